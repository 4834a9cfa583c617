"""The update re-run (check 3 with one replica): the pure functions in-process, then pure FSDP under
torchrun (gloo, 4 ranks and 2 ranks; tests/update_replay_worker.py)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sdcguard.checks.attribution import OWNER, REPLAYER
from sdcguard.checks.update_replay import (
    UpdateSnapshot, differing, fingerprints, owner_result, pack, refusal, rerun, result_digest, settle_alone,
    take_snapshot, tiebreaks, unpack, update_verdict,
)

HERE = Path(__file__).resolve().parent

VARIANTS = [
    (torch.optim.AdamW, {}),
    (torch.optim.AdamW, {"foreach": True}),
    (torch.optim.AdamW, {"foreach": False, "amsgrad": True}),
    (torch.optim.AdamW, {"fused": True}),
    (torch.optim.AdamW, {"maximize": True, "weight_decay": 0.1}),
    (torch.optim.AdamW, {"lr": torch.tensor(3e-3)}),
    (torch.optim.Adam, {}),
    (torch.optim.Adam, {"weight_decay": 0.05, "foreach": True}),
    (torch.optim.Adam, {"weight_decay": 0.05, "decoupled_weight_decay": True}),
    (torch.optim.Adam, {"amsgrad": True, "fused": True}),
    (torch.optim.SGD, {}),
    (torch.optim.SGD, {"momentum": 0.9}),
    (torch.optim.SGD, {"momentum": 0.9, "nesterov": True, "weight_decay": 1e-2, "foreach": True}),
    (torch.optim.SGD, {"momentum": 0.9, "dampening": 0.1, "fused": True}),
]


def _owner(cls, kwargs, steps_before=2):
    """An optimizer with state over three parameters in two groups (one with no gradient at the
    checked step), stepped ``steps_before`` times; then the checked step's gradients, clipped."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(7, 5)), torch.nn.Parameter(torch.randn(11)),
              torch.nn.Parameter(torch.randn(3, 3))]
    lr = kwargs.pop("lr", 1e-2)
    opt = cls([{"params": params[:2]}, {"params": params[2:], "lr": lr * 0.5 if not torch.is_tensor(lr) else lr}],
              lr=lr, **kwargs)
    for step in range(steps_before + 1):
        for i, p in enumerate(params):
            p.grad = torch.randn_like(p) * (10 ** (i - 1))
        if step == steps_before:
            params[1].grad = None  # not updated at the checked step: its state stays as it was
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            return opt, params
        opt.step()


@pytest.mark.parametrize("cls, kwargs", VARIANTS, ids=[f"{c.__name__}-{'-'.join(k) or 'default'}" for c, k in VARIANTS])
def test_a_rerun_is_bit_for_bit_the_owners_update(cls, kwargs):
    opt, params = _owner(cls, dict(kwargs))
    names = {id(p): f"p{i}" for i, p in enumerate(params)}
    snap = take_snapshot(opt, 7, names)
    opt.step()
    mine = owner_result(opt, snap.names)
    again = rerun(cls, snap)
    assert [n for n, _ in again] == [n for n, _ in mine]
    assert any(n.endswith(("exp_avg", "momentum_buffer")) for n, _ in mine) or kwargs == {} and cls is torch.optim.SGD
    for (name, a), (_, b) in zip(mine, again):
        assert a.dtype == b.dtype and torch.equal(a.view(-1).view(torch.int32 if a.element_size() == 4 else torch.int64),
                                                  b.view(-1).view(torch.int32 if b.element_size() == 4 else torch.int64)), name
    assert fingerprints(mine) == fingerprints(again)
    # the snapshot is a copy: the owner's update did not touch it, and a re-run leaves it as it was
    assert not torch.equal(snap.before[0], params[0].detach()) and snap.grads[1] is None
    assert fingerprints(rerun(cls, snap)) == fingerprints(again)


