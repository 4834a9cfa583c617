"""Checkpoints (sdcguard.checkpoint) in one process: the step a manifest records, one path written
over and over (nanoGPT's ``ckpt.pt``), and a resume that takes exactly the file an alarm named.

One process has no replay audit; where a test needs one that passed, it records it in the Guard's
``history`` the way a passing audit does (``last_audited_step``), so that the keep/prune rules run
on the files exactly as in a multi-process job (tests/test_example_gpt.py runs that end to end)."""
import json
import subprocess
import sys

import pytest
import torch
from torch import nn

import sdcguard
from sdcguard import recovery
from sdcguard.checkpoint import CheckpointError, manifest_path, verify_checkpoint
from sdcguard.config import Config


def make(**cfg):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, sdcguard.Guard(model, opt, loss_fn, config=Config(**cfg))


def loss_fn(module, batch):
    x, y = batch
    return ((module(x).squeeze(-1) - y) ** 2).mean()


def data(step):
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
    return x, x.sum(dim=1)


def train(guard, steps):
    for step in steps:
        guard.train_step(step, data(step))


def save_twice(guard, ckpt):
    """nanoGPT's pattern: one path, saved at step 2 (the audit at 0 passed) and again at step 5
    (the audit at 3 passed: step 2 is covered, 3..5 are not)."""
    train(guard, range(3))
    guard.history.last_audited_step = 0
    guard.save_checkpoint(ckpt)
    train(guard, range(3, 6))
    guard.history.last_audited_step = 3
    guard.save_checkpoint(ckpt)


def test_the_manifest_step_is_the_last_update_the_weights_hold(tmp_path):
    model, opt, guard = make()
    with pytest.raises(CheckpointError, match="no checked step has updated the weights"):
        guard.save_checkpoint(tmp_path / "early.pt")
    train(guard, range(3))
    # nanoGPT saves at the top of iteration 3: its weights hold the update of step 2
    with pytest.raises(CheckpointError, match=r"hold the update of step 2, not 3.*top of iteration 3"):
        guard.save_checkpoint(tmp_path / "ckpt.pt", 3)
    assert not (tmp_path / "ckpt.pt").exists()
    assert guard.save_checkpoint(tmp_path / "ckpt.pt") == str(tmp_path / "ckpt.pt")
    assert json.loads(manifest_path(tmp_path / "ckpt.pt").read_text())["step"] == 2
    assert guard.save_checkpoint(tmp_path / "same.pt", 2) is not None  # the right label is accepted


def test_inside_a_step_the_label_follows_the_optimizer_update(tmp_path):
    _, opt, guard = make()
    train(guard, range(2))
    with guard.step(2) as s:
        s.backward(data(2))
        s.check()
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert guard.updates_through == 2  # the optimizer's post-hook counted the update
        guard.save_checkpoint(tmp_path / "in-step.pt")
    assert verify_checkpoint(tmp_path / "in-step.pt").step == 2


def test_a_step_refused_as_the_datas_fault_counts_as_done_unapplied(tmp_path):
    model, _, guard = make()
    train(guard, range(2))
    x, y = data(2)
    x[0, 0] = float("inf")
    with pytest.raises(sdcguard.NonFiniteGradient):
        guard.train_step(2, (x, y))
    # the weights are step 1's and stay so; a loop that goes on saves them as "done with step 2"
    assert guard.updates_through == 2
    guard.save_checkpoint(tmp_path / "ckpt.pt", 2)


def test_one_path_written_again_keeps_the_resume_point_an_alarm_can_still_name(tmp_path, caplog):
    model, opt, guard = make()
    ckpt = tmp_path / "ckpt.pt"
    train(guard, range(3))
    guard.history.last_audited_step = 0   # the audit at step 0 passed
    guard.save_checkpoint(ckpt)           # step 2
    first_sha = json.loads(manifest_path(ckpt).read_text())["sha256"]
    train(guard, range(3, 6))
    guard.history.last_audited_step = 3   # the audit at 3 passed: step 2 is covered, 3..5 are not
    guard.save_checkpoint(ckpt)           # step 5, written over step 2
    kept = tmp_path / "ckpt.sdcguard-step2.pt"
    assert verify_checkpoint(ckpt).step == 5
    assert verify_checkpoint(kept, expect_step=2, expect_sha256=first_sha).step == 2
    assert "kept as" in caplog.text and str(kept) in caplog.text
    # a compute fault caught at the audit of 6 may have begun at 4: the alarm names the kept file
    fields = recovery.recovery_fields("replay", 6, guard.history)
    assert fields["suspect_window"] == {"first_step": 4, "last_step": 6}
    assert (fields["last_good_checkpoint"], fields["last_good_checkpoint_step"]) == (str(kept), 2)
    assert fields["last_good_checkpoint_sha256"] == first_sha
    assert fields["last_good_checkpoint_kept_from"] == str(ckpt)
    # a weights fault only reaches back to step 5: the path itself, which does hold step 5
    weights = recovery.recovery_fields("weights", 6, guard.history)
    assert (weights["last_good_checkpoint"], weights["last_good_checkpoint_step"]) == (str(ckpt), 5)
    # once the audit at 6 passes, step 5 is covered for every check: the kept step 2 goes
    train(guard, range(6, 9))
    guard.history.last_audited_step = 6
    guard.save_checkpoint(ckpt)           # step 8; step 5 is kept, step 2 removed
    assert not kept.exists() and not manifest_path(kept).exists()
    assert verify_checkpoint(tmp_path / "ckpt.sdcguard-step5.pt").step == 5
    assert [(c.step, c.path) for c in guard.history.checkpoints] == [
        (5, str(tmp_path / "ckpt.sdcguard-step5.pt")), (8, str(ckpt))]
    manifest = json.loads(manifest_path(ckpt).read_text())
    assert [(c["step"], c["kept_from"]) for c in manifest["earlier_checkpoints"]] == [(5, str(ckpt))]


