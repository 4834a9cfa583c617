"""The Guard: sdcguard's checks composed around the user's own training step (docs/design.md §3 order).

    guard = sdcguard.Guard(model, optimizer, loss_fn)
    for step, batches in enumerate(loader):
        with guard.step(step, micro_batches=len(batches)) as s:   # see sdcguard.step
            for micro in batches:
                s.backward(micro, divide_by=len(batches))
            s.check()                      # checks 1 and 2 (3 on audit steps) before any update
            optimizer.step(); optimizer.zero_grad(set_to_none=True)
        # leaving the block: check 3 on weight-check steps

or, in one call, ``guard.train_step(step, batch)``. A check that fires raises
:class:`~sdcguard.errors.SDCDetected` on every rank with the same alarm record and the update of
that step is refused; a NaN/Inf that reproduces elsewhere (the data's, not the hardware's) raises
:class:`~sdcguard.errors.NonFiniteGradient` instead. ``save_checkpoint`` writes only after check 3.

The model may be ``DistributedDataParallel``, ``torch.compile`` of one, DDP around a compiled
module, a model sharded with FSDP2 (``fully_shard``: pure FSDP or HSDP; ``sdcguard.sharding``), or
— with a single process — a plain (or compiled) module: the checks that need other replicas then
do not run, which the Guard says once at start-up. Each is a layout (``sdcguard.layouts``): the
Guard holds one and never asks which.
"""
from __future__ import annotations

import logging
import os
import weakref
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from . import recovery
from .budget import DECIDED, Budget, Meter
from .checks.commhook import ReduceHook
from .checks.determinism import check_replayable
from .checks.replay import ForwardBuffers
from .checks.topology import Topology
from .config import Config
from .contract.stats import CheckStats, stats_path
from .errors import NonFiniteGradient
from .fingerprint import triton_kernel as fingerprint_triton
from .fingerprint import triton_checksum
from .gate import Pending, UpdateGate, device_gate_refusal, to_host
from .layouts import Layout, StepRecord, build_layout, param_device, unwrap
from .reporting import AlarmReporter
from .step import Step, StepContext
from .verification import Verifier

__all__ = ["Guard", "LossFn", "unwrap"]

log = logging.getLogger("sdcguard")

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]
"""``loss_fn(module, micro_batch) -> scalar loss``: the forward pass and the loss, nothing else.
It is called with your model for the real pass and with the bare module for replays."""


