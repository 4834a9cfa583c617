"""The DDP communication hook that looks at each rank's local gradient before it is averaged.

Once the all-reduce has run, every replica holds the same average and a bad rank can no longer be
told apart, so what checks 1a, 2 and 4 need is recorded here, per bucket, on the way in:
  - the local gradient's weighted checksum and squared norm (``reduce_checksum``): check 4
    compares the checksums' mean over ranks with the same checksum of the reduced gradient (the
    norms bound the rounding), and the norm is finite exactly when the gradient is (check 1a);
  - on audit steps, each parameter's local-gradient fingerprint (check 2 compares them with a
    replay on another node);
and on the way out, the reduced gradient's checksum alone (check 4, and check 1b: it is finite
exactly when the reduced bucket is). With a comm hook DDP leaves the 1/W scaling of the bucket
to the hook (its reducer does it while it copies the gradients in only without one). The fold,
the norm and the scaling share one read of the local bucket (``ChecksumWeights.terms``: the fused
Triton kernel on CUDA, cache-sized blocks copied once on CPU), the reduced fold is the second:
a gradient byte is read twice per step in all.

The reduction itself is delegated to an inner hook (plain all-reduce by default), so sdcguard
composes with compression hooks and the drill can put a fault inside the all-reduce.
"""

from typing import Any, Callable

# No `from __future__ import annotations`: DDP checks comm-hook annotations at runtime.
import torch
import torch.distributed as dist
from ..fingerprint import Fingerprint, fingerprint_sums, to_fingerprints_together
from .exchange import hold
from .reduce_checksum import ChecksumWeights, Coefficients, Shape, vote

__all__ = ["GradientRecorder", "record_then_reduce", "allreduce_mean"]

ReduceHook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


class GradientRecorder:
    """State of :func:`record_then_reduce`: settings first, then what one step recorded."""

    __slots__ = (
        "inner_hook", "inner_state", "param_index", "weights", "coefficients", "checks_reduction", "world",
        "audit", "local", "reduced", "shapes", "pending",
    )

    def __init__(
        self,
        parameters: list[torch.nn.Parameter],
        process_group: dist.ProcessGroup | None = None,
        inner_hook: ReduceHook | None = None,
        inner_state: Any = None,
        seed: int = 0,
    ) -> None:
        # Settings.
        self.inner_hook: ReduceHook = inner_hook or allreduce_mean
        # A hook given without state gets the process group, as DDP's default hooks expect.
        self.inner_state = inner_state if inner_hook is not None and inner_state is not None else process_group
        self.param_index = {id(p): i for i, p in enumerate(parameters)}
        self.weights = ChecksumWeights(seed)
        self.coefficients = Coefficients()
        self.checks_reduction = bool(getattr(self.inner_hook, "averages_like_ddp", False))
        """Check 4 runs: the reduction is DDP's mean (a compression hook changes the sum)."""
        self.world = dist.get_world_size(process_group)
        # Per-step records, keyed by bucket index: buckets may finish on another thread, and a
        # dict item assignment needs no lock where a running sum would.
        self.audit = False
        self.local: dict[int, torch.Tensor] = {}
        """bucket -> ``[checksum, squared norm]`` of this rank's local gradient."""
        self.reduced: dict[int, torch.Tensor] = {}
        """bucket -> the checksum ``C`` of the reduced gradient."""
        self.shapes: dict[int, tuple[int, torch.dtype]] = {}
        """bucket -> (elements, dtype), for check 4's bound."""
        # Per bucket: (parameter indices, their fingerprint sums still on the device) — turned
        # into numbers after the backward pass, so the hook never waits for the device.
        self.pending: dict[int, tuple[list[int], torch.Tensor]] = {}

    def begin_step(self, audit: bool, step: int = 0) -> None:
        """Forget the previous step; record fingerprints only when this step is audited."""
        self.audit = audit
        self.weights.begin_step(step)
        self.local = {}
        self.reduced = {}
        self.shapes = {}  # DDP rebuilds its buckets after the first step: record them anew
        self.pending = {}

    def vote(self, device: torch.device) -> torch.Tensor:
        """This rank's ``[x, y]`` for check 1's all-reduce (see ``reduce_checksum``): summed over
        ranks, X is check 4's checksum difference and Y its operands' size, finite exactly when
        every local gradient is and X when every reduced one is too."""
        if not self.local:
            return torch.zeros(2, dtype=torch.float64, device=device)
        buckets = self._buckets()
        sizes = [self.shapes[b] for b in buckets]
        return vote([self.local[b] for b in buckets], [self.reduced[b] for b in buckets], sizes, self.world,
                    self.coefficients).to(device)

    def rows(self, device: torch.device) -> torch.Tensor:
        """``[local squared norm, reduced checksum]`` of this rank's gradient, summed over buckets:
        the per-rank values check 1 gathers when something is not finite (each is finite exactly
        when its gradient is, barring float32 overflow of finite values)."""
        if not self.local:
            return torch.zeros(2, dtype=torch.float64, device=device)
        buckets = self._buckets()
        local = torch.stack([self.local[b][1] for b in buckets]).sum()
        reduced = torch.stack([self.reduced[b] for b in buckets]).sum()
        return torch.stack([local, reduced]).to(device)

    def _buckets(self) -> list[int]:
        if self.local.keys() != self.reduced.keys():
            raise RuntimeError("sdcguard: a bucket's all-reduce has not completed")
        return sorted(self.local)

    def shape(self) -> Shape:
        return Shape(world=self.world, buckets=len(self.shapes), elements=sum(n for n, _ in self.shapes.values()),
                     dtypes=tuple(sorted({d for _, d in self.shapes.values()}, key=str)))

    def record_fingerprints(self, bucket: dist.GradBucket) -> None:
        indices = [self.param_index[id(param)] for param in bucket.parameters()]
        self.pending[bucket.index()] = (indices, fingerprint_sums(bucket.gradients()))

    def pending_sums(self) -> list[tuple[list[int], torch.Tensor]]:
        """This step's local-gradient fingerprint sums (audit steps only), still on the device: per
        bucket, its parameters' indices and their ``(n, 2)`` sums."""
        return list(self.pending.values())

    def fingerprints(self, losses: torch.Tensor | None = None) -> tuple[list[Fingerprint], dict[int, Fingerprint]]:
        """This step's local-gradient fingerprints by parameter index (audit steps only), and those
        of ``losses`` (fingerprint sums, e.g. the step's audited losses'): all in one read to the
        host, not one per bucket."""
        entries = self.pending_sums()
        loss_fps, *buckets = to_fingerprints_together(
            [losses if losses is not None else torch.zeros((0, 2), dtype=torch.int64), *(sums for _, sums in entries)])
        return loss_fps, {index: fp for (indices, _), fps in zip(entries, buckets) for index, fp in zip(indices, fps)}


