"""Judging a run with injected faults: which check should have caught each fault, and did it?

For every fault, the schedule alone (when audits, weight checks and checkpoints ran) says which
check must catch it and at which step; the alarms the run raised are matched against that. A
fault on a step where its check does not run is an *escape* (reported, not an error); a fault its
check should have caught but did not, an alarm naming the wrong rank, a resume from a state the
fault may have touched, or an alarm no fault explains fails the run. Works for the drill and for
your own job alike:

    verdict = judge_faults(specs, alarms, Schedule.of(guard, steps=1000))
    print(verdict.to_text())

Standard library only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from ..contract.alarm import (
    CHECK_NONFINITE_LOCAL, CHECK_NONFINITE_REDUCED, CHECK_REDUCE_CHECKSUM, CHECK_REPLAY, CHECK_WEIGHTS,
)
from .spec import FaultSpec, parse_fault

__all__ = [
    "Schedule", "Judgement", "judge_faults", "expectation", "suspect_window", "pipeline_candidates",
    "CAUGHT", "AMBIGUOUS", "ESCAPED", "NOT_REACHED", "MISSED", "MISATTRIBUTED", "RESUME_UNSAFE", "PASSING",
]

# Outcomes. The first four are what a healthy sdcguard produces; the rest fail the run.
CAUGHT, AMBIGUOUS, ESCAPED, NOT_REACHED = "caught", "caught-ambiguous", "escaped", "not-reached"
MISSED, MISATTRIBUTED, RESUME_UNSAFE = "missed", "misattributed", "resume-unsafe"
PASSING = frozenset({CAUGHT, AMBIGUOUS, ESCAPED, NOT_REACHED})


@dataclass(frozen=True, slots=True)
class Schedule:
    """When a run's checks ran: all that judging needs besides the faults and the alarms."""

    steps: int
    """Steps the run was to take (0 .. steps-1)."""
    audit_every: int
    """Check 2 interval (0: never); check 3 also runs on audit steps, before the update."""
    weight_check_every: int
    """Check 3 interval, after the update (0: on audit steps only)."""
    nodes: int
    checkpoint_every: int = 0
    """Interval of ``guard.save_checkpoint`` (0: none); check 3 runs first, after the update."""
    audit_checkpoints: bool = False
    """Checkpoint steps are audit steps too (``Config(checkpoint_every=K)``, the default there)."""
    checks_reduction: bool = True
    """Check 4 runs on every step (the reduce hook averages like DDP; not with a compression hook)."""
    checks_weights: bool = True
    """Check 3 has replicas to compare (not with one replica: a model sharded with pure FSDP)."""
    checks_updates: bool = False
    """With one replica: every rank's optimizer update is re-run by its ring neighbour on weight-check
    steps (pure FSDP with AdamW, Adam or SGD), which catches a corrupted update on those steps."""
    tp: int = 1
    """Ranks per tensor-parallel group, laid out on consecutive ranks (1: none). A fault in one
    rank's forward reaches its whole group through the activation collectives: the group is named."""
    pipeline: tuple[tuple[int, int], ...] | None = None
    """Pipeline parallelism: ``(replica, position)`` of every rank (None: no pipeline). The
    schedule's first step (step 0) is not audited with DDP stages (its shape inference primes DDP's
    reducer); an ambiguous alarm must name ranks of the faulted rank's stage (check 1: of its replica)."""
    pipeline_audits_first_step: bool = False
    """The pipeline's stages are sharded by FSDP2: its shape inference reduces nothing, so step 0
    is audited like any other step."""

    @classmethod
    def of(cls, guard: Any, steps: int, checkpoint_every: int | None = None) -> Schedule:
        """The schedule of an ``sdcguard.Guard`` (checkpoints every ``checkpoint_every`` steps,
        by default its config's ``checkpoint_every``)."""
        cfg, topology = guard.config, guard.topology
        replicas = topology.world_size > 1  # one replica: nobody to replay its batch, no audits
        configured = getattr(cfg, "checkpoint_every", 0)
        layout = guard.layout
        mesh = getattr(layout, "mesh", None)
        at = getattr(getattr(layout, "grid", None), "at", None)  # a pipeline's grid (layouts/pipeline.py)
        pipeline = None if at is None else tuple(at[r] for r in range(topology.world_size))
        first = bool(getattr(getattr(layout, "replicas", None), "audits_first_step", False))
        return cls(steps, cfg.audit_every if replicas else 0, cfg.weight_check_every, topology.nodes,
                   configured if checkpoint_every is None else checkpoint_every,
                   replicas and bool(configured) and getattr(cfg, "audit_checkpoints", False),
                   replicas and layout.checks_reduction,
                   layout.checks_weights or not replicas,  # sharded: check 3 needs a second replica of each shard
                   getattr(layout, "checks_updates", False),  # pure FSDP: its update re-run
                   mesh.tp if mesh is not None else 1, pipeline, first)

    def audits(self, step: int) -> bool:
        if self.pipeline is not None and step == 0 and not self.pipeline_audits_first_step:
            return False  # a DDP-replicated pipeline schedule's first step: see ``pipeline``
        if self.audit_checkpoints and self.checkpoints(step):
            return True
        return self.audit_every > 0 and step % self.audit_every == 0

    def weight_checks(self, step: int) -> bool:
        return self.weight_check_every > 0 and step % self.weight_check_every == 0

    def checkpoints(self, step: int) -> bool:
        return self.checkpoint_every > 0 and step % self.checkpoint_every == 0


