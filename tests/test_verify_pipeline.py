"""``sdcguard verify-checkpoint DIR`` on a pipeline checkpoint (``layouts/pipeline_verify.py``).

The directory is written by the pipeline's own store (``PipelineStore.save``): in this process over
a one-rank gloo group (one pipeline position holding two stages, as an interleaved schedule puts
them), and, marked slow, by two gloo ranks (two positions: this file run under torchrun). Checked
through the CLI: a good checkpoint (0), a tampered stage file, a tampered ``pipeline.json``, the wrong
``--sha256`` or ``--step``, a missing file (1), no manifest or an unsafe pickle (2, nothing run)."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.nn.parallel import DistributedDataParallel

from sdcguard import recovery
from sdcguard.checkpoint import manifest_path
from sdcguard.checks.pipeline import Grid
from sdcguard.checks.topology import Topology
from sdcguard.checks.weights import fingerprint_weights
from sdcguard.cli import main as cli
from sdcguard.layouts.pipeline_stages import stage_replicas
from sdcguard.layouts.pipeline_store import PipelineStore
from sdcguard.layouts.pipeline_store import manifest_problems

STEP = 4


def write_pipeline_checkpoint(path: Path, rank: int, world: int, position_group) -> recovery.History:
    """Rank ``rank`` of a PP ``world`` x DP 1 pipeline, holding stages ``rank`` and ``rank + world``
    (interleaved), writes its position's file (every rank calls). ``position_group``: its own rank."""
    cpu = torch.device("cpu")
    torch.manual_seed(rank)
    modules = {rank: nn.Linear(4, 8), rank + world: nn.Sequential(nn.Tanh(), nn.Linear(8, 2))}
    stages = [PipelineStage(DistributedDataParallel(m, process_group=position_group), i, 2 * world, cpu,
                            group=dist.group.WORLD) for i, m in modules.items()]
    module = nn.ModuleDict({f"stage{i}": m for i, m in modules.items()})
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    for p in module.parameters():  # one update, so the optimizer holds state
        p.grad = torch.ones_like(p)
    opt.step()
    named = list(module.named_parameters())
    grid = Grid(replicas=1, positions=world, at={r: (0, r) for r in range(world)},
                stages={r: (r, r + world) for r in range(world)}, num_stages=2 * world)
    topology = Topology(rank=rank, world_size=world, ranks_per_node=world,
                        identities={r: {"rank": r, "pod": "p", "node": "n"} for r in range(world)},
                        run_id="run-1", threads={r: 1 for r in range(world)})
    store = PipelineStore(module=module, optimizer=opt, named_parameters=named, grid=grid, topology=topology,
                          device=cpu, replicas=stage_replicas(stages, reduce_hook=None, reduce_state=None, seed=0),
                          group=position_group, zero_update=contextlib.nullcontext, on_load=lambda: None)
    history = recovery.History(last_audited_step=STEP - 1, last_weights_verified_step=STEP)
    return store.save(str(path), step=STEP, state=None, model_key="model", history=history,
                      weight_digest=fingerprint_weights(named).digest.hex(), keep=False)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A one-position pipeline checkpoint and the SHA-256 its save recorded (what an alarm names)."""
    where = tmp_path_factory.mktemp("pp-ckpt")
    dist.init_process_group("gloo", init_method=f"file://{where}/store", rank=0, world_size=1)
    try:
        history = write_pipeline_checkpoint(where / "ckpt", 0, 1, dist.group.WORLD)
    finally:
        dist.destroy_process_group()
    return where / "ckpt", history.checkpoints[-1].sha256


@pytest.fixture
def ckpt(written, tmp_path):
    """A copy of the checkpoint to tamper with, and its SHA-256."""
    source, sha = written
    shutil.copytree(source, tmp_path / "ckpt")
    return tmp_path / "ckpt", sha


def verify(path, *args):
    return cli(["verify-checkpoint", str(path), *map(str, args)])


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def edit_manifest(path: Path, change) -> None:
    top = json.loads((path / "pipeline.json").read_text())
    change(top)
    (path / "pipeline.json").write_text(json.dumps(top, indent=2, sort_keys=True))


def test_the_store_names_the_pipeline_json_sha256_and_a_good_checkpoint_verifies(ckpt, capsys):
    path, sha = ckpt
    assert sha == hashlib.sha256((path / "pipeline.json").read_bytes()).hexdigest()
    assert verify(path) == 0
    assert verify(path, "--step", STEP, "--sha256", sha.upper()) == 0
    out = capsys.readouterr().out
    assert f"OK {path}: step {STEP}, pipeline of 2 stages on 1 positions x 1 replicas (DDP)" in out
    assert f"sha256 {sha} (pipeline.json), weights cross-checked across replicas, covered by the audit at step {STEP - 1}" in out
    assert "position 0: stage-0.pt, 4 parameters" in out


def test_pure_fsdp_stages_are_said_not_cross_checked(ckpt, capsys):
    path, _ = ckpt
    edit_manifest(path, lambda top: top.update(replication="FSDP2", weights_verified=False))
    assert verify(path) == 0
    assert "x 1 replicas (FSDP2)" in (out := capsys.readouterr().out) and "weights not cross-checked" in out


def test_a_tampered_stage_file_is_a_mismatch(ckpt, capsys):
    path, sha = ckpt
    flip_a_byte(path / "stage-0.pt")
    assert verify(path, "--sha256", sha) == 1
    out = capsys.readouterr().out
    assert out.startswith("MISMATCH") and "position 0" in out and "was modified after it was verified" in out


def test_a_stage_file_whose_weights_differ_from_its_digest_is_a_mismatch(ckpt, capsys):
    """Bytes and both manifests rewritten to agree: the weights still differ from check 3's digest."""
    path, _ = ckpt
    state = torch.load(path / "stage-0.pt", weights_only=True)
    state["model"]["stage0.weight"][0, 0] += 1.0
    torch.save(state, path / "stage-0.pt")
    forge_stage_sha(path, 0)
    assert verify(path) == 1
    assert "its weights have digest" in capsys.readouterr().out


