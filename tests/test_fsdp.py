"""sdcguard on models sharded with FSDP2 (``sdcguard.sharding``): the pure judgements in-process,
then the real thing under torchrun over gloo — HSDP 2 x 2 and pure FSDP over 4 ranks in one launch,
HSDP 3 x 2 in another (see fsdp_worker): a clean run, audited (check 2's replay by the whole mesh)
or not, is bit-identical to plain FSDP2, and injected faults are caught by the check that should
catch them, naming the rank (or the reduction group)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sdcguard.checks.reduce_checksum import judge_checksum
from sdcguard.faults.sharded import _row_of
from sdcguard.fingerprint import Fingerprint
from sdcguard.sharding.layout import layout_of, plan_checks
from sdcguard.sharding.reduce_record import ShardedRecorder
from sdcguard.sharding.reduction_check import localize_checksum, step_vote
from sdcguard.sharding.replay import own_pass, pass_key
from sdcguard.sharding.shard_weights import judge_shard_weights, ranks_needed

HERE = Path(__file__).parent


# -- pure parts ----------------------------------------------------------------------------------

def test_layout_reads_the_mesh_grid():
    hsdp = layout_of([[0, 1, 2], [3, 4, 5]], rank=4)
    assert (hsdp.replicas, hsdp.shards, hsdp.hsdp) == (2, 3, True)
    assert hsdp.coordinates(4) == {"replica": 1, "shard": 1}
    assert hsdp.replicas_of_shard(2) == [2, 5] and hsdp.shard_group(1) == [3, 4, 5]
    flat = layout_of([0, 1, 2, 3], rank=2)
    assert (flat.replicas, flat.shards, flat.hsdp) == (1, 4, False)
    with pytest.raises(ValueError, match="exactly once"):
        layout_of([[0, 1], [1, 2]], rank=0)


def test_the_plan_says_what_runs_for_each_mesh():
    pure = plan_checks(layout_of([0, 1, 2, 3], 0), reduce_scatter_checked=True, all_reduce_checked=True)
    assert "weights" in pure.off and "one replica" in pure.off["weights"]
    assert "replay" in pure.runs and "nonfinite-local" in pure.runs and "confirmed" in pure.runs["nonfinite-local"]
    assert "reduce-checksum (all-reduce)" not in pure.runs
    two = plan_checks(layout_of([[0, 1], [2, 3]], 0), reduce_scatter_checked=True, all_reduce_checked=False)
    assert "ambiguous" in two.runs["weights"] and "reduce-checksum (all-reduce)" in two.off


def _digests(grid, odd=()):
    return [bytes([16 + j]) * 16 if r not in odd else bytes([99]) * 16
            for r in range(sum(len(row) for row in grid)) for j in [next(i for row in grid for i, x in enumerate(row) if x == r)]]


def test_check3_names_the_replica_outside_its_shards_majority():
    grid = [[0, 1], [2, 3], [4, 5]]
    layout = layout_of(grid, 0)
    digests = _digests(grid, odd={3})
    assert ranks_needed(digests, layout) == {1, 3}  # the odd one and the first of its shard's majority
    fps = [[Fingerprint(r, 0), Fingerprint(7, 7)] if r in (1, 3) else None for r in range(6)]
    fps[3] = [Fingerprint(1, 0), Fingerprint(8, 8)]  # differs from rank 1 in the second parameter
    fps[1] = [Fingerprint(1, 0), Fingerprint(7, 7)]
    verdict = judge_shard_weights(digests, fps, ["a", "b"], layout)
    assert verdict.check == "weights" and verdict.suspects == [3] and not verdict.ambiguous
    assert verdict.evidence["coordinates"] == {3: {"replica": 1, "shard": 1}}
    assert verdict.evidence["shards"][1]["differing_parameters"] == {3: {"count": 1, "names": ["b"]}}
    assert judge_shard_weights(_digests(grid), [None] * 6, ["a", "b"], layout) is None


def test_check3_with_two_replicas_names_both_ambiguously():
    grid = [[0, 1], [2, 3]]
    verdict = judge_shard_weights(_digests(grid, odd={2}), [None] * 4, ["a"], layout_of(grid, 0))
    assert verdict.suspects == [0, 2] and verdict.ambiguous
    assert ranks_needed(_digests(grid, odd={2}), layout_of(grid, 0)) == set()


class _Group:
    """What the recorder reads of an FSDPParamGroup."""
    all_reduce_grads, _partial_reduce_output, gradient_divide_factor = True, None, None


def _simulate(grid, n_rows=37, corrupt=None, seed=0):
    """Every rank's recorder fed FSDP2's reduction of random float32 gradients: a reduce-scatter
    (mean of row j over the shard group) and, for HSDP, an all-reduce (mean over the replicas),
    computed here as gloo's AVG does (sum, then divide). ``corrupt = (rank, element)`` adds 1 to one
    element of that rank's all-reduce output (or reduce-scatter output, pure FSDP)."""
    R, S = len(grid), len(grid[0])
    g = torch.Generator().manual_seed(seed)
    grads = {r: torch.randn(S * n_rows, generator=g) * 10.0 ** torch.randint(-3, 3, (S * n_rows,), generator=g)
             for row in grid for r in row}
    recorders = {r: ShardedRecorder(layout_of(grid, r), seed=1) for r in grads}
    for rec in recorders.values():
        rec.begin_step(5)
    records = {r: recorders[r].local_input(0, grads[r].clone(), torch.distributed.ReduceOp.AVG, _Group()) for r in grads}
    outputs = {}
    for i, row in enumerate(grid):
        for j, r in enumerate(row):
            outputs[r] = torch.stack([grads[q].view(S, -1)[j] for q in row]).sum(0) / S
    for r in grads:
        if corrupt and R == 1 and r == corrupt[0]:
            outputs[r][corrupt[1]] += 1.0
        recorders[r].reduced_shard(records[r], outputs[r], recorders[r].layout.coordinates(r)["shard"])
    if R > 1:
        for j in range(S):
            column = [grid[i][j] for i in range(R)]
            mean = torch.stack([outputs[r] for r in column]).sum(0) / R
            for r in column:
                out = mean.clone()
                if corrupt and r == corrupt[0]:
                    out[corrupt[1]] += 1.0
                recorders[r].replicated_shard(0, out)
    votes = {r: step_vote(recorders[r].records, recorders[r].layout, [torch.tensor(1.0)]) for r in grads}
    x, y = (sum(float(v.vote[k]) for v in votes.values()) for k in (0, 1))
    shape = votes[0].shape
    rows = [votes[r].row.tolist() for r in sorted(votes)]
    return x, y, shape, rows, votes[0]


