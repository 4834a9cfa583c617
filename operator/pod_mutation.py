"""What the pod webhook does to a pod, as pure functions (no API, no kopf): :func:`mutated`.

The rules (docs/design.md §5, §9): only a pod whose controlling ownerReference is the live
enabled PyTorchJob gets the sidecar, the spool, the downward-API identity and the job's check
settings; every pod loses each reference to an alarm-key Secret outside the sidecar. The kopf
handler that looks the job up and applies the result is :mod:`.webhook`.
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from sdcguard.contract import names

from .signature_check import secret_name
from .validate import job_enabled

SETTINGS = names.ANNOTATION_SETTINGS  # annotation -> (environment variable, library default)
_ANNOTATION_PREFIX = f"{names.GROUP}/"
_DECIMAL = re.compile(r"^[0-9]+$")


@dataclass(frozen=True, kw_only=True)
class SidecarSettings:
    """How the injected sidecar looks; the chart sets these on the operator's environment."""

    image: str = "ghcr.io/sdcguard/sdcguard-agent:0.1.0"
    pull_policy: str = "IfNotPresent"
    metrics_port: int = names.SIDECAR_METRICS_PORT
    cpu_request: str = "10m"
    memory_request: str = "48Mi"
    memory_limit: str = "128Mi"
    job_controllers: tuple[str, ...] = ()
    """SDCGUARD_JOB_CONTROLLER_USERS: users allowed to create the pods that get the sidecar (the
    training operator's service account; the chart's default is Kubeflow's
    ``system:serviceaccount:kubeflow:training-operator``). Empty: no pod gets the sidecar, unless
    ``allow_any_job_controller`` says explicitly that the ownerReference alone decides."""
    allow_any_job_controller: bool = False
    """SDCGUARD_ALLOW_ANY_JOB_CONTROLLER: with no job controller configured, inject into any pod whose
    controlling ownerReference is the enabled job (an ownerReference can be forged by anyone who may
    create pods in the namespace and read the job's uid: the victim job's key goes with the sidecar)."""
    grace_seconds: int = 90
    """The pod's terminationGracePeriodSeconds is raised to at least this (never lowered): the
    training process waits up to 30 s for the sidecar to confirm an alarm, and the sidecar then
    keeps publishing through the rest of the grace period."""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "SidecarSettings":
        names = {"image": "SDCGUARD_SIDECAR_IMAGE", "pull_policy": "SDCGUARD_SIDECAR_PULL_POLICY",
                 "cpu_request": "SDCGUARD_SIDECAR_CPU_REQUEST", "memory_request": "SDCGUARD_SIDECAR_MEMORY_REQUEST",
                 "memory_limit": "SDCGUARD_SIDECAR_MEMORY_LIMIT"}
        values: dict[str, Any] = {k: env[v] for k, v in names.items() if env.get(v)}
        for key, var in (("metrics_port", "SDCGUARD_SIDECAR_METRICS_PORT"),
                         ("grace_seconds", "SDCGUARD_SIDECAR_GRACE_SECONDS")):
            if env.get(var):
                try:
                    values[key] = int(env[var])
                except ValueError:
                    raise ValueError(f"{var} must be an integer, got {env[var]!r}") from None
        if env.get("SDCGUARD_JOB_CONTROLLER_USERS"):
            values["job_controllers"] = tuple(u.strip() for u in env["SDCGUARD_JOB_CONTROLLER_USERS"].split(",")
                                              if u.strip())
        allow = str(env.get("SDCGUARD_ALLOW_ANY_JOB_CONTROLLER") or "false").strip().lower()
        if allow not in ("true", "false"):
            raise ValueError(f"SDCGUARD_ALLOW_ANY_JOB_CONTROLLER must be true or false, got "
                             f"{env['SDCGUARD_ALLOW_ANY_JOB_CONTROLLER']!r}")
        values["allow_any_job_controller"] = allow == "true"
        return cls(**values)


@dataclass(slots=True)
class Plan:
    """What an enabled pod gets: its job and the check settings as environment variables."""

    job_name: str
    job_kind: str = names.JOB_KIND
    job_uid: str = ""
    settings_env: dict[str, str] = field(default_factory=dict)


