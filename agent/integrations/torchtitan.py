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

The step: torchtitan's own ``Trainer.train_step`` runs unchanged (the token count, the
micro-batches, ``clip_grad_norm_``, the optimizers and schedulers, the metrics); sdcguard
overrides the two methods torchtitan's trainer is built to have overridden. ``train_step`` holds
one ``guard.step`` open around torchtitan's, and ``forward_backward_step`` (called once per
micro-batch) runs the micro-batch's forward and backward as ``s.backward``, then, after the last
one and so before torchtitan clips and steps, ``s.check()``: an update is never applied
unchecked. The step closes (check 3 on weight-check steps) once torchtitan's ``train_step``
returned. The Guard is built in ``__init__`` after torchtitan parallelized the model
(``fully_shard`` on each block and the root) and built its optimizers: sdcguard's sharded checks
(``sdcguard.sharding``) then read torchtitan's mesh. A check that fires raises ``SDCDetected``
from ``train_step`` on every rank alike; ``Trainer.train`` lets it through, and torchtitan's
``train.py`` closes the trainer and re-raises: the run stops, the alarm is in the spool.

Parallelisms: FSDP2, HSDP and the replicate-only mesh, each also with
``parallelism.tensor_parallel_degree`` (torchtitan's mesh ``(dp_replicate, fsdp, tp)``: the Guard
reads the ``tp`` dimension from the TP layers' DTensor parameters and checks every (TP, FSDP)
position, ``layouts/tensor_parallel.py``), or with ``parallelism.pipeline_parallel_degree``
(torchtitan's mesh ``(pp, dp_replicate, fsdp)``, FSDP2 over every stage: the Guard is built on
torchtitan's ``pp_schedule``, ``layouts/pipeline.py``, and torchtitan's own
``pp_forward_backward_step`` runs each step — its micro-batches, first- and last-stage arguments,
targets, losses and the global token count as the loss's divisor — with its schedule's ``step``
run as ``s.run_schedule``). Refused before torchtitan builds anything, naming the setting
(:func:`refusals`): context and expert parallelism, pipeline with tensor parallelism, gradient
accumulation or a schedule other than GPipe / 1F1B / Interleaved1F1B, and one data-parallel rank.

