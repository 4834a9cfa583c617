"""sdcguard.integrations.torchtitan with pipeline parallelism: torchtitan 0.3.0's own Trainer (the tiny
llama3 of examples/torchtitan/, 2 layers: stage 0 the embedding and layer 0, stage 1 layer 1, the
norm and the head) on 4 CPU ranks over gloo, pipeline_parallel_degree=2 with 1F1B over 4
micro-batches, FSDP2 over each stage as torchtitan always applies it — DP 2 x PP 2 as HSDP
(data_parallel_replicate_degree=2, shard degree 1) and as pure FSDP (data_parallel_shard_degree=2).

The Guard is built on torchtitan's schedule; torchtitan's own ``pp_forward_backward_step`` runs
each step, its schedule's ``step`` through ``s.run_schedule``. In this process: the refusals and
the manifest's pure parts. Under torchrun (slow):

  - a clean HSDP x PP run audited every 2 steps (check 3 every step, checkpoints every 2) is bit for
    bit torchtitan's own PP run, every rank's losses and weights, with no alarm; its checkpoints
    carry a manifest with one entry per (pipeline position, shard), verified offline;
  - a fault of each kind (forward, gradient, reduction, weights) in one stage is caught by its check
    naming that stage: a scaled activation in rank 0's stage 0 names stage 0's pair (not the stage-1
    ranks its activations reached; two replicas: ambiguous), a flipped gradient bit in rank 2's
    stage 1 stage 1's pair, a flipped weight in rank 3's stage 1 its replicas, a NaN in rank 3's
    forward its replica's ranks;
  - an alarm names the last checkpoint before its window, none is written after it, and a run
    resumed from the checkpoint it named ends bit for bit on the uninterrupted run; a flipped byte
    in a stage's file is refused on every rank;
  - pure FSDP over each stage, two stages per rank (Interleaved1F1B), is bit for bit torchtitan's
    own, audited every step.
"""
import json
import shutil
import subprocess
import sys

import pytest
from test_integration_torchtitan import _finish, _start

pytest.importorskip("torchtitan")
pytestmark = pytest.mark.multiprocess

# torchtitan's mesh (pp, dp_replicate, fsdp): ranks 0, 1 hold stage 0 (replicas 0, 1), ranks 2, 3 stage 1.
# local batch 4 / micro-batch 1: 4 micro-batches per schedule step; global batch 8: no accumulation.
PP = ["--pp", "2", "--accum", "1", "--batch-size", "4"]
HSDP_PP = ["--replicate", "2", "--shard", "1", *PP]
# One fault per step from step 2, each in a module or parameter of its rank's stage. A weight fault stays
# in the weights (every later check 3 would name it again), so the one weight fault comes last.
L0, L1 = "layers.0.feed_forward", "layers.1.feed_forward"
STAGE_FAULTS = [f"forward-scale:rank=0:step=2:site={L0}", f"forward-nan:rank=3:step=3:site={L1}",
                f"grad-inf:rank=1:step=4:param={L0}.w1.weight", f"grad-bitflip:rank=2:step=5:param={L1}.w1.weight",
                f"reduce-nan:rank=0:step=6:param={L0}.w1.weight",
                f"reduce-scale:rank=2:step=7:magnitude=1000:param={L1}.w1.weight",
                f"weight-bitflip:rank=3:step=8:param={L1}.w1.weight"]


# -- in this process --------------------------------------------------------------------------------

def test_pipeline_parallelism_is_checked_within_what_the_pipeline_layout_covers():
    from sdcguard.integrations.torchtitan import refusals
    pp = dict(pp=2, cp=1, ep=1, dp_replicate=2, dp_shard=1, model_parts=2)  # interleaved: two parts per rank
    assert refusals(**pp) == [] and refusals(**pp, pp_schedule="interleaved1f1b") == []
    (tp,) = refusals(**pp, tp=2)
    assert tp.startswith("parallelism.pipeline_parallel_degree=2 with tensor_parallel_degree=2: a pipeline stage "
                         "that is tensor parallel is not checked")
    (accumulation,) = refusals(**pp, accumulation=2)
    assert accumulation.startswith("training.global_batch_size: 2 gradient accumulation steps with "
                                   "parallelism.pipeline_parallel_degree=2")
    assert refusals(**pp, pp_schedule="ZBVZeroBubble") == [
        "parallelism.pipeline_parallel_schedule='ZBVZeroBubble' is not checked (checked: GPipe, 1F1B, Interleaved1F1B)"]
    assert "pipeline_parallel_schedule_csv='s.csv'" in refusals(**pp, pp_schedule_csv="s.csv")[0]
    assert "data parallel degree 1" in refusals(**{**pp, "dp_replicate": 1})[0]  # a pure pipeline: nothing to compare
    assert refusals(**{**pp, "pp": 1}) == ["2 model parts"]
    (masks,) = refusals(**pp, pp_masked_attention="FlexAttention")
    assert masks.startswith("FlexAttention with parallelism.pipeline_parallel_degree=2: its attention masks travel")
    assert refusals(**{**pp, "pp": 1, "model_parts": 1}, pp_masked_attention="FlexAttention") == []  # no pipeline


