"""One checked optimizer step in the user's own loop.

    with guard.step(step, micro_batches=len(batches)) as s:  # decides the audit, seeds forwards
        for micro in batches:
            loss = s.backward(micro, divide_by=len(batches))  # loss_fn + backward, recorded
        s.check()                                    # checks 1 and 2 (3 on audits): raise on every rank
        scaler.unscale_(optimizer); clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer); scaler.update(); scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    # leaving the block runs check 3 on weight-check steps

The user keeps the backward weighting, clipping, the optimizer and scaler calls, the scheduler and
``zero_grad``. The step records what a replay needs (the micro-batches, each loss's weighting, the
forward RNG seed, the buffers each forward saw). An optimizer step taken before ``check()`` passed
is refused with :class:`~sdcguard.errors.UncheckedUpdate` (the Guard holds a step pre-hook on the
optimizer), never silently unchecked.

A framework that runs the forward and the backward itself (Lightning's ``training_step`` and
``backward``) records them with :meth:`Step.forward` and :meth:`Step.backward_pass` instead of
``s.backward``, which is built from the same two pieces.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from .checks.determinism import deterministic
from .checks.replay import ForwardBuffers, Payload, Weighting
from .checks.rng import forward_seed, seeded
from .fingerprint import fingerprint_sums
from .layouts.base import Layout, StepRecord

_NO_SUMS = torch.zeros((0, 2), dtype=torch.int64)
"""A step's loss fingerprint sums when it audits nothing."""


@dataclass(frozen=True, slots=True)
class StepContext:
    """What a step needs from the Guard that makes it, and nothing else of it."""

    model: torch.nn.Module
    """What ``loss_fn`` is called with for the real pass (DDP, compiled, or plain)."""
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] | None
    """None for a pipeline schedule, which computes its own loss."""
    scaler: Any
    """An enabled GradScaler, or None."""
    layout: Layout
    seed: int
    forwards: ForwardBuffers
    """Records the buffers each forward sees."""
    begin: Callable[[int, bool], None]
    """The step ``(step, audit)`` begins: the update gate opens, the layout forgets the last step."""
    verify: Callable[[StepRecord], bool]
    """The checks before the update: raise on every rank alike, or return whether the update of
    this step will not be applied (a GradScaler's overflow, a NaN/Inf skipped as the data's)."""
    end: Callable[[int, bool, BaseException | None], None]
    """The step ``(step, unchecked, failed)`` ends: the gate closes; an unchecked step with
    gradients raises; check 3 on weight-check steps."""


