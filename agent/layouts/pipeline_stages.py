"""How a pipeline's stages are replicated: DDP over each stage, or FSDP2 (pure FSDP or HSDP).

The :class:`~sdcguard.layouts.pipeline.Pipeline` layout runs the schedule, the boundary log, the
replay ring and the attribution; what differs with the data parallelism over each stage lives
here, behind one small interface (:class:`StageReplicas`), so that the layout has no branch on it:

  - where checks 1 and 4 read the stage's reduction (DDP's comm hook, or FSDP2's recording
    reduce-scatter and all-reduce hook) and this rank's share of the one vote over the job;
  - what a replay runs the stage on and how it keeps the real step's gradients out of reach
    (DDP: the bare module, its ``.grad`` set aside; FSDP2: the sharded module itself, every
    reduce-scatter a no-op that records its local input, ``sharding/replay._isolated``);
  - what check 3 compares across the stage's replicas (the whole stage, or each shard), and
    with whom;
  - what a checkpoint file of one pipeline position holds (FSDP2: the stage's full state,
    gathered, so one file per position serves both kinds).
"""
from __future__ import annotations

import contextlib
import re
from typing import Any, Callable, Iterator, Protocol

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..checks.commhook import GradientRecorder, ReduceHook, record_then_reduce
from ..checks.reduce_checksum import Shape, rounding_bound
from ..checks.weights import WeightCheck, fingerprint_weights
from ..checks.pipeline import GradSums
from ..fingerprint import fingerprint_sums


class StageVote:
    """This rank's share of the job's ``[x, y]`` vote over its stages' reductions."""

    __slots__ = ("vote", "underflow", "buckets", "rows")

    def __init__(self, vote: torch.Tensor, underflow: float, buckets: int,
                 rows: Callable[[], torch.Tensor]) -> None:
        self.vote, self.underflow, self.buckets = vote, underflow, buckets
        self.rows = rows
        """``[local squared norm, reduced checksum]`` summed over the stages (gathered by check 1)."""


class StageReplicas(Protocol):
    """The data parallelism over this rank's stages (see the module docstring)."""

    kind: str
    mesh_shape: tuple[int, int] | None
    """FSDP2: replicas x shards over each stage; DDP: None."""
    modules: list[torch.nn.Module]
    """The stage modules the optimizer and the checkpoint see, by stage."""
    checks_reduction: bool
    audits_first_step: bool
    """Whether the schedule's first step (its shape inference) leaves the reduction as later steps'."""

    def dp_ranks(self) -> list[int]: ...
    def plan_lines(self) -> list[str]: ...
    def begin_step(self, step: int, audit: bool) -> None: ...
    def first_step_after_resume(self) -> contextlib.AbstractContextManager[None]: ...
    def vote(self, device: torch.device) -> StageVote: ...
    def own_grad_sums(self) -> GradSums:
        """This rank's own pass's gradient fingerprint sums, every stage it holds (on the device, unread)."""
    def replay_module(self, i: int) -> torch.nn.Module: ...
    def isolated(self, norms: bool) -> contextlib.AbstractContextManager[None]:
        """Around a replay (``norms``: its gradients' finiteness will be asked for)."""
    def replay_grad_sums(self, check_finite: bool) -> tuple[GradSums, list[torch.Tensor]]:
        """The replay's, and (``check_finite``) a flag per gradient, on the device: whether it is finite."""
    def fingerprint_weights(self, named_parameters: list[tuple[str, torch.nn.Parameter]]) -> WeightCheck | None: ...
    weights_group: dist.ProcessGroup | None
    """Whom check 3 compares this rank's weights with (None: nobody, pure FSDP)."""
    group: dist.ProcessGroup | None
    """The ranks holding this rank's stages, as one group, if there is one already (else the layout makes it)."""
    def state_names(self, names: list[str]) -> list[str]: ...
    def file_digest(self, weight_digest: str | None, state: dict[str, Any], model_key: str, names: list[str]) -> str: ...
    def loaded_digest(self, digest: str, module: torch.nn.Module, named_parameters: list[tuple[str, torch.nn.Parameter]],
                      model_key: str) -> str | None: ...
    def state(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]: ...
    def load_state(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, model: dict[str, Any],
                   optim: dict[str, Any]) -> None: ...


