"""The Guard: sdcguard's checks composed around the user's own training step (SPEC §3 order).

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
module, or — with a single process — a plain (or compiled) module: the checks that need other
replicas then do not run, which the Guard says once at start-up.
"""
from __future__ import annotations

import atexit
import logging
import math
import os
import time
import uuid
import weakref
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from . import recovery
from .checks.audit import Replayer
from .checks.commhook import GradientRecorder, ReduceHook, record_then_reduce
from .checks.determinism import check_replayable
from .checks.exchange import DIGEST_BYTES, Incoming, agree, gather_digests, gather_objects, serialize
from .checks.nonfinite import gather_norms, judge_nonfinite, nonfinite_local_ranks, sum_votes
from .checks.reduce_checksum import judge_checksum
from .checks.replay import PassResult, Payload, replaying, snapshot_buffers
from .checks.topology import Topology, gather_topology, identity
from .checks.verdict import Verdict
from .checks.weights import WeightCheck, fingerprint_weights, judge_weight_digests
from .config import Config
from .contract import spool
from .contract.alarm import make_alarm
from .contract.stats import CheckStats
from .errors import NonFiniteGradient, ReplayError, SDCDetected, UncheckedUpdate
from .fingerprint import triton_kernel as fingerprint_triton
from .step import Step

log = logging.getLogger("sdcguard")

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]
"""``loss_fn(module, micro_batch) -> scalar loss``: the forward pass and the loss, nothing else.
It is called with your model for the real pass and with the bare module for replays."""


