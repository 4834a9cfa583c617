"""The drill judges recovery: after each alarm the run resumes from the newest verified state before
the alarm's suspect window (the named checkpoint, or an in-memory copy), a resume inside the
window fails the drill, and the recovered run ends bit for bit equal to the same run without faults.

In-process: the judging and the choice of resume point. Multi-process (3 nodes x 1 rank, 20 steps):
one clean run and two runs that between them hold every fault kind a check catches."""
import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from sdcguard.drill.launch import DrillInputError, add_arguments, config_from_args
from sdcguard.drill.report import build_report

# -- in-process ----------------------------------------------------------------------------------


def _cfg(**overrides):
    cfg = {"nodes": 3, "ranks_per_node": 1, "world_size": 3, "steps": 20, "audit_every": 5, "weight_check_every": 0,
           "micro_batches": 1, "checkpoint_every": 2, "on_alarm": "resume", "seed": 0, "backend": "gloo",
           "timeout_s": 60, "print_every": 2, "workdir": "/tmp/x", "spool": "/tmp/x/spool",
           "faults": [{"kind": "grad-bitflip", "rank": 1, "step": 10, "magnitude": None, "every": None,
                       "during": "own", "element": None, "site": None, "param": None}]}
    return {**cfg, **overrides}


ALARM = {"id": "run-1-replay-step10", "check": "replay", "step": 10, "suspect_ranks": [1], "ambiguous": False,
         "suspects": [{"rank": 1, "pod": None, "node": "drill-node-1"}],
         "suspect_window": {"first_step": 6, "last_step": 10},
         "last_good_checkpoint": "/tmp/x/checkpoints/step-4.pt", "last_good_checkpoint_step": 4}


def _results(resume_step, resumed_from, digests=("ab", "ab", "ab")):
    return [{"rank": r, "fired": [{"kind": "grad-bitflip", "rank": 1, "step": 10, "target": "hidden.weight[0]"}] if r == 1 else [],
             "alarms": [ALARM["id"]], "steps_completed": 20, "stopped_at_step": None, "final_weights": d,
             "recoveries": [{"alarm": ALARM["id"], "step": 10, "resume_step": resume_step, "resumed_from": resumed_from}]}
            for r, d in enumerate(digests)]


def test_a_resume_before_the_window_passes_with_one_final_digest():
    report = build_report(_cfg(), _results(4, "step-4.pt"), [ALARM])
    assert report["passed"] and report["injected"][0]["outcome"] == "caught"
    assert report["injected"][0]["resume_step"] == 4
    assert report["recoveries"] == [{
        "alarm": ALARM["id"], "check": "replay", "step": 10, "suspect_window": {"first_step": 6, "last_step": 10},
        "last_good_checkpoint": "step-4.pt", "resume_step": 4, "resumed_from": "step-4.pt"}]
    assert report["resumed_from"] == ["step-4.pt"]
    assert report["final_weights_digest"] == "ab" and report["final_weight_digests"] == {0: "ab", 1: "ab", 2: "ab"}


def test_a_resume_inside_the_window_is_resume_unsafe_and_fails_the_drill():
    report = build_report(_cfg(), _results(8, "step-8.pt"), [ALARM])
    [row] = report["injected"]
    assert row["outcome"] == "resume-unsafe" and not report["passed"]
    assert row["why"] == "resumed from step 8, inside the alarm's suspect window 6..10"


def test_a_window_that_starts_after_the_fault_is_caught_too():
    late = {**ALARM, "suspect_window": {"first_step": 10, "last_step": 10}}  # a library bug the drill must see
    since_8 = [{**_cfg()["faults"][0], "step": 8, "every": 1}]  # active from step 8, caught at the audit at 10
    report = build_report(_cfg(faults=since_8), _results(9, "step-9.pt"), [late])
    assert report["injected"][0]["outcome"] == "resume-unsafe" and not report["passed"]
    assert "after the fault struck at step 8" in report["injected"][0]["why"]


def test_replicas_that_disagree_at_the_end_have_no_final_digest():
    report = build_report(_cfg(), _results(4, "step-4.pt", digests=("ab", "ab", "cd")), [ALARM])
    assert report["final_weights_digest"] is None and report["final_weight_digests"][2] == "cd"


