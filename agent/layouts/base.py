"""What a parallel layout gives the checks: one protocol, one implementation per layout.

A layout (one process, DDP, FSDP2/HSDP, ...) knows where its gradients can be read before and after
their reduction, how another rank's step is recomputed on it, how its weights are compared across
replicas, and how its checkpoints are stored. The sequencing of the checks (``verification.py``),
the Guard and the Step only ever talk to this protocol: they never ask which layout they hold.
Adding a layout is one class implementing :class:`Layout` plus its tests (docs/design.md §2).

Every method marked *collective* must be called by every rank, in the same order.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist

from ..checks.audit import Confirmation
from ..checks.exchange import Incoming, agreed, start_agreement, wait
from ..checks.reduce_checksum import Shape
from ..checks.replay import PassResult, Payload
from ..checks.topology import Topology
from ..checks.verdict import Verdict
from ..checks.weights import WeightCheck
from ..fingerprint import Fingerprint, to_fingerprints

Scale = Callable[[torch.Tensor], torch.Tensor] | None
"""An enabled GradScaler's ``scale``: a replay scales its loss the same way."""


@dataclass(frozen=True, slots=True)
class StepRecord:
    """What one step recorded for its checks (made by ``Step``)."""

    step: int
    audit: bool
    payload: Payload
    loss_sums: torch.Tensor
    """The audited losses' fingerprint sums, still on the device (``(0, 2)`` on other steps): a
    layout reads them with its own pass's (one transfer to the host), or through :attr:`loss_fps`."""
    losses: list[torch.Tensor]

    @property
    def loss_fps(self) -> list[Fingerprint]:
        return to_fingerprints(self.loss_sums) if len(self.loss_sums) else []


@dataclass(frozen=True, slots=True)
class Vote:
    """This rank's share of checks 1 and 4 for one step."""

    vote: torch.Tensor
    """``[x, y]`` (float64): summed over every rank, check 4's difference and bound; not finite
    exactly when some local or reduced gradient is not (check 1)."""
    rows: Callable[[], torch.Tensor]
    """The per-rank row gathered only when the sum says something is wrong (its first value is
    the local squared norm, its second the reduced checksum: ``checks/nonfinite``)."""
    shape: Shape | None
    """What check 4's bound needs; None when no reduction of this step is checkable."""
    detail: Any = None
    """Layout-specific facts :meth:`Layout.localize_checksum` uses (e.g. per-kind element counts)."""


class CheckpointStore(Protocol):
    """Where a layout's checkpoints live (a file with a manifest, a DCP directory, ...). The save
    gate (no save after an alarm, the step rule, check 3 first) is the Guard's, once, for every store."""

    def save(self, path: str, *, step: int, state: dict[str, Any] | None, model_key: str,
             history: Any, weight_digest: str | None, keep: bool) -> Any:
        """Write ``path`` (collective); return the history with the new checkpoint."""

    def load(self, path: str, *, model_key: str, expect_step: int | None, expect_sha256: str | None,
             state: dict[str, Any] | None) -> tuple[int, Any, str | None]:
        """Verify and load ``path`` (collective); return (its step, the history a run resumed from it
        inherits, the weight digest check 3 compares next or None)."""


