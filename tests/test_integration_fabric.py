"""sdcguard.integrations.fabric under torchrun (gloo, CPU), with the real Lightning Fabric.

  job            tests/fabric_worker.py, 2 ranks, one torchrun job: examples/fabric/train_plain.py
                 and train.py (8 steps, accumulation 2, clipping, a cosine schedule, fabric.save every
                 4 steps to one path), a run resumed through fabric.load from the checkpoint the
                 Guard kept, a tampered copy and a checkpoint of another step refused, and a
                 pair with audits for each of bf16-mixed, 16-mixed and bf16-true (~15-25 s).
  refusals       what the integration cannot check, in this process (no process group).
  matrix (slow)  3 ranks, one job: each of the nine fault kinds in its own short run, and a run
                 saving every step whose alarm names the checkpoint the Guard kept, and a
                 resumed run bit for bit the uninterrupted one on 3 ranks (~20-40 s).
"""
import json

import pytest
from torchrun_jobs import ROOT, rank_results, spooled_alarms, torchrun

from sdcguard.checkpoint import verify_checkpoint
from sdcguard.faults.spec import KINDS
COMMON = ["--steps", "8", "--accum", "2", "--save-every", "4", "--max-grad-norm", "0.1"]
CHECKS = {"SDCGUARD_AUDIT_EVERY": "2", "SDCGUARD_WEIGHT_CHECK_EVERY": "1"}
PRECISIONS = ["bf16-mixed", "16-mixed", "bf16-true"]


def run_plan(ranks, out, plan):
    (out / "plan.json").write_text(json.dumps(plan, default=str))
    torchrun(ranks, ROOT / "tests" / "fabric_worker.py", out / "plan.json", timeout=600)  # each run's own settings


def run(out, name, script, *flags, env=None):
    return {"name": name, "script": script, "flags": ["--out", str(out / name), *map(str, flags)],
            "env": {**(env or {}), "SDCGUARD_SPOOL": str(out / name / "spool")}}




@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("fabric")
    kept = out / "clean" / "ckpt.sdcguard-step3.pt"
    run_plan(2, out, [
        run(out, "plain", "plain", *COMMON),
        run(out, "clean", "train", *COMMON, env=CHECKS),
        run(out, "resumed", "train", *COMMON, "--resume", kept, "--expect-step", 3,
            "--expect-sha256", f"sha256-of:{kept}", env=CHECKS),
        {"tamper": str(out / "clean" / "ckpt.pt"), "copy_to": str(out / "tampered")},
        run(out, "tampered", "train", *COMMON, "--resume", out / "tampered" / "ckpt.pt", env=CHECKS),
        run(out, "other-step", "train", *COMMON, "--resume", out / "clean" / "ckpt.pt", "--expect-step", 3, env=CHECKS),
        *[run(out, f"{precision}{suffix}", script, "--precision", precision, "--steps", 4, env=env)
          for precision in PRECISIONS for suffix, script, env in (("", "train", CHECKS), ("-plain", "plain", None))],
    ])
    return out


@pytest.mark.slow  # the job fixture's 2-rank launches (~30 s): make test keeps the Lightning and Hugging Face clean runs
@pytest.mark.multiprocess
def test_clean_run_is_bitwise_the_plain_fabric_loop(job):
    guarded, plain = rank_results(job / "clean", 2), rank_results(job / "plain", 2)
    for g, p in zip(guarded, plain):
        assert (g["alarms"], g["errors"], g["final_step"]) == ([], [], 7)
        assert len(g["weights"]) == 8 and g["weights"] == p["weights"]  # every step's weights, bit for bit
        assert g["losses"] == p["losses"] and all(len(v) == 2 for v in g["losses"].values())
        assert g["weights_digest"] == p["weights_digest"]
    assert guarded[0]["weights"] == guarded[1]["weights"] and guarded[0]["losses"] != guarded[1]["losses"]
    assert spooled_alarms(job / "clean" / "spool") == []
    stats = json.loads((job / "clean" / "spool" / "stats" / "rank-0.json").read_text())
    assert stats["checks"]["replay"]["runs"] == 4  # audits at 0, 2, 4, 6 ran: the checks were not skipped
    assert stats["checks"]["weights"]["runs"] >= 8 and stats["last_verified_step"] == 6  # the last audit


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("precision", PRECISIONS)
def test_replays_run_under_fabrics_precision(job, precision):
    # the replays run under Fabric's precision plugin too (autocast, bfloat16 weights, 16-mixed's
    # GradScaler): audits pass, bit for bit the plain loop
    for g, p in zip(rank_results(job / precision, 2), rank_results(job / f"{precision}-plain", 2)):
        assert (g["alarms"], g["errors"], g["final_step"]) == ([], [], 3)
        assert g["weights"] == p["weights"] and g["losses"] == p["losses"]
    stats = json.loads((job / precision / "spool" / "stats" / "rank-1.json").read_text())
    assert stats["checks"]["replay"]["runs"] == 2 and stats["last_verified_step"] == 2


