"""Pipeline parallelism (``torch.distributed.pipelining``) with DDP or FSDP2 over each stage.

The Guard is built on the schedule (``Guard(schedule, optimizer)``; the loss is the schedule's)
and a step runs it with ``s.run_schedule(x, target=y)``. Rank ``(replica i, position p)`` holds
stage ``p`` (or stages ``p, p + P, ...`` under an interleaved schedule) of replica ``i``; each
stage module is wrapped in ``DistributedDataParallel`` over the ranks holding the same stage, or
sharded over them with FSDP2's ``fully_shard`` (pure FSDP or HSDP; then "replica" ``i`` is the
rank's index in the stage's mesh: the pipeline that computes one batch). What differs between
the two lives in ``pipeline_stages``.

- Checks 1 and 4 read each stage's reductions before and after they run (DDP's comm hook, or
  FSDP2's recording reduce-scatter); every rank's share is summed in the one vote over the whole
  job, so every stage stops on the same step.
- Check 3 compares each stage's weights (each shard, under HSDP) across its replicas.
- Check 2: every replica replays the batch of the replica ``shift`` ahead (``checks/pipeline``),
  the whole pipeline schedule on a second set of stages built over the bare stage modules, with
  the real gradients set aside. Each rank compares its stage's gradients and what crossed its
  boundaries with its counterpart's own pass; the first stage whose output differs is named.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from ..checks.audit import Confirmation, judge_confirmation
from ..checks.commhook import ReduceHook
from ..checks.exchange import (DIGEST_BYTES, Incoming, agree, gather_digests, gather_objects, gather_tensor, ring_post,
                               serialize)
from ..checks.pipeline import BoundaryLog, Grid, StagePass, judge_pipeline_replays, read_grid, ring_shift, ring_target
from ..checks.reduce_checksum import Shape
from ..checks.replay import Payload, load_buffers, replay_mode, snapshot_buffers
from ..checks.replay_failures import CONFIRMATION, received_everywhere
from ..checks.rng import forward_seed, seeded
from ..checks.topology import Topology
from ..checks.verdict import Verdict
from ..checks.weights import WeightCheck, weights_verdict
from ..fingerprint import fingerprint_sums
from .base import Scale, StepRecord, Vote, all_true, answered, everywhere_finite, flag_token, replicas_token
from .pipeline_stages import StageReplicas, stage_replicas
from .pipeline_store import PipelineStore


def is_schedule(model: Any) -> bool:
    """Whether the Guard was given a pipeline schedule (no pipelining import for other models)."""
    import sys
    if "torch.distributed.pipelining" not in sys.modules:
        return False
    from torch.distributed.pipelining.schedules import _PipelineSchedule
    return isinstance(model, _PipelineSchedule)


class Pipeline:
    """The :class:`~sdcguard.layouts.base.Layout` of a pipeline schedule whose stages DDP or FSDP2 replicates."""

    group: dist.ProcessGroup | None = None
    """The whole job votes: a fault in one stage stops every stage on the same step."""
    wrappers: tuple[torch.nn.Module, ...] = ()
    compiled = False
    checks_weights = True

    def __init__(self, *, schedule: Any, topology: Topology, device: torch.device, seed: int,
                 optimizer: torch.optim.Optimizer, scaler: Any, reduce_hook: ReduceHook | None = None,
                 reduce_state: Any = None,
                 zero_update: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext) -> None:
        """``reduce_hook(reduce_state, bucket)``: each stage DDP's reduction inside sdcguard's comm
        hook (default: DDP's mean over the stage's data-parallel group), as for DDP."""
        if scaler is not None:
            raise TypeError("sdcguard: a GradScaler with a pipeline schedule is not checked (the schedule's "
                            "loss_fn would have to scale): train in bfloat16 autocast, or float32")
        self.schedule = schedule
        self.stages = list(getattr(schedule, "_stages", None) or [schedule._stage])
        refusal, replicas = None, None
        try:
            replicas = stage_replicas(self.stages, reduce_hook=reduce_hook, reduce_state=reduce_state, seed=seed)
        except TypeError as exc:
            refusal = str(exc)
        said = sorted({r for r in gather_objects(refusal, None, device) if r})
        if said or replicas is None:  # refused on every rank alike: none is left waiting in a collective
            raise TypeError(said[0] if said else refusal)
        self.replicas: StageReplicas = replicas
        self.modules = self.replicas.modules
        self.module: torch.nn.Module = torch.nn.ModuleDict(
            {f"stage{st.stage_index}": m for st, m in zip(self.stages, self.modules)})
        """This rank's stage modules, named by stage index: what its checkpoint file holds."""
        self.device = device
        self.seed = seed
        self.grid = self._read_grid()
        self.shift, self.crosses_nodes = ring_shift(self.grid, topology.ranks_per_node)
        ring = tuple(ring_target(self.grid, rank, self.shift) for rank in range(topology.world_size))
        self.topology = dataclasses.replace(topology, ring=ring)
        # Per stage this rank holds: its parameters, named with the stage so an alarm says where.
        self.stage_params = [[(f"stage{st.stage_index}.{n}", p) for n, p in m.named_parameters()]
                             for st, m in zip(self.stages, self.modules)]
        assert [n for n, _ in self.module.named_parameters()] == [n for ps in self.stage_params for n, _ in ps]
        self.named_parameters = [np for params in self.stage_params for np in params]
        self.checks_weights = self.replicas.weights_group is not None
        self.own_log = BoundaryLog()
        for stage in self.stages:
            self.own_log.install(stage)
        self.replay_log = BoundaryLog()
        self._replay_schedule: Any = None
        self._resumed = False
        """This run resumed from a checkpoint: its schedule's first step reduces regularly."""
        self.position_group = self.replicas.group or _position_group(self.grid, topology.rank)
        self.store = PipelineStore(module=self.module, optimizer=optimizer, named_parameters=self.named_parameters,
                                   grid=self.grid, topology=self.topology, device=device, replicas=self.replicas, group=self.position_group, zero_update=zero_update,
                                   on_load=self._on_load)

    def _read_grid(self) -> Grid:
        mine = {"pp": dist.get_process_group_ranks(self.stages[0].group),
                "dp": self.replicas.dp_ranks(),
                "stages": sorted(st.stage_index for st in self.stages), "num_stages": self.stages[0].num_stages,
                "replication": _replication(self.replicas), "checks_reduction": self.replicas.checks_reduction}
        everyone = gather_objects(mine, None, self.device)
        kinds = sorted({m["replication"] for m in everyone})
        if len(kinds) > 1:  # every rank refuses alike, before any group is made on some ranks only
            raise TypeError(f"sdcguard: the pipeline's stages are replicated by {' and '.join(kinds)}: replicate "
                            "every stage alike")
        # one vote over the job: check 4 is judged everywhere or nowhere (a stage's reduction that is
        # not a plain average turns it off for the whole job, as the start-up plan says)
        self.checks_reduction = all(m["checks_reduction"] for m in everyone)
        grid = read_grid(everyone)
        if isinstance(grid, str):
            raise TypeError(f"sdcguard: {grid}")
        return grid

    def plan_lines(self) -> list[str]:
        where = ("each replica's pipeline replays the batch of the replica "
                 f"{self.shift} ahead, on other nodes" if self.crosses_nodes else
                 "each stage's replicas share a node: a replay runs on another GPU of the same node (a fault of "
                 "one GPU is caught, a fault of a whole node is not)")
        lines = [self.grid.describe(), where,
                 "a fault in one stage's forward reaches every later stage and the whole backward: the first "
                 "stage whose output differs is named (boundary fingerprints), ambiguous with two replicas",
                 "guard.save_checkpoint writes a directory of one file per pipeline position and pipeline.json "
                 "(layouts/pipeline_store)"]
        if not self.checks_reduction:
            lines.append("does not run check 4 (reduce-checksum) anywhere: a stage's reduction is not a plain average "
                         "(one vote over the job)")
        return lines + self.replicas.plan_lines()

    # -- recording -------------------------------------------------------------------------------

    # The schedule's first step infers its shapes by running each stage's DDP forward outside
    # no_sync: that primes DDP's reducer, which then reduces that step's gradient in another order
    # than every later step (the last bits differ; plain DDP + pipelining does it too). So that
    # step is checked (1, 3, 4) but not audited: its local gradients are not what a replay
    # computes. After a resume, the first step runs under no_sync instead (the reduction of its
    # last backward still runs: the stage calls DDP's reducer itself), so it reduces as the
    # uninterrupted run did at that step, and the recovered run stays bit for bit on it.

    def _initialized(self) -> bool:
        return bool(getattr(self.schedule, "_stages_forward_initialized",
                            getattr(self.schedule, "_stage_forward_initialized", True)))

    def can_audit(self) -> bool:
        return self._initialized() or self._resumed or self.replicas.audits_first_step

    def _on_load(self) -> None:
        self._resumed = True

    def begin_step(self, step: int, audit: bool) -> None:
        self.replicas.begin_step(step, audit)
        self.own_log.start(audit)

    @contextlib.contextmanager
    def micro_batch(self, last: bool) -> Iterator[None]:
        """Around the schedule's step (it runs the micro-batches, DDP's no_sync included)."""
        if self._initialized() or not self._resumed:
            yield
            return
        with self.replicas.first_step_after_resume():  # see can_audit
            yield

    # -- checks 1 and 4 --------------------------------------------------------------------------

    def vote(self, s: StepRecord) -> Vote:
        # Each stage's reduction has its own bound; the summed vote needs one Shape on every rank,
        # so this rank's share of its stage's underflow term travels in y (the group's shares add up).
        mine = self.replicas.vote(self.device)
        vote = mine.vote + torch.tensor([0.0, mine.underflow], dtype=torch.float64, device=mine.vote.device)
        shape = Shape(world=self.topology.world_size, buckets=mine.buckets, elements=0, dtypes=())
        return Vote(vote, mine.rows, shape if self.checks_reduction else None)

    def reduced_gradients_finite(self) -> bool:
        return everywhere_finite(self.named_parameters, self.device, None)

    def confirm_nonfinite(self, step: int, bad: list[int], payload: Payload, scale: Scale) -> Confirmation:
        """Every replica replays the batch of the replica ahead (a pipeline replays together, once
        every rank holds its batch)."""
        topo, me = self.topology, self.topology.rank
        incoming = ring_post(serialize(payload), bytes(DIGEST_BYTES), send_to=topo.replayer_of(me),
                             recv_from=topo.replay_target(me), device=self.device, group=None)
        received = received_everywhere(step, lambda: Payload.from_wire(incoming.receive()), topo.replay_target(me),
                                       self.device, None, CONFIRMATION)
        result, finite = self._replay(received, check_finite=True)
        row = torch.tensor([0.0 if finite else math.inf, -1.0], dtype=torch.float64, device=self.device)
        parts = gather_tensor(row, None, "norms")
        replayed = {b: (parts[topo.replayer_of(b)][0].item(), None) for b in bad}
        confirmation = judge_confirmation(bad, replayed, {b: topo.replayer_of(b) for b in bad})
        if confirmation.verdict is None:
            return confirmation
        verdict = confirmation.verdict
        # A NaN made in one stage reaches every stage of its replica through the backward: which
        # stage made it is not known (the boundaries are fingerprinted on audit steps only).
        replicas = [self.grid.at[r][0] for r in verdict.suspects]
        spread = len(replicas) != len(set(replicas))
        verdict = Verdict(verdict.check, suspects=verdict.suspects, ambiguous=verdict.ambiguous or spread,
                          evidence=verdict.evidence)
        return Confirmation(confirmation.reproduced, self.annotate(verdict))

    def localize_checksum(self, verdict: Verdict, vote: Vote) -> Verdict:
        return self.annotate(verdict)  # the stages' reductions are summed: no stage can be named

    def annotate(self, verdict: Verdict) -> Verdict:
        coordinates = {r: {"replica": self.grid.at[r][0], "pipeline_position": self.grid.at[r][1],
                           "stages": list(self.grid.stages[r])} for r in verdict.suspects}
        return Verdict(verdict.check, suspects=verdict.suspects, ambiguous=verdict.ambiguous,
                       evidence={**verdict.evidence, "coordinates": coordinates,
                                 "mesh": {"pp": self.grid.positions, "dp": self.grid.replicas,
                                          "stages": self.grid.num_stages}})

    def seed_rank(self, rank: int) -> int:
        return rank

    # -- check 2 ---------------------------------------------------------------------------------

    def own_pass(self, s: StepRecord) -> StagePass:
        return self.own_log.into(s.loss_sums, self.replicas.own_grad_sums())  # one read to the host

    def post_batch(self, blob: torch.Tensor, own_digest: bytes) -> Incoming:
        topo, me = self.topology, self.topology.rank
        return ring_post(blob, own_digest, send_to=topo.replayer_of(me), recv_from=topo.replay_target(me),
                         device=self.device, group=None)

    def replay(self, step: int, incoming: Incoming, scale: Scale) -> tuple[StagePass | None, Exception | None]:
        """Collective across each replica's pipeline: every rank first agrees that each holds its
        batch (one missing would leave its pipeline waiting)."""
        received = received_everywhere(step, lambda: Payload.from_wire(incoming.receive()),
                                       self.topology.replay_target(self.topology.rank), self.device, None)
        result, _ = self._replay(received)
        return result, None

    def replay_verdict(self, own: StagePass, replayed: StagePass | None, digests: list[list[bytes]],
                       payload: Payload, scale: Scale) -> Verdict | None:
        topo = self.topology
        involved = {x for r in range(topo.world_size) if digests[r][1] != digests[topo.replay_target(r)][0]
                    for x in (r, topo.replay_target(r))}
        replicas = {self.grid.at[r][0] for r in involved}
        me = topo.rank
        said = gather_objects([own.to_json(), replayed.to_json()] if self.grid.at[me][0] in replicas
                              and replayed is not None else None, None, self.device)
        details = [None if d is None else [StagePass.from_json(d[0]), StagePass.from_json(d[1])] for d in said]
        verdict = judge_pipeline_replays(digests, topo.replay_target, self.grid, details)
        return self.annotate(verdict) if verdict is not None else None

    def _replay(self, payload: Payload, check_finite: bool = False) -> tuple[StagePass, bool]:
        """Run ``payload``'s pipeline step on the bare stage modules, leaving this rank's real
        gradients, buffers and RNG streams as they were; return what it recorded."""
        micro = payload.micro_batches[0]
        schedule = self._replay_schedule or self._build_replay_schedule()
        saved_buffers = [snapshot_buffers(m) for m in self.modules]
        losses: list[torch.Tensor] = []
        self.replay_log.start(True)
        try:
            with self.replicas.isolated(check_finite), replay_mode(), \
                    seeded(forward_seed(self.seed, payload.step, payload.owner, 0), self.device):
                schedule.step(*micro["args"], target=micro["target"], losses=losses, **micro["kwargs"])
                grads, flags = self.replicas.replay_grad_sums(check_finite)
            loss_sums = fingerprint_sums([loss.detach() for loss in losses])
            if check_finite:
                flags += [torch.isfinite(loss).all() for loss in losses]
            finite = all_true(flags)  # True when not asked for
        finally:
            self.replay_log.stop()
            for m, b in zip(self.modules, saved_buffers):
                load_buffers(m, b)
        return self.replay_log.into(loss_sums, grads), finite  # one read to the host

    def _build_replay_schedule(self) -> Any:
        """The user's schedule class over stages built on the replay modules (DDP's bare module: a
        replay's gradients stay on this rank; FSDP2's sharded one, whose reduce-scatters record and
        send nothing during a replay), unscaled (the owner's gradients are compared before the
        schedule divides them by the micro-batch count)."""
        from torch.distributed.pipelining import PipelineStage
        replay_stages = []
        for k, stage in enumerate(self.stages):
            replay_stage = PipelineStage(self.replicas.replay_module(k), stage.stage_index, stage.num_stages,
                                         stage.device, group=stage.group)
            self.replay_log.install(replay_stage)
            replay_stages.append(replay_stage)
        s = self.schedule
        first = replay_stages if hasattr(s, "_stages") else replay_stages[0]
        self._replay_schedule = type(s)(first, s._n_microbatches, loss_fn=s._loss_fn,
                                        args_chunk_spec=s._args_chunk_spec, kwargs_chunk_spec=s._kwargs_chunk_spec,
                                        output_merge_spec=s._output_merge_spec, scale_grads=False)
        return self._replay_schedule

    # -- check 3 ---------------------------------------------------------------------------------

    def fingerprint_weights(self) -> WeightCheck | None:
        return self.replicas.fingerprint_weights(self.named_parameters)

    def weights_token(self, weights: WeightCheck | None) -> Callable[[], tuple[bytes, bool]]:
        if weights is None:
            return answered(flag_token(True))  # pure FSDP over the stages: no replica to compare with
        return replicas_token(weights.digest, self.device, self.replicas.weights_group)  # each stage (shard) across its replicas

    def judge_weights(self, weights: WeightCheck, tokens: list[bytes] | None) -> Verdict | None:
        if tokens is not None and all(t == flag_token(True) for t in tokens):
            return None
        group = self.replicas.weights_group
        group_ranks = dist.get_process_group_ranks(group)
        digests = [d for [d] in gather_digests([weights.digest], self.device, group)]
        local = weights_verdict(weights, digests, dist.get_rank(group), group, self.device)
        mine = None if local is None else {"check": local.check, "suspects": [group_ranks[r] for r in local.suspects],
                                           "ambiguous": local.ambiguous, "evidence": local.evidence}
        said = [v for v in gather_objects(mine if dist.get_rank(group) == 0 else None, None, self.device)
                if v is not None]
        if not said:
            return None
        suspects = sorted({r for v in said for r in v["suspects"]})
        return self.annotate(Verdict(said[0]["check"], suspects=suspects, ambiguous=any(v["ambiguous"] for v in said),
                                     evidence={"stages": said}))

    def check_update(self, step: int) -> Verdict | None:
        return None  # DDP and HSDP stages have replicas (check 3 runs); pure FSDP's re-run is not wired here

    def weights_agree(self, weights: WeightCheck) -> bool:
        ok = agree(weights.digest, self.device, self.replicas.weights_group)
        return agree(flag_token(ok), self.device, None) and ok


def _position_group(grid: Grid, rank: int) -> dist.ProcessGroup:
    """The ranks of ``rank``'s pipeline position as one process group (collective: every rank
    creates every position's group, in the same order)."""
    mine = None
    for position in range(grid.positions):
        ranks = sorted(r for r, (_, p) in grid.at.items() if p == position)
        group = dist.new_group(ranks)
        if grid.at[rank][1] == position:
            mine = group
    assert mine is not None
    return mine


def _replication(replicas: StageReplicas) -> str:
    """What every stage's replication must match: the kind, and FSDP2's replicas x shards."""
    shape = replicas.mesh_shape
    return replicas.kind if shape is None else f"{replicas.kind} over {shape[0]} replicas x {shape[1]} shards"
