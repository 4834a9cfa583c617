"""FSDP2's gradient reduction, recorded on the way in and out: what checks 1 and 4 need of a
sharded model (the counterpart of ``checks/commhook.py`` for DDP).

FSDP2 reduces each ``fully_shard`` unit's gradients in ``foreach_reduce``: the local unsharded
gradients are copied into one flat input laid out as ``S`` rows (row ``j`` goes to shard rank
``j``), divided if needed, reduce-scattered within the shard group with the op FSDP2 chose (on
float32/bfloat16 without a divide factor: ``ReduceOp.AVG``), and for HSDP the output is then
all-reduced across the replicas (``AVG`` again), after which the all-reduce hook runs. Two public
hook points see exactly those tensors, and nothing here changes a bit of them:

  - ``FSDPModule.set_custom_reduce_scatter``: :class:`RecordingReduceScatter` reads each row of
    this rank's input — the local gradient *before* any other rank's is added — for its weighted
    checksum and squared norm (``reduce_checksum.ChecksumWeights``: check 4's operands, and check
    1's finiteness), calls the reduce-scatter FSDP2 would have called (same tensors, same op, same
    group), and reads the output's checksum and squared norm;
  - ``FSDPModule.set_all_reduce_hook`` (HSDP only): the all-reduced shard's checksum.

The reduce-scatter output is the all-reduce's local operand, so its checksum serves both checks.
Faults for tests and drills plug in through ``before_reduce_scatter`` / ``after_reduction``, so
they strike before the recording, where failing hardware would.

A shard group of one rank (an HSDP mesh ``(R, 1)``: torchtitan's data-parallel-only setting) has
no reduce-scatter: ``foreach_reduce`` never calls the comm, it copies the filled input into the
output (divided by a ``gradient_divide_factor``, if set) and all-reduces that across the replicas.
It still asks the comm for both buffers, in this order: ``allocate(input)``, the copy-in of the
local gradients, ``allocate(output)``, the copy, the all-reduce, the all-reduce hook
(``fsdp_internals.single_shard_gaps`` checks that order at start-up). So the second ``allocate``
is where the input is filled and not yet copied: :class:`RecordingReduceScatter` records it there
— check 1's norms, check 2's fingerprint, and, as the all-reduce's operand, its checksum (the
output is a bitwise copy of it) — and the all-reduce hook records the result, so check 4 covers
the copy and the all-reduce together, exactly DDP's case. There is no reduce-scatter to check.

On audit steps each local input is also fingerprinted (check 2 compares it with another rank's
replay of this rank's batch); during that replay (``sharding/replay.py``) the same hook records the
replayed local input into a :class:`ReplayTrace` instead and reduces nothing: the replay's
reduce-scatter is a no-op, so no replayed gradient reaches another rank (docs/design.md §3).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from ..checks.exchange import hold
from ..checks.norms import squared_norm
from ..checks.reduce_checksum import ChecksumWeights
from ..fingerprint import fingerprint_sums
from .layout import ShardLayout, param_groups

__all__ = ["Reduction", "ShardedRecorder", "RecordingReduceScatter"]

TensorHook = Callable[[int, torch.Tensor], None]
"""``hook(unit, tensor)``: may change the tensor in place (a fault); runs before it is recorded."""


@dataclass(slots=True)
class ReplayTrace:
    """What the no-op reduce-scatters of one replay saw: per call ``(unit, micro-batch, local
    input's fingerprint sums, its squared norm or None)``, in call order."""

    micro: int = 0
    """The micro-batch being replayed now (set by the replay loop)."""
    calls: list[tuple[int, int, torch.Tensor, torch.Tensor | None]] = field(default_factory=list)
    norms: bool = True
    """Record each local input's squared norm (a confirmation of a NaN/Inf reads it; an audit's
    replay does not, and skips that read of every local input)."""


@dataclass(slots=True)
class Reduction:
    """What one reduce-scatter (and its all-reduce) of one unit recorded on this rank."""

    unit: int
    chunks: torch.Tensor
    """``(S, 2)`` float64: ``[checksum, squared norm]`` of each row of this rank's local input."""
    elements: int
    """Elements of one row (the output shard), padding included."""
    dtype: torch.dtype
    shard: torch.Tensor | None = None
    """``[checksum, squared norm]`` of this rank's reduce-scatter output."""
    replicated: torch.Tensor | None = None
    """The checksum of the all-reduce's output (HSDP), once the all-reduce hook ran."""
    micro: int = 0
    """The micro-batch whose backward ran this reduce-scatter."""
    fp: torch.Tensor | None = None
    """The local input's fingerprint sums (audit steps only; ``fingerprint_sums``, on its device)."""
    rs_checked: bool = True
    """The reduce-scatter is FSDP2's plain average (check 4 applies to it)."""
    ar_checked: bool = False
    """An all-reduce averages (or sums) exactly this output across replicas (HSDP, not deferred)."""
    sums: bool = False
    """The reductions add instead of averaging (a ``gradient_divide_factor`` of 1.0, torchtitan's, or
    forced sum comms; FSDP2 divides after the all-reduce hook, if at all): the recorded outputs are
    ``S`` (reduce-scatter) and ``R`` (all-reduce) times the means check 4 compares."""
    copied: bool = False
    """A one-rank shard group: FSDP2 copied the input instead of reduce-scattering it (the recorded
    output is the input's; ``rs_checked`` is False)."""


class ShardedRecorder:
    """State of the recording hooks of every unit: settings first, then one step's records."""

    __slots__ = ("layout", "weights", "units", "comms", "before_reduce_scatter", "after_reduction",
                 "user_all_reduce_hooks", "records", "last", "fingerprints", "micro", "replay")

    def __init__(self, layout: ShardLayout, seed: int = 0) -> None:
        # Settings.
        self.layout = layout
        self.weights = ChecksumWeights(seed)
        self.units: list[tuple[str, Any]] = []
        """``(module path, FSDPParamGroup)`` per unit, in module order (the same on every rank)."""
        self.comms: list[RecordingReduceScatter] = []
        self.before_reduce_scatter: list[TensorHook] = []
        """Run on the local input before it is recorded (fault injection)."""
        self.after_reduction: list[TensorHook] = []
        """Run on the reduced shard — the all-reduce's output with HSDP, else the reduce-scatter's —
        before it is recorded (fault injection)."""
        self.user_all_reduce_hooks: dict[int, Callable[[torch.Tensor], None]] = {}
        # Per step.
        self.records: list[Reduction] = []
        self.last: dict[int, Reduction] = {}
        """unit -> its latest reduce-scatter, which the all-reduce hook completes."""
        self.fingerprints = False
        """Fingerprint each local input (this step is audited)."""
        self.micro = 0
        """The micro-batch whose backward runs now (``end_backward`` counts them)."""
        self.replay: ReplayTrace | None = None
        """Set while a replay runs: the hooks record into it and reduce nothing."""

    def install(self, model: torch.nn.Module) -> None:
        """Put the recording reduce-scatter (and, for HSDP, the all-reduce hook) on every unit."""
        for unit, (path, module, group) in enumerate(param_groups(model)):
            self.units.append((path, group))
            comm = RecordingReduceScatter(self, unit, group, group._reduce_scatter_comm)
            self.comms.append(comm)
            module.set_custom_reduce_scatter(comm)
            if self.layout.hsdp:
                if group._all_reduce_hook is not None:
                    self.user_all_reduce_hooks[unit] = group._all_reduce_hook
                module.set_all_reduce_hook(_AllReduceRecorder(self, unit))

    def begin_step(self, step: int, audit: bool = False) -> None:
        """Forget the previous step; this step's checksum weights are offset by ``step``."""
        self.weights.begin_step(step)
        self.records = []
        self.last = {}
        self.fingerprints = audit
        self.micro = 0
        for comm in self.comms:
            comm.pending = None  # a reduction an exception cut short leaves no half-recorded input

    def end_backward(self) -> None:
        """One micro-batch's backward is done (its reduce-scatters have run)."""
        self.micro += 1

    def sync_pattern(self) -> dict[int, set[int]]:
        """micro-batch -> the units that reduce-scattered in its backward (FSDP2 may accumulate
        without reducing: ``set_requires_gradient_sync(False)``); a replay repeats it."""
        pattern: dict[int, set[int]] = {}
        for rec in self.records:
            pattern.setdefault(rec.micro, set()).add(rec.unit)
        return pattern

    # -- called by the hooks -------------------------------------------------------------------

    def replayed_input(self, unit: int, flat: torch.Tensor) -> None:
        """A replay's local input: recorded in the trace, never reduced."""
        for hook in self.before_reduce_scatter:
            hook(unit, flat)
        trace = self.replay
        assert trace is not None
        trace.calls.append((unit, trace.micro, fingerprint_sums([flat])[0], squared_norm(flat) if trace.norms else None))

    def copied_input(self, unit: int, flat: torch.Tensor, group: Any) -> None:
        """A one-rank shard group's filled input, before FSDP2 copies it into the output and
        all-reduces that (see the module docstring): recorded as a reduce-scatter whose output is
        the input itself. The op is the all-reduce's, as FSDP2 chooses it."""
        if self.replay is not None:
            self.replayed_input(unit, flat)
            return
        record = self.local_input(unit, flat, all_reduce_op(group, flat), group)
        record.rs_checked, record.copied = False, True
        record.shard = record.chunks[0]

    def local_input(self, unit: int, flat: torch.Tensor, op: Any, group: Any) -> Reduction:
        for hook in self.before_reduce_scatter:
            hook(unit, flat)
        shards = self.layout.shards
        rows = flat.view(shards, -1)
        index = unit * shards
        chunks = torch.stack([self.weights.terms(index + j, rows[j]) for j in range(shards)])
        mean = op == dist.ReduceOp.AVG
        sums = not mean and plain_sum(op, group, flat.dtype)
        hsdp_next = self.layout.hsdp and group.all_reduce_grads
        record = Reduction(unit, chunks, rows.shape[1], flat.dtype, rs_checked=mean or sums, sums=sums,
                           # the all-reduce's input is exactly this output only without an earlier
                           # partial (set_requires_all_reduce(False)), and it averages (sums) only
                           # with FSDP2's plain average (a plain sum)
                           ar_checked=bool(hsdp_next and (sums or (mean and group.gradient_divide_factor is None))
                                           and group._partial_reduce_output is None
                                           and unit not in self.user_all_reduce_hooks),
                           micro=self.micro, fp=fingerprint_sums([flat])[0] if self.fingerprints else None)
        self.records.append(record)
        self.last[unit] = record
        return record

    def reduced_shard(self, record: Reduction, output: torch.Tensor, shard_index: int) -> None:
        if not self.layout.hsdp:
            for hook in self.after_reduction:
                hook(record.unit, output)
        record.shard = self.weights.terms(record.unit * self.layout.shards + shard_index, output)

    def replicated_shard(self, unit: int, output: torch.Tensor) -> None:
        user = self.user_all_reduce_hooks.get(unit)
        if user is not None:
            user(output)
        for hook in self.after_reduction:
            hook(unit, output)
        record = self.last.get(unit)
        if self.layout.shards == 1 and (record is None or not record.copied or record.replicated is not None):
            # the second allocate did not see this reduction's input: FSDP2's order changed
            raise RuntimeError(f"sdcguard: FSDP2 all-reduced unit {unit} without sdcguard recording its local "
                               "gradient first; this torch's one-rank shard group path is not the one checked")
        if record is None or record.shard is None:
            return
        shard_index = self.layout.coordinates(self.layout.rank)["shard"]
        record.replicated = self.weights.checksum(unit * self.layout.shards + shard_index, output)


def plain_sum(op: Any, group: Any, dtype: torch.dtype) -> bool:
    """Whether FSDP2 reduces with a plain sum, no division before it: a float32 / bfloat16 gradient
    (FSDP2 pre-divides others) and ``ReduceOp.SUM`` (forced sum comms) or ``PREMUL_SUM`` by exactly
    1 (a ``gradient_divide_factor`` of 1.0: torchtitan divides its loss by the global token count)."""
    factor = group.gradient_divide_factor
    return (dtype in (torch.float32, torch.bfloat16) and factor in (None, 1.0)
            and (op == dist.ReduceOp.SUM or factor == 1.0))


def all_reduce_op(group: Any, flat: torch.Tensor) -> Any:
    """The op of the all-reduce FSDP2 runs after a one-rank shard group's copy (its own choice,
    ``_get_gradient_divide_factors``): ``AVG`` for its plain average, else ``SUM``."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors

    info = group.mesh_info
    return _get_gradient_divide_factors(
        reduce_scatter_group=info.shard_process_group, all_reduce_group=info.replicate_process_group,
        reduce_dtype=flat.dtype, device_type=flat.device.type, factor=group.gradient_divide_factor,
        force_sum_reduction_for_comms=group.force_sum_reduction_for_comms)[3]


class RecordingReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter of one unit, with this rank's input and output recorded."""

    def __init__(self, recorder: ShardedRecorder, unit: int, group: Any, inner: ReduceScatter) -> None:
        self.recorder = recorder
        self.unit = unit
        self.group = group
        """The unit's FSDPParamGroup (is an all-reduce to follow, and of what)."""
        self.inner = inner
        """The reduce-scatter FSDP2 had (its default one, or the user's custom one)."""
        self.pending: torch.Tensor | None = None
        """A one-rank shard group: the input buffer allocated, filled before the next ``allocate``."""

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buffer = self.inner.allocate(size, dtype=dtype, device=device)
        if self.recorder.layout.shards == 1:  # no reduce-scatter will be called: record the copy's input
            if self.pending is None:
                self.pending = buffer
            else:
                flat, self.pending = self.pending, None
                if flat.numel() != buffer.numel() or flat.dtype != buffer.dtype:
                    raise RuntimeError(f"sdcguard: unit {self.unit}: FSDP2 allocated {tuple(buffer.shape)} "
                                       f"{buffer.dtype} after a {tuple(flat.shape)} {flat.dtype} input; this "
                                       "torch's one-rank shard group path is not the one checked")
                self.recorder.copied_input(self.unit, flat, self.group)
        return buffer

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False) -> dist.Work | None:
        if self.recorder.replay is not None:  # a replay: record its local input, reduce nothing
            self.recorder.replayed_input(self.unit, input_tensor)
            output_tensor.zero_()
            return None
        record = self.recorder.local_input(self.unit, input_tensor, op, self.group)
        work = self.inner(output_tensor=output_tensor, input_tensor=input_tensor, group=group, op=op, async_op=async_op)
        if work is not None:
            hold(work)
            work.wait()  # the output is read below (on a GPU, this only orders the stream)
        self.recorder.reduced_shard(record, output_tensor, dist.get_rank(group))
        return work


class _AllReduceRecorder:
    """FSDP2's all-reduce hook for one unit: runs after HSDP's all-reduce, on its output."""

    __slots__ = ("recorder", "unit")

    def __init__(self, recorder: ShardedRecorder, unit: int) -> None:
        self.recorder = recorder
        self.unit = unit

    def __call__(self, output: torch.Tensor) -> None:
        self.recorder.replicated_shard(self.unit, output)
