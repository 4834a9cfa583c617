"""The fault injector: synthetic silent data corruption in your own job, where failing hardware
would put it, to see which check catches each fault.

    injector = FaultInjector(["grad-bitflip:rank=1:step=10", "weight-swap:rank=2:step=30"], rank)
    injector.install(model, optimizer, site="transformer.h.0.mlp", param="lm_head.weight")
    hook, state = injector.reduce_hook_around()        # or around your own reduce hook and state
    guard = sdcguard.Guard(ddp, optimizer, loss_fn, reduce_hook=hook, reduce_state=state)
    for step, batch in enumerate(loader):
        injector.begin_step(step)
        guard.train_step(step, batch)

A fault must strike inside the computation that the checks watch, not after a fingerprint was
taken: activations through a forward hook on the site, local gradients through a tensor hook on
the parameter (before DDP copies them into its buckets), the all-reduce through a reduce hook
wrapped around the real one, the optimizer through a step post-hook, and stored weights between
steps (``begin_step``). Each strikes one element of the flattened tensor (``element``, default 0).

Names resolve through ``torch.compile`` and DDP / DataParallel wrappers: ``_orig_mod.`` and
``module.`` may be given or left out. Install before the model's first forward: hooks added to a
compiled module after it was traced are not seen by the compiled code. The hooks run eagerly (a
graph break at the site).

A transient fault strikes the first matching computation of its step on its rank, once: the
rank's own pass, or with ``during=replay`` its replay of another rank's batch. A persistent one
(``every=K``) strikes every matching computation of its steps — the rank's own pass and its
replays alike, as a broken unit would.
"""

# No `from __future__ import annotations`: DDP checks comm-hook annotations at runtime.
import logging
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from ..checks.commhook import ReduceHook, allreduce_mean
from ..checks.replay import replaying
from .spec import FaultSpec, FaultTargetError, parse_fault
from .targets import check_element, checked_parameter, resolve_module, resolve_parameter

__all__ = ["FaultInjector", "ReduceFaults", "corrupt_reduced"]

log = logging.getLogger("sdcguard.faults")

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class _Target:
    """Where one fault strikes: a module (forward kinds) or a parameter, and an element."""

    __slots__ = ("name", "obj", "element")

    def __init__(self, name: str, obj: Any, element: int) -> None:
        self.name, self.obj, self.element = name, obj, element

    def __str__(self) -> str:
        return f"{self.name}[{self.element}]"


