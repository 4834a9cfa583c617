"""The sandbox's Kubernetes API: kmock's KubernetesEmulator, served over real HTTP on 127.0.0.1.

A SANDBOX, never a production path: no RBAC on ordinary requests, no TLS, no persistence, no
schema validation. It exists so that ``sdcguard sandbox`` / ``make demo`` can run the real operator,
sidecar, kubectl and ``kubectl sdcguard`` against something that answers like an API server, and
the test suite uses the same one (docs/design.md §8: real clients over HTTP; the server side is adapted).

Usage (any thread)::

    from sdcguard.sandbox.apiserver import start_emulator

    kube = start_emulator(workdir)                     # serves http://127.0.0.1:<port> in a thread
    kube.url                                           # "http://127.0.0.1:41234"
    kube.kubeconfig                                    # path of a kubeconfig for kubectl, kopf, clients
    kube.api_client()                                  # a kubernetes.client.ApiClient bound to it
    kube.stop()

or ``with start_emulator(workdir) as kube: ...``.  ``KUBECONFIG=kube.kubeconfig`` works for kubectl
and for subprocesses (kopf, the sidecar).  Objects must be created through the API (objects put
straight into the store emit no watch events).

Registered resources (``RESOURCES``): core ``v1`` events, pods, nodes, namespaces, configmaps,
secrets; ``kubeflow.org/v1`` pytorchjobs; ``sdcguard.dev/v1`` sdcincidents (namespaced) and
nodereplacements (cluster-scoped), both with the ``status`` subresource.

Fixed here, server-side, because kmock 0.8 lacks them (see ../shared/TOOLING.md):
``watch=True`` recognised; create answers 201; ``metadata.generateName`` honoured; ``uid`` and
``creationTimestamp`` assigned by the server (a client's own values are overwritten), ``kind``,
``apiVersion`` filled in; a new ``resourceVersion`` on every change,
and optimistic concurrency on it: a patch carrying a stale ``metadata.resourceVersion`` answers
409 Conflict (a JSON-patch ``test`` of a stale one answers 422, as kopf expects); core discovery says ``v1``;
lists carry ``kind``/``apiVersion``; watch streams are served as JSON lines; a strategic-merge patch
merges the lists the API gives a merge key (a node's or pod's ``status.conditions``, by ``type``:
``MERGE_KEYS``) instead of replacing them (kmock treats every patch as a merge patch).
Added: server-side printing (``kubectl get`` shows the printer columns of deploy/crds; printing.py);
equality field/label selectors on list and watch, as a real API server applies them; object requests
are served straight from the store (kmock's reaction matching costs time proportional to all past
requests, which a flood of Events turns into seconds per request), so kmock reactions do not
apply to them: to make the server refuse a request use ``kube.reject("POST", path, 422)``.
Added for sdcguard's approval model (server-side, like the API server's own parts):

- authentication by bearer token (``kube.add_user(token, username, groups)`` writes a kubeconfig
  for that user; the default kubeconfig's token ``emulator`` is user ``tester``). kubectl sends no
  token over plain HTTP, so these kubeconfigs also name their user in kubectl's impersonation
  fields (``as``, ``as-groups``), and an ``Impersonate-User`` / ``Impersonate-Group`` request is
  served as that user, as the API server presents impersonated requests to admission (whether
  impersonation is allowed is not checked: there is no RBAC here);
- ``authorization.k8s.io/v1`` ``subjectaccessreviews`` create, answered from a small policy set
  with ``kube.grant("user:alice" | "group:oncall", verb, "plural.group")``; every review asked is
  kept in ``kube.emulator.access_reviews``;
- admission webhooks, opt-in per resource (``kube.admit("group/version/plural", url, name)``):
  CREATE and UPDATE of the main resource (not subresources) are sent to ``url`` as an
  ``admission.k8s.io/v1`` AdmissionReview carrying the authenticated user, old and new object; a
  denial is answered as the API server does ("admission webhook "<name>" denied the request:
  ..."), an allowed JSONPatch is applied before the object is stored, and an unreachable webhook
  fails the request (``failurePolicy: Fail``, the default) or is skipped (``Ignore``).

Fault injection (``kube.inject(rate, users={...})``): a share of the requests of the named users
is answered 500 / 409 (writes only) / 429 or stalled for seconds, server-side, like an overloaded
API server (api_faults.py).
``coordination.k8s.io/v1`` leases are served (leader election).

Our CRDs' schemas are applied server-side as for a structural schema (crd_schema.py): unknown fields are pruned
(each one recorded in ``kube.emulator.pruned``, so tests can insist on none), nulls of
non-nullable fields dropped, wrong types and values outside an enum answered 422.

Still not emulated: set-based selectors, watching from a resourceVersion, PUT, RBAC on ordinary
requests, the CRDs' CEL rules and other schema keywords (formats, patterns, bounds, ``required``),
/status isolation (a status patch may change spec too).
"""
from __future__ import annotations

