"""The drill on a sharded model (``sdcguard drill --shard S --replicate R``): FSDP2 over a gloo CPU
mesh of consecutive ranks, with the DDP drill's flags, report and judging. In-process: the mesh
the flags give, what is refused before anything starts, and how the judge treats pure FSDP's missing
check 3. Under real processes: HSDP 2 x 2 and pure FSDP over 4, each clean (no alarm) and with
faults (each caught by its check at its step, naming its rank; a weight fault on pure FSDP escapes,
said why), resumed after every alarm; the recovered HSDP run ends bit for bit where the clean one
does, and the pure-FSDP run's last job (resumed from the start, every fault spent) is a clean run;
3 replicas of unsharded units (``--shard 1``) catch every check's fault and recover bit for bit. The full matrix (every kind, every mesh) is bench/drill_matrix.py."""
import argparse
import json
import subprocess
import sys

import pytest

from sdcguard.drill import launch
from sdcguard.faults.judge import Schedule, judge_faults
from sdcguard.faults.sharded import shard_numel


def config(*argv):
    parser = argparse.ArgumentParser()
    launch.add_arguments(parser)
    return launch.config_from_args(parser.parse_args(list(argv)))


@pytest.mark.parametrize("argv, mesh", [
    (["--shard", "2", "--replicate", "2"], (2, 2, 2, 4)),            # HSDP: a replica per node of 2 ranks
    (["--shard", "2"], (3, 2, 3, 6)),                                 # the default 3 nodes: 3 replicas
    (["--shard", "4", "--replicate", "1", "--ranks-per-node", "1"], (1, 4, 4, 4)),  # FSDP over 4 nodes
    (["--shard", "2", "--replicate", "2", "--nodes", "1", "--ranks-per-node", "4"], (2, 2, 1, 4)),
    (["--shard", "4", "--world-size", "8", "--ranks-per-node", "2"], (2, 4, 4, 8)),  # a shard group spans 2 nodes
    (["--shard", "1", "--replicate", "3", "--ranks-per-node", "1"], (3, 1, 3, 3)),  # (R, 1): unsharded units
])
def test_the_mesh_follows_the_flags_and_the_nodes(argv, mesh):
    cfg = config(*argv)
    assert (cfg["replicate"], cfg["shard"], cfg["nodes"], cfg["world_size"]) == mesh


def test_the_ddp_drill_config_is_unchanged():
    assert "shard" not in config("--nodes", "3") and "replicate" not in config("--nodes", "3")


@pytest.mark.parametrize("argv, message", [
    (["--replicate", "2"], "--replicate needs --shard S"),
    (["--shard", "1"], "--shard 1 needs --replicate R >= 2"),
    (["--shard", "1", "--replicate", "1", "--nodes", "1", "--ranks-per-node", "1"], "--shard 1 needs --replicate R >= 2"),
    (["--shard", "0"], "--shard must be >= 1"),
    (["--shard", "4"], "--shard 4 does not divide the job's 6 ranks"),
    (["--shard", "2", "--replicate", "2", "--nodes", "3"], "--replicate 2 x --shard 2 = 4 ranks, but the job has 6"),
    (["--shard", "3", "--replicate", "2", "--ranks-per-node", "2"], "would straddle nodes of 2 ranks"),
    # element= of a shard-side kind indexes the struck rank's shard: head.weight (4 x 32) over 4 shards
    # holds 32 elements per shard
    (["--shard", "4", "--replicate", "1", "--ranks-per-node", "4", "--nodes", "1",
      "--inject", "weight-bitflip:rank=3:step=1:param=head.weight:element=40"],
     "element 40 is not in shard 3 of head.weight (shape (4, 32), over 4 shards), which holds 32 elements"),
    # over 8 shards, shards 4..7 of head.weight are empty; a reduce fault without a rank strikes them all
    (["--shard", "8", "--replicate", "1", "--ranks-per-node", "8", "--nodes", "1",
      "--inject", "reduce-scale:step=1:param=head.weight"], "shard 4 of head.weight (shape (4, 32), over 8 shards) is empty"),
    (["--shard", "2", "--inject", "grad-inf:rank=0:step=1:param=head.bias:element=4"], "element 4 is out of range"),
])
def test_what_cannot_strike_a_shard_is_refused_before_anything_starts(argv, message):
    with pytest.raises(launch.DrillInputError, match=None) as info:
        config(*argv)
    assert message in str(info.value)


def test_help_says_how_ranks_map_onto_the_mesh():
    assert "rank r holds shard r % S of replica r // S" in launch.DESCRIPTION
    assert "within a node" in launch.DESCRIPTION


