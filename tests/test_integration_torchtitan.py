"""sdcguard.integrations.torchtitan under torchrun: torchtitan 0.3.0's own Trainer (a tiny llama3,
in-code tokenizer and random-token data; examples/torchtitan/) on 4 CPU ranks over gloo, HSDP
(data_parallel_replicate_degree=2 x data_parallel_shard_degree=2), 2 micro-batches per step,
torchtitan's clipping, AdamW and LR schedule.

  - clean (slow): examples/torchtitan/train.py (GuardedTrainer) against train_plain.py (torchtitan's
    Trainer), started together: every rank's final shards and every step's loss bit-identical,
    checks 1, 2 and 3 ran and passed, and check 3 ran before the checkpoints torchtitan wrote;
  - faults (slow): every kind of sdcguard.faults.spec planted in a run, each caught by its check
    naming its rank (weights faults: 2 replicas, both named, ambiguous; reduce-scale: check 4 on
    torchtitan's summed reductions, no rank);
  - checkpoints (slow): sdcguard's manifest beside torchtitan's DCP folders, checked offline; a resume
    verified before torchtitan loads it (bit-identical to torchtitan's own resume), a flipped byte
    refused; an alarm naming the last checkpoint before its window, none written after it;
  - the replicate-only mesh (data_parallel_shard_degree=1, FSDP2 on a (2, 1) mesh) checked (slow): bit-identical
    to torchtitan, a NaN in one rank's forward and a corrupted all-reduce caught;
  - bfloat16 parameters (training.mixed_precision_param, torchtitan's default; slow): bit-identical to
    torchtitan with every check run, and the compute and reduction faults caught as in float32;
  - compile.enable (slow): unaudited compiled steps bit-identical to torchtitan's, an audited one
    (eager) catching a flipped gradient bit;
  - tensor_parallel_degree=2 (slow; 4 ranks posing as 2 nodes of one TP group each): DP 2 x TP 2
    bit-identical to torchtitan's TP run with every check, its checkpoints verified offline and a
    resume bit-identical to torchtitan's; pure FSDP 2 x TP 2 bit-identical; a fault of every kind
    caught naming the rank or its TP group (ambiguous with 2 replicas; exact with DP 3 x TP 2);
  - context and expert parallelism, pipeline x tensor parallelism and spmd_backend="full_dtensor"
    refused before torchtitan builds anything, naming the setting (in this process); pipeline
    parallelism itself: tests/test_integration_torchtitan_pipeline.py.
"""
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from torchrun_jobs import rank_results, spooled_alarms, start

pytest.importorskip("torchtitan")
pytestmark = pytest.mark.multiprocess
EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "torchtitan"
HSDP = ["--replicate", "2", "--shard", "2", "--accum", "2"]


def _start(script, out, ranks, *flags):
    out.mkdir(parents=True, exist_ok=True)
    return start(ranks, EXAMPLES / script, "--out", out, *flags, spool=out / "spool")


def _finish(out, proc, ranks, ok=True):
    try:
        output, _ = proc.communicate(timeout=400)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
    if ok:
        assert proc.returncode == 0, output[-8000:]
    results, alarms = rank_results(out, ranks, present_only=True), spooled_alarms(out / "spool")
    return {"results": results, "alarms": alarms, "output": output, "returncode": proc.returncode}


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    root = tmp_path_factory.mktemp("titan")
    flags = [*HSDP, "--steps", "6", "--audit-every", "3", "--weight-check-every", "2", "--checkpoint-every", "3"]
    procs = {"guarded": _start("train.py", root / "guarded", 4, *flags),
             "plain": _start("train_plain.py", root / "plain", 4, *flags)}
    runs = {name: _finish(root / name, proc, 4) for name, proc in procs.items()}
    runs["root"] = root
    return runs


@pytest.mark.slow  # a 4-rank launch pair: `make test` stays under its budget
def test_clean_run_is_bit_identical_to_torchtitan_without_sdcguard(clean):
    guarded, plain = clean["guarded"]["results"], clean["plain"]["results"]
    assert len(guarded) == len(plain) == 4
    for g, p in zip(guarded, plain):
        assert (g["error"], g["alarms"], g["step"]) == (None, [], 6)
        assert g["weights_digest"] == p["weights_digest"]  # this rank's shards after 6 updates
        assert g["losses"] == p["losses"] and len(g["losses"]) == 6
    # rank (i, j) holds shard j of replica i
    digests = [g["weights_digest"] for g in guarded]
    assert digests[0] == digests[2] and digests[1] == digests[3] and digests[0] != digests[1]
    assert clean["guarded"]["alarms"] == []


