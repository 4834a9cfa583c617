"""sdcguard on pipeline-parallel jobs (``layouts/pipeline.py``, ``checks/pipeline.py``):
``torch.distributed.pipelining`` stages, each replicated by DDP over its data-parallel group. The
pure parts in process (the grid and its refusals, the replay ring, which stage and rank a
mismatch names); then, under torchrun over gloo, one launch of tests/pp_worker.py (6 ranks: PP 2 x
DP 3): for GPipe, 1F1B and interleaved 1F1B a clean run, unaudited and audited every step, is bit
for bit the plain loop; injected faults are named — the rank whose stage-0 forward is wrong (not
the later stage its activations reached), a transient gradient fault's stage pair, a flipped
weight's replica, a NaN's replica; a run resumed from the checkpoint an alarm names ends bit for bit
on the uninterrupted run, and a tampered stage file is refused on every rank."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sdcguard.checks.pipeline import Grid, StagePass, culprit_stage, judge_pipeline_replays, read_grid, ring_shift, ring_target
from sdcguard.fingerprint import Fingerprint

HERE = Path(__file__).parent

A, B, C = Fingerprint(1, 1), Fingerprint(2, 2), Fingerprint(3, 3)


def everyone(pp, dp, stages_per_rank=1):
    """torchtitan's order (pp, dp): rank = pipeline position * dp + replica."""
    out = []
    for rank in range(pp * dp):
        position, replica = divmod(rank, dp)
        out.append({"pp": [p * dp + replica for p in range(pp)], "dp": [position * dp + r for r in range(dp)],
                    "stages": [position + pp * k for k in range(stages_per_rank)], "num_stages": pp * stages_per_rank})
    return out


def test_the_grid_reads_replicas_and_positions_from_the_groups():
    grid = read_grid(everyone(2, 3))
    assert isinstance(grid, Grid)
    assert (grid.replicas, grid.positions, grid.num_stages) == (3, 2, 2)
    assert grid.at[4] == (1, 1) and grid.rank_at(2, 0) == 2 and grid.stages[5] == (1,)
    interleaved = read_grid(everyone(2, 2, stages_per_rank=2))
    assert interleaved.stages[0] == (0, 2) and interleaved.position_of_stage(3) == 1
    assert "interleaved" in interleaved.describe()


@pytest.mark.parametrize("mutate, message", [
    (lambda e: e[1].update(dp=[0, 1, 2, 3]), "differ in size"),
    (lambda e: e[2].update(pp=[2, 0]), "holds different pipeline positions"),
    (lambda e: e[3].update(stages=[0]), "different stages"),
])
def test_a_grid_that_is_not_one_is_refused_with_why(mutate, message):
    ranks = everyone(2, 2)
    mutate(ranks)
    assert message in read_grid(ranks)


def test_one_replica_of_each_stage_is_refused():
    assert "one data-parallel replica" in read_grid(everyone(4, 1))


def test_the_ring_replays_the_same_stage_of_another_replica_on_another_node_when_one_exists():
    grid = read_grid(everyone(2, 4))
    # 8 ranks, 2 per node: a stage's replicas 0,1 share a node, so the ring skips two replicas ahead
    shift, crosses = ring_shift(grid, ranks_per_node=2)
    assert (shift, crosses) == (2, True)
    assert all(grid.at[ring_target(grid, r, shift)][1] == grid.at[r][1] for r in range(8))
    # one node: the next replica, on the same node (said in the plan)
    assert ring_shift(grid, ranks_per_node=8) == (1, False)


def passes(forward_fault_stage=None, grad_fault_stage=None, stages=(0, 1, 2)):
    """A clean replica's pass, and one whose ``forward_fault_stage`` output differs (and so every
    later stage and every gradient), or whose ``grad_fault_stage`` gradient alone differs."""
    clean = StagePass(losses=[A], outputs={s: [[A]] for s in stages[:-1]}, input_grads={s: [[A]] for s in stages[1:]},
                      grads={s: {0: A} for s in stages})
    bad = StagePass(losses=list(clean.losses), outputs=dict(clean.outputs), input_grads=dict(clean.input_grads),
                    grads=dict(clean.grads))
    if forward_fault_stage is not None:
        for s in stages:
            if s >= forward_fault_stage and s != stages[-1]:
                bad.outputs[s] = [[B]]
            bad.grads[s] = {0: B}
            if s > 0:
                bad.input_grads[s] = [[B]]
        bad.losses = [B]
    if grad_fault_stage is not None:
        bad.grads[grad_fault_stage] = {0: C}
    return clean, bad


