"""FSDP2 (``fully_shard``): pure FSDP over a 1-D mesh, HSDP over ``(replicate, shard)``.

The pieces live in ``sharding/`` (docs/design.md §3, "Sharded models"): the recording reduce-scatter
and all-reduce hook (``reduce_record``), the mesh (``layout``), the collective replay (``replay``),
check 4's vote per reduction (``reduction_check``), check 3 per shard (``shard_weights``) and DCP
checkpoints (``dcp``). This class is what they give the checks.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from ..checks.audit import Confirmation
from ..checks.exchange import Incoming
from ..checks.nonfinite import gather_norms
from ..checks.replay import PassResult, Payload
from ..checks.replay_failures import received_everywhere
from ..checks.topology import Topology
from ..checks.verdict import Verdict
from ..checks.weights import WeightCheck
from ..sharding.fsdp_internals import require_supported
from ..sharding.layout import ShardLayout, plain_average, plan_checks, read_layout
from ..sharding.reduce_record import ShardedRecorder
from ..sharding.reduction_check import VoteCoefficients, localize_checksum, step_vote
from ..sharding.replay import ShardedReplayer, labels, own_pass
from ..sharding.shard_weights import fingerprint_shards, mesh_evidence, replicas_agree, shard_weights_verdict
from ..sharding.update_check import UpdateCheck
from .base import Scale, StepRecord, Vote, answered, everywhere_finite, flag_token, replicas_token
from .stores import DcpStore

log = logging.getLogger("sdcguard")


class Sharded:
    """The :class:`~sdcguard.layouts.base.Layout` of a model sharded with FSDP2 (pure FSDP or HSDP)."""

    group: dist.ProcessGroup | None = None
    """The whole mesh votes (the default group)."""
    wrappers: tuple[torch.nn.Module, ...] = ()

    def __init__(self, *, model: torch.nn.Module, compiled: bool, loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
                 topology: Topology, device: torch.device, seed: int, optimizer: torch.optim.Optimizer,
                 scaler: Any, zero_update: Callable[[], contextlib.AbstractContextManager[None]],
                 weight_check_every: int = 0) -> None:
        require_supported(model)
        self.mesh: ShardLayout = read_layout(model)
        topology = self.ring(self.mesh, topology)
        self.check_mesh(self.mesh, topology)
        if self.mesh.shards == 1:  # FSDP2 copies instead of reduce-scattering: its order is relied on
            require_supported(model, single_shard=True)
        self.module = model
        self.compiled = compiled
        self.topology = topology
        self.device = device
        self.named_parameters = list(model.named_parameters())
        self.recorder = ShardedRecorder(self.mesh, seed)
        self.recorder.install(model)
        self.replayer = ShardedReplayer(model=model, loss_fn=loss_fn, recorder=self.recorder, topology=topology,
                                        device=device, seed=seed)
        self.coefficients = VoteCoefficients()
        self.replicate_group: dist.ProcessGroup | None = (
            self.recorder.units[0][1].mesh_info.replicate_process_group if self.mesh.hsdp else None)
        """This rank's column of the mesh: the replicas of its shard (FSDP2's own group)."""
        self.checks_reduction = plain_average([g for _, g in self.recorder.units])
        self.checks_weights = self.mesh.hsdp
        self.store = DcpStore(model=model, optimizer=optimizer, scaler=scaler, named_parameters=self.named_parameters,
                              mesh=self.mesh, topology=topology, device=device, zero_update=zero_update)
        self._told_unchecked = False
        self.update_check: UpdateCheck | None = None
        """Pure FSDP: check 3's stand-in, the ring neighbour re-running each rank's update."""
        if not self.mesh.hsdp and self.mesh.tp == 1 and self.mesh.world_size == topology.world_size:
            self.update_check = UpdateCheck(optimizer=optimizer, named_parameters=self.named_parameters,
                                            topology=topology, device=device, weight_check_every=weight_check_every)
        self.checks_updates = self.update_check is not None and self.update_check.active
        """Weight-check steps re-run every rank's optimizer update on its ring neighbour."""

    def ring(self, mesh: ShardLayout, topology: Topology) -> Topology:
        """The topology whose replay ring this layout audits with (a subclass's own ring)."""
        return topology

    def check_mesh(self, mesh: ShardLayout, topology: Topology) -> None:
        """Refuse a mesh this layout cannot check (a subclass's own conditions)."""
        if mesh.tp > 1:
            raise TypeError("sdcguard: a tensor-parallel FSDP2 model is layouts.tensor_parallel's, not this one")

    def seed_rank(self, rank: int) -> int:
        return rank

    def plan_lines(self) -> list[str]:
        plain = self.checks_reduction
        user_hook = bool(self.recorder.user_all_reduce_hooks)
        plan = plan_checks(self.mesh, reduce_scatter_checked=plain, all_reduce_checked=plain and not user_hook)
        update = [self.update_check.plan_line()] if self.update_check is not None else []
        return [self.mesh.describe()] + plan.lines() + update

    # -- recording -------------------------------------------------------------------------------

    def can_audit(self) -> bool:
        return True

    def begin_step(self, step: int, audit: bool) -> None:
        self.recorder.begin_step(step, audit)
        if self.update_check is not None:
            self.update_check.begin_step(step)

    @contextlib.contextmanager
    def micro_batch(self, last: bool) -> Iterator[None]:
        # Gradient accumulation is FSDP2's own (set_requires_gradient_sync): the user's loop sets it.
        yield
        self.recorder.end_backward()  # the reduce-scatters that just ran belong to this micro-batch

    # -- checks 1 and 4 --------------------------------------------------------------------------

    def vote(self, s: StepRecord) -> Vote:
        mine = step_vote(self.recorder.records, self.mesh, s.losses, self.coefficients)
        if mine.shape is None and not self._told_unchecked:
            self._told_unchecked = True
            log.warning("sdcguard: step %d: no reduction of this step is FSDP2's plain average: check 4 skipped", s.step)
        return Vote(mine.vote.to(self.device), lambda: mine.row.to(self.device), mine.shape, detail=mine)

    def reduced_gradients_finite(self) -> bool:
        return everywhere_finite(self.named_parameters, self.device, None)

    def confirm_nonfinite(self, step: int, bad: list[int], payload: Payload, scale: Scale) -> Confirmation:
        confirmation = self.replayer.confirm_nonfinite(step, bad, payload, scale)
        if confirmation.verdict is None:
            return confirmation
        return Confirmation(confirmation.reproduced, self.annotate(confirmation.verdict))

    def localize_checksum(self, verdict: Verdict, vote: Vote) -> Verdict:
        mine = vote.detail
        rows = gather_norms(vote.rows(), None)  # every rank, to name the groups
        where = localize_checksum(rows, self.mesh, mine.rs_elements, mine.ar_elements, mine.shape.dtypes)
        return Verdict(verdict.check, evidence={**self.annotate(verdict).evidence, "groups": where})

    # -- check 2 ---------------------------------------------------------------------------------

    def own_pass(self, s: StepRecord) -> PassResult:
        return own_pass(self.recorder.records, s.loss_sums, len(self.recorder.units))

    def post_batch(self, blob: torch.Tensor, own_digest: bytes) -> Incoming:
        return self.replayer.post_batch(blob, own_digest)

    def replay(self, step: int, incoming: Incoming, scale: Scale) -> tuple[PassResult | None, Exception | None]:
        """A replay is collective (the forward and backward all-gather each unit): every rank first
        agrees that each holds its batch — one missing would leave the others in an all-gather — and a
        failure to receive is a ReplayError on every rank."""
        received = received_everywhere(step, lambda: Payload.from_wire(incoming.receive()),
                                       self.topology.replay_target(self.topology.rank), self.device, None)
        return self.replayer.run(received, scale), None

    def replay_verdict(self, own: PassResult, replayed: PassResult | None, digests: list[list[bytes]],
                       payload: Payload, scale: Scale) -> Verdict | None:
        self.replayer.names = labels(self.recorder, len(payload.micro_batches))
        verdict = self.replayer.verdict(own, replayed, digests, payload, scale)
        return self._named_groups(verdict) if verdict is not None else None

    def _named_groups(self, verdict: Verdict) -> Verdict:
        """A replay verdict with each suspect's place in the mesh and its shard group."""
        where = {r: self.where(r) for r in verdict.suspects}
        return self.annotate(Verdict(verdict.check, suspects=verdict.suspects, ambiguous=verdict.ambiguous,
                                      evidence={**verdict.evidence, "coordinates": where}))

    def where(self, rank: int) -> dict[str, Any]:
        """A suspect's place in the mesh, as an alarm's evidence states it."""
        at = self.mesh.coordinates(rank)
        return {**at, "shard_group": self.mesh.shard_group(at["replica"], at.get("tp"))}

    def annotate(self, verdict: Verdict) -> Verdict:
        """A verdict with the mesh's dimensions in its evidence (the alarm's ``mesh``)."""
        return Verdict(verdict.check, suspects=verdict.suspects, ambiguous=verdict.ambiguous,
                       evidence={**verdict.evidence, "mesh": mesh_evidence(self.mesh)})

    # -- check 3 ---------------------------------------------------------------------------------

    def fingerprint_weights(self) -> WeightCheck | None:
        return fingerprint_shards(self.named_parameters) if self.mesh.hsdp else None

    def weights_token(self, weights: WeightCheck | None) -> Callable[[], tuple[bytes, bool]]:
        if weights is None:
            return answered(flag_token(True))  # pure FSDP: no replica to compare with
        return replicas_token(weights.digest, self.device, self.replicate_group)  # each shard across its replicas

    def judge_weights(self, weights: WeightCheck, tokens: list[bytes] | None) -> Verdict | None:
        if tokens is not None and all(t == flag_token(True) for t in tokens):
            return None
        return shard_weights_verdict(weights, self.mesh, self.device)

    def weights_agree(self, weights: WeightCheck) -> bool:
        return replicas_agree(weights, self.device, self.replicate_group)

    def check_update(self, step: int) -> Verdict | None:
        """Pure FSDP, weight-check steps: every rank's update re-run by its ring neighbour (collective)."""
        verdict = self.update_check.check(step) if self.update_check is not None else None
        return self._named_groups(verdict) if verdict is not None else None

