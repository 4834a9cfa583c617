"""The library under torchrun (3 gloo ranks): a run under sdcguard is bit-identical to the same run
without it, GradScaler overflows are told from SDC, checkpoints are verified. See guard_worker."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sdcguard.checkpoint import CheckpointError, load_checkpoint, manifest_path

pytestmark = pytest.mark.multiprocess
HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("library")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3",
         str(HERE / "guard_worker.py"), str(out)],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr

    def result(name):
        return [json.loads((out / f"{name}-rank{r}.json").read_text()) for r in range(3)]
    return out, result


def test_audited_run_is_bitwise_the_run_without_sdcguard(run):
    # audit + weight check on every step, dropout, BatchNorm, 2 micro-batches: parameters,
    # buffers, .grad and optimizer state all equal the plain-DDP run bit for bit
    _, result = run
    for r in result("clean"):
        assert r["alarms"] == 0
        assert r["guarded"] == r["reference"]
        assert r["rng_untouched"]


def test_checkpoint_round_trip_records_step_and_digest(run):
    out, result = run
    r = result("clean")[0]
    assert r["checkpoint_step"] == 5 and r["reloaded_equal"]
    assert r["checkpoints"] == [[5, str(out / "ckpt.pt")]]
    manifest = json.loads(manifest_path(out / "ckpt.pt").read_text())
    assert manifest["verified"] is True and manifest["step"] == 5 and len(manifest["weight_digest"]) == 32


def test_honest_overflow_is_skipped_without_alarm(run):
    _, result = run
    for r in result("scaler"):
        steps = r["steps"]
        assert steps["1"]["applied"] is False                     # the scaler skipped the step
        assert steps["1"]["scale_after"] == steps["1"]["scale_before"] / 2
        assert steps["0"]["applied"] and steps["2"]["applied"]    # ...and training went on


def test_injected_inf_under_a_scaler_names_the_rank(run):
    _, result = run
    for r in result("scaler"):
        alarm = r["alarm"]
        assert (alarm["check"], alarm["step"], alarm["suspect_ranks"]) == ("nonfinite-local", 3, [2])
        assert alarm["evidence"]["confirmation"]["2"]["reproduced"] is False
        assert "refusing to write" in r["refused"]                # no checkpoint after an alarm


def test_unequal_thread_counts_are_refused_at_start(run):
    _, result = run
    for r in result("threads"):
        assert "same count on every rank" in r["error"]


def _copy(run, tmp_path):
    out, _ = run
    for name in ("ckpt.pt", "ckpt.pt.sdcguard.json"):
        shutil.copy(out / name, tmp_path / name)
    return tmp_path / "ckpt.pt"


def test_tampered_checkpoint_is_refused(run, tmp_path):
    import guard_worker  # noqa: E402  (tests/ is on sys.path under pytest)
    path = _copy(run, tmp_path)
    state = torch.load(path, weights_only=False)
    state["model"]["out.weight"][0, 0] += 1e-3
    torch.save(state, path)
    with pytest.raises(CheckpointError, match="modified after it was verified"):
        load_checkpoint(path, guard_worker.Net())


def test_checkpoint_whose_weights_disagree_with_the_manifest_is_refused(run, tmp_path):
    import guard_worker
    path = _copy(run, tmp_path)
    manifest = json.loads(manifest_path(path).read_text())
    state = torch.load(path, weights_only=False)
    state["model"]["inp.bias"][0] += 1.0
    torch.save(state, path)
    manifest["sha256"] = __import__("hashlib").sha256(path.read_bytes()).hexdigest()  # a forged manifest
    manifest_path(path).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="loaded weights have digest"):
        load_checkpoint(path, guard_worker.Net())


def test_checkpoint_without_manifest_is_refused(run, tmp_path):
    import guard_worker
    path = _copy(run, tmp_path)
    manifest_path(path).unlink()
    with pytest.raises(CheckpointError, match="has no manifest"):
        load_checkpoint(path, guard_worker.Net())


def test_finite_norms_whose_squares_would_overflow_a_sum_raise_no_alarm(run):
    # Each rank's squared norm is 1.44e308: three of them would sum to Inf. Check 1's vote
    # carries square roots (check 4's operand bounds), so it stays finite: no alarm, the step is
    # applied, and nothing is gathered beyond the one 16-byte all-reduce.
    _, result = run
    for r in result("huge"):
        assert r["alarm"] is None
        assert r["applied"]
        assert r["norm_bytes"] == 16


def test_agreement_and_ring_transfer(run):
    # One 16-byte MAX all-reduce answers "same digest everywhere, no veto?"; only the first 52
    # bits are compared (a float64 holds them exactly). The ring transfer's note arrives with
    # the batch, from the rank before.
    _, result = run
    for rank, r in enumerate(result("exchange")):
        assert (r["equal"], r["one_differs"], r["one_vetoes"], r["beyond_52_bits"]) == (True, False, False, True)
        assert r["received"] == {"from": (rank - 1) % 3}
        assert r["note"] == bytes([(rank - 1) % 3]).hex() * 16


def test_a_replay_that_raises_on_one_rank_stops_every_rank_without_hanging(run):
    # The failing rank vetoes the audit's agreement instead of leaving it: every rank then learns
    # what failed where and raises the same ReplayError; no alarm, the update is not applied.
    _, result = run
    for r in result("replay_fails"):
        assert r["0"] == "ok"
        assert r["1"] == {"failures": {"1": "RuntimeError: out of memory (simulated)"}, "step": 1, "applied": False}


def test_a_confirmation_replay_that_raises_on_one_rank_stops_every_rank_without_hanging(run):
    # The replay that confirms a non-finite gradient (every GradScaler overflow runs one) fails on
    # rank 1 only: before, rank 1 left with its exception and ranks 0 and 2 waited in the
    # confirmation's gather until the process group's timeout.
    _, result = run
    for r in result("confirmation_fails"):
        assert r == {"failures": {"1": "RuntimeError: out of memory (simulated)"}, "step": 0, "applied": False,
                     "confirmation": True}, r


def test_a_tiebreak_replay_that_raises_leaves_both_ranks_suspect_without_hanging(run):
    # Before, rank 0 left with its exception and ranks 1 and 2 waited in the third opinion's broadcast.
    _, result = run
    for r in result("tiebreak_fails"):
        assert isinstance(r, dict), r
        assert (r["suspects"], r["ambiguous"], r["applied"]) == ([1, 2], True, False), r
        assert [(t["replayer"], t["owner"], t["third"], t["agrees_with"]) for t in r["tiebreaks"]] == [(1, 2, 0, "neither")], r


def test_a_checkpoint_that_fails_on_one_rank_fails_on_every_rank(run):
    # Before, rank 0's pickling error left the others in the outcome's broadcast, and ranks 0 and 1
    # went on from a load rank 2 could not make, into collectives rank 2 never joined.
    _, result = run
    for rank, r in enumerate(result("checkpoint_failures")):
        assert r["save"].startswith("checkpoint ") and "was not written" in r["save"], r
        assert "pickle" in r["save"].lower(), r
        if rank == 2:
            assert r["load"].startswith("CheckpointError") and "not-on-this-node.pt" in r["load"], r
        else:
            assert r["load"].startswith("CheckpointError") and "not on every rank (rank 2: " in r["load"] and r["unchanged"], r


def test_the_users_own_loop_is_bitwise_the_plain_ddp_loop(run):
    # guard.step with weight= accumulation, clip_grad_norm_ and a scheduler kept in the user's code,
    # audits and weight checks on every step: parameters, buffers, .grad and optimizer state equal
    _, result = run
    for r in result("step_api"):
        assert r["alarms"] == 0 and r["guarded"] == r["plain"]


def test_a_data_caused_inf_is_not_blamed_on_a_gpu(run):
    out, result = run
    for r in result("data_inf"):
        assert r["error"] is not None and r["error"] != "alarm", r
        assert r["ranks"] == {"1": 1} and r["confirmed"] is True and r["step"] == 0
        assert r["applied"] is False
        assert r["alarm_files"] == []


def test_compiled_models_replay_bit_exactly(run):
    _, result = run
    for r in result("compiled"):
        for form in ("eager", "compile(ddp)", "ddp(compile)"):
            assert "alarm" not in r[form], (form, r[form])
            assert r[form]["alarms"] == 0 and r[form]["audited"] == 2
        # audited steps run eagerly; the others compiled: the weights may differ from eager in
        # the last bits, but every replica agreed (check 3 ran on every step)


def test_check4_stays_silent_on_honest_reductions_and_catches_a_scaled_element(run):
    _, result = run
    for r in result("checksum"):
        # finite gradients whose float32 squared norm overflows (dynamic range to 1e30, values near
        # the type's largest) are recognised as finite element by element: no alarm, no error
        assert r["honest_alarms"] == [] and r["nonfinite"] == [] and r["honest_steps"] == 15
        alarm = r["corrupted"]
        assert alarm is not None and alarm["check"] == "reduce-checksum"
        assert alarm["suspect_ranks"] == [] and alarm["evidence"]["exceeds_bound_by"] > 1
        assert alarm["suspect_window"] == {"first_step": 0, "last_step": 0}
        assert r["applied"] is False
