"""The integrity budget (``Config(max_overhead=..., max_audit_interval=...)``, ``sdcguard.budget``):
the interval is a pure function of the measured costs, kept within the cap, agreed by every rank,
and adds nothing to an ordinary step. The multi-process part runs tests/budget_worker.py (2 gloo
ranks)."""
import json
import math
import os
import random
import subprocess
import sys
from dataclasses import astuple
from pathlib import Path

import pytest
import torch
from torch import nn

import sdcguard
from sdcguard.budget import (
    AUDIT_WINDOW, Budget, Measurement, Sample, choose_interval, estimate, explain, premium, starting_interval,
)
from sdcguard.config import Config
from sdcguard.contract.stats import CheckStats

HERE = Path(__file__).parent


# -- choose_interval: pure -------------------------------------------------------------------------

def test_the_shortest_interval_whose_premium_fits():
    # 1 ms of checks on a 100 ms step leaves 2 ms a step of a 3% budget for audits of 100 ms: every 50
    assert choose_interval(0.001, 0.100, 0.100, 0.03, 1000) == 50
    assert premium(0.001, 0.100, 0.100, 50) <= 0.03 < premium(0.001, 0.100, 0.100, 49)


def test_never_beyond_the_cap_never_below_one():
    assert choose_interval(0.001, 0.100, 0.100, 0.03, 20) == 20  # 50 needed: the detection-latency cap wins
    assert choose_interval(0.001, 0.100, 0.100, 1e-9, 20) == 20  # nothing fits
    assert choose_interval(0.001, 0.100, 0.100, 1e6, 20) == 1  # everything fits
    assert choose_interval(0.050, 0.100, 0.100, 0.03, 20) == 20  # the ordinary checks alone are over budget
    assert choose_interval(0.001, 0.0, 0.100, 0.03, 20) == 1  # an audit that costs nothing
    assert choose_interval(-0.001, -1.0, 0.100, 0.03, 20) == 1  # negative costs count as 0
    assert choose_interval(0.001, 0.100, 0.100, 0.03, 1) == 1


@pytest.mark.parametrize("bad", [
    (math.nan, 0.1, 0.1), (0.001, math.inf, 0.1), (0.001, 0.1, 0.0), (0.001, 0.1, -1.0), (0.001, 0.1, math.nan),
])
def test_figures_that_are_no_measurement_give_the_cap(bad):
    assert choose_interval(*bad, 0.03, 7) == 7


@pytest.mark.parametrize("cap", [0, -3, 2.5, None])
def test_the_cap_is_an_integer_of_at_least_one(cap):
    with pytest.raises(ValueError, match="cap must be an integer >= 1"):
        choose_interval(0.001, 0.1, 0.1, 0.03, cap)


def test_every_choice_is_the_smallest_that_fits_or_the_cap():
    rng = random.Random(34)
    for _ in range(5000):
        o, a, s = rng.uniform(0, 0.02), rng.choice([0.0, rng.uniform(0, 1.0)]), rng.uniform(0.001, 1.0)
        budget, cap = rng.choice([1e-6, rng.uniform(0.001, 0.5), 10.0]), rng.randint(1, 2000)
        k = choose_interval(o, a, s, budget, cap)
        assert 1 <= k <= cap and k == choose_interval(o, a, s, budget, cap)  # bounded, deterministic
        fits = premium(o, a, s, k) <= budget * (1 + 1e-12)
        assert fits or k == cap or (a == 0 and k == 1), (o, a, s, budget, cap, k)  # free audits: every step
        if k > 1 and fits:  # one shorter would not fit
            assert premium(o, a, s, k - 1) > budget * (1 - 1e-12), (o, a, s, budget, cap, k)
        # a larger budget never asks for rarer audits
        assert choose_interval(o, a, s, budget * 2, cap) <= k


# -- estimate and explain ------------------------------------------------------------------------------

