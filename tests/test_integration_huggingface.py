"""sdcguard.integrations.huggingface under torchrun (gloo, CPU), with the real transformers.Trainer
and Accelerate.

  clean / plain  examples/huggingface/train.py and train_plain.py, 2 ranks, 8 steps, accumulation 2,
                 clipping, cosine schedule, checkpoint-N every 4 steps with save_total_limit=1:
                 the same weights after every step, the same losses and gradient norms;
                 checkpoint-8 carries a manifest, checkpoint-4 was rotated out (~15-20 s each).
  matrix (slow)  tests/huggingface_worker.py, 3 ranks, one job: each of the nine fault kinds in
                 its own short Trainer run; bfloat16 autocast with and without sdcguard; a run saving every step under save_total_limit=1 while
                 audits run every 3 steps and a fault's window reaches back past the newest
                 folders; a plain Accelerate loop, the same loop through accelerate_guard, and
                 that loop with a fault (~30-60 s).
"""
import json
import os
import shutil
import subprocess
import sys

import pytest
from torchrun_jobs import ROOT, rank_results, spooled_alarms, torchrun

from sdcguard.checkpoint import CheckpointError
from sdcguard.faults.spec import KINDS

pytestmark = pytest.mark.multiprocess
EXAMPLE = ROOT / "examples" / "huggingface"
COMMON = ["--steps", "8", "--accum", "2", "--audit-every", "4", "--weight-check-every", "2",
          "--save-steps", "4", "--save-total-limit", "1", "--max-grad-norm", "0.5"]


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    out = tmp_path_factory.mktemp("clean")
    torchrun(2, EXAMPLE / "train.py", "--out", out, *COMMON, spool=out / "spool")
    return out


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    out = tmp_path_factory.mktemp("plain")
    torchrun(2, EXAMPLE / "train_plain.py", "--out", out, *COMMON)
    return out


def test_clean_trainer_run_is_bitwise_the_plain_trainer_run(clean, plain):
    guarded, unguarded = rank_results(clean, 2), rank_results(plain, 2)
    for g, u in zip(guarded, unguarded):
        assert (g["alarms"], g["errors"], g["final_step"]) == ([], [], 8)
        assert len(g["weights"]) == 8 and g["weights"] == u["weights"]  # every step's weights, bit for bit
        assert g["losses"] == u["losses"] and g["grad_norms"] == u["grad_norms"]
        assert g["weights_digest"] == u["weights_digest"]
    assert guarded[0]["weights"] == guarded[1]["weights"]
    assert spooled_alarms(clean / "spool") == []
    stats = json.loads((clean / "spool" / "stats" / "rank-0.json").read_text())
    assert stats["checks"]["replay"]["runs"] == 2  # audits at 4 and 8 ran: the checks were not skipped
    assert stats["checks"]["weights"]["runs"] >= 4 and stats["last_verified_step"] == 8


def test_checkpoint_folders_carry_manifests_and_rotate(clean, plain, tmp_path):
    from sdcguard.integrations.huggingface import MANIFEST_NAME, verify_folder

    assert not (clean / "checkpoint-4").exists()  # save_total_limit=1: no alarm could name it after step 8
    manifest = verify_folder(clean / "checkpoint-8", expect_step=8)
    assert manifest["audited"] and manifest["audited_step"] == 8
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json",
            "rng_state_0.pth", "rng_state_1.pth"} <= set(manifest["files"])
    assert not (plain / "checkpoint-8" / MANIFEST_NAME).exists()
    # the folder's bytes are the plain run's, except what records the run itself
    for name in ("model.safetensors", "optimizer.pt", "scheduler.pt"):
        assert (clean / "checkpoint-8" / name).read_bytes() == (plain / "checkpoint-8" / name).read_bytes()
    tampered = tmp_path / "checkpoint-8"
    shutil.copytree(clean / "checkpoint-8", tampered)
    data = bytearray((tampered / "optimizer.pt").read_bytes())
    data[-100] ^= 1
    (tampered / "optimizer.pt").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="optimizer.pt: modified"):
        verify_folder(tampered)
    with pytest.raises(CheckpointError, match="not step 4"):
        verify_folder(clean / "checkpoint-8", expect_step=4)



