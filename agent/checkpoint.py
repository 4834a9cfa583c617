"""Checkpoints you can trust: written only after check 3 passes, verified when loaded.

``save_checkpoint`` is collective: rank 0 decides whether to save (its ``when``), every rank runs
check 3, and rank 0 writes *your* state dict as it is (flat keys, e.g. nanoGPT's ``model``,
``optimizer``, ``model_args``, ``iter_num``) and, beside it, a manifest ``<path>.sdcguard.json``:
the step, the weight digest it was verified at, the parameter names that digest covers, the
file's SHA-256, and the last audited step the checkpoint is covered by (``recovery``).
``load_checkpoint`` (``weights_only=True`` by default) and ``verify_checkpoint`` (no process group,
no model: what ``sdcguard verify-checkpoint`` runs) refuse a file whose bytes or weights do not
match its manifest.
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from . import manifest as manifest_codec
from . import recovery
from .checks.exchange import broadcast_json, wait
from .checks.weights import fingerprint_weights
from .contract.alarm import now_rfc3339
from .contract.spool import write_json_atomic
from .fingerprint import digest, fingerprint_many

log = logging.getLogger("sdcguard")

MANIFEST_SCHEMA = "sdcguard.dev/checkpoint/v1"
# Prefixes torch.compile and DDP put in front of a module's state-dict keys.
_WRAPPER_PREFIXES = ("_orig_mod.", "module.")


class CheckpointError(RuntimeError):
    """A checkpoint that must not be written or must not be trusted; the message says why."""


def manifest_path(path: str | os.PathLike[str]) -> Path:
    return Path(f"{os.fspath(path)}.sdcguard.json")


@dataclass(frozen=True, slots=True)
class Facts:
    """What a manifest records, as the Guard knows it when check 3 has just passed."""

    step: int
    """The last step whose update the saved weights include."""
    weight_digest: str
    """Check 3's digest of those weights."""
    parameters: list[str]
    """The parameter names the digest covers, in order."""
    model_key: str
    history: recovery.History
    """What the run had verified by then (audits, reductions, earlier checkpoints)."""
    replicas: int
    run_id: str


def save(path: str | os.PathLike[str], state: Mapping[str, Any], facts: Facts, *, keep: bool, writer: bool,
         device: torch.device, group: dist.ProcessGroup | None) -> recovery.History:
    """Write ``state`` and its manifest at ``path`` (on the ``writer`` rank; with a process group,
    every rank calls and learns the outcome), keeping first the file ``path`` held when a later
    alarm may still name it (``recovery.plan_save``). Returns the history with the new entry."""
    path = Path(path)
    plan = recovery.plan_save(facts.history, str(path), facts.step, keep=keep)
    outcome: dict[str, Any] = {"failure": None, "sha256": None, "kept": None}
    failed: Exception | None = None
    if writer:
        try:
            outcome["kept"] = keep_file(plan.keep) if plan.keep is not None else None
            outcome["sha256"] = _write(path, state, facts, plan, outcome["kept"])
            _remove(plan.remove, path.parent)
        except Exception as exc:  # noqa: BLE001 - a full disk is torch.save's RuntimeError, a state that
            # does not pickle its own error: any of them, every rank must learn it (none left waiting)
            failed, outcome["failure"] = exc, f"{type(exc).__name__}: {exc}"
    if group is not None:  # every rank learns what the writer did (and waits until it has)
        outcome = broadcast_json(outcome if writer else None, 0, device, group)
    if outcome["failure"] is not None:
        raise CheckpointError(f"checkpoint {path} was not written: {outcome['failure']}") from failed
    saved = recovery.Checkpoint(facts.step, str(path), facts.history.last_audited_step, outcome["sha256"])
    if writer:
        recovery.log_plan(plan, outcome["kept"], saved)
    return recovery.after_save(facts.history, plan, saved, outcome["kept"])


def manifest_step(known: int | None, given: int | None, path: Any) -> int:
    """The step a checkpoint written now holds: the Guard's count; the caller's must agree."""
    if known is None:
        raise CheckpointError(f"refusing to write {path}: no checked step has updated the weights yet "
                              "(a checkpoint holds the state after a step's update)")
    if given is not None and int(given) != known:
        raise CheckpointError(
            f"save_checkpoint({path}, step={given}): the weights hold the update of step {known}, not {given}. "
            "A checkpoint's step is the last step whose update its weights include (a save at the top of "
            f"iteration {known + 1}, as nanoGPT does, holds step {known}); leave step out and sdcguard records it")
    return known