def test_the_estimate_from_samples():
    # ordinary steps: 1 ms of checks on 11 ms (a check-3 step 3 ms on 13 ms: its mean counts, the
    # median plain time ignores the 100 ms pause of an evaluation); audits: 6 ms of phases, 12 ms
    # outside them (2 ms of determinism and recording beyond the 10 ms plain step)
    ordinary = [Sample(0.001, 0.011)] * 3 + [Sample(0.003, 0.013), Sample(0.001, 0.101)]
    m = estimate(ordinary, [Sample(0.006, 0.018), Sample(0.006, 0.018)])
    assert astuple(m) == pytest.approx((0.0014, (0.006 - 0.0014) + 0.002, 0.010), rel=1e-9)
    assert estimate(ordinary, []) is None  # no audit measured yet: no opinion
    # every step audited: the audit steps stand for both
    assert astuple(estimate([], [Sample(0.006, 0.016)])) == pytest.approx((0.0, 0.006, 0.010))


def test_the_reason_says_what_decided():
    m = Measurement(0.001, 0.100, 0.100)
    assert explain(m, 0.03, 1000, 50).startswith("the shortest interval whose premium fits the budget; premium 3%")
    assert explain(m, 0.03, 20, 20).startswith("the budget would need audits rarer than every 20 steps")
    assert explain(m, 1e6, 20, 1).startswith("auditing every step fits the budget")
    assert explain(Measurement(0.05, 0.1, 0.1), 0.03, 20, 20).startswith("the ordinary checks alone cost 50%")
    assert "this rank alone would audit every 50" in explain(m, 0.03, 1000, 60)
    assert explain(None, 0.03, 1000, 60).startswith("no measurement yet")


# -- the Budget on one rank (no collective with one rank) -----------------------------------------------

def budget(**cfg):
    stats = CheckStats({"rank": 0}, None)
    config = Config(max_overhead=0.03, max_audit_interval=100, **cfg)
    return Budget(config, stats, torch.device("cpu"), None, world_size=1, rank=0), stats


def test_it_starts_at_audit_every_within_the_cap():
    assert starting_interval(Config(max_overhead=0.03, max_audit_interval=100)) == 100  # the default audit_every
    assert starting_interval(Config(max_overhead=0.03, max_audit_interval=40, audit_every=500)) == 40
    assert starting_interval(Config(max_overhead=0.03, max_audit_interval=40, audit_every=5)) == 5
    b, stats = budget(audit_every=10)
    assert b.interval == 10 and stats.audit_schedule["mode"] == "budget"
    assert stats.as_dict()["audit_schedule"]["interval"] == 10


def step(b, audit, weights=False):
    """One step as the Guard measures it: the meter's sample, then the budget's decision."""
    b.meter.begin(audit)
    b.meter.ended(weights)
    b.ended(0)


def test_decisions_come_only_after_audit_steps_and_say_why():
    b, stats = budget(audit_every=10)
    for _ in range(1, 10):  # ordinary steps: measured, never decided
        b.meter.begin(audit=False)
        stats.timed("nonfinite", stats_clock(stats, 0.0))
        b.meter.ended()
        b.ended(_)
    assert b.decisions == 0 and b.interval == 10
    b.meter.ordinary.clear()
    b.meter.ordinary.extend([Sample(0.001, 0.101)] * 20)
    b.meter.audits.extend([Sample(0.101, 0.201)] * AUDIT_WINDOW)
    b.meter.interrupted()  # this audit step itself gives no sample: the figures above decide
    b.meter.begin(audit=True)
    b.meter.ended()
    b.ended(10)
    assert b.decisions == 1 and b.decided_at == 10 and b.interval == 50
    schedule = stats.as_dict()["audit_schedule"]
    assert schedule["interval"] == 50 and schedule["changes"] == 1 and schedule["wanted_here"] == 50
    assert schedule["reason"].startswith("the shortest interval whose premium fits the budget")
    assert schedule["measured_here"]["ordinary_cost_s"] == pytest.approx(0.001)


def test_without_a_measurement_the_interval_stays():
    b, _ = budget(audit_every=10)
    step(b, audit=True)  # the first step a Guard sees gives no sample
    assert b.decisions == 1 and b.interval == 10 and b.wanted is None


