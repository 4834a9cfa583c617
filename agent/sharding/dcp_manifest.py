"""The manifest of a sharded checkpoint directory, and its verification without a process group.

A sharded (FSDP2) model is saved with ``torch.distributed.checkpoint`` (DCP) into a directory:
each rank writes its own ``__<rank>_<n>.distcp`` files, rank 0 the ``.metadata`` that says which
bytes hold which chunk of which tensor. Beside them rank 0 writes :data:`MANIFEST_NAME` once every
rank's files are written (docs/design.md §3, Sharded models)::

    {"schema": "sdcguard.dev/checkpoint-dcp/v1", "format": "torch.distributed.checkpoint",
     "step": 3, "sha256": "<identity>",
     "files": {".metadata": "<sha256>", "__0_0.distcp": "<sha256>", ...},
     "mesh": {"replicas": 2, "shards": 2, "grid": [[0, 1], [2, 3]]},
     "weights_verified": true,            # check 3 compared every shard across its replicas
     "model_key": "model", "state_keys": ["optimizer", "scheduler", "sdcguard"],
     "parameters": ["gain", "inp.weight", ...],
     "shards": [{"shard": 0, "ranks": [0, 2], "digest": "<fingerprint digest>",
                 "chunks": [[[0], [2]], [[0, 0], [8, 8]], ...]}, ...],
     "audited_step": ..., "audited": ..., "reduction_verified_step": ...,
     "earlier_checkpoints": [...], "replicas": 2, "verified_at": ..., "run_id": ...}

The checkpoint's identity — what an alarm names as ``last_good_checkpoint_sha256`` — is one
SHA-256 over the file list (:func:`identity`: the ``sha256sum`` lines of every file but the
manifest, sorted by name), so ``(cd DIR && sha256sum .metadata *.distcp | sort -k2 | sha256sum)``
reproduces it. A shard's ``digest`` is check 3's digest of that shard's local tensors
(``sdcguard.fingerprint``), ``chunks`` where each lies in its parameter (offsets, sizes).

:func:`verify_directory` is what ``sdcguard verify-checkpoint DIR`` runs: the manifest's form, the
step and identity an alarm named, every file's SHA-256 (and no file missing or added), then every
shard's fingerprint recomputed from the files (one parameter group at a time, through DCP's reader
without a process group).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import pathlib
import pickle
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, load
import torch.distributed.checkpoint.filesystem as dcp_filesystem
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

from ..checkpoint import CheckpointError
from ..fingerprint import digest, fingerprint_many
from ..manifest import sha256_file

MANIFEST_NAME = "sdcguard-manifest.json"
SCHEMA = "sdcguard.dev/checkpoint-dcp/v1"
FORMAT = "torch.distributed.checkpoint"
# Offline verification reads at most this many bytes of parameters at once.
READ_BUDGET_BYTES = 1 << 30


def manifest_file(path: str | os.PathLike[str]) -> Path:
    return Path(path) / MANIFEST_NAME


def is_sharded_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a directory sdcguard wrote a sharded checkpoint into."""
    return manifest_file(path).is_file()


def identity(files: Mapping[str, str]) -> str:
    """Pure: the checkpoint's SHA-256, over its file list (``sha256sum``'s lines, sorted by name)."""
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(f"{files[name]}  {name}\n".encode())
    return h.hexdigest()


def chunk_of(tensor: torch.Tensor) -> list[list[int]]:
    """``[offsets, sizes]`` of a DTensor's local shard in its parameter (a plain tensor: all of it)."""
    if hasattr(tensor, "__create_chunk_list__"):
        chunks = tensor.__create_chunk_list__()  # what DCP itself records for this rank's shard
        if chunks:
            return [list(chunks[0].offsets), list(chunks[0].sizes)]
        return [[0] * tensor.dim(), [0] * tensor.dim()]
    return [[0] * tensor.dim(), list(tensor.shape)]


