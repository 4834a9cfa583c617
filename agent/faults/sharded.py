"""The fault injector for a model sharded with FSDP2: where each kind strikes in a sharded step.

    guard = sdcguard.Guard(fsdp_model, optimizer, loss_fn)
    injector = ShardedFaultInjector(["grad-inf:rank=1:step=3", "weight-bitflip:rank=2:step=5"], rank)
    injector.install(guard, param="layers.1.weight")
    for step, batch in enumerate(loader):
        injector.begin_step(step)
        ...  # the user's loop under guard.step

On a pipeline whose stages FSDP2 shards (``Guard(schedule, optimizer)``), ``install(guard,
model=MODULE)`` finds parameters in the stages this rank holds (each stage's recorder, names as in
the stage module) and resolves ``site`` in ``MODULE``; give it only the faults of this rank's stages.

Same grammar as ``faults.spec``; ``element=N`` indexes the parameter's flattened tensor as this
rank sees it where the fault strikes:

  - ``grad-inf`` / ``grad-bitflip``: rank R's *local* gradient (the full, unsharded one, element N
    of the parameter) inside FSDP2's reduce-scatter input, before checks 1 and 2 read it
    (``ShardedRecorder.before_reduce_scatter``), as a fault in R's backward would leave it: an Inf
    (check 1) or a flipped top mantissa bit, finite (check 2's replay), as in a DDP job;
  - ``forward-nan`` / ``forward-scale``: element N of the output of module ``site`` in rank R's
    forward (a forward hook, as in a DDP job);
  - ``reduce-nan`` / ``reduce-scale``: the reduced shard (HSDP: the all-reduce's output; pure FSDP:
    the reduce-scatter's), on rank R or, without ``rank``, on every rank; element N of the local shard;
  - ``optimizer-scale``: element N of rank R's local shard, after its optimizer step;
  - ``weight-bitflip`` / ``weight-swap``: rank R's stored local shard, between steps (``begin_step``).

A transient compute fault (forward, grad) strikes rank R's own pass once, or with
``during=replay`` its replay of another rank's batch; a persistent one (``every=K``) strikes both.

Every kind works on a ``Shard(0)`` parameter (what ``fully_shard`` makes); a target that is not one,
or an element this rank's shard does not hold (an uneven shard's padding, an empty shard), is
refused at :meth:`~ShardedFaultInjector.install` with :class:`FaultTargetError` saying why.
:func:`shard_numel` says, without a process group, how many elements shard ``j`` holds (the drill
checks its faults with it before anything starts).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Iterable

import torch

from ..checks.replay import replaying
from .injector import _corrupt_output, _flip_bit, _mantissa_bit, _swap_partner
from .spec import SHARD_SIDE, FaultSpec, FaultTargetError, parse_fault
from .targets import resolve_module

if TYPE_CHECKING:
    from ..guard import Guard

__all__ = ["ShardedFaultInjector", "check_sharded_fault", "shard_numel"]

log = logging.getLogger("sdcguard.faults")


class _ShardTarget:
    """One fault's parameter: its unit (``(stage, unit)``: a pipeline rank's stages each have their
    own units), its offset in the unit's reduce-scatter row, its layout (for a forward kind: the
    module, under a negative key of its own in place of a unit)."""

    __slots__ = ("name", "fsdp_param", "unit", "offset", "element")

    def __init__(self, name: str, fsdp_param: Any, unit: Any, offset: int, element: int) -> None:
        self.name, self.fsdp_param, self.unit, self.offset, self.element = name, fsdp_param, unit, offset, element

    @property
    def param(self) -> torch.nn.Parameter:
        """The sharded parameter now (FSDP2 may replace it, e.g. on a state-dict load)."""
        return self.fsdp_param.sharded_param

    def __str__(self) -> str:
        return f"{self.name}[{self.element}]"


class ShardedFaultInjector:
    """This rank's faults in a sharded model, and the hooks that fire them."""

    def __init__(self, faults: Iterable[FaultSpec | str], rank: int) -> None:
        self.rank = rank
        specs = [parse_fault(f) if isinstance(f, str) else f for f in faults]
        self.faults = [f for f in specs if f.hits_rank(rank)]
        self.targets: list[_ShardTarget] = []
        self.step: int | None = None
        self.fired: list[dict[str, Any]] = []
        """One ``{kind, rank, step, target}`` per fault and step it struck."""
        self._struck: set[tuple[int, int]] = set()
        self._struck_faults: set[int] = set()
        self._disarmed: set[int] = set()
        self._handles: list[Any] = []
        self._shards = 1

    def install(self, guard: Guard, *, param: str | None = None, site: str | None = None, element: int = 0,
                model: torch.nn.Module | None = None) -> None:
        """Find every fault's parameter (``param=`` in the fault, else ``param``) or, for the
        forward kinds, module (``site=``, else ``site``; resolved in ``model``, default the Guard's
        module) in the Guard's sharded model and attach the hooks. On a pipeline whose stages
        FSDP2 shards, each stage this rank holds has its own recorder, and a parameter is named as
        in its stage module. Install after the Guard (it owns the reduce hooks). Installing again
        (a rebuilt job's Guard) moves the hooks to it; what already struck, and what was disarmed,
        is kept."""
        self.remove()
        self.targets = []
        stages = _stage_recorders(guard)
        layout = stages[0][0].layout
        self._shards = layout.shards
        where = {name: (i, *found) for i, (recorder, names) in enumerate(stages)
                 for name, found in _locate(recorder, names).items()}
        for fault in self.faults:
            index = fault.element if fault.element is not None else element
            if fault.info.corrupts == "forward":
                path = fault.site if fault.site is not None else site
                if path is None:
                    raise FaultTargetError(f"{fault} strikes a module's output: pass site='PATH' to install()")
                name, module = resolve_module(model if model is not None else guard.module, path)
                key = -1 - len(self.targets)  # a forward target's own key where a unit would be
                self.targets.append(_ShardTarget(name, module, key, 0, index))
                self._handles.append(module.register_forward_hook(self._on_forward(key)))
                continue
            name = fault.param if fault.param is not None else param
            if name is None or name not in where:
                raise FaultTargetError(f"{fault}: no sharded parameter {name!r}; it has: {', '.join(where)}")
            stage, unit, offset, fsdp_param = where[name]
            if fault.info.corrupts in SHARD_SIDE:
                shard = layout.coordinates(self.rank)["shard"]
                held = shard_numel(tuple(fsdp_param._orig_size), layout.shards, shard)
                _check_shard_element(fault, name, tuple(fsdp_param._orig_size), layout.shards, shard, held, index)
            else:
                numel = fsdp_param._orig_size.numel()
                if not 0 <= index < numel:
                    raise FaultTargetError(f"{fault}: element {index} is out of range for {name} (shape "
                                           f"{tuple(fsdp_param._orig_size)}), which has {numel} elements")
            self.targets.append(_ShardTarget(name, fsdp_param, (stage, unit), offset, index))
        for stage, (recorder, _) in enumerate(stages):
            on_local, on_reduced = self._stage_hooks(stage)
            recorder.before_reduce_scatter.append(on_local)
            recorder.after_reduction.append(on_reduced)
            self._handles.append(_Detach(recorder.before_reduce_scatter, on_local))
            self._handles.append(_Detach(recorder.after_reduction, on_reduced))
        self._handles.append(guard.optimizer.register_step_post_hook(self._after_optimizer_step))

    def _stage_hooks(self, stage: int) -> tuple[Any, Any]:
        """The recorder hooks of one stage's units (keyed ``(stage, unit)``; one stage without a pipeline)."""
        return (lambda unit, flat: self._on_local_gradient((stage, unit), flat),
                lambda unit, flat: self._on_reduced_shard((stage, unit), flat))

    def remove(self) -> None:
        """Detach every hook this injector attached."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def disarm(self, ranks: list[int]) -> None:
        """The drill's stand-in for replacing the suspects' nodes: the faults that already struck
        there stop (a fault scheduled later is a new one). Reduction faults belong to no node."""
        if self.rank in ranks:
            self._disarmed.update(i for i in self._struck_faults if self.faults[i].info.corrupts != "reduce")

    def begin_step(self, step: int) -> None:
        """Call at the top of each step: the weight faults due now strike the stored shard."""
        self.step = step
        for i in self._due("weights"):
            flat = _local(self.targets[i].param).view(-1)
            with torch.no_grad():
                e = self.targets[i].element
                if self.faults[i].kind == "weight-swap":
                    other = _swap_partner(e, flat.numel())
                    flat[[e, other]] = flat[[other, e]].clone()
                else:
                    _flip_bit(flat, e, bit=_mantissa_bit(flat, 1))

    # -- the hooks -----------------------------------------------------------------------------

    def _on_forward(self, key: int) -> Any:
        def on_output(module: torch.nn.Module, args: Any, output: Any) -> Any:
            for i in self._due("forward", key):
                output = _corrupt_output(output, self.faults[i], self.targets[i])
            return output
        return on_output

    def _on_local_gradient(self, unit: tuple[int, int], flat: torch.Tensor) -> None:
        for i in self._due("grad", unit):
            t = self.targets[i]
            j, within = _row_of(t.element, t.fsdp_param._orig_size, t.fsdp_param.padded_sharded_param_size[0])
            row = flat.view(self._shards, -1)[j]
            if self.faults[i].kind == "grad-inf":
                row[t.offset + within] = float("inf")
            else:  # grad-bitflip: the top mantissa bit, a finite result
                _flip_bit(row, t.offset + within, bit=_mantissa_bit(row, 1))

    def _on_reduced_shard(self, unit: tuple[int, int], flat: torch.Tensor) -> None:
        for i in self._due("reduce", unit):
            t = self.targets[i]
            at = t.offset + t.element
            before = flat[at].clone()
            flat[at] = float("nan") if self.faults[i].kind == "reduce-nan" else flat[at] * self.faults[i].magnitude
            if torch.equal(before, flat[at]):
                log.warning("sdcguard fault injector: %s left %s unchanged (a zero, or shard padding): pick another "
                            "element", self.faults[i], t)

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for i in self._due("optimizer"):
            with torch.no_grad():
                _local(self.targets[i].param).view(-1)[self.targets[i].element] *= self.faults[i].magnitude

    # -- bookkeeping ---------------------------------------------------------------------------

    def _due(self, corrupts: str, unit: Any = None, kinds: set[str] | None = None) -> list[int]:
        due = []
        for i, fault in enumerate(self.faults):
            if i in self._disarmed or fault.info.corrupts != corrupts or self.step is None or not fault.fires_at(self.step):
                continue
            if (kinds is not None and fault.kind not in kinds) or (unit is not None and self.targets[i].unit != unit):
                continue
            if not fault.persistent:
                compute = fault.info.corrupts in ("forward", "grad")
                if (compute and replaying() != (fault.during == "replay")) or (i, self.step) in self._struck:
                    continue
                self._struck.add((i, self.step))
            due.append(i)
            self._struck_faults.add(i)
            event = {"kind": fault.kind, "rank": self.rank, "step": self.step, "target": str(self.targets[i])}
            if event not in self.fired:
                self.fired.append(event)
                log.info("injected %s on rank %d at step %d into %s", fault.kind, self.rank, self.step, self.targets[i])
        return due


class _Detach:
    """A handle that takes one hook out of one of the recorder's hook lists."""

    __slots__ = ("hooks", "hook")

    def __init__(self, hooks: list[Any], hook: Any) -> None:
        self.hooks, self.hook = hooks, hook

    def remove(self) -> None:
        if self.hook in self.hooks:
            self.hooks.remove(self.hook)