def test_the_rerun_travels_as_plain_tensors_and_comes_back_the_same():
    from sdcguard.checks.exchange import Incoming
    from sdcguard.sharding.update_check import _frame, _unframe
    opt, params = _owner(torch.optim.AdamW, {})
    snap = take_snapshot(opt, 3)
    framed = _frame(snap)  # the small part with torch.save (loaded weights_only=True), the tensors raw
    assert framed.numel() - snap.nbytes < 4096
    back = _unframe(Incoming(bytes(16), framed.clone(), [], torch.device("cpu"), None), torch.device("cpu"))
    assert _unframe(Incoming(bytes(16), _frame(None), [], torch.device("cpu"), None), torch.device("cpu")) is None
    tensor_lr, _ = _owner(torch.optim.Adam, {"lr": torch.tensor(3e-3), "amsgrad": True})  # settings travel as JSON
    snap2 = take_snapshot(tensor_lr, 2)
    back2 = _unframe(Incoming(bytes(16), _frame(snap2), [], torch.device("cpu"), None), torch.device("cpu"))
    assert isinstance(back2.hyper[0]["lr"], torch.Tensor) and isinstance(back2.hyper[0]["betas"], tuple)
    assert fingerprints(rerun(torch.optim.Adam, back2)) == fingerprints(rerun(torch.optim.Adam, snap2))
    assert back.hyper[0]["betas"] == snap.hyper[0]["betas"] and back.names == ["group0.param0", "group0.param1",
                                                                               "group1.param0"]
    assert fingerprints(rerun(torch.optim.AdamW, back)) == fingerprints(rerun(torch.optim.AdamW, snap))
    assert snap.nbytes == sum(t.numel() * 4 for t in (*params, params[0], params[2])) + sum(
        2 * p.numel() * 4 + 4 for p in params)  # shards, two gradients, two moments and a step per parameter


def test_the_payload_packs_every_tensor_into_one_buffer_and_back():
    tensors = [torch.randn(3, 4), None, torch.tensor(5.0), torch.zeros(0, 3), torch.arange(4), torch.randn(2).bfloat16()]
    flat, meta = pack(tensors)
    assert flat.dtype == torch.uint8 and flat.numel() == 48 + 4 + 32 + 4
    for a, b in zip(tensors, unpack(flat, meta)):
        assert (a is None and b is None) or (a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b))
    with pytest.raises(ValueError, match="unexpected dtype"):
        unpack(flat, [["torch.Foo", [1]]])
    with pytest.raises(ValueError, match="holds 88 bytes"):
        unpack(flat, meta[:1])
    # the digest of a result sees one flipped bit in any tensor, and two elements that traded places
    result = [("a", torch.randn(5)), ("a.exp_avg", torch.randn(5))]
    flipped = [(n, t.clone()) for n, t in result]
    flipped[1][1].view(torch.int32)[2] ^= 1
    swapped = [(n, t.clone()) for n, t in result]
    swapped[0][1][[0, 1]] = swapped[0][1][[1, 0]]
    assert len({result_digest(result), result_digest(flipped), result_digest(swapped)}) == 3


def test_a_corrupted_update_differs_in_the_corrupted_shard_only():
    opt, params = _owner(torch.optim.AdamW, {})
    snap = take_snapshot(opt, 1, {id(p): f"p{i}" for i, p in enumerate(params)})
    opt.step()
    with torch.no_grad():
        params[2].view(-1)[4] *= 1e4  # what the injector's optimizer-scale does
    mine, again = owner_result(opt, snap.names), rerun(torch.optim.AdamW, snap)
    assert differing([n for n, _ in again], fingerprints(mine), fingerprints(again)) == ["p2"]
    # a flipped bit in a moment (the state's update) is seen too
    opt2, params2 = _owner(torch.optim.AdamW, {})
    snap2 = take_snapshot(opt2, 1, {id(p): f"p{i}" for i, p in enumerate(params2)})
    opt2.step()
    opt2.state[params2[0]]["exp_avg_sq"].view(-1).view(torch.int32)[3] ^= 1 << 20
    assert differing([n for n, _ in rerun(torch.optim.AdamW, snap2)], fingerprints(owner_result(opt2, snap2.names)),
                     fingerprints(rerun(torch.optim.AdamW, snap2))) == ["p0.exp_avg_sq"]