@pytest.mark.slow  # a 4-rank launch pair
def test_bfloat16_parameters_run_bit_identical_to_torchtitan_with_every_check(tmp_path):
    """training.mixed_precision_param = "bfloat16" (torchtitan's default): FSDP2 all-gathers and
    computes in bfloat16, reduces the gradients in float32; audited every 2 steps, the guarded run
    ends where torchtitan's own does, bit for bit, with every check run and none raised."""
    flags = [*HSDP, "--steps", "4", "--audit-every", "2", "--weight-check-every", "2",
             "--mixed-precision-param", "bfloat16"]
    procs = {name: _start(script, tmp_path / name, 4, *flags)
             for name, script in (("guarded", "train.py"), ("plain", "train_plain.py"))}
    guarded, plain = (_finish(tmp_path / name, proc, 4) for name, proc in procs.items())
    assert guarded["alarms"] == [] and len(guarded["results"]) == len(plain["results"]) == 4
    for g, p in zip(guarded["results"], plain["results"]):
        assert (g["error"], g["alarms"], g["step"]) == (None, [], 4)
        assert (g["weights_digest"], g["losses"]) == (p["weights_digest"], p["losses"])
        assert (g["last_audited"], g["last_weights_verified"], g["last_reduction_verified"]) == (4, 4, 4)


@pytest.mark.slow  # three compiled 4-rank jobs side by side (~2-3 min: inductor on 2 cores)
def test_compiled_blocks_audited_eagerly_catch_a_fault_and_unaudited_steps_stay_bit_identical(tmp_path):
    """compile.enable (torchtitan compiles every block and the loss): checks 1, 3 and 4 run on the
    compiled steps, which stay bit for bit torchtitan's own; an audited step runs eagerly (its own
    pass and the replay), so it catches a flipped gradient bit and raises nothing else, but from
    the first audit on the run no longer matches the compiled one bit for bit (eager and compiled
    kernels round differently)."""
    common = [*HSDP, "--steps", "4", "--weight-check-every", "2", "--compile"]
    procs = {"audited": _start("train.py", tmp_path / "audited", 4, *common, "--audit-every", "2", "--keep-going",
                               "--inject", "grad-bitflip:rank=1:step=2"),
             "unaudited": _start("train.py", tmp_path / "unaudited", 4, *common, "--audit-every", "0"),
             "plain": _start("train_plain.py", tmp_path / "plain", 4, *common)}
    audited, unaudited, plain = (_finish(tmp_path / name, proc, 4) for name, proc in procs.items())
    for a, u, p in zip(audited["results"], unaudited["results"], plain["results"]):
        assert [(x["check"], x["step"], x["suspect_ranks"]) for x in a["alarms"]] == [("replay", 2, [1])]
        assert (a["step"], a["last_audited"]) == (4, 4)  # the audit of step 4 passed: no false alarm
        assert (u["error"], u["alarms"], u["step"], u["last_weights_verified"]) == (None, [], 4, 4)
        assert (u["weights_digest"], u["losses"]) == (p["weights_digest"], p["losses"])
    assert [x["check"] for x in audited["alarms"]] == ["replay"]


@pytest.mark.slow  # a 4-rank launch pair: `make test` stays under its budget
def test_every_check_ran_on_torchtitans_mesh_and_before_its_checkpoints(clean):
    for g in clean["guarded"]["results"]:
        assert (g["last_audited"], g["last_weights_verified"]) == (6, 6)
    plan = "\n".join(clean["guarded"]["results"][0]["plan"])
    assert "HSDP 2 replicas x 2 shards" in plan
    for check in ("nonfinite-local", "replay", "weights", "reduce-checksum (reduce-scatter)",
                  "reduce-checksum (all-reduce)"):
        assert f"runs {check}:" in plan  # check 4 too: torchtitan's sum (divide factor 1.0) is checked as one
    assert "does not run" not in plan
    for g in clean["guarded"]["results"]:
        assert g["last_reduction_verified"] == 6
    for run in ("guarded", "plain"):
        folders = sorted(p.name for p in (clean["root"] / run / "checkpoint").iterdir())
        assert folders == ["step-3", "step-6"]