@pytest.mark.parametrize("grid", [[[0, 1], [2, 3]], [[0, 1], [2, 3], [4, 5]], [[0, 1, 2, 3]]])
def test_check4_is_silent_on_honest_sharded_reductions(grid):
    for seed in range(5):
        x, y, shape, rows, mine = _simulate(grid, seed=seed)
        assert judge_checksum(x, y, shape) is None, (grid, seed, x, y)
        where = localize_checksum(rows, layout_of(grid, 0), mine.rs_elements, mine.ar_elements, shape.dtypes)
        assert where == {"reduce_scatter": [], "all_reduce": []}


def test_check4_names_the_group_whose_reduction_is_off():
    grid = [[0, 1], [2, 3], [4, 5]]
    x, y, shape, rows, mine = _simulate(grid, corrupt=(3, 4))
    verdict = judge_checksum(x, y, shape)
    assert verdict is not None and verdict.check == "reduce-checksum"
    where = localize_checksum(rows, layout_of(grid, 0), mine.rs_elements, mine.ar_elements, shape.dtypes)
    assert [g["shard"] for g in where["all_reduce"]] == [1] and where["reduce_scatter"] == []
    flat = [[0, 1, 2, 3]]
    x, y, shape, rows, mine = _simulate(flat, corrupt=(2, 4))
    assert judge_checksum(x, y, shape) is not None
    where = localize_checksum(rows, layout_of(flat, 0), mine.rs_elements, mine.ar_elements, shape.dtypes)
    assert [g["replica"] for g in where["reduce_scatter"]] == [0] and where["all_reduce"] == []


