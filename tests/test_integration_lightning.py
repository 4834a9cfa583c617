"""sdcguard.integrations.lightning under torchrun: examples/lightning on 3 gloo ranks (one process each).

Lightning's import and the process group dominate a short run, so one torchrun launch runs several
of the example's scripts in turn (tests/lightning_worker.py; each as ``python SCRIPT FLAGS``):

  quick (make test, ~15 s)  train.py clean (3 epochs = 9 steps of 2 micro-batches, clipping, a step
      LR schedule, audits at 0/4/8, check 3 every 2 steps, ModelCheckpoint + last.ckpt at each
      epoch's end); train_plain.py the same; train.py with a flipped gradient bit on rank 1 at the
      audit of step 8, whose window (5..8) reaches back past the save that last.ckpt held before it
      was written again; train.py resumed with trainer.fit(ckpt_path=) as that alarm says.
  matrix (slow, ~25 s)  each of the nine fault kinds, one run each; a bf16-mixed pair; the removal
      of a rotated checkpoint an alarm may still name (save_last off) and a resume from it.
  script (slow, ~15 s)  train.py launched by torchrun as a user runs it, stopped by an alarm.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torchrun_jobs import ROOT, job_env, rank_results, spooled_alarms, spooled_stats, torchrun

from sdcguard import cli, verify_checkpoint
from sdcguard.faults.spec import KINDS, parse_fault

pytestmark = pytest.mark.multiprocess
EXAMPLE = ROOT / "examples" / "lightning"
RANKS = 3
FLAGS = ["--epochs", "3", "--audit-every", "4", "--weight-check-every", "2", "--accumulate", "2", "--clip", "1.0"]
# Each kind where the check that must catch it runs (audits at 0, 4, 8; check 3 at even steps).
MATRIX = ["forward-nan:rank=1:step=1", "forward-scale:rank=2:step=4", "grad-inf:rank=0:step=2",
          "grad-bitflip:rank=1:step=4", "reduce-nan:step=3", "reduce-scale:step=1", "optimizer-scale:rank=2:step=2",
          "weight-bitflip:rank=0:step=3", "weight-swap:rank=1:step=1"]


def _read(out: Path) -> dict:
    """Every rank's result file and the spool's alarm records and statistics of one run."""
    return {"out": out, "results": rank_results(out, RANKS), "alarms": spooled_alarms(out / "spool"),
            "stats": spooled_stats(out / "spool")}


def run_plan(tmp: Path, plan: list[dict]) -> dict[str, dict]:
    """Run ``plan`` (name -> script, flags[, resume_as]) in one torchrun job; each run's _read."""
    entries = []
    for name, spec in plan:
        entry = {"script": spec["script"], "flags": ["--out", str(tmp / name), *spec["flags"]]}
        if "resume_as" in spec:
            entry["resume_as_alarmed"] = str(tmp / spec["resume_as"])
        entries.append(entry)
    (tmp / "plan.json").write_text(json.dumps(entries))
    torchrun(RANKS, ROOT / "tests" / "lightning_worker.py", tmp / "plan.json", timeout=600)
    return {name: _read(tmp / name) for name, _ in plan}


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    return run_plan(tmp_path_factory.mktemp("lightning"), [
        ("clean", {"script": "train.py", "flags": FLAGS}),
        ("plain", {"script": "train_plain.py", "flags": FLAGS}),
        ("fault", {"script": "train.py", "flags": [*FLAGS, "--inject", "grad-bitflip:rank=1:step=8"]}),
        ("resumed", {"script": "train.py", "flags": FLAGS, "resume_as": "fault"}),
    ])


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    plan = [(f"fault{i}", {"script": "train.py", "flags": [*FLAGS, "--epochs", "2", "--inject", spec]})
            for i, spec in enumerate(MATRIX)]
    plan += [("bf16", {"script": "train.py", "flags": [*FLAGS, "--epochs", "2", "--precision", "bf16-mixed"]}),
             ("bf16-plain", {"script": "train_plain.py", "flags": [*FLAGS, "--epochs", "2", "--precision", "bf16-mixed"]}),
             ("clean", {"script": "train.py", "flags": [*FLAGS, "--no-save-last"]}),
             ("rotated", {"script": "train.py", "flags": [*FLAGS, "--no-save-last", "--inject", "grad-bitflip:rank=2:step=8"]}),
             ("rotated-resumed", {"script": "train.py", "flags": [*FLAGS, "--no-save-last"], "resume_as": "rotated"})]
    return run_plan(tmp_path_factory.mktemp("lightning-matrix"), plan)


def _digest(run: dict) -> str:
    digests = {r["weights_digest"] for r in run["results"]}
    assert len(digests) == 1, digests  # every replica holds the same weights
    return digests.pop()