def test_flex_and_varlen_attention_are_found_in_the_model_parts():
    import torch
    from torchtitan.models.common.attention import FlexAttention

    from sdcguard.integrations.torchtitan import _masked_attention
    flex = FlexAttention.__new__(FlexAttention)  # only its type is read
    torch.nn.Module.__init__(flex)
    assert _masked_attention([torch.nn.Sequential(torch.nn.Linear(2, 2)), torch.nn.Sequential(flex)]) == "FlexAttention"
    assert _masked_attention([torch.nn.Sequential(torch.nn.Linear(2, 2))]) is None


def test_a_guarded_trainer_refuses_pipeline_accumulation_before_building(monkeypatch):
    from torchtitan.config import ParallelismConfig
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from sdcguard.errors import ConfigurationError
    from sdcguard.integrations.torchtitan import GuardedTrainer, guarded

    monkeypatch.setenv("WORLD_SIZE", "4")
    config = guarded(llama3_debugmodel())
    config.parallelism = ParallelismConfig(data_parallel_replicate_degree=2, pipeline_parallel_degree=2)
    config.training.local_batch_size, config.training.global_batch_size = 2, 8  # 2 x 2 replicas x 2 accumulated
    with pytest.raises(ConfigurationError, match="2 gradient accumulation steps with parallelism.pipeline_parallel"):
        GuardedTrainer(config)


def test_each_stage_entry_of_a_manifest_covers_its_own_tensors_and_empty_pieces_of_the_others():
    import torch

    from sdcguard.fingerprint import digest, fingerprint_many
    from sdcguard.integrations.torchtitan import in_manifest_order, manifest_parameters

    a, b, c = torch.arange(6.0).view(2, 3), torch.ones(4), torch.full((3, 2), 2.0)

    def report(names, tensors):
        return {"names": names, "fingerprints": [list(fp) for fp in fingerprint_many(tensors)],
                "chunks": [[[0] * t.dim(), list(t.shape)] for t in tensors]}

    stage0, stage1 = report(["emb", "w0"], [a, b]), report(["w1"], [c])
    names = manifest_parameters([stage0, stage0, stage1, stage1])
    assert names == ["emb", "w0", "w1"]
    ndims = {"emb": 2, "w0": 1, "w1": 2}
    mine = in_manifest_order(stage1, names, ndims)
    assert mine["chunks"] == [[[0, 0], [0, 0]], [[0], [0]], [[0, 0], [3, 2]]]
    # what dcp_manifest.shard_digests cuts from the files: each tensor's chunk, empty where the stage holds none
    assert mine["digest"] == digest(fingerprint_many([a[0:0, 0:0], b[0:0], c])).hex()
    # with data parallelism alone every rank holds every tensor: the digest of its pieces, in order
    assert in_manifest_order(stage0, ["emb", "w0"], ndims)["digest"] == digest(fingerprint_many([a, b])).hex()


# -- under torchrun ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pp_runs(tmp_path_factory):
    """Side by side: guarded and plain HSDP x PP runs (checkpoints every 2 steps), a guarded one with a
    fault of each kind in one stage or the other (audited every step), and one that checkpoints until an
    alarm at the audit of step 4."""
    root = tmp_path_factory.mktemp("titan-pp")
    clean = [*HSDP_PP, "--steps", "4", "--audit-every", "2", "--weight-check-every", "1", "--checkpoint-every", "2"]
    faults = [*HSDP_PP, "--steps", "8", "--audit-every", "1", "--weight-check-every", "1", "--keep-going"]
    for spec in STAGE_FAULTS:
        faults += ["--inject", spec]
    named = [*clean, "--inject", "forward-scale:rank=2:step=4:site=layers.1.feed_forward"]
    procs = {"guarded": _start("train.py", root / "guarded", 4, *clean),
             "plain": _start("train_plain.py", root / "plain", 4, *clean),
             "faults": _start("train.py", root / "faults", 4, *faults),
             "named": _start("train.py", root / "named", 4, *named)}
    runs = {name: _finish(root / name, proc, 4) for name, proc in procs.items()}
    runs["root"] = root
    return runs