class Step:
    """What one step has done so far; made by :meth:`Guard.step`, used as a context manager."""

    __slots__ = ("ctx", "step", "audit", "micro_batches", "batches", "weighting", "audited_losses",
                 "buffers", "losses", "checked", "skipped")

    def __init__(self, ctx: StepContext, step: int, micro_batches: int, audit: bool) -> None:
        if not isinstance(micro_batches, int) or micro_batches < 1:
            raise ValueError(f"micro_batches must be an integer >= 1, got {micro_batches!r}")
        self.ctx = ctx
        self.step = step
        self.audit = audit
        """Whether check 2 (ring replay) runs on this step."""
        self.micro_batches = micro_batches
        # What a replay needs, per micro-batch.
        self.batches: list[Any] = []
        self.weighting: list[Weighting | None] = []
        self.audited_losses: list[torch.Tensor] = []
        """Audit steps: a copy of each loss as computed, fingerprinted all at once by ``record()``
        (one read to the host after the backward, not one stall per forward)."""
        self.buffers: list[dict[str, torch.Tensor]] = []
        self.losses: list[torch.Tensor] = []
        self.checked = False
        """``check()`` passed: the update may be applied."""
        self.skipped = False
        """The update of this step will not be applied: an honest GradScaler overflow (the scaler
        skips it), or a reproduced NaN/Inf with ``on_nonfinite="skip"`` (the gradients were
        dropped, so ``optimizer.step()`` changes nothing)."""

    # -- the user's verbs ----------------------------------------------------------------------

    def backward(self, micro: Any, *, weight: float | None = None, divide_by: float | None = None) -> torch.Tensor:
        """Forward (``loss_fn(model, micro)``) and backward of one micro-batch; returns its loss,
        unweighted and detached.

        The backward runs on ``loss * weight`` or ``loss / divide_by`` (as your loop wrote it: the
        two round differently), scaled by the GradScaler when one is enabled. DDP reduces the
        gradients on the last of the ``micro_batches`` declared to :meth:`Guard.step`."""
        weighting = _weighting(weight, divide_by)
        ctx = self.ctx
        if ctx.loss_fn is None:
            raise TypeError("sdcguard: the Guard holds a pipeline schedule: run the step with s.run_schedule(...)")
        last = len(self.batches) == self.micro_batches - 1
        with ctx.layout.micro_batch(last):
            with self._forward(micro, "backward()") as record:
                loss = record(ctx.loss_fn(ctx.model, micro))
            with self._backward_pass(weighting, settled=True):
                scaled = weighting.apply(loss) if weighting is not None else loss
                (ctx.scaler.scale(scaled) if ctx.scaler is not None else scaled).backward()
        return loss.detach()

    # -- a pipeline schedule -------------------------------------------------------------------

    def run_schedule(self, *args: Any, target: Any = None, losses: list[torch.Tensor] | None = None,
                     **kwargs: Any) -> Any:
        """One step of the pipeline schedule the Guard was built on (``schedule.step``, same
        arguments: the whole batch on the first stage, ``target`` on the last, ``kwargs`` on
        every stage); returns what it returns. The schedule runs its own micro-batches: declare
        ``micro_batches=1`` to :meth:`Guard.step`. ``losses`` receives the last stage's
        micro-batch losses, as the schedule gives them."""
        ctx = self.ctx
        if isinstance(ctx.model, torch.nn.Module) or not callable(getattr(ctx.model, "step", None)):
            raise TypeError("sdcguard: run_schedule() needs the Guard built on a pipeline schedule "
                            "(Guard(schedule, optimizer)); for a module use backward()")
        index = self._next("run_schedule()")
        mine: list[torch.Tensor] = []
        with ctx.layout.micro_batch(last=True), self._exact():
            seed_rank = ctx.layout.seed_rank(ctx.layout.topology.rank)
            with seeded(forward_seed(ctx.seed, self.step, seed_rank, index), ctx.layout.device):
                out = ctx.model.step(*args, target=target, losses=mine, **kwargs)
        detached = [loss.detach() for loss in mine]
        if losses is not None:
            losses.extend(detached)
        self.batches.append({"args": list(args), "kwargs": dict(kwargs), "target": target})
        self.weighting.append(None)
        if self.audit:
            self.audited_losses.extend(loss.clone() for loss in detached)
        self.losses.extend(detached)
        return out

    # -- for a framework that runs the forward and the backward itself -------------------------

    def forward(self, micro: Any) -> contextlib.AbstractContextManager[Callable[[torch.Tensor], torch.Tensor]]:
        """Your framework's forward of one micro-batch, recorded for the replay that redoes it::

            with s.forward(micro) as record:
                loss = record(framework_forward(micro))    # the unweighted loss, returned as is
            with s.backward_pass(divide_by=n):
                framework_backward(loss / n)

        ``micro`` is what the Guard's ``loss_fn(module, micro)`` takes: a replay on another rank runs
        ``loss_fn`` on the bare module with it and must compute the loss the block computed (store
        tensors detached). Inside the block: this (step, rank, micro-batch)'s forward RNG seed, the
        recording of the buffers the forward sees, and on audit steps deterministic kernels and
        compiled code run eagerly. Exactly one ``record(loss)`` per block; :meth:`backward_pass`
        must follow before the next forward. Gradient synchronisation (DDP's ``no_sync``) stays
        your framework's: it must reduce on the last of the step's ``micro_batches``."""
        return self._forward(micro, "forward()")

    @contextlib.contextmanager
    def _forward(self, micro: Any, verb: str) -> Iterator[Callable[[torch.Tensor], torch.Tensor]]:
        index = self._next(verb)
        if len(self.weighting) != index:
            raise RuntimeError(f"sdcguard: step {self.step}: {verb} of micro-batch {index} before the "
                               f"backward_pass() of micro-batch {index - 1}")
        ctx = self.ctx
        recorded: list[torch.Tensor] = []

        def record(loss: torch.Tensor) -> torch.Tensor:
            if not isinstance(loss, torch.Tensor):
                raise TypeError(f"sdcguard: record() takes the loss tensor, got {type(loss).__name__}")
            if recorded:
                raise RuntimeError(f"sdcguard: step {self.step}: record() called twice in one forward()")
            recorded.append(loss)
            return loss

        # The buffers are needed where a replay may run: audit steps, and every step with a
        # GradScaler (its overflow is confirmed by replay).
        buffers = self.buffers if self.audit or ctx.scaler is not None else None
        with self._exact(), ctx.forwards.recording(buffers, index):
            seed_rank = ctx.layout.seed_rank(ctx.layout.topology.rank)
            with seeded(forward_seed(ctx.seed, self.step, seed_rank, index), ctx.layout.device):
                yield record
        if not recorded:
            raise RuntimeError(f"sdcguard: step {self.step}: the forward of micro-batch {index} recorded no loss "
                               "(call record(loss) inside the block)")
        loss = recorded[0].detach()
        self.batches.append(micro)
        if self.audit:
            self.audited_losses.append(loss.clone())
        self.losses.append(loss)

    def backward_pass(self, *, weight: float | None = None,
                      divide_by: float | None = None) -> contextlib.AbstractContextManager[None]:
        """Your framework's backward of the loss the last :meth:`forward` recorded, which it
        computes as ``loss * weight`` or ``loss / divide_by`` (or the loss itself: neither given)
        and scales with the Guard's GradScaler when that is enabled; the replay applies the same
        weighting. On audit steps the block runs deterministic kernels (and compiled code eagerly)."""
        return self._backward_pass(_weighting(weight, divide_by))

    @contextlib.contextmanager
    def _backward_pass(self, weighting: Weighting | None, *, settled: bool = False) -> Iterator[None]:
        """``settled``: the caller already runs the micro-batch inside ``layout.micro_batch``."""
        if len(self.weighting) != len(self.batches) - 1:
            raise RuntimeError(f"sdcguard: step {self.step}: backward_pass() without its forward()")
        # A framework's own backward: its gradient synchronisation stays the framework's (no
        # ``no_sync`` entered), but the layout still learns that the micro-batch ended.
        with self._exact(), contextlib.nullcontext() if settled else self.ctx.layout.micro_batch(last=True):
            yield
        self.weighting.append(weighting)

    def _next(self, verb: str) -> int:
        """The index of the micro-batch ``verb`` starts, refused after check() or past the count."""
        if self.checked:
            raise RuntimeError(f"sdcguard: step {self.step}: {verb} after check(): start a new guard.step()")
        index = len(self.batches)
        if index >= self.micro_batches:
            raise RuntimeError(f"sdcguard: step {self.step} was declared with micro_batches={self.micro_batches}; "
                               f"{verb} was called a {index + 1}th time")
        return index

    def check(self) -> None:
        """Checks 1a/1b, and on audit steps 2 and 3 (before the update): raise on every rank
        alike, or allow this step's optimizer update."""
        if self.checked:
            return
        if len(self.batches) != self.micro_batches:
            raise RuntimeError(f"sdcguard: step {self.step} was declared with micro_batches={self.micro_batches} "
                               f"but ran {len(self.batches)} backward()")
        if len(self.weighting) != len(self.batches):
            raise RuntimeError(f"sdcguard: step {self.step}: check() before the backward_pass() of its last forward()")
        with self._exact():
            self.skipped = self.ctx.verify(self.record())  # raises, or opens the update gate
        self.checked = True

    @property
    def loss(self) -> torch.Tensor:
        """The mean of the micro-batch losses (unweighted, detached)."""
        if not self.losses:
            raise RuntimeError("no backward() has run in this step yet (or this pipeline stage is not the last: "
                               "only the last stage has losses)")
        total = self.losses[0]
        for more in self.losses[1:]:
            total = total + more
        return total / len(self.losses) if len(self.losses) > 1 else total

    def payload(self) -> Payload:
        """What another rank needs to redo this rank's step."""
        layout = self.ctx.layout
        return Payload(self.step, layout.seed_rank(layout.topology.rank), list(self.batches), list(self.buffers),
                       list(self.weighting))

    def record(self) -> StepRecord:
        """What the checks read of this step."""
        losses = self.audited_losses
        # one device for the sums (a loss may live on another one; a fingerprint is the same everywhere)
        loss_sums = fingerprint_sums([loss.to(losses[0].device) for loss in losses]) if losses else _NO_SUMS
        return StepRecord(self.step, self.audit, self.payload(), loss_sums, list(self.losses))

    # -- the context ---------------------------------------------------------------------------

    def __enter__(self) -> Step:
        self.ctx.begin(self.step, self.audit)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        failed = None if exc_type is None else exc if exc is not None else RuntimeError(exc_type)
        self.ctx.end(self.step, bool(self.batches) and not self.checked, failed)
        return False

    @contextlib.contextmanager
    def _exact(self) -> Iterator[None]:
        """On audit steps: deterministic kernels, and compiled code run eagerly (the replay runs
        the bare module eagerly; the two must produce the same bits)."""
        if not self.audit:
            yield
            return
        stance = torch.compiler.set_stance("force_eager") if self.ctx.layout.compiled else contextlib.nullcontext()
        with deterministic(True), stance:
            yield


def _weighting(weight: float | None, divide_by: float | None) -> Weighting | None:
    if weight is not None and divide_by is not None:
        raise ValueError("give weight= or divide_by=, not both")
    return Weighting("div", divide_by) if divide_by is not None else (
        Weighting("mul", weight) if weight is not None else None)