def test_the_first_stage_whose_output_differs_is_the_culprit_not_the_later_ones_it_reached():
    clean, bad = passes(forward_fault_stage=1)
    assert culprit_stage(clean, bad, [0, 1, 2], last_stage=2) == (1, "forward")
    clean, bad = passes(grad_fault_stage=0)
    assert culprit_stage(clean, bad, [0, 1, 2], last_stage=2) == (0, "backward")
    assert culprit_stage(clean, clean, [0, 1, 2], last_stage=2) is None


def split(p: StagePass, stages):
    """The part of a replica's pass one rank holding ``stages`` records."""
    return StagePass(losses=p.losses if 2 in stages else [], outputs={s: v for s, v in p.outputs.items() if s in stages},
                     input_grads={s: v for s, v in p.input_grads.items() if s in stages},
                     grads={s: v for s, v in p.grads.items() if s in stages})


def test_a_persistent_forward_fault_names_its_rank_alone():
    # PP 3 x DP 3: rank = position * 3 + replica; rank 4 (replica 1, stage 1) computes its forward
    # wrongly in its own pass and in its replay of replica 2's batch
    grid = read_grid(everyone(3, 3))
    target = lambda r: ring_target(grid, r, 1)  # noqa: E731
    clean, bad = passes(forward_fault_stage=1)
    own = {r: bad if grid.at[r][0] == 1 else clean for r in range(9)}
    replay = {r: bad if grid.at[r][0] == 1 else clean for r in range(9)}  # replica 1 replays replica 2
    details = [[split(own[r], grid.stages[r]), split(replay[r], grid.stages[r])] for r in range(9)]
    digests = [[d[0].digest(), d[1].digest()] for d in details]
    verdict = judge_pipeline_replays(digests, target, grid, details)
    assert (verdict.check, verdict.suspects, verdict.ambiguous) == ("replay", [4], False)
    assert verdict.evidence["first_differing_stages"] == [1]


def test_a_transient_gradient_fault_names_its_stage_pair_ambiguously():
    grid = read_grid(everyone(2, 3))
    target = lambda r: ring_target(grid, r, 1)  # noqa: E731
    clean, bad = passes(grad_fault_stage=1, stages=(0, 1))
    details = [[split(clean, grid.stages[r]), split(clean, grid.stages[r])] for r in range(6)]
    details[5][0] = split(bad, grid.stages[5])  # rank 5's own pass only: replica 2, stage 1
    details = [[StagePass(losses=d[0].losses if 1 in grid.stages[r] else [], outputs=d[0].outputs,
                          input_grads=d[0].input_grads, grads=d[0].grads), d[1]] for r, d in enumerate(details)]
    digests = [[d[0].digest(), d[1].digest()] for d in details]
    verdict = judge_pipeline_replays(digests, target, grid, details)
    assert (verdict.suspects, verdict.ambiguous) == ([4, 5], True)  # no third replay of a pipeline
    assert verdict.evidence["pipeline_pairs"][0]["direction"] == "backward"


def test_a_stage_pass_survives_its_json():
    clean, _ = passes()
    assert StagePass.from_json(json.loads(json.dumps(clean.to_json()))).digest() == clean.digest()


# -- how the stages are replicated (layouts/pipeline_stages) --------------------------------------

def test_a_pass_is_assembled_from_its_sums_in_one_read_as_the_fingerprints_say():
    """``BoundaryLog.into``: what the stages recorded on the device becomes the pass the digest and
    the JSON carry — outputs and input gradients per stage in micro-batch order (recorded in
    another order), gradients per stage (a stage that recorded none is there, empty), losses."""
    import torch

    from sdcguard.checks.pipeline import BoundaryLog
    from sdcguard.fingerprint import fingerprint_many, fingerprint_sums

    torch.manual_seed(0)
    t = [torch.randn(3, 4) for _ in range(8)]
    log = BoundaryLog()
    log.outputs = {0: {1: fingerprint_sums([t[1]]), 0: fingerprint_sums([t[0], t[2]])}}  # stage 0 of 2 and 3
    log.input_grads = {2: {0: fingerprint_sums([t[3]]), 1: fingerprint_sums([])},
                       0: {1: fingerprint_sums([t[4]]), 0: fingerprint_sums([t[5]])}}
    losses = fingerprint_sums([t[6][0, 0], t[6][1, 1]])
    grads = [(0, [3, 1], fingerprint_sums([t[7], t[0]])), (2, [], torch.zeros((0, 2), dtype=torch.int64))]
    got = log.into(losses, grads)
    fp = fingerprint_many
    want = StagePass(losses=fp([t[6][0, 0], t[6][1, 1]]),
                     outputs={0: [fp([t[0], t[2]]), fp([t[1]])]},
                     input_grads={2: [fp([t[3]]), []], 0: [fp([t[5]]), fp([t[4]])]},
                     grads={0: {3: fp([t[7]])[0], 1: fp([t[0]])[0]}, 2: {}})
    assert got == want and got.digest() == want.digest()
    assert StagePass.from_json(json.loads(json.dumps(got.to_json()))) == want


