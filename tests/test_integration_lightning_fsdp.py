"""GuardedModelParallelStrategy under torchrun: examples/lightning_fsdp on 4 gloo ranks (one process each).

One torchrun launch runs several of the example's scripts in turn (tests/lightning_worker.py):

  quick (slow)  pure FSDP over 4 ranks (Lightning's data_parallel mesh): train.py clean (2 epochs =
      6 steps of 2 micro-batches, clipping, a step LR schedule, audits at 0 and 4), train_plain.py
      (ModelParallelStrategy) the same, train.py with a flipped gradient bit on rank 2 at the audit of step 4.
  tp (slow)  tensor_parallel_size=2 (Lightning's ("data_parallel", "tensor_parallel") mesh, HSDP 2 x 1 x
      TP 2): clean and plain bit for bit, a flipped gradient bit and a scaled activation named.
  hsdp (slow)  HSDP 2 x 2 (configure_model builds the (replicate, shard) mesh): clean and plain
      (3 epochs, audits at 0/3/6), a flipped gradient bit on rank 1 at step 6 and the resume the alarm
      names, a weight bit flipped on rank 3; pure FSDP: a NaN in rank 1's forward, a scaled reduced shard.
"""
import json
from pathlib import Path

import pytest
from torchrun_jobs import ROOT, rank_results, spooled_alarms, spooled_stats, torchrun

from sdcguard import cli
from sdcguard.errors import ConfigurationError

pytestmark = pytest.mark.multiprocess
RANKS = 4
FSDP = ["--epochs", "2", "--audit-every", "4", "--weight-check-every", "2", "--accumulate", "2", "--clip", "1.0"]
HSDP = ["--epochs", "3", "--audit-every", "3", "--weight-check-every", "2", "--accumulate", "2", "--clip", "1.0",
        "--replicate", "2"]


def _read(out: Path) -> dict:
    return {"out": out, "results": rank_results(out, RANKS), "alarms": spooled_alarms(out / "spool"),
            "stats": spooled_stats(out / "spool")}


def run_plan(tmp: Path, plan: list[tuple[str, dict]]) -> dict[str, dict]:
    """Run ``plan`` (name -> script, flags[, resume_as]) in one torchrun job; each run's _read."""
    entries = []
    for name, spec in plan:
        entry = {"script": spec["script"], "flags": ["--out", str(tmp / name), *spec["flags"]]}
        if "env" in spec:
            entry["env"] = spec["env"]
        if "resume_as" in spec:
            entry["resume_as_alarmed"] = str(tmp / spec["resume_as"])
        entries.append(entry)
    (tmp / "plan.json").write_text(json.dumps(entries))
    torchrun(RANKS, ROOT / "tests" / "lightning_worker.py", tmp / "plan.json", "lightning_fsdp", timeout=600)
    return {name: _read(tmp / name) for name, _ in plan}


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    return run_plan(tmp_path_factory.mktemp("lightning-fsdp"), [
        ("clean", {"script": "train.py", "flags": FSDP}),
        ("plain", {"script": "train_plain.py", "flags": FSDP}),
        ("bitflip", {"script": "train.py", "flags": [*FSDP, "--inject", "grad-bitflip:rank=2:step=4"]}),
    ])


@pytest.fixture(scope="module")
def hsdp(tmp_path_factory):
    return run_plan(tmp_path_factory.mktemp("lightning-hsdp"), [
        ("clean", {"script": "train.py", "flags": HSDP}),
        ("plain", {"script": "train_plain.py", "flags": HSDP}),
        ("bitflip", {"script": "train.py", "flags": [*HSDP, "--inject", "grad-bitflip:rank=1:step=6"]}),
        ("resumed", {"script": "train.py", "flags": HSDP, "resume_as": "bitflip"}),
        ("weights", {"script": "train.py", "flags": [*HSDP, "--inject", "weight-bitflip:rank=3:step=4"]}),
        ("nan", {"script": "train.py", "flags": [*FSDP, "--inject", "forward-nan:rank=1:step=1"]}),
        ("reduce", {"script": "train.py", "flags": [*FSDP, "--inject", "reduce-scale:step=2"]}),
    ])


def _bitwise(guarded: dict, plain: dict, steps: int) -> None:
    """Every rank's every micro-batch loss and every local shard (``p.to_local()``) the same bits."""
    for g, p in zip(guarded["results"], plain["results"]):
        assert (g["alarms"], g["errors"], g["final_step"]) == ([], [], steps)
        assert g["losses"] == p["losses"] and len(g["losses"]) == 2 * steps
        assert g["shards"] == p["shards"] and len(g["shards"]) == 8  # 3 Linear weights + biases, the LayerNorm's 2
    assert len({json.dumps(r["shards"]) for r in guarded["results"]}) > 1  # the ranks hold different shards
    assert guarded["alarms"] == []