def build(*, step: int, files: Mapping[str, str], grid: Sequence[Sequence[int]], weights_verified: bool,
          model_key: str, state_keys: Sequence[str], parameters: Sequence[str],
          reports: Sequence[Mapping[str, Any]], recorded: Mapping[str, Any],
          columns: Sequence[Sequence[Sequence[int]]] | None = None) -> dict[str, Any]:
    """Pure: the manifest from every rank's report (``{"digest", "chunks"}``, indexed by global
    rank) and the run's facts (``recorded``: audited step, earlier checkpoints, …). With tensor
    parallelism ``columns`` holds every TP rank's FSDP grid (``grid`` is one of them) and the
    manifest lists every (TP shard, FSDP shard) position, TP index major (:func:`position`). Raises
    CheckpointError when the replicas of a shard reported different shards."""
    shards = []
    for k, column in enumerate(columns or [grid]):
        for j in range(len(column[0])):
            ranks = [int(row[j]) for row in column]
            first = reports[ranks[0]]
            odd = [r for r in ranks if (reports[r]["digest"], reports[r]["chunks"]) != (first["digest"], first["chunks"])]
            if odd:
                raise CheckpointError(f"the replicas {ranks} of shard {j} hold different weights at the save "
                                      f"(ranks {odd} differ from rank {ranks[0]}); nothing was written")
            shards.append({"shard": j, **({"tp": k} if columns else {}), "ranks": ranks, "digest": first["digest"],
                           "chunks": first["chunks"]})
    mesh: dict[str, Any] = {"replicas": len(grid), "shards": len(grid[0]), "grid": [list(map(int, row)) for row in grid]}
    if columns:
        mesh.update(tp=len(columns), columns=[[list(map(int, row)) for row in column] for column in columns])
    return {
        "schema": SCHEMA, "format": FORMAT, "step": int(step), "files": dict(sorted(files.items())),
        "sha256": identity(files), "mesh": mesh,
        "weights_verified": bool(weights_verified), "replicas": len(grid), "model_key": model_key,
        "state_keys": sorted(state_keys), "parameters": list(parameters), "shards": shards, **recorded,
    }


def read(path: str | os.PathLike[str], *, expect_step: int | None = None,
         expect_sha256: str | None = None) -> dict[str, Any]:
    """The manifest of the directory ``path``, checked for form, for its identity against its own
    file list and, when given, for the step and identity an alarm named (the files themselves are
    checked by :func:`check_files`)."""
    where = manifest_file(path)
    try:
        manifest = json.loads(where.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} has no manifest {MANIFEST_NAME}: it was not written by sdcguard "
                              "after a passing check") from None
    except ValueError as exc:
        raise CheckpointError(f"manifest {where} is not valid JSON: {exc}") from None
    return check_form(manifest, str(path), expect_step=expect_step, expect_sha256=expect_sha256)


def check_form(manifest: Any, where: str, *, expect_step: int | None = None,
               expect_sha256: str | None = None) -> dict[str, Any]:
    """Pure: :func:`read`'s checks on a parsed manifest."""
    if not isinstance(manifest, dict) or manifest.get("schema") != SCHEMA:
        raise CheckpointError(f"{where}: its manifest does not record a sharded sdcguard checkpoint")
    for key in ("step", "sha256", "files", "mesh", "parameters", "shards", "model_key"):
        if key not in manifest:
            raise CheckpointError(f"{where}: its manifest lacks {key!r}")
    files = manifest["files"]
    if not isinstance(files, dict) or ".metadata" not in files or any(
            not isinstance(n, str) or "/" in n or n in ("", ".", "..", MANIFEST_NAME) for n in files):
        raise CheckpointError(f"{where}: its manifest's file list is malformed")
    if identity(files) != manifest["sha256"]:
        raise CheckpointError(f"{where}: its manifest's sha256 {manifest['sha256']} is not that of its own file list "
                              f"({identity(files)}): the manifest was edited")
    if expect_step is not None and int(manifest["step"]) != int(expect_step):
        raise CheckpointError(f"{where} now holds the checkpoint of step {manifest['step']}, not step {expect_step}: "
                              "it was written again after the alarm named it; do not resume from it")
    if expect_sha256 is not None and manifest["sha256"] != expect_sha256.strip().lower():
        raise CheckpointError(f"{where} is not the checkpoint the alarm named: sha256 {manifest['sha256']} "
                              f"!= {expect_sha256}")
    return manifest


def listed(path: str | os.PathLike[str]) -> list[str]:
    """The names in the directory a manifest must list: every entry but the manifest."""
    return sorted(p.name for p in Path(path).iterdir() if p.name != MANIFEST_NAME)


def hash_files(path: str | os.PathLike[str], names: Iterable[str]) -> dict[str, str | None]:
    """name -> SHA-256 of each of ``names`` in the directory (None: not there)."""
    path = Path(path)
    return {n: sha256_file(path / n) if (path / n).is_file() else None for n in names}


