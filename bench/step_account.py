"""What sdcguard adds to a training step, counted (SPEC §10, "The step's cost, counted").

    .venv/bin/python bench/step_account.py [--layout ddp|hsdp|all] [--steps 3] [--ranks 3]

For each layout the same loop runs twice on every rank, each on its own replica of bench/gpt.py's
TinyGPT (AdamW): plain (zero_grad, forward + backward, ``opt.step()``), and under sdcguard's step
API (``with guard.step(step, audit=...) as s: s.backward(batch); s.check(); opt.step()``). Both
replicas take the same steps with the same batches; every counted step of the checked replica is
counted beside the same step of the plain one, and the difference is what sdcguard adds. Layouts:

  ddp   DistributedDataParallel on ``--ranks`` gloo ranks (3), one rank per simulated node;
  hsdp  FSDP2 over a 2 x 2 ``init_device_mesh("cpu", (2, 2), ("replicate", "shard"))`` mesh on 4
        ranks, ``fully_shard`` per block and on the root; two ranks (one replica) per node.
  pp    a pipeline of 2 stages x 2 replicas on 4 ranks, laid out ``(dp, pp)`` as bench/overhead.py
        ``--pp 2`` lays it out: bench/pp_model.py's stages, DDP over each stage's replicas,
        ``PipelineStage`` and ``Schedule1F1B`` (4 micro-batches), gradient clipping over the
        pipeline, AdamW; ``Guard(schedule, optimizer)`` and ``s.run_schedule``; a replica's two
        stages on one node.

Step kinds (``Config(audit_every=0, weight_check_every=4)``; audits asked for with
``guard.step(step, audit=True)``): after 4 warm-up steps (DDP rebuilds its buckets, AdamW makes its
state, every check's first use), steps 4k+1 and 4k+3 are **ordinary**, 4k+2 an **audit** step (checks
1-4, the replay of the next node's batch) and 4k+4 a **weight-check** step (check 3 after the update).

How each figure is counted, inside the counted step only (from zero_grad to the end of the step),
on every thread:
  host syncs   calls of the ``torch.Tensor`` methods that read a value to the host — ``item``,
               ``tolist``, ``__bool__``, ``__float__``, ``__int__``, ``__index__``, ``cpu``, ``numpy``
               — wrapped on the class for the duration (a call made inside another counted one
               is not counted again). On CPU no read waits for a device, but each of these on a
               GPU tensor would. With CUDA, ``torch.cuda.set_sync_debug_mode("warn")``'s warnings
               are counted too (the "device syncs" row).
  collectives  every ``c10d`` operator that reaches the dispatcher (a ``TorchDispatchMode``): the
               ``torch.distributed`` functions, methods called straight on a ProcessGroup and
               DDP's C++ reducer all go through one; bytes are this rank's payload (the input of
               an all-reduce, all-gather, reduce-scatter, broadcast, send; the buffer of a recv).
               An object collective shows as the tensor collectives it is made of.
  tensor ops   every ``aten``/``prims`` operator seen by the same dispatch mode (composite ops
               decomposed as the dispatcher does; an op run inside another is not seen again).
               Futures' callbacks (the comm hook's, on gloo's thread) run under the mode too:
               ``Future.then`` is wrapped for the duration.
  bytes read   over those ops, the bytes of every tensor input, except views and reshapes (read
               nothing), ``out=`` arguments, and the destination of ``copy_``/``fill_``/``zero_``
               (written, not read); a DTensor counts its local shard. "read / grad byte" is the
               checked step's total minus the plain step's, over this rank's gradient bytes (DDP:
               the whole gradient; HSDP: its shard of it).
  per bucket   (DDP) sdcguard's comm hook is labelled per bucket (``register_comm_hook`` wrapped
               while the Guard is built; its futures' callbacks carry the label): its ops and
               bytes read per byte of the bucket. DDP's own 1/W scaling of the bucket, which the
               hook does in the reducer's stead, is one of those reads.

``--device-gate``: both replicas use ``AdamW(fused=True)`` and sdcguard ``Config(device_gate=True)``;
every step is ordinary (no audits, no weight checks), so each counted step also reads the previous
step's verdict, decided on the device. That read is counted apart ("deferred verdict reads"): it
reads host memory the device copied the verdict into without blocking (``sdcguard.gate``), after
an event the device passed a step ago — no synchronisation with the launch queue. Called from
``gate._read_settled``, a wrapped method counts there instead of under host syncs.

Every figure is per step (the mean over ``--steps`` steps of each kind; they are equal step to
step), from rank 0, with the largest difference over all ranks beside it. The goals (SPEC §10):
an ordinary step adds at most one host synchronisation and one 16-byte collective, and reads
each gradient byte at most twice.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterator

HERE = Path(__file__).resolve().parent
KINDS = ("ordinary", "audit", "weight-check")
WARMUP = 4
SYNC_METHODS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy")
LAYOUT_RANKS = {"hsdp": 4, "pp": 4}
LAYOUTS = ("ddp", "hsdp", "pp")
_REDUCTIONS = {"allreduce_", "allreduce_coalesced_", "_reduce_scatter_base_", "reduce_scatter_",
               "reduce_scatter_tensor_coalesced_", "reduce_"}
GRADIENT_PAYLOAD = 1024
"""A reduction of at least this many bytes is taken for a gradient's (the checks' own are 16 B)."""
# A collective's payload: the arguments that hold what this rank sends (or receives, for recv).
_PAYLOAD_ARGS = {"tensors", "input_tensor", "input_tensors", "input_list", "inputs", "input"}
# Ops that write their first argument without reading it, and reshapes that read nothing.
_WRITE_ONLY = {"copy_", "fill_", "zero_", "resize_", "set_", "normal_", "uniform_", "bernoulli_", "random_"}
_NO_READ = {"_unsafe_view", "lift_fresh", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
            "zeros", "zeros_like", "new_zeros", "ones", "ones_like", "new_ones", "full", "full_like", "new_full",
            "scalar_tensor", "arange", "randperm", "detach_", "_local_scalar_dense"}


def step_kind(step: int) -> str:
    """The kind of a counted step (steps from WARMUP on; see the module's docstring)."""
    return {1: "ordinary", 2: "audit", 3: "ordinary", 0: "weight-check"}[step % 4]


# -- counting -------------------------------------------------------------------------------------

class Counts:
    """What one counted region did. ``tally`` keys: (metric, label, name) -> number, where label is
    the phase of the step (``begin``, ``backward``, ``check``, ``update``, ``end``…) or
    ``bucket <i>`` inside the comm hook of DDP bucket i, and metric one of ``sync``, ``cuda-sync``,
    ``op``, ``read`` (bytes), ``coll`` (name = ``op <bytes> B``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tally: Counter[tuple[str, str, str]] = Counter()
        self.bucket_bytes: dict[int, int] = {}
        # For the reads of gradient memory: every op's index; each storage's births (an op whose
        # output lives in a storage none of its inputs does); every read (op index, label,
        # storage, bytes); the storages known to hold a gradient, with when they were known.
        self.ops = 0
        self.births: dict[int, list[int]] = {}
        self.reads: list[tuple[int, str, int, int]] = []
        self.gradients: list[tuple[int, int]] = []

    def add(self, metric: str, name: str, n: int = 1) -> None:
        with self.lock:
            self.tally[(metric, _label(), name)] += n

    def gradient(self, tensor: Any) -> None:
        """``tensor``'s storage holds a gradient (a DDP bucket, a ``.grad``, a reduction's payload)."""
        ptr = _storage(tensor)
        if ptr:
            with self.lock:
                self.gradients.append((self.ops, ptr))

    def gradient_reads(self) -> Counter[str]:
        """Bytes read from gradient memory, by label: a read of a storage counts when the storage
        was born (or existed from the start) no later than the read, holds a gradient known at
        some point of that same life, and was not born again in between (an address reused)."""
        windows: dict[int, list[tuple[int, int]]] = {}
        for known, ptr in self.gradients:
            births = self.births.get(ptr, [])
            born = max((b for b in births if b <= known), default=-1)
            dies = min((b for b in births if b > known), default=1 << 62)
            windows.setdefault(ptr, []).append((born, dies))
        out: Counter[str] = Counter()
        for index, where, ptr, n in self.reads:
            if any(born <= index < dies for born, dies in windows.get(ptr, ())):
                out[where] += n
        return out


_tls = threading.local()


def _label() -> str:
    return getattr(_tls, "label", None) or "other"


@contextlib.contextmanager
def label(name: str) -> Iterator[None]:
    """What the current thread is doing (a phase of the step, or a bucket's comm hook)."""
    before = getattr(_tls, "label", None)
    _tls.label = name
    try:
        yield
    finally:
        _tls.label = before


def _nbytes(t: Any) -> int:
    local = getattr(t, "_local_tensor", None)  # a DTensor: its shard on this rank
    t = local if local is not None else t
    return t.numel() * t.element_size()


def _storage(t: Any) -> int:
    local = getattr(t, "_local_tensor", None)
    t = local if local is not None else t
    try:
        return t.untyped_storage().data_ptr()
    except Exception:  # noqa: BLE001 - a tensor without storage
        return 0


def _site() -> str:
    """Where the library asked for it: the innermost frame outside torch and this file, as
    ``agent/…:line`` when it is sdcguard's (else the file's name and line)."""
    import torch
    skip = (str(Path(torch.__file__).parent), __file__, contextlib.__file__)
    f = sys._getframe(2)
    while f is not None and f.f_code.co_filename.startswith(skip):
        f = f.f_back
    if f is None:
        return "?"
    name = f.f_code.co_filename
    if "/agent/" in name:
        name = "agent/" + name.rsplit("/agent/", 1)[1]
    return f"{name.rsplit('/', 1)[-1] if '/agent/' not in f.f_code.co_filename else name}:{f.f_lineno}"


_current: list[Counts | None] = [None]
"""The Counts being filled (for the gradient hooks registered on the parameters)."""


def _tensors(value: Any) -> Iterator[Any]:
    import torch
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def _make_mode(counts: Counts) -> Any:
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpCounter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            inputs: set[int] = set()
            try:
                with counts.lock:
                    index = counts.ops
                    counts.ops += 1
                schema = func._schema
                values = [(a, args[i] if i < len(args) else kwargs.get(a.name)) for i, a in enumerate(schema.arguments)]
                inputs = {_storage(t) for _, v in values for t in _tensors(v)}
                if func.namespace == "c10d":
                    if func._opname not in ("check_for_nan",):
                        payload = [t for a, v in values if a.name in _PAYLOAD_ARGS for t in _tensors(v)]
                        size = 0 if func._opname in ("barrier", "monitored_barrier_") else sum(map(_nbytes, payload))
                        counts.add("coll", f"{func._opname} {size} B")
                        counts.add("coll-site", f"{func._opname} {size} B @ {_site()}")
                        if func._opname in _REDUCTIONS and size >= GRADIENT_PAYLOAD:
                            for _, v in values:  # a gradient reduction: input and output hold gradients
                                for t in _tensors(v):
                                    counts.gradient(t)
                elif func.namespace in ("aten", "prims"):
                    counts.add("op", func._opname)
                    if not (getattr(func, "is_view", False) or func._opname in _NO_READ):
                        read, seen = 0, set()
                        where = _label()
                        for i, (a, v) in enumerate(values):
                            written = a.alias_info is not None and a.alias_info.is_write
                            if (written and a.kwarg_only) or (i == 0 and func._opname in _WRITE_ONLY):
                                continue
                            for t in _tensors(v):
                                key = (t.data_ptr() if not hasattr(t, "_local_tensor") else id(t), t.shape, t.stride())
                                if key in seen:  # dot(x, x) reads x once
                                    continue
                                seen.add(key)
                                n = _nbytes(t)
                                read += n
                                with counts.lock:
                                    counts.reads.append((index, where, _storage(t), n))
                        counts.add("read", func._opname, read)
            except Exception as exc:  # noqa: BLE001 - a counting bug must not change the step
                counts.add("op", f"uncounted ({type(exc).__name__}: {exc})")
            out = func(*args, **kwargs)
            try:
                for t in _tensors(out if isinstance(out, (list, tuple)) else [out]):
                    ptr = _storage(t)
                    if ptr and ptr not in inputs:
                        with counts.lock:
                            counts.births.setdefault(ptr, []).append(index)
            except Exception as exc:  # noqa: BLE001
                counts.add("op", f"uncounted output ({type(exc).__name__})")
            return out

    return OpCounter()


@contextlib.contextmanager
def _under_mode(counts: Counts) -> Iterator[None]:
    """The op counter on this thread, unless it already counts here (no op is counted twice)."""
    if getattr(_tls, "mode", False):
        yield
        return
    _tls.mode = True
    try:
        with _make_mode(counts):
            yield
    finally:
        _tls.mode = False


@contextlib.contextmanager
def counting(counts: Counts) -> Iterator[None]:
    """Count host syncs, collectives, tensor ops and bytes read into ``counts`` until the block
    ends, on every thread (see the module's docstring). Nothing the step computes changes."""
    import torch

    originals = {name: torch.Tensor.__dict__.get(name) for name in SYNC_METHODS}

    def wrap(name: str) -> Callable[..., Any]:
        inner = getattr(torch.Tensor, name)

        @functools.wraps(inner)
        def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
            if getattr(_tls, "in_sync", False):
                return inner(self, *args, **kwargs)
            _tls.in_sync = True
            try:
                caller = sys._getframe(1).f_code
                if caller.co_name == "_read_settled" and caller.co_filename.endswith("gate.py"):
                    counts.add("deferred-read", name)  # host memory, already copied: no device sync
                    return inner(self, *args, **kwargs)
                counts.add("sync", name)
                counts.add("sync-site", f"{name} @ {_site()}")
                return inner(self, *args, **kwargs)
            finally:
                _tls.in_sync = False
        return counted

    then = torch._C.Future.then

    def counted_then(fut: Any, callback: Callable[[Any], Any]) -> Any:
        where = _label()

        def run(f: Any) -> Any:
            with label(where), _under_mode(counts):
                return callback(f)
        return then(fut, run)

    sync_debug = None
    cuda = torch.cuda.is_available()
    for name in SYNC_METHODS:
        setattr(torch.Tensor, name, wrap(name))
    torch._C.Future.then = counted_then
    _current[0] = counts
    caught = contextlib.ExitStack()
    try:
        if cuda:
            import warnings
            sync_debug = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
            seen = caught.enter_context(warnings.catch_warnings(record=True))
            warnings.simplefilter("always")
        with _under_mode(counts):
            yield
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode(sync_debug)
            for w in seen:
                if "synchroniz" in str(w.message):
                    counts.tally[("cuda-sync", "all", "cuda")] += 1
        caught.close()
        _current[0] = None
        torch._C.Future.then = then
        for name, original in originals.items():
            if original is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, original)


