"""The update gate: no optimizer update without a passing check in the step in progress.

One small object on the optimizer's step hooks, used by ``Step`` (which opens it, and allows the
update once ``check()`` passed) and by ``Guard`` (which closes it when the step ends). It also
counts which step's update the weights include: what a checkpoint written now records.

**On the device** (``Config(device_gate=True)``, a fused Adam, AdamW or SGD): on an ordinary step
the checks' verdict stays on the device. ``check()`` then allows the update with a ``found_inf``
tensor (``mask``) that the fused kernel reads on the device — 1.0 skips the update, and the
optimizer's step counter with it (``_fused_adam`` adds 1 to ``state['step']`` and subtracts
``found_inf``) — so the step needs no host synchronisation. The host reads that verdict (copied
to host memory without blocking, see :class:`Pending`) one step later, before it allows the next
update, before a checkpoint is written, and at ``Guard.settle()``/``close()``. A GradScaler
already hands the optimizer a ``found_inf`` of its own: the gate adds its mask to it (either one
skips the update) and puts the scaler's back after the step, where the scaler expects it.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from .errors import UncheckedUpdate

FUSED_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
"""What the device gate can hold back on the device: torch's fused kernels read ``found_inf``."""


def device_gate_refusal(optimizer: torch.optim.Optimizer) -> str | None:
    """Why ``optimizer`` cannot be gated on the device, or None when it can (every param group
    fused: ``torch.optim.Adam/AdamW/SGD(..., fused=True)``)."""
    if not isinstance(optimizer, FUSED_OPTIMIZERS):
        return (f"Config.device_gate needs torch.optim.Adam, AdamW or SGD with fused=True (their fused kernels "
                f"skip an update on the device); got {type(optimizer).__module__}.{type(optimizer).__name__}")
    unfused = [i for i, group in enumerate(optimizer.param_groups) if not group.get("fused")]
    if unfused:
        return (f"Config.device_gate needs fused=True in every param group of {type(optimizer).__name__} "
                f"(groups {unfused} are not fused): build it with {type(optimizer).__name__}(..., fused=True)")
    return None


@dataclass(slots=True)
class Pending:
    """An ordinary step whose verdict the device decided and the host has not read yet."""

    step: int
    record: Any
    """The step's ``StepRecord`` (a NaN/Inf found later is confirmed by replaying its batches)."""
    vote: Any
    """Its ``Vote``, with the per-rank row already taken (the layout's records move on)."""
    host: torch.Tensor
    """``[X, Y, failed]`` in host memory, copied without blocking once the device had them."""
    ready: Any = None
    """A CUDA event recorded after the copy (None on CPU: the copy is done when it returns)."""
    updates_before: int | None = None
    """What ``updates_through`` was before the step (restored when its update is refused)."""
    fresh: list[Any] = field(default_factory=list)
    """Parameters whose optimizer state the masked step created (SGD momentum: left unset)."""
    scale: Any = None
    """The GradScaler's scale when the step ran (a copy on the device, no sync): a replay of its
    batches confirming a NaN/Inf must scale the loss as its backward did, not as the scaler's
    ``update()`` has since changed it."""

    def read(self) -> tuple[float, float, bool]:
        """``(X, Y, failed)``: waits on an event the device passed long ago, never on the queue."""
        if self.ready is not None:
            self.ready.synchronize()
        x, y, failed = _read_settled(self.host)
        return x, y, failed != 0.0


def _read_settled(host: torch.Tensor) -> list[float]:
    """Values already in host memory (not a device sync: ``bench/step_account.py`` counts this
    read apart from the host synchronisations)."""
    return host.tolist()


