"""DDP: every rank holds the whole model; gradients are averaged bucket by bucket.

The comm hook (``checks/commhook.py``) reads each bucket before and after its all-reduce; a replay
runs the bare module alone on the rank (``checks/audit.py``); check 3 compares one digest of the
whole model across every rank; a checkpoint is one file written by rank 0 (``checkpoint.py``).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..checks.audit import Confirmation, Replayer
from ..checks.commhook import GradientRecorder, ReduceHook, record_then_reduce
from ..checks.exchange import Incoming, agree, gather_digests
from ..checks.replay import PassResult, Payload
from ..checks.topology import Topology
from ..checks.verdict import Verdict
from ..checks.weights import WeightCheck, fingerprint_weights, weights_verdict
from .base import Scale, StepRecord, Vote, everywhere_finite
from .stores import FileStore


class DataParallel:
    """The :class:`~sdcguard.layouts.base.Layout` of a ``DistributedDataParallel`` model."""

    def __init__(self, *, ddp: DistributedDataParallel, wrappers: tuple[torch.nn.Module, ...], compiled: bool,
                 loss_fn: Any, topology: Topology, device: torch.device, seed: int,
                 reduce_hook: ReduceHook | None, reduce_state: Any, optimizer: torch.optim.Optimizer,
                 scaler: Any) -> None:
        self.ddp = ddp
        self.module: torch.nn.Module = ddp.module
        self.wrappers = wrappers
        self.compiled = compiled
        self.topology = topology
        self.device = device
        self.group: dist.ProcessGroup | None = ddp.process_group
        self.named_parameters = list(self.module.named_parameters())
        self.recorder = GradientRecorder([p for _, p in self.named_parameters], self.group, reduce_hook,
                                         reduce_state, seed=seed)
        ddp.register_comm_hook(self.recorder, record_then_reduce)
        self.replayer = Replayer(
            module=self.module, loss_fn=loss_fn,
            params=[(i, p) for i, (_, p) in enumerate(self.named_parameters) if p.requires_grad],
            names={i: n for i, (n, _) in enumerate(self.named_parameters)},
            topology=topology, group=self.group, device=device, seed=seed)
        self.checks_reduction = topology.world_size > 1 and self.recorder.checks_reduction
        self.checks_weights = topology.world_size > 1
        self.store = FileStore(module=self.module, optimizer=optimizer, scaler=scaler,
                               named_parameters=self.named_parameters, topology=topology, device=device,
                               group=self.group)

    def plan_lines(self) -> list[str]:
        lines = []  # every check runs: nothing to say beyond the Guard's line of settings
        if not self.recorder.checks_reduction and self.topology.world_size > 1:
            lines.append("the reduce hook does not declare averages_like_ddp (a compression hook?): check 4 "
                         "(reduce-checksum) is off, a finite fault inside the all-reduce goes unseen")
        return lines

    # -- recording -------------------------------------------------------------------------------

    def can_audit(self) -> bool:
        return True

    def begin_step(self, step: int, audit: bool) -> None:
        self.recorder.begin_step(audit, step)

    @contextlib.contextmanager
    def micro_batch(self, last: bool) -> Iterator[None]:
        with contextlib.nullcontext() if last else self.ddp.no_sync():
            yield

    # -- checks 1 and 4 --------------------------------------------------------------------------

    def vote(self, s: StepRecord) -> Vote:
        # Check 4 only where the reduction is DDP's mean (a compression hook changes the sum).
        shape = self.recorder.shape() if self.recorder.checks_reduction else None
        return Vote(self.recorder.vote(self.device), lambda: self.recorder.rows(self.device), shape)

    def reduced_gradients_finite(self) -> bool:
        return everywhere_finite(self.named_parameters, self.device, self.group)

    def confirm_nonfinite(self, step: int, bad: list[int], payload: Payload, scale: Scale) -> Confirmation:
        return self.replayer.confirm_nonfinite(step, bad, payload, scale)

    def localize_checksum(self, verdict: Verdict, vote: Vote) -> Verdict:
        return verdict  # one all-reduce of every rank: no rank or group can be named

    def annotate(self, verdict: Verdict) -> Verdict:
        return verdict

    def seed_rank(self, rank: int) -> int:
        return rank

    # -- check 2 ---------------------------------------------------------------------------------

    def own_pass(self, s: StepRecord) -> PassResult:
        losses, grads = self.recorder.fingerprints(s.loss_sums)  # one read to the host for both
        return PassResult(losses, grads)

    def post_batch(self, blob: torch.Tensor, own_digest: bytes) -> Incoming:
        return self.replayer.post_batch(blob, own_digest)

    def replay(self, step: int, incoming: Incoming, scale: Scale) -> tuple[PassResult | None, Exception | None]:
        try:
            return self.replayer.run(incoming.receive(), scale), None
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank by the verifier
            return None, exc

    def replay_verdict(self, own: PassResult, replayed: PassResult | None, digests: list[list[bytes]],
                       payload: Payload, scale: Scale) -> Verdict | None:
        return self.replayer.verdict(own, replayed, digests, payload, scale)

    # -- check 3 ---------------------------------------------------------------------------------

    def fingerprint_weights(self) -> WeightCheck | None:
        return fingerprint_weights(self.named_parameters)

    def weights_token(self, weights: WeightCheck | None) -> Callable[[], tuple[bytes, bool]]:
        # Every rank holds the whole model: the digest itself is agreed in the audit's all-reduce,
        # read to the host when answered (after the replay).
        return lambda: (weights.digest, True)

    def judge_weights(self, weights: WeightCheck, tokens: list[bytes] | None) -> Verdict | None:
        if tokens is None:
            tokens = [d for [d] in gather_digests([weights.digest], self.device, self.group)]
        return weights_verdict(weights, tokens, self.topology.rank, self.group, self.device)

    def check_update(self, step: int) -> Verdict | None:
        return None  # fingerprint_weights is never None here: check 3 itself runs

    def weights_agree(self, weights: WeightCheck) -> bool:
        return agree(weights.digest, self.device, self.group)
