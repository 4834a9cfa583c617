"""sdcguard in a Lightning Fabric loop (lightning 2.6): the Guard for what ``fabric.setup`` returned.

    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=int(os.environ["LOCAL_WORLD_SIZE"]))
    fabric.launch()
    model, optimizer = fabric.setup(model, optimizer)
    guard = fabric_guard(fabric, model, optimizer, loss_fn)       # config: Config.from_env() by default
    for step in range(steps):
        with guard.step(step, micro_batches=n) as s:
            for micro in micro_batches:
                s.backward(micro, divide_by=n)   # replaces no_backward_sync + fabric.backward(loss / n)
            s.check()
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            optimizer.zero_grad()
        fabric.save(path, {"model": model, "optimizer": optimizer, "step": step})  # check 3, manifest

The Guard gets the ``DistributedDataParallel`` module inside Fabric's ``_FabricModule`` (or the
plain module with one device) and the torch optimizer inside ``_FabricOptimizer``; the update
gate sits on that optimizer, so ``optimizer.step()`` (through Fabric's precision plugin, a
GradScaler's ``step`` with ``"16-mixed"``) is refused before ``s.check()`` passed.
``loss_fn(module, micro)`` is called with a module that does what ``_FabricModule.forward`` does
(the precision plugin's ``convert_input``, its autocast / dtype context, ``convert_output``)
around DDP for your pass and around the bare module for replays on other ranks, so both compute
the bits the plain Fabric loop computes. ``s.backward`` is ``fabric.backward``: the precision
plugin's backward is ``loss.backward()`` (``scaler.scale(loss)`` first with ``"16-mixed"``),
which the step API does, and DDP's ``no_sync`` on all but the last micro-batch is Fabric's
``no_backward_sync``.

Checkpoints: once the Guard exists, ``fabric.save(path, state)`` runs check 3 and writes ``state``
(converted as Fabric converts it) with ``path.sdcguard.json`` through ``guard.save_checkpoint``
(the step, the kept resume points of a path written over and over); ``fabric.load(path, state)``
checks the file against its manifest (and the alarm's step and sha256: ``expect_step`` /
``expect_sha256``) on every rank before Fabric reads it, and the loaded weights against its
digest after, then the run inherits its history.

Refused with a :class:`~sdcguard.errors.ConfigurationError` naming the setting: FSDP (Fabric's is
FSDP1), DeepSpeed, XLA, ``strategy="dp"``, ``ModelParallelStrategy``, precision plugins other than
``32-true`` / ``64-true`` / ``16-mixed`` / ``bf16-mixed`` / ``16-true`` / ``bf16-true``, and a
custom ``CheckpointIO`` (sdcguard writes the file itself).
"""
from __future__ import annotations

import atexit
import logging
import os
from typing import Any, Callable

import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.fabric.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from lightning.fabric.strategies import (DataParallelStrategy, DDPStrategy, DeepSpeedStrategy, FSDPStrategy,
                                         ModelParallelStrategy, SingleDeviceStrategy, SingleDeviceXLAStrategy,
                                         Strategy, XLAFSDPStrategy, XLAStrategy)
from lightning.fabric.wrappers import _FabricModule, _FabricOptimizer

from .. import checkpoint as ckpt
from ..buckets import settle_buckets
from ..checks.replay import replay_mode
from ..checks.weights import fingerprint_weights
from ..config import Config
from ..errors import ConfigurationError
from ..guard import Guard
from .base import adopt, agree

__all__ = ["fabric_guard"]

log = logging.getLogger("sdcguard")

_PRECISIONS = (Precision, MixedPrecision, HalfPrecision, DoublePrecision)
"""Precision plugins whose forward and backward the step API reproduces (exact types: a subclass
may change the backward)."""