def test_a_stage_module_neither_ddp_nor_fsdp2_is_refused_naming_both():
    from types import SimpleNamespace

    import torch

    from sdcguard.layouts.pipeline_stages import stage_replicas
    with pytest.raises(TypeError, match="DistributedDataParallel, or FSDP2's fully_shard"):
        stage_replicas([SimpleNamespace(submod=torch.nn.Linear(2, 2), stage_index=0)], reduce_hook=None,
                       reduce_state=None, seed=0)


def test_each_rank_carries_its_share_of_its_groups_underflow_term():
    import torch

    from sdcguard.checks.reduce_checksum import Shape, rounding_bound
    from sdcguard.layouts.pipeline_stages import underflow_share
    shape = Shape(world=3, buckets=2, elements=1000, dtypes=(torch.float32,))
    # the group's ranks add up to the term the group's own bound has at y = 0
    assert 6 * underflow_share(shape, 6) == pytest.approx(rounding_bound(0.0, shape), rel=1e-12)
    assert underflow_share(shape, 3) > 0
    assert underflow_share(None, 3) == 0.0
    assert underflow_share(Shape(world=3, buckets=0, elements=0, dtypes=()), 3) == 0.0


# -- under torchrun (6 ranks: PP 2 x DP 3) --------------------------------------------------------

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("pp")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SDCGUARD_")}, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=6",
                           str(HERE / "pp_worker.py"), str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return lambda scenario: [json.loads((out / f"{scenario}-rank{r}.json").read_text()) for r in range(6)]


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "interleaved"])
def test_a_clean_pipeline_run_is_bitwise_the_plain_loop_audited_or_not(runs, kind):
    results = runs(f"exact-{kind}")
    for r in results:
        assert r["unaudited"] == r["plain"] + [0] and r["audited"] == r["plain"] + [0]
        assert r["alarms"] == [{str(s): None for s in range(3)}] * 2
        assert (r["audited_step"], r["weights_verified"]) == (2, 2)  # step 0 (shape inference) unaudited
    assert all(len(r["plain"][0]) == 12 for r in results[3:])  # the last stage: 4 micro-batch losses a step
    plan = "\n".join(results[0]["plan"])
    stages = "4 stages on 2 ranks per replica (2 stages per rank" if kind == "interleaved" else "2 stages on 2 ranks"
    assert stages in plan and "3 data-parallel replicas" in plan and "same node" in plan


@pytest.mark.multiprocess
def test_pipeline_faults_name_the_stage_and_rank_where_they_happened(runs):
    results = runs("faults")
    assert len({json.dumps(r["steps"], sort_keys=True) for r in results}) == 1  # every rank, the same verdicts
    steps = results[0]["steps"]
    assert steps["0"] is None
    # rank 1's stage-0 forward (own pass and replays): rank 1 alone, stage 0 — not the stage-1
    # ranks whose activations and gradients it corrupted
    assert (steps["1"]["check"], steps["1"]["suspect_ranks"], steps["1"]["ambiguous"]) == ("replay", [1], False)
    assert steps["1"]["evidence"]["first_differing_stages"] == [0]
    assert steps["1"]["evidence"]["coordinates"]["1"] == {"replica": 1, "pipeline_position": 0, "stages": [0]}
    # rank 5's stage-1 gradient in its own pass only: one mismatching pair at stage 1, ambiguous
    assert (steps["2"]["suspect_ranks"], steps["2"]["ambiguous"]) == ([4, 5], True)
    assert steps["2"]["evidence"]["first_differing_stages"] == [1]
    # rank 4's stored weights: check 3 among stage 1's replicas
    assert (steps["3"]["check"], steps["3"]["suspect_ranks"], steps["3"]["ambiguous"]) == ("weights", [4], False)
    # a NaN once in rank 3's stage-1 forward reaches replica 0's stage 0 through the backward: the
    # replays elsewhere are finite, so check 1a names replica 0's ranks, ambiguous (which stage made it
    # is not known off audit steps)
    assert (steps["4"]["check"], steps["4"]["suspect_ranks"], steps["4"]["ambiguous"]) == ("nonfinite-local", [0, 3], True)


