"""Pipeline parallelism (``torch.distributed.pipelining``) with DDP over each stage's replicas.

The Guard is built on the schedule (``Guard(schedule, optimizer)``; the loss is the schedule's)
and a step runs it with ``s.run_schedule(x, target=y)``. Rank ``(replica i, position p)`` holds
stage ``p`` (or stages ``p, p + P, ...`` under an interleaved schedule) of replica ``i``; each
stage module is wrapped in ``DistributedDataParallel`` over the ranks holding the same stage.

- Checks 1 and 4 read each stage's DDP buckets before and after their all-reduce (the comm hook,
  as for DDP); every rank's share is summed in the one vote over the whole job, so every stage
  stops on the same step.
- Check 3 compares each stage's weights across its replicas.
- Check 2: every replica replays the batch of the replica ``shift`` ahead (``checks/pipeline``),
  the whole pipeline schedule on a second set of stages built over the bare stage modules, with
  the real gradients set aside. Each rank compares its stage's gradients and what crossed its
  boundaries with its counterpart's own pass; the first stage whose output differs is named.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..checks.audit import Confirmation, judge_confirmation
from ..checks.commhook import GradientRecorder, ReduceHook, record_then_reduce
from ..checks.exchange import DIGEST_BYTES, Incoming, agree, gather_digests, gather_objects, gather_tensor, ring_exchange, ring_post
from ..checks.pipeline import BoundaryLog, Grid, StagePass, judge_pipeline_replays, read_grid, ring_shift, ring_target
from ..checks.reduce_checksum import Shape
from ..checks.replay import Payload, load_buffers, replay_mode, snapshot_buffers
from ..checks.rng import forward_seed, seeded
from ..checks.topology import Topology
from ..checks.verdict import Verdict
from ..checks.weights import WeightCheck, fingerprint_weights, weights_verdict
from ..fingerprint import fingerprint, fingerprint_many
from .base import Scale, StepRecord, Vote, everywhere_finite, flag_token, raise_replay_failures
from .pipeline_store import PipelineStore

log = logging.getLogger("sdcguard")


def is_schedule(model: Any) -> bool:
    """Whether the Guard was given a pipeline schedule (no pipelining import for other models)."""
    import sys
    if "torch.distributed.pipelining" not in sys.modules:
        return False
    from torch.distributed.pipelining.schedules import _PipelineSchedule
    return isinstance(model, _PipelineSchedule)


class Pipeline:
    """The :class:`~sdcguard.layouts.base.Layout` of a pipeline schedule whose stages DDP replicates."""

    group: dist.ProcessGroup | None = None
    """The whole job votes: a fault in one stage stops every stage on the same step."""
    wrappers: tuple[torch.nn.Module, ...] = ()
    compiled = False
    checks_weights = True

    def __init__(self, *, schedule: Any, topology: Topology, device: torch.device, seed: int,
                 optimizer: torch.optim.Optimizer, scaler: Any, reduce_hook: ReduceHook | None = None,
                 reduce_state: Any = None) -> None:
        """``reduce_hook(reduce_state, bucket)``: each stage DDP's reduction inside sdcguard's comm
        hook (default: DDP's mean over the stage's data-parallel group), as for DDP."""
        if scaler is not None:
            raise TypeError("sdcguard: a GradScaler with a pipeline schedule is not checked (the schedule's "
                            "loss_fn would have to scale): train in bfloat16 autocast, or float32")
        self.schedule = schedule
        self.stages = list(getattr(schedule, "_stages", None) or [schedule._stage])
        self.ddps = [_stage_ddp(stage) for stage in self.stages]
        self.modules = [ddp.module for ddp in self.ddps]
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
        self.dp_group = self.ddps[0].process_group
        self.recorders = []
        for ddp, params in zip(self.ddps, self.stage_params):
            recorder = GradientRecorder([p for _, p in params], ddp.process_group, reduce_hook, reduce_state, seed=seed)
            ddp.register_comm_hook(recorder, record_then_reduce)
            self.recorders.append(recorder)
        self.checks_reduction = all(r.checks_reduction for r in self.recorders)
        self.last_stages = {st.stage_index for st in self.stages if st.is_last}
        self.own_log = BoundaryLog()
        for stage in self.stages:
            self.own_log.install(stage)
        self.replay_log = BoundaryLog()
        self._replay_schedule: Any = None
        self._resumed = False
        """This run resumed from a checkpoint: its schedule's first step reduces regularly."""
        self.store = PipelineStore(module=self.module, optimizer=optimizer, named_parameters=self.named_parameters,
                                   grid=self.grid, topology=self.topology, device=device, dp_group=self.dp_group,
                                   on_load=self._on_load)

    def _read_grid(self) -> Grid:
        mine = {"pp": dist.get_process_group_ranks(self.stages[0].group),
                "dp": dist.get_process_group_ranks(self.ddps[0].process_group),
                "stages": sorted(st.stage_index for st in self.stages), "num_stages": self.stages[0].num_stages}
        if any(dist.get_process_group_ranks(d.process_group) != mine["dp"] for d in self.ddps):
            raise TypeError("sdcguard: the stages of one rank are replicated over different data-parallel groups")
        grid = read_grid(gather_objects(mine, None, self.device))
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
                 "checkpoints: a directory of one file per pipeline position and pipeline.json (layouts/pipeline_store)"]
        if not self.checks_reduction:
            lines.append("a stage's reduce hook is not DDP's mean: check 4 (reduce-checksum) is off")
        return lines

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
        return self._initialized() or self._resumed

    def _on_load(self) -> None:
        self._resumed = True

    def begin_step(self, step: int, audit: bool) -> None:
        for recorder in self.recorders:
            recorder.begin_step(audit, step)
        self.own_log.start(audit)

    @contextlib.contextmanager
    def micro_batch(self, last: bool) -> Iterator[None]:
        """Around the schedule's step (it runs the micro-batches, DDP's no_sync included)."""
        if self._initialized() or not self._resumed:
            yield
            return
        with contextlib.ExitStack() as stack:  # a resumed run's first step: see can_audit
            for ddp in self.ddps:
                stack.enter_context(ddp.no_sync())
            yield

    # -- checks 1 and 4 --------------------------------------------------------------------------

    def vote(self, s: StepRecord) -> Vote:
        votes = [r.vote(self.device) for r in self.recorders]
        mine = torch.stack(votes).sum(0) if len(votes) > 1 else votes[0]
        # Each stage's reduction has its own bound; the summed vote needs one Shape on every rank,
        # so this rank's share of its stage's underflow term travels in y (W ranks add W shares).
        underflow = sum(_underflow_share(r.shape()) for r in self.recorders)
        mine = mine + torch.tensor([0.0, underflow], dtype=torch.float64, device=mine.device)
        shape = Shape(world=self.topology.world_size, buckets=sum(r.shape().buckets for r in self.recorders),
                      elements=0, dtypes=())
        return Vote(mine, self._rows, shape if self.checks_reduction else None)

    def _rows(self) -> torch.Tensor:
        rows = [r.rows(self.device) for r in self.recorders]
        return torch.stack(rows).sum(0) if len(rows) > 1 else rows[0]

    def reduced_gradients_finite(self) -> bool:
        return everywhere_finite(self.named_parameters, self.device, None)

    def confirm_nonfinite(self, bad: list[int], payload: Payload, scale: Scale) -> Confirmation:
        """Every replica replays the batch of the replica ahead (a pipeline replays together)."""
        topo, me = self.topology, self.topology.rank
        theirs = ring_exchange(payload, send_to=topo.replayer_of(me), recv_from=topo.replay_target(me),
                               device=self.device, group=None)
        result, finite = self._replay(Payload.from_wire(theirs), check_finite=True)
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
        result = StagePass(losses=list(s.loss_fps))
        for stage, recorder in zip(self.stages, self.recorders):
            result.grads[stage.stage_index] = recorder.fingerprints()
        return self.own_log.into(result, self.last_stages)

    def post_batch(self, blob: torch.Tensor, own_digest: bytes) -> Incoming:
        topo, me = self.topology, self.topology.rank
        return ring_post(blob, own_digest, send_to=topo.replayer_of(me), recv_from=topo.replay_target(me),
                         device=self.device, group=None)

    def replay(self, step: int, incoming: Incoming, scale: Scale) -> tuple[StagePass | None, Exception | None]:
        """Collective across each replica's pipeline: every rank first agrees that each holds its
        batch (one missing would leave its pipeline waiting)."""
        received, failure = None, None
        try:
            received = Payload.from_wire(incoming.receive())
        except Exception as exc:  # noqa: BLE001 - raised on every rank below
            log.exception("sdcguard: receiving rank %d's batch failed", self.topology.replay_target(self.topology.rank))
            failure = exc
        if not agree(bytes(DIGEST_BYTES), self.device, None, veto=failure is not None):
            raise_replay_failures(step, failure, None, self.device)
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
        params = [p for _, p in self.named_parameters]
        saved_grads = [p.grad for p in params]
        saved_buffers = [snapshot_buffers(m) for m in self.modules]
        losses: list[torch.Tensor] = []
        for p in params:
            p.grad = None
        self.replay_log.start(True)
        try:
            with replay_mode(), seeded(forward_seed(self.seed, payload.step, payload.owner, 0), self.device):
                schedule.step(*micro["args"], target=micro["target"], losses=losses, **micro["kwargs"])
            result = StagePass(losses=[fingerprint(loss.detach()) for loss in losses])
            finite = all(bool(torch.isfinite(loss).all()) for loss in losses)
            for stage, params_of in zip(self.stages, self.stage_params):
                grads = [p.grad if p.grad is not None else torch.zeros_like(p) for _, p in params_of]
                result.grads[stage.stage_index] = dict(enumerate(fingerprint_many(grads)))
                if check_finite:
                    finite = finite and all(bool(torch.isfinite(g).all()) for g in grads)
        finally:
            self.replay_log.stop()
            for p, g in zip(params, saved_grads):
                p.grad = g
            for m, b in zip(self.modules, saved_buffers):
                load_buffers(m, b)
        return self.replay_log.into(result, self.last_stages), finite

    def _build_replay_schedule(self) -> Any:
        """The user's schedule class over stages built on the bare modules (no DDP: a replay's
        gradients stay on this rank), unscaled (the owner's gradients are compared before the
        schedule divides them by the micro-batch count)."""
        from torch.distributed.pipelining import PipelineStage
        replay_stages = []
        for stage, module in zip(self.stages, self.modules):
            replay_stage = PipelineStage(module, stage.stage_index, stage.num_stages, stage.device, group=stage.group)
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
        return fingerprint_weights(self.named_parameters)

    def weights_token(self, weights: WeightCheck | None) -> tuple[bytes, bool]:
        ok = agree(weights.digest, self.device, self.dp_group)  # each stage across its replicas
        return flag_token(ok), ok

    def judge_weights(self, weights: WeightCheck, tokens: list[bytes] | None) -> Verdict | None:
        if tokens is not None and all(t == flag_token(True) for t in tokens):
            return None
        group_ranks = dist.get_process_group_ranks(self.dp_group)
        digests = [d for [d] in gather_digests([weights.digest], self.device, self.dp_group)]
        local = weights_verdict(weights, digests, dist.get_rank(self.dp_group), self.dp_group, self.device)
        mine = None if local is None else {"check": local.check, "suspects": [group_ranks[r] for r in local.suspects],
                                           "ambiguous": local.ambiguous, "evidence": local.evidence}
        said = [v for v in gather_objects(mine if dist.get_rank(self.dp_group) == 0 else None, None, self.device)
                if v is not None]
        if not said:
            return None
        suspects = sorted({r for v in said for r in v["suspects"]})
        return self.annotate(Verdict(said[0]["check"], suspects=suspects, ambiguous=any(v["ambiguous"] for v in said),
                                     evidence={"stages": said}))

    def check_update(self, step: int) -> Verdict | None:
        return None  # every stage has replicas: check 3 itself runs (fingerprint_weights is never None)

    def weights_agree(self, weights: WeightCheck) -> bool:
        ok = agree(weights.digest, self.device, self.dp_group)
        return agree(flag_token(ok), self.device, None) and ok


def _stage_ddp(stage: Any) -> DistributedDataParallel:
    module = stage.submod
    if not isinstance(module, DistributedDataParallel):
        raise TypeError("sdcguard: wrap each pipeline stage's module in DistributedDataParallel over the ranks "
                        "holding the same stage before building its PipelineStage (FSDP2 stages are not checked yet)")
    return module


def _underflow_share(shape: Shape) -> float:
    """This rank's share (1/W of its stage's) of ``reduce_checksum``'s absolute underflow term,
    ``5 W eta n``: half the smallest subnormal of the widest-ranging element type, per element."""
    if not shape.dtypes:
        return 0.0
    eta = max(torch.finfo(d).tiny * torch.finfo(d).eps / 2 for d in shape.dtypes)
    return 5 * eta * shape.elements