def test_guarded_turns_a_registry_config_into_one_with_an_sdcguard_section():
    import tyro
    from torchtitan.config.manager import custom_registry
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from sdcguard.integrations.torchtitan import GuardedTrainer, SDCGuardConfig, guarded

    base = llama3_debugmodel()
    config = guarded(base, audit_every=4)
    assert type(config) is GuardedTrainer.Config and type(config)._owner is GuardedTrainer  # config.build() builds it
    assert config.training == base.training and config.model_spec is base.model_spec
    assert config.sdcguard == SDCGuardConfig(audit_every=4)
    # torchtitan's command line reaches the section like any other (ConfigManager's tyro call)
    parsed = tyro.cli(GuardedTrainer.Config, args=["--sdcguard.audit-every", "7", "--sdcguard.inject",
                                                   "grad-inf:rank=1:step=2"], default=config, registry=custom_registry)
    assert (parsed.sdcguard.audit_every, parsed.sdcguard.inject) == (7, ["grad-inf:rank=1:step=2"])
    assert parsed.training == base.training
    # torchtitan's checkpoint section, built as sdcguard's subclass of its CheckpointManager
    from sdcguard.integrations.torchtitan import GuardedCheckpointManager
    for c in (config, parsed):
        assert type(c.checkpoint) is GuardedCheckpointManager.Config and c.checkpoint._owner is GuardedCheckpointManager
        assert dataclasses.asdict(c.checkpoint) == dataclasses.asdict(base.checkpoint)


def _sum_reduction(corrupt: bool) -> bool:
    """One shard group of 4 ranks reducing as torchtitan has FSDP2 reduce (a plain sum, divide factor
    1.0), fed through sdcguard's recorder: whether check 4's vote is within its bound."""
    import torch
    import torch.distributed as dist

    from sdcguard.checks.reduce_checksum import judge_checksum
    from sdcguard.sharding.layout import layout_of
    from sdcguard.sharding.reduce_record import ShardedRecorder
    from sdcguard.sharding.reduction_check import step_vote

    class Group:  # what the recorder reads of torchtitan's FSDPParamGroup
        all_reduce_grads, _partial_reduce_output, gradient_divide_factor = True, None, 1.0

    S = 4
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(S * 33, generator=g) * 10.0 ** torch.randint(-3, 3, (S * 33,), generator=g)
             for _ in range(S)]
    votes, shape = [], None
    for r in range(S):
        recorder = ShardedRecorder(layout_of([list(range(S))], r), seed=1)
        recorder.begin_step(3)
        record = recorder.local_input(0, grads[r].clone(), dist.ReduceOp.PREMUL_SUM(1.0), Group())
        out = torch.stack([grads[q].view(S, -1)[r] for q in range(S)]).sum(0)  # a sum: no division
        if corrupt and r == 2:
            out[5] *= 1.001
        recorder.reduced_shard(record, out, r)
        vote = step_vote(recorder.records, recorder.layout, [])
        votes.append(vote.vote)
        shape = vote.shape
    x, y = (float(v) for v in torch.stack(votes).sum(0))
    return judge_checksum(x, y, shape) is None


def test_check_4_bounds_torchtitans_summed_reduce_scatter():
    assert _sum_reduction(corrupt=False) and not _sum_reduction(corrupt=True)


COMPUTE = ["forward-nan:rank=2:step=1", "grad-inf:rank=1:step=2", "forward-scale:rank=3:step=3",
           "grad-bitflip:rank=1:step=4", "reduce-nan:step=5", "reduce-scale:step=6:magnitude=1000"]


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["float32", "bfloat16"])  # bfloat16: torchtitan's default parameter dtype
def test_compute_and_reduction_faults_are_caught_by_their_check_naming_the_rank(tmp_path, precision):
    flags = [*HSDP, "--steps", "6", "--audit-every", "1", "--weight-check-every", "1", "--keep-going",
             "--mixed-precision-param", precision]
    for spec in COMPUTE:
        flags += ["--inject", spec]
    run = _finish(tmp_path, _start("train.py", tmp_path, 4, *flags), 4)
    expected = [("nonfinite-local", 1, [2]), ("nonfinite-local", 2, [1]), ("replay", 3, [3]), ("replay", 4, [1]),
                ("nonfinite-reduced", 5, []), ("reduce-checksum", 6, [])]
    for r in run["results"]:
        assert [(a["check"], a["step"], a["suspect_ranks"]) for a in r["alarms"]] == expected
        assert [e["step"] for e in r["errors"]] == [1, 2, 3, 4, 5, 6]
    assert sorted((a["check"], a["step"], a["suspect_ranks"]) for a in run["alarms"]) == sorted(expected)
    fired = {(f["kind"], f["step"]) for r in run["results"] for f in r["fired"]}
    assert {(s.split(":")[0], int(s.split("step=")[1].split(":")[0])) for s in COMPUTE} <= fired