Checkpoints: :class:`GuardedCheckpointManager` is torchtitan's DCP ``CheckpointManager`` with its
``_save`` / ``_load`` hooks (the ones torchtitan's ``BaseCheckpointManager`` has subclasses
override) extended; ``GuardedTrainer.Config`` builds it in place of torchtitan's own. With
``sdcguard.check_checkpoints`` (default on) every save torchtitan makes passes the Guard's save
gate first (no save after an alarm, the step rule, check 3: a replica that differs raises
``SDCDetected`` and nothing is written), and once every rank's files are written rank 0 adds
sdcguard's sharded manifest beside them (``sharding/dcp_manifest.py``: every file's SHA-256, each
shard's fingerprint digest and ranks, the mesh, the step, the audit it is covered by); the
checkpoint enters the run's history, so an alarm can name it as ``last_good_checkpoint``. Before
torchtitan loads a folder (a resume), it is checked against its manifest (``sdcguard
verify-checkpoint`` checks one offline), and after the load every rank's shards against the
digest recorded: a folder that differs is refused on every rank. Under pipeline parallelism the
manifest's entries are (pipeline position, FSDP shard) pairs, each covering its stage's tensors.
"""
from __future__ import annotations

import contextlib
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
from ..errors import ConfigurationError
from ..manifest import verification_fields
from .base import HeldStep, adopt, agree, rank0_outcome

try:
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.trainer import Trainer
except ImportError as exc:  # pragma: no cover - the extra is not installed
    raise ImportError("sdcguard.integrations.torchtitan needs torchtitan (pip install 'sdcguard[torchtitan]')") from exc

__all__ = ["SDCGuardConfig", "GuardedCheckpointManager", "GuardedTrainer", "guarded"]

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


class GuardedCheckpointManager(CheckpointManager):
    """torchtitan's DCP checkpoint manager whose saves pass the Guard's save gate and get sdcguard's
    manifest, and whose loads are verified against it (see the module docstring). Without a Guard
    (``guard`` None: sdcguard off, or ``check_checkpoints`` off) it is torchtitan's manager."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        """torchtitan's ``checkpoint`` section, unchanged; declared so that ``build()`` builds this
        class (``BaseCheckpointManager``'s rule for subclasses)."""

    guard: Any = None
    """The Guard the checkpoints go through. torchtitan builds this manager inside
    ``Trainer.__init__``, before the Guard can exist, so :class:`GuardedTrainer` sets it after."""
    parallel_dims: Any = None
    """torchtitan's ``ParallelDims``, set with ``guard``: under pipeline parallelism the manifest's
    entries are (pipeline position, FSDP shard) pairs, read from torchtitan's meshes."""
    _where: Any = None

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        guard = self.guard
        if guard is None or not self._should_save(curr_step, last_step):  # the same answer on every rank
            return super()._save(curr_step, last_step)
        # torchtitan's Trainer.train() does step += 1, train_step(), then save(step): the folder of
        # curr_step holds that step's update, which is the Guard's updates_through (GuardedTrainer's
        # guard.step is torchtitan's step number, and a resume restores both). Passed, not left out,
        # so that a numbering that ever disagreed would be refused by the step rule, not recorded.
        step = guard.save_gate(self._create_checkpoint_id(curr_step), curr_step)
        saved = super()._save(curr_step, last_step)
        self.maybe_wait_for_saving()  # async modes: the files must be complete to be hashed
        self._write_manifest(step)
        return saved

    def _load(self, step: int = -1) -> bool:
        guard = self.guard
        folder = self._load_folder(step) if guard is not None else None
        manifest = self._verified(folder) if folder is not None else None
        loaded = super()._load(step)
        if loaded and folder is not None and manifest is not None:
            self._adopt(folder, manifest)
        return loaded

    def _write_manifest(self, step: int) -> None:
        """sdcguard's manifest for the DCP folder torchtitan just wrote (collective): every file's
        SHA-256, each shard's fingerprint digest and its ranks, the mesh, the step, the audits it
        is covered by; the checkpoint then counts in the run's history (an alarm may name it)."""
        from .. import recovery
        from ..checks.exchange import gather_objects
        from ..contract.alarm import now_rfc3339
        from ..contract.spool import write_json_atomic
        from ..sharding import dcp_manifest

        guard = self.guard
        folder = Path(self._create_checkpoint_id(step))
        where = self._placement()
        everyone = gather_objects(self._model_report(), None, guard.device)
        names = manifest_parameters(everyone)
        ndims = {n: len(c[0]) for r in everyone for n, c in zip(r["names"], r["chunks"])}
        reports = [in_manifest_order(r, names, ndims) for r in everyone]
        history = guard.history
        verified = len(where.grid) > 1 and guard.last_weights_verified_step == step
        plan = recovery.plan_save(history, str(folder), step, keep=False)  # torchtitan writes a new folder per step

        def write() -> dict[str, Any]:
            files = {name: dcp_manifest.sha256_file(folder / name) for name in dcp_manifest.listed(folder)}
            recorded = {
                **verification_fields(history, step, str(folder), plan, None),
                "verified_at": now_rfc3339(), "run_id": guard.topology.run_id, "torch": torch.__version__,
                "writer": "torchtitan",
            }
            manifest = where.annotate(dcp_manifest.build(
                step=step, files=files, grid=where.grid, weights_verified=verified, model_key="",
                state_keys=[k for k in self.states if k != "model"],
                parameters=names, reports=reports, recorded=recorded, columns=where.columns))
            write_json_atomic(dcp_manifest.manifest_file(folder), json.dumps(manifest, indent=2, sort_keys=True))
            return {"sha256": manifest["sha256"]}

        outcome = rank0_outcome(guard, write, f"sdcguard: no manifest for torchtitan's checkpoint {folder}")
        saved = recovery.Checkpoint(step, str(folder), history.last_audited_step, outcome["sha256"],
                                    cross_checked=verified)
        guard.history = recovery.after_save(history, plan, saved, None)

    def _model_report(self) -> dict[str, Any]:
        """The model state torchtitan saves (``ModelWrapper.state_dict()`` over this rank's model
        parts: its key space, e.g. the fused ``wqkv`` split into ``wq`` / ``wk`` / ``wv``,
        replicated), this rank's part of it: the tensors' names, and each local piece's fingerprint
        and chunk — what ``dcp_manifest.shard_digests`` recomputes from the files (collective: the
        split all-gathers). A pipeline stage holds only its own tensors."""
        from ..fingerprint import fingerprint_many
        from ..sharding import dcp_manifest
        state = self.states["model"].state_dict()
        names = [n for n, t in state.items() if isinstance(t, torch.Tensor)]
        tensors = [state[n] for n in names]
        local = [(t.to_local() if hasattr(t, "to_local") else t).detach().contiguous() for t in tensors]
        return {"names": names, "fingerprints": [list(fp) for fp in fingerprint_many(local)],
                "chunks": [dcp_manifest.chunk_of(t) for t in tensors]}

    def _placement(self) -> _Placement:
        """Which entry of the manifest's ``shards`` each rank's part of the model state is."""
        if self._where is None:
            dims = self.parallel_dims
            if dims is not None and dims.pp_enabled:
                self._where = _pipeline_placement(dims, self.guard.device)
            else:
                from ..sharding import dcp_manifest
                mesh = self.guard.layout.mesh
                self._where = _Placement([list(row) for row in mesh.grid],
                                         [[list(row) for row in c] for c in mesh.columns] or None,
                                         dcp_manifest.position(mesh.coordinates(mesh.rank), mesh.shards))
        return self._where

    def _load_folder(self, step: int) -> Path | None:
        """The ``step-N`` folder torchtitan's ``load(step)`` will read, or None (no checkpoint yet:
        an initial load from HF weights or a seed is not sdcguard's)."""
        if not os.path.isdir(self.folder):
            return None
        found = self._find_load_step() if step == -1 else step
        return Path(self._create_checkpoint_id(found)) if found != -1 else None

    def _verified(self, folder: Path) -> dict[str, Any]:
        """Rank 0 checks ``folder`` against its manifest (every file's SHA-256, every shard's digest
        recomputed from the files) before any rank loads it; the verdict reaches every rank."""
        from ..sharding import dcp_manifest

        def verify() -> dict[str, Any]:
            dcp_manifest.verify_directory(folder)
            return {"manifest": dcp_manifest.read(folder)}

        return rank0_outcome(self.guard, verify, f"sdcguard: refusing to resume from {folder}")["manifest"]

    def _adopt(self, folder: Path, manifest: dict[str, Any]) -> None:
        """The verified checkpoint is this run's starting point: its step, what it was covered by,
        and — after torchtitan loaded it — each rank's shards against the digest the manifest records."""
        guard = self.guard
        mine = self._model_report()  # collective (the split all-gathers): before anything that may fail
        try:  # a manifest of another mesh (DCP resharded the load) must not leave one rank behind
            entry = manifest["shards"][self._placement().mine]
            names = manifest["parameters"]
            ndims = {n: len(c[0]) for n, c in zip(names, entry["chunks"])}
            ok = ([n for n in names if n in set(mine["names"])] == mine["names"]
                  and in_manifest_order(mine, names, ndims)["digest"] == entry["digest"])
        except (IndexError, KeyError, TypeError, ValueError):
            ok = False
        agree(guard, None if ok else f"sdcguard: the weights torchtitan loaded from {folder} are not those its "
                                     "manifest records")
        weights = guard.layout.fingerprint_weights() if manifest.get("weights_verified") else None
        adopt(guard, str(folder), manifest, weights.digest.hex() if weights is not None else None)


class GuardedTrainer(Trainer):
    """torchtitan's ``Trainer`` with sdcguard's checks in every step (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        sdcguard: SDCGuardConfig = field(default_factory=SDCGuardConfig)

        def __post_init__(self) -> None:
            Trainer.Config.__post_init__(self)
            if type(self.checkpoint) is CheckpointManager.Config:  # torchtitan's own: built as the guarded one
                values = {f.name: getattr(self.checkpoint, f.name) for f in dataclasses.fields(self.checkpoint) if f.init}
                self.checkpoint = GuardedCheckpointManager.Config(**values)

    def __init__(self, config: Config) -> None:
        if config.sdcguard.enable:  # before torchtitan builds anything: a refusal costs no start-up
            _refuse_unchecked(config)
        super().__init__(config)
        self.guard: Any = None
        self.injector: Any = None
        self._held = HeldStep()
        """The optimizer step in progress: opened at its first micro-batch, closed after the update."""
        settings = config.sdcguard
        if not settings.enable:
            return
        _require_checkable(self)
        checkpoints = settings.check_checkpoints and self.checkpointer.enable
        if checkpoints and not isinstance(self.checkpointer, GuardedCheckpointManager):
            raise ConfigurationError(
                f"sdcguard: sdcguard.check_checkpoints needs checkpoints written by GuardedCheckpointManager, not "
                f"{type(self.checkpointer).__name__}: give checkpoint=GuardedCheckpointManager.Config(...) (or "
                "subclass it), or set sdcguard.check_checkpoints=False")
        import sdcguard
        defaults = {"audit_every": settings.audit_every, "weight_check_every": settings.weight_check_every}
        if settings.spool is not None:
            defaults["spool"] = settings.spool
        guard_config = GuardConfig.from_env(**defaults)
        if self.parallel_dims.pp_enabled:  # torchtitan's schedule, over every stage this rank holds; its loss
            self.guard = sdcguard.Guard(self.pp_schedule, self.optimizers, config=guard_config)
        else:
            self.guard = sdcguard.Guard(self.model_parts[0], self.optimizers, self._loss_of, config=guard_config)
        if settings.inject:
            self.injector = _install_faults(self, settings)
        if checkpoints:
            self.checkpointer.guard = self.guard
            self.checkpointer.parallel_dims = self.parallel_dims

    # -- the step --------------------------------------------------------------------------------

    def train_step(self, data_iterator: Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]) -> None:
        """torchtitan's ``Trainer.train_step`` as one ``guard.step``: opened by its first
        micro-batch (:meth:`forward_backward_step`), closed once torchtitan clipped, stepped the
        optimizers and schedulers and logged (check 3 on weight-check steps), or with the error
        that cut it short."""
        if self.guard is None:
            return super().train_step(data_iterator)
        if self.injector is not None:
            self.injector.begin_step(self.step)
        try:
            super().train_step(data_iterator)
        except BaseException as exc:
            self._held.close(exc)
            raise
        self._held.close(None)

    def forward_backward_step(self, *, input_dict: Any, labels: Any, global_valid_tokens: torch.Tensor) -> torch.Tensor:
        """One micro-batch's forward and backward through the Guard (``s.backward``, what
        ``_forward_backward_body`` computes); after the step's last one, ``s.check()``: checks 1
        and 4 (2 and 3 on audit steps) before torchtitan clips and updates, on every rank alike."""
        guard = self.guard
        if guard is None:
            return super().forward_backward_step(input_dict=input_dict, labels=labels,
                                                 global_valid_tokens=global_valid_tokens)
        s = self._held.current
        if s is None:
            s = self._held.open(guard, self.step, self.gradient_accumulation_steps)
        if self.parallel_dims.pp_enabled:
            # torchtitan's own pp_forward_backward_step (its micro-batches, first / last stage
            # arguments, targets, losses and the global token count as the loss's divisor), its
            # schedule's step() run as s.run_schedule: recorded, seeded and replayed by sdcguard
            with _schedule_through(self, s):
                loss = super().forward_backward_step(input_dict=input_dict, labels=labels,
                                                     global_valid_tokens=global_valid_tokens)
        else:
            # torchtitan's loss is already this rank's share (a sum over the global token count): its backward, unweighted
            loss = s.backward((dict(input_dict), labels, global_valid_tokens))
        if len(s.batches) == s.micro_batches:
            s.check()
        return loss

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


def guarded(config: Trainer.Config, **settings: Any) -> GuardedTrainer.Config:
    """``config`` (e.g. what ``llama3_debugmodel()`` returns) as a :class:`GuardedTrainer` config,
    with ``settings`` in its ``sdcguard`` section."""
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(Trainer.Config) if f.init}
    return GuardedTrainer.Config(**values, sdcguard=SDCGuardConfig(**settings))



# -- the checkpoint manifest's entries ----------------------------------------------------------

@dataclass(frozen=True, slots=True)
class _Placement:
    """Where each rank's part of the model state sits in sdcguard's manifest of a DCP folder."""

    grid: list[list[int]]
    """``grid[i][j]``: the rank holding entry ``j`` of replica ``i`` (an FSDP shard; under pipeline
    parallelism a (position, shard) pair, ``j = position * shards + shard``)."""
    columns: list[list[list[int]]] | None
    """Tensor parallelism: every TP rank's grid (the manifest's entries are (TP, FSDP) positions)."""
    mine: int
    """This rank's entry in the manifest's ``shards``."""
    positions: int = 1
    """Pipeline positions (1: no pipeline)."""

    def annotate(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """The manifest, with each entry's pipeline position when there is a pipeline (the
        checkpoint's identity covers its files, not these fields)."""
        if self.positions == 1:
            return manifest
        per_position = len(self.grid[0]) // self.positions
        manifest["mesh"]["pipeline"] = {"positions": self.positions, "shards_per_position": per_position}
        for entry in manifest["shards"]:
            entry["pipeline_position"] = entry["shard"] // per_position
        return manifest


