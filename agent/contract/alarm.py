"""The alarm record, schema ``sdcguard.dev/alarm/v1`` (docs/design.md §3): built, validated, serialised.

One schema shared by the library (which writes records), the sidecar (which publishes them) and
the operator (which acts on them). Standard library only: the sidecar and the operator never
import torch.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
from typing import Any, Mapping

SCHEMA = "sdcguard.dev/alarm/v1"

CHECK_NONFINITE_LOCAL = "nonfinite-local"
CHECK_NONFINITE_REDUCED = "nonfinite-reduced"
CHECK_REPLAY = "replay"
CHECK_WEIGHTS = "weights"
CHECK_REDUCE_CHECKSUM = "reduce-checksum"

REQUIRED_FIELDS = (
    "schema", "id", "time", "job", "check", "step", "suspect_ranks", "suspects", "ambiguous",
    "reporter", "evidence", "last_verified_step", "last_good_checkpoint",
)


class AlarmError(ValueError):
    """A record that does not follow the schema; the message says which field and why."""


def now_rfc3339() -> str:
    """The current UTC time in RFC 3339 form with a ``Z`` suffix."""
    stamp = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")
    return stamp.replace("+00:00", "Z")


def rfc3339_seconds(text: str) -> float:
    """Epoch seconds of an RFC 3339 time (``...Z``, with or without milliseconds: the alarm's
    ``time``, the API server's timestamps)."""
    return _dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def make_alarm(
    *,
    alarm_id: str,
    job: Mapping[str, str] | None,
    check: str,
    step: int,
    suspect_ranks: list[int],
    identities: Mapping[int, Mapping[str, Any]],
    ambiguous: bool,
    reporter_rank: int,
    evidence: Mapping[str, Any],
    last_verified_step: int | None,
    last_good_checkpoint: str | None,
    **extra: Any,
) -> dict[str, Any]:
    """Build a record; ``identities`` maps every rank to its ``{rank, pod, node}``."""
    record = {
        "schema": SCHEMA,
        "id": alarm_id,
        "time": now_rfc3339(),
        "job": dict(job) if job else None,
        "check": check,
        "step": step,
        "suspect_ranks": sorted(suspect_ranks),
        "suspects": [dict(identities[r]) for r in sorted(suspect_ranks)],
        "ambiguous": ambiguous,
        "reporter": dict(identities[reporter_rank]),
        "evidence": json_safe(evidence),
        "last_verified_step": last_verified_step,
        "last_good_checkpoint": last_good_checkpoint,
        **json_safe(extra),
    }
    validate(record)
    return record


def validate(record: Any) -> dict[str, Any]:
    """Raise :class:`AlarmError` unless ``record`` is a well-formed v1 alarm; return it."""
    if not isinstance(record, dict):
        raise AlarmError("alarm record must be a JSON object")
    missing = [f for f in REQUIRED_FIELDS if f not in record]
    if missing:
        raise AlarmError(f"alarm record lacks required fields: {', '.join(missing)}")
    if record["schema"] != SCHEMA:
        raise AlarmError(f"unsupported alarm schema {record['schema']!r} (expected {SCHEMA!r})")
    if not isinstance(record["id"], str) or not record["id"]:
        raise AlarmError("id must be a non-empty string")
    if not isinstance(record["check"], str) or not record["check"]:
        raise AlarmError("check must be a non-empty string")
    if not _is_int(record["step"]) or record["step"] < 0:
        raise AlarmError("step must be a non-negative integer")
    _validate_job(record["job"])
    ranks = record["suspect_ranks"]
    if not isinstance(ranks, list) or not all(_is_int(r) and r >= 0 for r in ranks):
        raise AlarmError("suspect_ranks must be a list of non-negative integers")
    suspects = record["suspects"]
    if not isinstance(suspects, list) or len(suspects) != len(ranks):
        raise AlarmError("suspects must list one {rank, pod, node} per suspect rank")
    for entry, rank in zip(suspects, ranks):
        _validate_identity(entry, "suspects[]")
        if entry["rank"] != rank:
            raise AlarmError("suspects must follow the order of suspect_ranks")
    _validate_identity(record["reporter"], "reporter")
    if not isinstance(record["ambiguous"], bool):
        raise AlarmError("ambiguous must be a boolean")
    if not isinstance(record["evidence"], dict):
        raise AlarmError("evidence must be an object")
    lvs = record["last_verified_step"]
    if lvs is not None and not _is_int(lvs):
        raise AlarmError("last_verified_step must be an integer or null")
    if record["last_good_checkpoint"] is not None and not isinstance(record["last_good_checkpoint"], str):
        raise AlarmError("last_good_checkpoint must be a string or null")
    return record


def dumps(record: Mapping[str, Any]) -> str:
    """Strict JSON (no NaN literals: non-finite numbers were already turned into strings)."""
    return json.dumps(record, sort_keys=True, allow_nan=False)


def loads(text: str | bytes) -> dict[str, Any]:
    """Parse and validate one record."""
    try:
        record = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise AlarmError(f"alarm record is not valid JSON: {exc}") from None
    return validate(record)


def json_safe(value: Any) -> Any:
    """Copy ``value`` with non-finite floats as the strings "nan", "inf", "-inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _validate_job(job: Any) -> None:
    if job is None:
        return
    if not isinstance(job, dict) or not all(isinstance(job.get(k), str) for k in ("kind", "name", "namespace")):
        raise AlarmError("job must be null or {kind, name, namespace} strings")


def _validate_identity(entry: Any, where: str) -> None:
    if not isinstance(entry, dict) or not _is_int(entry.get("rank")):
        raise AlarmError(f"{where} must be {{rank, pod, node}} with an integer rank")
    for key in ("pod", "node"):
        if key not in entry or not (entry[key] is None or isinstance(entry[key], str)):
            raise AlarmError(f"{where}.{key} must be a string or null")
