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
do not run, which the Guard says once at start-up.
"""
from __future__ import annotations

import logging
import os
import sys
import uuid
import weakref
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from . import recovery
from .checks.audit import Replayer
from .checks.commhook import GradientRecorder, ReduceHook, record_then_reduce
from .checks.determinism import check_replayable
from .checks.replay import replaying, snapshot_buffers
from .checks.topology import Topology, gather_topology, identity
from .config import Config
from .contract.stats import CheckStats, stats_path
from .errors import NonFiniteGradient
from .fingerprint import triton_kernel as fingerprint_triton
from .gate import UpdateGate
from .reporting import AlarmReporter
from .step import Step
from .verification import Verifier

if TYPE_CHECKING:
    from .sharding.verifier import ShardedVerifier

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
        self.compiled = self.compiled or _compiles_inside(self.module)
        self.sharded = _is_fsdp(self.module)
        """FSDP2 (``fully_shard``) at the root: the sharded checks (``sdcguard.sharding``) run."""
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        # A disabled GradScaler (what nanoGPT builds for float32/bfloat16) never skips a step: none.
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.config = config if config is not None else Config.from_env()
        self.group: dist.ProcessGroup | None = self.ddp.process_group if self.ddp is not None else None
        distributed = dist.is_available() and dist.is_initialized()
        if self.ddp is None and not self.sharded and distributed and dist.get_world_size() > 1:
            raise TypeError("with more than one process, Guard needs the model wrapped in "
                            "DistributedDataParallel (or torch.compile of it), or sharded with FSDP2's fully_shard")
        if self.sharded and (reduce_hook is not None or not distributed):
            raise TypeError("sdcguard: an FSDP2 model needs a process group, and takes no DDP reduce_hook")
        self.device = (_collective_device(self.group) if self.ddp is not None or self.sharded
                       else _param_device(self.module))
        self.topology: Topology = (gather_topology(self.config, self.group, self.device)
                                   if self.ddp is not None or self.sharded else _solo_topology(self.config))
        self.solo = self.topology.world_size == 1
        self._replays = not self.solo
        """Check 2 can run: more than one rank (a sharded model's ranks replay each other's batches)."""
        self.named_parameters = list(self.module.named_parameters())
        # The parts.
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
        if self.config.audit_every and self._replays:
            check_replayable(self.topology, _param_device(self.module))
        if _param_device(self.module).type == "cuda":  # compile and self-test the GPU kernel now, not mid-step
            fingerprint_triton.ready(_param_device(self.module))
        if not self.solo and any(True for _ in self.module.buffers()):
            # Eager even inside compiled code: it keeps Python state, which dynamo must not trace.
            hook = torch._dynamo.disable(self._remember_buffers) if self.compiled else self._remember_buffers
            self.replayer.module.register_forward_pre_hook(hook)
        self.gate = UpdateGate(optimizer)
        """Refuses an update before its step's checks passed; counts the updates the weights hold."""
        self.stats = CheckStats(self.topology.identities[self.topology.rank], self.config.job)
        self.verifier: Verifier | ShardedVerifier
        if self.sharded:  # the reduce-scatter and all-reduce hooks go on every fully_shard unit here
            from .sharding.verifier import ShardedVerifier
            self.verifier = ShardedVerifier(model=self.module, named_parameters=self.named_parameters,
                                            loss_fn=loss_fn, topology=self.topology, device=self.device,
                                            stats=self.stats, seed=self.config.seed)
        else:
            self.verifier = Verifier(recorder=self.recorder, replayer=self.replayer, topology=self.topology,
                                     group=self.group, device=self.device, named_parameters=self.named_parameters,
                                     stats=self.stats)
        self.reporter = AlarmReporter(self.config, self.topology, self.stats, self.group)
        # The step in progress, while one is.
        self.recording: Step | None = None
        """The step whose forward passes run now (the buffers hook records into it)."""
        self.nonfinite_skipped = 0
        """Steps skipped because of a reproduced NaN/Inf (``on_nonfinite="skip"``)."""
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
        return Step(self, step, micro_batches, self.is_audit_step(step) if audit is None else bool(audit) and self._replays)

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
        every = self.config.audit_every
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

    def flush_stats(self) -> None:
        """Write this rank's check statistics to the spool now."""
        self.stats.flush(self.config.spool, force=True)

    def close(self) -> None:
        """End of training: flush the statistics (also done when the Guard is collected, or at
        interpreter exit)."""
        if not self._closed:
            self._closed = True
            self._flush_at_end.detach()
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
        (``Config.keep_resume_points``). Returns the path, or None when rank 0 said not to save.

        A sharded (FSDP2) model is saved as a DCP directory at ``path`` (``sdcguard.sharding.dcp``):
        every rank writes its shards of the model and optimizer; ``state`` then holds only your
        extra entries (e.g. ``{"scheduler": scheduler}``), loaded back by ``load_checkpoint(...,
        state=)``. With one replica (pure FSDP) check 3 has nothing to compare: the checkpoint is
        written, its manifest says its weights were not cross-checked, and no alarm names it."""
        from . import checkpoint
        if not checkpoint.rank0_says(bool(when), self.device, self.group, self.solo):
            return None
        if self.alarms_raised:
            raise checkpoint.CheckpointError(
                f"refusing to write {path}: this run raised {self.alarms_raised} alarm(s) and its state "
                "is suspect; resume from the last good checkpoint instead")
        step = checkpoint.manifest_step(self.updates_through, step, path)
        self.check_weights(step)  # raises SDCDetected on every rank when a replica differs
        if self.sharded:
            from .sharding import dcp
            self.history = dcp.save(path, **self._sharded_parts(state, model_key), facts=self._sharded_facts(step),
                                    keep=self.config.keep_resume_points)
            return str(path)
        if state is None:
            state = {"step": step, model_key: self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                     "scaler": self.scaler.state_dict() if self.scaler is not None else None}
        facts = checkpoint.Facts(
            step=step, weight_digest=self.last_weights_digest, parameters=[n for n, _ in self.named_parameters],
            model_key=model_key, history=self.history, replicas=self.topology.world_size, run_id=self.topology.run_id)
        self.history = checkpoint.save(path, state, facts, keep=self.config.keep_resume_points,
                                       writer=self.topology.rank == 0, device=self.device,
                                       group=None if self.solo else self.group)
        return str(path)

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
        from . import checkpoint
        if self.sharded:
            from .sharding import dcp
            manifest, digest = dcp.load(path, **self._sharded_parts(state, model_key), layout=self.verifier.layout,
                                        expect_step=expect_step, expect_sha256=expect_sha256)
            step = int(manifest["step"])
            self.resumed(step, dcp.resumed_history(path, manifest), digest if manifest.get("weights_verified") else None)
            return step
        if state is not None:
            raise TypeError("load_checkpoint(state=) is for sharded models; with DDP, sdcguard.load_checkpoint(path, "
                            "module, optimizer) returns the dict you saved")
        manifest = checkpoint.read_manifest(path, expect_step=expect_step, expect_sha256=expect_sha256)
        checkpoint.load_checkpoint(path, self.module, self.optimizer, self.scaler,
                                   map_location=_param_device(self.module), model_key=model_key,
                                   expect_step=int(manifest["step"]), expect_sha256=manifest["sha256"])
        step = int(manifest["step"])
        self.resumed(step, checkpoint.resumed_history(path, manifest), manifest["weight_digest"])
        return step

    def resumed(self, step: int, history: recovery.History, weights_digest: str | None) -> None:
        """The run starts from a checkpoint of ``step`` that the caller loaded and verified (a
        framework's own load): it inherits that checkpoint's ``history``, check 3's next
        comparison starts from ``weights_digest``, and the update count from ``step``."""
        self.history = history
        self.verifier.last_weights_digest = weights_digest
        self.gate.resumed_at(step)

    # -- the phases of a step (called by Step) -------------------------------------------------

    def begin(self, s: Step) -> None:
        self.gate.open(s.step)
        if self.recorder is not None:
            self.recorder.begin_step(s.audit, s.step)
        elif self.sharded:
            self.verifier.begin_step(s.step, s.audit)
        self.stats.last_step = s.step

    def verify(self, s: Step) -> None:
        """Checks 1 and 4 (and 2 and 3 on audit steps) before any update: raise on every rank
        alike, or let the update through."""
        outcome = self.verifier.before_update(s.record(), self._scale)
        if outcome.verdict is not None:
            self.reporter.raise_alarm(s.step, outcome.verdict, self.history)
        if outcome.nonfinite is not None:
            self._nonfinite_reproduced(s, outcome.nonfinite, outcome.confirmed)
        self.gate.allow()

    def end(self, s: Step, failed: BaseException | None) -> None:
        # A NaN/Inf refused as the data's is done with, unapplied: the weights are the step before's.
        self.gate.close(done=failed is None or isinstance(failed, NonFiniteGradient))
        if failed is not None:
            return
        if s.batches and not s.checked:
            raise RuntimeError(f"sdcguard: step {s.step} ended without s.check(): its gradients were never checked")
        if self.is_weight_check_step(s.step):
            self.check_weights(s.step)
        self.stats.last_verified_step = self.history.last_verified_step
        self.stats.steps += 1
        self.stats.flush(self.config.spool)

    def _nonfinite_reproduced(self, s: Step, ranks: dict[int, int | None], confirmed: bool) -> None:
        """A NaN/Inf that is the data's or the model's, not the hardware's: never an alarm. With
        an enabled GradScaler an honest overflow: the scaler skips the step."""
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

    @property
    def _scale(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        return self.scaler.scale if self.scaler is not None else None

    def _remember_buffers(self, module: torch.nn.Module, args: Any) -> None:
        """Forward pre-hook: the buffers this micro-batch's forward sees (after DDP's broadcast),
        recorded where a replay may need them (audit steps; every step with a GradScaler)."""
        s = self.recording
        if s is None or replaying() or not (s.audit or self.scaler is not None):
            return
        if len(s.buffers) == len(s.batches):
            s.buffers.append(snapshot_buffers(module))

    # -- sharded checkpoints (sharding/dcp.py): what the Guard hands them ---------------------

    def _sharded_parts(self, state: dict[str, Any] | None, model_key: str) -> dict[str, Any]:
        """What a sharded checkpoint saves or loads besides the step: the model, the optimizer, the
        scaler, and your extra entries (``state``, loaded back into that same dict)."""
        return {"model": self.module, "optimizer": self.optimizer, "scaler": self.scaler, "model_key": model_key,
                "named_parameters": self.named_parameters, "extra": state if state is not None else {},
                "device": self.device, "zero_step": self.gate.zero_update}

    def _sharded_facts(self, step: int) -> Any:
        from .sharding import dcp
        layout = self.verifier.layout
        return dcp.Facts(step=step, history=self.history, layout=layout, weights_verified=layout.hsdp,
                         weight_digest=self.last_weights_digest if layout.hsdp else None,
                         parameters=[n for n, _ in self.named_parameters], run_id=self.topology.run_id)

    def _log_configuration(self) -> None:
        if self.topology.rank != 0:
            return
        cfg, topo = self.config, self.topology
        if self.sharded:
            for line in self.verifier.plan_lines():
                log.warning("sdcguard (sharded): %s", line)
            log.info("sdcguard: %d ranks, weight check every %s, spool %s", topo.world_size,
                     cfg.weight_check_every or "never", cfg.spool or "(none)")
            return
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


def _compiles_inside(module: torch.nn.Module) -> bool:
    """Whether a submodule runs compiled: ``torch.compile(block)`` put in the tree, or
    ``block.compile()`` in place (torchtitan compiles each block so, before ``fully_shard``)."""
    return any(getattr(m, "_compiled_call_impl", None) is not None or isinstance(getattr(m, "_orig_mod", None), torch.nn.Module)
               for m in module.modules())


def _is_fsdp(module: torch.nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to the root (no FSDP import for a model that never used it)."""
    if "torch.distributed.fsdp" not in sys.modules:
        return False
    from torch.distributed.fsdp import FSDPModule
    return isinstance(module, FSDPModule)


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