@pytest.mark.parametrize("change, message", [
    (lambda top: top.update(step=STEP + 1), f"stage-0.pt holds step {STEP}, pipeline.json says step {STEP + 1}"),
    (lambda top: top["stages"]["0"].update(sha256="ab" * 32), "not the file saved with this pipeline.json"),
    (lambda top: top["stages"]["0"].update(file="../elsewhere.pt"), "names file '../elsewhere.pt', not 'stage-0.pt'"),
    (lambda top: top.update(positions=2), "missing ['1']"),
    (lambda top: top.update(schema="other"), "unknown schema 'other'"),
])
def test_a_tampered_pipeline_json_is_a_mismatch(ckpt, capsys, change, message):
    path, _ = ckpt
    edit_manifest(path, change)
    assert verify(path) == 1
    out = capsys.readouterr().out
    assert out.startswith("MISMATCH") and message in out


def test_any_edit_to_pipeline_json_is_seen_against_the_alarms_sha256(ckpt, capsys):
    path, sha = ckpt
    edit_manifest(path, lambda top: top.update(verified_at="2020-01-01T00:00:00Z"))
    assert verify(path) == 0  # the stage files still match it: only the alarm's SHA-256 names the whole
    assert verify(path, "--sha256", sha) == 1
    assert "pipeline.json has SHA-256" in capsys.readouterr().out


def test_the_wrong_sha256_or_step_is_a_mismatch(ckpt, capsys):
    path, sha = ckpt
    assert verify(path, "--sha256", "0" * 64) == 1
    assert f"expected {'0' * 64}" in capsys.readouterr().out
    assert verify(path, "--sha256", sha, "--step", STEP - 1) == 1
    assert f"holds the checkpoint of step {STEP}, not step {STEP - 1}" in capsys.readouterr().out


@pytest.mark.parametrize("victim, message", [("stage-0.pt", "stage-0.pt is missing"),
                                             ("stage-0.pt.sdcguard.json", "has no manifest")])
def test_a_missing_stage_file_or_its_manifest_is_a_mismatch(ckpt, capsys, victim, message):
    path, _ = ckpt
    (path / victim).unlink()
    assert verify(path) == 1
    assert message in capsys.readouterr().out