def _pipeline_placement(dims: Any, device: torch.device) -> _Placement:
    """torchtitan's mesh ``(pp, dp_replicate, fsdp)``: every rank's coordinates, gathered
    (collective), as a grid of replicas x (pipeline position, FSDP shard)."""
    from ..checks.exchange import gather_objects

    def local(name: str) -> tuple[int, int]:
        mesh = dims.get_optional_mesh(name)
        return (mesh.get_local_rank(), mesh.size()) if mesh is not None else (0, 1)

    (_, positions), (_, replicas), (_, shards) = local("pp"), local("dp_replicate"), local("fsdp")
    everyone = gather_objects([local(name)[0] for name in ("pp", "dp_replicate", "fsdp")], None, device)
    grid = [[-1] * (positions * shards) for _ in range(replicas)]
    for rank, (position, replica, shard) in enumerate(everyone):
        grid[replica][position * shards + shard] = rank
    mine = everyone[dist.get_rank()]
    return _Placement(grid, None, mine[0] * shards + mine[2], positions)


def manifest_parameters(reports: list[dict[str, Any]]) -> list[str]:
    """Pure: the model state's tensor names over every rank's report (``{"names", ...}``), rank
    by rank, each where first seen: every rank's list with data parallelism, the stages' lists
    one after the other with a pipeline."""
    names: list[str] = []
    seen: set[str] = set()
    for report in reports:
        for name in report["names"]:
            if name not in seen:
                seen.add(name)
                names.append(name)
    return names