import asyncio
import base64
import copy
import datetime
import itertools
import json
import pathlib
import secrets
import threading
import uuid
from typing import Any, Callable

import aiohttp
import aiohttp.web
import attrs
import jsonpatch
import kmock
from kmock._internal import dicts, enums, rendering

from . import api_faults, crd_schema, printing
from .api_faults import Faults

ALL_VERBS = ("get", "list", "watch", "create", "update", "patch", "delete")

#: plural path -> (kind, namespaced, short names, subresources)
RESOURCES: dict[str, tuple[str, bool, tuple[str, ...], tuple[str, ...]]] = {
    "v1/events": ("Event", True, ("ev",), ()),
    "v1/pods": ("Pod", True, ("po",), ("status",)),
    "v1/nodes": ("Node", False, ("no",), ("status",)),
    "v1/namespaces": ("Namespace", False, ("ns",), ()),
    "v1/configmaps": ("ConfigMap", True, ("cm",), ()),
    "v1/secrets": ("Secret", True, (), ()),
    "kubeflow.org/v1/pytorchjobs": ("PyTorchJob", True, (), ("status",)),
    "sdcguard.dev/v1/sdcincidents": ("SDCIncident", True, ("sdci",), ("status",)),
    "sdcguard.dev/v1/nodereplacements": ("NodeReplacement", False, ("nrep",), ("status",)),
    "coordination.k8s.io/v1/leases": ("Lease", True, (), ()),
}


_FAST_ACTIONS = (enums.action.LIST, enums.action.FETCH, enums.action.CREATE, enums.action.UPDATE, enums.action.DELETE)


@attrs.define(kw_only=True)
class _DirectDispatch(kmock.KubernetesScaffold):
    """Serve object requests straight from the store, skipping kmock's reaction matching.

    kmock matches every request against views that re-scan all past requests, so each request
    costs time proportional to the traffic so far; a flood of Events then slows everything down.
    Placed after KubernetesEmulator in the MRO, so the emulator's own state handling still runs.
    """

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        if request.resource is not None and request.resource.plural and request.action in _FAST_ACTIONS \
                and request.subresource in (None, "status"):
            serve = {enums.action.LIST: self._serve_list, enums.action.FETCH: self._serve_fetch,
                     enums.action.CREATE: self._serve_create, enums.action.UPDATE: self._serve_update,
                     enums.action.DELETE: self._serve_delete}[request.action]
            payload = await serve(request)
            columns = printing.PRINTER_COLUMNS.get(str(request.resource.plural))
            if columns and request.action in (enums.action.LIST, enums.action.FETCH) \
                    and "as=Table" in request.headers.get("Accept", ""):
                payload = printing.table(payload, columns)
            return aiohttp.web.json_response(payload)
        return await super()._handle(request)




SAR_PATH = "/apis/authorization.k8s.io/v1/subjectaccessreviews"
DEFAULT_TOKEN = "emulator"
DEFAULT_USER = {"username": "tester", "uid": "7e57e700-0000-4000-8000-000000000001",
                "groups": ["system:authenticated"]}
ANONYMOUS = {"username": "system:anonymous", "groups": ["system:unauthenticated"]}


def _path(resource: Any) -> str:
    """"group/version/plural" (core: "version/plural"), as RESOURCES spells it."""
    return "/".join(p for p in (resource.group, resource.version, resource.plural) if p)


def _status(code: int, reason: str, message: str) -> aiohttp.web.Response:
    return aiohttp.web.json_response({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                                      "code": code, "reason": reason, "message": message}, status=code)


