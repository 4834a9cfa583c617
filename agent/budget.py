"""The integrity budget: the audit interval chosen from the checks' own measured cost.

    sdcguard.Config(max_overhead=0.03, max_audit_interval=500)

keeps the training-cost premium of the checks within 3% of a step without them, auditing as often
as that allows and at least every 500 steps (the detection latency the user accepts).

What is measured, on every rank, with ``time.perf_counter`` and nothing else (no tensor, no host
synchronisation, no collective on an ordinary step):

- per step, from the end of the step before to the end of this one: its wall time (everything
  the loop does, the user's own code included) and the time of sdcguard's phases inside it (what
  ``CheckStats.timed`` recorded: checks 1 and 4's vote, check 3, the audit's replay). A step whose
  predecessor failed, and the first step a Guard sees, give no sample;
- from the last ``ORDINARY_WINDOW`` ordinary steps and the last ``AUDIT_WINDOW`` audit steps
  (:func:`estimate`): the **ordinary cost** (mean phase time of an ordinary step: periodic check-3
  steps count at their rate), the **step time** (median of an ordinary step's wall time less its
  phases: the step without sdcguard, robust to an evaluation or a checkpoint between steps) and
  the **audit cost** (what an audit step adds to an ordinary one: its extra phase time, plus its
  extra wall time outside the phases — deterministic kernels, recording what a replay needs).
  Not measured: the comm hook's per-bucket work inside the backward. On CUDA a phase's time
  includes waiting for the kernels queued before its host read, so the ordinary cost is
  overstated there: the budget errs towards fewer audits (never beyond the cap).

When it is decided: at the end of every audit step (``Config.audit_every`` is the interval the run
starts with; a decision never happens on an ordinary step). The audit steps are the steps where
``step % interval == 0`` for the interval in force, as with a fixed ``audit_every``, so after a
decision at an audit step the next audit comes within the new interval.

How ranks agree: each rank computes the interval its own measurements want
(:func:`choose_interval`, a pure function) and one all-reduce of one float64 (8 bytes, ``MAX``) on
the audit step gives every rank the largest: the interval that keeps the premium within the budget
on the slowest rank. A rank without a measurement yet sends 0 (no opinion); when every rank says
0 the interval stays. The all-reduce runs on every rank at every audit step whatever it measured,
so the ranks stay in step.

What it costs: on an ordinary step two ``perf_counter`` reads and a few Python additions; on an
audit step one 8-byte all-reduce and its host read.

The measurement itself (:class:`Meter`) runs in every Guard, budgeted or not: the same samples
also give the run's cost by kind of check (:func:`run_cost`), which the statistics carry as
``cost`` (``sdcguard report`` and the sidecar's metrics read it there).
"""
from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from .checks.exchange import TRAFFIC, wait
from .config import Config
from .contract.stats import CheckStats

log = logging.getLogger("sdcguard")

__all__ = ["AUDIT_WINDOW", "Budget", "DECIDED", "KINDS", "Measurement", "Meter", "ORDINARY_PHASES",
           "ORDINARY_WINDOW", "Sample", "choose_interval", "estimate", "explain", "premium", "run_cost",
           "starting_interval"]

ORDINARY_WINDOW = 256
"""Ordinary steps the measurement keeps (the newest)."""
AUDIT_WINDOW = 8
"""Audit steps the measurement keeps (the newest)."""
DECIDED = "at the end of every audit step"
"""When the interval is re-decided (documented; a decision costs one 8-byte all-reduce)."""
ORDINARY_PHASES = ("nonfinite", "reduce_checksum")
"""The timed phases every step runs (checks 1 and 4's vote, check 4's judgement): the ordinary checks."""
KINDS = ("ordinary", "audit", "weights")
"""Kinds of step, and of check, the cost is told by: an audit step (checks 2 and 3 before the
update), a weight-check step that is no audit (check 3 after the update), every other step."""


@dataclass(frozen=True, slots=True)
class Sample:
    """One step as measured on one rank (seconds)."""

    checks: float
    """sdcguard's timed phases inside the step."""
    wall: float
    """From the end of the step before to the end of this one."""