def test_only_elementwise_torch_optimizers_are_re_run():
    p = [torch.nn.Parameter(torch.zeros(2))]
    assert refusal(torch.optim.AdamW(p)) is None and refusal(torch.optim.SGD(p, lr=0.1)) is None
    assert "RMSprop is not one of torch.optim.AdamW, Adam, SGD" in refusal(torch.optim.RMSprop(p))

    class MyAdam(torch.optim.Adam):  # a subclass may override step()
        pass
    assert "MyAdam" in refusal(MyAdam(p))
    assert "differentiable=True" in refusal(torch.optim.SGD(p, lr=0.1, differentiable=True))
    with pytest.raises(TypeError):
        rerun(torch.optim.RMSprop, take_snapshot(torch.optim.RMSprop(p), 0))


def test_foreach_is_resolved_as_torch_resolves_it_for_the_owners_tensors():
    opt, _ = _owner(torch.optim.AdamW, {})
    assert [g["foreach"] for g in take_snapshot(opt, 0).hyper] == [False, False]  # CPU tensors: single-tensor
    opt, _ = _owner(torch.optim.SGD, {"foreach": True})
    assert [g["foreach"] for g in take_snapshot(opt, 0).hyper] == [True, True]   # the user's choice, kept


# -- who is named ----------------------------------------------------------------------------------

def test_one_mismatching_pair_is_settled_by_a_third_rank():
    # rank 2 re-ran rank 1's update and differs; rank 3's re-run of rank 1 agrees with rank 2: rank 1 erred
    assert tiebreaks([(2, 1)], 4) == [(2, 1)]
    verdict = update_verdict(5, [(2, 1)], 4, {(2, 1): REPLAYER}, {1: ["out.weight"]})
    assert (verdict.check, verdict.suspects, verdict.ambiguous) == ("weights", [1], False)
    assert verdict.evidence["update_replay"]["differing"] == {1: {"count": 1, "names": ["out.weight"]}}
    # the third agrees with the owner: the re-run was wrong (a fault on rank 2)
    assert update_verdict(5, [(2, 1)], 4, {(2, 1): OWNER}, {}).suspects == [2]
    both = update_verdict(5, [(2, 1)], 4, {(2, 1): "neither"}, {})
    assert (both.suspects, both.ambiguous) == ([1, 2], True)


def test_a_rank_in_two_pairs_is_named_without_a_tie_break():
    # rank 1's own update differs from rank 2's re-run, and its re-run of rank 0 differs from rank 0's
    assert tiebreaks([(1, 0), (2, 1)], 4) == []
    verdict = update_verdict(5, [(1, 0), (2, 1)], 4, {}, {})
    assert (verdict.suspects, verdict.ambiguous) == ([1], False)
    assert update_verdict(5, [], 4, {}, {}) is None


def test_two_ranks_settle_a_lone_pair_by_the_owners_own_rerun():
    assert tiebreaks([(0, 1)], 2) == [(0, 1)] and tiebreaks([(0, 1), (1, 0)], 2) == []
    # the owner's re-run agrees with its neighbour's, not with its first result: a transient fault of the owner
    assert settle_alone(b"A", b"B", b"B") == REPLAYER
    assert settle_alone(b"A", b"B", b"A") == "neither"
    named = update_verdict(3, [(0, 1)], 2, {(0, 1): REPLAYER}, {})
    assert (named.suspects, named.ambiguous) == ([1], False)
    both = update_verdict(3, [(0, 1), (1, 0)], 2, {}, {})
    assert (both.suspects, both.ambiguous) == ([0, 1], True)