def stage_replicas(stages: list[Any], *, reduce_hook: ReduceHook | None, reduce_state: Any,
                   seed: int) -> StageReplicas:
    """The replicas of this rank's ``stages``: DDP or FSDP2, the same for every stage."""
    if all(isinstance(st.submod, DistributedDataParallel) for st in stages):
        return DdpStages(stages, reduce_hook, reduce_state, seed)
    if all(_is_fsdp(st.submod) for st in stages):
        if reduce_hook is not None:
            raise TypeError("sdcguard: a reduce_hook is DDP's; FSDP2 pipeline stages take none")
        return FsdpStages(stages, seed)
    raise TypeError("sdcguard: replicate each pipeline stage's module over the ranks holding the same stage before "
                    "building its PipelineStage: DistributedDataParallel, or FSDP2's fully_shard (pure FSDP or HSDP), "
                    "the same for every stage")


def _is_fsdp(module: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule
    return isinstance(module, FSDPModule)


def underflow_share(shape: Shape | None, ranks: int) -> float:
    """This rank's share of a reduction group's absolute underflow term (``reduce_checksum``'s
    bound at ``y = 0``), the group's ``ranks`` adding up to it: the job's summed vote needs one
    Shape on every rank, so each group's own term travels in y."""
    return 0.0 if shape is None or not shape.dtypes else rounding_bound(0.0, shape) / ranks


class DdpStages:
    """Each stage module wrapped in ``DistributedDataParallel`` over the ranks holding that stage."""

    kind = "DDP"
    mesh_shape: tuple[int, int] | None = None
    # The schedule's first step infers shapes by running DDP's forward outside no_sync: that
    # primes the reducer, which then reduces that step in another order (the last bits differ).
    audits_first_step = False

    def __init__(self, stages: list[Any], reduce_hook: ReduceHook | None, reduce_state: Any, seed: int) -> None:
        self.ddps: list[DistributedDataParallel] = [st.submod for st in stages]
        self.modules = [ddp.module for ddp in self.ddps]
        self.group = self.ddps[0].process_group
        if any(dist.get_process_group_ranks(d.process_group) != self.dp_ranks() for d in self.ddps):
            raise TypeError("sdcguard: the stages of one rank are replicated over different data-parallel groups")
        self.indices = [st.stage_index for st in stages]
        self.params = [list(m.parameters()) for m in self.modules]
        self.recorders = []
        for ddp, params in zip(self.ddps, self.params):
            recorder = GradientRecorder(params, ddp.process_group, reduce_hook, reduce_state, seed=seed)
            ddp.register_comm_hook(recorder, record_then_reduce)
            self.recorders.append(recorder)
        self.checks_reduction = all(r.checks_reduction for r in self.recorders)
        self.weights_group = self.group

    def dp_ranks(self) -> list[int]:
        return dist.get_process_group_ranks(self.group)

    def plan_lines(self) -> list[str]:
        lines = ["each stage DDP-replicated: checks 1 and 4 read its buckets, check 3 compares its replicas"]
        if not self.checks_reduction:
            lines.append("a stage's reduce hook is not DDP's mean: check 4 (reduce-checksum) is off")
        return lines

    def begin_step(self, step: int, audit: bool) -> None:
        for recorder in self.recorders:
            recorder.begin_step(audit, step)

    @contextlib.contextmanager
    def first_step_after_resume(self) -> Iterator[None]:
        # under no_sync the reducer is not primed by the shape inference; the last backward still
        # reduces (the stage calls DDP's reducer itself), as the uninterrupted run's did
        with contextlib.ExitStack() as stack:
            for ddp in self.ddps:
                stack.enter_context(ddp.no_sync())
            yield

    def vote(self, device: torch.device) -> StageVote:
        votes = [r.vote(device) for r in self.recorders]
        shapes = [r.shape() for r in self.recorders]
        underflow = sum(underflow_share(shape, shape.world) for shape in shapes)
        return StageVote(_sum(votes), underflow, sum(shape.buckets for shape in shapes),
                         lambda: _sum([r.rows(device) for r in self.recorders]))

    def own_grad_sums(self) -> GradSums:
        return [(i, indices, sums) for i, r in zip(self.indices, self.recorders)
                for indices, sums in r.pending_sums() or [([], fingerprint_sums([]))]]

    def replay_module(self, i: int) -> torch.nn.Module:
        return self.modules[i]  # the bare module: a replay's gradients stay on this rank

    @contextlib.contextmanager
    def isolated(self, norms: bool) -> Iterator[None]:
        params = [p for ps in self.params for p in ps]
        saved = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            yield
        finally:
            for p, g in zip(params, saved):
                p.grad = g

    def replay_grad_sums(self, check_finite: bool) -> tuple[GradSums, list[torch.Tensor]]:
        out: GradSums = []
        finite: list[torch.Tensor] = []
        for i, params in zip(self.indices, self.params):
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            out.append((i, list(range(len(grads))), fingerprint_sums(grads)))
            if check_finite:
                finite += [torch.isfinite(g).all() for g in grads]
        return out, finite

    def fingerprint_weights(self, named_parameters: list[tuple[str, torch.nn.Parameter]]) -> WeightCheck | None:
        return fingerprint_weights(named_parameters)

    def state_names(self, names: list[str]) -> list[str]:
        return names  # module.state_dict()'s keys

    def file_digest(self, weight_digest: str | None, state: dict[str, Any], model_key: str, names: list[str]) -> str:
        return weight_digest or ""  # check 3's digest of these very weights (checkpoint.save compares)

    def loaded_digest(self, digest: str, module: torch.nn.Module, named_parameters: list[tuple[str, torch.nn.Parameter]],
                      model_key: str) -> str | None:
        loaded = fingerprint_weights(named_parameters).digest.hex()
        if loaded != digest:
            from ..checkpoint import CheckpointError
            raise CheckpointError(f"the loaded weights have digest {loaded}, the manifest says {digest}")
        return digest

    def state(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
        return module.state_dict(), optimizer.state_dict()

    def load_state(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, model: dict[str, Any],
                   optim: dict[str, Any]) -> None:
        module.load_state_dict(model)
        optimizer.load_state_dict(optim)


_WRAPPER = re.compile(r"(?:_orig_mod|_checkpoint_wrapped_module)\.|\.(?:_orig_mod|_checkpoint_wrapped_module)$")


class FsdpStages:
    """Each stage module sharded with FSDP2's ``fully_shard`` over the ranks holding that stage
    (pure FSDP, or HSDP: replicas of each shard)."""

    kind = "FSDP2"
    audits_first_step = True  # the shape inference reduces nothing: the first step is as any other

    def __init__(self, stages: list[Any], seed: int) -> None:
        from ..sharding.fsdp_internals import require_supported
        from ..sharding.layout import plain_average, tensor_parallel_columns
        from ..sharding.reduce_record import ShardedRecorder
        from ..sharding.reduction_check import VoteCoefficients
        self.modules = [st.submod for st in stages]
        self.indices = [st.stage_index for st in stages]
        self.layout = None
        for module in self.modules:
            if tensor_parallel_columns(module) is not None:
                raise TypeError("sdcguard: a tensor-parallel pipeline stage is not checked yet (pipeline x tensor "
                                "parallelism): keep the stages' parameters FSDP2's only")
            layout = _stage_layout(module)
            if self.layout is not None and layout.grid != self.layout.grid:
                raise TypeError("sdcguard: the stages of one rank are sharded over different meshes")
            self.layout = layout
            require_supported(module, single_shard=layout.shards == 1)
        assert self.layout is not None
        self.mesh_shape: tuple[int, int] | None = (self.layout.replicas, self.layout.shards)
        """Replicas x shards of every stage's mesh (the same over the whole job, or refused)."""
        self.recorders = []
        for module in self.modules:
            recorder = ShardedRecorder(self.layout, seed)
            recorder.install(module)
            self.recorders.append(recorder)
        self.coefficients = [VoteCoefficients() for _ in self.recorders]
        self.checks_reduction = all(plain_average([g for _, g in r.units]) for r in self.recorders)
        info = self.recorders[0].units[0][1].mesh_info
        self.weights_group: dist.ProcessGroup | None = info.replicate_process_group if self.layout.hsdp else None
        self.group: dist.ProcessGroup | None = None if self.layout.hsdp else info.shard_process_group
        self._traces: list[Any] = []

    def dp_ranks(self) -> list[int]:
        return [r for row in self.layout.grid for r in row]

    def plan_lines(self) -> list[str]:
        m = self.layout
        lines = [f"each stage sharded with FSDP2: {m.describe()}; checks 1 and 4 read its reduce-scatters"
                 + (" and all-reduces" if m.hsdp else "")]
        if m.hsdp:
            lines.append("check 3 compares each shard of each stage across its replicas")
        else:
            lines.append("does not run check 3: one replica of each stage (pure FSDP) holds no copy to compare; "
                         "use HSDP over the stages for it (the update re-run of pure FSDP covers unpipelined models)")
        if not self.checks_reduction:
            lines.append("a stage's reduction is not FSDP2's plain average: check 4 (reduce-checksum) is off for it")
        return lines

    def begin_step(self, step: int, audit: bool) -> None:
        for recorder in self.recorders:
            recorder.begin_step(step, audit)

    def first_step_after_resume(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def vote(self, device: torch.device) -> StageVote:
        from ..sharding.reduction_check import step_vote
        votes = [step_vote(r.records, self.layout, [], c) for r, c in zip(self.recorders, self.coefficients)]
        underflow = sum(underflow_share(v.shape, self.layout.world_size) for v in votes)
        buckets = sum(v.shape.buckets for v in votes if v.shape is not None)
        return StageVote(_sum([v.vote.to(device) for v in votes]), underflow, buckets,
                         lambda: _sum([v.row[:2].to(device) for v in votes]))

    def own_grad_sums(self) -> GradSums:
        from ..sharding.replay import pass_key
        out: GradSums = []
        for i, recorder in zip(self.indices, self.recorders):
            records = [rec for rec in recorder.records if rec.fp is not None]
            out.append((i, [pass_key(rec.unit, rec.micro, len(recorder.units)) for rec in records],
                        torch.stack([rec.fp for rec in records]) if records else fingerprint_sums([])))
        return out

    def replay_module(self, i: int) -> torch.nn.Module:
        return self.modules[i]  # the sharded module: its all-gathers run with the stage's other ranks

    @contextlib.contextmanager
    def isolated(self, norms: bool) -> Iterator[None]:
        from ..sharding.reduce_record import ReplayTrace
        from ..sharding.replay import _isolated
        self._traces = [ReplayTrace(norms=norms) for _ in self.recorders]
        with contextlib.ExitStack() as stack:
            for module, recorder, trace in zip(self.modules, self.recorders, self._traces):
                stack.enter_context(_isolated(module, recorder, trace))
                stack.enter_context(_no_all_reduce(module))
            yield

    def replay_grad_sums(self, check_finite: bool) -> tuple[GradSums, list[torch.Tensor]]:
        from ..sharding.replay import pass_key
        out: GradSums = []
        finite: list[torch.Tensor] = []
        for i, recorder, trace in zip(self.indices, self.recorders, self._traces):
            calls = trace.calls
            # the pipeline reduces once per step, after its last backward: micro-batch 0, as in the owner's pass
            out.append((i, [pass_key(u, m, len(recorder.units)) for u, m, _, _ in calls],
                        torch.stack([c[2] for c in calls]) if calls else fingerprint_sums([])))
            if check_finite:
                finite += [torch.isfinite(c[3]).all() for c in calls]
        return out, finite

    def fingerprint_weights(self, named_parameters: list[tuple[str, torch.nn.Parameter]]) -> WeightCheck | None:
        from ..sharding.shard_weights import fingerprint_shards
        return fingerprint_shards(named_parameters) if self.layout.hsdp else None

    def state_names(self, names: list[str]) -> list[str]:
        # the full state dict's keys: torch.compile's and activation checkpointing's wrappers of a
        # block are not in them
        return [_WRAPPER.sub("", n) for n in names]

    def file_digest(self, weight_digest: str | None, state: dict[str, Any], model_key: str, names: list[str]) -> str:
        # check 3 compared shards; the file holds them gathered: its digest is of what it holds (the
        # store has the position's ranks, which each gathered the same state, agree on it)
        from ..checkpoint import state_digest
        return state_digest(state, model_key, names, where="the gathered stage state")

    def loaded_digest(self, digest: str, module: torch.nn.Module, named_parameters: list[tuple[str, torch.nn.Parameter]],
                      model_key: str) -> str | None:
        """The loaded shards gathered again (collective per stage) against the file's digest: a
        fault while sharding it back is not carried into the run as verified weights."""
        from ..checkpoint import CheckpointError, state_digest
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        loaded = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
        found = state_digest({model_key: loaded}, model_key, self.state_names([n for n, _ in named_parameters]),
                             where="the loaded stage state")
        if found != digest:
            raise CheckpointError(f"the loaded shards gather to weights of digest {found}, the file holds {digest}")
        return None  # check 3 compares shards from here on, not the file's digest

    def state(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
        """The stages' full (unsharded) state, the same on every rank of the position (collective
        over each stage's mesh)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
        options = StateDictOptions(full_state_dict=True)
        return (get_model_state_dict(module, options=options),
                get_optimizer_state_dict(module, optimizer, options=options))

    def load_state(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, model: dict[str, Any],
                   optim: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict
        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(module, model, options=options)
        set_optimizer_state_dict(module, optimizer, optim, options=options)


@contextlib.contextmanager
def _no_all_reduce(module: Any) -> Iterator[None]:
    """The schedule's ``perform_reduce_grad`` turns the stage's gradient sync back on before its
    reductions, which re-enables HSDP's all-reduce that ``_isolated`` turned off: during a replay
    this stage module turns it off again right after, so a replay sends nothing to other replicas."""
    real = type(module).set_requires_gradient_sync

    def set_requires_gradient_sync(requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        real(module, requires_gradient_sync, recurse=recurse)
        module.set_requires_all_reduce(False, recurse=recurse)

    module.set_requires_gradient_sync = set_requires_gradient_sync
    try:
        yield
    finally:
        del module.set_requires_gradient_sync


def _stage_layout(module: torch.nn.Module) -> Any:
    """The ShardLayout of one stage's FSDP2 mesh (global ranks; it holds only the stage's ranks)."""
    from ..sharding.layout import ShardLayout, mesh_ranks
    ranks, _ = mesh_ranks(module)
    rows = ranks if ranks and isinstance(ranks[0], list) else [ranks]  # a 1-D mesh: one replica
    return ShardLayout(tuple(tuple(int(r) for r in row) for row in rows), dist.get_rank())


def _sum(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(parts).sum(0) if len(parts) > 1 else parts[0]