def test_a_directory_without_pipeline_json_or_not_json_is_refused(ckpt, capsys):
    path, _ = ckpt
    (path / "pipeline.json").write_text("{not json")
    assert verify(path) == 1
    assert "is not valid JSON" in capsys.readouterr().out
    (path / "pipeline.json").unlink()
    assert verify(path) == 2
    assert "pipeline.json for a pipeline's" in capsys.readouterr().err


class _RunsCommand:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def test_an_unsafe_pickle_in_a_stage_file_is_refused_and_never_run(ckpt, capsys, tmp_path):
    """A stage file replaced by one that pickles ``os.system``, every digest forged to agree: it
    is refused (2) without being run, and ``--allow-global`` cannot admit it."""
    path, _ = ckpt
    marker = tmp_path / "pwned"
    state = torch.load(path / "stage-0.pt", weights_only=True)
    state["extra"] = _RunsCommand(f"touch {marker}")
    torch.save(state, path / "stage-0.pt")
    forge_stage_sha(path, 0)
    assert verify(path) == 2
    assert "posix.system" in capsys.readouterr().err
    assert verify(path, "--allow-global", "os.system") == 2
    assert not marker.exists()


@pytest.mark.parametrize("manifest, problem", [
    ([], "not a JSON object"),
    ({"schema": "sdcguard.pipeline-checkpoint/1", "verified": True, "step": 1, "positions": 0, "replicas": 2,
      "num_stages": 2, "stages": {}}, "'positions' is 0"),
    ({"schema": "sdcguard.pipeline-checkpoint/1", "verified": False, "step": True, "positions": 1, "replicas": 2,
      "num_stages": 1, "stages": {"0": {"file": "stage-0.pt", "sha256": "a" * 64}}}, "'step' is True"),
    ({"schema": "sdcguard.pipeline-checkpoint/1", "verified": True, "step": 1, "positions": 2, "replicas": 2,
      "num_stages": 2, "stages": {"0": {"file": "stage-0.pt", "sha256": "a" * 64},
                                  "1": {"file": "stage-1.pt", "sha256": "not hex"}}}, "position 1: sha256 'not hex'"),
])
def test_the_manifest_form_is_judged_without_files(manifest, problem):
    assert any(problem in p for p in manifest_problems(manifest))


def forge_stage_sha(path: Path, position: int) -> None:
    """Make stage ``position``'s manifest and pipeline.json agree with its current bytes."""
    stage = path / f"stage-{position}.pt"
    sha = hashlib.sha256(stage.read_bytes()).hexdigest()
    manifest = json.loads(manifest_path(stage).read_text())
    manifest["sha256"] = sha
    manifest_path(stage).write_text(json.dumps(manifest))
    edit_manifest(path, lambda top: top["stages"][str(position)].update(sha256=sha))


# -- two positions, written by two gloo ranks (this file under torchrun) -----------------------------

@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_two_position_pipeline_checkpoint_verifies_each_position(tmp_path):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SDCGUARD_")}, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           __file__, str(tmp_path / "ckpt")], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    path = tmp_path / "ckpt"
    sha = hashlib.sha256((path / "pipeline.json").read_bytes()).hexdigest()
    sdcguard = [sys.executable, "-m", "sdcguard.cli", "verify-checkpoint", str(path)]
    good = subprocess.run([*sdcguard, "--step", str(STEP), "--sha256", sha], capture_output=True, text=True, env=env)
    assert good.returncode == 0, good.stdout + good.stderr
    assert "pipeline of 4 stages on 2 positions x 1 replicas (DDP), 2 stage files" in good.stdout
    assert "position 1: stage-1.pt" in good.stdout
    flip_a_byte(path / "stage-1.pt")
    (path / "stage-0.pt").unlink()
    bad = subprocess.run([*sdcguard, "--sha256", sha], capture_output=True, text=True, env=env)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "position 0: stage-0.pt is missing" in bad.stdout
    assert "position 1:" in bad.stdout and "stage-1.pt was modified after it was verified" in bad.stdout


def _two_rank_worker(out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    own = [dist.new_group([r]) for r in range(world)][rank]  # every rank creates every group
    write_pipeline_checkpoint(Path(out), rank, world, own)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _two_rank_worker(sys.argv[1])