def record_then_reduce(
    state: GradientRecorder, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Record the local gradient's checksum and norm (and fingerprints on audit steps), reduce, and
    record the reduced gradient's checksum."""
    index = bucket.index()
    buffer = bucket.buffer()
    state.shapes[index] = (buffer.numel(), buffer.dtype)
    if state.audit:  # first: the gradients as the backward made them
        state.record_fingerprints(bucket)

    if state.inner_hook is allreduce_mean:  # the common case: one callback, not two
        def record_mean(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            reduced = fut.value()[0]
            state.reduced[index] = state.weights.checksum(index, reduced)
            return reduced

        # The local terms and DDP's 1/W scaling in one call: one read of the bucket.
        state.local[index] = state.weights.terms(index, buffer, scale=1.0 / _size(state.inner_state))
        return _start_sum(state.inner_state, buffer).then(record_mean)

    state.local[index] = state.weights.terms(index, buffer)

    def record_reduced(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        reduced = fut.value()
        state.reduced[index] = state.weights.checksum(index, reduced)
        return reduced

    return state.inner_hook(state.inner_state, bucket).then(record_reduced)


def allreduce_mean(
    process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket exactly as DDP's built-in reducer does — multiply by 1/W, then sum —
    so a run under sdcguard is bit-identical to the same run without it. (PyTorch's Python
    ``allreduce_hook`` divides instead, which rounds differently.)"""
    return _launch_mean(process_group, bucket.buffer()).then(lambda fut: fut.value()[0])


allreduce_mean.averages_like_ddp = True  # type: ignore[attr-defined]  # check 4 applies


def _launch_mean(process_group: dist.ProcessGroup | None, buffer: torch.Tensor) -> torch.futures.Future[list[torch.Tensor]]:
    """Scale by 1/W in place and start the sum."""
    buffer.mul_(1.0 / _size(process_group))
    return _start_sum(process_group, buffer)


def _size(process_group: dist.ProcessGroup | None) -> int:
    return (process_group if process_group is not None else dist.group.WORLD).size()


def _start_sum(process_group: dist.ProcessGroup | None, buffer: torch.Tensor) -> torch.futures.Future[list[torch.Tensor]]:
    """Start the sum of an already scaled bucket, straight on the process group (this runs once
    per bucket and step: the Python wrappers of ``dist.all_reduce`` are measurable there)."""
    group = process_group if process_group is not None else dist.group.WORLD
    work = group.allreduce([buffer])
    hold(work)  # the op is never destroyed on gloo's worker thread (see exchange.hold)
    return work.get_future()