@pytest.mark.slow  # four 4-rank jobs side by side
def test_a_pp_run_is_bit_identical_to_torchtitans_pp_run_with_every_check(pp_runs):
    guarded, plain = pp_runs["guarded"]["results"], pp_runs["plain"]["results"]
    assert len(guarded) == len(plain) == 4
    for g, p in zip(guarded, plain):
        assert (g["error"], g["alarms"], g["step"]) == (None, [], 4)
        assert (g["weights_digest"], g["losses"]) == (p["weights_digest"], p["losses"])
        assert (g["last_audited"], g["last_weights_verified"], g["last_reduction_verified"]) == (4, 4, 4)
    digests = [g["weights_digest"] for g in guarded]  # rank (p, i): stage p of replica i
    assert digests[0] == digests[1] and digests[2] == digests[3] and digests[0] != digests[2]
    assert guarded[2]["losses"] == guarded[3]["losses"] != guarded[0]["losses"]  # the last stage's losses
    plan = "\n".join(guarded[0]["plan"])
    assert "pipeline: 2 stages on 2 ranks per replica" in plan and "each stage sharded with FSDP2" in plan
    assert pp_runs["guarded"]["alarms"] == []


@pytest.mark.slow
def test_pp_checkpoints_have_an_entry_per_stage_and_verify_offline(pp_runs):
    folder = pp_runs["root"] / "guarded" / "checkpoint" / "step-4"
    manifest = json.loads((folder / "sdcguard-manifest.json").read_text())
    assert manifest["mesh"] == {"replicas": 2, "shards": 2, "grid": [[0, 2], [1, 3]],
                                "pipeline": {"positions": 2, "shards_per_position": 1}}
    assert [(s["pipeline_position"], s["ranks"]) for s in manifest["shards"]] == [(0, [0, 1]), (1, [2, 3])]
    names = manifest["parameters"]
    assert names[0] == "tok_embeddings.weight" and names[-1] == "lm_head.weight"  # stage 0's, then stage 1's
    assert manifest["weights_verified"] and manifest["audited_step"] == 4
    out = subprocess.run([sys.executable, "-m", "sdcguard.cli", "verify-checkpoint", str(folder), "--step", "4"],
                         capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("OK"), out.stdout + out.stderr


@pytest.mark.slow
def test_every_fault_kind_in_a_stage_is_caught_by_its_check_naming_the_stage(pp_runs):
    """Two replicas of each stage: a mismatch names the stage's pair (ambiguous: no third opinion),
    never the other stage's ranks; a NaN made once names its replica's ranks, which it reached."""
    run = pp_runs["faults"]
    expected = [("replay", 2, [0, 1], True), ("nonfinite-local", 3, [1, 3], True), ("nonfinite-local", 4, [1], False),
                ("replay", 5, [2, 3], True), ("nonfinite-reduced", 6, [], False), ("reduce-checksum", 7, [], False),
                ("weights", 8, [2, 3], True)]
    for r in run["results"]:
        assert [(a["check"], a["step"], a["suspect_ranks"], a["ambiguous"]) for a in r["alarms"]] == expected
        assert [e["step"] for e in r["errors"]] == [2, 3, 4, 5, 6, 7, 8]
    alarms = {a["step"]: a for a in run["results"][0]["alarms"]}
    assert alarms[2]["evidence"]["first_differing_stages"] == [0]  # not stage 1, which rank 0's activations reached
    assert alarms[5]["evidence"]["first_differing_stages"] == [1]  # a gradient of stage 1
    assert {r: c["stages"] for r, c in alarms[5]["evidence"]["coordinates"].items()} == {"2": [1], "3": [1]}
    assert alarms[3]["evidence"]["non_finite_ranks"] == [1, 3]  # rank 3's NaN reached its replica's stage 0 backward
    fired = {(f["kind"], f["rank"], f["step"]) for r in run["results"] for f in r["fired"]}
    assert {(s.split(":")[0], int(s.split("rank=")[1].split(":")[0]), int(s.split("step=")[1].split(":")[0]))
            for s in STAGE_FAULTS} <= fired
    assert sorted((a["check"], a["step"]) for a in run["alarms"]) == sorted((e[0], e[1]) for e in expected)


@pytest.mark.slow
def test_an_alarm_on_a_pipeline_names_the_last_checkpoint_before_its_window(pp_runs):
    run = pp_runs["named"]
    (alarm,) = run["alarms"]
    assert (alarm["check"], alarm["step"], alarm["suspect_ranks"]) == ("replay", 4, [2, 3])
    folder = pp_runs["root"] / "named" / "checkpoint" / "step-2"
    manifest = json.loads((folder / "sdcguard-manifest.json").read_text())
    assert alarm["last_good_checkpoint"] == str(folder)  # audited at 2: the window opens at step 3
    assert (alarm["last_good_checkpoint_step"], alarm["last_good_checkpoint_sha256"]) == (2, manifest["sha256"])
    assert not (pp_runs["root"] / "named" / "checkpoint" / "step-4").exists()  # not saved after the alarm


@pytest.fixture(scope="module")
def pp_more(pp_runs, tmp_path_factory):
    """The run the alarm stopped, resumed from the checkpoint it named (step 2) to step 4; the clean
    run's checkpoints with a flipped byte in stage 1's file, resumed; pure FSDP x PP under
    Interleaved1F1B (two stages per rank: 4 stages of one layer or module each), guarded and plain."""
    root = tmp_path_factory.mktemp("titan-pp-more")
    shutil.copytree(pp_runs["root"] / "named" / "checkpoint", root / "resumed" / "checkpoint")
    shutil.copytree(pp_runs["root"] / "guarded" / "checkpoint", root / "tampered" / "checkpoint")
    shard = root / "tampered" / "checkpoint" / "step-4" / "__2_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    resume = [*HSDP_PP, "--steps", "4", "--audit-every", "2", "--weight-check-every", "1", "--checkpoint-every", "2"]
    fsdp = ["--replicate", "1", "--shard", "2", *PP, "--pp-schedule", "Interleaved1F1B", "--steps", "3",
            "--audit-every", "1", "--weight-check-every", "1"]
    procs = {"resumed": _start("train.py", root / "resumed", 4, *resume),
             "tampered": _start("train.py", root / "tampered", 4, *HSDP_PP, "--steps", "6", "--checkpoint-every", "2"),
             "fsdp": _start("train.py", root / "fsdp", 4, *fsdp),
             "fsdp-plain": _start("train_plain.py", root / "fsdp-plain", 4, *fsdp)}
    return {name: _finish(root / name, proc, 4, ok=name != "tampered") for name, proc in procs.items()}


@pytest.mark.slow  # four 4-rank jobs side by side
def test_a_run_resumed_from_the_checkpoint_an_alarm_named_ends_bit_for_bit_on_the_uninterrupted_run(pp_runs, pp_more):
    for r, u in zip(pp_more["resumed"]["results"], pp_runs["guarded"]["results"]):
        assert (r["error"], r["alarms"], r["step"], sorted(r["losses"])) == (None, [], 4, ["3", "4"])
        assert r["weights_digest"] == u["weights_digest"]
        assert r["losses"] == {k: u["losses"][k] for k in ("3", "4")}
    tampered = pp_more["tampered"]
    assert tampered["returncode"] != 0
    assert "refusing to resume from" in tampered["output"] and "__2_0.distcp was modified" in tampered["output"]


@pytest.mark.slow
def test_pure_fsdp_over_interleaved_stages_is_checked_and_bit_identical_to_torchtitan(pp_more):
    guarded, plain = pp_more["fsdp"]["results"], pp_more["fsdp-plain"]["results"]
    assert len(guarded) == len(plain) == 4
    for g, p in zip(guarded, plain):
        assert (g["error"], g["alarms"], g["step"], g["last_audited"]) == (None, [], 3, 3)
        assert (g["weights_digest"], g["losses"]) == (p["weights_digest"], p["losses"])
    plan = "\n".join(guarded[0]["plan"])
    assert "pipeline: 4 stages on 2 ranks per replica (2 stages per rank (interleaved))" in plan
    assert "FSDP over 2 ranks (one replica)" in plan and "does not run check 3" in plan
