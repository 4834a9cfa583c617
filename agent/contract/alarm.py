"""The alarm record, schema ``sdcguard.dev/alarm/v1`` (docs/design.md §3): built, validated, serialised.

The wire form is a JSON object (:func:`make_alarm` builds it, :func:`loads` parses it, both
validate every field, the optional ones of :class:`Additive` included); :class:`Alarm` is the
same record as typed fields.

One schema shared by the library (which writes records), the sidecar (which publishes them) and
the operator (which acts on them). Standard library only: the sidecar and the operator never
import torch.
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import math
import re
from typing import Any, Mapping, TypedDict, Unpack

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


class Additive(TypedDict, total=False):
    """The optional fields of a v1 record (docs/design.md §3, §9, §10), as :func:`make_alarm`
    takes them: a field not given is absent from the record (a record of an older library lacks
    it); one given is validated like every other field, when built and when parsed."""

    suspect_window: Mapping[str, int]
    """``{first_step, last_step}``: the steps whose results the fault may have touched."""
    last_audited_step: int | None
    """The last step whose audit (check 2) passed."""
    last_weights_verified_step: int | None
    """The last step whose weight check (check 3) passed."""
    steps_at_risk: int | None
    """The steps resuming from ``last_good_checkpoint`` redoes (alarm step - its step)."""
    last_good_checkpoint_sha256: str | None
    """The SHA-256 (hex) of the checkpoint named, as its manifest records it."""
    last_good_checkpoint_step: int | None
    """The manifest step of the checkpoint named."""
    last_good_checkpoint_kept_from: str | None
    """The path the named checkpoint was saved to, when sdcguard kept it because that path was
    written again."""
    drill: bool
    """The record comes from ``sdcguard drill`` (synthetic faults)."""
    step_seconds: float | None
    """The wall seconds of one checked step, measured on the reporting rank while training (a step
    without sdcguard times one plus the checks' premium): what redoing a step costs each rank."""
    world_size: int | None
    """The job's ranks (GPUs): with ``steps_at_risk`` and ``step_seconds``, the rollback's GPU-seconds."""


ADDITIVE_FIELDS = tuple(Additive.__annotations__)

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
GPU_UUID = re.compile(r"^(GPU|MIG)-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
"""``suspects[].gpu.uuid``: as nvidia-smi prints it and dcgm-exporter labels its series (``UUID``)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Gpu:
    """``suspects[].gpu``: the rank's device. ``index``: the CUDA device index the process uses (on
    CPU: the rank's local index on its node); ``uuid``: the GPU's UUID as nvidia-smi prints it and
    dcgm-exporter labels it (``UUID``), None on CPU. Absent from records of older libraries."""

    index: int
    uuid: str | None = None


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Identity:
    """A rank as the record names it: ``{rank, pod, node}`` (pod/node None outside Kubernetes),
    its pod's uid (signed, docs/design.md §9) and its GPU (§10) where known."""

    rank: int
    pod: str | None
    node: str | None
    pod_uid: str | None = None
    gpu: Gpu | None = None


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Job:
    """``job``: the Kubernetes job; ``uid`` is the instance the record was signed for."""

    kind: str
    name: str
    namespace: str
    uid: str | None = None


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SuspectWindow:
    first_step: int
    last_step: int


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Alarm:
    """A v1 record as typed fields (:meth:`parse`). The wire form stays the JSON object
    :func:`make_alarm` builds and :func:`loads` reads (the signature covers its exact text);
    fields a record lacks are None here (``drill`` False)."""

    id: str
    time: str
    job: Job | None
    check: str
    step: int
    suspect_ranks: tuple[int, ...]
    suspects: tuple[Identity, ...]
    ambiguous: bool
    reporter: Identity
    evidence: Mapping[str, Any]
    last_verified_step: int | None
    last_good_checkpoint: str | None
    suspect_window: SuspectWindow | None = None
    last_audited_step: int | None = None
    last_weights_verified_step: int | None = None
    steps_at_risk: int | None = None
    last_good_checkpoint_sha256: str | None = None
    last_good_checkpoint_step: int | None = None
    last_good_checkpoint_kept_from: str | None = None
    drill: bool = False
    step_seconds: float | None = None
    world_size: int | None = None

    @classmethod
    def parse(cls, record: Any) -> "Alarm":
        """The typed view of a record, which is validated first (:class:`AlarmError`)."""
        validate(record)
        window = record.get("suspect_window")
        job = record["job"]
        return cls(
            id=record["id"], time=record["time"], check=record["check"], step=record["step"],
            job=None if job is None else Job(kind=job["kind"], name=job["name"], namespace=job["namespace"],
                                             uid=job.get("uid")),
            suspect_ranks=tuple(record["suspect_ranks"]),
            suspects=tuple(_identity(s) for s in record["suspects"]), ambiguous=record["ambiguous"],
            reporter=_identity(record["reporter"]), evidence=record["evidence"],
            last_verified_step=record["last_verified_step"], last_good_checkpoint=record["last_good_checkpoint"],
            suspect_window=None if window is None else SuspectWindow(first_step=window["first_step"],
                                                                     last_step=window["last_step"]),
            **{f: record.get(f) for f in ADDITIVE_FIELDS if f not in ("suspect_window", "drill")},
            drill=record.get("drill") is True,
        )


def _identity(entry: Mapping[str, Any]) -> Identity:
    gpu = entry.get("gpu")
    return Identity(rank=entry["rank"], pod=entry["pod"], node=entry["node"], pod_uid=entry.get("pod_uid"),
                    gpu=None if gpu is None else Gpu(index=gpu["index"], uuid=gpu.get("uuid")))


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
    **additive: Unpack[Additive],
) -> dict[str, Any]:
    """Build a record; ``identities`` maps every rank to its ``{rank, pod, node}`` (and
    ``pod_uid``, ``gpu`` where known); ``additive``: the optional fields of :class:`Additive`,
    each present in the record only when given. Raises :class:`AlarmError` on a bad value, and
    ``TypeError`` on a field the schema does not have."""
    unknown = sorted(set(additive) - set(ADDITIVE_FIELDS))
    if unknown:
        raise TypeError(f"make_alarm() got fields the alarm schema does not have: {', '.join(unknown)} "
                        f"(optional fields: {', '.join(ADDITIVE_FIELDS)})")
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
        **json_safe(dict(additive)),
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
    _validate_additive(record)
    return record


def _validate_additive(record: dict[str, Any]) -> None:
    """The optional fields, where present (a record of an older library lacks them)."""
    window = record.get("suspect_window")
    if window is not None:
        if not isinstance(window, dict) or not all(_is_int(window.get(k)) and window[k] >= 0
                                                   for k in ("first_step", "last_step")):
            raise AlarmError("suspect_window must be {first_step, last_step} non-negative integers")
        if window["first_step"] > window["last_step"]:
            raise AlarmError("suspect_window.first_step must not be after suspect_window.last_step")
    for key in ("last_audited_step", "last_weights_verified_step", "last_good_checkpoint_step"):
        if record.get(key) is not None and not _is_int(record[key]):
            raise AlarmError(f"{key} must be an integer or null")
    at_risk = record.get("steps_at_risk")
    if at_risk is not None and (not _is_int(at_risk) or at_risk < 0):
        raise AlarmError("steps_at_risk must be a non-negative integer or null")
    sha = record.get("last_good_checkpoint_sha256")
    if sha is not None and (not isinstance(sha, str) or not _SHA256.match(sha)):
        raise AlarmError("last_good_checkpoint_sha256 must be 64 lowercase hex digits or null")
    kept = record.get("last_good_checkpoint_kept_from")
    if kept is not None and not isinstance(kept, str):
        raise AlarmError("last_good_checkpoint_kept_from must be a string or null")
    if "drill" in record and not isinstance(record["drill"], bool):
        raise AlarmError("drill must be a boolean")
    seconds = record.get("step_seconds")
    if seconds is not None and (not isinstance(seconds, (int, float)) or isinstance(seconds, bool)
                                or not math.isfinite(seconds) or seconds < 0):
        raise AlarmError("step_seconds must be a non-negative finite number or null")
    world = record.get("world_size")
    if world is not None and (not _is_int(world) or world < 1):
        raise AlarmError("world_size must be a positive integer or null")
    job = record["job"]
    if job is not None and job.get("uid") is not None and not isinstance(job["uid"], str):
        raise AlarmError("job.uid must be a string or null")


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
    if entry.get("pod_uid") is not None and not isinstance(entry["pod_uid"], str):
        raise AlarmError(f"{where}.pod_uid must be a string or null")
    gpu = entry.get("gpu")
    if gpu is not None and (not isinstance(gpu, dict) or not _is_int(gpu.get("index")) or gpu["index"] < 0
                            or not (gpu.get("uuid") is None or isinstance(gpu["uuid"], str)
                                    and GPU_UUID.fullmatch(gpu["uuid"]))):
        raise AlarmError(f"{where}.gpu must be {{index, uuid}}: a non-negative integer and null or a GPU UUID as "
                         "nvidia-smi prints it (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)")


def gpu_text(gpu: Mapping[str, Any] | None) -> str:
    """A suspect's GPU as people read it: ``GPU 3 (GPU-8b2c…)``, ``GPU 3`` on CPU, ``""`` when the
    record names none (an older library)."""
    if not gpu:
        return ""
    return f"GPU {gpu['index']}" + (f" ({gpu['uuid']})" if gpu.get("uuid") else "")