def test_shard_sizes_follow_fsdp2s_chunking():
    assert [shard_numel((32, 16), 3, j) for j in range(3)] == [11 * 16, 11 * 16, 10 * 16]
    assert [shard_numel((4,), 8, j) for j in range(8)] == [1, 1, 1, 1, 0, 0, 0, 0]


def test_without_a_second_replica_a_weight_fault_escapes_and_says_why():
    plan = Schedule(10, 2, 1, nodes=4, checks_weights=False)
    verdict = judge_faults(["weight-swap:rank=1:step=3", "optimizer-scale:rank=0:step=5", "grad-inf:rank=2:step=4"],
                           [], plan)
    assert [r["outcome"] for r in verdict.rows] == ["escaped", "escaped", "missed"]
    assert "one replica (pure FSDP)" in verdict.rows[0]["why"]


# -- real drills (gloo, 4 ranks) -----------------------------------------------------------------

HSDP = ["--shard", "2", "--replicate", "2", "--nodes", "1", "--ranks-per-node", "4"]
FSDP = ["--shard", "4", "--replicate", "1", "--nodes", "4", "--ranks-per-node", "1"]  # the shard group spans 4 nodes
RUN = ["--steps", "8", "--audit-every", "2", "--weight-check-every", "1", "--micro-batches", "2"]


def drill(tmp_path_factory, name, *args):
    out = tmp_path_factory.mktemp(name)
    proc = subprocess.run([sys.executable, "-m", "sdcguard.cli", "drill", *args, "--report", str(out / "report.json"),
                           "--spool", str(out / "spool")], capture_output=True, text=True, timeout=600)
    assert (out / "report.json").exists(), proc.stdout + proc.stderr
    return proc, json.loads((out / "report.json").read_text())


def alarms_by_step(report):
    return {a["step"]: (a["check"], a["suspect_ranks"], a["ambiguous"]) for a in report["alarms"]}


@pytest.fixture(scope="module")
def hsdp_clean(tmp_path_factory):
    return drill(tmp_path_factory, "hsdp-clean", *HSDP, *RUN)


@pytest.fixture(scope="module")
def hsdp_faults(tmp_path_factory):
    return drill(tmp_path_factory, "hsdp-faults", *HSDP, *RUN, "--on-alarm", "resume",
                 "--inject", "grad-bitflip:rank=1:step=2",         # check 2: rank 1's local gradient
                 "--inject", "forward-nan:rank=2:step=3",          # check 1: a NaN in rank 2's forward
                 "--inject", "weight-swap:rank=3:step=5",          # check 3: shard 1's replicas differ
                 "--inject", "reduce-scale:step=7")                # check 4: every rank's reduced shard


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_clean_hsdp_drill_raises_no_alarm(hsdp_clean):
    proc, report = hsdp_clean
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert report["passed"] and report["alarms"] == [] and report["steps_completed"] == 8
    assert (report["config"]["replicate"], report["config"]["shard"]) == (2, 2)
    assert report["final_weights_digest"] is not None  # every replica's gathered model agrees
    assert "[drill] sharded: HSDP 2 replicas x 2 shards" in proc.stdout


@pytest.mark.multiprocess
@pytest.mark.slow
def test_hsdp_faults_are_caught_by_their_checks_naming_their_ranks(hsdp_faults, hsdp_clean):
    proc, report = hsdp_faults
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert report["passed"] and report["unexplained_alarms"] == []
    assert [r["outcome"] for r in report["injected"]] == ["caught", "caught", "caught-ambiguous", "caught"]
    assert alarms_by_step(report) == {
        2: ("replay", [1], False),
        3: ("nonfinite-local", [2], False),
        5: ("weights", [1, 3], True),          # two replicas: no majority, both named
        7: ("reduce-checksum", [], False),     # a reduction is shared: no rank
    }
    by_step = {a["step"]: a for a in report["alarms"]}
    assert by_step[2]["evidence"]["coordinates"]["1"] == {"replica": 0, "shard": 1, "shard_group": [0, 1]}
    assert by_step[3]["evidence"]["confirmation"]["2"]["reproduced"] is False
    assert by_step[7]["evidence"]["groups"]["all_reduce"]
    # every alarm resumed from a state before its window, and the recovered run ends where the clean one does
    assert [r["resume_step"] < r["suspect_window"]["first_step"] for r in report["recoveries"]] == [True] * 4
    assert report["final_weights_digest"] == hsdp_clean[1]["final_weights_digest"]