# The real command, with transformers and accelerate unimportable: a checkpoint-N folder is checked
# with the standard library, torch and safetensors only.
WITHOUT_FRAMEWORK = ("import sys; sys.modules['transformers'] = sys.modules['accelerate'] = None; "
                     "from sdcguard.cli import main; sys.exit(main(sys.argv[1:]))")


def verify_command(*argv):
    return subprocess.run([sys.executable, "-c", WITHOUT_FRAMEWORK, "verify-checkpoint", *map(str, argv)],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONSAFEPATH": "1"})


def test_verify_checkpoint_command_checks_a_trainer_folder_without_transformers(clean, tmp_path, capsys):
    from sdcguard.cli import main

    folder = clean / "checkpoint-8"
    sha = json.loads((folder / "sdcguard-trainer.json").read_text())["sha256"]
    good = verify_command(folder, "--step", "8", "--sha256", sha)
    assert good.returncode == 0, good.stderr
    assert good.stdout.startswith(f"OK {folder}: step 8, Trainer checkpoint folder") and "on an audited step" in good.stdout
    # exit codes as for the other checkpoints (in this process: the same command, faster)
    capsys.readouterr()
    assert main(["verify-checkpoint", str(folder), "--step", "4"]) == 1
    assert capsys.readouterr().out.startswith("MISMATCH")
    tampered = tmp_path / "checkpoint-8"
    shutil.copytree(folder, tampered)
    (tampered / "extra.txt").write_text("not written by the Trainer")
    assert main(["verify-checkpoint", str(tampered)]) == 1
    assert "extra.txt: not in the manifest" in capsys.readouterr().out
    (tampered / "extra.txt").unlink()
    (tampered / "sdcguard-trainer.json").unlink()
    assert main(["verify-checkpoint", str(tampered)]) == 2  # a folder with no manifest at all is bad input

def test_accelerate_guard_takes_the_prepared_objects_and_refuses_accelerates_own_accumulation():
    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from sdcguard import ConfigurationError
    from sdcguard.integrations.huggingface import accelerate_guard

    def loss_fn(module, batch):
        return module(batch).sum()

    try:
        accelerator = Accelerator(cpu=True)
        net = torch.nn.Linear(4, 2)
        model, optimizer = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
        guard = accelerate_guard(accelerator, model, optimizer, loss_fn)
        assert guard.optimizer is optimizer.optimizer  # the torch optimizer the update gate hooks
        AcceleratorState._reset_state(True)
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
        with pytest.raises(ConfigurationError, match="gradient_accumulation_steps=2"):
            accelerate_guard(accelerator, model, optimizer, loss_fn)
    finally:
        AcceleratorState._reset_state(True)


# -- the slow job: every fault kind, rotation under an alarm, Accelerate -------------------------

RANKS = 3
FAULT_FLAGS = ["--steps", "4", "--audit-every", "2", "--weight-check-every", "1", "--save-steps", "100"]
# kind -> (the fault, the step it is caught at, the rank it must name)
MATRIX = {
    "forward-nan": ("forward-nan:rank=0:step=2", 2, [0]),
    "forward-scale": ("forward-scale:rank=1:step=2", 2, [1]),
    "grad-inf": ("grad-inf:rank=2:step=2", 2, [2]),
    "grad-bitflip": ("grad-bitflip:rank=1:step=2", 2, [1]),
    "reduce-nan": ("reduce-nan:step=2", 2, []),       # the all-reduce's: every replica got the same sum
    "reduce-scale": ("reduce-scale:step=2", 2, []),
    "optimizer-scale": ("optimizer-scale:rank=2:step=2", 2, [2]),
    "weight-bitflip": ("weight-bitflip:rank=0:step=3", 3, [0]),
    "weight-swap": ("weight-swap:rank=1:step=3", 3, [1]),
}
ROTATION = ["--steps", "7", "--audit-every", "3", "--weight-check-every", "1", "--save-steps", "1",
            "--save-total-limit", "1", "--inject", "grad-bitflip:rank=1:step=6"]


# GPT-2's own dropout (its config's default is 0.1): every step audited, checkpoints every 3 steps
DROPOUT = ["--dropout", "0.1", "--steps", "6", "--audit-every", "1", "--weight-check-every", "1",
           "--save-steps", "3", "--save-total-limit", "2"]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("hfjob")
    plan = [{"name": kind, "kind": "trainer", "flags": [*FAULT_FLAGS, "--inject", spec]}
            for kind, (spec, _, _) in MATRIX.items()]
    plan.append({"name": "rotation", "kind": "trainer", "flags": ROTATION, "config": {"audit_checkpoints": False}})
    plan.append({"name": "resumed", "kind": "trainer", "config": {"audit_checkpoints": False},
                 "flags": [*ROTATION[:-2], "--resume", out / "rotation" / "checkpoint-3"]})
    plan.append({"name": "uninterrupted", "kind": "trainer", "config": {"audit_checkpoints": False},
                 "flags": ROTATION[:-2]})
    plan.append({"name": "dropout", "kind": "trainer", "config": {"audit_checkpoints": False}, "flags": DROPOUT})
    plan.append({"name": "dropout-resumed", "kind": "trainer", "config": {"audit_checkpoints": False},
                 "flags": [*DROPOUT, "--resume", out / "dropout" / "checkpoint-3"]})
    bf16 = ["--bf16", "--steps", "4", "--audit-every", "2", "--weight-check-every", "1", "--save-steps", "100"]
    plan += [{"name": "bf16", "kind": "trainer", "flags": bf16}, {"name": "bf16-plain", "kind": "trainer", "flags": bf16,
                                                                    "guarded": False}]
    plan += [{"name": "acc-plain", "kind": "accelerate", "guarded": False},
             {"name": "acc-guarded", "kind": "accelerate", "guarded": True},
             {"name": "acc-fault", "kind": "accelerate", "guarded": True, "inject": ["grad-bitflip:rank=2:step=4"]}]
    (out / "plan.json").write_text(json.dumps(plan, default=str))
    torchrun(RANKS, ROOT / "tests" / "huggingface_worker.py", out, out / "plan.json")
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(MATRIX))
def test_every_fault_kind_is_caught_by_its_check_naming_the_rank(job, kind):
    _, step, named = MATRIX[kind]
    expected = (KINDS[kind].caught_by, step, named)
    ranks = rank_results(job / kind, RANKS)
    for r in ranks:  # every rank stopped on the same alarm, in the step that raised it: none hung
        assert [(a["check"], a["step"], a["suspect_ranks"]) for a in r["alarms"]] == [expected], r["errors"]
        assert r["final_step"] == step - 1
    for rank in named:  # the fault did strike there (and a reduce fault struck every rank)
        assert [f["step"] for f in ranks[rank]["fired"]] == [step]
    [alarm] = spooled_alarms(job / kind / "spool")
    assert (alarm["check"], alarm["step"], alarm["suspect_ranks"]) == expected


