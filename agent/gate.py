"""The update gate: no optimizer update without a passing check in the step in progress.

One small object on the optimizer's step hooks, used by ``Step`` (which opens it, and allows the
update once ``check()`` passed) and by ``Guard`` (which closes it when the step ends). It also
counts which step's update the weights include: what a checkpoint written now records.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch

from .errors import UncheckedUpdate


class UpdateGate:
    """Refuses ``optimizer.step()`` unless the open step's checks passed; counts updates."""

    __slots__ = ("step", "allowed", "updates_through")

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.step: int | None = None
        """The step in progress, or None between steps."""
        self.allowed = False
        self.updates_through: int | None = None
        """The last step whose update the weights include. A step done with unapplied (a
        GradScaler skip, a NaN/Inf refused as the data's) counts too: its weights are the step
        before's, and a run resumed from them goes on with the step after it."""
        optimizer.register_step_pre_hook(self._before_update)
        optimizer.register_step_post_hook(self._after_update)

    def open(self, step: int) -> None:
        if self.step is not None:
            raise RuntimeError(f"sdcguard: step {step} begun while step {self.step} is still open")
        self.step, self.allowed = step, False

    def allow(self) -> None:
        """The open step's checks passed: its update may be applied."""
        self.allowed = True

    def close(self, *, done: bool) -> None:
        """The open step ended; ``done``: it completed (applied or skipped), or was refused as
        the data's fault, so the weights now stand for it."""
        if done and self.step is not None:
            self.updates_through = self.step
        self.step, self.allowed = None, False

    @contextmanager
    def zero_update(self) -> Iterator[None]:
        """Let through the one ``optimizer.step()`` that DCP's ``get_state_dict`` runs to create an
        empty optimizer's state (learning rate 0, zero gradients: the weights do not change)."""
        allowed, self.allowed = self.allowed, True
        try:
            yield
        finally:
            self.allowed = allowed

    def resumed_at(self, step: int) -> None:
        """The weights were loaded from the state after ``step``'s update."""
        self.updates_through = step

    def _before_update(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.allowed:
            return None
        if self.step is None:
            raise UncheckedUpdate("sdcguard: optimizer.step() outside a checked step: run it inside "
                                  "`with guard.step(step) as s:` after s.check() (or use guard.train_step)")
        raise UncheckedUpdate(f"sdcguard: optimizer.step() at step {self.step} before s.check() "
                              "passed: the gradients are unchecked, the update is refused")

    def _after_update(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.step is not None:
            self.updates_through = self.step
