"""sdcguard's checks inside a PyTorch Lightning 2.6 run: one strategy, the user's module unchanged.

    import sdcguard.integrations.lightning
    strategy = sdcguard.integrations.lightning.GuardedDDPStrategy(sdcguard.Config.from_env(audit_every=100))
    trainer = L.Trainer(accelerator="cpu", devices=3, strategy=strategy, accumulate_grad_batches=2,
                        gradient_clip_val=1.0, callbacks=[ModelCheckpoint(save_last=True)])
    trainer.fit(model, datamodule=data)  # raises sdcguard.SDCDetected on every rank when a check fires

:class:`GuardedDDPStrategy` is Lightning's ``DDPStrategy`` with each optimizer step run as one
``guard.step`` of the step API (``sdcguard.step``): ``training_step`` is the forward sdcguard
records (micro-batch, forward RNG seed, buffers), Lightning's backward of ``loss / N`` is the
backward it replays, and the optimizer step checks before it updates.

The crux is Lightning's automatic optimization: it calls ``optimizer.step(closure)`` and the last
micro-batch's forward and backward run *inside* that call, after torch's step pre-hooks, where
sdcguard's update gate refuses an unchecked update. The strategy therefore runs the closure first,
then ``s.check()`` (checks 1 and 4, and on audit steps 2 and 3), then hands Lightning's precision
plugin a closure that returns the result already computed: ``on_before_optimizer_step``, gradient
clipping (``gradient_clip_val``) and the update then run in Lightning's order, and check 3 after.

Checkpoints: every ``trainer.save_checkpoint`` (``ModelCheckpoint``, ``last.ckpt``) goes through
``guard.save_checkpoint`` (check 3 first, a manifest beside the file, a file written again kept
while an alarm may still name it); a checkpoint ``ModelCheckpoint`` rotates away is kept the same
way. ``trainer.fit(ckpt_path=...)`` checks the file against its manifest before Lightning reads it
and the loaded weights against its digest before the first step.

:class:`GuardedModelParallelStrategy` does the same for Lightning's ``ModelParallelStrategy`` with
FSDP2 (``fully_shard`` in ``configure_model``, pure FSDP or HSDP, and tensor parallelism): the
Guard is built on the sharded module, the sharded checks run (``sdcguard.sharding``), and every
checkpoint is the Guard's verified DCP directory; with ``tensor_parallel_size > 1``
(``parallelize_module`` on Lightning's ``tensor_parallel`` mesh first) the tensor-parallel layout's.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import os
from typing import Any, Callable, Iterator, Mapping

import torch
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

from .. import checkpoint as ckpt
from .. import recovery
from ..buckets import settle_buckets
from ..checks.replay import replay_mode, replaying
from ..checks.weights import fingerprint_weights
from ..config import Config
from ..errors import ConfigurationError
from ..guard import Guard
from ..step import Step
from .base import HeldStep, adopt, agree

__all__ = ["GuardedDDPStrategy", "GuardedFSDPStrategy", "GuardedModelParallelStrategy", "training_step_loss"]

log = logging.getLogger("sdcguard")

MODEL_KEY = "state_dict"
"""Where a Lightning checkpoint holds the module's weights (what the manifest's digest covers)."""
LIGHTNING_KEY = "lightning"
"""The entry of a sharded checkpoint that holds Lightning's own (loops, callbacks, schedulers), pickled."""


