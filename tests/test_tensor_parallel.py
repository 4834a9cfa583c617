"""sdcguard on tensor-parallel models (``layouts/tensor_parallel.py``): ``parallelize_module`` then
FSDP2/HSDP over the data-parallel dimensions, as torchtitan builds its 3-D mesh. The pure parts in
process (the mesh of every TP rank's FSDP grid, the ring's start-up check, check 3 and check 4 per
(TP, FSDP) position, who a fault must name); then, under torchrun over gloo, one launch of
tests/tp_worker.py (4 ranks: 2 replicas x TP 2): a clean run audited every step is bit for bit the
plain loop, a DCP checkpoint of every position resumes bit for bit and a tampered one is refused,
and injected faults are named — one rank for a fault in its own gradient, its TP group for a fault
in its forward. The slow tests run the drill with ``--tp 2`` on 3 nodes: every fault kind caught by
its check, the recovered run bit for bit the clean one."""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sdcguard.checks.topology import Topology
from sdcguard.drill import launch
from sdcguard.drill.model import tp_local_shape
from sdcguard.faults.judge import Schedule, expected_suspects, judge_faults
from sdcguard.faults.spec import parse_fault
from sdcguard.fingerprint import Fingerprint
from sdcguard.layouts.tensor_parallel import ring_refusal, tp_plan, tp_ring
from sdcguard.sharding.dcp_manifest import build, judge_shard, position
from sdcguard.sharding.layout import columns_layout
from sdcguard.sharding.reduction_check import localize_checksum
from sdcguard.sharding.shard_weights import judge_shard_weights, ranks_needed

HERE = Path(__file__).parent

# torchtitan's order (dp_replicate, dp_shard, tp) over 12 ranks: replica i, shard j, TP rank k is
# rank 4i + 2j + k; each TP rank's FSDP grid is a column.
COLUMNS = [[[4 * i + 2 * j + k for j in range(2)] for i in range(3)] for k in range(2)]


def topology(world, per_node):
    ids = {r: {"rank": r, "pod": None, "node": None} for r in range(world)}
    return Topology(0, world, per_node, ids, run_id="t", threads={r: 1 for r in range(world)})


# -- pure parts ----------------------------------------------------------------------------------

def test_the_mesh_holds_every_tp_ranks_fsdp_grid():
    mesh = columns_layout(COLUMNS, rank=7)
    assert (mesh.replicas, mesh.shards, mesh.tp, mesh.world_size) == (3, 2, 2, 12)
    assert mesh.grid == ((1, 3), (5, 7), (9, 11))                       # rank 7's own FSDP grid: TP rank 1
    assert mesh.coordinates(7) == {"replica": 1, "shard": 1, "tp": 1}
    assert mesh.tp_group(7) == [6, 7] and mesh.tp_group(0) == [0, 1]
    assert mesh.replicas_of_shard(1, 0) == [2, 6, 10] and mesh.shard_group(2, 1) == [9, 11]
    assert mesh.positions() == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert "each x tensor parallel over 2 ranks" in mesh.describe()
    with pytest.raises(ValueError, match="exactly once"):
        columns_layout([[[0, 1]], [[1, 2]]], rank=0)


def test_the_ring_must_carry_each_tp_group_onto_another():
    mesh = columns_layout(COLUMNS, rank=0)
    assert ring_refusal(mesh, topology(12, 4)) is None                  # TP groups inside nodes of 4
    assert ring_refusal(mesh, topology(12, 2)) is None                  # a TP group per node
    # TP rank k = r // 6 (TP the slowest dimension): rank r + 2 is not r's counterpart in another group
    strided = [[[6 * k + 2 * i + j for j in range(2)] for i in range(3)] for k in range(2)]
    refusal = ring_refusal(columns_layout(strided, rank=0), topology(12, 2))
    assert refusal is not None and "TP the fastest mesh dimension" in refusal


def test_on_one_node_a_rank_replays_the_same_tp_rank_of_the_next_group():
    mesh = columns_layout(COLUMNS, rank=0)
    one_node = topology(12, 12)  # the default ring reaches the next GPU: its own TP group
    assert "does not carry" in ring_refusal(mesh, one_node)
    ring = tp_ring(mesh, one_node)
    assert [ring.replay_target(r) for r in (0, 1, 10, 11)] == [2, 3, 0, 1]
    assert ring_refusal(mesh, ring) is None and ring.units == 6  # six TP groups in the ring
    assert tp_ring(mesh, topology(12, 2)) == topology(12, 2)  # across nodes: the default ring
    two_groups = tp_ring(columns_layout([[[0]], [[1]]], rank=0), topology(2 * 2, 4))
    assert two_groups.units == 2  # rank r and r + 2 replay each other: ambiguous, never certain


def test_the_plan_says_where_tp_groups_lie_and_what_is_named():
    mesh = columns_layout(COLUMNS, rank=0)
    inside = "\n".join(tp_plan(mesh, topology(12, 2)))
    assert "lies within one node" in inside and "the group (one node) is named" in inside
    assert "spans nodes" in "\n".join(tp_plan(mesh, topology(12, 1)))