def test_a_nonfinite_local_gradient_shows_in_the_vote_and_its_rank_row():
    grid = [[0, 1], [2, 3]]
    recorder = ShardedRecorder(layout_of(grid, 2), seed=0)
    recorder.begin_step(0)
    grad = torch.ones(8)
    grad[5] = float("inf")
    record = recorder.local_input(0, grad, torch.distributed.ReduceOp.AVG, _Group())
    recorder.reduced_shard(record, torch.ones(4), 0)
    recorder.replicated_shard(0, torch.ones(4))
    vote = step_vote(recorder.records, recorder.layout, [torch.tensor(1.0)])
    assert not torch.isfinite(vote.vote).all() and not torch.isfinite(vote.row[0]) and torch.isfinite(vote.row[1])


def test_fault_layout_finds_an_element_in_the_reduce_scatter_rows():
    # a (5, 4) parameter over 2 shards: 3 rows each (padded to 6); element 13 = row 3, column 1
    assert _row_of(13, torch.Size([5, 4]), chunk_rows=3) == (1, 1)
    assert _row_of(2, torch.Size([3]), chunk_rows=2) == (1, 0)


def test_the_replays_pass_keys_one_reduce_scatter_per_unit_and_micro_batch():
    class _Rec:  # what own_pass reads of a Reduction
        def __init__(self, unit, micro, sums):
            self.unit, self.micro, self.fp = unit, micro, torch.tensor(sums)
    loss = torch.tensor([[9, 9]])
    own = own_pass([_Rec(2, 0, [5, 6]), _Rec(0, 0, [1, 2]), _Rec(2, 1, [7, 8])], loss, units=3)
    assert own.loss_fps == [Fingerprint(9, 9)]
    assert own.grad_fps == {pass_key(2, 0, 3): (5, 6), pass_key(0, 0, 3): (1, 2), pass_key(2, 1, 3): (7, 8)}
    assert len({pass_key(u, m, 3) for u in range(3) for m in range(4)}) == 12
    swapped = own_pass([_Rec(2, 0, [7, 8]), _Rec(0, 0, [1, 2]), _Rec(2, 1, [5, 6])], loss, units=3)
    assert swapped.digest() != own.digest()  # the same gradients in other micro-batches differ


# -- under torchrun ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
                               str(HERE / "fsdp_worker.py"), str(out / str(n))], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env)
             for n in (4, 6) if (out / str(n)).mkdir() is None]
    for proc in procs:
        output, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, output[-6000:]

    def result(mesh, scenario):
        n = 6 if mesh == "hsdp3x2" else 4
        return [json.loads((out / str(n) / f"{mesh}-{scenario}-rank{r}.json").read_text()) for r in range(n)]
    return result