@pytest.fixture(scope="module")
def fsdp_faults(tmp_path_factory):
    return drill(tmp_path_factory, "fsdp-faults", *FSDP, *RUN, "--on-alarm", "resume",
                 "--inject", "weight-bitflip:rank=2:step=0",            # pure FSDP: no check 3, it escapes
                 "--inject", "grad-inf:rank=3:step=1",                  # check 1 names rank 3
                 "--inject", "forward-scale:rank=0:step=2:during=replay",  # check 2 names the replayer
                 "--inject", "reduce-nan:step=3")                       # check 1b: a NaN no local gradient had


@pytest.mark.multiprocess
@pytest.mark.slow
def test_pure_fsdp_faults_are_caught_and_a_weight_fault_escapes_saying_why(fsdp_faults):
    proc, report = fsdp_faults
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert report["passed"] and report["unexplained_alarms"] == []
    assert [r["outcome"] for r in report["injected"]] == ["escaped", "caught", "caught", "caught"]
    assert alarms_by_step(report) == {1: ("nonfinite-local", [3], False), 2: ("replay", [0], False),
                                      3: ("nonfinite-reduced", [], False)}
    assert "one replica (pure FSDP)" in report["injected"][0]["why"]
    assert {"kind": "weight-bitflip", "step": 0, "ranks": [2]} in report["fired"]  # it struck, unseen
    assert report["alarms"][0]["suspects"] == [{"rank": 3, "pod": None, "node": "drill-node-3",
                                                "gpu": {"index": 0, "uuid": None}}]
    assert report["alarms"][1]["evidence"]["coordinates"]["0"] == {"replica": 0, "shard": 0, "shard_group": [0, 1, 2, 3]}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_clean_pure_fsdp_run_raises_no_alarm(fsdp_faults):
    """No weights are ever verified with one replica, so every resume is from the start; each fault
    struck once (transient), so the last job is a clean pure-FSDP run of all 8 steps, audited every
    2 (the mesh replaying the ring's batches), with check 1 and 4 on every step: no alarm."""
    proc, report = fsdp_faults
    assert [r["resume_step"] for r in report["recoveries"]] == [-1, -1, -1]
    assert report["steps_completed"] == 8 and report["stopped_at_step"] is None
    assert len(report["alarms"]) == 3 and report["unexplained_alarms"] == []
    assert "[drill] sharded: FSDP over 4 ranks (one replica)" in proc.stdout
    assert report["final_weights_digest"] is not None  # every rank gathers the same model


# -- (R, 1): FSDP2 units that are not sharded, R replicas (tests/test_fsdp_shard1.py for the library)

SHARD1 = ["--shard", "1", "--replicate", "3", "--nodes", "3", "--ranks-per-node", "1"]


@pytest.fixture(scope="module")
def shard1_clean(tmp_path_factory):
    return drill(tmp_path_factory, "shard1-clean", *SHARD1, *RUN)


@pytest.fixture(scope="module")
def shard1_faults(tmp_path_factory):
    return drill(tmp_path_factory, "shard1-faults", *SHARD1, *RUN, "--on-alarm", "resume",
                 "--inject", "weight-bitflip:rank=2:step=0",       # check 3: a majority of 3 replicas
                 "--inject", "grad-inf:rank=1:step=1",             # check 1 names rank 1
                 "--inject", "grad-bitflip:rank=0:step=2",         # check 2: the replay differs
                 "--inject", "reduce-scale:step=3",                # check 4: the all-reduce (no reduce-scatter)
                 "--inject", "optimizer-scale:rank=1:step=5")      # check 3 after the update


@pytest.mark.multiprocess
@pytest.mark.slow
def test_an_unsharded_mesh_drill_catches_every_check_and_recovers_bitwise(shard1_faults, shard1_clean):
    proc, report = shard1_faults
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert shard1_clean[1]["passed"] and shard1_clean[1]["alarms"] == []
    assert report["passed"] and report["unexplained_alarms"] == []
    assert [r["outcome"] for r in report["injected"]] == ["caught"] * 5
    assert alarms_by_step(report) == {0: ("weights", [2], False), 1: ("nonfinite-local", [1], False),
                                      2: ("replay", [0], False), 3: ("reduce-checksum", [], False),
                                      5: ("weights", [1], False)}
    assert "[drill] sharded: HSDP 3 replicas x 1 shards" in proc.stdout
    assert report["final_weights_digest"] == shard1_clean[1]["final_weights_digest"] is not None
