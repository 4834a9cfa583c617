"""Security, round 3 (issue 32), items 8 and 12: what a checkpoint's files and manifests can make
sdcguard do.

8. ``verify-checkpoint`` must never run code: ``--allow-global`` takes only classes (never a
   function, nothing from builtins/os/subprocess/...), the bytes unpickled are the bytes hashed,
   and DCP's ``.metadata`` is read with a restricted unpickler.
12. A resumed run deletes only what sdcguard itself keeps beside a checkpoint (``recovery.may_remove``),
   never a path a tampered manifest names.

Each attack test's docstring says what the attack did before the fix. One process, no process group.
"""
from __future__ import annotations

import builtins
import hashlib
import io
import json
import logging
import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import sdcguard
from sdcguard import recovery
from sdcguard import checkpoint as ck
from sdcguard.checkpoint import CheckpointError, load_checkpoint, manifest_path, verify_checkpoint
from sdcguard.cli import main as cli
from sdcguard.config import Config
from sdcguard.fingerprint import digest, fingerprint_many
from sdcguard.sharding import dcp_manifest


# -- helpers ---------------------------------------------------------------------------------------

def _guard():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def loss_fn(module, batch):
        x, y = batch
        return ((module(x).squeeze(-1) - y) ** 2).mean()

    return model, opt, sdcguard.Guard(model, opt, loss_fn, config=Config())


def _train(guard, steps):
    for step in steps:
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        guard.train_step(step, (x, x.sum(dim=1)))


def _saved(tmp_path: Path) -> Path:
    _, _, guard = _guard()
    _train(guard, range(2))
    return Path(guard.save_checkpoint(tmp_path / "ckpt.pt"))