WEIGHTS = {"optimizer-scale": ("optimizer-scale:rank=2:step=2", 2), "weight-bitflip": ("weight-bitflip:rank=1:step=2", 1),
           "weight-swap": ("weight-swap:rank=3:step=2:element=3", 3)}


@pytest.fixture(scope="module")
def weight_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("titan-weights")
    flags = [*HSDP, "--steps", "2", "--audit-every", "0", "--weight-check-every", "1"]
    procs = {kind: _start("train.py", root / kind, 4, *flags, "--inject", spec) for kind, (spec, _) in WEIGHTS.items()}
    return {kind: _finish(root / kind, proc, 4) for kind, proc in procs.items()}  # together: start-up dominates


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(WEIGHTS))
def test_weight_faults_are_caught_by_check_3_naming_the_replicas(weight_runs, kind):
    run, rank = weight_runs[kind], WEIGHTS[kind][1]
    for r in run["results"]:  # SDCDetected stopped every rank at step 2, after its update
        assert r["alarm"]["check"] == "weights" and r["alarm"]["step"] == 2 and r["step"] == 2
        assert rank in r["alarm"]["suspect_ranks"]
    # two replicas of each shard: no strict majority, so both holders of the shard are named
    (alarm,) = run["alarms"]
    assert alarm["ambiguous"] and sorted(alarm["suspect_ranks"]) == sorted({rank, (rank + 2) % 4})


@pytest.fixture(scope="module")
def checkpoint_runs(clean, tmp_path_factory):
    """From the clean runs' checkpoints: both resumed to step 8, a copy with one flipped byte resumed,
    and a fault run that checkpoints (every 2 steps) until an alarm at the audit of step 4."""
    import shutil
    root = tmp_path_factory.mktemp("titan-resume")
    for name in ("guarded", "plain"):
        shutil.copytree(clean["root"] / name / "checkpoint", root / name / "checkpoint")
    shutil.copytree(clean["root"] / "guarded" / "checkpoint", root / "tampered" / "checkpoint")
    shard = root / "tampered" / "checkpoint" / "step-6" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    resume = [*HSDP, "--steps", "8", "--audit-every", "3", "--weight-check-every", "2", "--checkpoint-every", "3"]
    fault = [*HSDP, "--steps", "4", "--audit-every", "2", "--weight-check-every", "2", "--checkpoint-every", "2",
             "--inject", "grad-bitflip:rank=1:step=4"]
    procs = {"guarded": _start("train.py", root / "guarded", 4, *resume),
             "plain": _start("train_plain.py", root / "plain", 4, *resume),
             "tampered": _start("train.py", root / "tampered", 4, *resume),
             "fault": _start("train.py", root / "fault", 4, *fault)}
    runs = {name: _finish(root / name, proc, 4, ok=name != "tampered") for name, proc in procs.items()}
    runs["root"], runs["clean_root"] = root, clean["root"]
    return runs


@pytest.mark.slow
def test_torchtitans_checkpoints_carry_a_manifest_verified_offline(checkpoint_runs):
    clean = checkpoint_runs["clean_root"]
    for step in (3, 6):
        folder = clean / "guarded" / "checkpoint" / f"step-{step}"
        manifest = json.loads((folder / "sdcguard-manifest.json").read_text())
        assert manifest["step"] == step and manifest["weights_verified"] and manifest["audited"]
        assert manifest["mesh"] == {"replicas": 2, "shards": 2, "grid": [[0, 1], [2, 3]]}
        assert "layers.0.attention.qkv_linear.wq.weight" in manifest["parameters"]  # torchtitan's saved layout
        out = subprocess.run([sys.executable, "-m", "sdcguard.cli", "verify-checkpoint", str(folder), "--step", str(step)],
                             capture_output=True, text=True)
        assert out.returncode == 0 and out.stdout.startswith("OK"), out.stdout + out.stderr
    assert not (clean / "plain" / "checkpoint" / "step-6" / "sdcguard-manifest.json").exists()
    tampered = checkpoint_runs["root"] / "tampered" / "checkpoint" / "step-6"
    out = subprocess.run([sys.executable, "-m", "sdcguard.cli", "verify-checkpoint", str(tampered)],
                         capture_output=True, text=True)
    assert out.returncode == 1 and "__1_0.distcp was modified" in out.stdout + out.stderr