def plan(job_name: str, annotations: Mapping[str, str]) -> tuple[Plan | None, list[str]]:
    """Decide from the effective ``sdcguard.dev/*`` annotations; return (plan or None, warnings)."""
    warnings: list[str] = []
    enabled = str(annotations.get(names.ENABLED_ANNOTATION, "")).strip().lower()
    if not job_enabled(annotations):
        if enabled not in ("", "false"):
            warnings.append(f"sdcguard: {names.ENABLED_ANNOTATION}={annotations[names.ENABLED_ANNOTATION]!r} is "
                            "neither \"true\" nor \"false\"; sdcguard stays off for this pod")
        return None, warnings
    result = Plan(job_name=job_name)
    for key, (var, default) in SETTINGS.items():
        if key not in annotations:
            continue
        raw = str(annotations[key]).strip()
        if _DECIMAL.fullmatch(raw):
            result.settings_env[var] = str(int(raw))
        else:
            warnings.append(f"sdcguard: {key}={annotations[key]!r} is not an integer >= 0; "
                            f"using the default ({default})")
    return result, warnings


def inject(pod: dict[str, Any], *, how: Plan, sidecar: SidecarSettings) -> None:
    """Wire sdcguard into ``pod`` in place. Idempotent: every item is set by name, so a pod that
    already has it (or went through twice) ends up the same."""
    meta = pod.setdefault("metadata", {})
    meta.setdefault("labels", {})[names.INJECTED_LABEL] = "true"
    spec = pod.setdefault("spec", {})
    grace = max(int(spec.get("terminationGracePeriodSeconds") or 30), sidecar.grace_seconds)
    spec["terminationGracePeriodSeconds"] = grace
    volumes = spec.setdefault("volumes", [])
    if not any(v.get("name") == names.SPOOL_VOLUME for v in volumes):
        volumes.append({"name": names.SPOOL_VOLUME, "emptyDir": {}})
    key_volume = _key_volume(how)
    for i, volume in enumerate(volumes):
        if volume.get("name") == names.ALARM_KEY_VOLUME:
            volumes[i] = key_volume
            break
    else:
        volumes.append(key_volume)
    env = _env(how)
    for container in spec.get("containers", []):
        _ensure_mount(container)
        _set_env(container, env)
    for container in spec.get("containers", []) + [c for c in spec.get("initContainers", [])
                                                    if c.get("name") != names.SIDECAR_CONTAINER]:
        # Only the sidecar may read the key: never the training containers, whatever their spec says.
        if any(m.get("name") == names.ALARM_KEY_VOLUME for m in container.get("volumeMounts") or []):
            container["volumeMounts"] = [m for m in container["volumeMounts"] if m.get("name") != names.ALARM_KEY_VOLUME]
    inits = spec.setdefault("initContainers", [])
    wanted = _sidecar_container(sidecar, grace)
    for i, container in enumerate(inits):
        if container.get("name") == names.SIDECAR_CONTAINER:
            inits[i] = wanted
            break
    else:
        inits.insert(0, wanted)


def mutated(pod: Mapping[str, Any], job_annotations: Mapping[str, str] | None,
            sidecar: SidecarSettings, job_uid: str | None = None,
            creator: str | None = None) -> tuple[dict[str, Any] | None, list[str]]:
    """The pure whole: the mutated copy of ``pod`` (None: leave it alone) and the warnings.

    Every pod first loses each reference to an alarm-key Secret outside the sidecar
    (:func:`strip_key_references`). The sidecar goes only into a pod whose controlling
    ownerReference is the live PyTorchJob named by its job-name label (``job_uid``, read by the
    webhook; None when the job could not be read): no owner, another owner, or another uid, and the
    pod gets no sidecar and so no key (docs/design.md §9). With ``SidecarSettings.job_controllers`` set, the
    pod must also be created by one of those users (the training operator's service account, as
    the API server authenticated the request: ``creator``): an ownerReference can be written by
    anyone who may create pods and read the job's uid. With none configured the pod gets no sidecar
    unless ``SidecarSettings.allow_any_job_controller`` says so explicitly."""
    result = copy.deepcopy(dict(pod))
    warnings = strip_key_references(result)
    changed = result != pod
    job_name = ((pod.get("metadata") or {}).get("labels") or {}).get(names.JOB_NAME_LABEL)
    if not job_name:
        return (result if changed else None), warnings
    how, notes = plan(job_name, effective_annotations(pod, job_annotations))
    warnings += notes
    if how is not None and not owned_by(pod, job_name, job_uid):
        warnings.append(f"sdcguard: pod is not controlled by {names.JOB_KIND} {job_name}"
                        + (f" (uid {job_uid})" if job_uid else " (the job could not be read)")
                        + "; no sidecar: only the job's own pods may sign its alarms")
        how = None
    if how is not None and not sidecar.job_controllers and not sidecar.allow_any_job_controller:
        warnings.append("sdcguard: no job controller is configured (SDCGUARD_JOB_CONTROLLER_USERS, chart "
                        "webhook.jobControllerUsers) and SDCGUARD_ALLOW_ANY_JOB_CONTROLLER is not true; no sidecar: "
                        "an ownerReference alone can be forged by anyone who may create pods here")
        how = None
    if how is not None and sidecar.job_controllers and creator not in sidecar.job_controllers:
        warnings.append(f"sdcguard: pod created by {creator!r}, not by the job controller "
                        f"({', '.join(sidecar.job_controllers)}); no sidecar")
        how = None
    if how is None:
        return (result if changed else None), warnings
    how.job_uid = str(job_uid)
    inject(result, how=how, sidecar=sidecar)
    return result, warnings


