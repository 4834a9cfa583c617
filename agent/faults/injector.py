"""The fault injector: puts each fault kind where failing hardware would put it.

A fault must strike inside the computation that the checks watch, not after a fingerprint was
taken: activations through a forward hook, local gradients through a tensor hook on the
parameter (before DDP copies them into its buckets), the all-reduce through the inner reduce hook,
the optimizer through a step post-hook, and stored weights between steps.

A transient fault strikes the first matching computation of its step on its rank, once: the
rank's own pass, or with ``during=replay`` its replay of another rank's batch. A persistent one
(``every=K``) strikes every matching computation of its steps — the rank's own pass and its
replays alike, as a broken unit would.
"""

# No `from __future__ import annotations`: DDP checks comm-hook annotations at runtime.
import logging
from typing import Any

import torch
import torch.distributed as dist
from ..checks.commhook import allreduce_mean
from .spec import FaultSpec
from ..checks.replay import replaying

log = logging.getLogger("sdcguard.faults")

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class FaultInjector:
    """Holds this rank's faults and the hooks that fire them."""

    def __init__(self, faults: list[FaultSpec], rank: int) -> None:
        self.rank = rank
        self.faults = [f for f in faults if f.hits_rank(rank)]
        self.step: int | None = None
        self.fired: list[dict[str, Any]] = []
        self._struck: set[tuple[int, int]] = set()  # (fault index, step) of transient strikes
        self._struck_faults: set[int] = set()
        self._disarmed: set[int] = set()

    # -- wiring --------------------------------------------------------------------------------

    def install(self, activation_site: torch.nn.Module, parameter: torch.nn.Parameter,
                optimizer: torch.optim.Optimizer) -> None:
        """Attach the forward, gradient and optimizer hooks (the reduce hook goes to the Guard)."""
        self.parameter = parameter
        activation_site.register_forward_hook(self._on_activation)
        parameter.register_hook(self._on_local_grad)
        optimizer.register_step_post_hook(self._after_optimizer_step)

    def begin_step(self, step: int) -> None:
        """Called between steps: set the step and corrupt stored weights if a fault says so."""
        self.step = step
        for fault in self._due("weights"):
            with torch.no_grad():
                flat = self.parameter.view(-1)
                if fault.kind == "weight-bitflip":
                    _flip_bit(flat, 0, bit=_mantissa_bit(flat, 3))
                else:  # weight-swap
                    a, b = flat[0].clone(), flat[1].clone()
                    flat[0], flat[1] = b, a

    def disarm(self, ranks: list[int]) -> None:
        """The drill's stand-in for replacing the suspects' nodes: the faults that already struck
        there stop (a fault scheduled later is a new one). All-reduce faults belong to no node."""
        if self.rank in ranks:
            self._disarmed.update(i for i in self._struck_faults if self.faults[i].info.corrupts != "reduce")

    # -- the hooks -----------------------------------------------------------------------------

    def _on_activation(self, module: torch.nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor | None:
        for fault in self._due("forward"):
            output = output.clone()
            flat = output.view(-1)
            flat[0] = float("nan") if fault.kind == "forward-nan" else flat[0] * fault.magnitude
        return output

    def _on_local_grad(self, grad: torch.Tensor) -> torch.Tensor:
        for fault in self._due("grad"):
            grad = grad.clone()
            flat = grad.view(-1)
            if fault.kind == "grad-inf":
                flat[0] = float("inf")
            else:  # grad-bitflip: the top mantissa bit, a finite result
                _flip_bit(flat, 0, bit=_mantissa_bit(flat, 1))
        return grad

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for fault in self._due("optimizer"):
            with torch.no_grad():
                self.parameter.view(-1)[0] *= fault.magnitude

    def reduce_hook(self, process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
                    ) -> torch.futures.Future[torch.Tensor]:
        """DDP's average, corrupted on the way out when a ``reduce-*`` fault is due."""
        faults = self._due("reduce")

        def corrupt(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            reduced = fut.value()
            for fault in faults:
                reduced[0] = float("nan") if fault.kind == "reduce-nan" else reduced[0] * fault.magnitude
            return reduced

        return allreduce_mean(process_group, bucket).then(corrupt)

    # -- bookkeeping ---------------------------------------------------------------------------

    def _due(self, corrupts: str) -> list[FaultSpec]:
        """Faults of this kind that strike now, recorded as fired."""
        due = []
        for i, fault in enumerate(self.faults):
            if i in self._disarmed or fault.info.corrupts != corrupts or self.step is None:
                continue
            if not fault.fires_at(self.step):
                continue
            if not fault.persistent:
                if replaying() != (fault.during == "replay") or (i, self.step) in self._struck:
                    continue
                self._struck.add((i, self.step))
            due.append(fault)
            self._struck_faults.add(i)
            event = {"kind": fault.kind, "rank": self.rank, "step": self.step}
            if event not in self.fired:
                self.fired.append(event)
                log.info("injected %s on rank %d at step %d", fault.kind, self.rank, self.step)
        return due


def _mantissa_bit(flat: torch.Tensor, from_top: int) -> int:
    """Index of a mantissa bit ``from_top`` places below its highest one (keeps values finite)."""
    mantissa = {torch.float32: 23, torch.float64: 52, torch.float16: 10, torch.bfloat16: 7}
    return mantissa.get(flat.dtype, 8 * flat.element_size() - 2) - from_top


def _flip_bit(flat: torch.Tensor, index: int, bit: int) -> None:
    """Flip one bit of one element in place, whatever its dtype."""
    as_int = flat.view(_INT_OF_WIDTH[flat.element_size()])
    as_int[index] ^= 1 << bit