def test_resume_point_is_the_newest_snapshot_before_the_window():
    from sdcguard.drill.worker import Snapshot, resume_point
    snapshots = [Snapshot(s, None, None, {}, {}) for s in (-1, 0, 2, 4, 6, 8)]
    assert [resume_point(snapshots, first).step for first in (0, 1, 6, 7, 9, 100)] == [-1, 0, 4, 6, 8, 8]


def _args(*argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_named_targets_are_checked_against_the_drill_model_before_anything_starts():
    cfg = config_from_args(_args("--inject", "grad-bitflip:rank=1:step=3:param=head.weight:element=5",
                                 "--inject", "forward-scale:rank=0:step=5:site=norm"))
    assert [(f["param"], f["site"], f["element"]) for f in cfg["faults"]] == [("head.weight", None, 5), (None, "norm", None)]
    with pytest.raises(DrillInputError, match="no parameter 'hiden.weight' in DrillModel; closest: hidden.weight"):
        config_from_args(_args("--inject", "grad-bitflip:rank=1:step=3:param=hiden.weight"))
    with pytest.raises(DrillInputError, match="element 4096 is out of range for hidden.weight"):
        config_from_args(_args("--inject", "weight-swap:rank=1:step=3:element=4096"))


# -- multi-process ---------------------------------------------------------------------------------

LAYOUT = ["--nodes", "3", "--ranks-per-node", "1", "--steps", "20"]


def drill(tmp_path_factory, name, *args):
    out = tmp_path_factory.mktemp(name)
    proc = subprocess.run(
        [sys.executable, "-m", "sdcguard.cli", "drill", *LAYOUT, "--report", str(out / "report.json"),
         "--spool", str(out / "spool"), *args],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, json.loads((out / "report.json").read_text())


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    return drill(tmp_path_factory, "clean")[1]


BETWEEN = [  # audits every 5, checkpoints every 2, no other weight check
    "grad-bitflip:rank=1:step=10",       # on an audit step, with checkpoints since the last audit
    "forward-nan:rank=0:step=11",
    "grad-inf:rank=2:step=12",
    "weight-bitflip:rank=2:step=13",     # seen only by check 3 before the checkpoint at 14
    "reduce-nan:step=15",
    "optimizer-scale:rank=0:step=17",    # seen only by check 3 before the checkpoint at 18
]
PERSISTENT = [  # audits every 8, checkpoints every 3, weight checks every 2
    "reduce-scale:step=4",                  # check 4, on every step
    "forward-scale:rank=2:step=8",
    "grad-bitflip:rank=1:step=10:every=1",  # active from 10, caught by the audit at 16
    "weight-swap:rank=0:step=18",
]


def _injects(specs):
    return [arg for spec in specs for arg in ("--inject", spec)]


@pytest.fixture(scope="module")
def between_checkpoints(tmp_path_factory):
    return drill(tmp_path_factory, "between", "--audit-every", "5", "--weight-check-every", "0",
                 "--checkpoint-every", "2", "--on-alarm", "resume", *_injects(BETWEEN))


@pytest.fixture(scope="module")
def persistent(tmp_path_factory):
    return drill(tmp_path_factory, "persistent", "--audit-every", "8", "--checkpoint-every", "3",
                 "--on-alarm", "resume", *_injects(PERSISTENT))


def _alarm(report, check, step):
    [alarm] = [a for a in report["alarms"] if (a["check"], a["step"]) == (check, step)]
    [recovery] = [r for r in report["recoveries"] if r["alarm"] == alarm["id"]]
    return alarm, recovery


def _recovered(alarm, recovery, window, checkpoint_step):
    assert alarm["suspect_window"] == {"first_step": window[0], "last_step": window[1]}
    assert Path(alarm["last_good_checkpoint"]).name == f"step-{checkpoint_step}.pt"
    assert alarm["last_good_checkpoint_step"] == checkpoint_step
    assert alarm["steps_at_risk"] == alarm["step"] - checkpoint_step
    assert (recovery["resume_step"], recovery["resumed_from"]) == (checkpoint_step, f"step-{checkpoint_step}.pt")


@pytest.mark.multiprocess
@pytest.mark.slow
def test_transient_fault_on_an_audit_step_resumes_from_before_the_last_passing_audit(between_checkpoints):
    _, report = between_checkpoints
    alarm, recovery = _alarm(report, "replay", 10)
    assert alarm["suspect_ranks"] == [1] and alarm["last_audited_step"] == 5
    # the audit at 5 passed: steps 6..10 are suspect, so step-8 (inside) must not be named
    _recovered(alarm, recovery, (6, 10), 4)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_weight_fault_caught_by_the_check_before_a_checkpoint(between_checkpoints):
    proc, report = between_checkpoints
    alarm, recovery = _alarm(report, "weights", 14)  # step 14: neither an audit nor a weight-check step
    assert alarm["suspect_ranks"] == [2] and alarm["last_weights_verified_step"] == 12
    assert alarm["evidence"]["differing_parameters"] == {"2": {"count": 1, "names": ["hidden.weight"]}}
    _recovered(alarm, recovery, (13, 14), 12)
    alarm, recovery = _alarm(report, "weights", 18)
    assert alarm["suspect_ranks"] == [0]
    _recovered(alarm, recovery, (17, 18), 16)
    assert "[drill] step   14  ALARM silent data corruption: check weights at step 14: rank 2 node drill-node-2" in proc.stdout


@pytest.mark.multiprocess
@pytest.mark.slow
def test_non_finite_faults_resume_from_before_their_windows(between_checkpoints):
    _, report = between_checkpoints
    # local: after the last passing audit (10), and never before the checkpoint this run resumed
    # from; reduced: after the last step check 4 verified
    for check, step, window, checkpoint in (("nonfinite-local", 11, (11, 11), 10), ("nonfinite-local", 12, (11, 12), 10),
                                            ("nonfinite-reduced", 15, (15, 15), 14)):
        alarm, recovery = _alarm(report, check, step)
        _recovered(alarm, recovery, window, checkpoint)
        assert alarm["suspect_ranks"] == ([] if check == "nonfinite-reduced" else [0 if step == 11 else 2])


@pytest.mark.multiprocess
@pytest.mark.slow
def test_persistent_fault_between_audits_resumes_from_before_the_last_passing_audit(persistent):
    _, report = persistent
    alarm, recovery = _alarm(report, "replay", 16)
    assert alarm["suspect_ranks"] == [1] and alarm["last_audited_step"] == 8
    # active since 10, unseen until the audit at 16: everything after the audit at 8 is suspect,
    # so the newest checkpoint (step-15) must not be named
    _recovered(alarm, recovery, (9, 16), 6)
    # after the audit at 0: the run resumed from step-3.pt (taken between audits) reaches back past
    # it, to step-0.pt, which it knows from step-3.pt's manifest
    _recovered(*_alarm(report, "replay", 8), (1, 8), 0)
    _recovered(*_alarm(report, "weights", 18), (17, 18), 15)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_finite_fault_inside_the_all_reduce_is_caught_by_check_4(persistent):
    _, report = persistent
    alarm, recovery = _alarm(report, "reduce-checksum", 4)
    assert alarm["suspect_ranks"] == [] and alarm["suspects"] == []  # the reduction is shared: no rank
    assert alarm["evidence"]["difference"] > alarm["evidence"]["bound"]
    assert {"kind": "reduce-scale", "step": 4, "ranks": [0, 1, 2]} in report["fired"]  # every rank alike
    _recovered(alarm, recovery, (4, 4), 3)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("run", ["between_checkpoints", "persistent"])
def test_every_fault_caught_and_the_recovered_run_is_bitwise_the_clean_one(run, clean, request):
    _, report = request.getfixturevalue(run)
    assert report["passed"] and report["unexplained_alarms"] == []
    assert {r["outcome"] for r in report["injected"]} == {"caught"}
    assert len(report["alarms"]) == len(report["recoveries"]) == len(report["injected"])
    for recovery in report["recoveries"]:
        assert recovery["resume_step"] < recovery["suspect_window"]["first_step"]
    assert clean["alarms"] == [] and clean["final_weights_digest"] is not None
    assert report["final_weights_digest"] == clean["final_weights_digest"]
    assert set(report["final_weight_digests"].values()) == {clean["final_weights_digest"]}


def test_the_two_runs_hold_every_kind_a_check_catches():
    from sdcguard.faults import KINDS
    assert {spec.split(":")[0] for spec in BETWEEN + PERSISTENT} == {k for k, i in KINDS.items() if i.caught_by}