def _key_secret(name: Any) -> bool:
    return isinstance(name, str) and name.startswith(names.ALARM_KEY_SECRET_PREFIX)


def strip_key_references(pod: dict[str, Any]) -> list[str]:
    """Remove, in place, every way a container other than the sidecar could read an alarm-key Secret
    (``sdcguard-alarm-key-*``, any job's): secret volumes and projected-volume sources of any volume
    name (with their mounts), ``env[].valueFrom.secretKeyRef`` and ``envFrom[].secretRef``. The
    sidecar's own key volume (:data:`names.ALARM_KEY_VOLUME`) is put back by :func:`inject`, mounted
    in the sidecar only. Returns a warning per removal."""
    spec = pod.get("spec") or {}
    warnings: list[str] = []
    removed: set[str] = set()
    kept = []
    for volume in spec.get("volumes") or []:
        name = volume.get("name")
        if _key_secret((volume.get("secret") or {}).get("secretName")):
            if name != names.ALARM_KEY_VOLUME:
                warnings.append(f"sdcguard: volume {name!r} mounted an alarm-key Secret; removed")
            removed.add(name)
            continue
        projected = volume.get("projected")
        if projected and any(_key_secret((src.get("secret") or {}).get("name")) for src in projected.get("sources") or []):
            sources = [src for src in projected.get("sources") or [] if not _key_secret((src.get("secret") or {}).get("name"))]
            warnings.append(f"sdcguard: projected volume {name!r} held an alarm-key Secret; that source removed")
            if not sources:
                removed.add(name)
                continue
            volume = {**volume, "projected": {**projected, "sources": sources}}
        kept.append(volume)
    if "volumes" in spec:
        spec["volumes"] = kept
    for container in (spec.get("containers") or []) + (spec.get("initContainers") or []) + \
            (spec.get("ephemeralContainers") or []):
        where = container.get("name")
        if container.get("volumeMounts") and any(m.get("name") in removed for m in container["volumeMounts"]):
            container["volumeMounts"] = [m for m in container["volumeMounts"] if m.get("name") not in removed]
        env = container.get("env") or []
        if any(_key_secret(((e.get("valueFrom") or {}).get("secretKeyRef") or {}).get("name")) for e in env):
            container["env"] = [e for e in env if not _key_secret(((e.get("valueFrom") or {}).get("secretKeyRef")
                                                                    or {}).get("name"))]
            warnings.append(f"sdcguard: container {where!r} read an alarm-key Secret into env; removed")
        env_from = container.get("envFrom") or []
        if any(_key_secret((e.get("secretRef") or {}).get("name")) for e in env_from):
            container["envFrom"] = [e for e in env_from if not _key_secret((e.get("secretRef") or {}).get("name"))]
            warnings.append(f"sdcguard: container {where!r} loaded an alarm-key Secret with envFrom; removed")
    return [w for w in warnings if w]


def ephemeral_key_references(pod: Mapping[str, Any], old: Mapping[str, Any] | None = None) -> list[str]:
    """Why each ephemeral container of ``pod`` not already in ``old`` may not be added: it mounts the
    alarm-key volume (:data:`names.ALARM_KEY_VOLUME`) or any volume of an alarm-key Secret (secret or
    projected source), or reads one through ``env`` / ``envFrom``. An ephemeral container is added
    through the ``pods/ephemeralcontainers`` subresource, after the pod was created (``kubectl debug``):
    the pod webhook's CREATE never sees it. Empty: nothing to refuse."""
    spec = pod.get("spec") or {}
    key_volumes = {names.ALARM_KEY_VOLUME}
    for volume in spec.get("volumes") or []:
        if _key_secret((volume.get("secret") or {}).get("secretName")) or any(
                _key_secret((src.get("secret") or {}).get("name"))
                for src in (volume.get("projected") or {}).get("sources") or []):
            key_volumes.add(volume.get("name"))
    before = {c.get("name") for c in ((old or {}).get("spec") or {}).get("ephemeralContainers") or []}
    problems = []
    for container in spec.get("ephemeralContainers") or []:
        where = container.get("name")
        if where in before:
            continue
        mounts = [m.get("name") for m in container.get("volumeMounts") or [] if m.get("name") in key_volumes]
        if mounts:
            problems.append(f"ephemeral container {where!r} mounts the alarm-key volume {mounts[0]!r}")
        if any(_key_secret(((e.get("valueFrom") or {}).get("secretKeyRef") or {}).get("name"))
               for e in container.get("env") or []):
            problems.append(f"ephemeral container {where!r} reads an alarm-key Secret into env")
        if any(_key_secret((e.get("secretRef") or {}).get("name")) for e in container.get("envFrom") or []):
            problems.append(f"ephemeral container {where!r} loads an alarm-key Secret with envFrom")
    return problems