def _tamper(path: Path, extra: dict) -> None:
    """What an attacker who can write the checkpoint's folder does: rewrite the file with ``extra``
    entries and make its manifest agree with the new bytes (the manifest is not signed)."""
    state = torch.load(path, weights_only=True)
    torch.save({**state, **extra}, path, pickle_module=_AsWritten)
    where = manifest_path(path)
    manifest = json.loads(where.read_text())
    manifest["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    where.write_text(json.dumps(manifest))


class _Pickler(pickle.Pickler):
    """Writes module names as they are (``subprocess``, ``builtins``), not Python 2's."""

    def __init__(self, file, protocol=2, **_):
        super().__init__(file, protocol, fix_imports=False)


class _AsWritten:
    __name__ = "pickle"
    Pickler = _Pickler


class _Evaluates:
    """Pickles as a call of ``builtins.eval`` on Python source."""

    def __init__(self, source: str) -> None:
        self.source = source

    def __reduce__(self):
        return eval, (self.source,)


class _RunsCommand:
    """Pickles as a call of ``os.system`` (global ``posix.system``)."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


class _StartsProcess:
    """Pickles as a call of the class ``subprocess.Popen``."""

    def __init__(self, argv: list[str]) -> None:
        self.argv = argv

    def __reduce__(self):
        import subprocess
        return subprocess.Popen, (self.argv,)


# -- item 8: verify-checkpoint runs no code --------------------------------------------------------

def test_allow_global_builtins_eval_cannot_run_code(tmp_path, capsys):
    """Before: ``--allow-global builtins.eval`` was accepted (any callable was); the weights-only
    unpickler then *called* ``eval`` on the file's string, and the Python code in a tampered
    checkpoint ran as the person verifying it (here: it created ``pwned``)."""
    path = _saved(tmp_path)
    marker = tmp_path / "pwned"
    _tamper(path, {"hparams": _Evaluates(f"open({str(marker)!r}, 'w').close()")})
    assert cli(["verify-checkpoint", str(path), "--allow-global", "builtins.eval"]) == 2
    assert not marker.exists()
    assert "never allowed" in capsys.readouterr().err
    with pytest.raises(ValueError, match="not a class"):
        verify_checkpoint(path, allow_globals=[eval])
    assert not marker.exists()


def test_allow_global_subprocess_popen_cannot_start_a_process(tmp_path):
    """Before: ``--allow-global subprocess.Popen`` (a class) was accepted, and the unpickler built
    ``Popen([...])`` from the file: the tampered checkpoint started a process (``touch pwned``)."""
    path = _saved(tmp_path)
    marker = tmp_path / "pwned"
    _tamper(path, {"hparams": _StartsProcess(["touch", str(marker)])})
    assert cli(["verify-checkpoint", str(path), "--allow-global", "subprocess.Popen"]) == 2
    import subprocess
    with pytest.raises(ValueError, match="never allowed"):
        verify_checkpoint(path, allow_globals=[subprocess.Popen])
    assert not marker.exists()


@pytest.mark.parametrize("payload,name", [(_RunsCommand("true"), "posix.system"),
                                          (_Evaluates("0"), "builtins.eval")])
def test_the_refusal_of_a_code_running_file_never_suggests_allowing_it(tmp_path, payload, name):
    """Before: a file holding ``posix.system`` or ``builtins.eval`` was answered "If you trust them,
    allow exactly those (--allow-global NAME)", naming them: the message led to the attack above."""
    path = _saved(tmp_path)
    _tamper(path, {"hparams": payload})
    with pytest.raises(ck.UnsafeGlobals) as caught:
        verify_checkpoint(path)
    assert getattr(caught.value, "refused", None) == [name]
    assert "--allow-global" not in str(caught.value) and "do not load this file" in str(caught.value)


def test_a_plain_class_can_still_be_allowed(tmp_path, capsys):
    """The one use ``--allow-global`` exists for (a ``pathlib.PosixPath`` among Lightning's
    hyperparameters) still works, and the message for it still says how."""
    path = _saved(tmp_path)
    _tamper(path, {"hparams": {"root": Path("/data")}})
    assert cli(["verify-checkpoint", str(path)]) == 2
    assert "--allow-global MODULE.CLASS" in capsys.readouterr().err
    assert cli(["verify-checkpoint", str(path), "--allow-global", "pathlib.PosixPath"]) == 0


@pytest.mark.parametrize("entry", [os.system, print, eval, type, object, str, io.FileIO, logging.FileHandler,
                                   (os.system, "collections.OrderedDict"), (Path, "os.system"),
                                   torch.serialization.load, torch.jit.ScriptModule])
def test_refuse_global_refuses_functions_metaclasses_and_system_modules(entry):
    assert ck.refuse_global(entry) is not None
    with pytest.raises(ValueError):
        ck.check_allowed([entry])


@pytest.mark.parametrize("entry", [Path, __import__("argparse").Namespace, __import__("collections").OrderedDict,
                                   __import__("enum").Enum])
def test_refuse_global_admits_plain_classes(entry):
    assert ck.refuse_global(entry) is None


def test_refused_names_are_judged_without_importing():
    refused = ck.refused_name
    assert refused("posix.system") and refused("builtins.eval") and refused("os.path.join")
    assert refused("subprocess.Popen") and refused("torch.jit._script.ScriptModule")
    assert not refused("pathlib.PosixPath") and not refused("argparse.Namespace")
    assert not refused("ossified.Thing")  # a prefix of a name is not its module


def _swap_on_second_open(monkeypatch, path: Path, new_bytes: bytes) -> list[int]:
    """An attacker who wins the race: ``path`` holds ``new_bytes`` from its second opening on."""
    opened = [0]
    real_open = io.open

    def hooked(file, mode="r", *args, **kwargs):
        if "r" in mode and isinstance(file, (str, os.PathLike)) and os.path.abspath(file) == str(path):
            opened[0] += 1
            if opened[0] == 2:
                fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
                os.write(fd, new_bytes)
                os.close(fd)
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(io, "open", hooked)
    monkeypatch.setattr(builtins, "open", hooked)
    return opened


def _swap_after_first_read(monkeypatch, path: Path, new_bytes: bytes) -> list[int]:
    """An attacker who wins the race: ``path`` holds ``new_bytes`` once its first reader closed it
    (whoever reads it next, Python or native code)."""
    opened = [0]
    real_open = io.open

    def hooked(file, mode="r", *args, **kwargs):
        handle = real_open(file, mode, *args, **kwargs)
        if "r" in mode and isinstance(file, (str, os.PathLike)) and os.path.abspath(file) == str(path):
            opened[0] += 1
            if opened[0] == 1:
                close = handle.close

                def swap_after_close():
                    close()
                    fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
                    os.write(fd, new_bytes)
                    os.close(fd)
                handle.close = swap_after_close
        return handle

    monkeypatch.setattr(io, "open", hooked)
    monkeypatch.setattr(builtins, "open", hooked)
    return opened


def test_a_file_swapped_after_hashing_is_not_what_gets_loaded(tmp_path, monkeypatch):
    """Before: the file was hashed, then opened again by ``torch.load``; bytes swapped in between
    (same weights, an optimizer with ``lr=1000``) passed every check and were loaded into the run."""
    path = _saved(tmp_path).resolve()
    state = torch.load(path, weights_only=True)
    state["optimizer"]["param_groups"][0]["lr"] = 1000.0
    buf = io.BytesIO()
    torch.save(state, buf)
    _swap_on_second_open(monkeypatch, path, buf.getvalue())
    model, opt, _ = _guard()
    loaded = load_checkpoint(path, model, opt)
    monkeypatch.undo()
    assert loaded["optimizer"]["param_groups"][0]["lr"] == 1e-2
    assert opt.param_groups[0]["lr"] == 1e-2


# -- item 8: a DCP directory's .metadata is never a way to run code -------------------------------

def _dcp_checkpoint(path: Path) -> dict:
    """A one-rank DCP directory with an sdcguard manifest, written in-process."""
    import torch.distributed.checkpoint as dcp
    torch.manual_seed(0)
    params = {"w": torch.randn(3, 4), "b": torch.randn(4)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": params}, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)
    files = dcp_manifest.hash_files(path, dcp_manifest.listed(path))
    names = list(params)
    report = {"digest": digest(fingerprint_many(params[n] for n in names)).hex(),
              "chunks": [dcp_manifest.chunk_of(params[n]) for n in names]}
    manifest = dcp_manifest.build(step=3, files=files, grid=[[0]], weights_verified=True, model_key="model",
                                  state_keys=[], parameters=names, reports=[report], recorded={})
    dcp_manifest.manifest_file(path).write_text(json.dumps(manifest))
    return manifest


def _rewrite_metadata(path: Path, data: bytes) -> None:
    """The attacker's side: new ``.metadata`` bytes, and a manifest that agrees with them."""
    (path / ".metadata").write_bytes(data)
    where = dcp_manifest.manifest_file(path)
    manifest = json.loads(where.read_text())
    manifest["files"][".metadata"] = hashlib.sha256(data).hexdigest()
    manifest["sha256"] = dcp_manifest.identity(manifest["files"])
    where.write_text(json.dumps(manifest))


def test_a_dcp_metadata_pickle_cannot_run_a_command(tmp_path):
    """Before: a DCP directory whose manifest agrees with its own file list (anyone who can write
    the directory can make it so) had its ``.metadata`` read with ``pickle.load`` unless ``--sha256``
    was given: a ``.metadata`` that pickles ``os.system("touch pwned")`` ran the command."""
    ckpt = tmp_path / "step-3"
    _dcp_checkpoint(ckpt)
    assert cli(["verify-checkpoint", str(ckpt)]) == 0
    marker = tmp_path / "pwned"
    _rewrite_metadata(ckpt, pickle.dumps(_RunsCommand(f"touch {marker}")))
    assert cli(["verify-checkpoint", str(ckpt)]) == 1
    assert not marker.exists()


def test_the_metadata_unpickler_builds_dcp_metadata_and_nothing_else(tmp_path):
    ckpt = tmp_path / "step-3"
    _dcp_checkpoint(ckpt)
    metadata = dcp_manifest.load_metadata((ckpt / ".metadata").read_bytes())
    assert "model.w" in metadata.state_dict_metadata
    for module, name in [("posix", "system"), ("builtins", "eval"), ("torch", "load"), ("subprocess", "Popen"),
                         ("torch.distributed.checkpoint.metadata", "dataclass"), ("torch", "Tensor")]:
        with pytest.raises(pickle.UnpicklingError):
            dcp_manifest.metadata_global(module, name)
    with pytest.raises(CheckpointError, match="not DCP metadata"):
        dcp_manifest.load_metadata(pickle.dumps({"a": 1}))


def test_a_dcp_metadata_changed_after_hashing_is_refused(tmp_path):
    """``.metadata`` was hashed by the file check, then opened again by DCP's reader: the reader
    now hashes the very bytes it unpickles, so bytes changed in between are refused, never read."""
    ckpt = (tmp_path / "step-3").resolve()
    manifest = _dcp_checkpoint(ckpt)
    reader = dcp_manifest.MetadataReader(str(ckpt), manifest["files"][".metadata"])
    (ckpt / ".metadata").write_bytes((ckpt / ".metadata").read_bytes() + b"\0")
    with pytest.raises(CheckpointError, match="modified after it was verified"):
        reader.read_metadata()


# -- item 12: a resumed run deletes only what sdcguard keeps beside its checkpoint ------------------

def test_a_tampered_manifest_cannot_make_a_resumed_run_delete_another_checkpoint(tmp_path, caplog):
    """Before: a resumed run trusted ``earlier_checkpoints[].path`` of its manifest; an entry marked
    as a kept copy below the resume floor was deleted at the next save, wherever it was. Editing the
    manifest (no signature) to name another team's checkpoint deleted that file and its manifest."""
    victim_dir, run_dir = tmp_path / "team-b", tmp_path / "team-a"
    _, _, other = _guard()
    _train(other, range(2))
    victim = Path(other.save_checkpoint(victim_dir / "ckpt.pt"))
    victim_manifest = json.loads(manifest_path(victim).read_text())

    _, _, guard = _guard()
    _train(guard, range(3))
    ckpt = Path(guard.save_checkpoint(run_dir / "ckpt.pt"))
    where = manifest_path(ckpt)
    manifest = json.loads(where.read_text())
    manifest["earlier_checkpoints"] = [{"step": 1, "path": str(victim), "audited_step": None,
                                        "sha256": victim_manifest["sha256"], "kept_from": str(run_dir / "x.pt"),
                                        "cross_checked": True}]
    where.write_text(json.dumps(manifest))

    model, opt, resumed = _guard()
    assert resumed.load_checkpoint(ckpt) == 2
    assert (1, str(victim)) in resumed.checkpoints  # it still holds its step: the history inherits it
    _train(resumed, range(3, 6))
    resumed.history.last_audited_step = 5
    with caplog.at_level(logging.WARNING, logger="sdcguard"):
        resumed.save_checkpoint(ckpt)
    assert victim.exists() and manifest_path(victim).exists()
    assert f"refusing to delete {victim}" in caplog.text


def test_kept_copies_in_the_checkpoints_own_directory_are_still_pruned(tmp_path):
    """The rule does not stop what it exists for: kept copies below the floor are removed."""
    _, _, guard = _guard()
    ckpt = tmp_path / "ckpt.pt"
    _train(guard, range(3))
    guard.history.last_audited_step = 0
    guard.save_checkpoint(ckpt)
    _train(guard, range(3, 6))
    guard.history.last_audited_step = 3
    guard.save_checkpoint(ckpt)
    kept = tmp_path / "ckpt.sdcguard-step2.pt"
    assert kept.exists()
    _train(guard, range(6, 9))
    guard.history.last_audited_step = 8
    guard.save_checkpoint(ckpt)
    assert not kept.exists() and not manifest_path(kept).exists()


@pytest.mark.parametrize("path,why", [
    ("/ckpt/ckpt.sdcguard-step2.pt", None),
    ("/ckpt/step-3.sdcguard-step3", None),
    ("/ckpt/./ckpt.sdcguard-step12.pt", None),
    ("/ckpt/ckpt.pt", "name"),
    ("/ckpt/ckpt.sdcguard-step2.pt.sdcguard.json", "name"),
    ("/ckpt/ckpt.sdcguard-stepX.pt", "name"),
    ("/ckpt/.bashrc", "name"),
    ("/other/ckpt.sdcguard-step2.pt", "directory"),
    ("/ckpt/../other/ckpt.sdcguard-step2.pt", "directory"),
    ("/ckpt/sub/ckpt.sdcguard-step2.pt", "directory"),
    ("/etc/passwd", "directory"),
])
def test_may_remove_keeps_deletions_to_kept_names_in_the_checkpoints_directory(path, why):
    found = recovery.may_remove(path, "/ckpt")
    if why is None:
        assert found is None
    else:
        assert found is not None and why in found


def test_may_remove_allows_what_this_run_kept_and_never_a_link():
    assert recovery.may_remove("/elsewhere/ckpt.sdcguard-step2.pt", "/ckpt",
                               written={"/elsewhere/ckpt.sdcguard-step2.pt"}) is None
    assert "link" in recovery.may_remove("/ckpt/ckpt.sdcguard-step2.pt", "/ckpt", is_link=True)
    assert "link" in recovery.may_remove("/elsewhere/x", "/ckpt", written={"/elsewhere/x"}, is_link=True)


def test_a_kept_name_that_is_a_link_to_elsewhere_is_not_followed(tmp_path):
    """A manifest can name a symbolic link with a kept name in the checkpoint's directory, pointing
    elsewhere: it is refused (neither the link nor what it points to is removed)."""
    target = tmp_path / "precious"
    target.mkdir()
    (target / dcp_manifest.MANIFEST_NAME).write_text("{}")
    link = tmp_path / "ckpt" / "step-3.sdcguard-step3"
    link.parent.mkdir()
    link.symlink_to(target)
    assert recovery.removable((str(link),), str(link.parent)) == []
    assert target.exists()


def _trainer_folder(folder: Path) -> None:
    """A ``checkpoint-N`` folder as sdcguard's Hugging Face integration writes it (in-process)."""
    from safetensors.torch import save_file

    from sdcguard import checkpoint_folder
    folder.mkdir()
    torch.manual_seed(0)
    weights = {"w": torch.randn(3, 4), "b": torch.randn(4)}
    save_file(weights, folder / checkpoint_folder.WEIGHTS_FILE)
    (folder / "trainer_state.json").write_text("{}")
    files = checkpoint_folder.hash_folder(folder)
    (folder / checkpoint_folder.MANIFEST_NAME).write_text(json.dumps({
        "schema": checkpoint_folder.SCHEMA, "verified": True, "step": 8, "files": files,
        "sha256": dcp_manifest.identity(files), "parameters": ["b", "w"],
        "weight_digest": ck.state_digest({"model": weights}, "model", ["b", "w"], where="test")}))


def test_a_trainer_folder_is_judged_on_the_weights_it_hashed(tmp_path, monkeypatch):
    """Before: ``model.safetensors`` was hashed, then reopened by safetensors; bytes swapped in
    between (other weights) were the ones whose digest was checked: the verdict was about a file
    other than the one hashed. Now the bytes hashed are the bytes parsed."""
    from safetensors.torch import save

    from sdcguard.checkpoint_folder import verify_folder
    folder = (tmp_path / "checkpoint-8").resolve()
    _trainer_folder(folder)
    assert verify_folder(folder)["step"] == 8
    opened = _swap_after_first_read(monkeypatch, folder / "model.safetensors",
                                    save({"w": torch.zeros(3, 4), "b": torch.zeros(4)}))
    manifest = verify_folder(folder)
    monkeypatch.undo()
    assert manifest["step"] == 8 and opened[0] == 1