@attrs.define(kw_only=True)
class FixedKubernetesEmulator(kmock.KubernetesEmulator, _DirectDispatch):
    """kmock's emulator with the gaps that break kopf, the official client and kubectl closed."""

    _versions: Any = attrs.field(factory=lambda: itertools.count(1), init=False)
    rejections: dict[tuple[str, str], int] = attrs.field(factory=dict, init=False)
    """(METHOD, path) -> HTTP status to answer with instead of serving: a server that refuses a
    request (e.g. 422 for an invalid object). Set it through ``RunningEmulator.reject``."""
    rejections_left: dict[tuple[str, str], int] = attrs.field(factory=dict, init=False)
    """(METHOD, path) -> how many more requests the rejection answers (absent: all of them)."""
    users: dict[str, dict[str, Any]] = attrs.field(factory=lambda: {DEFAULT_TOKEN: dict(DEFAULT_USER)}, init=False)
    """bearer token -> userInfo (username, uid, groups) as an authenticator would report it."""
    grants: set[tuple[str, str, str, str]] = attrs.field(factory=set, init=False)
    """(subject, verb, group, plural): what SubjectAccessReviews allow; subject ``user:X`` or ``group:X``."""
    access_reviews: list[dict[str, Any]] = attrs.field(factory=list, init=False)
    webhooks: dict[str, tuple[str, str, str]] = attrs.field(factory=dict, init=False)
    """"group/version/plural" -> (webhook name, URL, failurePolicy "Fail" or "Ignore") of a mutating
    admission webhook."""
    admission_reviews: list[dict[str, Any]] = attrs.field(factory=list, init=False)
    faults: Faults = attrs.field(factory=Faults, init=False)
    """Server-side fault injection (``RunningEmulator.inject``)."""
    pruned: list[str] = attrs.field(factory=list, init=False)
    """"plural/name: path" of every field a write carried that the CRD's schema does not declare,
    dropped as the API server prunes unknown fields of a structural schema."""
    conflicts: int = attrs.field(default=0, init=False)
    """How many writes were refused with 409 for a stale ``metadata.resourceVersion`` (not injected)."""
    _writes: asyncio.Lock = attrs.field(factory=asyncio.Lock, init=False)

    def user_of(self, request: rendering.Request) -> dict[str, Any]:
        headers = {k.lower(): v for k, v in request.headers.items()}
        raw = getattr(request._raw_request, "headers", None)
        groups = raw.getall("Impersonate-Group", []) if raw is not None else []
        if headers.get("impersonate-user"):
            return {"username": headers["impersonate-user"], "groups": list(groups) + ["system:authenticated"]}
        header = headers.get("authorization", "")
        token = header[7:].strip() if header.lower().startswith("bearer ") else None
        return copy.deepcopy(self.users.get(token, ANONYMOUS) if token else ANONYMOUS)

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        fault = self.faults.pick(self.user_of(request)["username"], write=str(request.method.value).upper() in (
            "POST", "PUT", "PATCH", "DELETE")) if self.faults.rate else None
        if isinstance(fault, float):
            await asyncio.sleep(fault)
        elif isinstance(fault, int):
            return _status(fault, api_faults.REASONS.get(fault, "InternalError"), f"injected ({fault})")
        if request.resource is not None and request.action in (enums.action.CREATE, enums.action.UPDATE,
                                                               enums.action.DELETE) \
                and request.params.get("watch") not in ("True", "1", "true") and request.url.path != SAR_PATH:
            async with self._writes:  # a precondition check and the write it guards are one step
                return await self._handle_one(request)
        return await self._handle_one(request)

    async def _handle_one(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        key = (str(request.method.value).upper(), request.url.path)
        refused = self.rejections.get(key)
        if refused is not None and key in self.rejections_left:
            self.rejections_left[key] -= 1
            if self.rejections_left[key] <= 0:
                del self.rejections[key], self.rejections_left[key]
        if refused is not None:
            return aiohttp.web.json_response(
                {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": refused,
                 "reason": "Invalid", "message": "rejected (injected)"}, status=refused)
        if request.url.path == SAR_PATH and str(request.method.value).upper() == "POST":
            return self._review_access(request)
        if request.action == enums.action.UPDATE and request.resource is not None:
            self._precondition(request)
            self._strategic(request)
        if request.resource is not None and request.subresource is None and \
                request.action in (enums.action.CREATE, enums.action.UPDATE) and \
                str(request.resource.plural) in ("configmaps", "secrets") and not request.resource.group:
            invalid = self._config_limits(request)
            if invalid is not None:
                return invalid
        if request.resource is not None and request.subresource is None and \
                request.action in (enums.action.CREATE, enums.action.UPDATE) and \
                _path(request.resource) in self.webhooks:
            denied = await self._admit(request)
            if denied is not None:
                return denied
        if request.resource is not None and request.action in (enums.action.CREATE, enums.action.UPDATE) \
                and str(request.resource.plural) in crd_schema.SCHEMAS:
            invalid = self._structural(request)
            if invalid is not None:
                return invalid
        if request.resource is not None and request.params.get("watch") in ("True", "1", "true"):
            return await self._stream_watch(request)
        if request.action == enums.action.CREATE and isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {})
            info = self.resources.get(request.resource)
            if info is not None and info.kind:
                group, version = request.resource.group, request.resource.version
                request.data.setdefault("kind", info.kind)
                request.data.setdefault("apiVersion", f"{group}/{version}" if group else version)
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = meta["generateName"] + secrets.token_hex(5)
            meta["uid"] = str(uuid.uuid4())  # the server's, never the client's (as the API server does)
            meta["creationTimestamp"] = _now()
            meta["resourceVersion"] = str(next(self._versions))
            if request.namespace and not meta.get("namespace"):
                meta["namespace"] = request.namespace
        elif request.action == enums.action.UPDATE and request.resource is not None:
            self._bump_version(request)
        response = await super()._handle(request)
        if request.action == enums.action.CREATE and response.status == 200 and not response.prepared:
            response.set_status(201)
        return response

    def _review_access(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        """A SubjectAccessReview, answered from ``grants``."""
        review = request.data if isinstance(request.data, dict) else {}
        spec = review.get("spec") or {}
        wanted = spec.get("resourceAttributes") or {}
        subjects = {f"user:{spec.get('user')}"} | {f"group:{g}" for g in spec.get("groups") or []}
        allowed = any(subject in subjects and (verb, group, plural) == (
            wanted.get("verb"), wanted.get("group", ""), wanted.get("resource")) for subject, verb, group, plural
            in self.grants)
        answer = {**review, "apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
                  "metadata": {"creationTimestamp": None},
                  "status": {"allowed": allowed, "reason": "granted by the sandbox policy" if allowed else ""}}
        self.access_reviews.append(answer)
        return aiohttp.web.json_response(answer, status=201)

    async def _admit(self, request: rendering.Request) -> aiohttp.web.StreamResponse | None:
        """Call the resource's admission webhook as the API server would; None: go on and store."""
        assert request.resource is not None
        webhook_name, url, policy = self.webhooks[_path(request.resource)]
        info = self.resources.get(request.resource)
        key = (request.resource, request.namespace, request.name)
        old = None
        if request.action == enums.action.UPDATE:
            stored = self._objects._objects.get(key)
            if stored is None or stored.deleted:
                return None  # the ordinary 404
            old = copy.deepcopy(dict(stored.raw))
            try:
                new = copy.deepcopy(dict(dicts.patch_dict(old, request.data)))
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
                return _status(422, "Invalid", f"the patch does not apply: {exc}")
        else:
            new = copy.deepcopy(request.data)
            if request.namespace and isinstance(new, dict):
                # as the API server does before admission (EnsureObjectNamespaceMatchesRequestNamespace)
                new.setdefault("metadata", {}).setdefault("namespace", request.namespace)
        group, version, plural = request.resource.group, request.resource.version, request.resource.plural
        gvk = {"group": group, "version": version, "kind": info.kind if info else ""}
        gvr = {"group": group, "version": version, "resource": plural}
        review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
            "uid": str(uuid.uuid4()), "kind": gvk, "resource": gvr, "requestKind": gvk, "requestResource": gvr,
            "name": request.name or (new.get("metadata") or {}).get("name"), "operation": (
                "CREATE" if request.action == enums.action.CREATE else "UPDATE"),
            "userInfo": self.user_of(request), "object": new, "oldObject": old,
            "dryRun": bool(request.params.get("dryRun")),
            "options": {"apiVersion": "meta.k8s.io/v1",
                        "kind": "CreateOptions" if request.action == enums.action.CREATE else "UpdateOptions"}}}
        if request.namespace:
            review["request"]["namespace"] = request.namespace
        self.admission_reviews.append(review)
        try:
            async with aiohttp.ClientSession() as session:
                async with session.post(url, json=review, timeout=aiohttp.ClientTimeout(total=10)) as answer:
                    response = (await answer.json())["response"]
        except Exception as exc:  # noqa: BLE001 — the webhook's failurePolicy decides
            if policy == "Ignore":
                return None
            return _status(500, "InternalError", f'Internal error occurred: failed calling webhook "{webhook_name}": '
                           f"{type(exc).__name__}: {exc}")
        if not response.get("allowed"):
            status = response.get("status") or {}
            code = int(status.get("code") or 403)
            return _status(code, "Forbidden" if code == 403 else "Invalid",
                           f'admission webhook "{webhook_name}" denied the request: {status.get("message", "")}')
        final = new
        if response.get("patch"):
            final = jsonpatch.apply_patch(new, json.loads(base64.b64decode(response["patch"])))
        if request.action == enums.action.CREATE:
            request.data.clear()
            request.data.update(final)
        else:  # store exactly what was admitted
            object.__setattr__(request, "data", jsonpatch.make_patch(old, final).patch)
        return None

    def _config_limits(self, request: rendering.Request) -> aiohttp.web.StreamResponse | None:
        """ConfigMaps and Secrets as the API server validates them: an ``immutable: true`` one keeps
        its data (and stays immutable): an update that changes either answers 422; data beyond
        1 MiB (``MaxSecretSize`` / the ConfigMap limit) answers 422."""
        assert request.resource is not None
        kind = "ConfigMap" if str(request.resource.plural) == "configmaps" else "Secret"
        before_after = self._before_after(request)
        if before_after is None:
            return None
        old, new = before_after
        name = request.name or (new.get("metadata") or {}).get("name")
        if old is not None and old.get("immutable") is True:
            fields = ("data", "binaryData", "stringData") if kind == "Secret" else ("data", "binaryData")
            if new.get("immutable") is not True or any(new.get(f) != old.get(f) for f in fields):
                return _status(422, "Invalid", f'{kind} "{name}" is invalid: data: Forbidden: field is immutable '
                               "when `immutable` is set")
        size = sum(len(str(k)) + len(str(v)) for f in ("data", "binaryData", "stringData")
                   for k, v in (new.get(f) or {}).items())
        if size > 1024 * 1024:
            return _status(422, "Invalid", f'{kind} "{name}" is invalid: []: Too long: must have at most '
                           "1048576 bytes")
        return None

    def _before_after(self, request: rendering.Request) -> tuple[dict[str, Any] | None, dict[str, Any]] | None:
        """(the stored object or None for a create, the object the request would leave), copies
        both; None where kmock answers itself (a 404, a patch it cannot apply: 422)."""
        if request.action == enums.action.CREATE:
            return None, copy.deepcopy(request.data) if isinstance(request.data, dict) else {}
        stored = self._objects._objects.get((request.resource, request.namespace, request.name))
        if stored is None or stored.deleted:
            return None
        old = copy.deepcopy(dict(stored.raw))
        try:
            return old, copy.deepcopy(dict(dicts.patch_dict(copy.deepcopy(old), request.data)))
        except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException, TypeError, ValueError):
            return None

    def _structural(self, request: rendering.Request) -> aiohttp.web.StreamResponse | None:
        """Prune and validate a custom resource against its CRD's schema, as the API server does
        for a structural schema: unknown fields are dropped (recorded in ``pruned``), nulls of
        non-nullable fields too, and a wrong type or a value outside an enum answers 422."""
        assert request.resource is not None
        plural = str(request.resource.plural)
        before_after = self._before_after(request)
        if before_after is None:
            return None
        old, new = before_after
        name = request.name or (new.get("metadata") or {}).get("name")
        errors: list[str] = []
        dropped: list[str] = []
        final = crd_schema.prune(new, crd_schema.SCHEMAS[plural], "", dropped, errors, root=True)
        if errors:
            info = self.resources.get(request.resource)
            return _status(422, "Invalid", f'{info.kind if info else plural}.{request.resource.group} "{name}" is '
                           f"invalid: {'; '.join(errors)}")
        self.pruned.extend(f"{plural}/{name}: {path}" for path in dropped)
        if final == new:
            return None
        if request.action == enums.action.CREATE:
            request.data.clear()
            request.data.update(final)
        else:  # what is stored is the pruned object; a JSON patch keeps its preconditions
            tests = [op for op in request.data if op.get("op") == "test"] if isinstance(request.data, list) else []
            object.__setattr__(request, "data", tests + jsonpatch.make_patch(old, final).patch)
        return None

    def _bump_version(self, request: rendering.Request) -> None:
        """A new resourceVersion per change.  Optimistic concurrency as the API server does it: a
        merge/strategic patch carrying ``metadata.resourceVersion`` is refused with 409 Conflict
        unless that is the stored version; a JSON-patch ``test`` of a stale one answers 422 (kopf
        relies on it)."""
        key = (request.resource, request.namespace, request.name)
        stored = self._objects._objects.get(key)
        current = (stored.raw.get("metadata") or {}).get("resourceVersion") if stored is not None \
            and not stored.deleted else None
        version = str(next(self._versions))
        if isinstance(request.data, dict):
            request.data.setdefault("metadata", {})["resourceVersion"] = version
        elif isinstance(request.data, list):
            for op in request.data:
                if op.get("op") == "test" and op.get("path") == "/metadata/resourceVersion" and op.get("value") != current:
                    raise kmock.KubernetesError(status=422, reason="Invalid",
                                                message=f"resourceVersion {op.get('value')} is stale ({current})")
            request.data.append({"op": "add", "path": "/metadata/resourceVersion", "value": version})

    def _strategic(self, request: rendering.Request) -> None:
        """A strategic-merge patch (what the official client sends for a dict body, and what kubelet
        and node-problem-detector send for node conditions) as the API server applies it: the lists
        of ``MERGE_KEYS`` merge by key, the rest as a merge patch. Stored as the equivalent JSON patch."""
        assert request.resource is not None
        keys = MERGE_KEYS.get(str(request.resource.plural))
        content = {k.lower(): v for k, v in request.headers.items()}.get("content-type", "")
        if keys is None or not isinstance(request.data, dict) or "strategic-merge-patch" not in content:
            return
        stored = self._objects._objects.get((request.resource, request.namespace, request.name))
        if stored is None or stored.deleted:
            return
        old = copy.deepcopy(dict(stored.raw))
        patch = {k: v for k, v in request.data.items() if k != "metadata" or set(v or {}) - {"resourceVersion"}}
        object.__setattr__(request, "data", jsonpatch.make_patch(old, strategic_merge(old, patch, keys)).patch)

    def _precondition(self, request: rendering.Request) -> None:
        """409 Conflict for a patch whose ``metadata.resourceVersion`` is not the stored one
        (checked before admission, which may rewrite the patch)."""
        if not isinstance(request.data, dict):
            return
        wanted = (request.data.get("metadata") or {}).get("resourceVersion")
        stored = self._objects._objects.get((request.resource, request.namespace, request.name))
        if wanted is None or stored is None or stored.deleted:
            return
        if str(wanted) != (stored.raw.get("metadata") or {}).get("resourceVersion"):
            self.conflicts += 1
            raise kmock.KubernetesError(status=409, reason="Conflict", message=(
                f'Operation cannot be fulfilled on {request.resource.plural} "{request.name}": the object has '
                "been modified; please apply your changes to the latest version and try again"))

    async def _stream_watch(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        """Serve a watch as newline-delimited JSON (kubectl -w refuses octet-stream)."""
        if not any(res == request.resource for res in self._get_resources()):
            raise kmock.KubernetesResourceNotFoundError()
        assert request._raw_request is not None
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request._raw_request)
        try:
            selected = _selector(request)
            async for event in self._serve_watch(request):
                if isinstance(event, dict) and selected(event.get("object") or {}):
                    await response.write(json.dumps(event).encode() + b"\n")
            await response.write_eof()
        except (ConnectionError, asyncio.CancelledError):
            pass
        return response

    # Object look-ups by key: kmock's own scan all objects of all resources on every request.
    def _stored(self, request: rendering.Request, namespace: str | None = None, name: str | None = None) -> Any:
        key = (request.resource, namespace or request.namespace, name or request.name)
        return self._objects._objects.get(key)

    async def _serve_fetch(self, request: rendering.Request) -> rendering.Payload:
        obj = self._stored(request)
        if obj is None or obj.deleted:
            raise kmock.KubernetesObjectNotFoundError()
        return obj.raw

    async def _serve_create(self, request: rendering.Request) -> rendering.Payload:
        meta = request.data.get("metadata", {})
        return self._stored(request, meta.get("namespace"), meta.get("name")).raw

    async def _serve_update(self, request: rendering.Request) -> rendering.Payload:
        return self._stored(request).last.raw

    async def _serve_delete(self, request: rendering.Request) -> rendering.Payload:
        return self._stored(request).last.raw

    async def _serve_version(self, request: rendering.Request) -> rendering.Payload:
        payload = await super()._serve_version(request)
        payload["groupVersion"] = payload["groupVersion"].lstrip("/")
        return payload

    async def _serve_list(self, request: rendering.Request) -> rendering.Payload:
        assert request.resource is not None
        if not any(res == request.resource for res in self._get_resources()):
            raise kmock.KubernetesResourceNotFoundError()
        wanted = (request.resource.group, request.resource.version, request.resource.plural)
        payload: dict[str, Any] = {"items": [
            obj.raw for (res, namespace, _), obj in list(self._objects._objects.items())
            if (res.group, res.version, res.plural) == wanted and not obj.deleted
            and (request.namespace is None or namespace == request.namespace)]}
        info = self.resources.get(request.resource)
        kind = info.kind if info is not None and info.kind else "List"
        group, version = request.resource.group, request.resource.version
        selected = _selector(request)
        payload["items"] = [item for item in payload["items"] if selected(item)]
        payload["kind"] = f"{kind}List"
        payload["apiVersion"] = f"{group}/{version}" if group else version
        payload["metadata"] = {"resourceVersion": str(next(self._versions))}
        return payload