def keep_file(entry: recovery.Checkpoint) -> str | None:
    """Keep the file of ``entry`` (its path is about to be written again, or removed by a framework's
    rotation) under its kept name (``recovery.kept_path``), with its manifest; return that name, or
    None when the path no longer holds the entry."""
    source = Path(entry.path)
    try:
        manifest = read_manifest(source)
    except CheckpointError:
        manifest = {}
    if int(manifest.get("step", -1)) != entry.step or (entry.sha256 and manifest.get("sha256") != entry.sha256):
        log.warning("sdcguard: %s no longer holds the checkpoint of step %d; nothing to keep", source, entry.step)
        return None
    target = Path(recovery.kept_path(str(source), entry.step))
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(source, tmp)  # the new save replaces the path's directory entry, not this inode
    except OSError:
        shutil.copy2(source, tmp)  # a filesystem without hard links
    os.replace(tmp, target)
    write_json_atomic(manifest_path(target), json.dumps(manifest, indent=2, sort_keys=True))
    recovery.remember_kept(str(target))
    return str(target)


def _remove(paths: tuple[str, ...], directory: Path) -> None:
    """Remove kept files below the floor, and their manifests: only those ``recovery.removable``
    allows (kept names in the checkpoint's own directory, or kept by this run); never another path
    a manifest names."""
    for path in recovery.removable(paths, str(directory)):
        for victim in (Path(path), manifest_path(path)):
            victim.unlink(missing_ok=True)


def _write(path: Path, state: Mapping[str, Any], facts: Facts, plan: recovery.SavePlan, kept_as: str | None) -> str:
    """Write ``state`` and its manifest; return the file's SHA-256."""
    saved_digest = state_digest(state, facts.model_key, facts.parameters, where=str(path))
    if saved_digest != facts.weight_digest:
        raise CheckpointError(f"state[{facts.model_key!r}] does not hold the weights check 3 just verified "
                              "(pass the model's own state_dict)")
    _save_atomic(dict(state), path)
    history = facts.history
    sha256 = manifest_codec.sha256_file(path)
    write_json_atomic(manifest_path(path), json.dumps({
        "schema": MANIFEST_SCHEMA, "step": facts.step, "verified": True,
        "weight_digest": facts.weight_digest, "sha256": sha256,
        "model_key": facts.model_key, "parameters": facts.parameters,
        **manifest_codec.verification_fields(history, facts.step, str(path), plan, kept_as),
        "replicas": facts.replicas,
        "verified_at": now_rfc3339(), "run_id": facts.run_id,
    }, indent=2, sort_keys=True))
    return sha256


