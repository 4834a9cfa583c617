"""Alarm reporting (sdcguard.reporting): the record every rank raises, spooled by the reporting
rank, which waits (bounded) for the sidecar's confirmation before the exception leaves."""
import pytest
import torch
from torch import nn

import sdcguard
from sdcguard.config import Config


def make(**cfg):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, sdcguard.Guard(model, opt, lambda m, b: m(b).sum(), config=Config(**cfg))


def test_a_drill_record_says_so_and_carries_the_identities_it_was_given(tmp_path):
    from sdcguard.checks.verdict import Verdict
    from sdcguard.contract import spool

    job = {"kind": "PyTorchJob", "name": "llm", "namespace": "ml", "uid": "u-1"}
    _, _, guard = make(spool=str(tmp_path), job=job, pod="llm-worker-0", node="n1", pod_uid="p-1", drill=True,
                       publish_wait_seconds=0)
    with pytest.raises(sdcguard.SDCDetected) as err:
        guard.reporter.raise_alarm(3, Verdict("weights", suspects=[0]), guard.history)
    record = err.value.alarm
    assert record["drill"] is True and record["job"]["uid"] == "u-1"
    [suspect] = record["suspects"]  # and its GPU where known (docs/design.md §10)
    assert {k: v for k, v in suspect.items() if k != "gpu"} == {"rank": 0, "pod": "llm-worker-0", "node": "n1",
                                                                 "pod_uid": "p-1"}
    assert [p.name for p in spool.list_alarms(tmp_path)] and guard.alarms_raised == 1


def test_an_alarm_waits_for_the_sidecars_confirmation(tmp_path):
    # The exception must not leave (and end the pod, spool and all) before the sidecar confirms
    # that the Event exists: here a stand-in sidecar moves the record to published/ after 0.5 s.
    import threading
    import time

    from sdcguard.checks.verdict import Verdict
    from sdcguard.contract import spool

    job = {"kind": "PyTorchJob", "name": "llm", "namespace": "ml"}
    _, _, guard = make(spool=str(tmp_path), job=job)
    assert guard.config.publish_wait() == spool.PUBLISH_WAIT_SECONDS

    def sidecar():
        while not spool.list_alarms(tmp_path):
            time.sleep(0.05)
        time.sleep(0.5)
        [record] = spool.list_alarms(tmp_path)
        (tmp_path / spool.PUBLISHED_DIR).mkdir(exist_ok=True)
        record.rename(tmp_path / spool.PUBLISHED_DIR / record.name)

    thread = threading.Thread(target=sidecar)
    thread.start()
    started = time.monotonic()
    with pytest.raises(sdcguard.SDCDetected) as err:
        guard.reporter.raise_alarm(3, Verdict("weights", suspects=[0]), guard.history)
    thread.join()
    assert time.monotonic() - started >= 0.5
    assert spool.published(tmp_path, err.value.alarm["id"])


def test_an_unconfirmed_alarm_is_raised_after_the_bound(tmp_path):
    import time

    from sdcguard.checks.verdict import Verdict

    _, _, guard = make(spool=str(tmp_path), job={"kind": "PyTorchJob", "name": "llm", "namespace": "ml"},
                       publish_wait_seconds=0.3)
    started = time.monotonic()
    with pytest.raises(sdcguard.SDCDetected):
        guard.reporter.raise_alarm(3, Verdict("weights", suspects=[0]), guard.history)
    assert 0.3 <= time.monotonic() - started < 5
    # outside a Kubernetes job (no sidecar) nothing waits
    _, _, local = make(spool=str(tmp_path))
    assert local.config.publish_wait() == 0.0


def test_an_alarm_carries_the_measured_step_time_and_the_ranks_for_its_rollback_cost(tmp_path):
    from sdcguard.checks.verdict import Verdict
    from sdcguard.contract.alarm import Alarm

    _, _, guard = make(spool=str(tmp_path), publish_wait_seconds=0)
    with pytest.raises(sdcguard.SDCDetected) as err:  # nothing measured yet: no step time, never a guess
        guard.reporter.raise_alarm(0, Verdict("weights", suspects=[0]), guard.history)
    assert "step_seconds" not in err.value.alarm and err.value.alarm["world_size"] == 1
    _, _, guard = make(spool=str(tmp_path), publish_wait_seconds=0)
    for step in range(4):
        guard.train_step(step, torch.randn(8, 4))
    cost = guard.stats.cost()
    with pytest.raises(sdcguard.SDCDetected) as err:
        guard.reporter.raise_alarm(4, Verdict("weights", suspects=[0]), guard.history)
    typed = Alarm.parse(err.value.alarm)
    assert typed.world_size == 1 and typed.step_seconds == pytest.approx(cost["checked_step_s"], rel=0.5)
    assert 0 < cost["step_time_s"] <= typed.step_seconds and typed.steps_at_risk == 5