def training_step_loss(output: Any) -> torch.Tensor:
    """The loss of a ``training_step`` output, as Lightning's automatic optimization reads it."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    raise TypeError("sdcguard: training_step must return the loss tensor or a dict with a 'loss' tensor "
                    f"(got {type(output).__name__}); a step skipped by returning None cannot be checked")


class _CheckedSteps:
    """What both guarded strategies share: one optimizer step = one ``guard.step`` (training_step,
    backward and optimizer_step, see the module docstring), the Guard's close, checkpoint rotation.
    Mixed in before a Lightning strategy class, whose methods ``super()`` reaches."""

    guard: Guard | None
    _held: HeldStep
    _resumed: tuple[str, dict[str, Any]] | None

    def _init_checks(self, config: Config | None, expect_step: int | None, expect_sha256: str | None) -> None:
        # Settings.
        self.sdc_config = config
        self.expect_step = expect_step
        self.expect_sha256 = expect_sha256
        # State.
        self.guard = None
        """Built in ``setup`` once the module is wrapped (DDP) or sharded, and the optimizer exists."""
        self._held = HeldStep()
        """The optimizer step in progress: opened at its first training_step, closed after the update."""
        self._resumed = None

    def _refuse_unchecked(self) -> None:
        """What the step cannot check, said before the first step."""
        module = self.lightning_module  # type: ignore[attr-defined]
        name = type(self).__name__
        if not module.automatic_optimization:
            raise ConfigurationError(f"sdcguard: {name} checks Lightning's automatic optimization; with "
                                     "automatic_optimization=False use the step API (sdcguard.Guard) in your training_step")
        optimizers = self.optimizers  # type: ignore[attr-defined]
        if len(optimizers) != 1:
            raise ConfigurationError(f"sdcguard: one optimizer per run is checked, configure_optimizers gave {len(optimizers)}")
        if isinstance(optimizers[0], torch.optim.LBFGS):
            raise ConfigurationError("sdcguard: LBFGS re-evaluates its closure inside optimizer.step(); "
                                     "those passes cannot be checked before the update")

    def _loss_fn(self, module: torch.nn.Module, micro: Any) -> torch.Tensor:
        """sdcguard's ``loss_fn`` for replays: the module's own ``training_step`` on the recorded
        ``(args, kwargs)``, in the precision plugin's forward context, with logging off."""
        args, kwargs = micro
        with self.precision_plugin.train_step_context(), _quiet(module):  # type: ignore[attr-defined]
            return training_step_loss(module.training_step(*args, **kwargs))

    def _build_late(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A resumed run's Guard, built at its first training_step (DDP: after settling its buckets)."""

    # -- one optimizer step = one guard.step ---------------------------------------------------

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.guard is None and self._resumed is not None and self.lightning_module.trainer.training:  # type: ignore[attr-defined]
            self._build_late(args, kwargs)
        guard = self.guard
        if guard is None or not self.lightning_module.training:  # type: ignore[attr-defined]
            return super().training_step(*args, **kwargs)  # type: ignore[misc]
        s = self._held.current if self._held.current is not None else self._open_step()
        if len(s.batches) >= s.micro_batches:
            raise RuntimeError(f"sdcguard: step {s.step} declared {s.micro_batches} micro-batches, Lightning ran "
                               f"another training_step before the optimizer step (did optimizer_step skip "
                               "optimizer.step(closure)?)")
        with s.forward((_detached(args), _detached(kwargs))) as record:  # what _loss_fn replays
            output = super().training_step(*args, **kwargs)  # type: ignore[misc]
            record(training_step_loss(output))
        return output

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        s = self._held.current
        if s is None or self.guard is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)  # type: ignore[misc]
        # Lightning's automatic optimization backpropagates training_step's loss / accumulate_grad_batches.
        with s.backward_pass(divide_by=float(self.lightning_module.trainer.accumulate_grad_batches)):  # type: ignore[attr-defined]
            return super().backward(closure_loss, optimizer, *args, **kwargs)  # type: ignore[misc]

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        if self.guard is None and self._resumed is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)  # type: ignore[misc]
        # The last micro-batch's training_step and backward (DDP reduces here); the first of a resumed
        # run (accumulate_grad_batches=1) builds the Guard in there.
        result = closure()
        s = self._held.current
        if s is None:
            raise RuntimeError("sdcguard: optimizer step without a training_step in this step")
        try:
            s.check()  # checks 1 and 4 (2 and 3 on audit steps): raise on every rank alike
            output = super().optimizer_step(optimizer, lambda: result, model, **kwargs)  # type: ignore[misc]
        except BaseException as exc:
            self._held.close(exc)
            raise
        self._held.close(None)  # check 3 on weight-check steps
        return output

    def _open_step(self) -> Step:
        assert self.guard is not None
        trainer = self.lightning_module.trainer  # type: ignore[attr-defined]
        return self._held.open(self.guard, trainer.global_step, self._window(trainer))

    @staticmethod
    def _window(trainer: Any) -> int:
        """The micro-batches of the step starting now: ``accumulate_grad_batches``, fewer at the end of
        an epoch (Lightning steps on an epoch's last batch)."""
        accumulate = trainer.accumulate_grad_batches
        batch_idx = trainer.fit_loop.epoch_loop.batch_idx
        total = trainer.num_training_batches
        if isinstance(total, int) and total > 0:
            return max(1, min(accumulate, total - batch_idx))
        return accumulate

    def on_exception(self, exception: BaseException) -> None:
        self._held.close(exception)  # a step cut short (e.g. training_step raised) ends unapplied
        super().on_exception(exception)  # type: ignore[misc]

    def teardown(self) -> None:
        if self.guard is not None:
            self.guard.close()
        super().teardown()  # type: ignore[misc]

    # -- checkpoint rotation -------------------------------------------------------------------

    def _keep(self, entry: recovery.Checkpoint) -> str | None:
        """Move ``entry``'s checkpoint to its kept name; return it (None: the path no longer holds it)."""
        raise NotImplementedError

    def remove_checkpoint(self, filepath: Any) -> None:
        """``ModelCheckpoint`` rotating a checkpoint away: when a later alarm may still name it as its
        resume point it is kept under its kept name instead (``recovery.kept_path``), else removed
        with its manifest and out of the history."""
        guard = self.guard
        if guard is None:
            return super().remove_checkpoint(filepath)  # type: ignore[misc]
        path = os.fspath(filepath)
        history = guard.history
        keep = recovery.worth_keeping(history, path) if guard.config.keep_resume_points else None
        kept_as = None
        if self.is_global_zero:  # type: ignore[attr-defined]
            if keep is not None:
                kept_as = self._keep(keep)
                if kept_as is not None:
                    log.warning("sdcguard: %s held step %d, which a later alarm may still name as its resume point: "
                                "kept as %s", path, keep.step, kept_as)
            if os.path.lexists(path):
                super().remove_checkpoint(filepath)  # type: ignore[misc]
            ckpt.manifest_path(path).unlink(missing_ok=True)
        kept_as = self.broadcast(kept_as)  # type: ignore[attr-defined]  # every rank's history says where it went
        entries_after = []
        for c in history.checkpoints:
            if c.path != path:
                entries_after.append(c)
            elif c is keep and kept_as is not None:
                entries_after.append(dataclasses.replace(c, path=kept_as, kept_from=path))
        history.checkpoints = entries_after


