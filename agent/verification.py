"""The checks of one step, in the order of docs/design.md, composed: what they found, as an outcome.

Before the update: checks 1a/1b and 4 (one 16-byte all-reduce on every step), and on audit steps
checks 2 and 3 (the batch transfer to the ring neighbour, its replay, one more 16-byte agreement).
After the update, on weight-check steps: check 3. Each check is an exchange (the collectives, in
``checks/``) followed by a pure judgement; this module only sequences them, times them, and keeps
the record of what passed (``recovery.History``), which the checkpoints and alarms read.

A verdict is returned, never raised: the Guard reports it (``reporting``) and decides what a
reproduced NaN/Inf means for the user's loop.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from . import recovery
from .checks.audit import Replayer
from .checks.commhook import GradientRecorder
from .checks.exchange import DIGEST_BYTES, Incoming, agree, gather_digests, gather_objects, serialize, wait
from .checks.nonfinite import gather_norms, judge_nonfinite, nonfinite_local_ranks, sum_votes
from .checks.reduce_checksum import judge_checksum
from .checks.replay import PassResult, Payload
from .checks.topology import Topology
from .checks.verdict import Verdict
from .checks.weights import WeightCheck, fingerprint_weights, weights_verdict
from .contract.stats import CheckStats
from .errors import ReplayError

log = logging.getLogger("sdcguard")

Scale = Callable[[torch.Tensor], torch.Tensor] | None


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


@dataclass(frozen=True, slots=True)
class StepRecord:
    """What one step recorded for its checks (made by ``Step``)."""

    step: int
    audit: bool
    payload: Payload
    loss_fps: list[Any]
    losses: list[torch.Tensor]


class Verifier:
    """Runs the checks of each step; owns the record of what passed."""

    def __init__(self, *, recorder: GradientRecorder | None, replayer: Replayer, topology: Topology,
                 group: dist.ProcessGroup | None, device: torch.device,
                 named_parameters: list[tuple[str, torch.nn.Parameter]], stats: CheckStats) -> None:
        self.recorder = recorder
        self.replayer = replayer
        self.topology = topology
        self.group = group
        self.device = device
        self.named_parameters = named_parameters
        self.stats = stats
        self.solo = topology.world_size == 1
        self.history = recovery.History()
        """What this run has verified: audits, weights, reductions, checkpoints."""
        self.last_weights_digest: str | None = None
        """The digest of the weights check 3 last verified (what a checkpoint must hold)."""

    # -- before the update ---------------------------------------------------------------------

    def before_update(self, s: StepRecord, scale: Scale) -> Outcome:
        """Checks 1a, 1b and 4; on audit steps then 2 and 3 (a NaN step is not replayed)."""
        if self.solo:
            return self._solo(s)
        outcome = self._nonfinite_and_reduction(s, scale)
        if outcome is not None or not s.audit:
            return outcome or PASSED
        verdict = self._audit(s, scale)
        return PASSED if verdict is None else Outcome(verdict)

    def _solo(self, s: StepRecord) -> Outcome:
        """One replica: only the local non-finite check can run, and it cannot be confirmed."""
        started = time.perf_counter()
        if self.recorder is not None:
            finite = bool(torch.isfinite(self.recorder.rows(self.device)).all())
        else:
            finite = all(bool(torch.isfinite(p.grad).all()) for _, p in self.named_parameters if p.grad is not None)
        self.stats.timed("nonfinite", started)
        if finite:
            return PASSED
        first = next((i for i, loss in enumerate(s.losses) if not bool(torch.isfinite(loss).all())), None)
        return Outcome(nonfinite={0: first}, confirmed=False)

    def _nonfinite_and_reduction(self, s: StepRecord, scale: Scale) -> Outcome | None:
        """Checks 1a, 1b and 4: one all-reduce of two scalars; the per-rank values are gathered
        only when it finds something non-finite. None when everything passed."""
        started = time.perf_counter()
        x, y = sum_votes(self.recorder.vote(self.device), self.group)  # the common case: 16 bytes
        self.stats.timed("nonfinite", started)
        if not (math.isfinite(x) and math.isfinite(y)):
            if self._reduced_gradients_finite():
                # Finite gradients whose float32 norm overflowed (elements past ~1e19): a NaN/Inf
                # anywhere in a local gradient would have reached the reduced one. Nothing to
                # judge; check 4's bound is unknown for this step, so it does not run.
                log.warning("sdcguard: step %d: gradient norms overflowed float32; check 4 skipped", s.step)
                return None
            return self._judge_nonfinite(s, gather_norms(self.recorder.rows(self.device), self.group), scale)
        if self.recorder.checks_reduction:
            started = time.perf_counter()
            verdict = judge_checksum(x, y, self.recorder.shape())
            self.stats.timed("reduce_checksum", started)
            if verdict is not None:
                return Outcome(verdict)
            self.history.last_reduction_verified_step = s.step
        return None

    def _reduced_gradients_finite(self) -> bool:
        """Every rank's reduced gradients (now in ``.grad``) checked element by element, agreed."""
        finite = all(bool(torch.isfinite(p.grad).all()) for _, p in self.named_parameters if p.grad is not None)
        flag = torch.tensor([1.0 if finite else 0.0], dtype=torch.float64, device=self.device)
        wait(dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group, async_op=True))
        return bool(flag.item() == 1.0)

    def _judge_nonfinite(self, s: StepRecord, norms: list[list[float]], scale: Scale) -> Outcome:
        """From every rank's ``[local, reduced]`` norms: check 1a (a NaN/Inf that does not
        reproduce on another node) or 1b; or, when every non-finite local gradient reproduces,
        the data's (or a GradScaler's honest overflow)."""
        bad = nonfinite_local_ranks(norms)
        if not bad:
            verdict = judge_nonfinite(norms)  # 1b, or an overflowed sum of finite norms
            return Outcome(verdict) if verdict is not None else PASSED
        confirmation = self.replayer.confirm_nonfinite(bad, s.payload, scale)
        if confirmation.verdict is not None:
            return Outcome(confirmation.verdict)
        return Outcome(nonfinite=confirmation.reproduced)

    def _audit(self, s: StepRecord, scale: Scale) -> Verdict | None:
        """Checks 2 and 3 with one collective besides the batch transfer between ring
        neighbours: this rank's batch leaves for its replayer with the digest of its own pass,
        the weights are fingerprinted while it travels (before the replay), the neighbour's
        batch is replayed and compared locally, and one 16-byte all-reduce says whether every
        rank's weights agree and its replay matched. Only when it says no are the digests
        gathered and judged — weights, then replays — so that a weight fault is not taken for a
        compute fault."""
        step = s.step
        started = time.perf_counter()
        own = PassResult(list(s.loss_fps), self.recorder.fingerprints())
        own_digest = own.digest()
        incoming = self.replayer.post_batch(serialize(s.payload), own_digest)
        weights_started = time.perf_counter()
        weights = fingerprint_weights(self.named_parameters)
        self.stats.timed("weights", weights_started)
        started += time.perf_counter() - weights_started  # the replay's time leaves the weights' out
        replayed, failure = self._replay_neighbour(incoming, scale)
        replay_digest = replayed.digest() if replayed is not None else bytes(DIGEST_BYTES)
        matched = failure is None and replay_digest == incoming.note
        verdict = None
        if agree(weights.digest, self.device, self.group, veto=not matched):
            self._weights_verified(step - 1, weights)  # the weights before this step's update
            self.history.last_audited_step = step
        else:
            digests = gather_digests([weights.digest, own_digest, replay_digest], self.device, self.group)
            verdict = self._weights_verdict(step - 1, weights, [d[0] for d in digests])
            if verdict is None:
                self._raise_if_replays_failed(step, failure)
                verdict = self.replayer.verdict(own, replayed, [d[1:] for d in digests], s.payload, scale)
                if verdict is None:
                    self.history.last_audited_step = step
        self.stats.timed("replay", started)
        return verdict

    def _replay_neighbour(self, incoming: Incoming, scale: Scale) -> tuple[PassResult | None, Exception | None]:
        """Receive and replay the neighbour's batch. An exception is kept, not raised: this rank
        must still join the agreement (and veto it), or every other rank would wait there."""
        try:
            return self.replayer.run(incoming.receive(), scale), None
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
            log.exception("sdcguard: replaying rank %d's batch failed", self.topology.replay_target(self.topology.rank))
            return None, exc

    def _raise_if_replays_failed(self, step: int, failure: Exception | None) -> None:
        """Every rank learns which replays failed (this runs only after a vetoed agreement) and
        raises the same ReplayError."""
        said = gather_objects(None if failure is None else f"{type(failure).__name__}: {failure}", self.group, self.device)
        failures = {rank: msg for rank, msg in enumerate(said) if msg is not None}
        if failures:
            raise ReplayError(step, failures) from failure

    # -- after the update ----------------------------------------------------------------------

    def weights(self, step: int) -> Verdict | None:
        """Check 3 on the weights after ``step``'s update; on success remember the step and digest."""
        started = time.perf_counter()
        mine = fingerprint_weights(self.named_parameters)
        if self.solo or agree(mine.digest, self.device, self.group):  # the common case: 16 bytes
            self._weights_verified(step, mine)
            verdict = None
        else:
            digests = [d for [d] in gather_digests([mine.digest], self.device, self.group)]
            verdict = self._weights_verdict(step, mine, digests)
        self.stats.timed("weights", started)
        return verdict

    def _weights_verdict(self, step: int, mine: WeightCheck, digests: list[bytes]) -> Verdict | None:
        verdict = weights_verdict(mine, digests, self.topology.rank, self.group, self.device)
        if verdict is None:
            self._weights_verified(step, mine)
        return verdict

    def _weights_verified(self, step: int, mine: WeightCheck) -> None:
        """Every replica held this rank's weights ``mine`` after ``step``'s update."""
        if self.history.last_weights_verified_step is None or step > self.history.last_weights_verified_step:
            self.history.last_weights_verified_step = step
        self.last_weights_digest = mine.digest.hex()
