"""Shared test set-up: the ``operator`` marker and the worlds of the operator tests.

``OperatorWorld`` is the product's sandbox (``sdcguard.sandbox.cluster.Sandbox``: the Kubernetes
API emulator + the local SageMaker endpoint + the real operator run as a subprocess, ``sdcguard
operator``, with short kopf delays) plus what only tests do: plant keys, post alarm Events with
bad signatures.

One world serves every test that asks for ``world`` (session-scoped: admission on, the storm
guard raised so that the tests cannot hold each other back). Each of those tests uses its own
namespace, job and nodes (``start_training``) and asks the SageMaker endpoint only about its own
instances, so none needs a fresh world. They run last, one after another, wherever their module
is (``pytest_collection_modifyitems``): the shared operator then runs only while they do, and every
other world has been closed before it starts (kmock's emulators must stop last-in, first-out).
A test that needs other operator settings builds its own with ``make_world`` (one set per module).

The operator authenticates as its own service account (``OPERATOR_USER``); tests and kubectl as
``tester``. ``make_world(admission=True)`` also sends NodeReplacement writes through the
operator's own admission webhook, as the chart configures the API server to, with ``tester``
granted the ``approve`` verb. Alarm Events are signed with the job's key Secret, as the sidecar
signs them (``alarm_event``).
"""
from __future__ import annotations

import json
import re
import secrets
from typing import Any

import pytest

from sdcguard.sandbox.cluster import (ADMISSION_WEBHOOK, CLUSTER, GROUP, KUBECTL, OPERATOR_USER,  # noqa: F401
                                      Sandbox, free_port, new_instance)


class OperatorWorld(Sandbox):
    """The sandbox, with the helpers only tests need."""

    def plant_key(self, namespace: str, job: str, key: bytes | None = None) -> bytes:
        """A key Secret the operator did not write (e.g. left from when the job was still enabled)."""
        import base64

        key = key or secrets.token_bytes(32)
        self.core.create_namespaced_secret(namespace, {
            "metadata": {"name": f"sdcguard-alarm-key-{job}", "namespace": namespace}, "type": "Opaque",
            "data": {"key": base64.b64encode(key).decode()}})
        return key

    def with_uids(self, record: dict[str, Any]) -> dict[str, Any]:
        """The record as the library writes it in a pod of the job: ``job.uid`` from
        ``SDCGUARD_JOB_UID`` and each identity's ``pod_uid`` from ``POD_UID`` (the webhook injects
        both), i.e. the live job's and pods' uids; fields already set are kept."""
        job = record.get("job")
        if isinstance(job, dict) and job.get("name") and "uid" not in job:
            try:
                job["uid"] = self.job_uid(job.get("namespace"), job["name"])
            except Exception:  # noqa: BLE001 - no such job: the record names none
                pass
        for identity in list(record.get("suspects") or []) + [record.get("reporter")]:
            if isinstance(identity, dict) and identity.get("pod") and "pod_uid" not in identity and job:
                try:
                    identity["pod_uid"] = self.core.read_namespaced_pod(identity["pod"], job["namespace"]).metadata.uid
                except Exception:  # noqa: BLE001 - no such pod
                    pass
        return record

    def alarm_event(self, namespace: str, record: dict[str, Any] | None = None, *, raw: str | None = None,
                    involved_pod: str = "unknown", sign: bool = True, key: bytes | None = None,
                    signature: str | None = None, uids: bool = True, name: str | None = None) -> str:
        """Post an alarm Event the way the sidecar does (docs/design.md §4), signed with the named job's key
        (``key`` instead, ``signature`` as given, or unsigned with ``sign=False``); returns the
        Event's name. Text that names no job gets a well-formed signature no key makes. The record
        gets the live uids first (:meth:`with_uids`) unless ``uids=False``; ``name``: the Event's
        own name instead of a generated one."""
        from sdcguard.contract import alarm, events

        if record is not None and uids:
            record = self.with_uids(record)
        text = raw if raw is not None else alarm.dumps(record) if record is not None else None
        annotations = {} if text is None else {"sdcguard.dev/alarm": text}
        if text is not None and sign:
            if signature is None:
                try:
                    job = json.loads(text)["job"]
                except (ValueError, KeyError, TypeError):
                    job = None
                if key is None and isinstance(job, dict) and job.get("name"):
                    key = self.alarm_key(job.get("namespace") or namespace, job["name"])
                signature = events.alarm_signature(key, text) if key else "v1=" + "0" * 64
            annotations["sdcguard.dev/alarm-signature"] = signature
        if record is not None and (record.get("suspects") or [record.get("reporter")])[0]:
            involved_pod = ((record.get("suspects") or [record["reporter"]])[0].get("pod")) or involved_pod
        event = self.core.create_namespaced_event(namespace, {
            "metadata": {**({"name": name} if name else {"generateName": "sdcguard-alarm-"}), "namespace": namespace,
                         "annotations": annotations},
            "type": "Warning", "reason": "SilentDataCorruption", "message": "silent data corruption detected",
            "involvedObject": {"apiVersion": "v1", "kind": "Pod", "name": involved_pod, "namespace": namespace},
            "source": {"component": "sdcguard-agent"}})
        return event.metadata.name


