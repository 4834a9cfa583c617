"""The checkpoint stores of the layouts: one file with a manifest (``checkpoint.py``) for a model
every rank holds whole, a DCP directory with per-shard digests (``sharding/dcp.py``) for a sharded
one. The save gate in front of them (no save after an alarm, the step rule, check 3 first) is the
Guard's, once for every store."""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.distributed as dist

from .. import checkpoint, recovery
from .. import manifest as manifest_codec
from ..checks.exchange import gather_objects
from ..checks.topology import Topology
from ..sharding.layout import ShardLayout


class FileStore:
    """One file written by rank 0 (``torch.save`` of your state dict) and its manifest."""

    def __init__(self, *, module: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: Any,
                 named_parameters: list[tuple[str, torch.nn.Parameter]], topology: Topology,
                 device: torch.device, group: dist.ProcessGroup | None) -> None:
        self.module, self.optimizer, self.scaler = module, optimizer, scaler
        self.named_parameters = named_parameters
        self.topology, self.device, self.group = topology, device, group

    def save(self, path: str, *, step: int, state: dict[str, Any] | None, model_key: str,
             history: recovery.History, weight_digest: str | None, keep: bool) -> recovery.History:
        if state is None:
            state = {"step": step, model_key: self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                     "scaler": self.scaler.state_dict() if self.scaler is not None else None}
        facts = checkpoint.Facts(
            step=step, weight_digest=weight_digest, parameters=[n for n, _ in self.named_parameters],
            model_key=model_key, history=history, replicas=self.topology.world_size, run_id=self.topology.run_id)
        solo = self.topology.world_size == 1
        return checkpoint.save(path, state, facts, keep=keep, writer=self.topology.rank == 0, device=self.device,
                               group=None if solo else self.group)

    def load(self, path: str, *, model_key: str, expect_step: int | None, expect_sha256: str | None,
             state: dict[str, Any] | None) -> tuple[int, recovery.History, str | None]:
        if state is not None:
            raise TypeError("load_checkpoint(state=) is for sharded models; with DDP, sdcguard.load_checkpoint(path, "
                            "module, optimizer) returns the dict you saved")
        first = next(self.module.parameters(), None)
        read, failure = None, None
        try:  # read and checked on every rank before any rank loads anything
            read = checkpoint.read_state(path, map_location=first.device if first is not None else "cpu",
                                         expect_step=expect_step, expect_sha256=expect_sha256)
        except Exception as exc:  # noqa: BLE001 - e.g. a file only some nodes see: agreed below
            if self.topology.world_size == 1:
                raise
            failure = exc
        if self.topology.world_size > 1:
            _agree_read(path, failure, self.device, self.group)
        state, manifest = read
        checkpoint.apply_state(path, state, manifest, self.module, self.optimizer, self.scaler, model_key=model_key)
        step = int(manifest["step"])
        return step, manifest_codec.resumed_history(path, manifest), manifest["weight_digest"]


def _agree_read(path: str, failure: Exception | None, device: torch.device, group: dist.ProcessGroup | None) -> None:
    """Collective: every rank read ``path``, or every rank raises, before any loads it (the weights
    stay the same on every rank): a rank that failed its own error, the others a CheckpointError
    naming the ranks that could not (a file on one node's disk, a stale mount). None goes on alone
    into the next step's collectives."""
    said = gather_objects(None if failure is None else f"{type(failure).__name__}: {failure}", group, device)
    failed = {rank: msg for rank, msg in enumerate(said) if msg is not None}
    if failure is not None:
        raise failure
    if failed:
        where = "; ".join(f"rank {r}: {msg}" for r, msg in sorted(failed.items()))
        raise checkpoint.CheckpointError(f"{path} was read here but not on every rank ({where}): nothing loaded")


class DcpStore:
    """A DCP directory every rank writes its shards into, with a manifest of per-shard digests.
    ``state`` holds only your extra entries (e.g. ``{"scheduler": scheduler}``), loaded back in place."""

    def __init__(self, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: Any,
                 named_parameters: list[tuple[str, torch.nn.Parameter]], mesh: ShardLayout, topology: Topology,
                 device: torch.device, zero_update: Callable[[], contextlib.AbstractContextManager[None]]) -> None:
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.named_parameters = named_parameters
        self.mesh, self.topology, self.device = mesh, topology, device
        self.zero_update = zero_update

    def _parts(self, state: dict[str, Any] | None, model_key: str) -> dict[str, Any]:
        return {"model": self.model, "optimizer": self.optimizer, "scaler": self.scaler, "model_key": model_key,
                "named_parameters": self.named_parameters, "extra": state if state is not None else {},
                "device": self.device, "zero_step": self.zero_update}

    def save(self, path: str, *, step: int, state: dict[str, Any] | None, model_key: str,
             history: recovery.History, weight_digest: str | None, keep: bool) -> recovery.History:
        from ..sharding import dcp
        verified = self.mesh.hsdp  # with one replica check 3 has nothing to compare
        facts = dcp.Facts(step=step, history=history, layout=self.mesh, weights_verified=verified,
                          weight_digest=weight_digest if verified else None,
                          parameters=[n for n, _ in self.named_parameters], run_id=self.topology.run_id)
        return dcp.save(path, **self._parts(state, model_key), facts=facts, keep=keep)

    def load(self, path: str, *, model_key: str, expect_step: int | None, expect_sha256: str | None,
             state: dict[str, Any] | None) -> tuple[int, recovery.History, str | None]:
        from ..sharding import dcp
        manifest, digest = dcp.load(path, **self._parts(state, model_key), layout=self.mesh,
                                    expect_step=expect_step, expect_sha256=expect_sha256)
        step = int(manifest["step"])
        return step, manifest_codec.resumed_history(path, manifest), digest if manifest.get("weights_verified") else None
