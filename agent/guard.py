"""The training-loop wrapper: one data-parallel step with sdcguard's checks in SPEC §3 order.

    guard = sdcguard.Guard(ddp_model, optimizer, loss_fn)
    for step, batch in enumerate(loader):
        loss = guard.train_step(step, batch)

``train_step`` does forward + backward, checks 1a/1b, on audit steps check 3 and the ring replay
(check 2), the optimizer step, then check 3 on weight-check steps. A check that fires raises
:class:`~sdcguard.errors.SDCDetected` on every rank with the same alarm record, and the update of
that step is not applied.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from . import spool
from .alarm import make_alarm
from .commhook import GradientRecorder, ReduceHook, record_then_reduce
from .config import Config
from .errors import SDCDetected
from .nonfinite import gather_norms, judge_nonfinite
from .rng import forward_seed, seeded
from .topology import Topology, gather_topology
from .verdict import Verdict
from .weights import compare_weights, fingerprint_weights

log = logging.getLogger("sdcguard")

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]
"""``loss_fn(module, micro_batch) -> scalar loss``: the forward pass and the loss, nothing else.
It is called with the DDP model for the real pass and with the bare module for replays."""


class Guard:
    """Wraps a ``DistributedDataParallel`` model and its optimizer for checked training steps."""

    def __init__(
        self,
        model: DistributedDataParallel,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        *,
        config: Config | None = None,
        reduce_hook: ReduceHook | None = None,
        reduce_state: Any = None,
    ) -> None:
        if not isinstance(model, DistributedDataParallel):
            raise TypeError("Guard needs a torch.nn.parallel.DistributedDataParallel model")
        # Settings.
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.config = config if config is not None else Config.from_env()
        self.group: dist.ProcessGroup | None = model.process_group
        self.device = _collective_device(self.group)
        self.topology: Topology = gather_topology(self.config, self.group)
        self.named_parameters = list(model.module.named_parameters())
        self.recorder = GradientRecorder(
            [p for _, p in self.named_parameters], self.group, reduce_hook, reduce_state
        )
        model.register_comm_hook(self.recorder, record_then_reduce)
        # Observed state.
        self.last_verified_step: int | None = None
        """Last step whose checks all passed."""
        self.last_weights_verified_step: int | None = None
        """Last step at which check 3 found every replica's weights identical."""
        self.last_weights_digest: str | None = None
        self.last_good_checkpoint: str | None = None
        """Newest checkpoint written after a passing check 3 (set by the checkpoint helper)."""
        self.alarms_raised = 0
        if self.topology.rank == 0:
            log.info(
                "sdcguard: %d ranks, %d per node, audit every %s, weight check every %s, spool %s",
                self.topology.world_size, self.topology.ranks_per_node,
                self.config.audit_every or "never", self.config.weight_check_every or "never",
                self.config.spool or "(none)",
            )

    # -- the step ------------------------------------------------------------------------------

    def train_step(self, step: int, batch: Any = None, *, micro_batches: Sequence[Any] | None = None) -> torch.Tensor:
        """Run one checked optimizer step on ``batch`` (or on several ``micro_batches``).

        Returns the mean loss over the micro-batches (detached).
        """
        batches = _as_micro_batches(batch, micro_batches)
        audit = self.is_audit_step(step)
        self.optimizer.zero_grad(set_to_none=True)
        self.recorder.begin_step(audit)
        loss = self._forward_backward(step, batches)
        self._raise_if(step, self._nonfinite_verdict())
        if audit:
            self._raise_if(step, self.weights_verdict(step))
        self.optimizer.step()
        if self.is_weight_check_step(step):
            self._raise_if(step, self.weights_verdict(step))
        self.last_verified_step = step
        return loss

    def is_audit_step(self, step: int) -> bool:
        return self.config.audit_every > 0 and step % self.config.audit_every == 0

    def is_weight_check_step(self, step: int) -> bool:
        every = self.config.weight_check_every
        return every > 0 and step % every == 0

    def check_weights(self, step: int) -> None:
        """Run check 3 now (every rank must call it); raise SDCDetected if a replica differs."""
        self._raise_if(step, self.weights_verdict(step))

    # -- the checks ----------------------------------------------------------------------------

    def _forward_backward(self, step: int, batches: Sequence[Any]) -> torch.Tensor:
        """Accumulate gradients over the micro-batches; DDP reduces on the last one only."""
        total = torch.zeros((), device=self.device)
        for i, micro in enumerate(batches):
            last = i == len(batches) - 1
            with contextlib.nullcontext() if last else self.model.no_sync():
                seed = forward_seed(self.config.seed, step, self.topology.rank, i)
                with seeded(seed, self.device):
                    loss = self.loss_fn(self.model, micro)
                (loss / len(batches)).backward()
            total = total + loss.detach().to(self.device)
        return total / len(batches)

    def _nonfinite_verdict(self) -> Verdict | None:
        """Checks 1a and 1b from one all-gather of two scalars per rank."""
        return judge_nonfinite(gather_norms(self.recorder.norms(self.device), self.group))

    def weights_verdict(self, step: int) -> Verdict | None:
        """Check 3; on success remember the step and digest the weights were verified at."""
        mine = fingerprint_weights(self.named_parameters)
        verdict, digests = compare_weights(mine, self.device, self.group)
        if verdict is None:
            self.last_weights_verified_step = step
            self.last_weights_digest = digests[0].hex()
        return verdict

    # -- alarms --------------------------------------------------------------------------------

    def _raise_if(self, step: int, verdict: Verdict | None) -> None:
        if verdict is not None:
            raise SDCDetected(alarm=self._publish(step, verdict))

    def _publish(self, step: int, verdict: Verdict) -> dict[str, Any]:
        """Build the record every rank raises; only the reporter writes it to the spool."""
        self.alarms_raised += 1
        topo = self.topology
        reporter = topo.reporter(verdict.suspects)
        record = make_alarm(
            alarm_id=f"{topo.run_id}-{self.alarms_raised}-{verdict.check}-step{step}",
            job=self.config.job,
            check=verdict.check,
            step=step,
            suspect_ranks=verdict.suspects,
            identities=topo.identities,
            ambiguous=verdict.ambiguous,
            reporter_rank=reporter,
            evidence=verdict.evidence,
            last_verified_step=self.last_verified_step,
            last_good_checkpoint=self.last_good_checkpoint,
            suspect_window=self._suspect_window(step, verdict),
        )
        if topo.rank == reporter:
            log.error("sdcguard alarm: %s", SDCDetected(alarm=record))
            if self.config.spool:
                spool.write_alarm(self.config.spool, record)
        return record

    def _suspect_window(self, step: int, verdict: Verdict) -> dict[str, int]:
        """Steps whose results the fault may have touched: weights since their last check."""
        if verdict.check == "weights":
            first = 0 if self.last_weights_verified_step is None else self.last_weights_verified_step + 1
            return {"first_step": min(first, step), "last_step": step}
        return {"first_step": step, "last_step": step}


def _as_micro_batches(batch: Any, micro_batches: Sequence[Any] | None) -> Sequence[Any]:
    if (batch is None) == (micro_batches is None):
        raise ValueError("train_step takes either a batch or micro_batches=[...], not both")
    if micro_batches is not None:
        if len(micro_batches) == 0:
            raise ValueError("micro_batches must not be empty")
        return micro_batches
    return [batch]


def _collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Small check tensors travel on the device the backend wants (CUDA for NCCL)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