@pytest.mark.slow
def test_a_resume_is_verified_first_and_stays_bit_identical_to_torchtitan(checkpoint_runs):
    guarded, plain = checkpoint_runs["guarded"]["results"], checkpoint_runs["plain"]["results"]
    for g, p in zip(guarded, plain):
        assert (g["error"], g["step"], sorted(g["losses"])) == (None, 8, ["7", "8"])
        assert g["weights_digest"] == p["weights_digest"] and g["losses"] == p["losses"]
    tampered = checkpoint_runs["tampered"]
    assert tampered["returncode"] != 0
    assert "refusing to resume from" in tampered["output"] and "__1_0.distcp was modified" in tampered["output"]


@pytest.mark.slow
def test_an_alarm_names_the_last_checkpoint_before_its_window(checkpoint_runs):
    run = checkpoint_runs["fault"]
    (alarm,) = run["alarms"]
    assert (alarm["check"], alarm["step"], alarm["suspect_ranks"]) == ("replay", 4, [1])
    folder = checkpoint_runs["root"] / "fault" / "checkpoint" / "step-2"
    manifest = json.loads((folder / "sdcguard-manifest.json").read_text())
    assert alarm["last_good_checkpoint"] == str(folder)  # audited at 2: the window opens at step 3
    assert (alarm["last_good_checkpoint_step"], alarm["last_good_checkpoint_sha256"]) == (2, manifest["sha256"])
    assert not (checkpoint_runs["root"] / "fault" / "checkpoint" / "step-4").exists()  # not saved after the alarm


@pytest.fixture(scope="module")
def replicate_only(tmp_path_factory):
    """torchtitan's data-parallel-only mesh (data_parallel_replicate_degree=2, shard degree 1: FSDP2 on a
    (2, 1) mesh, copying each rank's gradient and all-reducing it): guarded and plain side by side,
    and a run with a NaN in rank 1's forward and a scaled element of the all-reduced gradient."""
    root = tmp_path_factory.mktemp("titan-replicate")
    flags = ["--replicate", "2", "--shard", "1", "--accum", "2", "--steps", "4", "--audit-every", "2",
             "--weight-check-every", "1"]
    faults = [*flags[:-4], "--audit-every", "1", "--weight-check-every", "1", "--keep-going",
              "--inject", "forward-nan:rank=1:step=1", "--inject", "reduce-scale:rank=0:step=2:magnitude=1000"]
    procs = {"guarded": _start("train.py", root / "guarded", 2, *flags),
             "plain": _start("train_plain.py", root / "plain", 2, *flags),
             "faults": _start("train.py", root / "faults", 2, *faults)}
    return {name: _finish(root / name, proc, 2) for name, proc in procs.items()}


@pytest.mark.slow
def test_a_replicate_only_mesh_is_checked_and_bit_identical_to_torchtitan(replicate_only):
    guarded, plain = replicate_only["guarded"]["results"], replicate_only["plain"]["results"]
    assert len(guarded) == len(plain) == 2
    for g, p in zip(guarded, plain):
        assert (g["error"], g["alarms"], g["step"]) == (None, [], 4)
        assert g["weights_digest"] == p["weights_digest"] and g["losses"] == p["losses"]
        assert (g["last_audited"], g["last_weights_verified"], g["last_reduction_verified"]) == (4, 4, 4)
    assert guarded[0]["weights_digest"] == guarded[1]["weights_digest"]  # each rank holds the whole model
    plan = "\n".join(guarded[0]["plan"])
    assert "HSDP 2 replicas x 1 shard" in plan
    for check in ("nonfinite-local", "replay", "weights", "reduce-checksum (all-reduce)"):
        assert f"runs {check}:" in plan  # torchtitan's summed all-reduce (divide factor 1.0) is checked as one
    assert "does not run reduce-checksum (reduce-scatter): one rank per shard group" in plan