@dataclass(slots=True)
class Judgement:
    """The verdict on a run: one row per fault, and the alarms that no fault explains."""

    rows: list[dict[str, Any]]
    """Per fault: its fields, ``expected_check``, ``expected_step``, ``why``, ``outcome``,
    ``alarm`` (the id of the matching alarm or None), ``named`` (the ranks it named) and, when the
    run resumed after that alarm, ``resume_step``."""
    unexplained: list[dict[str, Any]]
    """Alarm records no fault explains: a false alarm, or a misjudged fault."""

    @property
    def passed(self) -> bool:
        return not self.unexplained and all(r["outcome"] in PASSING for r in self.rows)

    def as_dict(self) -> dict[str, Any]:
        return {"injected": self.rows, "unexplained_alarms": [a["id"] for a in self.unexplained],
                "passed": self.passed}

    def to_text(self) -> str:
        """A few lines for a log: each fault's verdict, each unexplained alarm, the summary."""
        lines = [f"{_spec(row)}: {row['outcome'].upper()} ({_detail(row)})" for row in self.rows]
        lines += [f"unexplained alarm {a['id']}: check {a['check']} at step {a['step']} naming "
                  f"{_ranks(a.get('suspect_ranks', []))}" for a in self.unexplained]
        counts: dict[str, int] = {}
        for row in self.rows:
            counts[row["outcome"]] = counts.get(row["outcome"], 0) + 1
        tally = ", ".join(f"{n} {outcome}" for outcome, n in counts.items()) or "no faults"
        if self.unexplained:
            tally += f", {len(self.unexplained)} unexplained alarm(s)"
        lines.append(f"{'PASSED' if self.passed else 'FAILED'}: {tally}")
        return "\n".join(lines)


