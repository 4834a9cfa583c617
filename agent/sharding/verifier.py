"""The checks of one step of a sharded model, in order (the counterpart of ``verification.Verifier``).

Before the update: checks 1 and 4 from the step's reductions (one 16-byte all-reduce). A NaN/Inf
in a rank's own gradient is named by rank, before any reduction touched it, and confirmed as for
DDP: the whole mesh replays its ring targets' batches (``sharding/replay.py``); one that
reproduces elsewhere is the data's (``Outcome(nonfinite=...)``, no alarm), one that does not is
``nonfinite-local`` naming the rank. On audit steps then check 2: the mesh replays the ring's
batches together and each rank compares its replayed local gradients with the owner's, with check 3
of the weights before the update (HSDP) judged first. After the update, on weight-check steps:
check 3 per shard across its replicas (HSDP; pure FSDP has none). The Guard reads the same
``history`` and ``last_weights_digest`` as from the DDP verifier.
"""
from __future__ import annotations

import logging
import math
import time

import torch
import torch.distributed as dist

from typing import Any, Callable

from .. import recovery
from ..checks.exchange import DIGEST_BYTES, agree, gather_digests, gather_objects, serialize
from ..checks.nonfinite import gather_norms, judge_nonfinite, nonfinite_local_ranks, sum_votes
from ..checks.reduce_checksum import judge_checksum
from ..checks.topology import Topology
from ..checks.verdict import Verdict
from ..contract.stats import CheckStats
from ..errors import ReplayError
from ..verification import PASSED, Outcome, Scale, StepRecord
from .fsdp_internals import require_supported
from .layout import ShardLayout, plan_checks, read_layout
from .reduce_record import ShardedRecorder
from .reduction_check import VoteCoefficients, localize_checksum, step_vote
from .replay import ShardedReplayer, labels, own_pass
from .shard_weights import fingerprint_shards, replicas_agree, shard_weights_verdict

log = logging.getLogger("sdcguard")


