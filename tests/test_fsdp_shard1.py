"""sdcguard on an FSDP2 mesh whose shard groups have one rank, ``(R, 1)`` (tests/fsdp_shard1_worker.py
under torchrun over gloo): FSDP2 copies each rank's gradient instead of reduce-scattering it and
all-reduces the copy across the R replicas. The copy's input is recorded (checks 1, 2 and 4 on
the all-reduce), check 3 compares each rank's whole model across the replicas; the reduce-scatter
check does not run, and says so. A clean run is bit-identical to plain FSDP2 on the same mesh, and
every fault is caught naming the rank (or, for the all-reduce, its group)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sdcguard.sharding.layout import layout_of, plan_checks

HERE = Path(__file__).parent


def test_the_plan_of_a_one_shard_mesh_says_the_reduce_scatter_is_a_copy():
    plan = plan_checks(layout_of([[0], [1], [2]], 1), reduce_scatter_checked=True, all_reduce_checked=True)
    assert "one rank per shard group" in plan.off["reduce-checksum (reduce-scatter)"]
    assert "reduce-checksum (reduce-scatter)" not in plan.runs
    assert "reduce-checksum (all-reduce)" in plan.runs and "weights" in plan.runs and "replay" in plan.runs
    assert "before its all-reduce" in plan.runs["nonfinite-local"]
    assert layout_of([[0], [1]], 0).describe().startswith("HSDP 2 replicas x 1 shard")


def _launch(out, ranks, which="short"):
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
                             str(HERE / "fsdp_shard1_worker.py"), str(out), which], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    return proc


def _results(out, ranks, proc):
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output[-6000:]
    return lambda scenario: [json.loads((out / f"{scenario}-rank{r}.json").read_text()) for r in range(ranks)]


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    out = tmp_path_factory.mktemp("shard1") / "3"
    return _results(out, 3, _launch(out, 3))


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    out = tmp_path_factory.mktemp("shard1") / "2"
    return _results(out, 2, _launch(out, 2))


def _clean_run_is_bitwise_plain_fsdp2(runs):
    for r in runs("exact"):
        for run, audited in (("unaudited", None), ("audited", 3)):
            assert r[run]["alarms"] == 0
            assert r[run]["guarded"] == r["plain"]             # every loss, every rank's parameters
            assert r[run]["reduction_verified"] == 3           # check 4 (the all-reduce) on every step
            assert r[run]["weights_verified"] == 3             # check 3 on every step
            assert r[run]["audited"] == audited                # check 2 on every step
        assert r["grads_kept"] == [True] * 4
    plan = "\n".join(runs("exact")[0]["plan"])
    assert "does not run reduce-checksum (reduce-scatter): one rank per shard group" in plan
    for check in ("nonfinite-local", "replay", "reduce-checksum (all-reduce)", "weights"):
        assert f"runs {check}:" in plan
    for r in runs("deferred"):  # the all-reduce deferred to the last micro-batch: nothing for check 4
        assert (r["alarms"], r["guarded"], r["audited"]) == (0, r["plain"], 1)


@pytest.mark.multiprocess
def test_a_clean_run_on_three_replicas_of_one_shard_is_bitwise_plain_fsdp2(three):
    _clean_run_is_bitwise_plain_fsdp2(three)


def _alarm(results, step, weights=False):
    alarms = [{k: v for k, v in r["steps"][str(step)]["alarm"].items() if k != "time"} for r in results]
    assert all(a == alarms[0] for a in alarms)                 # one record (but its clock), every rank
    if not weights:  # (after check 3's alarm the test puts replica 0's weights back: they change)
        assert not any(r["steps"][str(step)]["applied"] for r in results)
    return alarms[0]


@pytest.mark.multiprocess
def test_each_fault_on_three_replicas_is_caught_naming_its_rank(three):
    results = three("faults")
    nan = _alarm(results, 0)                                   # check 1, before the all-reduce
    assert (nan["check"], nan["suspect_ranks"], nan["ambiguous"]) == ("nonfinite-local", [1], False)
    assert nan["evidence"]["confirmation"]["1"]["reproduced"] is False
    flip = _alarm(results, 1)                                  # check 2: the replay of rank 1's batch
    assert (flip["check"], flip["suspect_ranks"], flip["ambiguous"]) == ("replay", [1], False)
    assert flip["evidence"]["pairs"][0]["differing_parameters"]["names"] == ["out (micro-batch 0)"]
    assert flip["evidence"]["coordinates"]["1"] == {"replica": 1, "shard": 0, "shard_group": [1]}
    reduce = _alarm(results, 2)                                # check 4: the all-reduce of shard 0
    assert (reduce["check"], reduce["suspect_ranks"]) == ("reduce-checksum", [])
    assert reduce["evidence"]["groups"]["reduce_scatter"] == []
    assert [(g["shard"], g["ranks"]) for g in reduce["evidence"]["groups"]["all_reduce"]] == [(0, [0, 1, 2])]
    weights = _alarm(results, 3, weights=True)                 # check 3: three replicas, one named
    assert (weights["check"], weights["suspect_ranks"], weights["ambiguous"]) == ("weights", [2], False)
    assert weights["evidence"]["coordinates"] == {"2": {"replica": 2, "shard": 0}}
    reduced = _alarm(results, 5)                               # a NaN no local gradient had
    assert (reduced["check"], reduced["suspect_ranks"]) == ("nonfinite-reduced", [])
    update = _alarm(results, 6, weights=True)                  # check 3 after rank 0's update
    assert (update["check"], update["suspect_ranks"], update["ambiguous"]) == ("weights", [0], False)
    for r in results:
        assert r["steps"]["4"] == {"nonfinite": {"0": 1}, "confirmed": True, "applied": False}  # the data's NaN
        assert r["steps"]["7"] == {"ok": True, "applied": True} and r["audited"] == 7
    assert results[0]["spooled"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_replicas_of_one_shard_clean_and_faults(two):
    _clean_run_is_bitwise_plain_fsdp2(two)
    results = two("faults")
    nan = _alarm(results, 0)
    assert (nan["check"], nan["suspect_ranks"], nan["ambiguous"]) == ("nonfinite-local", [1], False)
    flip = _alarm(results, 1)                                  # two ranks: no third opinion
    assert (flip["check"], flip["suspect_ranks"], flip["ambiguous"]) == ("replay", [0, 1], True)
    reduce = _alarm(results, 2)
    assert reduce["check"] == "reduce-checksum" and [g["shard"] for g in reduce["evidence"]["groups"]["all_reduce"]] == [0]
    weights = _alarm(results, 3, weights=True)                 # two replicas: both named, ambiguous
    assert (weights["check"], weights["suspect_ranks"], weights["ambiguous"]) == ("weights", [0, 1], True)
    update = _alarm(results, 6, weights=True)
    assert (update["check"], update["suspect_ranks"], update["ambiguous"]) == ("weights", [0, 1], True)
    for r in results:
        assert r["steps"]["7"] == {"ok": True, "applied": True}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_hundred_audited_steps_raise_no_false_alarm(tmp_path):
    runs = _results(tmp_path, 3, _launch(tmp_path, 3, "long"))
    for r in runs("long"):
        assert r["alarms"] == 0 and r["guarded"] == r["plain"]  # every step's parameters, bit for bit
        assert (r["audited"], r["weights_verified"], r["reduction_verified"]) == (99, 99, 99)
