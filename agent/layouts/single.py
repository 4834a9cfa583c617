"""One process, no peers: only the local non-finite check can run, and nobody can confirm it."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from ..checks.audit import Confirmation
from ..checks.exchange import Incoming
from ..checks.replay import PassResult, Payload
from ..checks.topology import Topology
from ..checks.verdict import Verdict
from ..checks.weights import WeightCheck, fingerprint_weights
from .base import Scale, StepRecord, Vote, answered
from .stores import FileStore


class SingleProcess:
    """The :class:`~sdcguard.layouts.base.Layout` of a plain (or compiled) module in one process."""

    group: dist.ProcessGroup | None = None
    checks_reduction = False
    checks_weights = False

    def __init__(self, *, module: torch.nn.Module, wrappers: tuple[torch.nn.Module, ...], compiled: bool,
                 topology: Topology, device: torch.device, optimizer: torch.optim.Optimizer, scaler: Any) -> None:
        self.module = module
        self.wrappers = wrappers
        self.compiled = compiled
        self.topology = topology
        self.device = device
        self.named_parameters = list(module.named_parameters())
        self.store = FileStore(module=module, optimizer=optimizer, scaler=scaler, named_parameters=self.named_parameters,
                               topology=topology, device=device, group=None)

    def plan_lines(self) -> list[str]:
        return ["a single replica: only the local non-finite check runs (no replay audit, no weight "
                "comparison), and a NaN/Inf cannot be confirmed as the hardware's"]

    def can_audit(self) -> bool:
        return True

    def begin_step(self, step: int, audit: bool) -> None:
        pass

    @contextlib.contextmanager
    def micro_batch(self, last: bool) -> Iterator[None]:
        yield

    # Check 3 with one replica passes by itself; its digest is what a checkpoint records.

    def fingerprint_weights(self) -> WeightCheck | None:
        return fingerprint_weights(self.named_parameters)

    def weights_token(self, weights: WeightCheck | None) -> Callable[[], tuple[bytes, bool]]:
        return answered(weights.digest if weights is not None else bytes(16))

    def judge_weights(self, weights: WeightCheck, tokens: list[bytes] | None) -> Verdict | None:
        return None

    def weights_agree(self, weights: WeightCheck) -> bool:
        return True

    def annotate(self, verdict: Verdict) -> Verdict:
        return verdict

    def seed_rank(self, rank: int) -> int:
        return rank

    # With no peer none of the following runs (the verifier's single-replica path); they exist so
    # that every layout answers the whole protocol.

    def vote(self, s: StepRecord) -> Vote:
        raise _no_peers()

    def reduced_gradients_finite(self) -> bool:
        raise _no_peers()

    def confirm_nonfinite(self, step: int, bad: list[int], payload: Payload, scale: Scale) -> Confirmation:
        raise _no_peers()

    def localize_checksum(self, verdict: Verdict, vote: Vote) -> Verdict:
        raise _no_peers()

    def own_pass(self, s: StepRecord) -> PassResult:
        raise _no_peers()

    def post_batch(self, blob: torch.Tensor, own_digest: bytes) -> Incoming:
        raise _no_peers()

    def replay(self, step: int, incoming: Incoming, scale: Scale) -> tuple[PassResult | None, Exception | None]:
        raise _no_peers()

    def replay_verdict(self, own: PassResult, replayed: PassResult | None, digests: list[list[bytes]],
                       payload: Payload, scale: Scale) -> Verdict | None:
        raise _no_peers()

    def check_update(self, step: int) -> Verdict | None:
        return None  # fingerprint_weights is never None here: check 3 itself runs


def _no_peers() -> RuntimeError:
    return RuntimeError("sdcguard: a single process has no peer to vote, replay or compare with")