def test_check3_names_the_replica_of_a_tp_shard_outside_its_majority():
    mesh = columns_layout(COLUMNS, rank=0)
    digests = [bytes([r % 4]) * 16 for r in range(12)]      # each (TP, shard) position's replicas agree
    digests[7] = bytes([9]) * 16                             # ... but replica 1 of (tp 1, shard 1)
    assert ranks_needed(digests, mesh) == {3, 7}
    fps = [None] * 12
    fps[3], fps[7] = [Fingerprint(1, 1)], [Fingerprint(2, 2)]
    verdict = judge_shard_weights(digests, fps, ["up.weight"], mesh)
    assert verdict.suspects == [7] and not verdict.ambiguous
    assert verdict.evidence["coordinates"] == {7: {"replica": 1, "shard": 1, "tp": 1}}
    assert verdict.evidence["mesh"] == {"replicas": 3, "shards": 2, "tp": 2}
    assert list(verdict.evidence["shards"]) == ["1/tp1"]


def test_check4_names_the_reduction_group_of_its_tp_rank():
    mesh = columns_layout(COLUMNS, rank=0)
    rows = [[0.0, 0.0, -1.0, 0.0, 1.0, 0.0, 1.0] for _ in range(12)]
    for r in mesh.replicas_of_shard(0, 1):                  # the all-reduce of (tp 1, shard 0) is off
        rows[r][5] = 10.0
    found = localize_checksum(rows, mesh, rs_elements=8, ar_elements=4, dtypes=())
    assert found["reduce_scatter"] == []
    assert [(g["shard"], g["tp"], g["ranks"]) for g in found["all_reduce"]] == [(0, 1, [1, 5, 9])]


def test_a_manifest_lists_every_tp_and_fsdp_position():
    reports = [{"digest": f"d{r % 4}", "chunks": [[[0], [r % 4]]]} for r in range(12)]
    manifest = build(step=3, files={".metadata": "aa"}, grid=COLUMNS[0], weights_verified=True, model_key="model",
                     state_keys=[], parameters=["w"], reports=reports, recorded={}, columns=COLUMNS)
    assert [(s["tp"], s["shard"], s["ranks"]) for s in manifest["shards"]] == [
        (0, 0, [0, 4, 8]), (0, 1, [2, 6, 10]), (1, 0, [1, 5, 9]), (1, 1, [3, 7, 11])]
    assert manifest["mesh"]["tp"] == 2 and manifest["mesh"]["columns"] == COLUMNS
    where = columns_layout(COLUMNS, rank=7).coordinates(7)
    assert position(where, 2) == 3 and judge_shard(manifest, 3, "d3") is None
    assert "shard 1 of TP rank 1 (ranks [3, 7, 11])" in judge_shard(manifest, 3, "bad")


def test_a_fault_in_a_forward_names_the_tp_group_and_one_in_a_gradient_its_rank():
    assert expected_suspects(parse_fault("forward-scale:rank=3:step=1"), tp=2) == [2, 3]
    assert expected_suspects(parse_fault("grad-bitflip:rank=3:step=1"), tp=2) == [3]
    assert expected_suspects(parse_fault("forward-nan:rank=3:step=1"), tp=1) == [3]
    plan = Schedule(10, 2, 1, nodes=3, tp=2)
    alarm = {"id": "a", "check": "replay", "step": 2, "suspect_ranks": [2, 3], "ambiguous": False}
    assert judge_faults(["forward-scale:rank=3:step=2"], [alarm], plan).rows[0]["outcome"] == "caught"
    assert judge_faults(["forward-scale:rank=3:step=2"], [{**alarm, "suspect_ranks": [3]}],
                        plan).rows[0]["outcome"] == "misattributed"


def test_the_drill_models_tp_shards():
    assert tp_local_shape("hidden.weight", (32, 32), 2) == (16, 32)
    assert tp_local_shape("hidden.bias", (32,), 2) == (16,)
    assert tp_local_shape("head.weight", (4, 32), 2) == (4, 16)
    assert tp_local_shape("head.bias", (4,), 2) == (4,) and tp_local_shape("embed.weight", (32, 16), 2) == (32, 16)


def config(*argv):
    parser = argparse.ArgumentParser()
    launch.add_arguments(parser)
    return launch.config_from_args(parser.parse_args(list(argv)))


def test_the_drill_lays_tp_groups_inside_nodes():
    cfg = config("--tp", "2", "--replicate", "3", "--ranks-per-node", "2")
    assert (cfg["replicate"], cfg["shard"], cfg["tp"], cfg["world_size"], cfg["nodes"]) == (3, 1, 2, 6, 3)
    cfg = config("--tp", "2", "--shard", "2", "--replicate", "2", "--ranks-per-node", "4")
    assert (cfg["replicate"], cfg["shard"], cfg["tp"], cfg["world_size"]) == (2, 2, 2, 8)
    assert "tp" not in config("--shard", "2", "--replicate", "2")