@contextlib.contextmanager
def labelled_comm_hooks(counts: Counts) -> Iterator[None]:
    """While the Guard is built: the comm hook it registers on DDP runs under a ``bucket <i>``
    label (and its futures' callbacks carry the label, see ``counting``)."""
    from torch.nn.parallel import DistributedDataParallel

    register = DistributedDataParallel.register_comm_hook

    def labelling(self: Any, state: Any, hook: Callable[..., Any]) -> Any:
        @functools.wraps(hook)
        def labelled(state: Any, bucket: Any) -> Any:
            index = bucket.index()
            buffer = bucket.buffer()
            counts.bucket_bytes[index] = buffer.numel() * buffer.element_size()
            if _current[0] is not None:
                _current[0].gradient(buffer)
            with label(f"bucket {index}"):
                return hook(state, bucket)
        return register(self, state, labelled)

    DistributedDataParallel.register_comm_hook = labelling
    try:
        yield
    finally:
        DistributedDataParallel.register_comm_hook = register


def summarize(counts: Counts, steps: int) -> dict[str, Any]:
    """Per step: metric -> name -> number (summed over labels), and the same by label."""
    total: dict[str, dict[str, float]] = {}
    by_label: dict[str, dict[str, dict[str, float]]] = {}
    for (metric, where, name), n in counts.tally.items():
        total.setdefault(metric, {}).setdefault(name, 0)
        total[metric][name] += n / steps
        by_label.setdefault(metric, {}).setdefault(where, {}).setdefault(name, 0)
        by_label[metric][where][name] += n / steps
    grad_reads = counts.gradient_reads()
    return {"total": total, "by_label": by_label,
            "gradient_reads": {where: n / steps for where, n in grad_reads.items()}}


