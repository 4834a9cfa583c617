"""The resume record, schema ``sdcguard.dev/resume/v1``: which checkpoint a run started from.

When a run starts from a checkpoint (``Guard.load_checkpoint`` or a framework adapter's load), the
library leaves one of these in the spool; the sidecar publishes it, signed with the job's key, as
a ``SilentDataCorruption`` Event of type Normal (:func:`sdcguard.contract.events.build_resume_event`);
the operator records it on the job's open incidents (``status.resumed``): the incident then says
which checkpoint the run actually resumed from, not only the one the alarm named. The library
cannot know whether an incident preceded the resume (its spool went with the suspended job's
pods), so every resume of a job inside Kubernetes is reported; the operator ignores those that
follow no incident. Standard library only.
"""
from __future__ import annotations

import json
import re
from typing import Any, Mapping

from . import alarm as _alarm

SCHEMA = "sdcguard.dev/resume/v1"
REQUIRED_FIELDS = ("schema", "id", "time", "job", "reporter", "checkpoint")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class ResumeError(ValueError):
    """A record that does not follow the schema; the message says which field and why."""


def make_resume(*, resume_id: str, job: Mapping[str, str], reporter: Mapping[str, Any], path: str, step: int,
                sha256: str | None) -> dict[str, Any]:
    """Build and validate a record: the job (``kind, name, namespace, uid``), the rank that wrote
    it (``{rank, pod, node, pod_uid}``) and the checkpoint (path, manifest step, sha256)."""
    record = {"schema": SCHEMA, "id": resume_id, "time": _alarm.now_rfc3339(), "job": dict(job),
              "reporter": {k: reporter.get(k) for k in ("rank", "pod", "node", "pod_uid")},
              "checkpoint": {"path": str(path), "step": step, "sha256": sha256}}
    return validate(record)


def validate(record: Any) -> dict[str, Any]:
    """Raise :class:`ResumeError` unless ``record`` is a well-formed v1 resume record; return it."""
    if not isinstance(record, dict):
        raise ResumeError("resume record must be a JSON object")
    missing = [f for f in REQUIRED_FIELDS if f not in record]
    if missing:
        raise ResumeError(f"resume record lacks required fields: {', '.join(missing)}")
    if record["schema"] != SCHEMA:
        raise ResumeError(f"unsupported resume schema {record['schema']!r} (expected {SCHEMA!r})")
    if not isinstance(record["id"], str) or not record["id"]:
        raise ResumeError("id must be a non-empty string")
    try:
        _alarm.rfc3339_seconds(record["time"])
    except (TypeError, ValueError, AttributeError):
        raise ResumeError("time must be RFC 3339") from None
    job = record["job"]
    if not isinstance(job, dict) or not all(isinstance(job.get(k), str) and job[k]
                                            for k in ("kind", "name", "namespace")):
        raise ResumeError("job must be {kind, name, namespace, uid} strings")
    if job.get("uid") is not None and not isinstance(job["uid"], str):
        raise ResumeError("job.uid must be a string or null")
    reporter = record["reporter"]
    if not isinstance(reporter, dict) or not _is_int(reporter.get("rank")):
        raise ResumeError("reporter must be {rank, pod, node, pod_uid} with an integer rank")
    for key in ("pod", "node", "pod_uid"):
        if reporter.get(key) is not None and not isinstance(reporter[key], str):
            raise ResumeError(f"reporter.{key} must be a string or null")
    checkpoint = record["checkpoint"]
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("path"), str) or not checkpoint["path"]:
        raise ResumeError("checkpoint.path must be a non-empty string")
    if not _is_int(checkpoint.get("step")) or checkpoint["step"] < 0:
        raise ResumeError("checkpoint.step must be a non-negative integer")
    sha = checkpoint.get("sha256")
    if sha is not None and (not isinstance(sha, str) or not _SHA256.match(sha)):
        raise ResumeError("checkpoint.sha256 must be 64 lowercase hex digits or null")
    return record


dumps = _alarm.dumps
"""Strict JSON, as an alarm record is written."""


def loads(text: str | bytes) -> dict[str, Any]:
    try:
        record = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ResumeError(f"resume record is not valid JSON: {exc}") from None
    return validate(record)


_is_int = _alarm._is_int