@pytest.mark.slow
@pytest.mark.multiprocess
def test_fabric_save_writes_a_manifest_and_keeps_the_resume_point(job):
    import torch

    clean = job / "clean"
    latest = verify_checkpoint(clean / "ckpt.pt", expect_step=7)
    assert (latest.audited_step, latest.audited) == (6, False)
    # ckpt.pt was written at steps 3 and 7; a replay alarm after the audit at 6 would resume from
    # step 3's checkpoint (the newest at or before 6): the Guard kept that file beside it
    kept = verify_checkpoint(clean / "ckpt.sdcguard-step3.pt", expect_step=3)
    assert kept.audited_step == 2
    assert not (job / "plain" / "ckpt.pt.sdcguard.json").exists()
    ours, fabrics = torch.load(clean / "ckpt.pt"), torch.load(job / "plain" / "ckpt.pt")
    assert sorted(ours) == sorted(fabrics) == ["model", "optimizer", "scheduler", "step"]
    assert ours["step"] == fabrics["step"] == 7 and ours["scheduler"] == fabrics["scheduler"]
    assert all(torch.equal(ours["model"][k], v) for k, v in fabrics["model"].items())
    for a, b in zip(ours["optimizer"]["state"].values(), fabrics["optimizer"]["state"].values()):
        assert all(torch.equal(a[k], b[k]) for k in b)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_fabric_load_resumes_bitwise_and_inherits_the_history(job):
    clean, resumed = rank_results(job / "clean", 2), rank_results(job / "resumed", 2)
    for c, r in zip(clean, resumed):
        assert (r["alarms"], r["errors"], r["start"], r["final_step"]) == ([], [], 4, 7)
        assert r["weights"] == {k: v for k, v in c["weights"].items() if int(k) >= 4}
        assert r["losses"] == {k: v for k, v in c["losses"].items() if int(k) >= 4}
    manifest = json.loads((job / "resumed" / "ckpt.pt.sdcguard.json").read_text())
    assert [(e["step"], e["path"]) for e in manifest["earlier_checkpoints"]] == [
        (3, str(job / "clean" / "ckpt.sdcguard-step3.pt"))]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_tampered_or_other_checkpoint_is_refused_on_every_rank(job):
    for name, message in (("tampered", "was modified after it was verified"), ("other-step", "not step 3")):
        for r in rank_results(job / name, 2):
            [error] = r["errors"]
            assert error["type"] == "CheckpointError" and message in error["message"], error
            assert r["weights"] == {} and r["final_step"] is None  # no step ran


