"""sdcguard in a torchtitan (0.3.0) training run, enabled by configuration.

torchtitan builds its trainer from the config's owner class (``Trainer.Config.build()``), and its
extensions subclass ``Trainer`` with a ``Config`` of their own (``experiments/torchft``,
``graph_trainer``); :class:`GuardedTrainer` is such a subclass. Its config is torchtitan's with one
section more, ``sdcguard`` (:class:`SDCGuardConfig`, also on the command line:
``--sdcguard.audit-every 10``)::

    from sdcguard.integrations.torchtitan import GuardedTrainer
    config = GuardedTrainer.Config(model_spec=..., training=..., parallelism=...)  # was Trainer.Config
    trainer = config.build()          # torchtitan's Trainer, plus the Guard on the sharded model
    trainer.train()

or ``guarded(llama3_debugmodel())`` for a config a registry function returns.

torchtitan has no hook around its step, so the patch point is ``Trainer.train_step``, the method its
own experiments override (``experiments/torchft``, ``graph_trainer``): :meth:`GuardedTrainer.train_step` is
torchtitan's, line for line (the token count, the micro-batches, ``clip_grad_norm_``, the
optimizers and schedulers, the metrics), with the forward and backward of each micro-batch run
through ``guard.step`` / ``s.backward`` and ``s.check()`` before the clipping, so an update is
never applied unchecked. The Guard is built in ``__init__`` after torchtitan parallelized the model
(``fully_shard`` on each block and the root) and built its optimizers: sdcguard's sharded checks
(``sdcguard.sharding``) then read torchtitan's mesh. A check that fires raises ``SDCDetected``
from ``train_step`` on every rank alike; ``Trainer.train`` lets it through, and torchtitan's
``train.py`` closes the trainer and re-raises: the run stops, the alarm is in the spool.

Checkpoints: torchtitan's checkpointer writes its DCP folders ``step-N`` itself; with
``sdcguard.check_checkpoints`` (default on) check 3 runs before each save torchtitan makes (a
replica that differs raises ``SDCDetected`` and nothing is written; no save after an alarm), and
once every rank's files are written rank 0 adds sdcguard's sharded manifest beside them
(``sharding/dcp_manifest.py``: every file's SHA-256, each shard's fingerprint digest and ranks, the
mesh, the step, the audit it is covered by); the checkpoint enters the run's history, so an alarm
can name it as ``last_good_checkpoint``. Before torchtitan loads a folder (a resume), it is checked
against its manifest (``sdcguard verify-checkpoint`` checks one offline), and after the load every
rank's shards against the digest recorded: a folder that differs is refused on every rank.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from ..config import Config as GuardConfig
from ..checkpoint import CheckpointError
from ..manifest import resumed_history, verification_fields
from ..errors import ConfigurationError

try:
    from torchtitan.components.loss import IGNORE_INDEX
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.trainer import Trainer
except ImportError as exc:  # pragma: no cover - the extra is not installed
    raise ImportError("sdcguard.integrations.torchtitan needs torchtitan (pip install 'sdcguard[torchtitan]')") from exc

__all__ = ["SDCGuardConfig", "GuardedTrainer", "guarded"]

log = logging.getLogger("sdcguard")


@dataclass(kw_only=True, slots=True)
class SDCGuardConfig:
    """The ``sdcguard`` section of a torchtitan job config. ``SDCGUARD_*`` variables (the
    operator's webhook sets them) win over these values, as ``sdcguard.Config.from_env``."""

    enable: bool = True
    """Build the Guard; off: torchtitan's own ``train_step`` runs."""
    audit_every: int = 10
    """Check 2 (the mesh replays another node's batches) on steps divisible by this; 0: never."""
    weight_check_every: int = 5
    """Check 3 (each shard across its replicas, HSDP) after the update of these steps; 0: never."""
    check_checkpoints: bool = True
    """Check 3 before every checkpoint torchtitan saves; none after an alarm."""
    spool: str | None = None
    """Where alarms and statistics go (``SDCGUARD_SPOOL`` wins)."""
    inject: list[str] = field(default_factory=list)
    """Faults to plant (drills and tests), ``KIND:rank=R:step=S[...]`` (``sdcguard.faults.sharded``)."""
    fault_param: str = "layers.0.feed_forward.w1.weight"
    """The parameter gradient / weight / reduction faults strike, unless a fault names its own."""
    fault_site: str = "layers.0.feed_forward"
    """The module whose output forward faults strike, unless a fault names its own."""


class GuardedTrainer(Trainer):
    """torchtitan's ``Trainer`` with sdcguard's checks in every step (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        sdcguard: SDCGuardConfig = field(default_factory=SDCGuardConfig)

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.guard: Any = None
        self.injector: Any = None
        settings = config.sdcguard
        if not settings.enable:
            return
        _require_checkable(self)
        import sdcguard
        defaults = {"audit_every": settings.audit_every, "weight_check_every": settings.weight_check_every}
        if settings.spool is not None:
            defaults["spool"] = settings.spool
        self.guard = sdcguard.Guard(self.model_parts[0], self.optimizers, self._loss_of,
                                    config=GuardConfig.from_env(**defaults))
        if settings.inject:
            from ..faults.sharded import ShardedFaultInjector
            self.injector = ShardedFaultInjector(settings.inject, dist.get_rank())
            self.injector.install(self.guard, param=settings.fault_param, site=settings.fault_site)
        if settings.check_checkpoints and self.checkpointer.enable:
            self._cover_checkpoints()

    # -- the step --------------------------------------------------------------------------------

    def train_step(self, data_iterator: Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]) -> None:
        """torchtitan's ``Trainer.train_step`` with each micro-batch's forward and backward run
        through the Guard, and the checks before the clipping and the update."""
        guard = self.guard
        if guard is None:
            return super().train_step(data_iterator)
        if self.injector is not None:
            self.injector.begin_step(self.step)
        self.optimizers.zero_grad(set_to_none=self.config.training.disable_cuda_graphs)
        lr_metrics = self.lr_schedulers.get_metrics()
        should_log = self.metrics_processor.should_log(self.step)
        parallel_dims = self.parallel_dims
        microbatches: list[tuple[dict[str, torch.Tensor], torch.Tensor]] = []
        local_valid_tokens = torch.tensor(0, dtype=torch.int64)
        for _ in range(self.gradient_accumulation_steps):
            input_dict, labels = next(data_iterator)
            local_valid_tokens += (labels != IGNORE_INDEX).sum()
            microbatches.append((input_dict, labels))
        if parallel_dims.dp_enabled:
            global_valid_tokens = dist_utils.dist_sum_tensor(local_valid_tokens.to(self.device),
                                                             parallel_dims.get_mesh("batch"))
        else:
            global_valid_tokens = local_valid_tokens.to(self.device)

        accumulated_loss: torch.Tensor | None = None
        with guard.step(self.step, micro_batches=len(microbatches)) as s:
            for input_dict, labels in microbatches:
                micro = ({k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in input_dict.items()},
                         labels.to(self.device), global_valid_tokens)
                # torchtitan's loss is already this rank's share (a sum over the global token count):
                # its backward, unweighted
                loss = s.backward(micro)
                accumulated_loss = loss.clone() if accumulated_loss is None else accumulated_loss.add_(loss)
            s.check()  # checks 1 and 4 (2 and 3 on audit steps) before any update, on every rank alike
            grad_norm = dist_utils.clip_grad_norm_(
                [p for m in self.model_parts for p in m.parameters()], self.config.training.max_norm,
                foreach=True, pp_mesh=parallel_dims.get_optional_mesh("pp"), ep_enabled=parallel_dims.ep_enabled)
            self.checkpointer.maybe_wait_for_staging()
            self.optimizers.step()
            self.lr_schedulers.step()
        # leaving the guarded step ran check 3 on weight-check steps
        if should_log:
            assert accumulated_loss is not None
            self._log_step(accumulated_loss, local_valid_tokens, global_valid_tokens, grad_norm, lr_metrics)

    def _loss_of(self, module: torch.nn.Module, micro: tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]
                 ) -> torch.Tensor:
        """Forward and loss of one micro-batch, as ``Trainer._forward_backward_body`` computes
        them (sdcguard runs the backward, and replays this on other ranks)."""
        from ..checks.replay import replaying
        input_dict, labels, global_valid_tokens = micro
        seen = self.ntokens_seen
        inputs, labels, extra_kwargs = self.post_dataloading_process(dict(input_dict), labels)
        if replaying():  # another rank's batch: not tokens this run trained on
            self.ntokens_seen = seen
        with self.train_context():
            pred = module(inputs, **extra_kwargs)
            loss_kwargs = {"positions": extra_kwargs["positions"]} if "positions" in extra_kwargs else {}
            loss, _ = self.loss_fn(pred, labels, global_valid_tokens, **loss_kwargs)
        return loss

    def _log_step(self, accumulated_loss: torch.Tensor, local_valid_tokens: torch.Tensor,
                  global_valid_tokens: torch.Tensor, grad_norm: torch.Tensor, lr_metrics: dict[str, Any]) -> None:
        """The metrics of ``Trainer.train_step``, computed as it computes them."""
        import math
        parallel_dims = self.parallel_dims
        if parallel_dims.dp_cp_enabled:
            loss_mesh = parallel_dims.get_optional_mesh("loss")
            local_avg_loss = accumulated_loss * global_valid_tokens / local_valid_tokens
            global_avg_loss, global_max_loss, global_ntokens_seen = (
                dist_utils.dist_sum(accumulated_loss, loss_mesh), dist_utils.dist_max(local_avg_loss, loss_mesh),
                dist_utils.dist_sum(torch.tensor(self.ntokens_seen, dtype=torch.int64, device=self.device), loss_mesh))
        else:
            global_avg_loss = global_max_loss = float(accumulated_loss.item())
            global_ntokens_seen = self.ntokens_seen
        if not math.isfinite(global_avg_loss):
            raise RuntimeError(f"Loss is not finite (global_avg_loss={global_avg_loss}) at step {self.step}. "
                               "Stopping training.")
        self.metrics_processor.log(self.step, global_avg_loss, global_max_loss, float(grad_norm.item()),
                                   extra_metrics={"n_tokens_seen": global_ntokens_seen, **lr_metrics})

    # -- checkpoints -----------------------------------------------------------------------------

    def _cover_checkpoints(self) -> None:
        """Check 3 before each save torchtitan's checkpointer makes (none after an alarm) and
        sdcguard's manifest once its files are written; a folder verified against its manifest
        before torchtitan loads it."""
        checkpointer = self.checkpointer
        save, load = checkpointer.save, checkpointer.load
        trainer = self

        def checked_save(curr_step: int, last_step: bool = False) -> bool:
            due = checkpointer._should_save(curr_step, last_step)  # the same answer on every rank
            if due:
                if trainer.guard.alarms_raised:
                    raise CheckpointError(f"sdcguard: refusing torchtitan's checkpoint of step {curr_step}: this "
                                          f"run raised {trainer.guard.alarms_raised} alarm(s) and its state is suspect")
                trainer.guard.check_weights(curr_step)  # raises SDCDetected on every rank when a replica differs
            saved = save(curr_step, last_step=last_step)
            if due:
                checkpointer.maybe_wait_for_saving()  # async modes: the files must be complete to be hashed
                trainer._write_manifest(curr_step)
            return saved

        def verified_load(step: int = -1) -> bool:
            folder = trainer._load_folder(step)
            manifest = None
            if folder is not None:
                manifest = _verify_everywhere(folder, trainer.guard.device)
            loaded = load(step)
            if loaded and manifest is not None:
                trainer._resumed(folder, manifest)
            return loaded

        checkpointer.save = checked_save  # type: ignore[method-assign]
        checkpointer.load = verified_load  # type: ignore[method-assign]

    def _write_manifest(self, step: int) -> None:
        """sdcguard's manifest for the DCP folder torchtitan just wrote (collective): every file's
        SHA-256, each shard's fingerprint digest and its ranks, the mesh, the step, the audits it
        is covered by; the checkpoint then counts in the run's history (an alarm may name it)."""
        from .. import recovery
        from ..checks.exchange import broadcast_json, gather_objects
        from ..contract.alarm import now_rfc3339
        from ..contract.spool import write_json_atomic
        from ..sharding import dcp_manifest

        guard = self.guard
        folder = Path(self.checkpointer._create_checkpoint_id(step))
        names, mine = self._model_report()
        reports = gather_objects(mine, None, guard.device)
        history, layout = guard.history, guard.layout.mesh
        verified = layout.hsdp and guard.last_weights_verified_step == step
        plan = recovery.plan_save(history, str(folder), step, keep=False)  # torchtitan writes a new folder per step
        outcome: dict[str, Any] = {"failure": None, "sha256": None}
        if dist.get_rank() == 0:
            try:
                files = {name: dcp_manifest.sha256_file(folder / name) for name in dcp_manifest.listed(folder)}
                recorded = {
                    **verification_fields(history, step, str(folder), plan, None),
                    "verified_at": now_rfc3339(), "run_id": guard.topology.run_id, "torch": torch.__version__,
                    "writer": "torchtitan",
                }
                manifest = dcp_manifest.build(
                    step=step, files=files, grid=layout.grid, weights_verified=verified, model_key="",
                    state_keys=[k for k in self.checkpointer.states if k != "model"],
                    parameters=names, reports=reports, recorded=recorded)
                write_json_atomic(dcp_manifest.manifest_file(folder), json.dumps(manifest, indent=2, sort_keys=True))
                outcome["sha256"] = manifest["sha256"]
            except (CheckpointError, OSError) as exc:
                outcome["failure"] = f"{type(exc).__name__}: {exc}"
        outcome = broadcast_json(outcome if dist.get_rank() == 0 else None, 0, guard.device, None)
        if outcome["failure"] is not None:
            raise CheckpointError(f"sdcguard: no manifest for torchtitan's checkpoint {folder}: {outcome['failure']}")
        saved = recovery.Checkpoint(step, str(folder), history.last_audited_step, outcome["sha256"],
                                    cross_checked=verified)
        guard.history = recovery.after_save(history, plan, saved, None)

    def _model_report(self) -> tuple[list[str], dict[str, Any]]:
        """The model state torchtitan saves (``ModelWrapper.state_dict()``: its key space, e.g. the
        fused ``wqkv`` split into ``wq`` / ``wk`` / ``wv``, replicated), this rank's part of it:
        the tensors' names, and the fingerprint digest and chunk of this rank's pieces — what
        ``dcp_manifest.shard_digests`` recomputes from the files (collective: the split all-gathers)."""
        from ..fingerprint import digest, fingerprint_many
        from ..sharding import dcp_manifest
        state = self.checkpointer.states["model"].state_dict()
        names = [n for n, t in state.items() if isinstance(t, torch.Tensor)]
        tensors = [state[n] for n in names]
        local = [(t.to_local() if hasattr(t, "to_local") else t).detach().contiguous() for t in tensors]
        return names, {"digest": digest(fingerprint_many(local)).hex(),
                       "chunks": [dcp_manifest.chunk_of(t) for t in tensors]}

    def _load_folder(self, step: int) -> Path | None:
        """The ``step-N`` folder torchtitan's ``load(step)`` will read, or None (no checkpoint yet:
        an initial load from HF weights or a seed is not sdcguard's)."""
        checkpointer = self.checkpointer
        if not os.path.isdir(checkpointer.folder):
            return None
        found = checkpointer._find_load_step() if step == -1 else step
        return Path(checkpointer._create_checkpoint_id(found)) if found != -1 else None

    def _resumed(self, folder: Path, manifest: dict[str, Any]) -> None:
        """The verified checkpoint is this run's starting point: its step, what it was covered by,
        and — after torchtitan loaded it — each rank's shards against the digest the manifest records."""
        from ..sharding.shard_weights import fingerprint_shards
        guard = self.guard
        layout = guard.layout.mesh
        shard = layout.coordinates(layout.rank)["shard"]
        names, mine = self._model_report()
        ok = names == manifest["parameters"] and mine["digest"] == manifest["shards"][shard]["digest"]
        if not _everyone_agrees(ok, guard.device):
            raise CheckpointError(f"sdcguard: the weights torchtitan loaded from {folder} are not those its manifest "
                                  "records")
        step = int(manifest["step"])
        guard.resumed(step, resumed_history(str(folder), manifest),
                      fingerprint_shards(guard.named_parameters).digest.hex() if manifest.get("weights_verified") else None)


def guarded(config: Trainer.Config, **settings: Any) -> GuardedTrainer.Config:
    """``config`` (e.g. what ``llama3_debugmodel()`` returns) as a :class:`GuardedTrainer` config,
    with ``settings`` in its ``sdcguard`` section."""
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(Trainer.Config) if f.init}
    return GuardedTrainer.Config(**values, sdcguard=SDCGuardConfig(**settings))