class Guard:
    """sdcguard's checks for one model and its optimizer; one per training process.

    It wires the parts (the comm hook's recorder, the replayer, the update gate, the verifier,
    the alarm reporter) and owns the step's lifecycle; each part does one job (docs/design.md)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn | None = None,
        *,
        config: Config | None = None,
        scaler: torch.amp.GradScaler | None = None,
        reduce_hook: ReduceHook | None = None,
        reduce_state: Any = None,
    ) -> None:
        # Settings.
        self.model = model
        """What ``loss_fn`` is called with for the real pass (DDP, compiled, or plain)."""
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        # A disabled GradScaler (what nanoGPT builds for float32/bfloat16) never skips a step: none.
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.config = config if config is not None else Config.from_env()
        if self.config.device_gate:
            refusal = device_gate_refusal(optimizer)
            if refusal is not None:
                raise ValueError(refusal)
        # The parts.
        self.gate = UpdateGate(optimizer)
        """Refuses an update before its step's checks passed; counts the updates the weights hold."""
        self.layout: Layout = build_layout(model, loss_fn=loss_fn, optimizer=optimizer, scaler=self.scaler,
                                           config=self.config, zero_update=self.gate.zero_update,
                                           reduce_hook=reduce_hook, reduce_state=reduce_state)
        """DDP, FSDP2/HSDP or one process: what the checks read, replay, compare and store through."""
        self.module = self.layout.module
        """The bare module: what replays run on and checkpoints hold."""
        self.compiled = self.layout.compiled
        self.topology: Topology = self.layout.topology
        self.device = self.layout.device
        self.group: dist.ProcessGroup | None = self.layout.group
        self.named_parameters = self.layout.named_parameters
        self.solo = self.topology.world_size == 1
        self._replays = not self.solo
        """Check 2 can run: more than one rank."""
        if self.config.audit_every and self._replays:
            check_replayable(self.topology, param_device(self.module))
        if param_device(self.module).type == "cuda":  # compile and self-test the GPU kernels now, not mid-step
            fingerprint_triton.ready(param_device(self.module))
            triton_checksum.ready(param_device(self.module))
        self.forwards = ForwardBuffers()
        """The buffers each forward of a recorded step sees (what its replay loads)."""
        if not self.solo and any(True for _ in self.module.buffers()):
            # Eager even inside compiled code: it keeps Python state, which dynamo must not trace.
            self.module.register_forward_pre_hook(torch._dynamo.disable(self.forwards) if self.compiled else self.forwards)
        self.stats = CheckStats(self.topology.identities[self.topology.rank], self.config.job)
        self.verifier = Verifier(self.layout, self.stats)
        self.reporter = AlarmReporter(self.config, self.topology, self.stats, self.group)
        self.meter = Meter(self.stats, self.topology.world_size)
        """What each step and each kind of check cost on this rank (the statistics' ``cost``)."""
        self.budget: Budget | None = None
        """The integrity budget's audit interval (``Config.max_overhead``), or None: ``audit_every``."""
        if self.config.budgeted and self._replays:
            self.budget = Budget(self.config, self.stats, self.device, self.group,
                                 self.topology.world_size, self.topology.rank, meter=self.meter)
        else:
            self.stats.audit_schedule = {"mode": "fixed", "interval": self.config.audit_every if self._replays else 0}
        self._step_context = StepContext(model=model, loss_fn=loss_fn, scaler=self.scaler, layout=self.layout,
                                         seed=self.config.seed, forwards=self.forwards, begin=self._begin,
                                         verify=self._verify, end=self._end)
        self.nonfinite_skipped = 0
        """Steps skipped because of a reproduced NaN/Inf (``on_nonfinite="skip"``)."""
        self._pending: Pending | None = None
        """The last step whose verdict the device decided and the host has not read (``device_gate``)."""
        self._closed = False
        # The statistics reach the spool even when nobody calls close(): when this Guard is
        # collected (a Guard local to a function that returned) or at interpreter exit, whichever
        # comes first. The finalizer holds the statistics and the path, never the Guard.
        if self.config.spool:
            _NEWEST_STATS[str(stats_path(self.config.spool, self.topology.rank))] = self.stats
        self._flush_at_end = weakref.finalize(self, _flush_quietly, self.stats, self.config.spool)
        self._log_configuration()

    # -- the step ------------------------------------------------------------------------------

    def step(self, step: int, *, micro_batches: int = 1, audit: bool | None = None) -> Step:
        """A checked step in your own loop (use as ``with guard.step(step) as s:``).

        ``audit=True`` makes this step an audit step on demand (e.g. before a checkpoint);
        every rank must pass the same value."""
        audit = self.is_audit_step(step) if audit is None else bool(audit) and self._replays
        return Step(self._step_context, step, micro_batches, audit and self.layout.can_audit())

    def train_step(self, step: int, batch: Any = None, *, micro_batches: Sequence[Any] | None = None,
                   clip_grad_norm: float | None = None, audit: bool | None = None) -> torch.Tensor:
        """One checked optimizer step in one call: zero_grad, forward + backward of each
        micro-batch on ``loss / len(micro_batches)``, the checks, optional gradient clipping
        (after unscaling, with an enabled GradScaler), the update (through the scaler), check 3.

        Returns the mean of the micro-batch losses (unweighted, detached)."""
        batches = _as_micro_batches(batch, micro_batches)
        self.optimizer.zero_grad(set_to_none=True)
        with self.step(step, micro_batches=len(batches), audit=audit) as s:
            for micro in batches:
                s.backward(micro, divide_by=len(batches) if len(batches) > 1 else None)  # x / 1 == x
            s.check()
            if clip_grad_norm is not None:
                if self.scaler is not None:
                    self.scaler.unscale_(self.optimizer)
                torch.nn.utils.clip_grad_norm_([p for _, p in self.named_parameters], clip_grad_norm)
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
        return s.loss

    def is_audit_step(self, step: int) -> bool:
        # A single process has nobody to replay its batch: check 2 needs two ranks at least.
        if not self._replays:
            return False
        # Under an integrity budget the interval is the one every rank last agreed on (sdcguard.budget).
        every = self.budget.interval if self.budget is not None else self.config.audit_every
        if every > 0 and step % every == 0:
            return True
        return self.config.audits_checkpoints() and step % self.config.checkpoint_every == 0

    def is_weight_check_step(self, step: int) -> bool:
        every = self.config.weight_check_every
        return every > 0 and step % every == 0

    # -- what the run has verified -------------------------------------------------------------

    @property
    def history(self) -> recovery.History:
        """What this run has verified: audits, weights, checkpoints (see ``sdcguard.recovery``)."""
        return self.verifier.history

    @history.setter
    def history(self, value: recovery.History) -> None:
        self.verifier.history = value

    @property
    def last_verified_step(self) -> int | None:
        """The last step at which every check ran and passed (see ``recovery.History``)."""
        return self.history.last_verified_step

    @property
    def last_weights_verified_step(self) -> int | None:
        return self.history.last_weights_verified_step

    @property
    def last_weights_digest(self) -> str | None:
        return self.verifier.last_weights_digest

    @property
    def updates_through(self) -> int | None:
        """The last step whose update the weights include: what a checkpoint written now records."""
        return self.gate.updates_through

    @property
    def alarms_raised(self) -> int:
        return self.reporter.alarms_raised

    @property
    def checkpoints(self) -> list[tuple[int, str]]:
        """(step, path) of each checkpoint this run wrote or resumed from, oldest first."""
        return [(c.step, c.path) for c in self.history.checkpoints]

    def check_weights(self, step: int) -> None:
        """Run check 3 now on the weights after ``step``'s update (every rank must call it);
        raise SDCDetected if a replica differs."""
        verdict = self.verifier.weights(step)
        if verdict is not None:
            self.reporter.raise_alarm(step, verdict, self.history)

    def settle(self) -> None:
        """With ``Config.device_gate``: read the verdict of the last step decided on the device now,
        and raise what ``check()`` would have raised for it (its alarm, or NonFiniteGradient).
        Every rank must call it. The Guard does at the next ``check()``, before a checkpoint is
        written and at ``close()``; nothing happens when no verdict is pending."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        x, y, failed = pending.read()
        saved = pending.scale
        scale = None if saved is None else (lambda t: t * saved.to(device=t.device, non_blocking=True))
        outcome = self.verifier.settle(pending.record, pending.vote, x, y, scale)
        found = outcome.verdict is not None or outcome.nonfinite is not None
        if failed:
            for p in pending.fresh:  # a masked first step's empty SGD momentum buffers
                self.optimizer.state.get(p, {}).pop("momentum_buffer", None)
            if not found:
                log.warning("sdcguard: step %d: its update was held back on the device (the checks' sums were not "
                            "finite: float32 overflow of finite gradient norms); the step is skipped", pending.step)
        elif found:
            log.error("sdcguard: step %d: the device let an update through that the host judges failed",
                      pending.step)
        if outcome.verdict is not None:
            if failed:
                self.gate.updates_through = pending.updates_before  # its update was never applied
            self.reporter.raise_alarm(pending.step, outcome.verdict, self.history)
        if outcome.nonfinite is not None and self.scaler is None:
            error = NonFiniteGradient(step=pending.step, ranks=outcome.nonfinite, confirmed=outcome.confirmed)
            if self.config.on_nonfinite != "skip":
                raise error
            log.warning("%s; its update was skipped on the device (on_nonfinite=skip)", error)
            self.nonfinite_skipped += 1

    def flush_stats(self) -> None:
        """Write this rank's check statistics to the spool now."""
        self.stats.flush(self.config.spool, force=True)

    def close(self, *, settle: bool = True) -> None:
        """End of training: read a verdict still on the device (``settle``: collective), flush
        the statistics (also done when the Guard is collected, or at interpreter exit)."""
        if not self._closed:
            self._closed = True
            self._flush_at_end.detach()
            try:
                if settle:
                    self.settle()
                elif self._pending is not None:
                    log.warning("sdcguard: step %d's verdict was still on the device when the run failed; it "
                                "is not read (the other ranks may not be here to read it with)", self._pending.step)
            finally:
                self.flush_stats()

    def __enter__(self) -> Guard:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        # Leaving on an exception, this rank may be alone: settling would wait in collectives the
        # other ranks never join, and hide the error.
        self.close(settle=exc_type is None)

    # -- checkpoints ---------------------------------------------------------------------------

    def save_checkpoint(self, path: str | os.PathLike[str], step: int | None = None,
                        state: dict[str, Any] | None = None, *, when: bool = True,
                        model_key: str = "model") -> str | None:
        """Check 3, then write ``path`` (your ``state`` dict as it is; by default model, optimizer,
        scaler and step) and its manifest. Every rank calls it; rank 0 decides ``when`` and writes.

        The manifest's step is the last step whose update the weights include (``updates_through``;
        a save at the top of iteration ``it`` holds ``it - 1``): leave ``step`` out, or pass that
        value; any other is refused. When ``path`` already holds a checkpoint that a later alarm
        may still name (one file written over and over), that file is kept beside it as
        ``<stem>.sdcguard-step<N><suffix>`` until a newer verified checkpoint covers every window
        (``Config.keep_resume_points``). Returns the path, or None when rank 0 said not to save.

        A sharded (FSDP2) model is saved as a DCP directory at ``path`` (``sdcguard.sharding.dcp``):
        every rank writes its shards of the model and optimizer; ``state`` then holds only your
        extra entries (e.g. ``{"scheduler": scheduler}``), loaded back by ``load_checkpoint(...,
        state=)``. With one replica (pure FSDP) check 3 has nothing to compare: the checkpoint is
        written, its manifest says its weights were not cross-checked, and no alarm names it."""
        from . import checkpoint
        if not checkpoint.rank0_says(bool(when), self.device, self.group, self.solo):
            return None
        step = self.save_gate(path, step)
        self.history = self.layout.store.save(str(path), step=step, state=state, model_key=model_key,
                                              history=self.history, weight_digest=self.last_weights_digest,
                                              keep=self.config.keep_resume_points)
        return str(path)

    def save_gate(self, path: str | os.PathLike[str], step: int | None = None) -> int:
        """What every checkpoint must pass before anything is written, whoever writes its files
        (this Guard's store, or a framework's own save): no save after an alarm (the state is
        suspect), the step rule (the manifest's step is the last step whose update the weights
        include: ``step`` left out, or that value), then check 3 on every rank. Returns the step the
        checkpoint holds; raises ``CheckpointError`` or ``SDCDetected`` on every rank alike."""
        from . import checkpoint
        self.settle()  # a verdict still on the device is read first: it may be an alarm
        if self.alarms_raised:
            raise checkpoint.CheckpointError(
                f"refusing to write {path}: this run raised {self.alarms_raised} alarm(s) and its state "
                "is suspect; resume from the last good checkpoint instead")
        step = checkpoint.manifest_step(self.updates_through, step, path)
        self.check_weights(step)  # raises SDCDetected on every rank when a replica differs
        return step

    def load_checkpoint(self, path: str | os.PathLike[str], *, model_key: str = "model",
                        expect_step: int | None = None, expect_sha256: str | None = None,
                        state: dict[str, Any] | None = None) -> int:
        """Resume from a verified checkpoint (every rank calls); return the step it was taken at.

        The model, optimizer and scaler are loaded only after the file and the loaded weights
        match the manifest — and, with ``expect_step`` / ``expect_sha256`` (the alarm's
        ``last_good_checkpoint_step`` / ``_sha256``), only if it is the checkpoint the alarm
        named; the checkpoint then counts as this run's starting point.

        For a sharded model ``path`` is the DCP directory: every file's SHA-256 is checked before
        DCP reads any, and each rank's loaded shards against the fingerprint its manifest records;
        ``state`` holds the extra entries you saved, loaded in place (``Stateful`` values through
        their ``load_state_dict``)."""
        self.settle()  # a verdict still on the device belongs to the state being replaced
        step, history, digest = self.layout.store.load(str(path), model_key=model_key, expect_step=expect_step,
                                                       expect_sha256=expect_sha256, state=state)
        self.resumed(step, history, digest)
        return step

    def resumed(self, step: int, history: recovery.History, weights_digest: str | None) -> None:
        """The run starts from a checkpoint of ``step`` that the caller loaded and verified (a
        framework's own load): it inherits that checkpoint's ``history``, check 3's next
        comparison starts from ``weights_digest``, and the update count from ``step``."""
        self.history = history
        self.verifier.last_weights_digest = weights_digest
        self.gate.resumed_at(step)
        self.reporter.report_resume(step, history)  # the incident learns where the run resumed from

    def plan_lines(self) -> list[str]:
        """Which checks run for this model's layout, and why the others do not (logged at start-up)."""
        return self.layout.plan_lines()

    # -- the phases of a step (called by Step through its StepContext) -------------------------

    def _begin(self, step: int, audit: bool) -> None:
        self.gate.open(step)
        self.layout.begin_step(step, audit)
        self.stats.last_step = step
        self.meter.begin(audit)

    def _verify(self, record: StepRecord) -> bool:
        """Checks 1 and 4 (and 2 and 3 on audit steps) before any update: raise on every rank
        alike, or let the update through; True when the update will not be applied.

        With ``device_gate``, the previous step's verdict is read first, and an ordinary step's
        own is left on the device (the fused optimizer skips the update when it failed)."""
        self.settle()
        if self.config.device_gate and not record.audit and not self.is_weight_check_step(record.step):
            found_inf, vote, sums = self.verifier.on_device(record)
            before = self.gate.updates_through
            fresh = self.gate.allow_masked(found_inf)
            host, ready = to_host(torch.cat([sums, found_inf.to(sums.dtype).reshape(1)]))
            scale = self.scaler._scale.clone() if self.scaler is not None and self.scaler._scale is not None else None
            self._pending = Pending(record.step, record, vote, host, ready, updates_before=before, fresh=fresh,
                                    scale=scale)
            return False
        outcome = self.verifier.before_update(record, self._scale)
        if outcome.verdict is not None:
            self.reporter.raise_alarm(record.step, outcome.verdict, self.history)
        skipped = False
        if outcome.nonfinite is not None:
            skipped = self._nonfinite_reproduced(record.step, outcome.nonfinite, outcome.confirmed)
        self.gate.allow()
        return skipped

    def _end(self, step: int, unchecked: bool, failed: BaseException | None) -> None:
        # A NaN/Inf refused as the data's is done with, unapplied: the weights are the step before's
        # (one about the step before, read late by the device gate, leaves this step undone).
        self.gate.close(done=failed is None or isinstance(failed, NonFiniteGradient) and failed.step == step)
        if failed is not None:
            self.meter.interrupted()
            return
        if unchecked:
            raise RuntimeError(f"sdcguard: step {step} ended without s.check(): its gradients were never checked")
        if self.is_weight_check_step(step):
            self.check_weights(step)
        self.stats.last_verified_step = self.history.last_verified_step
        self.stats.steps += 1
        self.meter.ended(weights=self.is_weight_check_step(step))  # measure the step
        if self.budget is not None:  # after an audit, re-decide the interval
            self.budget.ended(step)
        self.stats.flush(self.config.spool)

    def _nonfinite_reproduced(self, step: int, ranks: dict[int, int | None], confirmed: bool) -> bool:
        """A NaN/Inf that is the data's or the model's, not the hardware's: never an alarm. With
        an enabled GradScaler an honest overflow: the scaler skips the step (returns True)."""
        if self.scaler is not None:
            return True
        error = NonFiniteGradient(step=step, ranks=ranks, confirmed=confirmed)
        if self.config.on_nonfinite != "skip":
            raise error
        log.warning("%s; skipping the step (on_nonfinite=skip)", error)
        self.nonfinite_skipped += 1
        for _, p in self.named_parameters:  # optimizer.step() then changes nothing
            p.grad = None
        return True

    @property
    def _scale(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        return self.scaler.scale if self.scaler is not None else None

    def _log_configuration(self) -> None:
        if self.topology.rank != 0:
            return
        cfg, topo = self.config, self.topology
        for line in self.plan_lines():
            log.warning("sdcguard: %s", line)
        audits = cfg.audit_every or "never"
        if self.budget is not None:
            audits = (f"chosen by the integrity budget (max_overhead={cfg.max_overhead:g}: at most "
                      f"{cfg.max_overhead * 100:.3g}% added to a step, as measured while training; at least every "
                      f"{cfg.max_audit_interval} steps, max_audit_interval), starting every {self.budget.interval}, "
                      f"re-decided {DECIDED} and the same on every rank")
        log.info("sdcguard: %d ranks, %d per node, audit every %s, weight check every %s, spool %s",
                 topo.world_size, topo.ranks_per_node, audits,
                 cfg.weight_check_every or "never", cfg.spool or "(none)")
        if cfg.device_gate:
            log.info("sdcguard: device gate: an ordinary step's update is decided on the device (the fused "
                     "optimizer's found_inf); its verdict is read at the next check(), save or close()")
        if self.budget is not None and cfg.checkpoint_every and not cfg.audit_checkpoints:
            log.warning("sdcguard: the audit interval changes under max_overhead, so checkpoints every %d steps "
                        "are not all audit steps: an alarm may name an older checkpoint than the newest; set "
                        "audit_checkpoints=True", cfg.checkpoint_every)
        elif self.budget is None and cfg.checkpoint_every and not self.solo and not cfg.audit_checkpoints and (
                not cfg.audit_every or cfg.checkpoint_every % cfg.audit_every):
            log.warning("sdcguard: checkpoints every %d steps are not all audit steps (audit every %s): an "
                        "alarm may name an older checkpoint than the newest; set audit_checkpoints=True",
                        cfg.checkpoint_every, cfg.audit_every or "never")


def _as_micro_batches(batch: Any, micro_batches: Sequence[Any] | None) -> Sequence[Any]:
    if (batch is None) == (micro_batches is None):
        raise ValueError("train_step takes either a batch or micro_batches=[...], not both")
    if micro_batches is not None:
        if len(micro_batches) == 0:
            raise ValueError("micro_batches must not be empty")
        return micro_batches
    return [batch]


_NEWEST_STATS: dict[str, CheckStats] = {}
"""A statistics file -> the statistics of the newest Guard writing it (the drill, or a loop that
builds a new Guard after an alarm, has several Guards on one spool and rank in one process)."""


def _flush_quietly(stats: CheckStats, spool: str | None) -> None:
    """A Guard's statistics flushed by its finalizer (collection or interpreter exit), unless a
    newer Guard owns the file: an older one collected late, or finalized after the newer one at
    exit (finalizers run newest first), must not put its stale figures back."""
    if spool is None or _NEWEST_STATS.get(str(stats_path(spool, stats.identity["rank"]))) is not stats:
        return
    try:
        stats.flush(spool, force=True)
    except Exception:  # noqa: BLE001 - a collection or the interpreter's exit must never fail
        pass