def _selector(request: rendering.Request) -> Callable[[dict[str, Any]], bool]:
    """Equality-based ``fieldSelector`` / ``labelSelector`` (``a=b``, ``a==b``, ``a!=b``, ``key``)."""
    terms: list[tuple[Callable[[dict[str, Any]], Any], str, str | None]] = []
    for param, getter in (("fieldSelector", _field), ("labelSelector", _label)):
        for term in filter(None, (request.params.get(param) or "").split(",")):
            key, op, value = (term.partition("!=") if "!=" in term else
                              term.replace("==", "=").partition("=") if "=" in term else (term, "exists", None))
            terms.append((lambda obj, g=getter, k=key.strip(): g(obj, k), op, value))
    return lambda obj: all((get(obj) is not None) if op == "exists" else
                           ((str(get(obj) or "") == value) == (op == "=")) for get, op, value in terms)


def _field(obj: dict[str, Any], path: str) -> Any:
    for part in path.split("."):
        obj = obj.get(part) if isinstance(obj, dict) else None
    return obj


def _label(obj: dict[str, Any], key: str) -> Any:
    return ((obj.get("metadata") or {}).get("labels") or {}).get(key)


MERGE_KEYS: dict[str, dict[tuple[str, ...], str]] = {
    "nodes": {("status", "conditions"): "type"},
    "pods": {("status", "conditions"): "type"},
}
"""plural -> (path of a list -> its ``patchMergeKey``), as the core API's types declare them."""