@dataclass(frozen=True, slots=True)
class Measurement:
    """What the checks cost on this rank (seconds): the inputs of :func:`choose_interval`."""

    ordinary_cost: float
    """What the checks add to an ordinary step."""
    audit_cost: float
    """What an audit step adds beyond an ordinary one."""
    step_time: float
    """A step without sdcguard."""

    def as_dict(self) -> dict[str, float]:
        return {"ordinary_cost_s": round(self.ordinary_cost, 6), "audit_cost_s": round(self.audit_cost, 6),
                "step_time_s": round(self.step_time, 6)}


def premium(ordinary_cost: float, audit_cost: float, step_time: float, interval: int) -> float:
    """The premium at ``interval``: what the checks add per step, over a step without them."""
    return (max(0.0, ordinary_cost) + max(0.0, audit_cost) / interval) / step_time


def _pct(x: float) -> str:
    return f"{x * 100:.3g}%"


def _usable(ordinary_cost: float, audit_cost: float, step_time: float, budget: float) -> bool:
    return all(math.isfinite(x) for x in (ordinary_cost, audit_cost, step_time, budget)) \
        and step_time > 0 and budget > 0


def choose_interval(ordinary_cost: float, audit_cost: float, step_time: float, budget: float, cap: int) -> int:
    """The audit interval for these costs: the smallest ``K`` in ``1..cap`` with
    ``(ordinary_cost + audit_cost / K) / step_time <= budget``; ``cap`` when none is (the ordinary
    checks alone exceed the budget, or an audit is too dear for the cap) or when the figures are
    not a measurement (non-finite, a step time <= 0); 1 when an audit costs nothing (the interval
    then changes no premium). Negative costs count as 0. Pure."""
    if not isinstance(cap, int) or cap < 1:
        raise ValueError(f"cap must be an integer >= 1, got {cap!r}")
    if not _usable(ordinary_cost, audit_cost, step_time, budget):
        return cap
    ordinary_cost, audit_cost = max(0.0, ordinary_cost), max(0.0, audit_cost)
    if audit_cost == 0.0:
        return 1
    room = budget * step_time - ordinary_cost  # seconds per step left for audits
    if room <= 0.0:
        return cap
    need = audit_cost / room
    if need >= cap:
        return cap
    return max(1, math.ceil(need))


def explain(m: Measurement | None, budget: float, cap: int, interval: int) -> str:
    """Why ``interval`` (agreed over ranks) is right for this rank's measurement ``m``."""
    if m is None or not _usable(m.ordinary_cost, m.audit_cost, m.step_time, budget):
        return f"no measurement yet on this rank: auditing every {interval} steps"
    own = choose_interval(m.ordinary_cost, m.audit_cost, m.step_time, budget, cap)
    p = premium(m.ordinary_cost, m.audit_cost, m.step_time, interval)
    costs = (f"an audit adds {m.audit_cost * 1e3:.3g} ms and the ordinary checks {m.ordinary_cost * 1e3:.3g} ms "
             f"to a {m.step_time * 1e3:.3g} ms step")
    ordinary = max(0.0, m.ordinary_cost) / m.step_time
    if own != interval:
        why = f"a slower rank's measurement sets it (this rank alone would audit every {own})"
    elif m.audit_cost <= 0:
        why = "an audit adds no measurable time: every step audited"
    elif ordinary >= budget:
        why = (f"the ordinary checks alone cost {_pct(ordinary)}, over the {_pct(budget)} budget: audits at the "
               f"max_audit_interval cap")
    elif interval == cap and p > budget:
        why = f"the budget would need audits rarer than every {cap} steps: held at the max_audit_interval cap"
    elif interval == 1:
        why = "auditing every step fits the budget"
    else:
        why = "the shortest interval whose premium fits the budget"
    return f"{why}; premium {_pct(p)} against a budget of {_pct(budget)} ({costs})"