@pytest.mark.slow
def test_an_alarm_names_a_folder_that_still_holds_its_step(job):
    from sdcguard.integrations.huggingface import verify_folder

    out = job / "rotation"
    [alarm] = spooled_alarms(out / "spool")
    assert (alarm["check"], alarm["step"], alarm["suspect_ranks"]) == ("replay", 6, [1])
    assert alarm["suspect_window"] == {"first_step": 4, "last_step": 6}  # after the audit at 3
    # save_total_limit=1 would have deleted checkpoint-3 at step 4; it was spared as the replay
    # check's resume point, every other older folder rotated out
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-5"]
    assert alarm["last_good_checkpoint"] == str(out / "checkpoint-3")
    assert (alarm["last_good_checkpoint_step"], alarm["steps_at_risk"]) == (3, 3)
    verify_folder(alarm["last_good_checkpoint"], expect_step=3, expect_sha256=alarm["last_good_checkpoint_sha256"])


@pytest.mark.slow
def test_resuming_from_the_named_folder_inherits_its_history_and_is_bitwise_the_uninterrupted_run(job):
    out = job / "resumed"
    for r, u in zip(rank_results(out, RANKS), rank_results(job / "uninterrupted", RANKS)):
        assert (r["alarms"], r["errors"], r["final_step"]) == ([], [], 7)
        assert sorted(int(k) for k in r["weights"]) == [4, 5, 6, 7]  # trained on from step 4
        # the Trainer's fresh DDP would reduce step 4 in its initial bucket layout; the buckets are
        # settled first, so every step's weights, loss and gradient norm are the uninterrupted run's
        later = [k for k in u["weights"] if int(k) >= 4]
        assert u["errors"] == [] and len(later) == 4
        for record in ("weights", "losses", "grad_norms"):
            assert {k: r[record][k] for k in later} == {k: u[record][k] for k in later}, record
    # the folder it resumed from (verified first) is in its history, as are its own folders that
    # still exist: 4 and 5 rotated out once the audit at 6 passed
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-6", "checkpoint-7"]
    manifest = json.loads((out / "checkpoint-7" / "sdcguard-trainer.json").read_text())
    assert [(c["step"], c["path"]) for c in manifest["earlier_checkpoints"]] == [
        (3, str(job / "rotation" / "checkpoint-3")), (6, str(out / "checkpoint-6"))]
    assert (manifest["step"], manifest["audited_step"]) == (7, 6)