def test_keeping_nothing_is_a_choice_and_the_alarm_then_names_nothing_overwritten(tmp_path):
    _, _, guard = make(keep_resume_points=False)
    ckpt = tmp_path / "ckpt.pt"
    save_twice(guard, ckpt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt", "ckpt.pt.sdcguard.json"]
    assert recovery.recovery_fields("replay", 6, guard.history)["last_good_checkpoint"] is None


def test_distinct_paths_are_never_copied_nor_deleted(tmp_path):
    _, _, guard = make()
    for step in (2, 5, 8):
        train(guard, range(step - 2 if step > 2 else 0, step + 1))
        guard.history.last_audited_step = step
        guard.save_checkpoint(tmp_path / f"step-{step}.pt")
    assert sorted(p.name for p in tmp_path.glob("*.pt")) == ["step-2.pt", "step-5.pt", "step-8.pt"]


def test_load_takes_only_the_file_the_alarm_named(tmp_path):
    model, opt, guard = make()
    ckpt = tmp_path / "ckpt.pt"
    train(guard, range(3))
    guard.save_checkpoint(ckpt)
    named = json.loads(manifest_path(ckpt).read_text())["sha256"]
    train(guard, range(3, 5))
    guard.save_checkpoint(ckpt)  # the same path, written again after the alarm named step 2
    other, other_opt, resumed = make()
    before = [p.detach().clone() for p in other.parameters()]
    with pytest.raises(CheckpointError, match="now holds the checkpoint of step 4, not step 2"):
        resumed.load_checkpoint(ckpt, expect_step=2)
    with pytest.raises(CheckpointError, match="not the file the alarm named"):
        sdcguard.load_checkpoint(ckpt, other, expect_sha256=named)
    assert all(torch.equal(a, b) for a, b in zip(before, other.parameters()))  # untouched
    assert resumed.load_checkpoint(ckpt, expect_step=4) == 4 and resumed.updates_through == 4


def cli(*args):
    return subprocess.run([sys.executable, "-m", "sdcguard.cli", *args], capture_output=True, text=True, timeout=120)


def test_verify_checkpoint_checks_the_step_and_bytes_the_alarm_named(tmp_path):
    _, _, guard = make()
    train(guard, range(2))
    path = guard.save_checkpoint(tmp_path / "ckpt.pt")
    sha = json.loads(manifest_path(path).read_text())["sha256"]
    good = cli("verify-checkpoint", path, "--step", "1", "--sha256", sha)
    assert good.returncode == 0 and "step 1" in good.stdout and sha in good.stdout, good.stdout + good.stderr
    wrong_step = cli("verify-checkpoint", path, "--step", "2")
    assert wrong_step.returncode == 1 and "not step 2" in wrong_step.stdout
    wrong_bytes = cli("verify-checkpoint", path, "--sha256", "0" * 64)
    assert wrong_bytes.returncode == 1 and "not the file the alarm named" in wrong_bytes.stdout


def test_a_resumed_guard_inherits_the_kept_files_that_still_hold_their_step(tmp_path):
    _, _, guard = make()
    ckpt = tmp_path / "ckpt.pt"
    save_twice(guard, ckpt)
    _, _, resumed = make()
    assert resumed.load_checkpoint(ckpt) == 5
    assert resumed.checkpoints == [(2, str(tmp_path / "ckpt.sdcguard-step2.pt")), (5, str(ckpt))]
    # the manifest of step 5 remembers that step 2's audit was the last one: a compute fault
    # after the resume reaches back to 4, and the kept file is named
    fields = recovery.recovery_fields("replay", 7, resumed.history)
    assert fields["last_good_checkpoint"] == str(tmp_path / "ckpt.sdcguard-step2.pt")