def judge_files(manifest: Mapping[str, Any], found: Mapping[str, str | None],
                present: Iterable[str] | None = None) -> list[str]:
    """Pure: what is wrong with the files, as sentences (empty: each is the one the manifest lists).
    ``found``: name -> SHA-256 of the files hashed (None: absent); ``present``: the directory's
    names, to compare with the manifest's list (None: not compared here)."""
    expected = manifest["files"]
    problems = []
    if present is not None:
        present = set(present)
        if missing := sorted(set(expected) - present):
            problems.append(f"files missing: {missing}")
        if extra := sorted(present - set(expected)):
            problems.append(f"files its manifest does not list: {extra}")
    for name, sha in sorted(found.items()):
        if sha is None:
            if present is None:
                problems.append(f"{name} is missing")
        elif sha != expected.get(name):
            problems.append(f"{name} was modified after it was written: sha256 {sha} != manifest {expected.get(name)}")
    return problems


def position(where: Mapping[str, int], shards: int) -> int:
    """Pure: the index in a manifest's ``shards`` of the rank at ``where`` (``ShardLayout.coordinates``)."""
    return where.get("tp", 0) * shards + where["shard"]


def judge_shard(manifest: Mapping[str, Any], shard: int, found_digest: str) -> str | None:
    """Pure: why the fingerprint ``found_digest`` of the manifest's ``shards[shard]`` is not the
    manifest's, or None."""
    entry = manifest["shards"][shard]
    want = entry["digest"]
    if found_digest == want:
        return None
    label = f"shard {entry['shard']}" + (f" of TP rank {entry['tp']}" if "tp" in entry else "")
    return f"{label} (ranks {entry['ranks']}) has fingerprint digest {found_digest}, manifest says {want}"


@dataclass(frozen=True, slots=True)
class Verification:
    path: str
    step: int
    sha256: str
    files: int
    replicas: int
    shards: int
    weights_verified: bool
    audited_step: int | None


def verify_directory(path: str | os.PathLike[str], *, expect_step: int | None = None,
                     expect_sha256: str | None = None) -> Verification:
    """Check a sharded checkpoint directory without a model or a process group: its manifest, the
    step and identity an alarm named, every file's SHA-256, and every shard's fingerprint
    recomputed from the files. Raises CheckpointError naming what differs."""
    manifest = read(path, expect_step=expect_step, expect_sha256=expect_sha256)
    problems = judge_files(manifest, hash_files(path, manifest["files"]), listed(path))
    if problems:
        raise CheckpointError(f"{path}: " + "; ".join(problems))
    found = shard_digests(path, manifest)
    problems = [p for j, d in enumerate(found) if (p := judge_shard(manifest, j, d)) is not None]
    if problems:
        raise CheckpointError(f"{path}: the weights in its files are not those fingerprinted at the save: "
                              + "; ".join(problems))
    return Verification(str(path), int(manifest["step"]), manifest["sha256"], len(manifest["files"]),
                        int(manifest["mesh"]["replicas"]), int(manifest["mesh"]["shards"]),
                        bool(manifest.get("weights_verified")), manifest.get("audited_step"))


