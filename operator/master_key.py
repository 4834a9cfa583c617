"""The operator's master key, and everything derived from it (docs/design.md §9, the tenant boundary).

Each enabled job's alarm key is ``HMAC-SHA256(master, "alarm-key/v1\\0<namespace>\\0<job>\\0<uid>")``:
the operator *writes* the key Secret ``sdcguard-alarm-key-<job>`` into the job's namespace but never
reads a tenant Secret, and a key is bound to the job's uid, so a job recreated under the same name
(a new uid) gets a new key and every signature made under the old one stops verifying.

Seals (:func:`seal`) mark the objects the operator creates (SDCIncidents, NodeReplacements): an
HMAC over what identifies them, which nobody without the master key can write.

The master key is read once per process: from ``SDCGUARD_MASTER_KEY_FILE`` when set (a mounted
Secret), else from the Secret ``sdcguard-master-key`` in the operator's namespace, created with
32 random bytes on the first start (a replica racing to create it reads the winner's). Rotating it
(delete the Secret, restart the operator) rotates every job's key: the operator rewrites the key
Secrets on its next key check and the sidecars sign with the new key once the kubelet updates
their volume; alarms signed in between are refused (``BadSignature``), so rotate between jobs.
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import threading
from pathlib import Path

from sdcguard.contract import names

from . import kube
from .settings import Settings

_lock = threading.Lock()
_cached: dict[str, bytes] = {}


def master(settings: Settings) -> bytes:
    with _lock:
        if "key" not in _cached:
            _cached["key"] = _load(settings)
        return _cached["key"]


def _load(settings: Settings) -> bytes:
    if settings.master_key_file:
        key = Path(settings.master_key_file).read_bytes()
        if len(key) < names.ALARM_KEY_MIN_BYTES:
            raise ValueError(f"SDCGUARD_MASTER_KEY_FILE {settings.master_key_file}: fewer than "
                             f"{names.ALARM_KEY_MIN_BYTES} bytes")
        return key
    namespace = settings.pod_namespace or "default"
    core = kube.core()
    secret = kube.read_or_create(
        f"Secret {namespace}/{names.MASTER_KEY_SECRET}",
        lambda: core.read_namespaced_secret(names.MASTER_KEY_SECRET, namespace),
        lambda: core.create_namespaced_secret(namespace, {
            "metadata": {"name": names.MASTER_KEY_SECRET, "namespace": namespace,
                         "labels": {"app.kubernetes.io/managed-by": "sdcguard"}},
            "type": "Opaque", "data": {"key": base64.b64encode(secrets.token_bytes(32)).decode()}}))
    key = base64.b64decode((secret.data or {}).get("key") or "")
    if len(key) < names.ALARM_KEY_MIN_BYTES:
        raise ValueError(f"Secret {namespace}/{names.MASTER_KEY_SECRET} holds fewer than {names.ALARM_KEY_MIN_BYTES} bytes")
    return key


def _mac(settings: Settings, *parts: str) -> bytes:
    return hmac.new(master(settings), "\0".join(parts).encode(), hashlib.sha256).digest()


def job_key(settings: Settings, namespace: str, job: str, uid: str) -> bytes:
    """The alarm key of one job instance (namespace, name and uid)."""
    return _mac(settings, "alarm-key/v1", namespace, job, uid)


def seal(settings: Settings, kind: str, *parts: str) -> str:
    """``v1=<hex>``: the operator's mark on an object it created, over ``parts``."""
    return "v1=" + _mac(settings, "seal/v1", kind, *parts).hex()


def sealed(settings: Settings, value: str | None, kind: str, *parts: str) -> bool:
    return bool(value) and hmac.compare_digest(str(value), seal(settings, kind, *parts))