def effective_annotations(pod: Mapping[str, Any], job_annotations: Mapping[str, str] | None) -> dict[str, str]:
    """The job's ``sdcguard.dev/*`` annotations overlaid by the pod's own (from its template)."""
    pod_annotations = (pod.get("metadata") or {}).get("annotations") or {}
    merged = {**(job_annotations or {}), **pod_annotations}
    return {k: v for k, v in merged.items() if k.startswith(_ANNOTATION_PREFIX)}


def owned_by(pod: Mapping[str, Any], job_name: str, job_uid: str | None) -> bool:
    """The pod's controlling ownerReference is the PyTorchJob ``job_name`` with uid ``job_uid``
    (other Kubeflow job kinds share the job-name label; a pod without a controller is no job's)."""
    owners = (pod.get("metadata") or {}).get("ownerReferences") or []
    controller = [o for o in owners if o.get("controller")]
    return bool(job_uid) and len(controller) == 1 and controller[0].get("kind") == names.JOB_KIND and \
        controller[0].get("apiVersion") == names.JOB_API_VERSION and controller[0].get("name") == job_name and \
        controller[0].get("uid") == job_uid


def _key_volume(how: Plan) -> dict[str, Any]:
    return {"name": names.ALARM_KEY_VOLUME, "secret": {"secretName": secret_name(how.job_name), "optional": True,
                                                         "defaultMode": 0o444}}


def _downward_api() -> list[dict[str, Any]]:
    fields = {**names.DOWNWARD_API, names.ENV_POD_UID: names.POD_UID_FIELD}
    return [{"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}} for name, path in fields.items()]


def _env(how: Plan) -> list[dict[str, Any]]:
    env = _downward_api()
    env += [{"name": names.ENV_SPOOL, "value": names.SPOOL_PATH},
            {"name": names.ENV_JOB_NAME, "value": how.job_name},
            {"name": names.ENV_JOB_KIND, "value": how.job_kind},
            {"name": names.ENV_JOB_UID, "value": how.job_uid}]
    env += [{"name": k, "value": v} for k, v in sorted(how.settings_env.items())]
    return env


def _set_env(container: dict[str, Any], env: list[dict[str, Any]]) -> None:
    current = container.setdefault("env", [])
    for item in env:
        for i, existing in enumerate(current):
            if existing.get("name") == item["name"]:
                current[i] = item
                break
        else:
            current.append(item)


def _ensure_mount(container: dict[str, Any]) -> None:
    mounts = container.setdefault("volumeMounts", [])
    if not any(m.get("name") == names.SPOOL_VOLUME for m in mounts):
        mounts.append({"name": names.SPOOL_VOLUME, "mountPath": names.SPOOL_PATH})


def _sidecar_container(s: SidecarSettings, grace: int) -> dict[str, Any]:
    return {
        "name": names.SIDECAR_CONTAINER,
        "image": s.image,
        "imagePullPolicy": s.pull_policy,
        "restartPolicy": "Always",
        "args": ["sidecar", "--spool", names.SPOOL_PATH, "--metrics-port", str(s.metrics_port),
                 "--key-file", names.ALARM_KEY_FILE, "--grace-period", str(grace)],
        "env": _downward_api() + [{"name": names.ENV_SPOOL, "value": names.SPOOL_PATH}],
        "ports": [{"name": names.SIDECAR_METRICS_PORT_NAME, "containerPort": s.metrics_port, "protocol": "TCP"}],
        "volumeMounts": [{"name": names.SPOOL_VOLUME, "mountPath": names.SPOOL_PATH},
                         {"name": names.ALARM_KEY_VOLUME, "mountPath": names.ALARM_KEY_MOUNT, "readOnly": True}],
        "resources": {"requests": {"cpu": s.cpu_request, "memory": s.memory_request},
                      "limits": {"memory": s.memory_limit}},
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": names.SIDECAR_METRICS_PORT_NAME},
                          "periodSeconds": 20, "failureThreshold": 3},
        # Fits the "restricted" Pod Security Standard, so enabling sdcguard never fails admission.
        "securityContext": {"runAsNonRoot": True, "allowPrivilegeEscalation": False,
                            "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]},
                            "seccompProfile": {"type": "RuntimeDefault"}},
    }