def in_manifest_order(report: dict[str, Any], names: list[str], ndims: dict[str, int]) -> dict[str, Any]:
    """Pure: one rank's report (its tensors' ``names``, ``fingerprints``, ``chunks``) over the
    manifest's ``names``: the digest of its pieces in that order and their chunks, a tensor it does
    not hold (another pipeline stage's) an empty piece (zero sizes over its ``ndims``), which
    ``dcp_manifest.shard_digests`` cuts from the files alike."""
    from ..fingerprint import Fingerprint, digest
    held = {n: (fp, chunk) for n, fp, chunk in zip(report["names"], report["fingerprints"], report["chunks"])}
    fps, chunks = [], []
    for name in names:
        fp, chunk = held.get(name, (list(_EMPTY), [[0] * ndims[name], [0] * ndims[name]]))
        fps.append(Fingerprint(int(fp[0]), int(fp[1])))
        chunks.append(chunk)
    return {"digest": digest(fps).hex(), "chunks": chunks}


_EMPTY = (0, 0)
"""The fingerprint of an empty piece: sums over no element."""


# -- helpers -------------------------------------------------------------------------------------

class _ScheduleInStep:
    """What torchtitan's ``pp_forward_backward_step`` finds as ``self.pp_schedule`` inside a guarded
    step: its ``step(...)`` is the open step's ``run_schedule`` with the same arguments, which runs
    torchtitan's schedule (the one the Guard holds) recorded for the checks."""

    __slots__ = ("s",)

    def __init__(self, s: Any) -> None:
        self.s = s

    def step(self, *args: Any, **kwargs: Any) -> Any:
        return self.s.run_schedule(*args, **kwargs)