# -- the loops ------------------------------------------------------------------------------------

def worker(layout: str, steps: int, kinds: tuple[str, ...], out: str, device_gate: bool = False) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(HERE))
    from gpt import TinyGPT, lm_batch, lm_loss

    import sdcguard

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    hook_counts = Counts()

    loss_fn: Any = lm_loss
    if layout == "pp":
        module, plain_model, plain_opt, checked_module, checked_model, checked_opt, run, loss_fn, per_node = \
            _pipeline(rank, device_gate)
    elif layout == "hsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        per_node = 2

        def replica() -> tuple[Any, Any, Any]:
            torch.manual_seed(0)
            module = TinyGPT()
            for block in module.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(module, mesh=mesh)
            return module, module, torch.optim.AdamW(module.parameters(), lr=1e-3, fused=device_gate or None)
    else:
        from torch.nn.parallel import DistributedDataParallel
        per_node = 1

        def replica() -> tuple[Any, Any, Any]:
            torch.manual_seed(0)
            module = TinyGPT()
            return module, DistributedDataParallel(module), torch.optim.AdamW(module.parameters(), lr=1e-3,
                                                                              fused=device_gate or None)
    if layout != "pp":
        module, plain_model, plain_opt = replica()
        checked_module, checked_model, checked_opt = replica()

        def run(step: int, model: Any, s: Any = None) -> None:
            batch = lm_batch(step, rank)
            if s is not None:
                s.backward(batch)
            else:
                lm_loss(model, batch).backward()
    grad_bytes = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)  # unsharded
    def note_gradient(param: Any) -> None:
        if _current[0] is not None:
            _current[0].gradient(param.grad)

    for p in (*module.parameters(), *checked_module.parameters()):  # each .grad, as soon as it is there
        p.register_post_accumulate_grad_hook(note_gradient)
    with labelled_comm_hooks(hook_counts):
        guard = sdcguard.Guard(checked_model, checked_opt, loss_fn, config=sdcguard.Config(
            audit_every=0, weight_check_every=0 if device_gate else 4, ranks_per_node=per_node, device_gate=device_gate))
    kind_of = (lambda step: "ordinary") if device_gate else step_kind

    def plain(step: int) -> None:
        with label("zero_grad"):
            plain_opt.zero_grad(set_to_none=True)
        with label("backward"):
            run(step, plain_model)
        with label("update"):
            plain_opt.step()

    def checked(step: int) -> None:
        with label("zero_grad"):
            checked_opt.zero_grad(set_to_none=True)
        with label("begin"):
            s = guard.step(step, audit=kind_of(step) == "audit" or step == 1)
            s.__enter__()
        try:
            with label("backward"):
                run(step, checked_model, s)
            with label("check"):
                s.check()
            with label("update"):
                checked_opt.step()
        except BaseException:
            if not s.__exit__(*sys.exc_info()):
                raise
            return
        with label("end"):
            s.__exit__(None, None, None)

    for step in range(WARMUP):
        plain(step)
        checked(step)
    counts = {kind: {"plain": Counts(), "sdcguard": Counts()} for kind in kinds}
    taken = Counter()
    step = WARMUP
    while any(taken[k] < steps for k in kinds):
        kind = kind_of(step)
        if kind in kinds and taken[kind] < steps:
            for name, fn in (("plain", plain), ("sdcguard", checked)):
                dist.barrier()
                hook_counts.bucket_bytes.clear()
                with counting(counts[kind][name]):
                    fn(step)
                counts[kind][name].bucket_bytes = dict(hook_counts.bucket_bytes)
            taken[kind] += 1
        else:  # a step of a kind not asked for: taken, not counted (every rank alike)
            plain(step)
            checked(step)
        step += 1
    result = {"rank": rank, "layout": layout, "world": dist.get_world_size(), "grad_bytes": grad_bytes,
              "steps": steps, "kinds": {}}
    for kind in kinds:
        result["kinds"][kind] = {name: {**summarize(c, steps), "bucket_bytes": c.bucket_bytes}
                                 for name, c in counts[kind].items()}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    guard.close()
    dist.destroy_process_group()


