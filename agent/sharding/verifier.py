"""The checks of one step of a sharded model, in order (the counterpart of ``verification.Verifier``).

Before the update: checks 1 and 4 from the step's reductions (one 16-byte all-reduce). A NaN/Inf
in a rank's own gradient is named by rank, before any reduction touched it; without a replay for
sharded models yet it cannot be confirmed as the hardware's or the data's, so it is returned as
``Outcome(nonfinite=..., confirmed=False)`` — the Guard raises ``NonFiniteGradient`` (or skips),
exactly as for a single replica. After the update, on weight-check steps: check 3 per shard across
its replicas (HSDP; pure FSDP has none). The Guard reads the same ``history`` and
``last_weights_digest`` as from the DDP verifier.
"""
from __future__ import annotations

import logging
import math
import time

import torch
import torch.distributed as dist

from .. import recovery
from ..checks.nonfinite import gather_norms, judge_nonfinite, nonfinite_local_ranks, sum_votes
from ..checks.reduce_checksum import judge_checksum
from ..checks.verdict import Verdict
from ..contract.stats import CheckStats
from ..verification import PASSED, Outcome, Scale, StepRecord
from .layout import ShardLayout, plan_checks, read_layout
from .reduce_record import ShardedRecorder
from .reduction_check import VoteCoefficients, localize_checksum, nonfinite_micro, step_vote
from .shard_weights import fingerprint_shards, replicas_agree, shard_weights_verdict

log = logging.getLogger("sdcguard")


class ShardedVerifier:
    """Runs the checks of each step of an FSDP2 model; owns the record of what passed."""

    def __init__(self, *, model: torch.nn.Module, named_parameters: list[tuple[str, torch.nn.Parameter]],
                 device: torch.device, stats: CheckStats, seed: int) -> None:
        self.layout: ShardLayout = read_layout(model)
        self.recorder = ShardedRecorder(self.layout, seed)
        self.recorder.install(model)
        self.named_parameters = named_parameters
        self.device = device
        self.stats = stats
        self.coefficients = VoteCoefficients()
        self.replicate_group: dist.ProcessGroup | None = (
            self.recorder.units[0][1].mesh_info.replicate_process_group if self.layout.hsdp else None)
        """This rank's column of the mesh: the replicas of its shard (FSDP2's own group)."""
        self.history = recovery.History()
        self.last_weights_digest: str | None = None
        self._told_unchecked = False

    def plan_lines(self) -> list[str]:
        """Which checks run for this mesh (logged once by the Guard)."""
        groups = [g for _, g in self.recorder.units]
        plain = all(g.gradient_divide_factor is None and not g.force_sum_reduction_for_comms for g in groups)
        user_hook = bool(self.recorder.user_all_reduce_hooks)
        plan = plan_checks(self.layout, reduce_scatter_checked=plain, all_reduce_checked=plain and not user_hook)
        return [self.layout.describe()] + plan.lines()

    def begin_step(self, step: int) -> None:
        self.recorder.begin_step(step)

    # -- before the update ---------------------------------------------------------------------

    def before_update(self, s: StepRecord, scale: Scale) -> Outcome:
        """Checks 1 and 4: one all-reduce of two float64s; the rows are gathered only when it says
        something is not finite or off."""
        started = time.perf_counter()
        mine = step_vote(self.recorder.records, self.layout, s.losses, self.coefficients)
        x, y = sum_votes(mine.vote.to(self.device), None)
        self.stats.timed("nonfinite", started)
        if not (math.isfinite(x) and math.isfinite(y)):
            rows = gather_norms(mine.row.to(self.device), None)
            bad = nonfinite_local_ranks(rows)
            if bad:
                return Outcome(nonfinite=nonfinite_micro(rows, bad), confirmed=False)
            verdict = judge_nonfinite(rows)  # a NaN/Inf that no local gradient had: inside a reduction
            return Outcome(self._sharded(verdict)) if verdict is not None else PASSED
        if mine.shape is None:
            if not self._told_unchecked:
                self._told_unchecked = True
                log.warning("sdcguard: step %d: no reduction of this step is FSDP2's plain average: check 4 skipped", s.step)
            return PASSED
        started = time.perf_counter()
        verdict = judge_checksum(x, y, mine.shape)
        if verdict is not None:
            rows = gather_norms(mine.row.to(self.device), None)  # every rank, to name the groups
            where = localize_checksum(rows, self.layout, mine.rs_elements, mine.ar_elements, mine.shape.dtypes)
            verdict = Verdict(verdict.check, evidence={**self._sharded(verdict).evidence, "groups": where})
        self.stats.timed("reduce_checksum", started)
        if verdict is not None:
            return Outcome(verdict)
        self.history.last_reduction_verified_step = s.step
        return PASSED

    def _sharded(self, verdict: Verdict) -> Verdict:
        mesh = {"replicas": self.layout.replicas, "shards": self.layout.shards}
        return Verdict(verdict.check, suspects=verdict.suspects, ambiguous=verdict.ambiguous,
                       evidence={**verdict.evidence, "mesh": mesh})

    # -- after the update ----------------------------------------------------------------------

    def weights(self, step: int) -> Verdict | None:
        """Check 3 on the weights after ``step``'s update: every shard across its replicas (HSDP);
        with one replica nothing runs and nothing is recorded as verified."""
        if not self.layout.hsdp:
            return None
        started = time.perf_counter()
        mine = fingerprint_shards(self.named_parameters)
        verdict = None
        if not replicas_agree(mine, self.device, self.replicate_group):
            verdict = shard_weights_verdict(mine, self.layout, self.device)
        if verdict is None:
            if self.history.last_weights_verified_step is None or step > self.history.last_weights_verified_step:
                self.history.last_weights_verified_step = step
            self.last_weights_digest = mine.digest.hex()
        self.stats.timed("weights", started)
        return verdict
