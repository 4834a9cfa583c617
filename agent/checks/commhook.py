"""The DDP communication hook that looks at each rank's local gradient before it is averaged.

Once the all-reduce has run, every replica holds the same average and a bad rank can no longer be
told apart, so what checks 1a and 2 need is recorded here, per bucket, on the way in:
  - the squared norm of the local gradient (check 1a: summed over ranks by one all-reduce, and
    gathered per rank only when something is not finite);
  - on audit steps, each parameter's local-gradient fingerprint (check 2 compares them with a
    replay on another node);
and on the way out, the squared norm of the reduced gradient (check 1b).

The reduction itself is delegated to an inner hook (plain all-reduce by default), so sdcguard
composes with compression hooks and the drill can put a fault inside the all-reduce.
"""

from typing import Any, Callable

# No `from __future__ import annotations`: DDP checks comm-hook annotations at runtime.
import torch
import torch.distributed as dist
from ..fingerprint import Fingerprint, fingerprint_sums, to_fingerprints

__all__ = ["GradientRecorder", "record_then_reduce", "allreduce_mean", "squared_norm"]

ReduceHook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


class GradientRecorder:
    """State of :func:`record_then_reduce`: settings first, then what one step recorded."""

    __slots__ = (
        "inner_hook", "inner_state", "param_index",
        "audit", "local_sq", "reduced_sq", "pending",
    )

    def __init__(
        self,
        parameters: list[torch.nn.Parameter],
        process_group: dist.ProcessGroup | None = None,
        inner_hook: ReduceHook | None = None,
        inner_state: Any = None,
    ) -> None:
        # Settings.
        self.inner_hook: ReduceHook = inner_hook or allreduce_mean
        self.inner_state = inner_state if inner_hook else process_group
        self.param_index = {id(p): i for i, p in enumerate(parameters)}
        # Per-step records, keyed by bucket index: buckets may finish on another thread, and a
        # dict item assignment needs no lock where a running sum would.
        self.audit = False
        self.local_sq: dict[int, torch.Tensor] = {}
        self.reduced_sq: dict[int, torch.Tensor] = {}
        # Per bucket: (parameter indices, their fingerprint sums still on the device) — turned
        # into numbers after the backward pass, so the hook never waits for the device.
        self.pending: dict[int, tuple[list[int], torch.Tensor]] = {}

    def begin_step(self, audit: bool) -> None:
        """Forget the previous step; record fingerprints only when this step is audited."""
        self.audit = audit
        self.local_sq = {}
        self.reduced_sq = {}
        self.pending = {}

    def norms(self, device: torch.device) -> torch.Tensor:
        """``[local, reduced]`` squared gradient norms of this step, float64, on ``device``."""
        if self.local_sq and len(self.local_sq) == len(self.reduced_sq):  # one entry per bucket
            both = torch.stack([*self.local_sq.values(), *self.reduced_sq.values()])
            return both.view(2, -1).sum(dim=1).to(device)
        return torch.stack([_total(self.local_sq, device), _total(self.reduced_sq, device)])

    def record_fingerprints(self, bucket: dist.GradBucket) -> None:
        indices = [self.param_index[id(param)] for param in bucket.parameters()]
        self.pending[bucket.index()] = (indices, fingerprint_sums(bucket.gradients()))

    def fingerprints(self) -> dict[int, Fingerprint]:
        """This step's local-gradient fingerprints by parameter index (audit steps only)."""
        out: dict[int, Fingerprint] = {}
        for indices, sums in self.pending.values():
            out.update(zip(indices, to_fingerprints(sums)))
        return out


def record_then_reduce(
    state: GradientRecorder, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Record the local gradient's norm (and fingerprints on audit steps), then reduce."""
    index = bucket.index()
    state.local_sq[index] = squared_norm(bucket.buffer())
    if state.audit:
        state.record_fingerprints(bucket)

    if state.inner_hook is allreduce_mean:  # the common case: one callback, not two
        def record_mean(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            reduced = fut.value()[0]
            state.reduced_sq[index] = squared_norm(reduced)
            return reduced

        return _launch_mean(state.inner_state, bucket.buffer()).then(record_mean)

    def record_reduced(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        reduced = fut.value()
        state.reduced_sq[index] = squared_norm(reduced)
        return reduced

    return state.inner_hook(state.inner_state, bucket).then(record_reduced)


def allreduce_mean(
    process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket exactly as DDP's built-in reducer does — multiply by 1/W, then sum —
    so a run under sdcguard is bit-identical to the same run without it. (PyTorch's Python
    ``allreduce_hook`` divides instead, which rounds differently.)"""
    return _launch_mean(process_group, bucket.buffer()).then(lambda fut: fut.value()[0])


def _launch_mean(process_group: dist.ProcessGroup | None, buffer: torch.Tensor) -> torch.futures.Future[list[torch.Tensor]]:
    """Scale by 1/W in place and start the sum, straight on the process group (this runs once
    per bucket and step: the Python wrappers of ``dist.all_reduce`` are measurable there)."""
    group = process_group if process_group is not None else dist.group.WORLD
    buffer.mul_(1.0 / group.size())
    return group.allreduce([buffer]).get_future()


def squared_norm(tensor: torch.Tensor) -> torch.Tensor:
    """Squared L2 norm as a float64 scalar, without a device sync.

    Accumulated in the gradient's own precision, at least float32 (a dot product for float32 and
    float64: half the cost of ``vector_norm``, several times less than float64 on CPU). The
    one cost: a finite gradient whose norm exceeds float32's range (~1.8e19) reads as Inf — with a
    GradScaler such a step is confirmed by a replay like any overflow."""
    if tensor.dtype in (torch.float32, torch.float64):
        flat = tensor.reshape(-1)
        return torch.dot(flat, flat).double()
    wide = torch.float32 if tensor.element_size() < 4 else None  # complex keeps its own (|z|)
    return torch.linalg.vector_norm(tensor, 2, dtype=wide).double().square()


def _total(parts: dict[int, torch.Tensor], device: torch.device) -> torch.Tensor:
    if not parts:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack([p.to(device) for p in parts.values()]).sum()