@pytest.mark.parametrize("argv, message", [
    (["--tp", "2"], "--tp needs the data-parallel size"),
    (["--tp", "4", "--replicate", "3", "--ranks-per-node", "2"], "--tp must divide --ranks-per-node"),
    (["--tp", "0", "--replicate", "2"], "--tp must be >= 1"),
    (["--tp", "2", "--replicate", "2", "--nodes", "3"], "--replicate 2 x --shard 1 x --tp 2 = 4 ranks, but the job has 6"),
    (["--tp", "2", "--shard", "2", "--replicate", "1", "--ranks-per-node", "2", "--nodes", "2",
      "--inject", "weight-bitflip:rank=1:step=1:param=hidden.weight:element=300"],
     "element 300 is not in shard 0 of hidden.weight (shape (16, 32), over 2 shards)"),  # its TP shard's half
])
def test_what_tp_cannot_run_is_refused_before_anything_starts(argv, message):
    with pytest.raises(launch.DrillInputError) as info:
        config(*argv)
    assert message in str(info.value)


# -- under torchrun (4 ranks: 2 replicas x TP 2) -------------------------------------------------

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                           str(HERE / "tp_worker.py"), str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return lambda scenario: [json.loads((out / f"{scenario}-rank{r}.json").read_text()) for r in range(4)]


@pytest.mark.multiprocess
def test_a_clean_tp_run_is_bitwise_the_plain_loop_audited_or_not(runs):
    for r in runs("exact"):
        assert r["unaudited"] == r["plain"] + [0] and r["audited"] == r["plain"] + [0]
        assert (r["audited_step"], r["weights_verified"]) == (3, 3)
    plan = "\n".join(runs("exact")[0]["plan"])
    assert "each x tensor parallel over 2 ranks" in plan and "lies within one node" in plan


@pytest.mark.multiprocess
def test_a_tp_checkpoint_resumes_bitwise_and_a_tampered_one_is_refused(runs):
    for r in runs("resume"):
        assert r["start"] == 1 and r["alarms"] == 0 and r["final"] == r["uninterrupted"]
        assert "was modified after it was written" in r["tampered_refused"]


@pytest.mark.multiprocess
def test_tp_faults_name_the_rank_or_its_tp_group(runs):
    results = runs("faults")
    assert len({json.dumps(r["steps"], sort_keys=True) for r in results}) == 1  # every rank, the same verdicts
    steps = results[0]["steps"]
    # rank 1's own gradient: only its pair differs, not its TP peer's (2 nodes: ambiguous with its replayer)
    assert (steps["0"]["check"], steps["0"]["suspect_ranks"], steps["0"]["ambiguous"]) == ("replay", [1, 3], True)
    assert [(p["replayer"], p["owner"]) for p in steps["0"]["evidence"]["pairs"]] == [(3, 1)]
    # rank 2's forward reaches its TP group (2, 3): both of its ranks' pairs differ
    assert steps["1"]["check"] == "replay"
    assert [(p["replayer"], p["owner"]) for p in steps["1"]["evidence"]["pairs"]] == [(0, 2), (1, 3)]
    assert steps["1"]["evidence"]["coordinates"]["2"]["tp_group"] == [2, 3]
    # rank 3's stored shard: check 3 at its (replica, shard, tp)
    assert (steps["2"]["check"], steps["2"]["suspect_ranks"]) == ("weights", [1, 3])
    assert steps["2"]["evidence"]["coordinates"]["3"] == {"replica": 1, "shard": 0, "tp": 1}


# -- the drill, 3 nodes x a TP group of 2 (slow) --------------------------------------------------

TP_DRILL = ["--tp", "2", "--replicate", "3", "--ranks-per-node", "2", "--steps", "10", "--audit-every", "2",
            "--weight-check-every", "1", "--checkpoint-every", "2"]


def drill(tmp_path, name, *args):
    out = tmp_path / name
    out.mkdir()
    proc = subprocess.run([sys.executable, "-m", "sdcguard.cli", "drill", *TP_DRILL, *args, "--report",
                           str(out / "report.json"), "--spool", str(out / "spool")], capture_output=True, text=True,
                          timeout=900)
    assert (out / "report.json").exists(), proc.stdout + proc.stderr
    return proc, json.loads((out / "report.json").read_text())


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_tp_drill_catches_every_check_and_recovers_bitwise(tmp_path):
    _, clean = drill(tmp_path, "clean")
    assert clean["passed"] and clean["alarms"] == []
    proc, report = drill(tmp_path, "faults", "--on-alarm", "resume",
                         "--inject", "forward-scale:rank=2:step=2",         # check 2 names TP group (2, 3)
                         "--inject", "grad-inf:rank=5:step=3",              # check 1 names rank 5
                         "--inject", "reduce-scale:step=5",                 # check 4, no rank
                         "--inject", "weight-bitflip:rank=1:step=7")        # check 3 names rank 1
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert report["passed"] and report["unexplained_alarms"] == []
    assert {a["step"]: (a["check"], a["suspect_ranks"]) for a in report["alarms"]} == {
        2: ("replay", [2, 3]), 3: ("nonfinite-local", [5]), 5: ("reduce-checksum", []), 7: ("weights", [1])}
    assert "tensor parallel over 2 ranks" in proc.stdout
    assert report["final_weights_digest"] == clean["final_weights_digest"]