def estimate(ordinary: Sequence[Sample], audits: Sequence[Sample]) -> Measurement | None:
    """This rank's costs from its samples (see the module's docstring); None without an audit
    sample. With no ordinary sample (every step audited) the audit steps stand for both: the
    ordinary cost is taken as 0 and an audit's cost is its phases' time."""
    if not audits:
        return None
    audit_checks = statistics.fmean(a.checks for a in audits)
    audit_plain = statistics.median(a.wall - a.checks for a in audits)
    if ordinary:
        ordinary_cost = statistics.fmean(s.checks for s in ordinary)
        step_time = statistics.median(s.wall - s.checks for s in ordinary)
    else:
        ordinary_cost, step_time = 0.0, audit_plain
    audit_cost = max(0.0, audit_checks - ordinary_cost) + max(0.0, audit_plain - step_time)
    return Measurement(ordinary_cost, audit_cost, step_time)


# -- the measurement (every Guard) ----------------------------------------------------------------

class Meter:
    """What each step costs on this rank, measured while training (module docstring): the samples
    the budget decides from, and the run's totals by kind (:func:`run_cost`, the statistics'
    ``cost``). The Guard calls :meth:`begin` and :meth:`ended` (or :meth:`interrupted`) around
    every step."""

    __slots__ = ("stats", "world_size", "ordinary", "audits", "steps", "sampled", "own", "ordinary_seconds",
                 "kind", "last", "_audit", "_last_end", "_last_checks", "_last_ordinary")

    def __init__(self, stats: CheckStats, world_size: int = 1) -> None:
        self.stats = stats
        self.world_size = world_size
        self.ordinary: deque[Sample] = deque(maxlen=ORDINARY_WINDOW)
        """The newest steps that were no audit (weight-check steps among them)."""
        self.audits: deque[Sample] = deque(maxlen=AUDIT_WINDOW)
        """The newest audit steps."""
        self.steps = dict.fromkeys(KINDS, 0)
        """Steps of each kind that ended (the unmeasured ones included)."""
        self.sampled = dict.fromkeys(KINDS, 0)
        """Of these, the measured ones (a predecessor that ended: the first step and one after a failure are not)."""
        self.own = dict.fromkeys(KINDS, 0.0)
        """Phase seconds beyond the ordinary checks on measured steps of each kind (an audit's replay and
        fingerprints, check 3, a NaN's confirming replay)."""
        self.ordinary_seconds = 0.0
        """Seconds of the ordinary checks (:data:`ORDINARY_PHASES`) on measured steps."""
        self.kind: str | None = None
        """The kind of the step that ended last."""
        self.last: Sample | None = None
        """Its sample, if it was measured."""
        self._audit = False
        self._last_end: float | None = None
        self._last_checks = 0.0
        self._last_ordinary = 0.0
        stats.measure = self.cost

    def begin(self, audit: bool) -> None:
        """A step begins; ``audit``: it is an audit step (the same on every rank)."""
        self._audit = audit

    def interrupted(self) -> None:
        """The step failed: the next step's wall time would span it, so it gives no sample."""
        self._last_end = None

    def ended(self, weights: bool = False) -> None:
        """The step ended (after check 3; ``weights``: check 3 ran after its update): its sample."""
        now = time.perf_counter()
        seconds = self.stats.seconds
        checks = sum(seconds.values())
        ordinary = sum(seconds.get(p, 0.0) for p in ORDINARY_PHASES)
        kind = "audit" if self._audit else "weights" if weights else "ordinary"
        self.steps[kind] += 1
        self.kind, self.last = kind, None
        if self._last_end is not None:
            self.last = Sample(max(0.0, checks - self._last_checks), max(0.0, now - self._last_end))
            (self.audits if self._audit else self.ordinary).append(self.last)
            spent_ordinary = min(self.last.checks, max(0.0, ordinary - self._last_ordinary))
            self.sampled[kind] += 1
            self.ordinary_seconds += spent_ordinary
            self.own[kind] += self.last.checks - spent_ordinary
        self._last_end, self._last_checks, self._last_ordinary = now, checks, ordinary

    def amend(self, spent: float) -> None:
        """``spent`` more seconds of sdcguard's work belong to the step that just ended (the
        budget's decision after it): they count in its sample and the next step's starts after them."""
        if self.last is not None:
            window = self.audits if self.kind == "audit" else self.ordinary
            self.last = window[-1] = Sample(self.last.checks + spent, self.last.wall + spent)
            self.own[self.kind or "ordinary"] += spent
        if self._last_end is not None:
            self._last_end += spent

    def cost(self) -> dict[str, Any] | None:
        """The run's cost on this rank so far (:func:`run_cost`); None before the first measured step."""
        return run_cost(self.steps, self.sampled, self.own, self.ordinary_seconds,
                        [s.wall - s.checks for s in self.ordinary], [s.wall - s.checks for s in self.audits],
                        self.world_size)