@contextlib.contextmanager
def _schedule_through(trainer: Trainer, s: Any) -> Iterator[None]:
    """torchtitan's ``pp_forward_backward_step`` runs unchanged, its schedule step through ``s``."""
    schedule = trainer.pp_schedule
    trainer.pp_schedule = _ScheduleInStep(s)
    try:
        yield
    finally:
        trainer.pp_schedule = schedule


def _install_faults(trainer: GuardedTrainer, settings: SDCGuardConfig) -> Any:
    """The faults of ``sdcguard.inject`` (drills and tests), planted in this rank's part of the
    model: FSDP2's reductions, parameters and module outputs (``faults/sharded.py``). Under
    pipeline parallelism a fault's ``param=`` / ``site=`` names a tensor or module of a stage this
    rank holds (as in torchtitan's model: stage 1 holds ``layers.1``)."""
    from ..faults.sharded import ShardedFaultInjector
    injector = ShardedFaultInjector(settings.inject, dist.get_rank())
    model = None
    if trainer.parallel_dims.pp_enabled:  # a forward fault's module: in the stage (model part) that holds it
        sites = {f.site if f.site is not None else settings.fault_site
                 for f in injector.faults if f.info.corrupts == "forward"}
        parts = [m for m in trainer.model_parts if sites <= {name for name, _ in m.named_modules()}]
        model = parts[0] if parts else trainer.model_parts[0]
    injector.install(trainer.guard, param=settings.fault_param, site=settings.fault_site, model=model)
    return injector