def expectation(fault: FaultSpec, plan: Schedule) -> tuple[str | None, int | None, str]:
    """(check, step, why): what must catch ``fault`` and when; check None means it escapes."""
    check = fault.info.caught_by
    if check is None:
        return None, None, "no check can see it"
    if check == CHECK_REDUCE_CHECKSUM and not plan.checks_reduction:
        return None, None, "check 4 is off (the reduce hook does not average like DDP): a finite all-reduce fault reaches every replica alike"
    firings = [s for s in range(fault.step, plan.steps) if fault.fires_at(s)]
    if not firings:
        return None, None, "the run ends before the fault's step"
    if check == CHECK_REPLAY:
        audited = [s for s in firings if plan.audits(s)]
        if not audited:
            if fault.during == "replay":
                return None, None, "a replay-side fault needs an audit step: nothing is replayed elsewhere"
            return None, None, "no audit step among the fault's steps: check 2 does not run there"
        return check, audited[0], "ring replay on an audit step"
    if check == CHECK_WEIGHTS:
        if not plan.checks_weights:
            if plan.checks_updates and fault.info.corrupts == "optimizer":
                rerun = [s for s in firings if plan.weight_checks(s)]
                if rerun:
                    return check, rerun[0], "the ring neighbour's re-run of the rank's update differs from it"
                return None, None, ("one replica (pure FSDP): the update re-run runs on weight-check steps only, and "
                                    "the next one starts from the corrupted shard")
            return None, None, ("one replica (pure FSDP): no copy of the shard to compare with, and every rank "
                                "all-gathers the same corrupted shard, so no replay differs")
        seen = _first_weight_check(fault, plan)
        if seen is None:
            return None, None, "no weight check runs between the fault and the end of the run"
        return check, seen, "weight fingerprints differ from the majority"
    if check == CHECK_REDUCE_CHECKSUM:
        return check, firings[0], "the all-reduce checksum is checked on every step"
    return check, firings[0], "non-finite values are checked on every step"


def judge_faults(faults: Iterable[FaultSpec | str], alarms: Iterable[Mapping[str, Any]], plan: Schedule, *,
                 stopped_at: int | None = None, resumed_at: Mapping[str, int] | None = None) -> Judgement:
    """Judge a run: ``faults`` injected (specs or their text), ``alarms`` it raised (records, as
    ``SDCDetected.alarm`` or the spool holds them; duplicates by id count once), ``plan`` its
    schedule, ``stopped_at`` the step it stopped at (None: it ran to the end), ``resumed_at`` the
    step whose state it resumed from after each alarm id (-1: from the start)."""
    specs = [parse_fault(f) if isinstance(f, str) else f for f in faults]
    unexplained = list({a["id"]: dict(a) for a in alarms}.values())
    rows = []
    for fault in specs:
        check, step, why = expectation(fault, plan)
        row = {**fault.as_dict(), "expected_check": check, "expected_step": step, "why": why,
               "alarm": None, "named": None}
        match = next((a for a in unexplained if a["check"] == check and a["step"] == step), None)
        if check is None:
            row["outcome"] = ESCAPED
        elif match is None:
            reached = stopped_at is None or step <= stopped_at
            row["outcome"] = MISSED if reached else NOT_REACHED
        else:
            unexplained.remove(match)
            row["alarm"], row["named"] = match["id"], list(match["suspect_ranks"])
            row["outcome"] = _attribution(fault, match, plan.tp, plan.pipeline)
            if resumed_at is not None and match["id"] in resumed_at:
                row["resume_step"] = resumed_at[match["id"]]
                unsafe = _unsafe_resume(fault, match, row["resume_step"])
                if unsafe and row["outcome"] in PASSING:
                    row["outcome"], row["why"] = RESUME_UNSAFE, unsafe
        rows.append(row)
    return Judgement(rows, unexplained)


def suspect_window(alarm: Mapping[str, Any]) -> tuple[int, int]:
    """(first, last) step of an alarm's suspect window (the alarm's own step when it has none)."""
    window = alarm.get("suspect_window") or {}
    return window.get("first_step", alarm["step"]), window.get("last_step", alarm["step"])