def run_cost(steps: dict[str, int], sampled: dict[str, int], own: dict[str, float], ordinary_seconds: float,
             ordinary_plain: Sequence[float], audit_plain: Sequence[float], world_size: int) -> dict[str, Any] | None:
    """The measured cost of each kind of check, as seconds each and as the premium it adds to the
    run (a fraction of a step without sdcguard); pure. ``steps``/``sampled``: steps of each kind
    (:data:`KINDS`) run / measured; ``own``: phase seconds beyond the ordinary checks on measured
    steps of each kind; ``ordinary_seconds``: the ordinary checks' seconds on measured steps;
    ``*_plain``: the newest steps' wall time less their phases (ordinary, audit).

    - the step time is the median plain time of the ordinary steps (of the audit steps when every
      step is audited, which then counts nothing outside an audit's phases);
    - the ordinary checks run on every step: their cost is their mean per measured step (a NaN's
      confirming replay on an ordinary step counted with them);
    - an audit costs its phases beyond the ordinary checks plus its steps' extra wall time outside
      them (the median plain time of audit steps over the step time: deterministic kernels, the
      recording a replay needs); a weight check its phase;
    - each premium is ``cost x runs / (steps x step time)``, so the premiums add up to the run's.
    None before any step is measured (no step time)."""
    total = sum(steps.values())
    measured = sum(sampled.values())
    if not measured or not (ordinary_plain or audit_plain):
        return None
    source = "ordinary steps" if ordinary_plain else "audit steps"
    step_time = statistics.median(ordinary_plain or audit_plain)
    if not (math.isfinite(step_time) and step_time > 0):
        return None
    outside = max(0.0, statistics.median(audit_plain) - step_time) if ordinary_plain and audit_plain else 0.0
    each = {
        "ordinary": (ordinary_seconds + own.get("ordinary", 0.0)) / measured,
        "audit": own.get("audit", 0.0) / sampled["audit"] + outside if sampled.get("audit") else 0.0,
        "weights": own.get("weights", 0.0) / sampled["weights"] if sampled.get("weights") else 0.0,
    }
    runs = {"ordinary": total, "audit": steps.get("audit", 0), "weights": steps.get("weights", 0)}
    checks = {}
    for kind in KINDS:
        spent = each[kind] * runs[kind]
        checks[kind] = {"runs": runs[kind], "seconds_each": round(each[kind], 9),
                        "premium": round(spent / (total * step_time), 9), "seconds": round(spent, 6)}
    checks["audit"]["outside_phases_s"] = round(outside, 9)
    premium_total = sum(c["seconds"] for c in checks.values()) / (total * step_time)
    return {
        "step_time_s": round(step_time, 9), "step_time_from": source,
        "checked_step_s": round(step_time * (1 + premium_total), 9),
        "world_size": world_size, "steps": dict(steps), "measured_steps": dict(sampled),
        "checks": checks, "premium": round(premium_total, 9),
        "premium_seconds": round(sum(c["seconds"] for c in checks.values()), 6),
    }