class FaultInjector:
    """This rank's faults and the hooks that fire them."""

    def __init__(self, faults: Iterable[FaultSpec | str], rank: int) -> None:
        # Settings.
        self.rank = rank
        specs = [parse_fault(f) if isinstance(f, str) else f for f in faults]
        self.faults = [f for f in specs if f.hits_rank(rank)]
        """The faults that strike this rank (the ``reduce-*`` ones strike every rank)."""
        self.targets: list[_Target] = []
        """Where each of ``faults`` strikes, set by :meth:`install`."""
        self._handles: list[Any] = []
        # Observed state.
        self.step: int | None = None
        self.fired: list[dict[str, Any]] = []
        """One ``{kind, rank, step, target}`` per fault and step it struck, in order."""
        self._struck: set[tuple[int, int]] = set()  # (fault index, step) of transient strikes
        self._struck_faults: set[int] = set()
        self._disarmed: set[int] = set()
        self._site_calls: dict[int, int] = {}
        self._steps_begun = 0
        self._unseen_warned = False

    # -- wiring --------------------------------------------------------------------------------

    def install(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *legacy: Any,
                site: str | None = None, param: str | None = None, element: int = 0) -> None:
        """Find every fault's target in ``model`` and attach the hooks that fire it.

        ``site`` is the default module path for the ``forward-*`` kinds, ``param`` the default
        parameter name for all others, ``element`` the default index into the flattened tensor;
        a fault's own ``site=``/``param=``/``element=`` wins. ``optimizer`` is needed only for
        ``optimizer-scale``. The ``reduce-*`` kinds also need :meth:`reduce_hook_around` given to
        the Guard. Raises :class:`FaultTargetError` naming the closest names when a target does
        not exist. Installing again (e.g. on a rebuilt job) moves the hooks to the new objects.
        """
        if isinstance(optimizer, torch.nn.Parameter):  # older form: install(site_module, parameter, optimizer)
            return self._install_objects(model, optimizer, legacy[0] if legacy else None, element)
        targets = []
        for fault in self.faults:
            index = fault.element if fault.element is not None else element
            if fault.info.corrupts == "forward":
                path = fault.site if fault.site is not None else site
                if path is None:
                    raise FaultTargetError(f"{fault} strikes a module's output: pass site='PATH' to install() or put site=PATH in the fault")
                name, module = resolve_module(model, path)
                targets.append(_Target(name, module, index))
            else:
                wanted = fault.param if fault.param is not None else param
                if wanted is None:
                    raise FaultTargetError(f"{fault} strikes a parameter: pass param='NAME' to install() or put param=NAME in the fault")
                name, parameter = resolve_parameter(model, wanted)
                targets.append(_Target(name, checked_parameter(fault, name, parameter, index), index))
        self._attach(targets, optimizer)

    def describe(self) -> list[str]:
        """One line per fault of this rank: the fault and where it strikes."""
        where = {"forward": "output of", "grad": "local gradient of", "reduce": "reduced gradient of",
                 "optimizer": "optimizer update of", "weights": "stored weights of"}
        return [f"{f} -> {where[f.info.corrupts]} {t}" for f, t in zip(self.faults, self.targets)]

    def remove(self) -> None:
        """Detach every hook this injector attached."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def reduce_hook_around(self, inner_hook: ReduceHook | None = None, inner_state: Any = None
                           ) -> tuple[Callable[["ReduceFaults", dist.GradBucket], torch.futures.Future[torch.Tensor]], "ReduceFaults"]:
        """``(hook, state)`` for ``Guard(reduce_hook=hook, reduce_state=state)`` (or for
        ``ddp.register_comm_hook(state, hook)``): ``inner_hook(inner_state, bucket)`` — your own
        reduction, by default DDP's average over the process group ``inner_state`` (None: the
        default group) — with the due ``reduce-*`` faults applied to its result. The hook declares
        ``averages_like_ddp`` (check 4 applies) exactly when the inner one does."""
        state = ReduceFaults(self, inner_hook, inner_state)
        return (_corrupt_reduced_mean if getattr(state.inner_hook, "averages_like_ddp", False) else corrupt_reduced), state

    def reduce_hook(self, process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
                    ) -> torch.futures.Future[torch.Tensor]:
        """DDP's average, corrupted on the way out when a ``reduce-*`` fault is due."""
        return corrupt_reduced(ReduceFaults(self, None, process_group), bucket)

    reduce_hook.averages_like_ddp = True  # type: ignore[attr-defined]  # DDP's mean: check 4 applies

    def begin_step(self, step: int) -> None:
        """Call before each step: sets the step and corrupts stored weights if a fault says so."""
        if self.faults and not self.targets:
            raise RuntimeError("FaultInjector.install(model, ...) must run before the first step")
        self._warn_unseen_sites()
        self.step = step
        self._steps_begun += 1
        for i in self._due("weights"):
            target = self.targets[i]
            with torch.no_grad():
                flat = target.obj.view(-1)
                before = flat.clone()
                if self.faults[i].kind == "weight-bitflip":
                    _flip_bit(flat, target.element, bit=_mantissa_bit(flat, 3))
                else:  # weight-swap
                    a, b = target.element, _swap_partner(target.element, flat.numel())
                    flat[a], flat[b] = before[b], before[a]
                _warn_if_unchanged(self.faults[i], target, before, flat)

    def disarm(self, ranks: list[int]) -> None:
        """The drill's stand-in for replacing the suspects' nodes: the faults that already struck
        there stop (a fault scheduled later is a new one). All-reduce faults belong to no node."""
        if self.rank in ranks:
            self._disarmed.update(i for i in self._struck_faults if self.faults[i].info.corrupts != "reduce")

    def _install_objects(self, site: torch.nn.Module, parameter: torch.nn.Parameter,
                         optimizer: torch.optim.Optimizer | None, element: int) -> None:
        targets = []
        for fault in self.faults:
            if fault.site is not None or fault.param is not None:
                raise FaultTargetError(f"{fault} names its target: use install(model, optimizer, ...) so names resolve")
            index = fault.element if fault.element is not None else element
            if fault.info.corrupts == "forward":
                targets.append(_Target(type(site).__name__, site, index))
            else:
                targets.append(_Target("parameter", checked_parameter(fault, "parameter", parameter, index), index))
        self._attach(targets, optimizer)

    def _attach(self, targets: list[_Target], optimizer: torch.optim.Optimizer | None) -> None:
        self.remove()
        self.targets = targets
        sites: dict[int, torch.nn.Module] = {}
        grads: dict[int, torch.Tensor] = {}
        for fault, target in zip(self.faults, targets):
            if fault.info.corrupts == "forward":
                sites[id(target.obj)] = target.obj
            elif fault.info.corrupts == "grad":
                grads[id(target.obj)] = target.obj
        self._site_calls = {key: 0 for key in sites}
        self._steps_begun = 0
        for key, module in sites.items():
            self._handles.append(module.register_forward_hook(self._activation_hook(key)))
        for key, parameter in grads.items():
            self._handles.append(parameter.register_hook(self._grad_hook(key)))
        if any(f.info.corrupts == "optimizer" for f in self.faults):
            if optimizer is None:
                raise ValueError("optimizer-scale faults need the optimizer: install(model, optimizer, ...)")
            self._handles.append(optimizer.register_step_post_hook(self._after_optimizer_step))

    # -- the hooks -----------------------------------------------------------------------------

    def _activation_hook(self, key: int) -> Callable[..., Any]:
        def on_activation(module: torch.nn.Module, args: Any, output: Any) -> Any:
            self._site_calls[key] += 1
            for i in self._due("forward", {key}):
                output = _corrupt_output(output, self.faults[i], self.targets[i])
            return output
        return torch.compiler.disable(on_activation)

    def _grad_hook(self, key: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def on_local_grad(grad: torch.Tensor) -> torch.Tensor:
            for i in self._due("grad", {key}):
                grad = grad.clone(memory_format=torch.contiguous_format)
                flat, element = grad.view(-1), self.targets[i].element
                if self.faults[i].kind == "grad-inf":
                    flat[element] = float("inf")
                else:  # grad-bitflip: the top mantissa bit, a finite result
                    _flip_bit(flat, element, bit=_mantissa_bit(flat, 1))
            return grad
        return on_local_grad

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for i in self._due("optimizer"):
            target = self.targets[i]
            with torch.no_grad():
                flat = target.obj.view(-1)
                before = flat.clone()
                flat[target.element] *= self.faults[i].magnitude
                _warn_if_unchanged(self.faults[i], target, before, flat)

    def _due_in_bucket(self, bucket: dist.GradBucket) -> list[tuple[FaultSpec, int]]:
        """The ``reduce-*`` faults striking this bucket now, each with its offset in the bucket."""
        if self.step is None or not any(f.info.corrupts == "reduce" and f.fires_at(self.step) for f in self.faults):
            return []
        offsets, offset = {}, 0
        for parameter in bucket.parameters():  # DDP lays a bucket's parameters end to end
            offsets[id(parameter)] = offset
            offset += parameter.numel()
        return [(self.faults[i], offsets[id(self.targets[i].obj)] + self.targets[i].element)
                for i in self._due("reduce", set(offsets))]

    # -- bookkeeping ---------------------------------------------------------------------------

    def _due(self, corrupts: str, keys: set[int] | None = None) -> list[int]:
        """Indices of the faults of this kind that strike now (on one of ``keys``), recorded as fired."""
        due = []
        for i, fault in enumerate(self.faults):
            if i in self._disarmed or fault.info.corrupts != corrupts or self.step is None:
                continue
            if not fault.fires_at(self.step) or (keys is not None and id(self.targets[i].obj) not in keys):
                continue
            if not fault.persistent:
                if replaying() != (fault.during == "replay") or (i, self.step) in self._struck:
                    continue
                self._struck.add((i, self.step))
            due.append(i)
            self._struck_faults.add(i)
            event = {"kind": fault.kind, "rank": self.rank, "step": self.step, "target": str(self.targets[i])}
            if event not in self.fired:
                self.fired.append(event)
                log.info("injected %s on rank %d at step %d into %s", fault.kind, self.rank, self.step, self.targets[i])
        return due

    def _warn_unseen_sites(self) -> None:
        """A forward site whose hook never ran during a whole step is probably compiled code
        traced before :meth:`install` (the compiled graph does not see later hooks)."""
        if self._unseen_warned or self._steps_begun == 0:
            return
        unseen = [t.name for f, t in zip(self.faults, self.targets)
                  if f.info.corrupts == "forward" and self._site_calls.get(id(t.obj)) == 0]
        if unseen:
            self._unseen_warned = True
            log.warning("sdcguard fault injector: the forward hook on %s did not run during step %s: was the "
                        "model compiled and run before install()? Install before the first forward.",
                        ", ".join(sorted(set(unseen))), self.step)


class ReduceFaults:
    """State of :func:`corrupt_reduced`: the injector, and the reduction it wraps."""

    __slots__ = ("injector", "inner_hook", "inner_state")

    def __init__(self, injector: FaultInjector, inner_hook: ReduceHook | None = None, inner_state: Any = None) -> None:
        self.injector = injector
        self.inner_hook: ReduceHook = inner_hook or allreduce_mean
        self.inner_state = inner_state
        """``inner_hook``'s state; for the default average, the process group (None: the default)."""


def corrupt_reduced(state: ReduceFaults, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """``state.inner_hook``'s reduction, with the due ``reduce-*`` faults applied to its result:
    one element of the target parameter's slice of the reduced bucket, alike on every rank."""
    strikes = state.injector._due_in_bucket(bucket)
    future = state.inner_hook(state.inner_state, bucket)
    if not strikes:
        return future

    def corrupt(fut: torch.futures.Future[Any]) -> Any:
        reduced = fut.value()
        flat = (reduced[0] if isinstance(reduced, (list, tuple)) else reduced).view(-1)
        for fault, at in strikes:
            flat[at] = float("nan") if fault.kind == "reduce-nan" else flat[at] * fault.magnitude
        return reduced

    return future.then(corrupt)


def _corrupt_reduced_mean(state: ReduceFaults, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """:func:`corrupt_reduced` around a reduction that averages like DDP (check 4 applies)."""
    return corrupt_reduced(state, bucket)


_corrupt_reduced_mean.averages_like_ddp = True  # type: ignore[attr-defined]


# -- corrupting ----------------------------------------------------------------------------------

def _corrupt_output(output: Any, fault: FaultSpec, target: _Target) -> Any:
    """A module's output with one element corrupted: a tensor, or the first item of a tuple."""
    if isinstance(output, torch.Tensor):
        return _corrupt_activation(output, fault, target)
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        items = [_corrupt_activation(output[0], fault, target), *output[1:]]
        return type(output)(*items) if hasattr(output, "_fields") else type(output)(items)
    raise FaultTargetError(f"{fault}: {target.name} returns {type(output).__name__}; a forward fault needs a "
                           "tensor output, or a tuple whose first item is one: pick another site")


def _corrupt_activation(output: torch.Tensor, fault: FaultSpec, target: _Target) -> torch.Tensor:
    if hasattr(output, "to_local"):  # a DTensor (tensor parallelism): this rank computed its local piece only
        from torch.distributed.tensor import DTensor
        local = _corrupt_activation(output.to_local(), fault, target)
        return DTensor.from_local(local, output.device_mesh, output.placements, run_check=False,
                                  shape=output.shape, stride=output.stride())
    check_element(fault, f"the output of {target.name} (shape {tuple(output.shape)})", output.numel(), target.element)
    output = output.clone(memory_format=torch.contiguous_format)  # never write into what autograd saved
    flat, e = output.view(-1), target.element
    flat[e] = float("nan") if fault.kind == "forward-nan" else flat[e] * fault.magnitude
    return output


def _swap_partner(element: int, numel: int) -> int:
    return element + 1 if element + 1 < numel else element - 1


def _warn_if_unchanged(fault: FaultSpec, target: _Target, before: torch.Tensor, after: torch.Tensor) -> None:
    if torch.equal(before, after):
        log.warning("sdcguard fault injector: %s left %s unchanged (equal values): pick another element", fault, target)


def _mantissa_bit(flat: torch.Tensor, from_top: int) -> int:
    """Index of a mantissa bit ``from_top`` places below its highest one (keeps values finite)."""
    mantissa = {torch.float32: 23, torch.float64: 52, torch.float16: 10, torch.bfloat16: 7}
    return mantissa.get(flat.dtype, 8 * flat.element_size() - 2) - from_top


def _flip_bit(flat: torch.Tensor, index: int, bit: int) -> None:
    """Flip one bit of one element in place, whatever its dtype."""
    as_int = flat.view(_INT_OF_WIDTH[flat.element_size()])
    as_int[index] ^= 1 << bit
