"""The checks of one step, in the order of docs/design.md, composed once for every layout.

Before the update: checks 1a/1b and 4 (one 16-byte all-reduce on every step), and on audit steps
checks 2 and 3 (the batch transfer to the ring neighbour, its replay, one more 16-byte agreement).
After the update, on weight-check steps: check 3. Each check is an exchange (the collectives, in
``checks/`` and the layout) followed by a pure judgement; this module only sequences them, times
them, and keeps the record of what passed (``recovery.History``), which checkpoints and alarms
read. What differs between DDP, FSDP2 and the other layouts is behind ``layouts.base.Layout``:
nothing here asks which one it holds.

A verdict is returned, never raised: the Guard reports it (``reporting``) and decides what a
reproduced NaN/Inf means for the user's loop.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import recovery
from .checks.exchange import DIGEST_BYTES, agreed, gather_digests, serialize, start_agreement, wait
from .checks.nonfinite import gather_norms, judge_nonfinite, nonfinite_local_ranks, start_sum, sum_votes
from .checks.reduce_checksum import failed_on_device, judge_checksum
from .checks.verdict import Verdict
from .checks.weights import WeightCheck
from .contract.stats import CheckStats
from .errors import ReplayError
from .checks.replay_failures import raise_replay_failures
from .layouts.base import Layout, Scale, StepRecord, Vote, gradients_finite, local_tensor

log = logging.getLogger("sdcguard")

__all__ = ["Outcome", "PASSED", "StepRecord", "Verifier"]


@dataclass(frozen=True, slots=True)
class Outcome:
    """What the checks before an update found."""

    verdict: Verdict | None = None
    """Silent data corruption: an alarm; the update must not be applied."""
    nonfinite: dict[int, int | None] | None = None
    """A NaN/Inf that is the data's or the model's (rank -> micro-batch), not the hardware's."""
    confirmed: bool = True
    """``nonfinite`` reproduced on another node (False: one replica, nobody to replay it on)."""


PASSED = Outcome()


