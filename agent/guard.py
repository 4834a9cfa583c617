"""The training-loop wrapper: one data-parallel step with sdcguard's checks in SPEC §3 order.

    guard = sdcguard.Guard(ddp_model, optimizer, loss_fn)
    for step, batch in enumerate(loader):
        loss = guard.train_step(step, batch)

``train_step`` does forward + backward, checks 1a/1b, on audit steps check 3 and the ring replay
(check 2), the optimizer step, then check 3 on weight-check steps. A check that fires raises
:class:`~sdcguard.errors.SDCDetected` on every rank with the same alarm record, and the update of
that step is not applied. ``save_checkpoint`` writes only after check 3 passes.
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .contract import spool
from .fingerprint import triton_kernel as fingerprint_triton
from .contract.alarm import CHECK_WEIGHTS, make_alarm
from .checks.audit import Replayer
from .checks.commhook import GradientRecorder, ReduceHook, record_then_reduce
from .config import Config
from .checks.determinism import check_replayable, deterministic
from .errors import ReplayError, SDCDetected
from .checks.exchange import DIGEST_BYTES, Incoming, agree, gather_digests, gather_objects, serialize
from .fingerprint import Fingerprint, fingerprint
from .checks.nonfinite import all_finite, gather_norms, judge_nonfinite, nonfinite_local_ranks
from .checks.replay import PassResult, Payload, replaying, snapshot_buffers
from .checks.rng import forward_seed, seeded
from .contract.stats import CheckStats
from .checks.topology import Topology, gather_topology
from .checks.verdict import Verdict
from .checks.weights import WeightCheck, fingerprint_weights, judge_weight_digests

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
        scaler: torch.amp.GradScaler | None = None,
        reduce_hook: ReduceHook | None = None,
        reduce_state: Any = None,
    ) -> None:
        if not isinstance(model, DistributedDataParallel):
            raise TypeError("Guard needs a torch.nn.parallel.DistributedDataParallel model")
        # Settings.
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.scaler = scaler
        self.config = config if config is not None else Config.from_env()
        self.group: dist.ProcessGroup | None = model.process_group
        self.device = _collective_device(self.group)
        self.topology: Topology = gather_topology(self.config, self.group)
        self.named_parameters = list(model.module.named_parameters())
        self.recorder = GradientRecorder(
            [p for _, p in self.named_parameters], self.group, reduce_hook, reduce_state
        )
        model.register_comm_hook(self.recorder, record_then_reduce)
        self.replayer = Replayer(
            module=model.module, loss_fn=loss_fn,
            params=[(i, p) for i, (_, p) in enumerate(self.named_parameters) if p.requires_grad],
            names={i: n for i, (n, _) in enumerate(self.named_parameters)},
            topology=self.topology, group=self.group, device=self.device, seed=self.config.seed,
        )
        if self.config.audit_every:
            check_replayable(self.topology, next(model.parameters()).device)
        if next(model.parameters()).is_cuda:  # compile and self-test the GPU kernel now, not mid-step
            fingerprint_triton.ready(next(model.parameters()).device)
        if any(True for _ in model.module.buffers()):
            model.module.register_forward_pre_hook(self._remember_buffers)
        # What this step's own pass recorded for a replay to compare with.
        self._recording = False
        self._micro = 0
        self._own_losses: list[Fingerprint] = []
        self._seen_buffers: list[dict[str, torch.Tensor]] = []
        # Observed state.
        self.last_verified_step: int | None = None
        """Last step whose checks all passed."""
        self.last_weights_verified_step: int | None = None
        """Last step at which check 3 found every replica's weights identical."""
        self.last_weights_digest: str | None = None
        self.checkpoints: list[tuple[int, str]] = []
        """(step, path) of each checkpoint written after a passing check 3, oldest first."""
        self.alarms_raised = 0
        self.stats = CheckStats(self.topology.identities[self.topology.rank], self.config.job)
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
        with deterministic(audit):
            loss = self._forward_backward(step, batches, record=audit or self.scaler is not None)
        payload = Payload(step, self.topology.rank, batches, self._seen_buffers)
        self.stats.last_step = step
        if audit:
            self._audit(step, payload)  # checks 1, 2 and 3, agreed on in one all-reduce
        else:
            self._check_nonfinite(step, payload)
        self._apply_update()
        if self.is_weight_check_step(step):
            self.check_weights(step)
        self.last_verified_step = self.stats.last_verified_step = step
        self.stats.steps += 1
        self.stats.flush(self.config.spool)
        return loss

    def is_audit_step(self, step: int) -> bool:
        # A single replica has nobody to replay its batch: check 2 needs two ranks at least.
        return self.config.audit_every > 0 and step % self.config.audit_every == 0 and self.topology.world_size > 1

    def is_weight_check_step(self, step: int) -> bool:
        every = self.config.weight_check_every
        return every > 0 and step % every == 0

    def check_weights(self, step: int) -> None:
        """Run check 3 now (every rank must call it); raise SDCDetected if a replica differs."""
        self._raise_if(step, self.weights_verdict(step))

    def flush_stats(self) -> None:
        """Write this rank's check statistics to the spool now (e.g. at the end of training)."""
        self.stats.flush(self.config.spool, force=True)

    def save_checkpoint(self, path: str, step: int, extra: dict[str, Any] | None = None) -> str:
        """Check 3, then write ``path`` and its manifest (every rank calls; rank 0 writes)."""
        from .checkpoint import save_checkpoint
        return str(save_checkpoint(self, path, step, extra))

    def load_checkpoint(self, path: str) -> int:
        """Resume from a verified checkpoint (every rank calls); return the step it was taken at.

        The model, optimizer and scaler are loaded only after the file and the loaded weights
        match the manifest; the checkpoint then counts as this run's last good one."""
        from .checkpoint import load_checkpoint
        device = next(self.model.parameters()).device
        state = load_checkpoint(path, self.model.module, self.optimizer, self.scaler, map_location=device)
        step = int(state["step"])
        self.checkpoints.append((step, str(path)))
        self.last_verified_step = self.last_weights_verified_step = step
        return step

    # -- the checks ----------------------------------------------------------------------------

    def _forward_backward(self, step: int, batches: Sequence[Any], record: bool) -> torch.Tensor:
        """Accumulate gradients over the micro-batches; DDP reduces on the last one only.

        With ``record``, keep what a replay compares with: each micro-batch's loss bits and the
        buffers its forward saw (the gradients' fingerprints come from the comm hook)."""
        self._recording, self._own_losses, self._seen_buffers = record, [], []
        for i, micro in enumerate(batches):
            self._micro = i
            last = i == len(batches) - 1
            with contextlib.nullcontext() if last else self.model.no_sync():
                seed = forward_seed(self.config.seed, step, self.topology.rank, i)
                with seeded(seed, self.device):
                    loss = self.loss_fn(self.model, micro)
                scaled = loss / len(batches) if len(batches) > 1 else loss  # x / 1 == x, bit for bit
                (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
            if record:
                self._own_losses.append(fingerprint(loss.detach()))
            total = loss.detach() if i == 0 else total + loss.detach()
        self._recording = False
        return total / len(batches) if len(batches) > 1 else total

    def _remember_buffers(self, module: torch.nn.Module, args: Any) -> None:
        """Forward pre-hook: the buffers this micro-batch's forward sees (after DDP's broadcast)."""
        if self._recording and not replaying() and len(self._seen_buffers) == self._micro:
            self._seen_buffers.append(snapshot_buffers(module))

    def _own_pass(self) -> PassResult:
        return PassResult(list(self._own_losses), self.recorder.fingerprints())

    def _check_nonfinite(self, step: int, payload: Payload) -> bool:
        """Checks 1a and 1b: one all-reduce of two scalars; the per-rank values are gathered only
        when it finds something non-finite. Returns whether the step holds an honest GradScaler
        overflow (see :meth:`_judge_nonfinite`)."""
        started = time.perf_counter()
        norms = self.recorder.norms(self.device)
        finite = all_finite(norms, self.group)  # the common case: 16 bytes, done
        self.stats.timed("nonfinite", started)
        return False if finite else self._judge_nonfinite(step, payload, gather_norms(norms, self.group))

    def _judge_nonfinite(self, step: int, payload: Payload, norms: list[list[float]]) -> bool:
        """Raise for check 1a or 1b from every rank's ``[local, reduced]`` norms; or return True
        when the non-finite local gradients are an honest GradScaler overflow (confirmed by
        replaying the overflowing batches on other nodes: the scaler then skips the step)."""
        bad = nonfinite_local_ranks(norms)
        if bad and self.scaler is not None:
            self._raise_if(step, self.replayer.confirm_nonfinite(bad, payload, self._scale))
            return True
        self._raise_if(step, judge_nonfinite(norms))
        return False

    def _audit(self, step: int, payload: Payload) -> None:
        """Checks 1, 2 and 3 with one collective after the backward pass, besides the batch
        transfer between ring neighbours: this rank's batch leaves for its replayer with the
        digest of its own pass, the weights are fingerprinted while it travels (before the
        replay, as the SPEC says), the neighbour's batch is replayed and compared locally, and one
        16-byte all-reduce says whether every rank's gradients are finite, its weights agree and
        its replay matched. Only when not is everything gathered and judged in the SPEC's order —
        non-finite gradients, then weights, then replays — so that neither a NaN nor a weight
        fault is taken for a compute fault."""
        started = time.perf_counter()
        norms = self.recorder.norms(self.device)
        finite = bool(torch.isfinite(norms).all())
        self.stats.timed("nonfinite", started)
        started = time.perf_counter()
        own = self._own_pass()
        own_digest = own.digest()
        incoming = self.replayer.post_batch(serialize(payload), own_digest)
        weights_started = time.perf_counter()
        weights = fingerprint_weights(self.named_parameters)
        self.stats.timed("weights", weights_started)
        started += time.perf_counter() - weights_started  # the replay's time leaves the weights' out
        with deterministic(True):
            replayed, failure = self._replay_neighbour(incoming)
            replay_digest = replayed.digest() if replayed is not None else bytes(DIGEST_BYTES)
            matched = failure is None and replay_digest == incoming.note
            if agree(weights.digest, self.device, self.group, veto=not (finite and matched)):
                self._weights_verified(step, weights)
                verdict = None
            elif self._judge_nonfinite(step, payload, gather_norms(norms, self.group)):
                verdict = None  # an honest overflow: the scaler skips this step
            else:
                digests = gather_digests([weights.digest, own_digest, replay_digest], self.device, self.group)
                self._raise_if(step, self._judge_weights(step, weights, [d[0] for d in digests]))
                self._raise_if_replays_failed(step, failure)
                verdict = self.replayer.judge(own, replayed, [d[1:] for d in digests], payload, self._scale)
        self.stats.timed("replay", started)
        self._raise_if(step, verdict)

    def _replay_neighbour(self, incoming: Incoming) -> tuple[PassResult | None, Exception | None]:
        """Receive and replay the neighbour's batch. An exception is kept, not raised: this rank
        must still join the agreement (and veto it), or every other rank would wait there."""
        try:
            return self.replayer.run(incoming.receive(), self._scale), None
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
            log.exception("sdcguard: replaying rank %d's batch failed", self.topology.replay_target(self.topology.rank))
            return None, exc

    def _raise_if_replays_failed(self, step: int, failure: Exception | None) -> None:
        """Every rank learns which replays failed (this runs only after a vetoed agreement) and
        raises the same ReplayError."""
        said = gather_objects(None if failure is None else f"{type(failure).__name__}: {failure}", self.group)
        failures = {rank: msg for rank, msg in enumerate(said) if msg is not None}
        if failures:
            raise ReplayError(step, failures) from failure

    @property
    def _scale(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        return self.scaler.scale if self.scaler is not None else None

    def _apply_update(self) -> None:
        if self.scaler is None:
            self.optimizer.step()
            return
        self.scaler.step(self.optimizer)
        self.scaler.update()

    def weights_verdict(self, step: int) -> Verdict | None:
        """Check 3; on success remember the step and digest the weights were verified at."""
        started = time.perf_counter()
        mine = fingerprint_weights(self.named_parameters)
        if agree(mine.digest, self.device, self.group):  # the common case: 16 bytes, done
            self._weights_verified(step, mine)
            verdict = None
        else:
            digests = [d for [d] in gather_digests([mine.digest], self.device, self.group)]
            verdict = self._judge_weights(step, mine, digests)
        self.stats.timed("weights", started)
        return verdict

    def _judge_weights(self, step: int, mine: WeightCheck, digests: list[bytes]) -> Verdict | None:
        verdict = judge_weight_digests(mine, digests, self.topology.rank, self.group)
        if verdict is None:
            self._weights_verified(step, mine)
        return verdict

    def _weights_verified(self, step: int, mine: WeightCheck) -> None:
        """Every replica's weights matched this rank's ``mine`` at ``step``."""
        self.last_weights_verified_step = step
        self.last_weights_digest = mine.digest.hex()

    # -- alarms --------------------------------------------------------------------------------

    def _raise_if(self, step: int, verdict: Verdict | None) -> None:
        if verdict is not None:
            raise SDCDetected(alarm=self._publish(step, verdict))

    def _publish(self, step: int, verdict: Verdict) -> dict[str, Any]:
        """Build the record every rank raises; only the reporter writes it to the spool."""
        self.alarms_raised += 1
        topo = self.topology
        reporter = topo.reporter(verdict.suspects)
        window = self._suspect_window(step, verdict)
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
            last_good_checkpoint=self._checkpoint_before(window["first_step"]),
            suspect_window=window,
        )
        if topo.rank == reporter:
            log.error("sdcguard alarm: %s", SDCDetected(alarm=record))
            if self.config.spool:
                spool.write_alarm(self.config.spool, record)
        self.stats.alarms += 1
        self.stats.flush(self.config.spool, force=True)
        return record

    def _suspect_window(self, step: int, verdict: Verdict) -> dict[str, int]:
        """Steps whose results the fault may have touched: weights since their last check."""
        if verdict.check == CHECK_WEIGHTS:
            first = 0 if self.last_weights_verified_step is None else self.last_weights_verified_step + 1
            return {"first_step": min(first, step), "last_step": step}
        return {"first_step": step, "last_step": step}


    def _checkpoint_before(self, step: int) -> str | None:
        """The newest verified checkpoint written before ``step``."""
        older = [path for at, path in self.checkpoints if at < step]
        return older[-1] if older else None


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
