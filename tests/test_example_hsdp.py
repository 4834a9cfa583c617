"""examples/gpt/train_hsdp.py under torchrun: the GPT example sharded with FSDP2 over a 2 x 2
(replicate, shard) gloo mesh, in the user's own loop (accumulation, clip_grad_norm_ on DTensors).

Three launches of 4 ranks, started together (each is mostly start-up; ~25-35 s for the three on
this 2-core machine):
  clean   under sdcguard with --mixed-precision (bfloat16 parameters, float32 reduction), 6 steps,
          audits at 0 and 3, check 3 every 2 steps, evaluations at 0 and 3;
  plain   the same flags with --no-sdcguard: every rank's shards, losses and evaluations must be
          bit-identical to clean's;
  faults  float32, --keep-going: an activation of rank 2's forward set to NaN at step 1 (check 1,
          not reproduced by the mesh's replay: nonfinite-local, rank 2) and a flipped bit in rank
          1's local gradient at the audit of step 3 (check 2 names rank 1).

Compiled (slow: three more launches, ~80 s together, most of it inductor):
  blocks  each block compiled in place before fully_shard (torchtitan), checks 1, 3 and 4 on every
          step and no audits: bit for bit the compiled loop without sdcguard;
  root    torch.compile of the sharded root, audits at 0, 3 and 6 (eager) among compiled steps:
          a NaN in a compiled forward, a flipped gradient bit at an audit, a scaled reduced
          element, each caught by its check, a clean audit after them, and a flipped weight bit
          caught by check 3 at the next weight check.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess
SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "gpt" / "train_hsdp.py"
RANKS = 4
COMMON = ["--replicate", "2", "--shard", "2", "--accum", "2", "--grad-clip", "1.0", "--dropout", "0"]
CLEAN = [*COMMON, "--steps", "6", "--audit-every", "3", "--weight-check-every", "2", "--eval-interval", "3",
         "--mixed-precision"]
FAULTS = [*COMMON, "--steps", "4", "--audit-every", "3", "--weight-check-every", "1", "--eval-interval", "0",
          "--keep-going", "--inject", "forward-nan:rank=2:step=1", "--inject", "grad-bitflip:rank=1:step=3:element=7"]


def _start(out, *flags):
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONSAFEPATH": "1", "SDCGUARD_SPOOL": str(out / "spool")}
    for var in ("SDCGUARD_AUDIT_EVERY", "SDCGUARD_WEIGHT_CHECK_EVERY"):
        env.pop(var, None)  # the flags decide
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={RANKS}", str(SCRIPT),
         "--out", str(out), *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _finish(out, proc):
    try:
        output, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
    assert proc.returncode == 0, output[-8000:]
    results = [json.loads((out / f"result-rank{r}.json").read_text()) for r in range(RANKS)]
    alarms = [json.loads(p.read_text()) for p in sorted((out / "spool").glob("*.alarm.json"))]
    stats = [json.loads((out / "spool" / "stats" / f"rank-{r}.json").read_text())
             for r in range(RANKS)] if (out / "spool" / "stats").is_dir() else None
    return {"results": results, "alarms": alarms, "stats": stats, "output": output}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hsdp")
    flags = {"clean": CLEAN, "plain": [*CLEAN, "--no-sdcguard"], "faults": FAULTS}
    procs = {name: _start(root / name, *f) for name, f in flags.items()}  # together: start-up dominates
    return {name: _finish(root / name, proc) for name, proc in procs.items()}


@pytest.mark.slow  # three 4-rank launches (~45 s): make test keeps test_fsdp.py's HSDP 2 x 2 runs
def test_clean_hsdp_run_under_mixed_precision_raises_nothing_and_every_check_ran(runs):
    clean = runs["clean"]
    for r in clean["results"]:
        assert (r["alarms"], r["errors"], r["final_step"], r["sdcguard"]) == ([], [], 6, True)
        # check 2 passed at the audit of step 3, check 3 at step 4, checks 1 and 4 on every step
        assert (r["last_audited"], r["last_weights_verified"], r["last_reduction_verified"]) == (3, 4, 5)
    assert clean["alarms"] == []
    for s in clean["stats"]:
        # check 3 on the 3 weight-check steps and, before the update, on the 2 audit steps (as for DDP)
        assert s["checks"]["replay"]["runs"] == 2 and s["checks"]["weights"]["runs"] == 5
        assert s["checks"]["reduce_checksum"]["runs"] == 6
    plan = "\n".join(clean["results"][0]["plan"])
    assert "HSDP 2 replicas x 2 shards" in plan
    for check in ("nonfinite-local", "replay", "reduce-checksum (reduce-scatter)", "reduce-checksum (all-reduce)",
                  "weights"):
        assert f"runs {check}:" in plan
    assert "does not run" not in plan  # mixed precision with a float32 reduction turns no check off
    digests = [r["weights_digest"] for r in clean["results"]]
    # rank (i, j) holds shard j of replica i: ranks 0 and 2 hold shard 0, ranks 1 and 3 shard 1
    assert digests[0] == digests[2] and digests[1] == digests[3] and digests[0] != digests[1]


@pytest.mark.slow
def test_clean_run_is_bitwise_the_same_loop_without_sdcguard(runs):
    # mixed precision, 2 micro-batches each reduce-scattered and all-reduced, clip_grad_norm_ on
    # DTensors, AdamW, warm-up + cosine, two audits: the same arithmetic, so the same bits
    for guarded, unguarded in zip(runs["clean"]["results"], runs["plain"]["results"]):
        assert unguarded["sdcguard"] is False and unguarded["alarms"] == [] and unguarded["errors"] == []
        assert guarded["weights_digest"] == unguarded["weights_digest"]
        assert guarded["losses"] == unguarded["losses"] and guarded["evals"] == unguarded["evals"]
    # and bfloat16 was in effect: the float32 run's step 0 (no fault yet) reads other bits
    assert runs["faults"]["results"][0]["losses"]["0"] != runs["clean"]["results"][0]["losses"]["0"]


@pytest.mark.slow
def test_injected_faults_are_caught_naming_the_rank_and_its_place_in_the_mesh(runs):
    faults = runs["faults"]
    expected = [("nonfinite-local", 1, [2]), ("replay", 3, [1])]
    for r in faults["results"]:
        assert [(a["check"], a["step"], a["suspect_ranks"]) for a in r["alarms"]] == expected
        assert [e["type"] for e in r["errors"]] == ["SDCDetected", "SDCDetected"]
    assert sorted((a["check"], a["step"], a["suspect_ranks"]) for a in faults["alarms"]) == sorted(expected)
    fired = sorted((f["kind"], f["rank"], f["step"]) for r in faults["results"] for f in r["fired"])
    assert fired == [("forward-nan", 2, 1), ("grad-bitflip", 1, 3)]
    by_check = {a["check"]: a for a in faults["alarms"]}
    nan = by_check["nonfinite-local"]["evidence"]
    assert nan["confirmation"]["2"]["reproduced"] is False  # the mesh replayed rank 2's batch elsewhere: finite
    replay = by_check["replay"]
    assert not replay["ambiguous"] and replay["evidence"]["mesh"] == {"replicas": 2, "shards": 2}
    assert replay["evidence"]["coordinates"]["1"] == {"replica": 0, "shard": 1, "shard_group": [0, 1]}
    assert replay["evidence"]["pairs"][0]["differing_parameters"]["names"] == ["transformer.h.0 (micro-batch 0)"]


COMPILED = [*COMMON, "--steps", "9", "--weight-check-every", "2", "--eval-interval", "0"]
# a weight fault leaves the replicas apart for good: it comes last, after the clean audit of step 6
COMPILED_FAULTS = ["--keep-going", "--inject", "forward-nan:rank=2:step=1", "--inject",
                   "grad-bitflip:rank=1:step=3:element=7", "--inject", "reduce-scale:rank=3:step=4",
                   "--inject", "weight-bitflip:rank=0:step=7"]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    root = tmp_path_factory.mktemp("hsdp-compiled")
    flags = {"blocks": [*COMPILED, "--compile", "blocks", "--audit-every", "0"],
             "blocks-plain": [*COMPILED, "--compile", "blocks", "--no-sdcguard"],
             "root": [*COMPILED, "--compile", "root", "--audit-every", "3", *COMPILED_FAULTS]}
    procs = {name: _start(root / name, *f) for name, f in flags.items()}
    return {name: _finish(root / name, proc) for name, proc in procs.items()}


@pytest.mark.slow
def test_blocks_compiled_before_fully_shard_train_bitwise_as_without_sdcguard(compiled):
    for guarded, unguarded in zip(compiled["blocks"]["results"], compiled["blocks-plain"]["results"]):
        assert guarded["compiled_graphs"] > 0 and unguarded["compiled_graphs"] > 0
        assert (guarded["alarms"], guarded["errors"], guarded["final_step"]) == ([], [], 9)
        assert guarded["weights_digest"] == unguarded["weights_digest"] and guarded["losses"] == unguarded["losses"]
        assert (guarded["last_weights_verified"], guarded["last_reduction_verified"]) == (8, 8)
    assert compiled["blocks"]["alarms"] == []


@pytest.mark.slow
def test_a_compiled_root_catches_every_fault_by_its_check_and_audits_clean_after(compiled):
    run = compiled["root"]
    expected = [("nonfinite-local", 1, [2]), ("replay", 3, [1]), ("reduce-checksum", 4, []),
                ("weights", 8, [0, 2])]  # two replicas of rank 0's shard: both named (ambiguous)
    for r in run["results"]:
        assert r["model"] == "OptimizedModule" and r["compiled_graphs"] > 0 and r["final_step"] == 9
        assert [(a["check"], a["step"], a["suspect_ranks"]) for a in r["alarms"]] == expected
        assert r["last_audited"] == 6  # the audit after the faults passed: no false alarm from compiled steps
    fired = sorted((f["kind"], f["rank"], f["step"]) for r in run["results"] for f in r["fired"])
    assert fired == [("forward-nan", 2, 1), ("grad-bitflip", 1, 3), ("reduce-scale", 3, 4),
                     ("weight-bitflip", 0, 7)]