class Verifier:
    """Runs the checks of each step on a layout; owns the record of what passed."""

    def __init__(self, layout: Layout, stats: CheckStats) -> None:
        self.layout = layout
        self.topology = layout.topology
        self.device = layout.device
        self.group = layout.group
        self.stats = stats
        self.solo = layout.topology.world_size == 1
        self.history = recovery.History()
        """What this run has verified: audits, weights, reductions, checkpoints."""
        self.last_weights_digest: str | None = None
        """The digest of the weights check 3 last verified (what a checkpoint must hold)."""

    # -- before the update ---------------------------------------------------------------------

    def before_update(self, s: StepRecord, scale: Scale) -> Outcome:
        """Checks 1a, 1b and 4; on audit steps then 2 and 3 (a NaN step is not replayed)."""
        if self.solo:
            return self._solo(s)
        if not s.audit:
            return self._nonfinite_and_reduction(s, scale) or PASSED
        return self._audit(s, scale)

    def _solo(self, s: StepRecord) -> Outcome:
        """One replica: only the local non-finite check can run, and it cannot be confirmed."""
        started = time.perf_counter()
        finite = gradients_finite(self.layout.named_parameters)
        self.stats.timed("nonfinite", started)
        if finite:
            return PASSED
        first = next((i for i, loss in enumerate(s.losses) if not bool(torch.isfinite(loss).all())), None)
        return Outcome(nonfinite={0: first}, confirmed=False)

    def _nonfinite_and_reduction(self, s: StepRecord, scale: Scale) -> Outcome | None:
        """Checks 1a, 1b and 4: one all-reduce of two scalars; the per-rank values are gathered
        only when it finds something non-finite. None when everything passed."""
        started = time.perf_counter()
        vote = self.layout.vote(s)
        x, y = sum_votes(vote.vote, self.group)  # the common case: 16 bytes
        self.stats.timed("nonfinite", started)
        return self._judge_sums(s, vote, x, y, scale)

    # -- before the update, decided on the device (Config.device_gate) --------------------------

    def on_device(self, s: StepRecord) -> tuple[torch.Tensor, Vote, torch.Tensor]:
        """Checks 1 and 4 of an ordinary step without a host sync: ``(found_inf, vote, sums)`` —
        the fused optimizer's mask (``reduce_checksum.failed_on_device``), this rank's vote with
        its per-rank row already taken, and the summed ``[X, Y]``, all on the device. The host
        judges the sums later with :meth:`settle`, to the same verdict."""
        started = time.perf_counter()
        if self.solo:
            finite = [torch.isfinite(local_tensor(p.grad)).all() for _, p in self.layout.named_parameters
                      if p.grad is not None]
            ok = torch.stack(finite).all() if finite else torch.ones((), dtype=torch.bool, device=self.device)
            total = torch.stack([ok.to(torch.float64), ok.to(torch.float64)]).log()  # [0, 0], or -inf: not finite
            vote = Vote(total, lambda: total, None)
        else:
            vote = self.layout.vote(s)
            total = _sum_on_device(vote.vote, self.group)
            row = vote.rows()  # now: the layout's records move on with the next step
            vote = Vote(vote.vote, lambda: row, vote.shape, vote.detail)
        found_inf = failed_on_device(total, vote.shape)
        self.stats.timed("nonfinite", started)
        return found_inf, vote, total

    def settle(self, s: StepRecord, vote: Vote, x: float, y: float, scale: Scale) -> Outcome:
        """The verdict of a step decided on the device, from its sums read back: the same judgement
        as :meth:`before_update` on an ordinary step, except that a non-finite sum is never taken
        for float32 overflow of finite gradients (the device already held that update back)."""
        if self.solo:
            if math.isfinite(x):
                return PASSED
            first = next((i for i, loss in enumerate(s.losses) if not bool(torch.isfinite(loss).all())), None)
            return Outcome(nonfinite={0: first}, confirmed=False)
        return self._judge_sums(s, vote, x, y, scale, deferred=True) or PASSED

    def _judge_sums(self, s: StepRecord, vote: Vote, x: float, y: float, scale: Scale,
                    deferred: bool = False) -> Outcome | None:
        if deferred and math.isfinite(x) and not math.isfinite(y):
            # Every local and reduced checksum was finite (X is), so every gradient was: only
            # their float32 squared norms overflowed. The gradients are gone by now (the plain
            # gate reads them instead); the device held this update back. Nothing to judge.
            log.warning("sdcguard: step %d: gradient norms overflowed float32; check 4 skipped", s.step)
            return None
        if not (math.isfinite(x) and math.isfinite(y)):
            if not deferred and self.layout.reduced_gradients_finite():
                # Finite gradients whose float32 norm overflowed (elements past ~1e19): a NaN/Inf
                # anywhere in a local gradient would have reached the reduced one. Nothing to
                # judge; check 4's bound is unknown for this step, so it does not run.
                log.warning("sdcguard: step %d: gradient norms overflowed float32; check 4 skipped", s.step)
                return None
            return self._judge_nonfinite(s, gather_norms(vote.rows(), self.group), scale)
        if vote.shape is not None:
            started = time.perf_counter()
            verdict = judge_checksum(x, y, vote.shape)
            if verdict is not None:
                verdict = self.layout.localize_checksum(verdict, vote)
            self.stats.timed("reduce_checksum", started)
            if verdict is not None:
                return Outcome(verdict)
            self.history.last_reduction_verified_step = s.step
        return None

    def _judge_nonfinite(self, s: StepRecord, norms: list[list[float]], scale: Scale) -> Outcome | None:
        """From every rank's ``[local, reduced]`` norms: check 1a (a NaN/Inf that does not
        reproduce on another node) or 1b; or, when every non-finite local gradient reproduces,
        the data's (or a GradScaler's honest overflow)."""
        bad = nonfinite_local_ranks(norms)
        if not bad:
            verdict = judge_nonfinite(norms)  # 1b, or an overflowed sum of finite norms
            return Outcome(self.layout.annotate(verdict)) if verdict is not None else None
        started = time.perf_counter()
        confirmation = self.layout.confirm_nonfinite(s.step, bad, s.payload, scale)
        self.stats.timed("replay", started)
        if confirmation.verdict is not None:
            return Outcome(confirmation.verdict)
        return Outcome(nonfinite=confirmation.reproduced)

    def _audit(self, s: StepRecord, scale: Scale) -> Outcome:
        """Checks 1a/1b and 4, then 2 and 3, with two collectives besides the batch transfer
        between ring neighbours (and the layout's own, if any): check 1's 16-byte vote is started
        first and travels while this rank's batch leaves for its replayer with the digest of its
        own pass, the weights are fingerprinted (before the replay), and the neighbour's batch is
        replayed and compared locally; then one 16-byte all-reduce says whether every rank's
        weights agree and its replay matched, and both answers reach the host in one read.

        Check 1's sums are judged first, as on an ordinary step: a step they stop (a NaN/Inf, a
        fault inside the all-reduce) is that step's outcome, and what the audit found is set aside
        (its replay ran on the same gradients; nothing of it is counted as a run). So is an audit
        that raised ``ReplayError`` (on every rank alike: a batch that could not be received):
        the sums are judged before the error is raised. Only when the agreement says no are the digests gathered and
        judged — weights, then replays — so that a weight fault is not taken for a compute fault."""
        step, layout = s.step, self.layout
        started = time.perf_counter()
        vote = layout.vote(s)
        total, vote_work = start_sum(vote.vote, self.group)
        self.stats.timed("nonfinite", started)  # its wait is the audit's, below
        started = time.perf_counter()
        try:
            own = layout.own_pass(s)
            own_digest = own.digest()
            incoming = layout.post_batch(serialize(s.payload), own_digest)
            weights_started = time.perf_counter()
            weights = layout.fingerprint_weights()
            weights_answer = layout.weights_token(weights)  # on its way while the replay runs
            weights_seconds = time.perf_counter() - weights_started
            replayed, failure = layout.replay(step, incoming, scale)
        except ReplayError as failed:
            # Raised on every rank alike (the layouts agree on a replay's readiness first), so
            # every rank may go on to judge the sums, which decide the step when they stop it.
            # Any other error may be this rank's alone: it propagates untouched, as before.
            wait(vote_work)
            x, y = total.tolist()
            outcome = self._judge_sums(s, vote, x, y, scale)
            if outcome is not None:
                log.warning("sdcguard: step %d: the audit failed (%s); check 1's sums decide the step", step, failed)
                return outcome
            raise
        started += weights_seconds  # the replay's time leaves the weights' out
        if failure is not None:
            log.error("sdcguard: replaying rank %d's batch failed: %s: %s",
                      self.topology.replay_target(self.topology.rank), type(failure).__name__, failure)
        replay_digest = replayed.digest() if replayed is not None else bytes(DIGEST_BYTES)
        matched = failure is None and replay_digest == incoming.note
        token, weights_ok = weights_answer()
        both, agree_work = start_agreement(token, self.device, self.group, veto=not (matched and weights_ok))
        wait(vote_work)
        wait(agree_work)
        x, y, *answer = torch.cat([total, both]).tolist()  # one read to the host for both
        judging = time.perf_counter()
        outcome = self._judge_sums(s, vote, x, y, scale)
        started += time.perf_counter() - judging  # checks 1 and 4 keep their own times
        if outcome is not None:
            return outcome  # the audit is set aside: neither its replay nor its weights count
        self.stats.add("weights", weights_seconds)
        verdict = None
        if agreed(answer):
            if weights is not None:
                self._weights_verified(step - 1, weights)  # the weights before this step's update
            self.history.last_audited_step = step
        else:
            digests = gather_digests([own_digest, replay_digest, token], self.device, self.group)
            if weights is not None:
                verdict = layout.judge_weights(weights, [d[2] for d in digests])
                if verdict is None:
                    self._weights_verified(step - 1, weights)
            if verdict is None:
                raise_replay_failures(step, failure, self.group, self.device)  # after a veto only
                verdict = layout.replay_verdict(own, replayed, [d[:2] for d in digests], s.payload, scale)
                if verdict is None:
                    self.history.last_audited_step = step
        self.stats.timed("replay", started)
        return PASSED if verdict is None else Outcome(verdict)

    # -- after the update ----------------------------------------------------------------------

    def weights(self, step: int) -> Verdict | None:
        """Check 3 on the weights after ``step``'s update; on success remember the step and digest.
        With no replica to compare with nothing is recorded as verified; pure FSDP re-runs each rank's
        update on its ring neighbour instead (``layout.check_update``), which verifies the update, not
        the shard it started from."""
        started = time.perf_counter()
        mine = self.layout.fingerprint_weights()
        if mine is None:
            verdict = self.layout.check_update(step)
            self.stats.timed("weights", started)
            return verdict
        verdict = None
        if self.solo or self.layout.weights_agree(mine):  # the common case: 16 bytes
            self._weights_verified(step, mine)
        else:
            verdict = self.layout.judge_weights(mine, None)
            if verdict is None:
                self._weights_verified(step, mine)
        self.stats.timed("weights", started)
        return verdict

    def _weights_verified(self, step: int, mine: WeightCheck) -> None:
        """Every replica held this rank's weights ``mine`` after ``step``'s update."""
        if self.history.last_weights_verified_step is None or step > self.history.last_weights_verified_step:
            self.history.last_weights_verified_step = step
        self.last_weights_digest = mine.digest.hex()


def _sum_on_device(vote: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every rank's ``[x, y]`` summed, left on the device (``nonfinite.sum_votes`` without its
    read): on NCCL the wait only orders the current stream after the all-reduce."""
    total, work = start_sum(vote, group)
    wait(work)
    return total