class Layout(Protocol):
    """One parallel layout, as the checks see it."""

    topology: Topology
    """Every rank's identity; the ring's replay targets."""
    device: torch.device
    """Where the checks' small tensors travel (CUDA for NCCL)."""
    group: dist.ProcessGroup | None
    """The group checks 1 and 4 are voted in, and digests gathered in (None: the default group)."""
    module: torch.nn.Module
    """The bare module (no DDP, no compile wrapper): what replays run on."""
    wrappers: tuple[torch.nn.Module, ...]
    """What wraps ``module`` in the user's model (DDP, compile), outermost first."""
    compiled: bool
    """torch.compile is involved: audit steps run eagerly."""
    named_parameters: list[tuple[str, torch.nn.Parameter]]
    checks_reduction: bool
    """Check 4 runs on every step."""
    checks_weights: bool
    """Check 3 has replicas to compare."""
    store: CheckpointStore

    def plan_lines(self) -> list[str]:
        """What the user must know of the checks this layout runs: which cannot run, and why
        (logged once at start-up as warnings; empty when every check runs)."""

    # -- recording a step ------------------------------------------------------------------------

    def can_audit(self) -> bool:
        """Whether the coming step can be replayed bit for bit (every rank answers alike): False
        only where the framework makes one step irregular (a pipeline schedule's first step)."""

    def begin_step(self, step: int, audit: bool) -> None:
        """Forget the previous step's records; record fingerprints when ``audit``."""

    def micro_batch(self, last: bool) -> contextlib.AbstractContextManager[None]:
        """Around one micro-batch's forward and backward: the layout's gradient accumulation
        (DDP's ``no_sync`` unless ``last``), and the end of the micro-batch's reductions."""

    # -- checks 1 and 4 --------------------------------------------------------------------------

    def vote(self, s: StepRecord) -> Vote:
        """This rank's vote for the step's one small all-reduce."""

    def reduced_gradients_finite(self) -> bool:
        """Collective: every rank's reduced gradients are finite, element by element."""

    def confirm_nonfinite(self, step: int, bad: list[int], payload: Payload, scale: Scale) -> Confirmation:
        """Collective: replay the non-finite ranks' batches on other nodes (a replay that fails
        anywhere is a ReplayError on every rank, :mod:`..checks.replay_failures`)."""

    def localize_checksum(self, verdict: Verdict, vote: Vote) -> Verdict:
        """Collective: a check 4 verdict with what can be said of where the reduction went wrong."""

    def annotate(self, verdict: Verdict) -> Verdict:
        """A verdict with the layout's own evidence (e.g. the mesh's dimensions)."""

    def seed_rank(self, rank: int) -> int:
        """The rank whose forward seeds ``rank``'s micro-batches use (dropout; ``checks/rng``): itself,
        or the first rank of its tensor-parallel group, whose ranks must drop the same activations.
        A replay seeds as the owner did (``Payload.owner`` carries it)."""

    # -- check 2 ---------------------------------------------------------------------------------

    def own_pass(self, s: StepRecord) -> PassResult:
        """What this rank's own pass of an audited step recorded (loss bits, gradient fingerprints)."""

    def post_batch(self, blob: torch.Tensor, own_digest: bytes) -> Incoming:
        """Send this rank's batch to its replayer; start receiving the batch it audits."""

    def replay(self, step: int, incoming: Incoming, scale: Scale) -> tuple[PassResult | None, Exception | None]:
        """Collective: receive and replay the audited batch; a failure is returned (every rank must
        still join the agreement that follows), never raised — unless the layout raises it on
        every rank alike."""

    def replay_verdict(self, own: PassResult, replayed: PassResult | None, digests: list[list[bytes]],
                       payload: Payload, scale: Scale) -> Verdict | None:
        """Collective: the ring's verdict from every rank's ``[own pass, replay]`` digests."""

    # -- check 3 ---------------------------------------------------------------------------------

    def fingerprint_weights(self) -> WeightCheck | None:
        """This rank's weights' fingerprints, or None when they have no replica to compare with."""

    def weights_token(self, weights: WeightCheck | None) -> Callable[[], tuple[bytes, bool]]:
        """Collective within the layout's replicas, if at all, started before the replay and
        answered after it (``replicas_token``): the answer is ``(token, ok)`` — the token every
        rank agrees on in the audit's one all-reduce (equal on every rank exactly when every
        replica agrees), and whether this rank's own replicas agreed."""

    def judge_weights(self, weights: WeightCheck, tokens: list[bytes] | None) -> Verdict | None:
        """Collective: check 3's verdict after a disagreement (``tokens``: every rank's token, when
        they were already gathered)."""

    def weights_agree(self, weights: WeightCheck) -> bool:
        """Collective: every replica holds the same weights (16 bytes)."""

    def check_update(self, step: int) -> Verdict | None:
        """Collective, asked only of a layout whose :meth:`fingerprint_weights` is None (no replica):
        check 3's stand-in after ``step``'s update — pure FSDP re-runs each rank's optimizer update on
        its ring neighbour on weight-check steps (``sharding/update_check.py``); None when it passed
        or does not run."""


_OK = bytes([1]) * 16
"""The audit token of a rank whose replicas agree (a layout whose check 3 runs in smaller groups)."""


def flag_token(ok: bool) -> bytes:
    """A 16-byte token saying whether this rank's replicas agreed."""
    return _OK if ok else bytes(16)


def answered(token: bytes, ok: bool = True) -> Callable[[], tuple[bytes, bool]]:
    """A :meth:`Layout.weights_token` known at once (no collective)."""
    return lambda: (token, ok)


def replicas_token(digest: bytes, device: torch.device, group: dist.ProcessGroup | None) -> Callable[[], tuple[bytes, bool]]:
    """:meth:`Layout.weights_token` for replicas that each hold a part: whether ``group`` (this
    rank's replicas) agrees on ``digest``, one 16-byte all-reduce started now and read when the
    answer is asked for — after the replay, which it no longer holds up (on a GPU the replay's
    kernels are queued while it travels)."""
    both, work = start_agreement(digest, device, group)

    def answer() -> tuple[bytes, bool]:
        wait(work)
        ok = agreed(both.tolist())
        return flag_token(ok), ok
    return answer


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, or the tensor itself (no collective)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def gradients_finite(named_parameters: list[tuple[str, torch.nn.Parameter]]) -> bool:
    """This rank's gradients (a DTensor's local shard) are finite, element by element (no collective),
    in one read to the host (not one per parameter: a single-replica job asks every step)."""
    return all_true([torch.isfinite(local_tensor(p.grad)).all() for _, p in named_parameters if p.grad is not None])


def all_true(flags: list[torch.Tensor]) -> bool:
    """Whether every boolean flag (on any device) holds, in one read to the host; True for none."""
    return bool(torch.stack([f.to(flags[0].device) for f in flags]).all()) if flags else True


def everywhere_finite(named_parameters: list[tuple[str, torch.nn.Parameter]], device: torch.device,
                      group: dist.ProcessGroup | None) -> bool:
    """Collective: every rank's gradients are finite (:func:`gradients_finite`), the same answer everywhere."""
    flag = torch.tensor([1.0 if gradients_finite(named_parameters) else 0.0], dtype=torch.float64, device=device)
    wait(dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group, async_op=True))
    return bool(flag.item() == 1.0)