def test_what_cannot_be_checked_is_refused_naming_the_setting():
    import torch
    from lightning.fabric import Fabric
    from lightning.fabric.plugins import Precision
    from lightning.fabric.strategies import DataParallelStrategy, FSDPStrategy, ModelParallelStrategy

    from sdcguard import ConfigurationError
    from sdcguard.integrations.fabric import _refuse_unchecked, fabric_guard

    class CustomPrecision(Precision):
        pass

    cpus = [torch.device("cpu")] * 2
    cases = [(Fabric(accelerator="cpu", strategy=DataParallelStrategy(parallel_devices=cpus)), "strategy='dp'"),
             (Fabric(accelerator="cpu", strategy=ModelParallelStrategy(lambda m, mesh: m)), "ModelParallelStrategy"),
             (Fabric(accelerator="cpu", devices=1, plugins=[CustomPrecision()]), "precision plugin CustomPrecision"),
             (Fabric(accelerator="cpu", devices=1), "the model fabric.setup returned")]
    for fabric, message in cases:
        with pytest.raises(ConfigurationError, match=message):
            fabric_guard(fabric, torch.nn.Linear(2, 2), None, lambda m, b: m(b).sum())
    # Fabric itself builds FSDP only for GPUs; the strategy object is refused the same way
    with pytest.raises(ConfigurationError, match="strategy='fsdp' is FSDP1"):
        _refuse_unchecked(FSDPStrategy())


# -- the slow job: every fault kind, an alarm naming a kept checkpoint ----------------------------

RANKS = 3
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


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    out = tmp_path_factory.mktemp("fabricfaults")
    plan = [run(out, kind, "train", "--steps", "4", "--inject", spec, env=CHECKS) for kind, (spec, _, _) in MATRIX.items()]
    kept = out / "uninterrupted" / "ckpt.sdcguard-step3.pt"
    plan.append(run(out, "uninterrupted", "train", *COMMON, env=CHECKS))
    plan.append(run(out, "resumed", "train", *COMMON, "--resume", kept, "--expect-step", 3,
                    "--expect-sha256", f"sha256-of:{kept}", env=CHECKS))
    plan.append(run(out, "kept", "train", "--steps", "6", "--save-every", "1", "--inject", "grad-bitflip:rank=1:step=4",
                    env=CHECKS))
    run_plan(RANKS, out, plan)
    return out


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", sorted(MATRIX))
def test_every_fault_kind_is_caught_by_its_check_naming_the_rank(matrix, kind):
    _, step, named = MATRIX[kind]
    expected = (KINDS[kind].caught_by, step, named)
    ranks = rank_results(matrix / kind, RANKS)
    for r in ranks:  # every rank stopped on the same alarm, in the step that raised it: none hung
        assert [(a["check"], a["step"], a["suspect_ranks"]) for a in r["alarms"]] == [expected], r["errors"]
        assert r["final_step"] == step - 1
    for rank in named:  # the fault did strike there
        assert [f["step"] for f in ranks[rank]["fired"]] == [step]
    [alarm] = spooled_alarms(matrix / kind / "spool")
    assert (alarm["check"], alarm["step"], alarm["suspect_ranks"]) == expected


@pytest.mark.slow
@pytest.mark.multiprocess
def test_an_alarm_names_the_checkpoint_the_guard_kept(matrix):
    out = matrix / "kept"
    [alarm] = spooled_alarms(out / "spool")
    assert (alarm["check"], alarm["step"], alarm["suspect_ranks"]) == ("replay", 4, [1])
    # ckpt.pt was written after every step; the replay alarm's window starts after the audit at 2,
    # so it resumes from step 2's checkpoint, which the Guard kept when step 3's save replaced it
    assert alarm["last_good_checkpoint"] == str(out / "ckpt.sdcguard-step2.pt")
    assert alarm["last_good_checkpoint_kept_from"] == str(out / "ckpt.pt")
    verify_checkpoint(alarm["last_good_checkpoint"], expect_step=2, expect_sha256=alarm["last_good_checkpoint_sha256"])
    assert verify_checkpoint(out / "ckpt.pt").step == 3  # no save after the alarm


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_resumed_run_on_three_ranks_settles_ddps_buckets_and_goes_on_bitwise(matrix):
    # with three ranks the ring all-reduce's sums depend on DDP's bucket layout: settle_with= puts
    # the resumed run in the layout the original run had by then
    for c, r in zip(rank_results(matrix / "uninterrupted", RANKS), rank_results(matrix / "resumed", RANKS)):
        assert (r["alarms"], r["errors"], r["start"], r["final_step"]) == ([], [], 4, 7)
        assert r["weights"] == {k: v for k, v in c["weights"].items() if int(k) >= 4}
        assert r["losses"] == {k: v for k, v in c["losses"].items() if int(k) >= 4}