@pytest.mark.multiprocess
def test_a_pipeline_resumes_bitwise_from_the_checkpoint_the_alarm_names(runs):
    results = runs("resume")
    for r in results:
        path, step, sha = r["named"]
        assert r["alarm_step"] == 5 and path.endswith("ckpt-3") and step == 3 and len(sha) == 64
        assert r["start"] == 3 and r["resumed"] == r["clean"]  # every stage's weights, bit for bit
        assert "stage-1.pt was modified after it was verified" in r["refused"]  # every rank refuses


# -- FSDP2 over each stage (torchtitan's default under PP) -----------------------------------------

SHARDED = {  # PP_DP -> (ranks, schedules, scenarios)
    "fsdp": (6, "1f1b", "faults,resume"),                       # pure FSDP over 3 ranks per stage
    "hsdp": (6, "gpipe,1f1b,interleaved", "faults,resume"),     # 3 replicas x 1 shard: torchtitan's DP only
    "hsdp22": (8, "1f1b,interleaved", "resume"),                # 2 replicas x 2 shards
}


@pytest.fixture(scope="module", params=sorted(SHARDED))
def sharded_runs(request, tmp_path_factory):
    kind = request.param
    ranks, kinds, scenarios = SHARDED[kind]
    out = tmp_path_factory.mktemp(f"pp-{kind}")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SDCGUARD_")}, "OMP_NUM_THREADS": "1",
           "PP_DP": kind, "PP_KINDS": kinds, "PP_SCENARIOS": scenarios}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
                           str(HERE / "pp_worker.py"), str(out)], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]

    def read(scenario):
        return [json.loads((out / f"{scenario}-rank{r}.json").read_text()) for r in range(ranks)]
    return kind, kinds.split(","), scenarios.split(","), read


@pytest.mark.slow
@pytest.mark.multiprocess
def test_fsdp2_stages_train_bitwise_the_plain_loop_name_faults_and_resume_bitwise(sharded_runs):
    kind, kinds, scenarios, read = sharded_runs
    hsdp = kind.startswith("hsdp")
    for schedule in kinds:
        results = read(f"exact-{schedule}")
        for r in results:
            assert r["unaudited"] == r["plain"] + [0] and r["audited"] == r["plain"] + [0]
            assert r["alarms"] == [{str(s): None for s in range(3)}] * 2
            # FSDP2's reductions are not primed by the shape inference: step 0 is audited too
            assert r["audited_step"] == 2 and r["weights_verified"] == (2 if hsdp else None)
        plan = "\n".join(results[0]["plan"])
        assert "each stage sharded with FSDP2" in plan
        # a replay sends nothing to another replica: no gradient all-reduce (only 2-element agreements)
        assert all(n <= 2 for r in results for n in r["replay_all_reduces"])
        assert ("check 3 compares each shard of each stage" in plan) == hsdp
        assert ("does not run check 3: one replica of each stage (pure FSDP)" in plan) == (not hsdp)
    if "faults" in scenarios:
        steps = read("faults")[0]["steps"]
        assert steps["0"] is None
        assert (steps["1"]["check"], steps["1"]["suspect_ranks"], steps["1"]["ambiguous"]) == ("replay", [1], False)
        assert steps["1"]["evidence"]["first_differing_stages"] == [0]
        assert (steps["2"]["suspect_ranks"], steps["2"]["ambiguous"]) == ([4, 5], True)
        assert steps["2"]["evidence"]["first_differing_stages"] == [1]
        if hsdp:  # rank 4's shard differs from its replicas'
            assert (steps["3"]["check"], steps["3"]["suspect_ranks"], steps["3"]["ambiguous"]) == ("weights", [4], False)
        else:  # one replica: a corrupted shard is what every pipeline all-gathers (the documented blind spot)
            assert steps["3"] is None
        assert (steps["4"]["check"], steps["4"]["suspect_ranks"], steps["4"]["ambiguous"]) == ("nonfinite-local", [0, 3], True)
    for r in read("resume"):
        path, step, sha = r["named"]
        if hsdp:
            assert r["alarm_step"] == 5 and path.endswith("ckpt-3") and step == 3 and len(sha) == 64
        else:  # nothing cross-checked pure FSDP's weights: the alarm names no checkpoint
            assert r["alarm_step"] == 5 and r["named"] == [None, None, None]
        assert r["start"] == 3 and r["resumed"] == r["clean"]
        assert "stage-1.pt was modified after it was verified" in r["refused"]