def _the_alarm(run: dict, updated: int = 0) -> dict:
    """The one alarm of a run: in the spool once, and raised as SDCDetected on every rank alike;
    the run stopped with the alarm's step not applied (``updated=1``: check 3 after the update,
    before a checkpoint)."""
    [alarm] = run["alarms"]
    for r in run["results"]:
        assert [a["id"] for a in r["alarms"]] == [alarm["id"]]
        assert [e["type"] for e in r["errors"]] == ["SDCDetected"]
        assert r["final_step"] == alarm["step"] + updated  # Lightning's global_step counts updates
    return alarm


# -- quick: make test --------------------------------------------------------------------------

def test_clean_run_is_bitwise_the_plain_lightning_run(quick):
    clean, plain = quick["clean"], quick["plain"]
    for r in clean["results"]:
        assert (r["alarms"], r["errors"], r["final_step"]) == ([], [], 9)
    assert clean["alarms"] == []
    # 2 micro-batches under no_sync, clipping, AdamW, a step LR schedule: the same arithmetic, so
    # the same bits, and every micro-batch's loss on every rank on the way
    assert _digest(clean) == _digest(plain)
    for guarded, unguarded in zip(clean["results"], plain["results"]):
        assert guarded["losses"] == unguarded["losses"] and len(guarded["losses"]) == 18
    assert len(clean["stats"]) == RANKS
    for s in clean["stats"]:  # the checks did run: audits at 0, 4, 8; check 3 at least every 2 steps
        assert s["checks"]["replay"]["runs"] == 3
        assert s["checks"]["weights"]["runs"] >= 5
        assert s["last_verified_step"] == 8


def test_model_checkpoint_files_have_manifests(quick):
    ckpts = quick["clean"]["out"] / "checkpoints"
    files = sorted(p.name for p in ckpts.glob("*.ckpt"))
    assert files == ["epoch=2-step=9.ckpt", "last.ckpt"]  # top-1 rotation; kept files gone once covered
    for name in files:
        manifest = json.loads((ckpts / f"{name}.sdcguard.json").read_text())
        # Lightning's global_step 9 counts updates; the manifest names the last step updated
        assert (manifest["step"], manifest["audited_step"], manifest["model_key"]) == (8, 8, "state_dict")
        assert verify_checkpoint(ckpts / name, expect_step=8).sha256 == manifest["sha256"]
    assert not list((quick["plain"]["out"] / "checkpoints").glob("*.sdcguard.json"))


def test_fault_names_the_rank_and_a_kept_checkpoint_before_its_window(quick):
    alarm = _the_alarm(quick["fault"])
    assert (alarm["check"], alarm["step"], alarm["suspect_ranks"], alarm["ambiguous"]) == ("replay", 8, [1], False)
    assert alarm["suspect_window"] == {"first_step": 5, "last_step": 8}  # after the passing audit at 4
    # last.ckpt held step 2, then step 5 (inside the window): the step-2 file was kept for this alarm
    ckpts = quick["fault"]["out"] / "checkpoints"
    assert alarm["last_good_checkpoint"] == str(ckpts / "last.sdcguard-step2.ckpt")
    assert alarm["last_good_checkpoint_kept_from"] == str(ckpts / "last.ckpt")
    assert alarm["last_good_checkpoint_step"] == 2
    assert json.loads((ckpts / "last.ckpt.sdcguard.json").read_text())["step"] == 5
    verified = verify_checkpoint(alarm["last_good_checkpoint"], expect_step=2,
                                 expect_sha256=alarm["last_good_checkpoint_sha256"])
    assert verified.step == 2


def test_resume_from_the_named_checkpoint_ends_bitwise_on_the_clean_run(quick):
    resumed = quick["resumed"]
    for r in resumed["results"]:
        assert (r["alarms"], r["errors"], r["first_step"], r["final_step"]) == ([], [], 3, 9)
    assert _digest(resumed) == _digest(quick["clean"])
    for again, clean in zip(resumed["results"], quick["clean"]["results"]):
        assert again["losses"] == {k: v for k, v in clean["losses"].items() if not k.startswith("0:")}



def test_hyperparameters_are_saved_and_checked(quick):
    # examples/lightning's module calls save_hyperparameters(): Lightning stores them as a plain dict,
    # which torch.load(weights_only=True) reads, so sdcguard verify-checkpoint passes as for any file
    last = quick["clean"]["out"] / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["hyper_parameters"] == {"features": 16, "hidden": 32, "classes": 4,
                                                                       "lr": 0.01}
    assert cli.main(["verify-checkpoint", str(last), "--step", "8"]) == 0