def test_the_judge_expects_a_corrupted_update_on_pure_fsdp_only_on_weight_check_steps():
    from sdcguard.faults.judge import Schedule, judge_faults
    plan = Schedule(12, 2, 3, nodes=4, checks_weights=False, checks_updates=True)
    alarm = {"id": "a", "check": "weights", "step": 6, "suspect_ranks": [2], "ambiguous": False}
    verdict = judge_faults(["optimizer-scale:rank=2:step=6", "optimizer-scale:rank=1:step=7",
                            "weight-bitflip:rank=3:step=3"], [alarm], plan)
    assert [r["outcome"] for r in verdict.rows] == ["caught", "escaped", "escaped"] and verdict.passed
    assert "weight-check steps only" in verdict.rows[1]["why"] and "no copy of the shard" in verdict.rows[2]["why"]
    wrong = judge_faults(["optimizer-scale:rank=2:step=6"], [{**alarm, "suspect_ranks": [3]}], plan)
    assert wrong.rows[0]["outcome"] == "misattributed"
    persistent = judge_faults(["optimizer-scale:rank=2:step=4:every=1"], [alarm], plan)  # first firing on a check step: 6
    assert persistent.rows[0]["outcome"] == "caught"


# -- under torchrun ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("update_replay")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = {n: subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                  f"--nproc_per_node={n}", str(HERE / "update_replay_worker.py"), str(out / str(n))],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for n in (4, 2) if (out / str(n)).mkdir() is None}
    for proc in procs.values():
        output, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, output[-6000:]
    return lambda n: [json.loads((out / str(n) / f"rank{r}.json").read_text()) for r in range(n)]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("world", [4, 2])
def test_a_clean_pure_fsdp_run_with_update_reruns_is_bitwise_plain_fsdp2(runs, world):
    for r in runs(world):
        assert r["clean"]["alarms"] == 0
        assert r["clean"]["guarded"] == r["clean"]["plain"]      # every loss and every local shard, bit for bit
        assert r["clean"]["reruns"] == 4 and r["clean"]["bytes_sent"] > 0
        assert r["clean"]["weights_verified"] is None            # a re-run is not a second copy of the weights
        assert any("runs update re-run" in line for line in r["clean"]["plan"])


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_corrupted_update_is_named_by_the_neighbours_rerun(runs):
    results = runs(4)
    alarms = [{k: v for k, v in r["faults"]["steps"]["2"]["alarm"].items() if k not in ("time", "step_seconds")} for r in results]
    assert all(a == alarms[0] for a in alarms)                   # one record, on every rank
    alarm = alarms[0]
    assert (alarm["check"], alarm["suspect_ranks"], alarm["ambiguous"]) == ("weights", [2], False)
    evidence = alarm["evidence"]["update_replay"]
    assert evidence["mismatching"] == [{"rerun_by": 3, "owner": 2, "tiebreak": "replayer"}]
    assert evidence["differing"] == {"2": {"count": 1, "names": ["out.weight"]}}
    assert list(alarm["evidence"]["coordinates"]) == ["2"]
    for r in results:
        assert [r["faults"]["steps"][s] for s in "0134"] == [{"ok": True}] * 4  # step 3 is no weight-check step: it escapes
        assert [(f["rank"], f["step"]) for f in r["faults"]["fired"]] == {2: [(2, 2)], 1: [(1, 3)]}.get(r["rank"], [])
    # with two ranks the owner's own re-run settles it
    two = runs(2)[0]["faults"]["steps"]["2"]["alarm"]
    assert (two["check"], two["suspect_ranks"], two["ambiguous"]) == ("weights", [1], False)
    assert two["evidence"]["update_replay"]["mismatching"] == [{"rerun_by": 0, "owner": 1, "tiebreak": "replayer"}]