def _unsafe_resume(fault: FaultSpec, alarm: Mapping[str, Any], resume_step: int) -> str | None:
    """Why resuming from the state after ``resume_step`` is unsafe, or None when it is safe: the
    state must precede the alarm's suspect window and (the ground truth only a drill knows) the
    fault's first strike. A replay-side fault never touches the model: only the window counts."""
    first, last = suspect_window(alarm)
    if resume_step >= first:
        return f"resumed from step {resume_step}, inside the alarm's suspect window {first}..{last}"
    if fault.during != "replay" and resume_step >= fault.step:
        return (f"resumed from step {resume_step}, after the fault struck at step {fault.step}: "
                f"the suspect window {first}..{last} starts too late")
    return None


def _attribution(fault: FaultSpec, alarm: Mapping[str, Any], tp: int = 1,
                 pipeline: tuple[tuple[int, int], ...] | None = None) -> str:
    named = list(alarm["suspect_ranks"])
    if fault.info.corrupts == "reduce":
        return CAUGHT if not named else MISATTRIBUTED
    if alarm["ambiguous"]:
        if fault.rank not in named:
            return MISATTRIBUTED
        if pipeline is not None and not set(named) <= pipeline_candidates(fault, pipeline):
            return MISATTRIBUTED
        return AMBIGUOUS
    return CAUGHT if named == expected_suspects(fault, tp) else MISATTRIBUTED


def pipeline_candidates(fault: FaultSpec, pipeline: tuple[tuple[int, int], ...]) -> set[int]:
    """Who an ambiguous alarm may name for a fault on a pipeline (``pipeline``: every rank's
    ``(replica, position)``): a non-finite value made in one stage reaches every stage of its
    replica through the backward, so check 1 names ranks of the faulted replica; every other check
    names ranks holding the faulted rank's stage (check 2: the first stage whose output differs,
    and its pair; check 3: the stage's replicas)."""
    replica, position = pipeline[fault.rank]
    if fault.info.caught_by in (CHECK_NONFINITE_LOCAL, CHECK_NONFINITE_REDUCED):
        return {r for r, (i, _) in enumerate(pipeline) if i == replica}
    return {r for r, (_, p) in enumerate(pipeline) if p == position}


def expected_suspects(fault: FaultSpec, tp: int = 1) -> list[int]:
    """Who a caught fault must name: its rank, or — for a fault in a rank's forward under tensor
    parallelism — the rank's whole TP group (consecutive ranks), which the activation collectives
    all reach alike."""
    if tp > 1 and fault.info.corrupts == "forward" and fault.rank is not None:
        first = fault.rank - fault.rank % tp
        return list(range(first, first + tp))
    return [fault.rank]


def _first_weight_check(fault: FaultSpec, plan: Schedule) -> int | None:
    """First check 3 after the weights went bad: audit steps check before the update, weight-check
    and checkpoint steps after it; an optimizer fault lands between the two, a stored-weight fault
    before both."""
    after_update = fault.info.corrupts == "optimizer"
    for step in range(fault.step, plan.steps):
        pre = plan.audits(step) and not (after_update and step == fault.step)
        if pre or plan.weight_checks(step) or plan.checkpoints(step):
            return step
    return None


def _spec(row: Mapping[str, Any]) -> str:
    return str(FaultSpec(**{k: row[k] for k in FaultSpec.__slots__}))


def _ranks(ranks: list[int]) -> str:
    return "rank " + ", ".join(map(str, ranks)) if ranks else "no rank"


def _detail(row: Mapping[str, Any]) -> str:
    outcome = row["outcome"]
    if outcome in (CAUGHT, AMBIGUOUS):
        text = f"check {row['expected_check']} at step {row['expected_step']}, naming {_ranks(row['named'])}"
        return text + (f"; resumed from step {row['resume_step']}" if "resume_step" in row else "")
    if outcome == MISATTRIBUTED:
        return f"check {row['expected_check']} at step {row['expected_step']} named {_ranks(row['named'])}"
    if outcome in (MISSED, NOT_REACHED):
        stop = "the run stopped before it" if outcome == NOT_REACHED else "no such alarm"
        return f"expected check {row['expected_check']} at step {row['expected_step']}: {stop}"
    return row["why"]