# -- helpers -------------------------------------------------------------------------------------

def _verify_everywhere(folder: Path, device: torch.device) -> dict[str, Any]:
    """Rank 0 checks ``folder`` against its manifest (every file's SHA-256, every shard's digest
    recomputed from the files) before any rank loads it; the verdict reaches every rank."""
    from ..checks.exchange import broadcast_json
    from ..sharding import dcp_manifest
    said: dict[str, Any] = {"failure": None, "manifest": None}
    if dist.get_rank() == 0:
        try:
            dcp_manifest.verify_directory(folder)
            said["manifest"] = dcp_manifest.read(folder)
        except CheckpointError as exc:
            said["failure"] = str(exc)
    said = broadcast_json(said if dist.get_rank() == 0 else None, 0, device, None)
    if said["failure"] is not None:
        raise CheckpointError(f"sdcguard: refusing to resume from {folder}: {said['failure']}")
    return said["manifest"]


def _everyone_agrees(ok: bool, device: torch.device) -> bool:
    flag = torch.tensor([0 if ok else 1], dtype=torch.int64, device=device)
    dist.all_reduce(flag)
    return int(flag.item()) == 0


def _require_checkable(trainer: Trainer) -> None:
    """Refuse, at start-up and with the reason, a torchtitan job whose parallelism sdcguard's
    sharded checks do not cover."""
    dims = trainer.parallel_dims
    problems = []
    for name, degree in (("pipeline_parallel_degree", dims.pp), ("tensor_parallel_degree", dims.tp),
                         ("context_parallel_degree", dims.cp), ("expert_parallel_degree", dims.ep)):
        if degree > 1:
            problems.append(f"{name}={degree} (only data parallelism is checked)")
    # data_parallel_shard_degree=1 is checked too: torchtitan then applies fully_shard over a
    # (dp_replicate, 1) mesh, where FSDP2 copies each rank's gradient and all-reduces the copy
    # (sharding/reduce_record.py records the copy's input)
    if dims.dp_shard * dims.dp_replicate < 2:
        problems.append(f"data parallel degree {dims.dp_shard * dims.dp_replicate} (one data-parallel rank has "
                        "no other to check it against)")
    if len(trainer.model_parts) != 1:
        problems.append(f"{len(trainer.model_parts)} model parts")
    if problems:
        raise ConfigurationError("sdcguard cannot check this torchtitan job: " + "; ".join(problems))