def _the_alarm(run: dict) -> dict:
    """The one alarm: in the spool once, raised as SDCDetected on every rank, its step not applied."""
    [alarm] = run["alarms"]
    for r in run["results"]:
        assert [a["id"] for a in r["alarms"]] == [alarm["id"]]
        assert [e["type"] for e in r["errors"]] == ["SDCDetected"]
        assert r["final_step"] == alarm["step"]  # Lightning's global_step counts updates
    return alarm


# -- quick: make test --------------------------------------------------------------------------

def test_fsdp1_and_unsaved_distributed_checkpoints_are_refused_and_tensor_parallelism_is_not():
    from sdcguard.integrations.lightning import GuardedFSDPStrategy, GuardedModelParallelStrategy
    assert GuardedModelParallelStrategy(tensor_parallel_size=2)._tensor_parallel_size == 2
    with pytest.raises(ConfigurationError, match="save_distributed_checkpoint=False"):
        GuardedModelParallelStrategy(save_distributed_checkpoint=False)
    with pytest.raises(ConfigurationError, match="FSDP1"):
        GuardedFSDPStrategy()


@pytest.mark.slow  # a 4-rank launch pair: `make test` stays under its budget
def test_pure_fsdp_clean_run_is_bitwise_the_plain_model_parallel_run(quick):
    clean = quick["clean"]
    _bitwise(clean, quick["plain"], 6)
    assert "does not run weights" in " ".join(clean["results"][0]["plan"])  # one replica: said at start-up
    for s in clean["stats"]:
        assert s["checks"]["replay"]["runs"] == 2 and s["checks"]["reduce_checksum"]["runs"] == 6
        assert s["last_verified_step"] is None or s["last_verified_step"] <= 5


@pytest.mark.slow  # a 4-rank launch pair: `make test` stays under its budget
def test_pure_fsdp_checkpoints_are_verified_dcp_directories(quick):
    ckpts = quick["clean"]["out"] / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["epoch=1-step=6.ckpt", "last.ckpt"]
    for name in ("epoch=1-step=6.ckpt", "last.ckpt"):
        manifest = json.loads((ckpts / name / "sdcguard-manifest.json").read_text())
        assert (manifest["step"], manifest["weights_verified"], manifest["model_key"]) == (5, False, "state_dict")
        assert "lightning" in manifest["state_keys"]  # Lightning's loops, callbacks, schedulers ride along
        assert cli.main(["verify-checkpoint", str(ckpts / name), "--step", "5"]) == 0
        assert cli.main(["verify-checkpoint", str(ckpts / name), "--step", "4"]) == 1


@pytest.mark.slow  # a 4-rank launch pair: `make test` stays under its budget
def test_pure_fsdp_gradient_bitflip_is_caught_by_the_audit_naming_the_rank(quick):
    alarm = _the_alarm(quick["bitflip"])
    assert (alarm["check"], alarm["step"], alarm["suspect_ranks"], alarm["ambiguous"]) == ("replay", 4, [2], False)
    assert alarm["evidence"]["mesh"] == {"replicas": 1, "shards": 4}
    assert alarm["last_good_checkpoint"] is None  # one replica: no checkpoint's weights were cross-checked


# -- slow: HSDP, a resume, the other fault kinds ----------------------------------------------

@pytest.mark.slow
def test_hsdp_clean_run_is_bitwise_the_plain_run_with_check_3(hsdp):
    clean = hsdp["clean"]
    _bitwise(clean, hsdp["plain"], 9)
    assert clean["results"][0]["plan"][0] == "HSDP 2 replicas x 2 shards"
    for s in clean["stats"]:
        assert s["checks"]["replay"]["runs"] == 3 and s["checks"]["weights"]["runs"] >= 5
        assert s["last_verified_step"] == 6  # the last audit
    manifest = json.loads((clean["out"] / "checkpoints" / "last.ckpt" / "sdcguard-manifest.json").read_text())
    assert (manifest["step"], manifest["weights_verified"], manifest["mesh"]["grid"]) == (8, True, [[0, 1], [2, 3]])