MESHES = ["hsdp2x2", "hsdp3x2", "fsdp4"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("mesh", MESHES)
def test_a_clean_sharded_run_is_bitwise_plain_fsdp2(runs, mesh):
    # AdamW, 2 micro-batches, dropout, clip_grad_norm_: every loss and every local shard equal,
    # without audits and with check 2 (the whole mesh replaying other ranks' batches) on every step
    for r in runs(mesh, "exact"):
        for run, audited in (("unaudited", None), ("audited", 3)):
            assert r[run]["alarms"] == 0
            assert r[run]["guarded"] == r["plain"]
            assert r[run]["reduction_verified"] == 3          # check 4 ran and passed on every step
            assert r[run]["weights_verified"] == (None if mesh == "fsdp4" else 3)
            assert r[run]["audited"] == audited               # check 2 ran and passed on every step
        assert r["grads_kept"] == [True] * 4                  # .grad the same objects, the same bits, after the replay


@pytest.mark.multiprocess
def test_the_start_up_plan_says_check3_cannot_run_on_pure_fsdp(runs):
    plan = "\n".join(runs("fsdp4", "exact")[0]["plan"])
    assert "FSDP over 4 ranks (one replica)" in plan and "does not run weights: one replica" in plan
    plan = "\n".join(runs("hsdp3x2", "exact")[0]["plan"])
    assert "runs weights" in plan and "runs reduce-checksum (all-reduce)" in plan and "runs replay" in plan


@pytest.mark.multiprocess
@pytest.mark.parametrize("mesh", MESHES)
def test_an_inf_in_one_ranks_local_gradient_is_named_and_not_reproduced_by_the_replay(runs, mesh):
    # no audits in this run: the confirmation replays anyway (the whole mesh, rank 1's batch on rank 0)
    for r in runs(mesh, "faults"):
        step = r["steps"]["0"]
        alarm = step["alarm"]
        assert (alarm["check"], alarm["suspect_ranks"], alarm["ambiguous"]) == ("nonfinite-local", [1], False)
        assert alarm["evidence"]["confirmation"] == {"1": {"replayed_on": 0, "replay_grad_sq_norm": pytest.approx(
            alarm["evidence"]["confirmation"]["1"]["replay_grad_sq_norm"]), "reproduced": False}}
        assert not step["applied"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("mesh, group", [("hsdp2x2", ("all_reduce", "shard", 1)), ("hsdp3x2", ("all_reduce", "shard", 1)),
                                         ("fsdp4", ("reduce_scatter", "replica", 0))])
def test_a_corrupted_reduced_shard_is_caught_by_check4_naming_its_group(runs, mesh, group):
    kind, key, index = group
    results = runs(mesh, "faults")
    alarms = [{k: v for k, v in r["steps"]["1"]["alarm"].items() if k != "time"} for r in results]
    assert all(a == alarms[0] for a in alarms)                  # one record (but its clock), every rank
    alarm = alarms[0]
    assert alarm["check"] == "reduce-checksum" and alarm["suspect_ranks"] == []
    assert [g[key] for g in alarm["evidence"]["groups"][kind]] == [index]
    assert not any(r["steps"]["1"]["applied"] for r in results)
    assert results[0]["spooled"]                               # the record went to the spool


@pytest.mark.multiprocess
def test_a_flipped_weight_bit_in_one_replica_is_named_with_its_coordinates(runs):
    alarm = runs("hsdp3x2", "faults")[0]["steps"]["2"]["alarm"]
    assert (alarm["check"], alarm["suspect_ranks"], alarm["ambiguous"]) == ("weights", [3], False)
    assert alarm["evidence"]["coordinates"] == {"3": {"replica": 1, "shard": 1}}
    assert alarm["evidence"]["shards"]["1"]["differing_parameters"] == {"3": {"count": 1, "names": ["out.weight"]}}
    two = runs("hsdp2x2", "faults")[0]["steps"]["2"]["alarm"]  # two replicas: no majority, both named
    assert (two["check"], two["suspect_ranks"], two["ambiguous"]) == ("weights", [1, 3], True)


@pytest.mark.multiprocess
def test_a_corrupted_update_of_one_ranks_shard_is_named_by_check3(runs):
    alarm = runs("hsdp3x2", "faults")[0]["steps"]["3"]["alarm"]
    assert (alarm["check"], alarm["suspect_ranks"], alarm["ambiguous"]) == ("weights", [2], False)
    assert alarm["evidence"]["coordinates"] == {"2": {"replica": 1, "shard": 0}}
    for r in runs("hsdp3x2", "faults"):
        assert r["steps"]["4"] == {"ok": True, "applied": True}  # training goes on once replicas agree again


@pytest.mark.multiprocess
@pytest.mark.parametrize("mesh", MESHES)
def test_a_deferred_reduction_is_bitwise_plain_fsdp2_without_false_alarms(runs, mesh):
    # HSDP: set_requires_all_reduce(False) on the first micro-batch: its reduce-scatter output is kept
    # as FSDP2's partial and added before the last one's all-reduce, so that all-reduce's operand is
    # no single reduce-scatter's output: check 4 leaves it out (check 1 still sees it). Pure FSDP:
    # set_requires_gradient_sync(False), the local gradients accumulate unreduced. Audited: the
    # replay repeats the pattern (and restores FSDP2's partial)
    for r in runs(mesh, "deferred"):
        assert r["alarms"] == 0 and r["guarded"] == r["plain"] and r["reduction_verified"] == 1 and r["audited"] == 1


# -- check 2 ------------------------------------------------------------------------------------

def _replay_alarm(runs, mesh, step):
    results = runs(mesh, "replay_faults")
    alarms = [{k: v for k, v in r["steps"][str(step)]["alarm"].items() if k != "time"} for r in results]
    assert all(a == alarms[0] for a in alarms) and not any(r["steps"][str(step)]["applied"] for r in results)
    return alarms[0]


@pytest.mark.multiprocess
@pytest.mark.parametrize("mesh", MESHES)
def test_a_flipped_bit_in_one_ranks_backward_is_named_by_the_replay(runs, mesh):
    alarm = _replay_alarm(runs, mesh, 0)
    assert (alarm["check"], alarm["suspect_ranks"], alarm["ambiguous"]) == ("replay", [1], False)
    pair = alarm["evidence"]["pairs"][0]
    assert (pair["replayer"], pair["owner"]) == (0, 1) and pair["loss_bits_owner"] == pair["loss_bits_replay"]
    assert pair["differing_parameters"]["names"] == ["out (micro-batch 0)"]  # the unit, the micro-batch
    assert alarm["evidence"]["tiebreaks"] == [{"replayer": 0, "owner": 1, "third": 2, "agrees_with": "replayer"}]
    S = {"hsdp2x2": 2, "hsdp3x2": 2, "fsdp4": 4}[mesh]
    assert alarm["evidence"]["coordinates"]["1"] == {"replica": 0, "shard": 1, "shard_group": list(range(S))}
    assert alarm["suspects"][0]["rank"] == 1


@pytest.mark.multiprocess
@pytest.mark.parametrize("mesh", MESHES)
def test_a_corrupted_activation_in_one_ranks_forward_is_named_by_the_replay(runs, mesh):
    alarm = _replay_alarm(runs, mesh, 1)
    assert (alarm["check"], alarm["suspect_ranks"], alarm["ambiguous"]) == ("replay", [2], False)
    pair = alarm["evidence"]["pairs"][0]
    assert pair["loss_bits_owner"][0] != pair["loss_bits_replay"][0] and pair["loss_bits_owner"][1] == pair["loss_bits_replay"][1]


@pytest.mark.multiprocess
@pytest.mark.parametrize("mesh", MESHES)
def test_a_fault_in_a_replay_names_the_replayer_not_the_owner(runs, mesh):
    alarm = _replay_alarm(runs, mesh, 2)
    owner = 4 if mesh == "hsdp3x2" else 0                         # rank 3 replays rank 3 + 1 (mod W)
    assert (alarm["check"], alarm["suspect_ranks"], alarm["ambiguous"]) == ("replay", [3], False)
    assert alarm["evidence"]["tiebreaks"][0]["owner"] == owner and alarm["evidence"]["tiebreaks"][0]["agrees_with"] == "owner"


@pytest.mark.multiprocess
@pytest.mark.parametrize("mesh", MESHES)
def test_a_nan_in_the_data_is_reproduced_by_the_replay_and_raises_no_alarm(runs, mesh):
    for r in runs(mesh, "replay_faults"):
        assert r["steps"]["3"] == {"nonfinite": {"2": 1}, "confirmed": True, "applied": False}
        assert r["steps"]["4"] == {"ok": True, "applied": True} and r["audited"] == 4
