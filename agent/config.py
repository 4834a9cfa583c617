"""Settings of the in-pod checks, and the one place that reads them from the environment.

The operator's webhook (docs/design.md §5) turns a job's ``sdcguard.dev/*`` annotations into the
``SDCGUARD_*`` variables below and adds the downward-API ``POD_NAME`` / ``POD_NAMESPACE`` /
``NODE_NAME``; outside Kubernetes the same variables may be set by hand, or arguments given.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from .contract import names

ENV = {
    "audit_every": names.ENV_AUDIT_EVERY,
    "weight_check_every": names.ENV_WEIGHT_CHECK_EVERY,
    "spool": names.ENV_SPOOL,
    "ranks_per_node": names.ENV_RANKS_PER_NODE,
    "seed": names.ENV_SEED,
    "max_overhead": names.ENV_MAX_OVERHEAD,
    "max_audit_interval": names.ENV_MAX_AUDIT_INTERVAL,
}
NONFINITE_ACTIONS = ("raise", "skip")


@dataclass(kw_only=True, slots=True)
class Config:
    """What the checks do and where alarms go."""

    audit_every: int = names.DEFAULT_AUDIT_EVERY
    """Run check 2 (ring replay) on steps where ``step % audit_every == 0``; 0 turns it off.
    With ``max_overhead``: the interval the run starts with (at most ``max_audit_interval``)."""

    max_overhead: float | None = None
    """The integrity budget: the largest training-cost premium the checks may add, as a fraction
    of a step without them (``0.03``: 3%). Set, the Guard measures what its checks add to an
    ordinary step and what an audit adds, and after each audit chooses the audit interval
    (``sdcguard.budget``): the smallest whose measured premium fits the budget, never more than
    ``max_audit_interval`` and never below 1; the same on every rank. None: ``audit_every`` fixed."""

    max_audit_interval: int | None = None
    """With ``max_overhead`` (required there): the longest audit interval the budget may choose, in
    steps — the detection latency you accept for a compute fault (a suspect window is at most this
    long). When even this interval costs more than the budget, the Guard audits at this interval
    and says so."""

    weight_check_every: int = names.DEFAULT_WEIGHT_CHECK_EVERY
    """Run check 3 (weight fingerprints) after the update on steps where
    ``step % weight_check_every == 0``; 0 limits it to audit steps and checkpoints."""

    spool: str | None = None
    """Directory shared with the sidecar where alarm records are written; None writes none."""

    ranks_per_node: int | None = None
    """Ranks per node ``R`` for the replay ring; None reads ``LOCAL_WORLD_SIZE``."""

    seed: int = 0
    """Base seed of the per-(step, rank) forward RNG that makes dropout replayable."""

    job: dict[str, str] | None = None
    """``{kind, name, namespace}`` of the Kubernetes job, or None outside Kubernetes."""

    pod: str | None = None
    """This rank's pod name (downward API ``POD_NAME``)."""

    node: str | None = None
    """This rank's node name (downward API ``NODE_NAME``)."""

    pod_uid: str | None = None
    """This rank's pod uid (downward API ``POD_UID``): signed into the alarm beside the pod name."""

    drill: bool = False
    """This run is a drill (``sdcguard drill``): its faults are synthetic and its alarm records say
    so (``"drill": true``)."""

    keep_resume_points: bool = True
    """When a save writes a path again (nanoGPT's ``ckpt.pt``) and the checkpoint it held may still
    be the one a later alarm names as its resume point, keep that file beside it (a hard link
    where the filesystem has them) as ``<stem>.sdcguard-step<N><suffix>``; it is removed once a
    newer verified checkpoint covers every window an alarm can open. False: the overwritten
    checkpoint just leaves the history, and an alarm may then name no checkpoint at all."""

    checkpoint_every: int = 0
    """The job's checkpoint interval, if it has one: with ``audit_checkpoints`` those steps are
    audit steps too, so that every checkpoint is one the run can trust (see ``recovery``)."""

    audit_checkpoints: bool = True
    """Audit every ``checkpoint_every``-th step (only with ``checkpoint_every``)."""

    device_gate: bool = False
    """Decide the update of an ordinary step on the device: checks 1 and 4 leave a ``found_inf``
    that a fused optimizer (``torch.optim.Adam``, ``AdamW`` or ``SGD`` with ``fused=True``; any
    other is refused at start-up) reads, skipping the update on the device when a check failed.
    The step then needs no host synchronisation; the host reads the verdict one step later
    (before it allows the next update, before any checkpoint is written, at ``Guard.settle()`` and
    ``close()``) and raises the same alarm there. Audit and weight-check steps stay synchronous."""

    on_nonfinite: str = "raise"
    """A NaN/Inf gradient that reproduces on another node (the data or the model, not the
    hardware): ``"raise"`` :class:`~sdcguard.errors.NonFiniteGradient` on every rank, or
    ``"skip"`` the step (its gradients are dropped; counted and logged)."""

    publish_wait_seconds: float | None = None
    """After an alarm, how long the reporting rank waits for the sidecar to confirm that the
    Event exists before the exception leaves (every rank waits with it, so the job does not end
    first and take the record with its pod). None: ``spool.PUBLISH_WAIT_SECONDS`` inside a
    Kubernetes job with a spool (a sidecar is there), 0 elsewhere."""

    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form settings kept for the record (e.g. the drill's fault list)."""

    def __post_init__(self) -> None:
        for name in ("audit_every", "weight_check_every", "checkpoint_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.ranks_per_node is not None and (
            not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1
        ):
            raise ValueError(f"ranks_per_node must be an integer >= 1, got {self.ranks_per_node!r}")
        self._check_budget()
        if not isinstance(self.device_gate, bool):
            raise ValueError(f"device_gate must be True or False, got {self.device_gate!r}")
        if self.on_nonfinite not in NONFINITE_ACTIONS:
            raise ValueError(f"on_nonfinite must be one of {NONFINITE_ACTIONS}, got {self.on_nonfinite!r}")

    def _check_budget(self) -> None:
        overhead, cap = self.max_overhead, self.max_audit_interval
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
            raise ValueError(f"max_audit_interval must be an integer >= 1, got {cap!r}")
        if overhead is None:
            if cap is not None:
                raise ValueError("max_audit_interval applies only with max_overhead (the integrity budget); "
                                 "for a fixed audit interval set audit_every")
            return
        if not isinstance(overhead, (int, float)) or isinstance(overhead, bool) or not math.isfinite(overhead) \
                or overhead <= 0:
            raise ValueError(f"max_overhead must be a number > 0 (a fraction of the step time: 0.03 is 3%), "
                             f"got {overhead!r}")
        if cap is None:
            raise ValueError(f"max_overhead needs max_audit_interval ({names.ENV_MAX_AUDIT_INTERVAL}): the longest "
                             "audit interval the budget may choose, i.e. the detection latency you accept")
        if self.audit_every == 0:
            raise ValueError("max_overhead chooses the audit interval, but audit_every=0 turns audits off: "
                             "leave audit_every out (it is only the starting interval with max_overhead), "
                             "or drop max_overhead")

    @property
    def budgeted(self) -> bool:
        """The audit interval is chosen by the integrity budget (``max_overhead``), not fixed."""
        return self.max_overhead is not None

    def publish_wait(self) -> float:
        if self.publish_wait_seconds is not None:
            return max(0.0, float(self.publish_wait_seconds))
        from .contract.spool import PUBLISH_WAIT_SECONDS
        return PUBLISH_WAIT_SECONDS if self.job is not None and self.spool else 0.0

    def audits_checkpoints(self) -> bool:
        return bool(self.checkpoint_every and self.audit_checkpoints)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **defaults: Any) -> "Config":
        """Settings from ``SDCGUARD_*`` and downward-API variables over ``defaults``.

        What the platform set in the environment (the webhook turns the job's annotations into
        it) wins over the keyword defaults the script passes; for settings that must not be
        overridden, build ``Config(...)`` explicitly."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = dict(defaults)
        for name, var in ENV.items():
            raw = env.get(var, "").strip()
            if raw:
                values[name] = raw if name == "spool" else (
                    _parse_float(var, raw) if name == "max_overhead" else _parse_int(var, raw))
        if "ranks_per_node" not in values and env.get("LOCAL_WORLD_SIZE", "").strip():
            values["ranks_per_node"] = _parse_int("LOCAL_WORLD_SIZE", env["LOCAL_WORLD_SIZE"])
        for key, var in (("pod", names.ENV_POD_NAME), ("node", names.ENV_NODE_NAME), ("pod_uid", names.ENV_POD_UID)):
            if env.get(var):
                values[key] = env[var]
        job = _job_from_env(env)
        if job is not None:
            values["job"] = job
        return cls(**values)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _parse_int(var: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{var} must be an integer, got {raw!r}") from None


def _parse_float(var: str, raw: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{var} must be a number, got {raw!r}") from None


def _job_from_env(env: Mapping[str, str]) -> dict[str, str] | None:
    """The owning job from ``SDCGUARD_JOB_NAME`` (+ ``_KIND``, ``POD_NAMESPACE``), else None."""
    name = env.get(names.ENV_JOB_NAME, "").strip()
    if not name:
        return None
    job = {
        "kind": env.get(names.ENV_JOB_KIND, "").strip() or names.JOB_KIND,
        "name": name,
        "namespace": env.get(names.ENV_POD_NAMESPACE, "").strip() or "default",
    }
    uid = env.get(names.ENV_JOB_UID, "").strip()
    if uid:
        job["uid"] = uid  # signed with the record: the operator compares it with the live job's
    return job