class Guard:
    """sdcguard's checks for one model and its optimizer; one per training process."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        *,
        config: Config | None = None,
        scaler: torch.amp.GradScaler | None = None,
        reduce_hook: ReduceHook | None = None,
        reduce_state: Any = None,
    ) -> None:
        # Settings.
        self.model = model
        """What ``loss_fn`` is called with for the real pass (DDP, compiled, or plain)."""
        self.ddp, self.module, self.compiled = unwrap(model)
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        # A disabled GradScaler (what nanoGPT builds for float32/bfloat16) never skips a step: none.
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.config = config if config is not None else Config.from_env()
        self.group: dist.ProcessGroup | None = self.ddp.process_group if self.ddp is not None else None
        distributed = dist.is_available() and dist.is_initialized()
        if self.ddp is None and distributed and dist.get_world_size() > 1:
            raise TypeError("with more than one process, Guard needs the model wrapped in "
                            "DistributedDataParallel (or torch.compile of it)")
        self.device = _collective_device(self.group) if self.ddp is not None else _param_device(self.module)
        self.topology: Topology = (gather_topology(self.config, self.group, self.device) if self.ddp is not None
                                   else _solo_topology(self.config))
        self.solo = self.topology.world_size == 1
        self.named_parameters = list(self.module.named_parameters())
        self.recorder: GradientRecorder | None = None
        if self.ddp is not None:
            self.recorder = GradientRecorder([p for _, p in self.named_parameters], self.group, reduce_hook,
                                             reduce_state, seed=self.config.seed)
            self.ddp.register_comm_hook(self.recorder, record_then_reduce)
        elif reduce_hook is not None:
            raise TypeError("reduce_hook needs a DistributedDataParallel model")
        self.replayer = Replayer(
            module=self.ddp.module if self.ddp is not None else self.module, loss_fn=loss_fn,
            params=[(i, p) for i, (_, p) in enumerate(self.named_parameters) if p.requires_grad],
            names={i: n for i, (n, _) in enumerate(self.named_parameters)},
            topology=self.topology, group=self.group, device=self.device, seed=self.config.seed,
        )
        if self.config.audit_every and not self.solo:
            check_replayable(self.topology, _param_device(self.module))
        if _param_device(self.module).type == "cuda":  # compile and self-test the GPU kernel now, not mid-step
            fingerprint_triton.ready(_param_device(self.module))
        if not self.solo and any(True for _ in self.module.buffers()):
            # Eager even inside compiled code: it keeps Python state, which dynamo must not trace.
            hook = torch._dynamo.disable(self._remember_buffers) if self.compiled else self._remember_buffers
            self.replayer.module.register_forward_pre_hook(hook)
        optimizer.register_step_pre_hook(self._refuse_unchecked)
        optimizer.register_step_post_hook(self._count_update)
        # Internal state of the step in progress.
        self._recording: Step | None = None
        self._current: Step | None = None
        self._update_allowed = False
        self._audit_requests: set[int] = set()
        # Observed state.
        self.history = recovery.History()
        """What this run has verified: audits, weights, checkpoints (see ``sdcguard.recovery``)."""
        self.last_weights_digest: str | None = None
        self.updates_through: int | None = None
        """The last step whose update the weights include (a step done with unapplied counts:
        its weights are the step before's); what a checkpoint written now records as its step."""
        self.alarms_raised = 0
        self.nonfinite_skipped = 0
        """Steps skipped because of a reproduced NaN/Inf (``on_nonfinite="skip"``)."""
        self.stats = CheckStats(self.topology.identities[self.topology.rank], self.config.job)
        self._closed = False
        atexit.register(_close_at_exit, weakref.ref(self))
        self._log_configuration()

    # -- the step ------------------------------------------------------------------------------

    def step(self, step: int, *, micro_batches: int = 1, audit: bool | None = None) -> Step:
        """A checked step in your own loop (use as ``with guard.step(step) as s:``).

        ``audit=True`` makes this step an audit step on demand (e.g. before a checkpoint);
        every rank must pass the same value."""
        return Step(self, step, micro_batches, self.is_audit_step(step) if audit is None else bool(audit) and not self.solo)

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
        # A single replica has nobody to replay its batch: check 2 needs two ranks at least.
        if self.solo:
            return False
        every = self.config.audit_every
        if every > 0 and step % every == 0:
            return True
        return self.config.audits_checkpoints() and step % self.config.checkpoint_every == 0

    def is_weight_check_step(self, step: int) -> bool:
        every = self.config.weight_check_every
        return every > 0 and step % every == 0

    @property
    def last_verified_step(self) -> int | None:
        """The last step at which every check ran and passed (see ``recovery.History``)."""
        return self.history.last_verified_step

    @property
    def last_weights_verified_step(self) -> int | None:
        return self.history.last_weights_verified_step

    @property
    def checkpoints(self) -> list[tuple[int, str]]:
        """(step, path) of each checkpoint this run wrote or resumed from, oldest first."""
        return [(c.step, c.path) for c in self.history.checkpoints]

    def check_weights(self, step: int) -> None:
        """Run check 3 now on the weights after ``step``'s update (every rank must call it);
        raise SDCDetected if a replica differs."""
        self._raise_if(step, self.weights_verdict(step))

    def flush_stats(self) -> None:
        """Write this rank's check statistics to the spool now."""
        self.stats.flush(self.config.spool, force=True)

    def close(self) -> None:
        """End of training: flush the statistics (also done at interpreter exit)."""
        if not self._closed:
            self._closed = True
            self.flush_stats()

    def __enter__(self) -> Guard:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

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
        (``Config.keep_resume_points``). Returns the path, or None when rank 0 said not to save."""
        from .checkpoint import save_checkpoint
        written = save_checkpoint(self, path, step, state, when=when, model_key=model_key)
        return None if written is None else str(written)

    def load_checkpoint(self, path: str | os.PathLike[str], *, model_key: str = "model",
                        expect_step: int | None = None, expect_sha256: str | None = None) -> int:
        """Resume from a verified checkpoint (every rank calls); return the step it was taken at.

        The model, optimizer and scaler are loaded only after the file and the loaded weights
        match the manifest — and, with ``expect_step`` / ``expect_sha256`` (the alarm's
        ``last_good_checkpoint_step`` / ``_sha256``), only if it is the checkpoint the alarm
        named; the checkpoint then counts as this run's starting point."""
        from .checkpoint import load_checkpoint, read_manifest
        manifest = read_manifest(path, expect_step=expect_step, expect_sha256=expect_sha256)
        state = load_checkpoint(path, self.module, self.optimizer, self.scaler,
                                map_location=_param_device(self.module), model_key=model_key,
                                expect_step=int(manifest["step"]), expect_sha256=manifest["sha256"])
        step = int(manifest["step"])
        del state
        audited = manifest.get("audited_step")
        earlier = [recovery.Checkpoint(int(c["step"]), str(c["path"]), c.get("audited_step"), c.get("sha256"),
                                       c.get("kept_from"))
                   for c in manifest.get("earlier_checkpoints") or []
                   if _still_holds(c["path"], c["step"], c.get("sha256"))]
        self.history = recovery.History(
            last_audited_step=audited, last_weights_verified_step=step,
            last_reduction_verified_step=manifest.get("reduction_verified_step"),
            checkpoints=[*earlier, recovery.Checkpoint(step, str(path), audited, manifest["sha256"])])
        self.last_weights_digest = manifest["weight_digest"]
        self.updates_through = step
        return step

    # -- the phases of a step (called by Step) -------------------------------------------------

    def _begin(self, s: Step) -> None:
        if self._current is not None:
            raise RuntimeError(f"sdcguard: step {s.step} begun while step {self._current.step} is still open")
        self._current = s
        self._update_allowed = False
        if self.recorder is not None:
            self.recorder.begin_step(s.audit, s.step)
        self.stats.last_step = s.step

    def _end(self, s: Step, failed: BaseException | None) -> None:
        self._current = None
        self._update_allowed = False
        if isinstance(failed, NonFiniteGradient):
            self.updates_through = s.step  # done with, unapplied: the weights are the step before's
        if failed is not None:
            return
        if s.batches and not s.checked:
            raise RuntimeError(f"sdcguard: step {s.step} ended without s.check(): its gradients were never checked")
        if self.is_weight_check_step(s.step):
            self.check_weights(s.step)
        self.updates_through = s.step  # applied, or skipped by the scaler / on_nonfinite="skip"
        self.stats.last_verified_step = self.history.last_verified_step
        self.stats.steps += 1
        self.stats.flush(self.config.spool)

    def _count_update(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Optimizer step post-hook: the weights now include this step's update."""
        if self._current is not None:
            self.updates_through = self._current.step

    def _refuse_unchecked(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Optimizer step pre-hook: no update without a passing check in the step in progress."""
        if self._update_allowed:
            return None
        if self._current is None:
            raise UncheckedUpdate("sdcguard: optimizer.step() outside a checked step: run it inside "
                                  "`with guard.step(step) as s:` after s.check() (or use guard.train_step)")
        raise UncheckedUpdate(f"sdcguard: optimizer.step() at step {self._current.step} before s.check() "
                              "passed: the gradients are unchecked, the update is refused")

    # -- the checks ----------------------------------------------------------------------------

    def _check(self, s: Step) -> None:
        """Checks 1 and 2 (and 3 before the update on audit steps), in SPEC order."""
        payload = s.payload()
        if self.solo:
            self._check_solo(s)
        elif s.audit:
            self._audit(s, payload)  # checks 1 and 4, then 2 and 3 agreed on in one all-reduce
        else:
            self._check_nonfinite(s, payload)

    def _check_solo(self, s: Step) -> None:
        """One replica: only the local non-finite check can run, and it cannot be confirmed."""
        started = time.perf_counter()
        if self.recorder is not None:
            finite = bool(torch.isfinite(self.recorder.rows(self.device)).all())
        else:
            finite = all(bool(torch.isfinite(p.grad).all()) for _, p in self.named_parameters if p.grad is not None)
        self.stats.timed("nonfinite", started)
        if not finite:
            self._nonfinite_reproduced(s, {0: _first_nonfinite(s.losses)}, confirmed=False)

    def _check_nonfinite(self, s: Step, payload: Payload) -> bool:
        """Checks 1a, 1b and 4: one all-reduce of two scalars (``reduce_checksum``); the per-rank
        values are gathered only when it finds something non-finite. Returns whether every
        gradient was finite (else the step was judged, and raised or will not be applied)."""
        started = time.perf_counter()
        x, y = sum_votes(self.recorder.vote(self.device), self.group)  # the common case: 16 bytes
        self.stats.timed("nonfinite", started)
        if not (math.isfinite(x) and math.isfinite(y)):
            if self._reduced_gradients_finite():
                # Finite gradients whose float32 norm overflowed (elements past ~1e19): a NaN/Inf
                # anywhere in a local gradient would have reached the reduced one. Nothing to
                # judge; check 4's bound is unknown for this step, so it does not run.
                log.warning("sdcguard: step %d: gradient norms overflowed float32; check 4 skipped", s.step)
                return True
            self._judge_nonfinite(s, payload, gather_norms(self.recorder.rows(self.device), self.group))
            return False
        if self.recorder.checks_reduction:
            started = time.perf_counter()
            verdict = judge_checksum(x, y, self.recorder.shape())
            self.stats.timed("reduce_checksum", started)
            self._raise_if(s.step, verdict)
            self.history.last_reduction_verified_step = s.step
        return True

    def _reduced_gradients_finite(self) -> bool:
        """Every rank's reduced gradients (now in ``.grad``) checked element by element, agreed."""
        finite = all(bool(torch.isfinite(p.grad).all()) for _, p in self.named_parameters if p.grad is not None)
        flag = torch.tensor([1.0 if finite else 0.0], dtype=torch.float64, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item() == 1.0)

    def _judge_nonfinite(self, s: Step, payload: Payload, norms: list[list[float]]) -> bool:
        """From every rank's ``[local, reduced]`` norms: raise for check 1a (a NaN/Inf that does
        not reproduce on another node) or 1b; or, when every non-finite local gradient reproduces,
        treat it as the GradScaler's overflow (the scaler skips) or the data's (raise
        NonFiniteGradient, or skip). Returns whether the step will not be applied."""
        bad = nonfinite_local_ranks(norms)
        if not bad:
            self._raise_if(s.step, judge_nonfinite(norms))  # 1b, or an overflowed sum of finite norms
            return False
        confirmation = self.replayer.confirm_nonfinite(bad, payload, self._scale)
        self._raise_if(s.step, confirmation.verdict)
        if self.scaler is not None:
            s.skipped = True  # an honest overflow: the scaler skips this step
            return True
        self._nonfinite_reproduced(s, confirmation.reproduced, confirmed=True)
        return True

    def _nonfinite_reproduced(self, s: Step, ranks: dict[int, int | None], confirmed: bool) -> None:
        """A NaN/Inf that is the data's or the model's, not the hardware's: never an alarm."""
        if self.scaler is not None:
            s.skipped = True
            return
        error = NonFiniteGradient(step=s.step, ranks=ranks, confirmed=confirmed)
        if self.config.on_nonfinite != "skip":
            raise error
        log.warning("%s; skipping the step (on_nonfinite=skip)", error)
        self.nonfinite_skipped += 1
        for _, p in self.named_parameters:  # optimizer.step() then changes nothing
            p.grad = None
        s.skipped = True

    def _audit(self, s: Step, payload: Payload) -> None:
        """Checks 1 and 4 as on every step (a NaN step is not replayed), then checks 2 and 3 with
        one collective besides the batch transfer between ring neighbours: this rank's batch
        leaves for its replayer with the digest of its own pass, the weights are fingerprinted
        while it travels (before the replay, as the SPEC says), the neighbour's batch is replayed
        and compared locally, and one 16-byte all-reduce says whether every rank's weights agree
        and its replay matched. Only when it says no are the digests gathered and judged —
        weights, then replays — so that a weight fault is not taken for a compute fault."""
        step = s.step
        if not self._check_nonfinite(s, payload):  # checks 1 and 4 first: nothing to replay in a NaN step
            return
        started = time.perf_counter()
        own = PassResult(list(s.loss_fps), self.recorder.fingerprints())
        own_digest = own.digest()
        incoming = self.replayer.post_batch(serialize(payload), own_digest)
        weights_started = time.perf_counter()
        weights = fingerprint_weights(self.named_parameters)
        self.stats.timed("weights", weights_started)
        started += time.perf_counter() - weights_started  # the replay's time leaves the weights' out
        replayed, failure = self._replay_neighbour(incoming)
        replay_digest = replayed.digest() if replayed is not None else bytes(DIGEST_BYTES)
        matched = failure is None and replay_digest == incoming.note
        if agree(weights.digest, self.device, self.group, veto=not matched):
            self._weights_verified(step - 1, weights)  # the weights before this step's update
            self._audited(step)
            verdict = None
        else:
            digests = gather_digests([weights.digest, own_digest, replay_digest], self.device, self.group)
            self._raise_if(step, self._judge_weights(step - 1, weights, [d[0] for d in digests]))
            self._raise_if_replays_failed(step, failure)
            verdict = self.replayer.judge(own, replayed, [d[1:] for d in digests], payload, self._scale)
            if verdict is None:
                self._audited(step)
        self.stats.timed("replay", started)
        self._raise_if(step, verdict)

    def _audited(self, step: int) -> None:
        self.history.last_audited_step = step

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
        said = gather_objects(None if failure is None else f"{type(failure).__name__}: {failure}", self.group, self.device)
        failures = {rank: msg for rank, msg in enumerate(said) if msg is not None}
        if failures:
            raise ReplayError(step, failures) from failure

    @property
    def _scale(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        return self.scaler.scale if self.scaler is not None else None

    def _remember_buffers(self, module: torch.nn.Module, args: Any) -> None:
        """Forward pre-hook: the buffers this micro-batch's forward sees (after DDP's broadcast),
        recorded where a replay may need them (audit steps; every step with a GradScaler)."""
        s = self._recording
        if s is None or replaying() or not (s.audit or self.scaler is not None):
            return
        if len(s.buffers) == len(s.batches):
            s.buffers.append(snapshot_buffers(module))

    def weights_verdict(self, step: int) -> Verdict | None:
        """Check 3 on the weights after ``step``'s update; on success remember the step and digest."""
        started = time.perf_counter()
        mine = fingerprint_weights(self.named_parameters)
        if self.solo or agree(mine.digest, self.device, self.group):  # the common case: 16 bytes
            self._weights_verified(step, mine)
            verdict = None
        else:
            digests = [d for [d] in gather_digests([mine.digest], self.device, self.group)]
            verdict = self._judge_weights(step, mine, digests)
        self.stats.timed("weights", started)
        return verdict

    def _judge_weights(self, step: int, mine: WeightCheck, digests: list[bytes]) -> Verdict | None:
        verdict = judge_weight_digests(mine, digests, self.topology.rank, self.group, self.device)
        if verdict is None:
            self._weights_verified(step, mine)
        return verdict

    def _weights_verified(self, step: int, mine: WeightCheck) -> None:
        """Every replica held this rank's weights ``mine`` after ``step``'s update."""
        if self.history.last_weights_verified_step is None or step > self.history.last_weights_verified_step:
            self.history.last_weights_verified_step = step
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
        fields = recovery.recovery_fields(verdict.check, step, self.history)
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
            **fields,
            **({"drill": True} if self.config.drill else {}),
        )
        wait = self.config.publish_wait() if self.config.spool else 0.0
        if topo.rank == reporter:
            log.error("sdcguard alarm: %s", SDCDetected(alarm=record))
            if self.config.spool:
                spool.write_alarm(self.config.spool, record)
                if wait and not spool.wait_published(self.config.spool, record["id"], timeout=wait):
                    log.error("sdcguard: the sidecar has not confirmed alarm %s within %.0f s (%s); it stays in "
                              "the spool %s and the sidecar keeps trying while the pod terminates",
                              record["id"], wait, spool.state(self.config.spool, record["id"]), self.config.spool)
        if wait and not self.solo:
            dist.barrier(group=self.group)  # no rank leaves (and ends the job) before the reporter's wait
        self.stats.alarms += 1
        self.stats.flush(self.config.spool, force=True)
        return record

    def _log_configuration(self) -> None:
        if self.topology.rank != 0:
            return
        cfg, topo = self.config, self.topology
        if self.solo:
            log.warning("sdcguard: a single replica: only the local non-finite check runs (no replay audit, "
                        "no weight comparison), and a NaN/Inf cannot be confirmed as the hardware's")
        log.info("sdcguard: %d ranks, %d per node, audit every %s, weight check every %s, spool %s",
                 topo.world_size, topo.ranks_per_node, cfg.audit_every or "never",
                 cfg.weight_check_every or "never", cfg.spool or "(none)")
        if self.recorder is not None and not self.solo and not self.recorder.checks_reduction:
            log.warning("sdcguard: the reduce hook does not declare averages_like_ddp (a compression hook?): "
                        "check 4 (reduce-checksum) is off, a finite fault inside the all-reduce goes unseen")
        if cfg.checkpoint_every and not self.solo and not cfg.audit_checkpoints and (
                not cfg.audit_every or cfg.checkpoint_every % cfg.audit_every):
            log.warning("sdcguard: checkpoints every %d steps are not all audit steps (audit every %s): an "
                        "alarm may name an older checkpoint than the newest; set audit_checkpoints=True",
                        cfg.checkpoint_every, cfg.audit_every or "never")


def unwrap(model: torch.nn.Module) -> tuple[DistributedDataParallel | None, torch.nn.Module, bool]:
    """(the DDP wrapper or None, the bare module, whether torch.compile is involved) of
    DDP, ``torch.compile(ddp)``, ``DDP(torch.compile(module))`` or a plain module."""
    ddp, compiled, m = None, False, model
    while True:
        if isinstance(m, DistributedDataParallel):
            ddp, m = m, m.module
        elif isinstance(getattr(m, "_orig_mod", None), torch.nn.Module):  # torch.compile's wrapper
            compiled, m = True, m._orig_mod
        else:
            return ddp, m, compiled


def _still_holds(path: str, step: int, sha256: str | None) -> bool:
    """Whether ``path`` still holds the checkpoint of ``step`` (a path reused by a later save
    holds another step now)."""
    from .checkpoint import CheckpointError, read_manifest
    try:
        read_manifest(path, expect_step=step, expect_sha256=sha256)
        return True
    except (CheckpointError, OSError, ValueError):
        return False


def _first_nonfinite(losses: list[torch.Tensor]) -> int | None:
    return next((i for i, loss in enumerate(losses) if not bool(torch.isfinite(loss).all())), None)


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


def _param_device(module: torch.nn.Module) -> torch.device:
    first = next(module.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


def _solo_topology(config: Config) -> Topology:
    return Topology(0, 1, 1, {0: identity(0, config.pod, config.node, config.pod_uid)}, run_id=uuid.uuid4().hex[:12], threads={0: torch.get_num_threads()})


def _close_at_exit(ref: "weakref.ref[Guard]") -> None:
    guard = ref()
    if guard is not None:
        try:
            guard.close()
        except Exception:  # noqa: BLE001 - the interpreter is going away; never fail its exit
            pass