def load_checkpoint(path: str | os.PathLike[str], model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None,
                    scaler: torch.amp.GradScaler | None = None,
                    map_location: Any = "cpu", *, model_key: str | None = None,
                    weights_only: bool = True, expect_step: int | None = None,
                    expect_sha256: str | None = None) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` after verifying it; return its state.

    ``model`` is the bare module (the DDP / torch.compile prefixes of the saved keys are removed).
    ``expect_step`` / ``expect_sha256``: what the alarm named (``last_good_checkpoint_step`` /
    ``_sha256``); a file that holds anything else is refused. Raises CheckpointError on any
    mismatch and leaves the model untouched when the file is wrong."""
    state, manifest = read_state(path, map_location=map_location, weights_only=weights_only,
                                 expect_step=expect_step, expect_sha256=expect_sha256)
    apply_state(path, state, manifest, model, optimizer, scaler, model_key=model_key)
    return state


def read_state(path: str | os.PathLike[str], *, map_location: Any = "cpu", weights_only: bool = True,
               expect_step: int | None = None, expect_sha256: str | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(state, manifest)``: the file read, its bytes matching its manifest (and what an alarm
    named), nothing loaded anywhere yet (the part of a load that one rank alone can fail: a file
    its node does not see)."""
    path = Path(path)
    manifest = read_manifest(path, expect_step=expect_step, expect_sha256=expect_sha256)
    return _verified_state(path, manifest, map_location, weights_only), manifest


def apply_state(path: str | os.PathLike[str], state: Mapping[str, Any], manifest: Mapping[str, Any],
                model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                scaler: torch.amp.GradScaler | None = None, *, model_key: str | None = None) -> None:
    """Load a state :func:`read_state` returned into the model, the optimizer and the scaler; the
    model's weights must then have the manifest's digest."""
    key = model_key or manifest.get("model_key", "model")
    model.load_state_dict(_strip_prefixes(state[key]))
    loaded = fingerprint_weights(list(model.named_parameters())).digest.hex()
    if loaded != manifest["weight_digest"]:
        raise CheckpointError(f"{path}: loaded weights have digest {loaded}, manifest says {manifest['weight_digest']}")
    if optimizer is not None and state.get("optimizer") is not None:
        optimizer.load_state_dict(state["optimizer"])
    if scaler is not None and state.get("scaler") is not None:
        scaler.load_state_dict(state["scaler"])


def read_verified_state(path: str | os.PathLike[str], *, map_location: Any = "cpu", expect_step: int | None = None,
                        expect_sha256: str | None = None,
                        allow_globals: Sequence[Any] = ()) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(state, manifest)`` of a checkpoint file whose bytes, step and weights match its manifest
    (and what an alarm named), read with ``weights_only=True`` (besides tensors and plain values,
    only the classes ``allow_globals`` names), before anything is loaded into a model: what
    :func:`verify_checkpoint` checks, for a caller that loads the state its own way (a sharded
    pipeline stage)."""
    path = Path(path)
    manifest = read_manifest(path, expect_step=expect_step, expect_sha256=expect_sha256)
    if "parameters" not in manifest:
        raise CheckpointError(f"manifest {manifest_path(path)} lists no parameters")
    state = _verified_state(path, manifest, map_location, True, allow_globals)
    key = manifest.get("model_key", "model")
    found = state_digest(state, key, manifest["parameters"], where=str(path))
    if found != manifest["weight_digest"]:
        raise CheckpointError(f"{path}: its weights have digest {found}, manifest says {manifest['weight_digest']}")
    return state, manifest


@dataclass(frozen=True, slots=True)
class Verification:
    path: str
    step: int
    audited_step: int | None
    audited: bool
    weight_digest: str
    parameters: int
    sha256: str


def verify_checkpoint(path: str | os.PathLike[str], *, expect_step: int | None = None,
                      expect_sha256: str | None = None, allow_globals: Sequence[Any] = ()) -> Verification:
    """Check a checkpoint file against its manifest without a model or a process group: its
    SHA-256, its step, and the digest of the parameters it holds; with ``expect_step`` /
    ``expect_sha256``, also that it is the checkpoint an alarm named. The file is read with
    ``torch.load(weights_only=True)`` from the very bytes that were hashed, building besides its
    tensors and plain values only the classes in ``allow_globals`` (ValueError for a function, any
    other callable, or anything from :data:`REFUSED_MODULES`: see :func:`refuse_global`). Raises
    CheckpointError (:class:`UnsafeGlobals` for a file that holds other objects, naming them)."""
    _, manifest = read_verified_state(path, expect_step=expect_step, expect_sha256=expect_sha256,
                                      allow_globals=check_allowed(allow_globals))
    return Verification(str(path), int(manifest["step"]), manifest.get("audited_step"), bool(manifest.get("audited")),
                        manifest["weight_digest"], len(manifest["parameters"]), manifest["sha256"])


def read_manifest(path: str | os.PathLike[str], *, expect_step: int | None = None,
                  expect_sha256: str | None = None) -> dict[str, Any]:
    """The manifest of ``path``, checked for form and, when given, for the step and SHA-256 an
    alarm named (the file's own bytes are checked against the manifest when it is loaded)."""
    where = manifest_path(path)
    try:
        manifest = json.loads(where.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} has no manifest {where.name}: it was not written by sdcguard after a passing check") from None
    except ValueError as exc:
        raise CheckpointError(f"manifest {where} is not valid JSON: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("schema") != MANIFEST_SCHEMA or manifest.get("verified") is not True:
        raise CheckpointError(f"manifest {where} does not record a verified checkpoint")
    for key in ("step", "weight_digest", "sha256"):
        if key not in manifest:
            raise CheckpointError(f"manifest {where} lacks {key!r}")
    if expect_step is not None and int(manifest["step"]) != int(expect_step):
        raise CheckpointError(f"{path} now holds the checkpoint of step {manifest['step']}, not step {expect_step}: "
                              "it was written again after the alarm named it; do not resume from it")
    if expect_sha256 is not None and manifest["sha256"] != expect_sha256.strip().lower():
        raise CheckpointError(f"{path} is not the file the alarm named: sha256 {manifest['sha256']} != {expect_sha256}")
    return manifest


def verified_manifest(path: str | os.PathLike[str], *, expect_step: int | None = None,
                      expect_sha256: str | None = None) -> dict[str, Any]:
    """The manifest of ``path`` (as :func:`read_manifest` checks it) with the file's bytes checked
    against it: what to call before a framework loads the file itself (Lightning's
    ``trainer.fit(ckpt_path=)``). The weights are the caller's to check once loaded."""
    manifest = read_manifest(path, expect_step=expect_step, expect_sha256=expect_sha256)
    _check_bytes(Path(path), manifest)
    return manifest


def _check_bytes(path: Path, manifest: Mapping[str, Any]) -> None:
    actual = manifest_codec.sha256_file(path)
    if actual != manifest["sha256"]:
        raise CheckpointError(f"{path} was modified after it was verified: sha256 {actual} != manifest {manifest['sha256']}")


class UnsafeGlobals(CheckpointError):
    """The file is the one its manifest names, but holds objects that ``torch.load(weights_only=True)``
    refuses to build (e.g. a ``pathlib.Path`` among Lightning's hyperparameters). ``refused``: the
    names among them that can never be allowed (:func:`refused_name`): such a file is not to be
    loaded at all."""

    def __init__(self, path: Path, names: list[str]) -> None:
        self.names = names
        self.refused = [n for n in names if refused_name(n)]
        if self.refused:
            message = (f"{path} holds references to functions or modules that can run code or touch the system "
                       f"({', '.join(self.refused)}): sdcguard never allows these; do not load this file")
        else:
            message = (f"{path} matches its manifest but holds objects torch.load(weights_only=True) does not "
                       f"build: {', '.join(names)}. Only if these are classes you know to hold plain data, allow "
                       "exactly those (sdcguard verify-checkpoint --allow-global MODULE.CLASS; in Python, "
                       "verify_checkpoint(allow_globals=[...])); functions are never allowed")
        super().__init__(message)


# Modules whose functions or classes run code, start processes, load native code, import modules,
# open sockets, or open, write or remove files: nothing from them may be built by the unpickler
# (``--allow-global``), whatever the user asks. Matched on the top-level package and on the module.
REFUSED_MODULES = frozenset({
    "builtins", "__builtin__", "__main__", "os", "posix", "nt", "posixpath", "ntpath", "subprocess",
    "_posixsubprocess", "sys", "importlib", "pkgutil", "zipimport", "runpy", "site", "sysconfig", "shutil",
    "glob", "fileinput", "tempfile", "io", "_io", "codecs", "pickle", "_pickle", "copyreg", "marshal",
    "shelve", "dbm", "sqlite3", "code", "codeop", "pdb", "bdb", "cmd", "inspect", "types", "functools",
    "operator", "_operator", "ctypes", "_ctypes", "cffi", "multiprocessing", "concurrent", "threading",
    "_thread", "asyncio", "signal", "socket", "ssl", "select", "selectors", "mmap", "pty", "tty", "termios",
    "fcntl", "resource", "gc", "webbrowser", "http", "urllib", "ftplib", "smtplib", "telnetlib", "xmlrpc",
    "logging", "gzip", "bz2", "lzma", "zipfile", "tarfile", "wave", "aifc", "sunau", "mailbox", "setuptools",
    "distutils", "pip", "torch.package", "torch.hub", "torch.jit", "torch._C", "torch.utils.cpp_extension",
    "torch.serialization", "torch._dynamo", "torch._inductor",
})


def refused_name(name: str) -> bool:
    """Pure: whether the global ``name`` (``module.qualname``) lies in a module nothing is ever
    allowed from (:data:`REFUSED_MODULES`), judged on the name alone (nothing is imported)."""
    parts = name.split(".")
    return any(".".join(parts[:i]) in REFUSED_MODULES for i in range(1, len(parts)))


def refuse_global(entry: Any) -> str | None:
    """Pure: why ``entry`` (a class, or ``(class, "module.Name")`` as torch takes it) may not be
    allowed for ``torch.load(weights_only=True)`` to build, or None when it may. The weights-only
    unpickler *calls* what it is allowed (``REDUCE``), so only classes, never a function or any
    other callable, nor a metaclass, nor anything from :data:`REFUSED_MODULES`."""
    obj, named = entry if isinstance(entry, tuple) and len(entry) == 2 else (entry, None)
    if named is not None and (not isinstance(named, str) or refused_name(named)):
        return f"{named!r} names a refused module"
    if not isinstance(obj, type):
        return (f"{obj!r} is not a class: the weights-only unpickler calls what it is allowed, so functions "
                "and other callables are never allowed")
    if issubclass(obj, type):
        return f"{obj.__module__}.{obj.__qualname__} is a metaclass (it builds classes)"
    where = f"{obj.__module__}.{obj.__qualname__}"
    if refused_name(where):
        return f"{where} is from a module that can run code or touch the system; it is never allowed"
    return None


def check_allowed(allow_globals: Sequence[Any]) -> list[Any]:
    """``allow_globals`` when every entry passes :func:`refuse_global`; else ValueError naming why."""
    reasons = [r for g in allow_globals if (r := refuse_global(g)) is not None]
    if reasons:
        raise ValueError("refused allow-list entries: " + "; ".join(reasons))
    return list(allow_globals)


def _read_verified(path: Path, manifest: Mapping[str, Any]) -> bytes:
    """The file's bytes, read once, when they hash to the manifest's SHA-256: what is unpickled is
    exactly what was hashed (the file is never opened again, so it cannot be swapped in between)."""
    data = path.read_bytes()
    actual = hashlib.sha256(data).hexdigest()
    if actual != manifest["sha256"]:
        raise CheckpointError(f"{path} was modified after it was verified: sha256 {actual} != manifest {manifest['sha256']}")
    return data


def _verified_state(path: Path, manifest: dict[str, Any], map_location: Any, weights_only: bool,
                    allow_globals: Sequence[Any] = ()) -> dict[str, Any]:
    allowed = check_allowed(allow_globals)
    data = _read_verified(path, manifest)
    try:
        with torch.serialization.safe_globals(allowed):
            state = torch.load(io.BytesIO(data), map_location=map_location, weights_only=weights_only)
    except Exception as exc:  # noqa: BLE001 - torch raises many kinds for a file it cannot read
        unsafe = _unsafe_globals(data, allowed) if weights_only else []
        if unsafe:
            raise UnsafeGlobals(path, unsafe) from None
        raise CheckpointError(f"{path} cannot be loaded: {exc}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} does not hold a state dict")
    if "step" in state and state["step"] != manifest["step"]:
        raise CheckpointError(f"{path} holds step {state['step']} but its manifest says {manifest['step']}")
    return state


def _unsafe_globals(data: bytes, allowed: Sequence[Any]) -> list[str]:
    """The globals in the file's bytes that weights_only loading refuses and ``allowed`` does not name."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data))
    except Exception:  # noqa: BLE001 - not a readable torch.save file: the load's own error says so
        return []
    given = {g[1] if isinstance(g, tuple) else f"{getattr(g, '__module__', '')}.{getattr(g, '__qualname__', '')}"
             for g in allowed}
    return [n for n in names if n not in given]


def state_digest(state: Mapping[str, Any], model_key: str, names: list[str], where: str) -> str:
    """The weight digest (check 3's) of the parameters ``names`` in ``state[model_key]`` (the DDP
    and torch.compile prefixes of its keys removed); ``where`` names the file in errors."""
    if model_key not in state or not isinstance(state[model_key], Mapping):
        raise CheckpointError(f"{where}: the checkpoint state has no model state dict under {model_key!r}")
    tensors = _strip_prefixes(state[model_key])
    missing = [n for n in names if n not in tensors]
    if missing:
        raise CheckpointError(f"{where}: state[{model_key!r}] lacks parameters {missing[:5]}"
                              + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    return digest(fingerprint_many(tensors[n] for n in names)).hex()


def _strip_prefixes(model_state: Mapping[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in model_state.items():
        while key.startswith(_WRAPPER_PREFIXES):
            key = key.split(".", 1)[1]
        out[key] = value
    return out


def rank0_says(when: bool, device: torch.device, group: dist.ProcessGroup | None, solo: bool) -> bool:
    """Rank 0's ``when``, on every rank (one broadcast)."""
    if solo:
        return when
    flag = torch.tensor([1 if when else 0], dtype=torch.int64, device=device)
    wait(dist.broadcast(flag, src=0 if group is None else dist.get_global_rank(group, 0), group=group, async_op=True))
    return bool(flag.item())


def _save_atomic(state: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(state, tmp)
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)