def shard_numel(size: tuple[int, ...], shards: int, index: int) -> int:
    """Elements of shard ``index`` of a parameter of shape ``size`` under FSDP2's ``Shard(0)``:
    ``torch.chunk`` of dim 0 into ``shards`` pieces (the last ones may be shorter, or empty)."""
    rows = size[0] if size else 1
    per_row = 1
    for d in size[1:]:
        per_row *= d
    chunk = -(-rows // shards)
    return max(0, min(chunk, rows - index * chunk)) * per_row


def _check_shard_element(fault: FaultSpec, name: str, size: tuple[int, ...], shards: int, shard: int, held: int,
                         element: int) -> None:
    """Refuse a shard-side fault whose element shard ``shard`` does not hold."""
    if held == 0:
        raise FaultTargetError(f"{fault}: shard {shard} of {name} (shape {size}, over {shards} shards) is empty: "
                               "FSDP2 gives it no rows, so nothing there can be corrupted; pick another parameter")
    if not 0 <= element < held:
        raise FaultTargetError(f"{fault}: element {element} is not in shard {shard} of {name} (shape {size}, over "
                               f"{shards} shards), which holds {held} elements: for {fault.kind} element= indexes "
                               "the rank's local shard (elements beyond it are another rank's, or padding)")
    if fault.kind == "weight-swap" and held < 2:
        raise FaultTargetError(f"{fault}: weight-swap needs two elements; shard {shard} of {name} holds one")


def check_sharded_fault(fault: FaultSpec, name: str, size: tuple[int, ...], shards: int, shard_of: Any,
                        element: int) -> None:
    """Without a process group: refuse a fault on parameter ``name`` (shape ``size``) that the
    sharded injector would refuse — a shard-side element that the struck ranks' shards do not
    hold (``shard_of(rank)``: the shard a rank holds; a fault without a rank strikes every shard).
    The other kinds index the full parameter or the site's output, as in a DDP job."""
    if fault.info.corrupts in SHARD_SIDE:
        for shard in sorted({shard_of(fault.rank)} if fault.rank is not None else set(range(shards))):
            _check_shard_element(fault, name, size, shards, shard, shard_numel(size, shards, shard), element)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _row_of(element: int, size: torch.Size, chunk_rows: int) -> tuple[int, int]:
    """Where element N of a Shard(0) parameter's full gradient lies in the reduce-scatter input:
    (the row, i.e. the shard rank it goes to; its offset inside the parameter's slice of that row)."""
    per_row = size[1:].numel() if len(size) > 1 else 1
    line = element // per_row
    row = line // chunk_rows
    return row, (line - row * chunk_rows) * per_row + element % per_row


def _stage_recorders(guard: Any) -> list[tuple[Any, dict[int, str]]]:
    """``(ShardedRecorder, parameter names by id)`` of each sharded model the Guard checks: the one
    model, or each FSDP2 pipeline stage this rank holds (its parameters named as in the stage
    module, without the layout's ``stage<k>.`` prefix)."""
    layout = guard.layout
    if hasattr(layout, "recorder"):
        return [(layout.recorder, {id(p): n for n, p in guard.named_parameters})]
    replicas = getattr(layout, "replicas", None)
    if replicas is None or getattr(replicas, "kind", None) != "FSDP2":
        raise FaultTargetError("the sharded fault injector needs a model (or pipeline stages) sharded by FSDP2")
    return [(recorder, {id(p): n for n, p in module.named_parameters()})
            for recorder, module in zip(replicas.recorders, replicas.modules)]


def _locate(recorder: Any, names: dict[int, str]) -> dict[str, tuple[int, int, Any]]:
    """parameter name -> (unit, offset of its slice in the unit's reduce-scatter row, FSDPParam).
    FSDP2 lays a unit's parameters end to end in each row, each padded to its sharded size."""
    found = {}
    for unit, (path, group) in enumerate(recorder.units):
        offset = 0
        for fsdp_param in group.fsdp_params:
            name = names[id(fsdp_param.sharded_param)]
            if fsdp_param.fsdp_placement.dim != 0:
                raise FaultTargetError(f"{name}: only Shard(0) parameters can be targeted")
            found[name] = (unit, offset, fsdp_param)
            offset += fsdp_param.padded_sharded_param_size.numel()
    return found
