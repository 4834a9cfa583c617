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

__all__ = ["AUDIT_WINDOW", "Budget", "DECIDED", "Measurement", "ORDINARY_WINDOW", "Sample",
           "choose_interval", "estimate", "explain", "premium", "starting_interval"]

ORDINARY_WINDOW = 256
"""Ordinary steps the measurement keeps (the newest)."""
AUDIT_WINDOW = 8
"""Audit steps the measurement keeps (the newest)."""
DECIDED = "at the end of every audit step"
"""When the interval is re-decided (documented; a decision costs one 8-byte all-reduce)."""


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


def starting_interval(config: Config) -> int:
    """The interval a budgeted run starts with: ``audit_every``, at most ``max_audit_interval``."""
    assert config.max_audit_interval is not None
    return max(1, min(config.audit_every, config.max_audit_interval))


class Budget:
    """The audit interval of one rank's Guard under ``Config.max_overhead``: measures each step's
    end (:meth:`ended`) and re-decides at the end of each audit step, with every other rank."""

    def __init__(self, config: Config, stats: CheckStats, device: torch.device,
                 group: dist.ProcessGroup | None, world_size: int, rank: int) -> None:
        assert config.max_overhead is not None and config.max_audit_interval is not None
        self.budget = float(config.max_overhead)
        self.cap = config.max_audit_interval
        self.stats = stats
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
        self._ordinary: deque[Sample] = deque(maxlen=ORDINARY_WINDOW)
        self._audits: deque[Sample] = deque(maxlen=AUDIT_WINDOW)
        self._audit = False
        self._last_end: float | None = None
        self._last_checks = 0.0
        self._publish()

    # -- the step's hooks (the Guard calls them) ----------------------------------------------

    def begin(self, audit: bool) -> None:
        """A step begins; ``audit``: it is an audit step (the same on every rank)."""
        self._audit = audit

    def interrupted(self) -> None:
        """The step failed: the next step's wall time would span it, so it gives no sample."""
        self._last_end = None

    def ended(self, step: int) -> None:
        """The step ended (after check 3): take its sample; after an audit step, re-decide."""
        now = time.perf_counter()
        checks = sum(self.stats.seconds.values())
        sample = None
        if self._last_end is not None:
            sample = Sample(max(0.0, checks - self._last_checks), max(0.0, now - self._last_end))
            (self._audits if self._audit else self._ordinary).append(sample)
        if self._audit:
            self.decide(step)
            spent = time.perf_counter() - now
            if sample is not None:  # the decision's own time is part of what the audit step costs
                self._audits[-1] = Sample(sample.checks + spent, sample.wall + spent)
            now += spent
        self._last_end, self._last_checks = now, checks

    # -- the decision ---------------------------------------------------------------------------

    def decide(self, step: int) -> int:
        """Every rank's wanted interval, agreed (the largest); the same on every rank. Called on
        every rank at the same steps (the end of each audit step)."""
        self.measurement = estimate(self._ordinary, self._audits)
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
            "samples_here": {"ordinary": len(self._ordinary), "audit": len(self._audits)},
        }

    def _publish(self) -> None:
        self.stats.audit_schedule = self.as_dict()