def make_alarm(namespace: str, job: str, *, check: str = "replay", step: int = 40,
               suspects: list[tuple[int, str, str]] = (), reporter: tuple[int, str, str] | None = None,
               checkpoint: str | None = "checkpoint-19.pt", alarm_id: str | None = None,
               window: tuple[int, int] | None = None, job_uid: str | None = None, **recovery: Any) -> dict[str, Any]:
    """A v1 alarm record via the shared schema module; suspects/reporter are (rank, pod, node).

    ``window`` is the suspect window (default: the alarm step alone); ``recovery`` adds the optional
    fields of newer libraries (``last_good_checkpoint_step``, ``steps_at_risk``, ...)."""
    from sdcguard.contract import alarm

    identities = {rank: {"rank": rank, "pod": pod, "node": node} for rank, pod, node in suspects}
    reporter = reporter or (99, f"{job}-reporter", "hyperpod-i-00000000000000000")
    identities[reporter[0]] = {"rank": reporter[0], "pod": reporter[1], "node": reporter[2]}
    return alarm.make_alarm(
        alarm_id=alarm_id or secrets.token_hex(6), job={"kind": "PyTorchJob", "name": job, "namespace": namespace,
                                                         **({"uid": job_uid} if job_uid else {})},
        check=check, step=step, suspect_ranks=[r for r, _, _ in suspects], identities=identities,
        ambiguous=False, reporter_rank=reporter[0], evidence={"pairs": [[0, 2]]}, last_verified_step=step - 1,
        last_good_checkpoint=checkpoint,
        suspect_window={"first_step": (window or (step, step))[0], "last_step": (window or (step, step))[1]},
        **recovery)


def start_training(world: OperatorWorld, namespace: str, n_nodes: int = 3,
                   enabled: bool = True) -> tuple[list[str], list[str], list[str]]:
    """A training job ``llm`` with one pod on each of ``n_nodes`` fresh nodes: (instance ids, nodes, pods)."""
    ids = [new_instance() for _ in range(n_nodes)]
    nodes = [world.node(i) for i in ids]
    pods = world.training(namespace, "llm", nodes, enabled=enabled)
    return ids, nodes, pods


def approved_replacement(world: OperatorWorld, namespace: str, job: str, script: list[str],
                         step: int) -> tuple[str, str]:
    """One suspect node of a new two-node job, whose BatchReplaceClusterNodes answers follow
    ``script`` (each in flight for two polls); its replacement approved once PendingApproval.
    Returns (node, instance)."""
    ids = [new_instance() for _ in range(2)]
    nodes = [world.node(i) for i in ids]
    pods = world.training(namespace, job, nodes)
    world.aws.script(ids[1], replace=script, replace_polls=2)
    world.alarm_event(namespace, make_alarm(namespace, job, step=step, suspects=[(1, pods[1], nodes[1])],
                                            reporter=(0, pods[0], nodes[0])))
    world.wait(lambda: phase(world, nodes[1]) == "PendingApproval", what="PendingApproval")
    assert world.kubectl("sdcguard", "approve", nodes[1]).returncode == 0
    return nodes[1], ids[1]


def phase(world: OperatorWorld, replacement: str) -> str | None:
    """The NodeReplacement's phase (None before it has one)."""
    return (world.replacement(replacement).get("status") or {}).get("phase")


def condition(obj: dict[str, Any], type_: str) -> dict[str, Any] | None:
    """The object's status condition of that type, if any."""
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == type_), None)


def metric(world: OperatorWorld, sample: str) -> float:
    """One sample of the operator's /metrics (``name{labels}`` as exposed); 0 when absent."""
    found = re.search(rf"^{re.escape(sample)} (\S+)$", world.metrics(), re.M)
    return float(found.group(1)) if found else 0.0


def _close(worlds: list[OperatorWorld]) -> None:
    pruned = [path for world in worlds for path in world.kube.emulator.pruned]
    for world in reversed(worlds):  # kmock's resolver hooks nest: stop the emulators last-in, first-out
        world.close()
    # A real API server would have dropped these fields silently: the operator must write none.
    assert pruned == [], f"fields the CRD schemas do not declare (a real API server prunes them): {pruned}"


@pytest.fixture(scope="module")
def make_world(tmp_path_factory: pytest.TempPathFactory):
    """``make_world(**SDCGUARD_settings) -> OperatorWorld`` (operator started); all closed at module end."""
    worlds: list[OperatorWorld] = []

    def factory(start: bool = True, via_kopf: bool = False, admission: bool = False, **settings: str) -> OperatorWorld:
        world = OperatorWorld(tmp_path_factory.mktemp("world"), admission=admission, **settings)
        worlds.append(world)
        if start:
            world.start_operator(via_kopf=via_kopf)
        return world

    yield factory
    _close(worlds)


@pytest.fixture(scope="session")
def world(tmp_path_factory: pytest.TempPathFactory):
    """The shared world (see the module's docstring): NodeReplacement writes pass the operator's
    admission webhook, and up to 500 suspect nodes are held at once (a held node is never given back by many tests)."""
    shared = OperatorWorld(tmp_path_factory.mktemp("shared-world"), admission=True,
                           SDCGUARD_MAX_CONCURRENT_SUSPECT_NODES="500")
    shared.start_operator()
    yield shared
    _close([shared])


def _on_shared_world(item: pytest.Item) -> bool:
    """The test asks for the session's ``world``: not for a module's own fixture of that name, nor
    for a parameter called so (a world size)."""
    module, callspec = getattr(item, "module", None), getattr(item, "callspec", None)
    return "world" in getattr(item, "fixturenames", ()) and not hasattr(module, "world") \
        and "world" not in (callspec.params if callspec else {})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests on the shared world run last, together (in their collected order)."""
    shared = [item for item in items if _on_shared_world(item)]
    if shared:
        items[:] = [item for item in items if not _on_shared_world(item)] + shared


def dump(obj: Any) -> str:
    return json.dumps(obj, indent=1, default=str)