def _refuse_unchecked(config: GuardedTrainer.Config) -> None:
    """Refuse, before torchtitan builds the model, a job whose parallelism sdcguard's sharded checks
    do not cover (torchtitan's own ``ParallelDims`` resolves ``data_parallel_shard_degree=-1``)."""
    from torchtitan.distributed import ParallelDims
    dims = ParallelDims.from_config(config.parallelism, int(os.environ.get("WORLD_SIZE", "1")))
    _raise_for(refusals(**_degrees(dims, config), model_parts=1, spmd_backend=config.parallelism.spmd_backend))


def _require_checkable(trainer: Trainer) -> None:
    """The same, on what torchtitan built (its model parts, and their attention, too)."""
    _raise_for(refusals(**_degrees(trainer.parallel_dims, trainer.config), model_parts=len(trainer.model_parts),
                        pp_masked_attention=_masked_attention(trainer.model_parts)))


def _masked_attention(parts: list[torch.nn.Module]) -> str | None:
    """The name of the first attention whose masks are not tensors (torchtitan's flex or varlen), or None."""
    from torchtitan.models.common.attention import FlexAttention, VarlenAttention
    return next((type(m).__name__ for part in parts for m in part.modules()
                 if isinstance(m, (FlexAttention, VarlenAttention))), None)