def _pipeline(rank: int, device_gate: bool) -> tuple[Any, ...]:
    """``--layout pp``: two replicas (plain, checked) of a 2-stage x 2-replica pipeline (see the
    module's docstring); returns them with the step's forward + backward (``run``), the Guard's loss
    function (None: the schedule has its own) and the ranks per node. Gradient clipping over the
    pipeline is part of the step, counted on both sides alike."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.nn.parallel import DistributedDataParallel
    from pp_model import MICRO_BATCHES, batch, clip, stage_module

    from sdcguard.checks.rng import forward_seed, seeded

    stages = 2
    mesh = init_device_mesh("cpu", (2, stages), mesh_dim_names=("dp", "pp"))
    position, replica_index = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    pp_group, dp_group, cpu = mesh["pp"].get_group(), mesh["dp"].get_group(), torch.device("cpu")

    def replica() -> tuple[Any, Any, Any]:
        module = stage_module(position, stages)
        held = DistributedDataParallel(module, process_group=dp_group, find_unused_parameters=True)
        schedule = Schedule1F1B(PipelineStage(held, position, stages, cpu, group=pp_group), MICRO_BATCHES,
                                loss_fn=F.cross_entropy)
        return module, schedule, torch.optim.AdamW(module.parameters(), lr=1e-3, fused=device_gate or None)

    plain_module, plain_schedule, plain_opt = replica()
    checked_module, checked_schedule, checked_opt = replica()
    modules = {id(plain_schedule): plain_module, id(checked_schedule): checked_module}

    def run(step: int, schedule: Any, s: Any = None) -> None:
        x, y = batch(step, replica_index)
        args, target = ((x,) if position == 0 else ()), (y if position == stages - 1 else None)
        if s is not None:
            s.run_schedule(*args, target=target)
        else:
            with seeded(forward_seed(0, step, rank, 0), cpu):  # as the Guard seeds its forward
                schedule.step(*args, target=target)
        clip([modules[id(schedule)]], pp_group)

    return (plain_module, plain_schedule, plain_opt, checked_module, checked_schedule, checked_opt, run, None,
            stages)


# -- the account ----------------------------------------------------------------------------------

def added(rank: dict[str, Any], kind: str) -> dict[str, Any]:
    """What the checked step added to the plain one on this rank, per step."""
    plain, checked = rank["kinds"][kind]["plain"], rank["kinds"][kind]["sdcguard"]

    def total(side: dict[str, Any], metric: str) -> float:
        return sum(side["total"].get(metric, {}).values())

    def diff(metric: str) -> dict[str, float]:
        a, b = plain["total"].get(metric, {}), checked["total"].get(metric, {})
        return {k: b.get(k, 0) - a.get(k, 0) for k in sorted(set(a) | set(b)) if b.get(k, 0) != a.get(k, 0)}

    def coll_bytes(side: dict[str, Any]) -> float:
        return sum(n * int(name.rsplit(" ", 2)[1]) for name, n in side["total"].get("coll", {}).items())

    buckets = {}
    for where, ops in checked["by_label"].get("op", {}).items():
        if where.startswith("bucket "):
            index = where.split()[1]
            read = sum(checked["by_label"].get("read", {}).get(where, {}).values())
            size = checked["bucket_bytes"].get(index) or checked["bucket_bytes"].get(int(index), 0)
            grad_read = checked["gradient_reads"].get(where, 0)
            buckets[index] = {"ops": sum(ops.values()), "bytes": size, "read_per_byte": read / size if size else None,
                              "gradient_read_per_byte": grad_read / size if size else None}
    row = {
        "syncs": (total(plain, "sync"), total(checked, "sync")),
        "cuda_syncs": (total(plain, "cuda-sync"), total(checked, "cuda-sync")),
        "deferred_reads": (total(plain, "deferred-read"), total(checked, "deferred-read")),
        "collectives": (total(plain, "coll"), total(checked, "coll")),
        "collective_bytes": (coll_bytes(plain), coll_bytes(checked)),
        "ops": (total(plain, "op"), total(checked, "op")),
        "read_bytes": (total(plain, "read"), total(checked, "read")),
        "grad_bytes": rank["grad_bytes"],
        "gradient_reads": (sum(plain["gradient_reads"].values()), sum(checked["gradient_reads"].values())),
        "gradient_reads_where": {w: n / rank["grad_bytes"] for w, n in checked["gradient_reads"].items()},
        "plain_gradient_reads_where": {w: n / rank["grad_bytes"] for w, n in plain["gradient_reads"].items()},
        "added_syncs": diff("sync"),
        "added_collectives": diff("coll"),
        "added_ops": diff("op"),
        "sync_where": checked["by_label"].get("sync", {}),
        "sync_sites": {k: v for k, v in checked["total"].get("sync-site", {}).items() if "agent/" in k},
        "coll_where": checked["by_label"].get("coll", {}),
        "coll_sites": {k: v for k, v in checked["total"].get("coll-site", {}).items() if "agent/" in k},
        "plain_coll_where": plain["by_label"].get("coll", {}),
        "buckets": buckets,
    }
    row["read_per_grad_byte"] = (row["read_bytes"][1] - row["read_bytes"][0]) / rank["grad_bytes"]
    row["gradient_passes"] = (row["gradient_reads"][1] - row["gradient_reads"][0]) / rank["grad_bytes"]
    return row


def account(layout: str, ranks: int | None = None, steps: int = 3, kinds: tuple[str, ...] = KINDS,
            timeout: float = 900, device_gate: bool = False) -> list[dict[str, Any]]:
    """Run the counted loops under torchrun (gloo, one thread per rank) and return every rank's
    result (``added(result, kind)`` gives the differences)."""
    ranks = LAYOUT_RANKS.get(layout, ranks or 3)
    with tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SDCGUARD_")}
        env.update(OMP_NUM_THREADS="1", PYTHONSAFEPATH="1")
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", __file__,
             "--layout", layout, "--steps", str(steps), "--kinds", ",".join(kinds), "--worker", tmp]
            + (["--device-gate"] if device_gate else []),
            capture_output=True, text=True, env=env, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"step_account {layout} failed ({proc.returncode}):\n"
                               f"{proc.stdout[-3000:]}{proc.stderr[-6000:]}")
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(ranks)]


def _fmt(x: float) -> str:
    return f"{x:,.0f}" if abs(x - round(x)) < 1e-9 else f"{x:,.2f}"


def report(layout: str, results: list[dict[str, Any]]) -> str:
    r0 = results[0]
    lines = []
    model = {"ddp": "DDP, TinyGPT", "hsdp": "HSDP 2 x 2 (fully_shard per block and on the root), TinyGPT",
             "pp": "pipeline 2 stages x 2 replicas (DDP per stage, Schedule1F1B, 4 micro-batches), "
                   "bench/pp_model.py"}[layout]
    lines.append(f"## {layout}: {model}; {r0['world']} gloo ranks; {r0['steps']} counted steps per kind; "
                 f"gradient bytes on rank 0: {r0['grad_bytes']:,}")
    for kind in r0["kinds"]:
        rows = [added(r, kind) for r in results]
        a = rows[0]
        lines.append("")
        lines.append(f"### {kind} step (per step; rank 0, and the largest difference over ranks)")
        lines.append(f"| {'':34} | {'plain':>12} | {'sdcguard':>12} | {'added':>10} | {'added, max rank':>15} |")
        lines.append(f"|{'-' * 36}|{'-' * 14}|{'-' * 14}|{'-' * 12}|{'-' * 17}|")
        metrics = [("host syncs (value reads)", "syncs"), ("collectives", "collectives"),
                   ("collective bytes (payload)", "collective_bytes"), ("tensor ops (aten)", "ops"),
                   ("bytes read by tensor ops", "read_bytes")]
        if any(r["deferred_reads"][1] for r in rows):
            metrics.insert(1, ("deferred reads (host memory)", "deferred_reads"))
        if any(r["cuda_syncs"][1] for r in rows):
            metrics.insert(1, ("device syncs (CUDA debug mode)", "cuda_syncs"))
        for title, key in metrics:
            p, c = a[key]
            most = max(r[key][1] - r[key][0] for r in rows)
            lines.append(f"| {title:34} | {_fmt(p):>12} | {_fmt(c):>12} | {_fmt(c - p):>10} | {_fmt(most):>15} |")
        g = a["grad_bytes"]
        most = max(r["gradient_passes"] for r in rows)
        lines.append(f"| {'gradient memory read / grad bytes':34} | {a['gradient_reads'][0] / g:>12.2f} | "
                     f"{a['gradient_reads'][1] / g:>12.2f} | {a['gradient_passes']:>10.2f} | {most:>15.2f} |")
        most = max(r["read_per_grad_byte"] for r in rows)
        lines.append(f"| {'all bytes read added / grad bytes':34} | {'':>12} | {'':>12} | "
                     f"{a['read_per_grad_byte']:>10.2f} | {most:>15.2f} |")
        lines.append("")
        lines.append("- host syncs added: " + (", ".join(f"{k} x{_fmt(v)}" for k, v in a["added_syncs"].items())
                                               or "none") + "; in the checked step by phase: "
                     + "; ".join(f"{w}: " + ", ".join(f"{k} x{_fmt(v)}" for k, v in d.items())
                                 for w, d in a["sync_where"].items()))
        lines.append("- where sdcguard's code makes those reads (innermost frame under agent/): " + (", ".join(
            f"{k} x{_fmt(v)}" for k, v in sorted(a["sync_sites"].items())
            if k.split(" @ ")[0] in a["added_syncs"]) or "none"))
        lines.append("- collectives added: " + (", ".join(f"{k} x{_fmt(v)}" for k, v in a["added_collectives"].items())
                                                or "none") + "; in the checked step by phase: "
                     + "; ".join(f"{w}: " + ", ".join(f"{k} x{_fmt(v)}" for k, v in d.items())
                                 for w, d in a["coll_where"].items()))
        lines.append("- where the added collectives start (innermost frame under agent/): " + (", ".join(
            f"{k} x{_fmt(v)}" for k, v in sorted(a["coll_sites"].items())
            if k.split(" @ ")[0] in a["added_collectives"]) or "none"))
        top = sorted(a["added_ops"].items(), key=lambda kv: -abs(kv[1]))[:10]
        lines.append("- tensor ops added, largest: " + ", ".join(f"{k} {_fmt(v):>}" for k, v in top))
        lines.append("- gradient memory read, per gradient byte, by phase: sdcguard " + ", ".join(
            f"{w} {v:.2f}" for w, v in sorted(a["gradient_reads_where"].items())) + "; plain " + ", ".join(
            f"{w} {v:.2f}" for w, v in sorted(a["plain_gradient_reads_where"].items())))
        if a["buckets"]:
            lines.append("- sdcguard's comm hook per DDP bucket: " + "; ".join(
                f"bucket {i} ({b['bytes']:,} B): {_fmt(b['ops'])} ops, reads {b['gradient_read_per_byte']:.2f} B of "
                f"gradient memory and {b['read_per_byte']:.2f} B in all per bucket byte"
                for i, b in sorted(a["buckets"].items())))
    return "\n".join(lines)


def goals(results: list[dict[str, Any]], device_gate: bool = False) -> list[str]:
    """The SPEC §10 goals for an ordinary step, on every rank: unmet ones, as sentences (with the
    device gate: no host sync at all)."""
    unmet = []
    most = 0 if device_gate else 1
    for r in results:
        if "ordinary" not in r["kinds"]:
            continue
        a = added(r, "ordinary")
        syncs = a["syncs"][1] - a["syncs"][0]
        if syncs > most:
            unmet.append(f"rank {r['rank']}: {_fmt(syncs)} host syncs added (goal <= {most}): {a['added_syncs']}")
        if a["added_collectives"] != {"allreduce_ 16 B": 1} and a["added_collectives"]:
            unmet.append(f"rank {r['rank']}: collectives added {a['added_collectives']} (goal: one of 16 B)")
        if a["gradient_passes"] > 2:
            unmet.append(f"rank {r['rank']}: gradient memory read {a['gradient_passes']:.2f} times more (goal <= 2)")
    return unmet


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layout", choices=(*LAYOUTS, "all"), default="all")
    parser.add_argument("--steps", type=int, default=3, help="counted steps of each kind")
    parser.add_argument("--ranks", type=int, default=3, help="DDP ranks (HSDP, pp: 4)")
    parser.add_argument("--kinds", default=",".join(KINDS), help=argparse.SUPPRESS)
    parser.add_argument("--json", help="also write every rank's figures here")
    parser.add_argument("--device-gate", action="store_true",
                        help="fused AdamW and Config(device_gate=True); ordinary steps only")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    kinds = ("ordinary",) if args.device_gate else tuple(k for k in args.kinds.split(",") if k)
    if args.worker:
        worker(args.layout, args.steps, kinds, args.worker, args.device_gate)
        return 0
    everything = {}
    for layout in (LAYOUTS if args.layout == "all" else (args.layout,)):
        results = account(layout, args.ranks, args.steps, kinds, device_gate=args.device_gate)
        everything[layout] = results
        print(report(layout, results) if not args.device_gate else
              report(layout, results).replace(f"## {layout}:", f"## {layout} with the device gate (fused AdamW):", 1))
        unmet = goals(results, args.device_gate)
        print(f"\nSPEC §10 goals for an ordinary step (<= {0 if args.device_gate else 1} host sync, one 16-byte "
              "collective, <= 2 reads per gradient byte): " + ("met on every rank" if not unmet else "NOT met: " + "; ".join(unmet)) + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(everything))
    return 0


if __name__ == "__main__":
    sys.exit(main())
