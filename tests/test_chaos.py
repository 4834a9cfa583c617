"""The chaos soak's short CI variant (bench/chaos_soak.py has the long one and its invariants):
two operator replicas SIGKILLed at random, API faults (500/409/429, stalls) and SageMaker faults
(throttling, InternalServerError before and after the effect, timeouts) while signed and invalid
alarms stream in; zero invariant violations and convergence once the faults stop. Its deep health
checks end at once (the long soak's last 15 s, as a real one outlasts a fail-over), which keeps it
short; see bench/RESULTS.md for what each setting has shown."""
from __future__ import annotations

import pathlib
import sys

import pytest

pytestmark = [pytest.mark.emulator, pytest.mark.operator]

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))


@pytest.mark.slow  # a 30 s soak: in make test-slow, which CI runs too
def test_chaos_soak_short(tmp_path: pathlib.Path) -> None:
    import chaos_soak

    figures = chaos_soak.soak(tmp_path, seconds=25, jobs=2, suspects=3, seed=7, api_fault_rate=0.08,
                              aws_fault_rate=0.25, kill_every=(3.0, 6.0), converge_timeout=90,
                              health_seconds=0.0)
    summary = figures.summary()
    print(summary)
    assert figures.violations == [], "\n".join(figures.violations)
    assert figures.kills >= 3 and summary["api_faults_total"] >= 10 and figures.aws_faults >= 1, summary
    assert figures.alarms_valid == 6 and figures.alarms_invalid >= 2
    assert figures.max_suspect_nodes <= chaos_soak.MAX_SUSPECTS