@pytest.mark.slow
def test_hsdp_alarm_names_a_kept_checkpoint_and_the_resume_ends_bitwise_on_the_clean_run(hsdp):
    alarm = _the_alarm(hsdp["bitflip"])
    assert (alarm["check"], alarm["step"], alarm["suspect_ranks"], alarm["ambiguous"]) == ("replay", 6, [1], False)
    assert alarm["suspect_window"] == {"first_step": 4, "last_step": 6}  # after the passing audit at 3
    ckpts = hsdp["bitflip"]["out"] / "checkpoints"
    # last.ckpt held step 2, then step 5 (inside the window): the step-2 directory was kept for this alarm
    assert alarm["last_good_checkpoint_step"] == 2
    assert alarm["last_good_checkpoint"] in (str(ckpts / "last.sdcguard-step2.ckpt"),
                                             str(ckpts / "epoch=0-step=3.sdcguard-step2.ckpt"))
    assert cli.main(["verify-checkpoint", alarm["last_good_checkpoint"], "--step", "2",
                     "--sha256", alarm["last_good_checkpoint_sha256"]]) == 0
    resumed, clean = hsdp["resumed"], hsdp["clean"]
    for again, full in zip(resumed["results"], clean["results"]):
        assert (again["alarms"], again["errors"], again["first_step"], again["final_step"]) == ([], [], 3, 9)
        assert again["shards"] == full["shards"]
        assert again["losses"] == {k: v for k, v in full["losses"].items() if not k.startswith("0:")}


@pytest.mark.slow
@pytest.mark.parametrize("run, expected", [
    ("nan", ("nonfinite-local", 1, [1], False)),     # check 1, before rank 1's reduce-scatter
    ("reduce", ("reduce-checksum", 2, [], False)),   # check 4: the reduce-scatter's output, every rank
    ("weights", ("weights", 4, [1, 3], True)),       # check 3: shard 1's two replicas, no strict majority
])
def test_other_fault_kinds_are_caught_by_their_check(hsdp, run, expected):
    alarm = _the_alarm(hsdp[run])
    assert (alarm["check"], alarm["step"], alarm["suspect_ranks"], alarm["ambiguous"]) == expected


# -- tensor_parallel_size=2: HSDP 2 x 1 x TP 2 --------------------------------------------------------

# Lightning's gradient clipping cannot run here, with or without sdcguard: torch's clip_grad_norm_
# stacks the norms of parameters on two meshes (the TP layers' and the others') and DTensor refuses
# ("All operands in aten.stack.default must have the same mesh"). One machine poses as 2 nodes of
# 2 ranks, so that the replay ring (rank r replays rank r + 2) carries TP group [0, 1] onto [2, 3].
TP = ["--epochs", "2", "--audit-every", "2", "--weight-check-every", "1", "--accumulate", "2", "--clip", "0",
      "--replicate", "2", "--tp", "2"]
TWO_NODES = {"SDCGUARD_RANKS_PER_NODE": "2"}


@pytest.fixture(scope="module")
def tp(tmp_path_factory):
    return run_plan(tmp_path_factory.mktemp("lightning-tp"), [
        ("clean", {"script": "train.py", "flags": TP, "env": TWO_NODES}),
        ("plain", {"script": "train_plain.py", "flags": TP}),
        ("bitflip", {"script": "train.py", "flags": [*TP, "--inject", "grad-bitflip:rank=1:step=2"], "env": TWO_NODES}),
        ("forward", {"script": "train.py", "flags": [*TP, "--inject", "forward-scale:rank=2:step=4"], "env": TWO_NODES}),
    ])


@pytest.mark.slow
def test_a_tp_run_is_bitwise_the_plain_model_parallel_tp_run(tp):
    clean, plain = tp["clean"], tp["plain"]
    for g, p in zip(clean["results"], plain["results"]):
        assert (g["alarms"], g["errors"], g["final_step"]) == ([], [], 12)
        assert g["losses"] == p["losses"] and g["shards"] == p["shards"]
    assert clean["results"][0]["shards"] != clean["results"][1]["shards"]  # TP shards 0 and 1
    assert clean["results"][0]["shards"] == clean["results"][2]["shards"]  # replicas of TP shard 0
    plan = "\n".join(clean["results"][0]["plan"])
    assert "HSDP 2 replicas x 1 shard" in plan and "each x tensor parallel over 2 ranks" in plan
    for s in clean["stats"]:
        assert s["checks"]["replay"]["runs"] == 6 and s["checks"]["weights"]["runs"] >= 11


@pytest.mark.slow
@pytest.mark.parametrize("run, expected, owners", [
    ("bitflip", ("replay", 2, [1, 3], True), [1]),            # rank 1's own gradient: its pair alone differs
    ("forward", ("replay", 4, [0, 1, 2, 3], True), [2, 3]),   # rank 2's forward reaches its TP group [2, 3]
])
def test_tp_faults_name_the_rank_or_its_tp_group(tp, run, expected, owners):
    alarm = _the_alarm(tp[run])
    assert (alarm["check"], alarm["step"], alarm["suspect_ranks"], alarm["ambiguous"]) == expected
    assert [p["owner"] for p in alarm["evidence"]["pairs"]] == owners  # 2 replicas: owner or replayer, ambiguous