def _degrees(dims: Any, config: Trainer.Config) -> dict[str, Any]:
    """What :func:`refusals` reads of torchtitan's resolved degrees and its config: the gradient
    accumulation steps as ``Trainer.__init__`` computes them (a negative global batch size: one)."""
    training, parallelism = config.training, config.parallelism
    batch = training.local_batch_size * dims.dp_replicate * dims.dp_shard  # torchtitan's "batch" mesh
    accumulation = max(1, training.global_batch_size // batch) if training.global_batch_size > 0 else 1
    return {"pp": dims.pp, "tp": dims.tp, "cp": dims.cp, "ep": dims.ep, "dp_replicate": dims.dp_replicate,
            "dp_shard": dims.dp_shard, "accumulation": accumulation,
            "pp_schedule": parallelism.pipeline_parallel_schedule,
            "pp_schedule_csv": parallelism.pipeline_parallel_schedule_csv or ""}


def _raise_for(problems: list[str]) -> None:
    if problems:
        raise ConfigurationError("sdcguard cannot check this torchtitan job: " + "; ".join(problems))


PIPELINE_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")
"""torchtitan's ``pipeline_parallel_schedule`` values whose replay sdcguard's pipeline layout is tested with."""


def refusals(*, pp: int, cp: int, ep: int, dp_replicate: int, dp_shard: int, model_parts: int,
             spmd_backend: str = "partial_dtensor", tp: int = 1, accumulation: int = 1, pp_schedule: str = "1F1B",
             pp_schedule_csv: str = "", pp_masked_attention: str | None = None) -> list[str]:
    """Pure: why sdcguard cannot check a torchtitan job of these degrees (empty: it can), each
    reason naming the setting. ``tensor_parallel_degree`` alone is not among them: TP under
    FSDP2/HSDP is checked (``layouts/tensor_parallel.py``; the layout refuses a mesh whose replay
    ring does not carry each TP group onto another). Nor is ``pipeline_parallel_degree``: the Guard
    is built on torchtitan's schedule (``layouts/pipeline.py``, FSDP2 / HSDP over each stage), with
    the limits below."""
    problems = []
    if pp > 1:
        # the pipeline layout checks FSDP2 / HSDP over each stage; a stage whose parameters are TP
        # DTensors is not one of its layouts yet
        if tp > 1:
            problems.append(f"parallelism.pipeline_parallel_degree={pp} with tensor_parallel_degree={tp}: a pipeline "
                            "stage that is tensor parallel is not checked (sdcguard's pipeline layout covers FSDP2 "
                            "and HSDP over each stage); set one of them to 1")
        # the layout records one schedule step per optimizer step (what a replay redoes); torchtitan
        # runs the schedule once per accumulation step
        if accumulation > 1:
            problems.append(f"training.global_batch_size: {accumulation} gradient accumulation steps with "
                            f"parallelism.pipeline_parallel_degree={pp} (one schedule step each) are not checked: "
                            "sdcguard replays one schedule step per optimizer step; give the schedule more "
                            "micro-batches instead (training.local_batch_size / pipeline_parallel_microbatch_size) "
                            "and set global_batch_size to local_batch_size x the data-parallel degree")
        if pp_schedule_csv:
            problems.append(f"parallelism.pipeline_parallel_schedule_csv={pp_schedule_csv!r}: a schedule loaded from "
                            "a CSV is not checked (sdcguard's replay rebuilds the schedule from its class)")
        elif pp_schedule.lower() not in {name.lower() for name in PIPELINE_SCHEDULES}:  # torch's names ignore case
            problems.append(f"parallelism.pipeline_parallel_schedule={pp_schedule!r} is not checked (checked: "
                            f"{', '.join(PIPELINE_SCHEDULES)})")
        # the masks ride in the schedule's keyword arguments, which a replay receives as data loaded
        # with weights_only: a BlockMask (a mask function) or varlen metadata cannot travel so
        if pp_masked_attention:
            problems.append(f"{pp_masked_attention} with parallelism.pipeline_parallel_degree={pp}: its attention "
                            "masks travel in the schedule's keyword arguments, which a replay cannot receive (they "
                            "are not tensors); use scaled dot-product attention (attn_backend='sdpa') under PP")
    if cp > 1:
        # a CP group computes one batch together (each rank a slice of the sequence, keys and values
        # passed around the group by ring attention), like a TP group; but torchtitan folds cp into
        # FSDP2's shard dimension (``fsdp``), so the mesh sdcguard reads shows CP ranks as data-parallel
        # shards with batches of their own: no ring check, per-rank forward seeds, no group to name
        problems.append(f"parallelism.context_parallel_degree={cp}: context parallelism is not checked (a CP group "
                        "computes one batch together through ring attention, but torchtitan folds cp into FSDP2's "
                        "shard dimension, where sdcguard would take its ranks for data-parallel shards with "
                        "batches of their own; set it to 1)")
    if ep > 1:
        # the experts live on a mesh of their own (dp_replicate, efsdp, ep), and the all-to-all sends
        # each rank's tokens to experts on ranks that hold other data-parallel batches
        problems.append(f"parallelism.expert_parallel_degree={ep}: expert parallelism is not checked (the experts' "
                        "parameters are sharded on a mesh of their own, (dp_replicate, efsdp, ep), and the token "
                        "all-to-all mixes the batches of the EP group's data-parallel ranks; set it to 1)")
    # data_parallel_shard_degree=1 is checked too: torchtitan then applies fully_shard over a
    # (dp_replicate, 1) mesh, where FSDP2 copies each rank's gradient and all-reduces the copy
    # (sharding/reduce_record.py records the copy's input)
    if spmd_backend == "full_dtensor":
        problems.append('parallelism.spmd_backend="full_dtensor": the loss is then a DTensor over the whole mesh, '
                        'which the step\'s records do not take (use "partial_dtensor", torchtitan\'s classic FSDP2 path)')
    if dp_shard * dp_replicate < 2:
        problems.append(f"data parallel degree {dp_shard * dp_replicate} (parallelism.data_parallel_replicate_degree "
                        "x data_parallel_shard_degree; one data-parallel rank has no other to check it against)")
    if model_parts != 1 and pp == 1:  # a pipeline's parts are its stages, which the schedule holds
        problems.append(f"{model_parts} model parts")
    return problems