@pytest.mark.slow
def test_faults_on_a_replicate_only_mesh_are_caught_naming_the_rank(replicate_only):
    run = replicate_only["faults"]
    expected = [("nonfinite-local", 1, [1]), ("reduce-checksum", 2, [])]
    for r in run["results"]:
        assert [(a["check"], a["step"], a["suspect_ranks"]) for a in r["alarms"]] == expected
        assert [e["step"] for e in r["errors"]] == [1, 2]
    assert sorted((a["check"], a["step"], a["suspect_ranks"]) for a in run["alarms"]) == sorted(expected)


# -- tensor parallelism: DP 2 x TP 2 (tensor_parallel_degree=2) ------------------------------------

# torchtitan's mesh (dp_replicate, fsdp, tp) = (2, 1, 2), TP the fastest dimension: TP groups [0, 1]
# and [2, 3]. One machine poses as 2 nodes of 2 ranks (SDCGUARD_RANKS_PER_NODE, as the operator's
# webhook sets it on a real node): the replay ring (rank r replays rank r + 2) then carries each TP
# group onto the other, rank for rank, as the layout requires.
TP = ["--replicate", "2", "--shard", "1", "--tp", "2", "--accum", "2", "--ranks-per-node", "2"]
TP_FAULTS = ["forward-nan:rank=2:step=1", "grad-inf:rank=1:step=2", "forward-scale:rank=3:step=3",
             "grad-bitflip:rank=1:step=4", "reduce-nan:step=5", "reduce-scale:step=6:magnitude=1000",
             "weight-bitflip:rank=1:step=7"]


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory):
    """Guarded and plain TP runs side by side (checkpoints every 2 steps), and a guarded one with a
    fault of every kind (one per step, audited every step)."""
    root = tmp_path_factory.mktemp("titan-tp")
    clean = [*TP, "--steps", "4", "--audit-every", "2", "--weight-check-every", "1", "--checkpoint-every", "2"]
    faults = [*TP, "--steps", "7", "--audit-every", "1", "--weight-check-every", "1", "--keep-going"]
    for spec in TP_FAULTS:
        faults += ["--inject", spec]
    procs = {"guarded": _start("train.py", root / "guarded", 4, *clean),
             "plain": _start("train_plain.py", root / "plain", 4, *clean),
             "faults": _start("train.py", root / "faults", 4, *faults)}
    runs = {name: _finish(root / name, proc, 4) for name, proc in procs.items()}
    runs["root"] = root
    return runs


@pytest.mark.slow  # three 4-rank jobs side by side
def test_a_tp_run_is_bit_identical_to_torchtitans_tp_run_with_every_check(tp_runs):
    guarded, plain = tp_runs["guarded"]["results"], tp_runs["plain"]["results"]
    assert len(guarded) == len(plain) == 4
    for g, p in zip(guarded, plain):
        assert (g["error"], g["alarms"], g["step"]) == (None, [], 4)
        assert (g["weights_digest"], g["losses"]) == (p["weights_digest"], p["losses"])
        assert (g["last_audited"], g["last_weights_verified"], g["last_reduction_verified"]) == (4, 4, 4)
    digests = [g["weights_digest"] for g in guarded]  # rank (i, k): TP shard k of replica i
    assert digests[0] == digests[2] and digests[1] == digests[3] and digests[0] != digests[1]
    plan = "\n".join(guarded[0]["plan"])
    assert "HSDP 2 replicas x 1 shard" in plan and "each x tensor parallel over 2 ranks" in plan
    assert "each tensor-parallel group (2 ranks) lies within one node" in plan
    for check in ("nonfinite-local", "replay", "weights", "reduce-checksum (all-reduce)"):
        assert f"runs {check}:" in plan
    assert tp_runs["guarded"]["alarms"] == []


