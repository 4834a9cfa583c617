"""The cost of a checked run (issue 34): the checks' measured premium by kind (``sdcguard.budget.run_cost``,
the statistics' ``cost``), the rollback waste of an alarm (``sdcguard.contract.cost``, the operator's
``status.cost``), false-positive investigations (``operator/cost.py``), and ``sdcguard report SPOOL``.

The arithmetic is pure and tested in-process on hand-made figures; one real drill (2 gloo ranks)
writes a spool that ``sdcguard report`` and the sidecar's collector read; one incident on the
shared operator world is denied after a passed health check.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from prometheus_client import CollectorRegistry

from sdcguard import run_cost
from sdcguard.budget import run_cost as figures
from sdcguard.contract import alarm as alarm_schema
from sdcguard.contract import cost
from sdcguard.contract.stats import CheckStats
from sdcguard.sidecar.metrics import RankStatsCollector
from sdcguard_operator import cost as incident_cost

# -- the premium by kind (pure) ------------------------------------------------------------------------


def test_each_kind_of_check_costs_its_measured_seconds_over_the_plain_step():
    # 10 steps: 6 ordinary, 2 audits, 2 weight checks, all measured but the first (an ordinary one).
    # Ordinary checks 1 ms a step; an audit 8 ms of phases beyond them and 2 ms of determinism and
    # recording outside them (its plain time 12 ms against 10 ms); a weight check 0.5 ms.
    steps = {"ordinary": 6, "audit": 2, "weights": 2}
    sampled = {"ordinary": 5, "audit": 2, "weights": 2}
    own = {"ordinary": 0.0, "audit": 0.016, "weights": 0.001}
    c = figures(steps, sampled, own, 0.009, [0.010] * 5 + [0.5, 0.010, 0.010], [0.012, 0.012], world_size=4)
    assert c["step_time_s"] == pytest.approx(0.010) and c["step_time_from"] == "ordinary steps"
    checks = c["checks"]
    assert (checks["ordinary"]["runs"], checks["audit"]["runs"], checks["weights"]["runs"]) == (10, 2, 2)
    assert checks["ordinary"]["seconds_each"] == pytest.approx(0.001)
    assert checks["audit"]["seconds_each"] == pytest.approx(0.010) and checks["audit"]["outside_phases_s"] == pytest.approx(0.002)
    assert checks["weights"]["seconds_each"] == pytest.approx(0.0005)
    # premium = cost x runs / (steps x step time): 10%, 2 x 10 ms / 100 ms = 20%, 1%
    assert [checks[k]["premium"] for k in ("ordinary", "audit", "weights")] == pytest.approx([0.10, 0.20, 0.01])
    assert c["premium"] == pytest.approx(0.31) and c["checked_step_s"] == pytest.approx(0.0131)
    assert c["premium_seconds"] == pytest.approx(0.010 + 0.020 + 0.001) and c["world_size"] == 4


def test_every_step_audited_takes_the_audit_steps_as_the_plain_step_and_nothing_measured_is_none():
    c = figures({"ordinary": 0, "audit": 3, "weights": 0}, {"ordinary": 0, "audit": 2, "weights": 0},
                {"audit": 0.004}, 0.001, [], [0.010, 0.012], world_size=2)
    assert c["step_time_from"] == "audit steps" and c["step_time_s"] == pytest.approx(0.011)
    assert c["checks"]["audit"]["outside_phases_s"] == 0.0  # nothing to compare an audit step with
    assert figures({"ordinary": 1, "audit": 0, "weights": 0}, dict.fromkeys(("ordinary", "audit", "weights"), 0),
                   {}, 0.0, [], [], 1) is None
    assert figures({"ordinary": 2}, {"ordinary": 1}, {}, 0.0, [0.0], [], 1) is None  # a 0 s step is no measurement


def test_the_statistics_carry_the_cost_when_written_not_on_every_step():
    from sdcguard.budget import Meter

    stats = CheckStats({"rank": 0}, None)
    meter = Meter(stats, world_size=2)
    assert "cost" not in stats.as_dict()  # nothing measured yet
    for step in range(3):
        meter.begin(audit=step == 2)
        meter.ended()
    record = stats.as_dict()["cost"]
    assert record["steps"] == {"ordinary": 2, "audit": 1, "weights": 0} and record["world_size"] == 2
    assert record["measured_steps"] == {"ordinary": 1, "audit": 1, "weights": 0}


# -- the rollback (pure) ----------------------------------------------------------------------------------

def test_rollback_waste_is_steps_at_risk_times_step_seconds_times_ranks():
    assert cost.rollback_gpu_seconds(21, 2.5, 8) == 420.0
    assert cost.rollback_gpu_seconds(0, 2.5, 8) == 0.0
    for bad in [(None, 2.5, 8), (21, None, 8), (21, 2.5, None), (True, 2.5, 8), (21, math.nan, 8), (21, -1.0, 8),
                (21, 2.5, 0), (-1, 2.5, 8), (21, "2.5", 8)]:
        assert cost.rollback_gpu_seconds(*bad) is None, bad
    assert cost.rollback({"steps_at_risk": 36, "step_seconds": 1.0, "world_size": 100}) == {
        "steps_at_risk": 36, "step_seconds": 1.0, "world_size": 100, "gpu_seconds": 3600.0, "gpu_hours": 1.0}
    assert cost.rollback({"steps_at_risk": 36}) is None  # an older library's record: unknown, never guessed


def test_the_cost_of_a_checked_run_is_premium_plus_waste():
    total = cost.checked_run(3600.0, [1800.0, 1800.0], plain_gpu_seconds=72000.0)
    assert total == {"premium_gpu_hours": 1.0, "rollback_gpu_hours": 1.0, "gpu_hours": 2.0, "fraction_of_run": 0.1}
    assert cost.checked_run(0.0, [], 0.0)["fraction_of_run"] is None


def record(**fields):
    me = {"rank": 0, "pod": None, "node": "n0"}
    return alarm_schema.make_alarm(alarm_id="a-1", job=None, check="replay", step=40, suspect_ranks=[0],
                                   identities={0: me}, ambiguous=False, reporter_rank=0, evidence={},
                                   last_verified_step=30, last_good_checkpoint=None, **fields)


def test_the_alarm_carries_the_step_time_and_the_ranks_validated_like_every_field():
    typed = alarm_schema.Alarm.parse(record(steps_at_risk=21, step_seconds=2.5, world_size=8))
    assert (typed.step_seconds, typed.world_size) == (2.5, 8)
    assert alarm_schema.Alarm.parse(record()).step_seconds is None  # optional: absent in older records
    for bad, message in [({"step_seconds": -1.0}, "step_seconds"), ({"step_seconds": True}, "step_seconds"),
                         ({"step_seconds": "1"}, "step_seconds"), ({"world_size": 0}, "world_size"),
                         ({"world_size": 2.0}, "world_size")]:
        with pytest.raises(alarm_schema.AlarmError, match=message):
            record(**bad)
    text = alarm_schema.dumps(record(step_seconds=1.0)).replace('"step_seconds": 1.0', '"step_seconds": NaN')
    with pytest.raises(alarm_schema.AlarmError):
        alarm_schema.loads(text)


# -- the incident's cost (pure) ----------------------------------------------------------------------------

def test_the_incident_status_cost_holds_what_the_alarm_knows():
    assert incident_cost.rollback(21, {"step_seconds": 2.5, "world_size": 8}) == {
        "stepsAtRisk": 21, "stepSeconds": 2.5, "worldSize": 8, "rollbackGpuSeconds": 420.0,
        "rollbackGpuHours": pytest.approx(420 / 3600)}
    assert incident_cost.rollback(21, {}) == {"stepsAtRisk": 21}
    assert incident_cost.rollback(None, {"step_seconds": 2.5, "world_size": 8}) == {"stepSeconds": 2.5, "worldSize": 8}


def test_a_false_positive_is_every_replacement_denied_after_a_passed_health_check():
    passed = {"phase": "Denied", "healthCheck": {"result": "Passed"}}
    assert incident_cost.denied_after_passed_check(passed)
    assert not incident_cost.denied_after_passed_check({"phase": "Denied", "healthCheck": {"result": "Failed"}})
    assert not incident_cost.denied_after_passed_check({"phase": "Denied", "healthCheck": {"result": "Skipped"}})
    assert not incident_cost.denied_after_passed_check({"phase": "Replaced", "healthCheck": {"result": "Passed"}})
    assert incident_cost.false_positive({"n1": "Denied", "n2": "Denied"}, ["n1", "n2"])
    assert not incident_cost.false_positive({"n1": "Denied", "n2": "Replaced"}, ["n1"])  # a node was replaced
    assert not incident_cost.false_positive({"n1": "Denied", "n2": "Denied"}, ["n1"])  # n2's check did not pass
    assert not incident_cost.false_positive({}, [])  # nothing was investigated


# -- sdcguard report (pure part) ---------------------------------------------------------------------------

def rank_stats(rank, premium_seconds, **extra):
    checks = {k: {"runs": r, "seconds_each": e, "premium": p, "seconds": s} for k, r, e, p, s in (
        ("ordinary", 100, 0.01, 0.01, 1.0), ("audit", 10, 0.5, 0.05, 5.0), ("weights", 10, 0.02, 0.002, 0.2))}
    return {"schema": "sdcguard.dev/stats/v1", "rank": rank, "steps": 100, "alarms": 0,
            "checks": {"replay": {"runs": 10, "seconds": 4.0}},
            "audit_schedule": {"mode": "budget", "interval": 10, "reason": "the shortest interval whose premium fits",
                               "max_overhead": 0.1},
            "cost": {"step_time_s": 1.0, "checked_step_s": 1.062, "world_size": 8, "checks": checks,
                     "premium": 0.062, "premium_seconds": premium_seconds}, **extra}


def test_the_summary_extrapolates_a_pods_ranks_to_the_job_and_adds_the_rollbacks():
    alarm = record(steps_at_risk=36, step_seconds=1.25, world_size=8)
    old = {**record(), "id": "old-1"}
    s = run_cost.summarize([rank_stats(0, 6.2), rank_stats(1, 6.2)], [alarm, old])
    assert (s["ranks"], s["world_size"], s["steps"]) == ([0, 1], 8, 100)
    assert s["checks"]["audit"] == {"runs": 10, "seconds_each": 0.5, "premium": 0.05}
    assert s["premium"] == pytest.approx(0.062) and s["audit_schedule"]["interval"] == 10
    # premium: 6.2 s on each of the 2 ranks here, 8 ranks in the job: 49.6 GPU-s; waste 36 x 1.25 x 8 = 360 GPU-s
    assert s["cost"]["premium_gpu_hours"] == pytest.approx(49.6 / 3600)
    assert s["cost"]["rollback_gpu_hours"] == pytest.approx(0.1) and s["cost"]["rollbacks_unknown"] == 1
    assert s["cost"]["fraction_of_run"] == pytest.approx((49.6 + 360) / (100 * 1.0 * 8))
    text = run_cost.render_text(s)
    assert "every 10 steps, budget (integrity budget 10%): the shortest interval" in text
    assert "36 steps at risk x 1.25e+03 ms x 8 ranks" in text and "rollback waste unknown" in text


def test_a_directory_without_statistics_is_an_error(tmp_path):
    with pytest.raises(run_cost.SpoolError, match="holds no statistics"):
        run_cost.read_spool(tmp_path)
    done = subprocess.run([sys.executable, "-m", "sdcguard.cli", "report", str(tmp_path / "nowhere")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "is not a directory" in done.stderr


# -- end to end: a real run's spool ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def drilled(tmp_path_factory):
    """A 2-rank drill: audits every 3 steps, check 3 every 2, checkpoints every 4; a weight bit flip on
    rank 1 at step 7 is caught at step 8 (stop mode). Its spool: both ranks' statistics and the alarm."""
    out = tmp_path_factory.mktemp("cost")
    proc = subprocess.run(
        [sys.executable, "-m", "sdcguard.cli", "drill", "--nodes", "2", "--ranks-per-node", "1", "--steps", "12",
         "--audit-every", "3", "--weight-check-every", "2", "--checkpoint-every", "4",
         "--inject", "weight-bitflip:rank=1:step=7", "--report", str(out / "report.json"), "--spool",
         str(out / "spool")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out / "spool"


def report(spool, *args):
    done = subprocess.run([sys.executable, "-m", "sdcguard.cli", "report", str(spool), *args],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.multiprocess
@pytest.mark.slow  # a real drill's spool: make test-slow
def test_sdcguard_report_on_a_real_runs_spool(drilled):
    summary = json.loads(report(drilled, "-o", "json"))
    assert summary["ranks"] == [0, 1] and summary["world_size"] == 2 and summary["steps"] == 8
    checks = summary["checks"]
    # steps 0..7 ended: audits at 0, 3, 6; weight checks (no audit) at 2, 4; checks 1 and 4 on all 8
    assert (checks["ordinary"]["runs"], checks["audit"]["runs"], checks["weights"]["runs"]) == (8, 3, 2)
    assert all(checks[k]["seconds_each"] > 0 and checks[k]["premium"] > 0 for k in ("ordinary", "audit", "weights"))
    assert summary["premium"] == pytest.approx(sum(c["premium"] for c in checks.values()))
    assert 0 < summary["step_time_s"] < summary["checked_step_s"]
    assert summary["audit_schedule"]["mode"] == "fixed" and summary["audit_schedule"]["interval"] == 3
    [alarm] = summary["alarms"]
    # caught at step 8; the last good checkpoint is step 4's: 4 steps at risk on 2 ranks
    assert (alarm["check"], alarm["step"], alarm["steps_at_risk"], alarm["drill"]) == ("weights", 8, 4, True)
    waste = alarm["rollback"]
    assert waste["world_size"] == 2 and waste["gpu_seconds"] == pytest.approx(4 * waste["step_seconds"] * 2, abs=1e-6)
    total = summary["cost"]
    assert total["gpu_hours"] == pytest.approx(total["premium_gpu_hours"] + total["rollback_gpu_hours"], abs=1e-8)
    assert total["rollback_gpu_hours"] == pytest.approx(waste["gpu_hours"], abs=1e-8) and total["premium_gpu_hours"] > 0
    text = report(drilled)
    for line in ("steps run: 8", "ordinary checks (1, 4; every step)", "audits (checks 2, 3)",
                 "weight checks (3, after an update)", "total premium", "audit interval: every 3 steps, fixed",
                 "4 steps at risk x", "cost of this integrity-checked run"):
        assert line in text, (line, text)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_sidecar_exports_the_measured_premium_of_a_real_run(drilled):
    registry = CollectorRegistry()
    registry.register(RankStatsCollector(drilled))
    stats = json.loads((drilled / "stats" / "rank-1.json").read_text())["cost"]
    for kind in ("ordinary", "audit", "weights"):
        assert registry.get_sample_value("sdcguard_check_premium_ratio", {"rank": "1", "kind": kind}) == \
            stats["checks"][kind]["premium"]
        assert registry.get_sample_value("sdcguard_check_premium_seconds", {"rank": "1", "kind": kind}) == \
            stats["checks"][kind]["seconds"]
    assert registry.get_sample_value("sdcguard_step_time_seconds", {"rank": "1"}) == stats["step_time_s"]
    assert registry.get_sample_value("sdcguard_checked_step_seconds", {"rank": "1"}) == stats["checked_step_s"]
    assert registry.get_sample_value("sdcguard_audit_interval", {"rank": "0"}) == 3.0


# -- the operator: an incident's cost, and a false positive ------------------------------------------------

@pytest.mark.emulator
@pytest.mark.operator
def test_an_incident_records_its_rollback_and_a_denial_after_a_passed_check_is_a_false_positive(world):
    from conftest import make_alarm, metric, phase, start_training

    ns = "cost"
    _, nodes, pods = start_training(world, ns, n_nodes=2)
    waste_before = metric(world, 'sdcguard_rollback_gpu_seconds_total{check="replay"}')
    false_before = metric(world, "sdcguard_false_positive_investigations_total")
    world.alarm_event(ns, make_alarm(ns, "llm", step=40, suspects=[(1, pods[1], nodes[1])],
                                     reporter=(0, pods[0], nodes[0]), last_good_checkpoint_step=19,
                                     steps_at_risk=21, step_seconds=2.5, world_size=8))
    world.wait(lambda: phase(world, nodes[1]) == "PendingApproval", what="PendingApproval")
    assert world.replacement(nodes[1])["status"]["healthCheck"]["result"] == "Passed"
    status = world.incident(ns, "llm-replay-40")["status"]
    assert status["cost"] == {"stepsAtRisk": 21, "stepSeconds": 2.5, "worldSize": 8, "rollbackGpuSeconds": 420.0,
                              "rollbackGpuHours": pytest.approx(420 / 3600)}
    assert metric(world, 'sdcguard_rollback_gpu_seconds_total{check="replay"}') == waste_before + 420.0
    deny = world.kubectl("sdcguard", "deny", nodes[1], "--reason", "health check passed; evidence thin")
    assert deny.returncode == 0, deny.stderr
    world.wait(lambda: world.incident(ns, "llm-replay-40")["status"].get("phase") == "Resolved", what="resolved")
    status = world.incident(ns, "llm-replay-40")["status"]
    assert status["cost"]["deniedAfterPassedCheck"] == [nodes[1]] and status["cost"]["falsePositive"] is True
    assert status["cost"]["rollbackGpuSeconds"] == 420.0  # the merge kept what the opening wrote
    world.wait(lambda: metric(world, "sdcguard_false_positive_investigations_total") == false_before + 1,
               what="false positive counted")