def to_host(values: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """``values`` copied to host memory without blocking (pinned on CUDA), and the event after it."""
    if values.device.type != "cuda":
        return values.detach().to("cpu", copy=True), None
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event


class UpdateGate:
    """Refuses ``optimizer.step()`` unless the open step's checks passed; counts updates."""

    __slots__ = ("step", "allowed", "updates_through", "optimizer", "found_inf", "_saved", "_fresh")

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.step: int | None = None
        """The step in progress, or None between steps."""
        self.allowed = False
        self.updates_through: int | None = None
        """The last step whose update the weights include. A step done with unapplied (a
        GradScaler skip, a NaN/Inf refused as the data's) counts too: its weights are the step
        before's, and a run resumed from them goes on with the step after it."""
        self.found_inf: torch.Tensor | None = None
        """The device gate's verdict for the open step (1.0: skip the update), or None."""
        self._saved: list[Any] = []
        self._fresh: list[Any] = []
        optimizer.register_step_pre_hook(self._before_update)
        optimizer.register_step_post_hook(self._after_update)

    def open(self, step: int) -> None:
        if self.step is not None:
            raise RuntimeError(f"sdcguard: step {step} begun while step {self.step} is still open")
        self.step, self.allowed, self.found_inf = step, False, None

    def allow(self) -> None:
        """The open step's checks passed: its update may be applied."""
        self.allowed = True

    def allow_masked(self, found_inf: torch.Tensor) -> list[Any]:
        """The open step's update may be applied where ``found_inf`` (a float32 scalar on the
        device, 0-d like GradScaler's) is 0.0: the fused optimizer skips it on the device otherwise. Returns the list the
        parameters whose optimizer state the update creates go into (see ``Pending.fresh``)."""
        self.found_inf = found_inf
        self.allowed = True
        self._fresh = []
        return self._fresh

    def close(self, *, done: bool) -> None:
        """The open step ended; ``done``: it completed (applied or skipped), or was refused as
        the data's fault, so the weights now stand for it."""
        if done and self.step is not None:
            self.updates_through = self.step
        self._unmask()  # an optimizer.step() that raised after the mask was set: never leave it behind
        self.step, self.allowed, self.found_inf = None, False, None

    @contextmanager
    def zero_update(self) -> Iterator[None]:
        """Let through the one ``optimizer.step()`` that DCP's ``get_state_dict`` runs to create an
        empty optimizer's state (learning rate 0, zero gradients: the weights do not change)."""
        allowed, found_inf, self.allowed, self.found_inf = self.allowed, self.found_inf, True, None
        try:
            yield
        finally:
            self.allowed, self.found_inf = allowed, found_inf

    def resumed_at(self, step: int) -> None:
        """The weights were loaded from the state after ``step``'s update."""
        self.updates_through = step

    def _before_update(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.allowed:
            if self.found_inf is not None:
                self._mask(optimizer)
            return None
        if self.step is None:
            raise UncheckedUpdate("sdcguard: optimizer.step() outside a checked step: run it inside "
                                  "`with guard.step(step) as s:` after s.check() (or use guard.train_step)")
        raise UncheckedUpdate(f"sdcguard: optimizer.step() at step {self.step} before s.check() "
                              "passed: the gradients are unchecked, the update is refused")

    def _unmask(self) -> None:
        """Put back what the optimizer's ``found_inf`` was before :meth:`_mask` (a GradScaler's, or none)."""
        if self._saved:
            theirs = self._saved.pop()
            if theirs is None:
                self.optimizer.__dict__.pop("found_inf", None)
            else:
                self.optimizer.found_inf = theirs  # type: ignore[attr-defined]  # the scaler deletes it next

    def _mask(self, optimizer: torch.optim.Optimizer) -> None:
        """Hand the fused kernel the gate's ``found_inf``, or the maximum of it and a GradScaler's."""
        theirs = optimizer.__dict__.get("found_inf")
        mine = self.found_inf
        self._saved = [theirs]
        optimizer.found_inf = mine if theirs is None else torch.maximum(theirs, mine.to(theirs.device))  # type: ignore[attr-defined]
        if isinstance(optimizer, torch.optim.SGD) and any(g.get("momentum") for g in optimizer.param_groups):
            # A first step's momentum buffers are created empty and filled by the kernel: masked,
            # they hold nothing, and must be dropped if the run goes on (a skipped NaN/Inf).
            state = optimizer.state
            self._fresh.extend(p for g in optimizer.param_groups for p in g["params"]
                               if p.grad is not None and "momentum_buffer" not in state.get(p, {}))

    def _after_update(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._unmask()
        if self.step is not None:
            self.updates_through = self.step