def fabric_guard(fabric: Fabric, model: _FabricModule, optimizer: Any,
                 loss_fn: Callable[[Any, Any], torch.Tensor], *, config: Config | None = None,
                 expect_step: int | None = None, expect_sha256: str | None = None, settle_with: Any = None,
                 **guard_kwargs: Any) -> Guard:
    """The Guard for the model and optimizer ``fabric.setup`` returned (every rank calls it).

    ``loss_fn(module, micro)``: the forward and the loss, as your loop computes them with the
    Fabric model (``module(x)`` runs under Fabric's precision). ``config``: default
    ``Config.from_env()``. ``expect_step`` / ``expect_sha256``: the alarm's
    ``last_good_checkpoint_step`` / ``_sha256`` when this run resumes from that file; a
    ``fabric.load`` of any other is refused. ``settle_with``: when resuming, any micro-batch of
    the usual shape: one throw-away pass through DDP (``sdcguard.settle_buckets``, faults and
    metrics off as in a replay) before the Guard exists, so the first resumed step reduces in the
    bucket layout the original run had and the run goes on bit for bit as the uninterrupted one
    would. Other keyword arguments go to :class:`Guard`
    (``reduce_hook`` / ``reduce_state``: your own DDP reduction). From here on ``fabric.save`` and
    ``fabric.load`` go through the Guard (module docstring)."""
    strategy = fabric.strategy
    _refuse_unchecked(strategy)
    if not isinstance(model, _FabricModule):
        raise ConfigurationError(f"sdcguard: fabric_guard takes the model fabric.setup returned (a _FabricModule), "
                                 f"got {type(model).__name__}")
    if isinstance(optimizer, _FabricOptimizer):
        optimizer = optimizer.optimizer
    elif not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigurationError(f"sdcguard: fabric_guard takes the optimizer fabric.setup returned, got "
                                 f"{type(optimizer).__name__}")
    precision = strategy.precision
    views: dict[int, _PrecisionForward] = {}

    def fabric_loss(module: torch.nn.Module, micro: Any) -> torch.Tensor:
        view = views.get(id(module))
        if view is None or view.target is not module:
            view = views[id(module)] = _PrecisionForward(module, precision, model.module)
        return loss_fn(view, micro)

    if settle_with is not None:
        with replay_mode():
            settle_buckets(model._forward_module, fabric_loss, settle_with)
    guard = Guard(model._forward_module, optimizer, fabric_loss, config=config,
                  scaler=getattr(precision, "scaler", None), **guard_kwargs)
    _Checkpoints(guard, strategy, expect_step, expect_sha256).install()
    # A Fabric loop has no end-of-training hook, and the Guard's own exit flush holds it weakly:
    # a guard local to a function that returned would never write its last statistics.
    atexit.register(guard.close)
    return guard


def _refuse_unchecked(strategy: Strategy) -> None:
    """What this integration cannot check, refused before anything is wrapped."""
    name = type(strategy).__name__
    if isinstance(strategy, (XLAStrategy, XLAFSDPStrategy, SingleDeviceXLAStrategy)):
        raise ConfigurationError(f"sdcguard: Fabric's XLA strategies (accelerator='tpu', {name}) are not supported: "
                                 "the checks run on torch.distributed process groups")
    if isinstance(strategy, DeepSpeedStrategy):
        raise ConfigurationError("sdcguard: strategy='deepspeed' is not supported: DeepSpeed's engine reduces and "
                                 "updates inside its own backward and step, out of reach of the checks")
    if isinstance(strategy, FSDPStrategy):
        raise ConfigurationError("sdcguard: Fabric's strategy='fsdp' is FSDP1 (FullyShardedDataParallel), which "
                                 "sdcguard does not check; use strategy='ddp', or FSDP2 (fully_shard) with the step "
                                 "API (sdcguard.Guard) in a plain torch.distributed loop")
    if isinstance(strategy, ModelParallelStrategy):
        raise ConfigurationError("sdcguard: ModelParallelStrategy (FSDP2 / tensor parallelism in parallelize_fn) is "
                                 "not checked by this integration yet; use strategy='ddp'")
    if isinstance(strategy, DataParallelStrategy):
        raise ConfigurationError("sdcguard: strategy='dp' (DataParallel, several devices in one process) is not "
                                 "supported: launch one process per device with strategy='ddp'")
    if not isinstance(strategy, (DDPStrategy, SingleDeviceStrategy)):
        raise ConfigurationError(f"sdcguard: Fabric strategy {name} is not supported; use strategy='ddp' "
                                 "(or one device)")
    precision = strategy.precision
    if type(precision) not in _PRECISIONS:
        raise ConfigurationError(
            f"sdcguard: precision plugin {type(precision).__name__} is not supported (its forward or backward is "
            "not one the replay reproduces); use precision='32-true', '64-true', '16-mixed', 'bf16-mixed', "
            "'16-true' or 'bf16-true'")


class _PrecisionForward:
    """What ``_FabricModule.forward`` does around a module, without its ``fabric.backward`` guard
    hook (the step API runs the backward): convert the inputs, run under the precision plugin's
    forward context, convert the outputs. Other attributes are the user's module's."""

    __slots__ = ("target", "precision", "original")

    def __init__(self, target: torch.nn.Module, precision: Precision, original: torch.nn.Module) -> None:
        self.target = target
        """DDP (or the compiled module) for your pass, the bare module for a replay."""
        self.precision = precision
        self.original = original

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = self.precision.convert_input((args, kwargs))
        with self.precision.forward_context():
            output = self.target(*args, **kwargs)
        return self.precision.convert_output(output)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.original, name)