@pytest.mark.slow
def test_tp_checkpoints_list_every_tp_position_and_verify_offline(tp_runs):
    folder = tp_runs["root"] / "guarded" / "checkpoint" / "step-4"
    manifest = json.loads((folder / "sdcguard-manifest.json").read_text())
    assert manifest["mesh"]["tp"] == 2 and manifest["mesh"]["columns"] == [[[0], [2]], [[1], [3]]]
    assert [(s["tp"], s["shard"], s["ranks"]) for s in manifest["shards"]] == [(0, 0, [0, 2]), (1, 0, [1, 3])]
    out = subprocess.run([sys.executable, "-m", "sdcguard.cli", "verify-checkpoint", str(folder), "--step", "4"],
                         capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("OK"), out.stdout + out.stderr


@pytest.mark.slow
def test_tp_faults_are_caught_naming_the_rank_or_its_tp_group(tp_runs):
    """Two replicas: a replay mismatch cannot tell the owner from its replayer, so both are named
    (ambiguous); a forward fault reaches its whole TP group (the activation collectives), so the
    group is named — as owners of the differing replays, or as the non-finite ranks."""
    run = tp_runs["faults"]
    expected = [("nonfinite-local", 1, [2, 3], False), ("nonfinite-local", 2, [1], False),
                ("replay", 3, [0, 1, 2, 3], True), ("replay", 4, [1, 3], True),
                ("nonfinite-reduced", 5, [], False), ("reduce-checksum", 6, [], False), ("weights", 7, [1, 3], True)]
    for r in run["results"]:
        assert [(a["check"], a["step"], a["suspect_ranks"], a["ambiguous"]) for a in r["alarms"]] == expected
        assert [e["step"] for e in r["errors"]] == [1, 2, 3, 4, 5, 6, 7]
    alarms = {a["step"]: a for a in run["results"][0]["alarms"]}
    assert alarms[1]["evidence"]["non_finite_ranks"] == [2, 3]  # rank 2's NaN reached its TP peer
    assert [(p["owner"], p["replayer"]) for p in alarms[3]["evidence"]["pairs"]] == [(2, 0), (3, 1)]
    assert alarms[3]["evidence"]["coordinates"]["3"]["tp_group"] == [2, 3]
    assert [(p["owner"], p["replayer"]) for p in alarms[4]["evidence"]["pairs"]] == [(1, 3)]  # its own gradient only
    assert alarms[7]["evidence"]["coordinates"]["1"]["tp"] == 1  # check 3 compares each (TP, FSDP) position
    fired = {(f["kind"], f["step"]) for r in run["results"] for f in r["fired"]}
    assert {(s.split(":")[0], int(s.split("step=")[1].split(":")[0])) for s in TP_FAULTS} <= fired
    assert sorted((a["check"], a["step"]) for a in run["alarms"]) == sorted((e[0], e[1]) for e in expected)


@pytest.fixture(scope="module")
def tp_more(tp_runs, tmp_path_factory):
    """From the TP runs' step-4 checkpoints, guarded and plain resumed to step 6; and pure FSDP x TP
    (data_parallel_shard_degree=2, tensor_parallel_degree=2: FSDP2's 1-D ``fsdp`` mesh), guarded and plain."""
    import shutil
    root = tmp_path_factory.mktemp("titan-tp-more")
    for name in ("guarded", "plain"):
        shutil.copytree(tp_runs["root"] / name / "checkpoint", root / name / "checkpoint")
    resume = [*TP, "--steps", "6", "--audit-every", "2", "--weight-check-every", "1", "--checkpoint-every", "2"]
    fsdp = ["--replicate", "1", "--shard", "2", "--tp", "2", "--accum", "2", "--ranks-per-node", "2", "--steps", "3",
            "--audit-every", "1"]
    procs = {"guarded": _start("train.py", root / "guarded", 4, *resume),
             "plain": _start("train_plain.py", root / "plain", 4, *resume),
             "fsdp": _start("train.py", root / "fsdp", 4, *fsdp),
             "fsdp-plain": _start("train_plain.py", root / "fsdp-plain", 4, *fsdp)}
    return {name: _finish(root / name, proc, 4) for name, proc in procs.items()}


@pytest.mark.slow
def test_a_tp_resume_is_verified_and_stays_bit_identical_to_torchtitans(tp_more):
    for g, p in zip(tp_more["guarded"]["results"], tp_more["plain"]["results"]):
        assert (g["error"], g["alarms"], g["step"], sorted(g["losses"])) == (None, [], 6, ["5", "6"])
        assert (g["weights_digest"], g["losses"]) == (p["weights_digest"], p["losses"])


@pytest.mark.slow
def test_pure_fsdp_x_tp_is_checked_and_bit_identical_to_torchtitan(tp_more):
    for g, p in zip(tp_more["fsdp"]["results"], tp_more["fsdp-plain"]["results"]):
        assert (g["error"], g["alarms"], g["step"], g["last_audited"]) == (None, [], 3, 3)
        assert (g["weights_digest"], g["losses"]) == (p["weights_digest"], p["losses"])
    plan = "\n".join(tp_more["fsdp"]["results"][0]["plan"])
    assert "FSDP over 2 ranks (one replica), each x tensor parallel over 2 ranks" in plan


@pytest.mark.slow  # a 6-rank job
def test_with_three_replicas_tp_faults_name_exactly_the_rank_or_the_tp_group(tmp_path):
    """DP 3 x TP 2 on 3 "nodes" of 2: a third replica settles every mismatch, so a gradient or weight
    fault names its rank alone and a forward fault its TP group alone, none ambiguous."""
    flags = ["--replicate", "3", "--shard", "1", "--tp", "2", "--accum", "2", "--ranks-per-node", "2",
             "--steps", "7", "--audit-every", "1", "--weight-check-every", "1", "--keep-going"]
    for spec in TP_FAULTS:
        flags += ["--inject", spec]
    run = _finish(tmp_path, _start("train.py", tmp_path, 6, *flags), 6)
    expected = [("nonfinite-local", 1, [2, 3], False), ("nonfinite-local", 2, [1], False), ("replay", 3, [2, 3], False),
                ("replay", 4, [1], False), ("nonfinite-reduced", 5, [], False), ("reduce-checksum", 6, [], False),
                ("weights", 7, [1], False)]
    assert len(run["results"]) == 6
    for r in run["results"]:
        assert [(a["check"], a["step"], a["suspect_ranks"], a["ambiguous"]) for a in r["alarms"]] == expected


# -- what is refused, at start-up (no process launched) --------------------------------------------

def test_refusals_name_the_setting_and_tensor_parallelism_is_not_among_them():
    from sdcguard.integrations.torchtitan import refusals
    ok = dict(pp=1, cp=1, ep=1, dp_replicate=2, dp_shard=1, model_parts=1)
    assert refusals(**ok) == []  # tensor_parallel_degree is not an argument: TP is checked
    assert "parallelism.context_parallel_degree=2: context parallelism is not checked" in \
        refusals(**{**ok, "cp": 2})[0]
    assert "parallelism.expert_parallel_degree=4: expert parallelism is not checked" in refusals(**{**ok, "ep": 4})[0]
    assert refusals(**{**ok, "pp": 2}) == []  # the Guard runs torchtitan's schedule (the pipeline test file)
    assert refusals(**{**ok, "pp": 2, "tp": 2})[0].startswith("parallelism.pipeline_parallel_degree=2 with "
                                                              "tensor_parallel_degree=2")
    assert "data parallel degree 1" in refusals(**{**ok, "dp_replicate": 1})[0]
    assert refusals(**ok, spmd_backend="full_dtensor")[0].startswith('parallelism.spmd_backend="full_dtensor"')


@pytest.mark.parametrize("setting, message", [
    ("context_parallel_degree", "parallelism.context_parallel_degree=2: context parallelism is not checked"),
    ("expert_parallel_degree", "parallelism.expert_parallel_degree=2: expert parallelism is not checked"),
    ("pipeline_parallel_degree", "parallelism.pipeline_parallel_degree=2 with tensor_parallel_degree=2"),
])
def test_a_guarded_trainer_refuses_context_expert_and_pipeline_x_tensor_parallelism_before_building(monkeypatch, setting,
                                                                                                    message):
    """torchtitan's own ParallelDims resolves the degrees; the refusal comes before torchtitan
    builds anything (no process group, no model: it runs in this process)."""
    from torchtitan.config import ParallelismConfig
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from sdcguard.errors import ConfigurationError
    from sdcguard.integrations.torchtitan import GuardedTrainer, guarded

    monkeypatch.setenv("WORLD_SIZE", "8")
    config = guarded(llama3_debugmodel())
    config.parallelism = ParallelismConfig(data_parallel_replicate_degree=2, tensor_parallel_degree=2,
                                           **{setting: 2})
    with pytest.raises(ConfigurationError, match="sdcguard cannot check this torchtitan job") as info:
        GuardedTrainer(config)
    assert message in str(info.value)