class ShardedVerifier:
    """Runs the checks of each step of an FSDP2 model; owns the record of what passed."""

    def __init__(self, *, model: torch.nn.Module, named_parameters: list[tuple[str, torch.nn.Parameter]],
                 loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor], topology: Topology,
                 device: torch.device, stats: CheckStats, seed: int) -> None:
        require_supported(model)
        self.layout: ShardLayout = read_layout(model)
        if self.layout.shards == 1:  # FSDP2 copies instead of reduce-scattering: its order is relied on
            require_supported(model, single_shard=True)
        self.recorder = ShardedRecorder(self.layout, seed)
        self.recorder.install(model)
        self.topology = topology
        self.replayer = ShardedReplayer(model=model, loss_fn=loss_fn, recorder=self.recorder, topology=topology,
                                        device=device, seed=seed)
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

    @property
    def checks_reduction(self) -> bool:
        """Check 4 covers the reduce-scatters (see :func:`plain_average`)."""
        return plain_average([g for _, g in self.recorder.units])

    def plan_lines(self) -> list[str]:
        """Which checks run for this mesh (logged once by the Guard)."""
        plain = self.checks_reduction
        user_hook = bool(self.recorder.user_all_reduce_hooks)
        plan = plan_checks(self.layout, reduce_scatter_checked=plain, all_reduce_checked=plain and not user_hook)
        return [self.layout.describe()] + plan.lines()

    def begin_step(self, step: int, audit: bool = False) -> None:
        self.recorder.begin_step(step, audit)

    def end_backward(self) -> None:
        self.recorder.end_backward()

    # -- before the update ---------------------------------------------------------------------

    def before_update(self, s: StepRecord, scale: Scale) -> Outcome:
        """Checks 1 and 4, then on audit steps 2 (with 3 before the update, HSDP); a NaN step is
        not audited."""
        outcome = self._nonfinite_and_reduction(s, scale)
        if outcome is not PASSED or not s.audit:
            return outcome
        verdict = self._audit(s, scale)
        return PASSED if verdict is None else Outcome(verdict)

    def _nonfinite_and_reduction(self, s: StepRecord, scale: Scale) -> Outcome:
        """Checks 1 and 4: one all-reduce of two float64s; the rows are gathered only when it says
        something is not finite or off. A non-finite local gradient is confirmed by replay."""
        started = time.perf_counter()
        mine = step_vote(self.recorder.records, self.layout, s.losses, self.coefficients)
        x, y = sum_votes(mine.vote.to(self.device), None)
        self.stats.timed("nonfinite", started)
        if not (math.isfinite(x) and math.isfinite(y)):
            rows = gather_norms(mine.row.to(self.device), None)
            bad = nonfinite_local_ranks(rows)
            if bad:
                return self._confirm_nonfinite(s, bad, scale)
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

    def _confirm_nonfinite(self, s: StepRecord, bad: list[int], scale: Scale) -> Outcome:
        """Replay the non-finite ranks' batches on other nodes (the whole mesh replays): reproduced,
        the data's or the model's; not reproduced, silent data corruption naming the rank."""
        started = time.perf_counter()
        confirmation = self.replayer.confirm_nonfinite(bad, s.payload, scale)
        self.stats.timed("replay", started)
        if confirmation.verdict is not None:
            return Outcome(self._sharded(confirmation.verdict))
        return Outcome(nonfinite=confirmation.reproduced)

    # -- check 2 -------------------------------------------------------------------------------

    def _audit(self, s: StepRecord, scale: Scale) -> Verdict | None:
        """Check 2 (and, on HSDP, check 3 of the weights before the update): this rank's batch
        leaves for its replayer with the digest of its own pass; every rank agrees it holds a
        batch before the mesh replays them together (a replay is collective: one rank missing
        would leave the others waiting in an all-gather); one 16-byte agreement says whether every
        replay matched and every shard's replicas agree; only on a no are digests gathered and
        judged — weights first, so that a weight fault is not taken for a compute fault."""
        step = s.step
        started = time.perf_counter()
        units = len(self.recorder.units)
        own = own_pass(self.recorder.records, s.loss_fps, units)
        own_digest = own.digest()
        incoming = self.replayer.post_batch(serialize(s.payload), own_digest)
        weights = fingerprint_shards(self.named_parameters) if self.layout.hsdp else None
        weights_ok = weights is None or agree(weights.digest, self.device, self.replicate_group)
        received, failure = None, None
        try:
            received = incoming.receive()
        except Exception as exc:  # noqa: BLE001 - raised on every rank below
            log.exception("sdcguard: receiving rank %d's batch failed", self.topology.replay_target(self.topology.rank))
            failure = exc
        if not agree(bytes(DIGEST_BYTES), self.device, None, veto=failure is not None):
            self._raise_replay_failures(step, failure)
        replayed = self.replayer.run(received, scale)
        replay_digest = replayed.digest()
        matched = replay_digest == incoming.note
        verdict = None
        if agree(bytes(DIGEST_BYTES), self.device, None, veto=not (matched and weights_ok)):
            if weights is not None:
                self._weights_verified(step - 1, weights)  # the weights before this step's update
            self.history.last_audited_step = step
        else:
            flag = bytes([1 if weights_ok else 0]) * DIGEST_BYTES
            digests = gather_digests([own_digest, replay_digest, flag], self.device, None)
            if weights is not None and any(d[2] != bytes([1]) * DIGEST_BYTES for d in digests):
                verdict = shard_weights_verdict(weights, self.layout, self.device)
            if verdict is None:
                if weights is not None:
                    self._weights_verified(step - 1, weights)
                self.replayer.names = labels(self.recorder, len(s.payload.micro_batches))
                verdict = self.replayer.verdict(own, replayed, [d[:2] for d in digests], s.payload, scale)
                verdict = self._named_groups(verdict) if verdict is not None else None
                if verdict is None:
                    self.history.last_audited_step = step
        self.stats.timed("replay", started)
        return verdict

    def _raise_replay_failures(self, step: int, failure: Exception | None) -> None:
        said = gather_objects(None if failure is None else f"{type(failure).__name__}: {failure}", None, self.device)
        raise ReplayError(step, {rank: msg for rank, msg in enumerate(said) if msg is not None}) from failure

    def _named_groups(self, verdict: Verdict) -> Verdict:
        """A replay verdict with each suspect's place in the mesh and its shard group."""
        layout = self.layout
        where = {r: {**layout.coordinates(r), "shard_group": layout.shard_group(layout.coordinates(r)["replica"])}
                 for r in verdict.suspects}
        return self._sharded(Verdict(verdict.check, suspects=verdict.suspects, ambiguous=verdict.ambiguous,
                                     evidence={**verdict.evidence, "coordinates": where}))

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
            self._weights_verified(step, mine)
        self.stats.timed("weights", started)
        return verdict

    def _weights_verified(self, step: int, mine: Any) -> None:
        if self.history.last_weights_verified_step is None or step > self.history.last_weights_verified_step:
            self.history.last_weights_verified_step = step
        self.last_weights_digest = mine.digest.hex()


def plain_average(groups: list[Any]) -> bool:
    """Every FSDP2 param group reduces with FSDP2's plain average, or a plain sum (a divide factor of
    1.0, torchtitan's, or forced sum comms: ``reduce_record.plain_sum``), in float32 or bfloat16
    (FSDP2 pre- and post-divides a float16 one around a sum, which check 4 does not model). Read
    from the groups' policies: it holds before the first forward, when FSDP2 has not yet set its
    parameters' dtypes."""
    return all(g.gradient_divide_factor in (None, 1.0)
               and all(_reduce_dtype(g.mp_policy, p) in (torch.float32, torch.bfloat16) for p in g.fsdp_params)
               for g in groups)


def _reduce_dtype(policy: Any, param: Any) -> torch.dtype:
    """The dtype a parameter's gradient is reduced in: the policy's, else the gradient's own."""
    return policy.reduce_dtype or policy.param_dtype or param.sharded_param.dtype