def strategic_merge(target: Any, patch: Any, keys: dict[tuple[str, ...], str], path: tuple[str, ...] = ()) -> Any:
    """``patch`` applied to ``target`` as a strategic merge: a merge patch, except that a list at a
    path of ``keys`` merges element by element on that key (``$patch`` directives are not emulated)."""
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        here = (*path, key)
        if value is None:
            result.pop(key, None)
        elif here in keys and isinstance(value, list):
            merged = [dict(e) for e in result.get(key) or [] if isinstance(e, dict)]
            for item in value:
                at = next((i for i, e in enumerate(merged) if e.get(keys[here]) == item.get(keys[here])), None)
                if at is None:
                    merged.append(item)
                else:
                    merged[at] = strategic_merge(merged[at], item, {})
            result[key] = merged
        else:
            result[key] = strategic_merge(result.get(key), value, keys, here)
    return result


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def make_emulator() -> FixedKubernetesEmulator:
    """An emulator with ``RESOURCES`` declared (not yet served)."""
    emulator = FixedKubernetesEmulator()
    for path, (kind, namespaced, short, subresources) in RESOURCES.items():
        emulator.resources[path] = kmock.ResourceInfo(
            kind=kind, namespaced=namespaced, singular=kind.lower(), verbs=ALL_VERBS,
            shortnames=short, subresources=subresources,
        )
    return emulator