def test_a_failed_step_gives_no_sample():
    b, _ = budget(audit_every=10)
    step(b, audit=False)
    step(b, audit=False)
    assert len(b.meter.ordinary) == 1
    b.meter.interrupted()
    step(b, audit=False)  # spans the failed step 3: not a sample
    assert len(b.meter.ordinary) == 1 and b.meter.steps["ordinary"] == 3 and b.meter.sampled["ordinary"] == 1


def test_the_decision_counts_in_the_audit_step_that_made_it():
    b, _ = budget(audit_every=10)
    step(b, audit=False)
    step(b, audit=True)
    [audit] = b.meter.audits
    assert b.decisions == 1 and b.meter.own["audit"] == pytest.approx(audit.checks) and audit.checks > 0


def stats_clock(stats, seconds):
    import time
    return time.perf_counter() - seconds


def test_a_single_process_guard_never_audits_under_a_budget():
    model = nn.Linear(4, 1)
    guard = sdcguard.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, b: m(b).sum(),
                           config=Config(max_overhead=0.03, max_audit_interval=10))
    assert guard.budget is None and not any(guard.is_audit_step(s) for s in range(20))
    assert guard.stats.as_dict()["audit_schedule"] == {"mode": "fixed", "interval": 0}


# -- two ranks -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("budget")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(HERE / "budget_worker.py"), str(out)],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr

    def result(name):
        return [json.loads((out / f"{name}-rank{r}.json").read_text()) for r in range(2)]
    return result


@pytest.mark.multiprocess
@pytest.mark.parametrize("name, interval", [("tight", 6), ("loose", 1)])
def test_the_interval_adapts_the_same_on_every_rank_without_alarm(run, name, interval):
    ranks = run(name)
    # equal on every rank, step by step; no alarm; a decision at each audit
    assert ranks[0]["steps"] == ranks[1]["steps"]
    assert all(r["alarms"] == 0 and r["stats"]["alarms"] == 0 for r in ranks)
    steps = ranks[0]["steps"]
    # it starts every 3 (audit_every), the first audit (step 0) has nothing measured, the second
    # (step 3) decides: to the cap (nothing fits a budget of 1e-9) or to 1 (everything fits 1e6)
    assert [s["interval"] for s in steps[:3]] == [3, 3, 3]
    assert all(s["interval"] == interval for s in steps[3:])
    audited = [s["step"] for s in steps if s["audit"]]
    expected = [0, 3] + [s for s in range(4, 20) if s % interval == 0]
    assert audited == expected
    # the audits that ran are what the history records (the suspect windows follow them)
    assert all(s["last_audited"] == max(a for a in audited if a <= s["step"]) for s in steps)
    for r in ranks:
        schedule = r["stats"]["audit_schedule"]
        assert schedule["mode"] == "budget" and schedule["interval"] == interval
        assert schedule["max_audit_interval"] == 6 and schedule["changes"] == 1
        assert schedule["decisions"] == len(audited) and schedule["reason"]
        assert r["stats"]["checks"]["replay"]["runs"] == len(audited)


@pytest.mark.multiprocess
def test_the_budget_adds_nothing_to_an_ordinary_step_and_8_bytes_to_an_audit(run):
    for r in run("count"):
        ordinary, audit = r["summary"]["ordinary"], r["summary"]["audit"]
        # counted with bench/step_account.py's counting: identical ordinary steps with and without
        for metric in ("sync", "coll", "op"):
            assert ordinary["budget"].get(metric) == ordinary["fixed"].get(metric), metric
        # an audit step: the decision's one 8-byte all-reduce and its one host read
        extra = {k: v - audit["fixed"]["coll"].get(k, 0) for k, v in audit["budget"]["coll"].items()}
        assert {k: v for k, v in extra.items() if v} == {"allreduce_ 8 B": 1}
        syncs = sum(audit["budget"]["sync"].values()) - sum(audit["fixed"]["sync"].values())
        assert syncs == 1
        assert r["decisions"] == 6  # the audit steps 1, 3, 5, 7, 9, 11