@pytest.mark.slow
def test_dropout_is_replayed_on_every_audit_and_a_resumed_run_draws_the_same_masks(job):
    """With dropout the masks come from sdcguard's generator, seeded per (step, rank, micro-batch):
    every step's replay reproduces them (no alarm), and a run resumed from checkpoint-3 draws the
    masks of steps 4-6 the uninterrupted run drew, so it ends bit for bit where that one does (a
    step count off by one after the resume, or masks from the global RNG, would not)."""
    uninterrupted, resumed = rank_results(job / "dropout", RANKS), rank_results(job / "dropout-resumed", RANKS)
    for u, r in zip(uninterrupted, resumed):
        assert (u["alarms"], u["errors"], u["final_step"]) == ([], [], 6)
        assert (r["alarms"], r["errors"], r["final_step"]) == ([], [], 6)
        assert sorted(int(k) for k in r["weights"]) == [4, 5, 6]
        for record in ("weights", "losses", "grad_norms"):
            assert {k: r[record][k] for k in r["weights"]} == {k: u[record][k] for k in r["weights"]}, record
    assert spooled_alarms(job / "dropout" / "spool") == [] and spooled_alarms(job / "dropout-resumed" / "spool") == []
    # dropout was on: step 1's loss (the same weights and batches) is not the dropout-free run's
    assert uninterrupted[0]["losses"]["1"] != rank_results(job / "uninterrupted", RANKS)[0]["losses"]["1"]


@pytest.mark.slow
def test_bf16_autocast_run_is_bitwise_the_plain_one_with_audits(job):
    # Accelerate puts the autocast on the module's own forward: the replays run it too
    for g, p in zip(rank_results(job / "bf16", RANKS), rank_results(job / "bf16-plain", RANKS)):
        assert (g["alarms"], g["errors"], g["final_step"]) == ([], [], 4)
        assert g["weights"] == p["weights"] and g["losses"] == p["losses"]
    stats = json.loads((job / "bf16" / "spool" / "stats" / "rank-1.json").read_text())
    assert stats["checks"]["replay"]["runs"] == 2 and stats["last_verified_step"] == 4


@pytest.mark.slow
def test_accelerate_loop_is_bitwise_the_plain_one_and_catches_a_fault(job):
    plain, guarded, faulted = (rank_results(job / n, RANKS) for n in ("acc-plain", "acc-guarded", "acc-fault"))
    for p, g, f in zip(plain, guarded, faulted):
        assert len(p["weights"]) == 6 and g["weights"] == p["weights"] and g["losses"] == p["losses"]
        assert g["alarms"] == []
        assert [(a["check"], a["step"], a["suspect_ranks"]) for a in f["alarms"]] == [("replay", 4, [2])]
        assert f["weights"] == {k: v for k, v in p["weights"].items() if int(k) < 4}
    assert len(spooled_alarms(job / "acc-fault" / "spool")) == 1