def starting_interval(config: Config) -> int:
    """The interval a budgeted run starts with: ``audit_every``, at most ``max_audit_interval``."""
    assert config.max_audit_interval is not None
    return max(1, min(config.audit_every, config.max_audit_interval))


class Budget:
    """The audit interval of one rank's Guard under ``Config.max_overhead``: re-decides at the end
    of each audit step (:meth:`ended`), with every other rank, from what its :class:`Meter` measured."""

    def __init__(self, config: Config, stats: CheckStats, device: torch.device,
                 group: dist.ProcessGroup | None, world_size: int, rank: int, meter: Meter | None = None) -> None:
        assert config.max_overhead is not None and config.max_audit_interval is not None
        self.budget = float(config.max_overhead)
        self.cap = config.max_audit_interval
        self.stats = stats
        self.meter = meter if meter is not None else Meter(stats, world_size)
        """The step measurements (the Guard's own, which it feeds)."""
        self.device = device
        self.group = group
        self.world_size = world_size
        self.rank = rank
        self.interval = starting_interval(config)
        """The audit interval in force: audits on the steps where ``step % interval == 0``."""
        self.reason = f"the starting interval (audit_every={config.audit_every}, at most {self.cap})"
        self.decisions = 0
        self.changes = 0
        self.decided_at: int | None = None
        self.measurement: Measurement | None = None
        self.wanted: int | None = None
        self._publish()

    def ended(self, step: int) -> None:
        """The step ended and the meter took its sample: after an audit step, re-decide (the
        decision's own time counts in what that audit step cost)."""
        if self.meter.kind != "audit":
            return
        started = time.perf_counter()
        self.decide(step)
        self.meter.amend(time.perf_counter() - started)

    # -- the decision ---------------------------------------------------------------------------

    def decide(self, step: int) -> int:
        """Every rank's wanted interval, agreed (the largest); the same on every rank. Called on
        every rank at the same steps (the end of each audit step)."""
        self.measurement = estimate(self.meter.ordinary, self.meter.audits)
        m = self.measurement
        self.wanted = None if m is None else choose_interval(m.ordinary_cost, m.audit_cost, m.step_time,
                                                             self.budget, self.cap)
        agreed = self._agree(self.wanted or 0)
        self.decisions += 1
        if agreed >= 1:
            agreed = min(agreed, self.cap)
            self.reason = explain(m, self.budget, self.cap, agreed)
            if agreed != self.interval:
                self.changes += 1
                if self.rank == 0:
                    log.info("sdcguard: step %d: audit interval %d -> %d: %s", step, self.interval, agreed,
                             self.reason)
            self.interval = agreed
            self.decided_at = step
        self._publish()
        return self.interval

    def _agree(self, wanted: int) -> int:
        """The largest of every rank's ``wanted``: one 8-byte all-reduce (only at a decision)."""
        if self.world_size == 1:
            return wanted
        TRAFFIC["budget"] += 8
        value = torch.tensor([float(wanted)], dtype=torch.float64, device=self.device)
        wait(dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.group, async_op=True))
        return int(value.item())

    def as_dict(self) -> dict[str, Any]:
        """What the statistics say about the schedule (``CheckStats.audit_schedule``)."""
        p = None
        if self.measurement is not None and _usable(self.measurement.ordinary_cost, self.measurement.audit_cost,
                                                    self.measurement.step_time, self.budget):
            m = self.measurement
            p = round(premium(m.ordinary_cost, m.audit_cost, m.step_time, self.interval), 6)
        return {
            "mode": "budget", "interval": self.interval, "reason": self.reason,
            "max_overhead": self.budget, "max_audit_interval": self.cap, "decided": DECIDED,
            "decided_at_step": self.decided_at, "decisions": self.decisions, "changes": self.changes,
            "wanted_here": self.wanted, "premium_here": p,
            "measured_here": self.measurement.as_dict() if self.measurement is not None else None,
            "samples_here": {"ordinary": len(self.meter.ordinary), "audit": len(self.meter.audits)},
        }

    def _publish(self) -> None:
        self.stats.audit_schedule = self.as_dict()