def shard_digests(path: str | os.PathLike[str], manifest: Mapping[str, Any]) -> list[str]:
    """Each shard's fingerprint digest, recomputed from the directory's files (parameters read whole,
    a group of at most READ_BUDGET_BYTES at a time, and cut into the manifest's chunks). A
    ``model_key`` of ``""``: the parameters are top-level entries (torchtitan's flattened model state)."""
    metadata_sha256 = manifest["files"][".metadata"]
    metadata = MetadataReader(str(path), metadata_sha256).read_metadata()  # data only, the bytes hashed
    key, names = manifest["model_key"], manifest["parameters"]
    shards = manifest["shards"]
    fingerprints: list[list[Any]] = [[] for _ in shards]

    def fqn(name: str) -> str:
        return f"{key}.{name}" if key else name

    for group in _groups(names, lambda n: _nbytes(metadata.state_dict_metadata.get(fqn(n)))):
        wanted = {}
        for name in group:
            meta = metadata.state_dict_metadata.get(fqn(name))
            if not isinstance(meta, TensorStorageMetadata):
                raise CheckpointError(f"{path}: its files hold no tensor {fqn(name)}")
            wanted[name] = torch.empty(meta.size, dtype=meta.properties.dtype)
        with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": no process group, on purpose
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            load({key: wanted} if key else wanted, storage_reader=MetadataReader(str(path), metadata_sha256),
                 planner=WeightsOnlyLoadPlanner(), no_dist=True)
        for name in group:
            i = names.index(name)
            for j, shard in enumerate(shards):
                offsets, sizes = shard["chunks"][i]
                piece = wanted[name][tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
                fingerprints[j] += fingerprint_many([piece.contiguous()])
    return [digest(fps).hex() for fps in fingerprints]


def _nbytes(meta: Any) -> int:
    size = getattr(meta, "size", None)
    if size is None:
        return 0
    return int(torch.Size(size).numel()) * torch.empty((), dtype=meta.properties.dtype).element_size()


def _groups(names: Sequence[str], nbytes: Any) -> Iterable[list[str]]:
    group: list[str] = []
    total = 0
    for name in names:
        size = nbytes(name)
        if group and total + size > READ_BUDGET_BYTES:
            yield group
            group, total = [], 0
        group.append(name)
        total += size
    if group:
        yield group


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, but non-tensor entries (the step, a scheduler's state, your own
    values) load with ``torch.load(weights_only=True)``: data, never code (DCP's own loads them
    with ``weights_only=False``)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


# What DCP's ``.metadata`` pickle may build: its own metadata classes and the plain torch values they
# hold. Everything else (a function, ``os.system``, any other class) is refused before it is looked up.
_METADATA_MODULE = dcp_metadata.__name__
_METADATA_GLOBALS: dict[tuple[str, str], Any] = {
    (dcp_filesystem.__name__, "_StorageInfo"): dcp_filesystem._StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,  # a torch.layout by name
    ("pathlib", "Path"): pathlib.Path, ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath, ("pathlib", "WindowsPath"): pathlib.WindowsPath,
    ("pathlib", "PureWindowsPath"): pathlib.PureWindowsPath,
    ("collections", "OrderedDict"): __import__("collections").OrderedDict,
    ("builtins", "set"): set, ("builtins", "frozenset"): frozenset,
}


def metadata_global(module: str, name: str) -> Any:
    """Pure: what ``.metadata`` may name as ``module.name`` — a class of
    ``torch.distributed.checkpoint.metadata`` (its dataclasses and enums), the few values they hold
    (:data:`_METADATA_GLOBALS`), a ``torch`` dtype — or ``pickle.UnpicklingError``."""
    if module == _METADATA_MODULE:
        found = getattr(dcp_metadata, name, None)
        if isinstance(found, type) and not issubclass(found, type) and found.__module__ == _METADATA_MODULE:
            return found
    elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
        return getattr(torch, name)
    elif (module, name) in _METADATA_GLOBALS:
        return _METADATA_GLOBALS[(module, name)]
    raise pickle.UnpicklingError(f"a DCP .metadata may not name {module}.{name}: refused (only DCP's metadata "
                                 "classes and plain values are built)")


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        return metadata_global(module, name)


def load_metadata(data: bytes) -> Metadata:
    """Pure: DCP's ``.metadata`` from its bytes, built with a restricted unpickler (never code:
    :func:`metadata_global`). Raises CheckpointError for anything else."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # noqa: BLE001 - the unpickler raises many kinds for foreign bytes
        raise CheckpointError(f"its .metadata cannot be read as DCP metadata: {exc}") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"its .metadata holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


class MetadataReader(FileSystemReader):
    """DCP's file-system reader, but ``.metadata`` is read once, its bytes checked against the
    SHA-256 the manifest lists (when given), and those very bytes unpickled with
    :func:`load_metadata` (DCP's own reader calls ``pickle.load`` on whatever the file holds)."""

    def __init__(self, path: str | os.PathLike[str], metadata_sha256: str | None) -> None:
        super().__init__(path)
        self.metadata_sha256 = metadata_sha256

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        where = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(where, "rb") as fh:
            data = fh.read()
        if self.metadata_sha256 is not None and hashlib.sha256(data).hexdigest() != self.metadata_sha256:
            raise CheckpointError(f"{where} was modified after it was verified: sha256 "
                                  f"{hashlib.sha256(data).hexdigest()} != manifest {self.metadata_sha256}")
        metadata = load_metadata(data)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