class _Checkpoints:
    """``fabric.save`` / ``fabric.load`` through the Guard: the strategy's own ``save_checkpoint``
    and ``load_checkpoint`` replaced on that one strategy object.

    A patch, kept on purpose: Fabric's extension points do not reach here. ``fabric_guard`` gets a
    Fabric the user already built and launched, so a ``Strategy`` subclass (chosen at
    ``Fabric(strategy=...)``) is not ours to pick; and a ``CheckpointIO`` plugin is called on
    global rank 0 only, after the state was converted, while check 3 is a collective every rank
    must run before anything is written (and the load check must run on every rank before Fabric
    reads the file)."""

    __slots__ = ("guard", "strategy", "expect_step", "expect_sha256", "fabric_load")

    def __init__(self, guard: Guard, strategy: Strategy, expect_step: int | None, expect_sha256: str | None) -> None:
        self.guard = guard
        self.strategy = strategy
        self.expect_step = expect_step
        self.expect_sha256 = expect_sha256
        # Fabric's own load, kept on the strategy: a second fabric_guard on the same Fabric
        # replaces the first one's routing instead of wrapping it.
        self.fabric_load = vars(strategy).setdefault("_sdcguard_fabric_load", strategy.load_checkpoint)

    def install(self) -> None:
        self.strategy.save_checkpoint = self.save  # type: ignore[method-assign]
        self.strategy.load_checkpoint = self.load  # type: ignore[method-assign]

    def save(self, path: Any, state: dict[str, Any], storage_options: Any = None,
             filter: dict[str, Callable[[str, Any], bool]] | None = None) -> None:
        """Every rank (Fabric's rule for ``fabric.save``): check 3, then rank 0 writes the state
        Fabric would write and its manifest."""
        if storage_options is not None:
            raise ConfigurationError("sdcguard: storage_options are not supported; checkpoints are written with torch.save")
        if type(self.strategy.checkpoint_io) is not TorchCheckpointIO:
            raise ConfigurationError(f"sdcguard: checkpoint_io {type(self.strategy.checkpoint_io).__name__} is not "
                                     "supported: sdcguard writes the file (torch.save) and its manifest itself")
        key = self._model_key(state)
        if key is None:
            raise ckpt.CheckpointError(f"fabric.save({path}): the state holds no entry for the model sdcguard checks "
                                       "(e.g. {'model': model, ...}); its manifest needs those weights")
        converted = self.strategy._convert_stateful_objects_in_state(state, filter=filter or {})
        step = converted.get("step")  # yours, when you save one: it must be the Guard's (a mismatch is refused)
        step = step if isinstance(step, int) and not isinstance(step, bool) else None
        self.guard.save_checkpoint(os.fspath(path), step=step, state=converted, model_key=key)

    def load(self, path: Any, state: Any = None, strict: bool = True, weights_only: bool | None = None) -> Any:
        """Every rank: the file against its manifest before Fabric reads it; once loaded, the
        weights against its digest, and the run inherits the checkpoint's history."""
        path = os.fspath(path)
        manifest: dict[str, Any] | None = None
        failure = None
        try:
            manifest = self._manifest(path)
        except (ckpt.CheckpointError, OSError) as exc:
            failure = f"{type(exc).__name__}: {exc}"
        agree(self.guard, failure)
        loaded = self.fabric_load(path, state, strict, weights_only)
        if manifest is None or not self._loads_model(state):
            return loaded
        guard = self.guard
        found = fingerprint_weights(guard.named_parameters).digest.hex()
        agree(guard, None if found == manifest["weight_digest"] else
              f"the weights Fabric loaded have digest {found}, {path}'s manifest says {manifest['weight_digest']}")
        adopt(guard, path, manifest, manifest["weight_digest"])
        return loaded

    def _manifest(self, path: str) -> dict[str, Any] | None:
        """The checked manifest, or None for a file sdcguard did not write (pretrained weights,
        ``fabric.load_raw``): loaded with a warning, unless an alarm's checkpoint was expected."""
        expected = self.expect_step is not None or self.expect_sha256 is not None
        if not expected and not ckpt.manifest_path(path).exists():
            if self.guard.topology.rank == 0:
                log.warning("sdcguard: %s has no manifest: loading a file sdcguard did not verify", path)
            return None
        return ckpt.verified_manifest(path, expect_step=self.expect_step, expect_sha256=self.expect_sha256)

    def _model_key(self, state: Any) -> str | None:
        """The key of ``state`` that holds the guarded model (Fabric has unwrapped it to DDP)."""
        guard = self.guard
        if not isinstance(state, dict):
            return None
        ours = [guard.model, guard.module, *guard.layout.wrappers]
        return next((k for k, v in state.items() if any(v is m for m in ours)), None)

    def _loads_model(self, state: Any) -> bool:
        guard = self.guard
        if isinstance(state, torch.nn.Module):
            return any(state is m for m in (guard.model, guard.module, *guard.layout.wrappers))
        return self._model_key(state) is not None