def test_hyperparameters_weights_only_refuses_are_named_and_a_resume_is_bitwise(tmp_path, capsys):
    # a pathlib.Path among the hyperparameters: verify-checkpoint says which object the file holds
    # (exit 2, not a mismatch) and checks the file once the user allows exactly it; a run resumed
    # from it (accumulate_grad_batches=1, weights_only=False after sdcguard checked the bytes) ends
    # bit for bit on the uninterrupted one
    def run(out, epochs, *resume):
        proc = subprocess.run([sys.executable, str(ROOT / "tests" / "lightning_hparams_worker.py"), str(out),
                               str(epochs), *resume], capture_output=True, text=True, timeout=300, env=job_env(), cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-6000:]
        return json.loads((out / "result.json").read_text())

    full = run(tmp_path / "full", 2)
    first = tmp_path / "full" / "checkpoints" / "epoch=0-step=4.ckpt"
    capsys.readouterr()
    assert cli.main(["verify-checkpoint", str(first)]) == 2
    assert "pathlib.PosixPath" in capsys.readouterr().err
    assert cli.main(["verify-checkpoint", str(first), "--step", "3", "--allow-global", "pathlib.PosixPath"]) == 0
    assert cli.main(["verify-checkpoint", str(first), "--step", "4", "--allow-global", "pathlib.PosixPath"]) == 1
    resumed = run(tmp_path / "resumed", 2, str(first))
    assert full["global_step"] == resumed["global_step"] == 8
    assert resumed["weights_digest"] == full["weights_digest"]

# -- slow: every fault kind, bf16, a rotated checkpoint, the scripts as launched ----------------

@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(MATRIX)), ids=[s.split(":")[0] for s in MATRIX])
def test_every_fault_kind_is_caught_by_its_check_naming_its_rank(matrix, index):
    fault = parse_fault(MATRIX[index])
    alarm = _the_alarm(matrix[f"fault{index}"])
    assert alarm["check"] == KINDS[fault.kind].caught_by
    assert alarm["step"] >= fault.step
    assert alarm["suspect_ranks"] == ([] if fault.rank is None else [fault.rank])
    assert alarm["ambiguous"] is False


@pytest.mark.slow
def test_bf16_mixed_is_checked_and_bitwise_the_plain_run(matrix):
    bf16 = matrix["bf16"]
    for r in bf16["results"]:
        assert (r["alarms"], r["errors"], r["final_step"]) == ([], [], 6)
    assert all(s["checks"]["replay"]["runs"] == 2 for s in bf16["stats"])  # audits at 0 and 4 replayed bf16
    assert _digest(bf16) == _digest(matrix["bf16-plain"])
    assert [r["losses"] for r in bf16["results"]] == [r["losses"] for r in matrix["bf16-plain"]["results"]]


@pytest.mark.slow
def test_a_rotated_checkpoint_an_alarm_may_name_is_kept_and_resumable(matrix):
    alarm = _the_alarm(matrix["rotated"])
    ckpts = matrix["rotated"]["out"] / "checkpoints"
    # ModelCheckpoint (top 1) removed epoch=0-step=3.ckpt when it wrote epoch 1's; the window (5..8) needs it
    assert (alarm["check"], alarm["suspect_ranks"], alarm["last_good_checkpoint_step"]) == ("replay", [2], 2)
    assert alarm["last_good_checkpoint"] == str(ckpts / "epoch=0-step=3.sdcguard-step2.ckpt")
    assert not (ckpts / "epoch=0-step=3.ckpt").exists() and not (ckpts / "epoch=0-step=3.ckpt.sdcguard.json").exists()
    verify_checkpoint(alarm["last_good_checkpoint"], expect_step=2, expect_sha256=alarm["last_good_checkpoint_sha256"])
    assert _digest(matrix["rotated-resumed"]) == _digest(matrix["clean"])


@pytest.mark.slow
def test_an_alarm_stops_the_script_as_launched_by_torchrun(tmp_path):
    out = tmp_path / "fault"
    proc = torchrun(RANKS, EXAMPLE / "train.py", "--out", out, *FLAGS, "--inject", "weight-bitflip:rank=2:step=5",
                    spool=out / "spool", timeout=600, check=False)
    assert proc.returncode != 0  # SDCDetected leaves trainer.fit on every rank; torchrun reports the failure
    assert "SDCDetected" in proc.stderr
    # flipped before step 5; the end-of-epoch checkpoint after step 5 runs check 3 first: no file is written
    alarm = _the_alarm(_read(out), updated=1)
    assert (alarm["check"], alarm["step"], alarm["suspect_ranks"]) == ("weights", 5, [2])
    assert json.loads((out / "checkpoints" / "last.ckpt.sdcguard.json").read_text())["step"] == 2