class RunningEmulator:
    """An emulator served on 127.0.0.1 from a background thread with its own event loop."""

    def __init__(self, workdir: pathlib.Path | str) -> None:
        self.emulator = make_emulator()
        self.kubeconfig = pathlib.Path(workdir) / "kubeconfig"
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._stopping: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kube-emulator", daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the Kubernetes emulator did not start")
        write_kubeconfig(self.kubeconfig, self.url)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        self._stopping = asyncio.Event()
        async with self.emulator, kmock.Server(self.emulator) as server:
            self.url = str(server.url).rstrip("/")
            self._ready.set()
            await self._stopping.wait()

    def reject(self, method: str, path: str, status: int, times: int | None = None) -> None:
        """Answer ``status`` to every ``METHOD path`` request from now on (server-side), or to the
        next ``times`` of them only."""
        key = (method.upper(), path)
        if times is not None and times <= 0:
            self.emulator.rejections.pop(key, None)
            self.emulator.rejections_left.pop(key, None)
            return
        self.emulator.rejections[key] = status
        if times is None:
            self.emulator.rejections_left.pop(key, None)
        else:
            self.emulator.rejections_left[key] = times

    def inject(self, rate: float, users: set[str] | None = None, seed: int | None = None, **options: Any) -> Faults:
        """Inject API faults (500/409/429 answers, stalls) into a share ``rate`` of the requests of
        ``users`` from now on; ``inject(0)`` stops.  Returns the ``Faults`` (with its counts)."""
        faults = self.emulator.faults
        faults.rate = rate
        if users is not None:
            faults.users = set(users)
        if seed is not None:
            faults.seed, faults._rng = seed, None
        for name, value in options.items():
            setattr(faults, name, value)
        return faults

    def add_user(self, token: str, username: str, groups: list[str] | None = None) -> pathlib.Path:
        """Authenticate ``token`` as ``username``; returns a kubeconfig for that user."""
        self.emulator.users[token] = {"username": username, "uid": str(uuid.uuid4()),
                                      "groups": list(groups or []) + ["system:authenticated"]}
        return write_kubeconfig(self.kubeconfig.with_name(f"kubeconfig-{token}"), self.url, token=token,
                                username=username, groups=groups)

    def grant(self, subject: str, verb: str, resource: str) -> None:
        """Let SubjectAccessReviews allow ``verb`` on ``resource`` ("plural.group") to ``subject``
        ("user:NAME" or "group:NAME")."""
        plural, _, group = resource.partition(".")
        self.emulator.grants.add((subject, verb, group, plural))

    def admit(self, resource: str, url: str | None, name: str = "webhook.test", failure_policy: str = "Fail") -> None:
        """Send CREATE/UPDATE of ``resource`` ("group/version/plural") to the admission webhook at
        ``url`` from now on; ``url=None``: no webhook (as if its configuration were removed).
        ``failure_policy``: an unreachable webhook fails the request ("Fail") or is skipped ("Ignore")."""
        if url is None:
            self.emulator.webhooks.pop(resource, None)
        else:
            self.emulator.webhooks[resource] = (name, url, failure_policy)

    def api_client(self) -> Any:
        """A ``kubernetes.client.ApiClient`` for this emulator (the client's global config is untouched)."""
        import kubernetes

        configuration = kubernetes.client.Configuration()
        configuration.host = self.url
        configuration.api_key = {"authorization": f"Bearer {DEFAULT_TOKEN}"}  # user "tester"
        return kubernetes.client.ApiClient(configuration)

    def request_count(self) -> int:
        """How many HTTP requests the emulator has served so far."""
        return len(self.emulator._requests)

    def stop(self) -> None:
        if self._stopping is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stopping.set)
            self._thread.join(10)

    def __enter__(self) -> "RunningEmulator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_emulator(workdir: pathlib.Path | str) -> RunningEmulator:
    """Start an emulator on a free port; its kubeconfig is written to ``workdir/kubeconfig``."""
    return RunningEmulator(workdir)


def write_kubeconfig(path: pathlib.Path | str, url: str, token: str = DEFAULT_TOKEN,
                     username: str = DEFAULT_USER["username"], groups: list[str] | None = None) -> pathlib.Path:
    """A kubeconfig with one context, ``emulator``, pointing at ``url`` (plain HTTP): a bearer
    token for clients that send one, and the user's name for kubectl, which does not."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "emulator", "cluster": {"server": url}}],
        "users": [{"name": "tester", "user": {"token": token, "as": username,
                                              **({"as-groups": list(groups)} if groups else {})}}],
        "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "tester",
                                                      "namespace": "default"}}],
        "current-context": "emulator",
    }
    path = pathlib.Path(path)
    path.write_text(json.dumps(config, indent=1))
    return path