class GuardedDDPStrategy(_CheckedSteps, DDPStrategy):
    """Lightning's DDP with sdcguard's checks around every optimizer step (see the module docstring).

    ``config``: sdcguard's settings (default ``Config.from_env()``: the ``SDCGUARD_*`` variables).
    ``expect_step`` / ``expect_sha256``: for ``trainer.fit(ckpt_path=...)``, the alarm's
    ``last_good_checkpoint_step`` / ``_sha256``: a file that holds anything else is refused.
    ``reduce_hook`` / ``reduce_state``: your own DDP reduction (``Guard(reduce_hook=)``). Other
    keyword arguments go to ``DDPStrategy``."""

    strategy_name = "sdcguard_ddp"

    def __init__(self, config: Config | None = None, *, expect_step: int | None = None,
                 expect_sha256: str | None = None, reduce_hook: Any = None, reduce_state: Any = None,
                 **ddp_kwargs: Any) -> None:
        if ddp_kwargs.get("ddp_comm_hook") is not None:
            raise ConfigurationError("sdcguard: give your DDP comm hook as GuardedDDPStrategy(reduce_hook=..., "
                                     "reduce_state=...): sdcguard's recording hook wraps it")
        if ddp_kwargs.get("model_averaging_period") is not None:
            raise ConfigurationError("sdcguard: post-local SGD model averaging changes the weights outside the "
                                     "checked step; it is not supported")
        super().__init__(**ddp_kwargs)
        self._init_checks(config, expect_step, expect_sha256)
        self.reduce_hook = reduce_hook
        self.reduce_state = reduce_state

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        if trainer.state.fn != "fit":
            return
        self._refuse_unchecked()
        if self._resumed is None:
            self._build_guard()
        # else at the first training_step: DDP's buckets are settled first (see _build_late)

    def _build_guard(self) -> None:
        scaler = getattr(self.precision_plugin, "scaler", None)
        self.guard = Guard(self.model, self.optimizers[0], self._loss_fn, config=self.sdc_config, scaler=scaler,
                           reduce_hook=self.reduce_hook, reduce_state=self.reduce_state)
        if self._resumed is not None:
            self._adopt_resumed(*self._resumed)

    def _build_late(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A resumed run: one throw-away pass through DDP on the first batch (``sdcguard.settle_buckets``,
        outside any check, faults and logging off as in a replay) so that the first resumed step
        reduces in the bucket layout the original run had by then; then the Guard."""
        def through_ddp(model: torch.nn.Module, micro: Any) -> torch.Tensor:
            with self.precision_plugin.train_step_context(), _quiet(self.lightning_module):
                return training_step_loss(self._forward_redirection(model, self.lightning_module, "training_step",
                                                                    *micro[0], **micro[1]))
        ddp = self.model
        sync, ddp.require_backward_grad_sync = ddp.require_backward_grad_sync, True  # also under no_sync
        try:
            with replay_mode():
                settle_buckets(ddp, through_ddp, (args, kwargs))
        finally:
            ddp.require_backward_grad_sync = sync
        self._build_guard()

    # -- checkpoints ---------------------------------------------------------------------------

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Every rank: check 3, then rank 0 writes Lightning's checkpoint dict and its manifest."""
        if self.guard is None:  # not fitting (e.g. trainer.save_checkpoint after fit): no check to run
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise ConfigurationError("sdcguard: storage_options are not supported; checkpoints are written with torch.save")
        self.guard.save_checkpoint(os.fspath(filepath), state=checkpoint, model_key=MODEL_KEY)

    def _keep(self, entry: recovery.Checkpoint) -> str | None:
        return ckpt.keep_file(entry)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Before Lightning reads ``ckpt_path``: its manifest (and the alarm's step and sha256 when
        given) and its bytes; the loaded weights are checked against the manifest in ``setup``."""
        path = os.path.realpath(os.fspath(checkpoint_path))  # save_last="link": the file it points to
        manifest = ckpt.verified_manifest(path, expect_step=self.expect_step, expect_sha256=self.expect_sha256)
        loaded = super().load_checkpoint(path, weights_only=weights_only)
        _same_step(path, loaded, int(manifest["step"]))
        self._resumed = (path, manifest)
        return loaded

    def _adopt_resumed(self, path: str, manifest: dict[str, Any]) -> None:
        """The run resumed from ``path``: its weights must be the manifest's (on every rank), and its
        history is."""
        guard = self.guard
        assert guard is not None
        found = fingerprint_weights(guard.named_parameters).digest.hex()
        agree(guard, None if found == manifest["weight_digest"] else
              f"{path}: the weights Lightning loaded have digest {found}, its manifest says {manifest['weight_digest']}")
        adopt(guard, path, manifest, manifest["weight_digest"])
        self._resumed = None


class GuardedModelParallelStrategy(_CheckedSteps, ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2: ``fully_shard`` in ``configure_model``, after
    ``parallelize_module`` with ``tensor_parallel_size > 1``) with sdcguard's checks around every
    optimizer step.

    ``configure_model`` shards the module: ``fully_shard`` on each block, then on the module itself
    (the root), with ``mesh=self.device_mesh["data_parallel"]`` (pure FSDP: one replica, so check 3
    cannot run) or a ``(replicate, shard)`` mesh it builds with ``init_device_mesh`` (HSDP). With
    ``tensor_parallel_size=N`` it first makes layers tensor parallel on
    ``self.device_mesh["tensor_parallel"]`` (Lightning's mesh is ``("data_parallel",
    "tensor_parallel")``, TP the fastest dimension): the Guard reads the TP dimension from the
    parameters and checks every (TP, FSDP) position (``layouts/tensor_parallel.py``; the replay ring
    must carry each TP group onto another, so each node holds whole TP groups). The Guard is built on
    the sharded module once Lightning made the optimizer. ``data_parallel_size`` defaults to every
    rank not taken by tensor parallelism. Checkpoints are the Guard's sharded DCP directories
    (``guard.save_checkpoint``: check 3 first, a manifest of every file and shard; Lightning's own entries ride along in it) and
    ``trainer.fit(ckpt_path=DIR)`` loads one only after its files and shards are verified.
    ``expect_step`` / ``expect_sha256`` as for :class:`GuardedDDPStrategy`."""

    strategy_name = "sdcguard_model_parallel"

    def __init__(self, config: Config | None = None, *, expect_step: int | None = None,
                 expect_sha256: str | None = None, data_parallel_size: int | str = "auto",
                 tensor_parallel_size: int | str = 1, **kwargs: Any) -> None:
        if not kwargs.get("save_distributed_checkpoint", True):
            raise ConfigurationError("sdcguard: save_distributed_checkpoint=False is not supported: a sharded "
                                     "model's checkpoints are written as verified DCP directories with a manifest")
        super().__init__(data_parallel_size=data_parallel_size, tensor_parallel_size=tensor_parallel_size, **kwargs)
        self._init_checks(config, expect_step, expect_sha256)

    def setup_environment(self) -> None:
        if self._data_parallel_size == "auto" and self._tensor_parallel_size != "auto":
            # Lightning's "auto" is the number of nodes: here every rank not taken by tensor parallelism
            self._data_parallel_size = self.num_nodes * self.num_processes // int(self._tensor_parallel_size)
        super().setup_environment()

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        if trainer.state.fn != "fit":
            return
        self._refuse_unchecked()
        self.guard = Guard(_sharded_root(self.model), self.optimizers[0], self._loss_fn, config=self.sdc_config,
                           scaler=getattr(self.precision_plugin, "scaler", None))

    def _loss_fn(self, module: torch.nn.Module, micro: Any) -> torch.Tensor:
        """The LightningModule's ``training_step`` (``module`` is it, or the submodule it sharded as root)."""
        return super()._loss_fn(self.lightning_module, micro)

    # -- checkpoints ---------------------------------------------------------------------------

    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self.guard is None:
            return super().lightning_module_state_dict()
        return {}  # the Guard's save takes the sharded state itself, after check 3

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if self.guard is None:
            return super().optimizer_state(optimizer)
        return {}

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Every rank: check 3, then the DCP directory of the model's and optimizer's shards, with
        Lightning's other entries (loops, callbacks, schedulers, hyperparameters) as one pickled
        entry, and its manifest."""
        if self.guard is None:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise ConfigurationError("sdcguard: storage_options are not supported by ModelParallelStrategy")
        rest = {k: v for k, v in checkpoint.items() if k not in (MODEL_KEY, "optimizer_states")}
        buffer = io.BytesIO()
        torch.save(rest, buffer)
        path = self.broadcast(os.fspath(filepath))
        self.guard.save_checkpoint(path, state={LIGHTNING_KEY: buffer.getvalue()}, model_key=MODEL_KEY)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """``trainer.fit(ckpt_path=DIR)``: the Guard checks the manifest (and the alarm's step and
        sha256 when given) and every file before DCP reads any, loads the shards and checks their
        fingerprints; then Lightning's entries."""
        if self.guard is None:
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        path = os.path.realpath(self.broadcast(os.fspath(checkpoint_path)))
        state: dict[str, Any] = {LIGHTNING_KEY: b""}
        step = self.guard.load_checkpoint(path, model_key=MODEL_KEY, expect_step=self.expect_step,
                                          expect_sha256=self.expect_sha256, state=state)
        loaded = torch.load(io.BytesIO(state[LIGHTNING_KEY]), weights_only=weights_only)
        _same_step(path, loaded, step)
        return loaded

    def _keep(self, entry: recovery.Checkpoint) -> str | None:
        from ..sharding import dcp
        return dcp.keep_directory(entry)  # the rename a save over the same directory does


def _same_step(path: str, loaded: Mapping[str, Any], step: int) -> None:
    """Lightning's ``global_step`` counts updates: a checkpoint of step N holds N + 1."""
    if int(loaded.get("global_step", -1)) != step + 1:
        raise ckpt.CheckpointError(f"{path} holds global_step {loaded.get('global_step')}, its manifest says "
                                   f"the update of step {step} (global_step {step + 1})")


def _sharded_root(module: torch.nn.Module) -> torch.nn.Module:
    """The FSDP2 root ``configure_model`` made: the LightningModule (``fully_shard(self)``) or the one
    submodule holding every parameter (``fully_shard(self.model)``, Lightning's documented way)."""
    from torch.distributed.fsdp import FSDPModule
    if isinstance(module, FSDPModule):
        return module
    tops = [m for _, m in module.named_children() if isinstance(m, FSDPModule)]
    if len(tops) == 1 and sum(1 for _ in tops[0].parameters()) == sum(1 for _ in module.parameters()):
        return tops[0]
    raise ConfigurationError("sdcguard: configure_model must shard the whole model with FSDP2: fully_shard on each "
                             "block, then on the LightningModule itself or on the one submodule that holds every "
                             "parameter (its root)")


class GuardedFSDPStrategy:
    """Not supported: Lightning's ``FSDPStrategy`` is FSDP1; constructing this says what to use instead."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise ConfigurationError("sdcguard: Lightning's FSDPStrategy is FSDP1 (FullyShardedDataParallel), which "
                                 "sdcguard does not check; use GuardedModelParallelStrategy (FSDP2: fully_shard in "
                                 "configure_model) or GuardedDDPStrategy")


@contextlib.contextmanager
def _quiet(module: torch.nn.Module) -> Iterator[None]:
    """During a replay of another rank's batch, ``self.log`` / ``self.log_dict`` do nothing (the
    values are that rank's, and Lightning refuses logging from the optimizer step)."""
    if not replaying():
        yield
        return
    module.__dict__["log"] = module.__dict__["log_dict"] = _no_log
    try:
        yield
    finally:
        module.__dict__.pop("log", None)
        module.__dict__.pop("log_dict", None)


def _no_log(*args: Any, **kwargs: Any) -> None:
    return None


def _detached(value: Any) -> Any:
    """The recorded micro-batch: tensors detached (a replay must not reach this pass's graph)."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_detached(v) for v in value)
    return value

