"""Settings of the in-pod checks, and the one place that reads them from the environment.

The operator's webhook (SPEC §5) turns a job's ``sdcguard.dev/*`` annotations into the
``SDCGUARD_*`` variables below and adds the downward-API ``POD_NAME`` / ``POD_NAMESPACE`` /
``NODE_NAME``; outside Kubernetes the same variables may be set by hand, or arguments given.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

ENV = {
    "audit_every": "SDCGUARD_AUDIT_EVERY",
    "weight_check_every": "SDCGUARD_WEIGHT_CHECK_EVERY",
    "spool": "SDCGUARD_SPOOL",
    "ranks_per_node": "SDCGUARD_RANKS_PER_NODE",
    "seed": "SDCGUARD_SEED",
}


@dataclass(kw_only=True, slots=True)
class Config:
    """What the checks do and where alarms go."""

    audit_every: int = 100
    """Run check 2 (ring replay) on steps where ``step % audit_every == 0``; 0 turns it off."""

    weight_check_every: int = 10
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

    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form settings kept for the record (e.g. the drill's fault list)."""

    def __post_init__(self) -> None:
        for name in ("audit_every", "weight_check_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.ranks_per_node is not None and (
            not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1
        ):
            raise ValueError(f"ranks_per_node must be an integer >= 1, got {self.ranks_per_node!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> "Config":
        """Settings from ``SDCGUARD_*`` and downward-API variables; keyword arguments win."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name, var in ENV.items():
            raw = env.get(var, "").strip()
            if raw:
                values[name] = raw if name == "spool" else _parse_int(var, raw)
        if "ranks_per_node" not in values and env.get("LOCAL_WORLD_SIZE", "").strip():
            values["ranks_per_node"] = _parse_int("LOCAL_WORLD_SIZE", env["LOCAL_WORLD_SIZE"])
        values["pod"] = env.get("POD_NAME") or None
        values["node"] = env.get("NODE_NAME") or None
        values["job"] = _job_from_env(env)
        values.update(overrides)
        return cls(**values)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _parse_int(var: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{var} must be an integer, got {raw!r}") from None


def _job_from_env(env: Mapping[str, str]) -> dict[str, str] | None:
    """The owning job from ``SDCGUARD_JOB_NAME`` (+ ``_KIND``, ``POD_NAMESPACE``), else None."""
    name = env.get("SDCGUARD_JOB_NAME", "").strip()
    if not name:
        return None
    return {
        "kind": env.get("SDCGUARD_JOB_KIND", "").strip() or "PyTorchJob",
        "name": name,
        "namespace": env.get("POD_NAMESPACE", "").strip() or "default",
    }
