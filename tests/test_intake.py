"""Alarm intake (operator/intake.py): an alarm Event becomes an SDCIncident, or is rejected and touches nothing.

On the shared world (tests/conftest.py): the real operator, real kubectl and kubernetes client
against the Kubernetes emulator; every alarm Event is signed with its job's key unless the case
says otherwise. How duplicates of one fault join one incident is tests/test_incident.py; the
checks behind each rejection one by one, tests/test_validate.py and tests/test_tenant_boundary.py.
"""
from __future__ import annotations

import json
import secrets

import pytest
from conftest import make_alarm, metric, start_training

from sdcguard.contract import alarm, events

pytestmark = [pytest.mark.emulator, pytest.mark.operator]


def _tampered(world, ns, pods, nodes):
    """A genuinely signed alarm whose text was changed afterwards (a healthy node named instead)."""
    signed = alarm.dumps(make_alarm(ns, "llm", suspects=[(1, pods[1], nodes[1])]))
    signature = events.alarm_signature(world.alarm_key(ns, "llm"), signed)
    return {"raw": signed.replace(nodes[1], nodes[0]).replace(pods[1], pods[0]), "signature": signature}


def _with_pod_uid(record):
    """A pod uid the library would have signed (the pod is gone since)."""
    record["suspects"][0]["pod_uid"] = "0000dead-0000-4000-8000-000000000000"
    return record


REJECTIONS = {  # case -> kwargs of world.alarm_event; the reason is the case up to its first "-"
    "MalformedAlarm": lambda world, ns, pods, nodes: {"raw": "{not json"},
    "UnsupportedSchema": lambda world, ns, pods, nodes: {"raw": json.dumps(
        {**make_alarm(ns, "llm", suspects=[(1, pods[1], nodes[1])]), "schema": "sdcguard.dev/alarm/v9"})},
    "NodeMismatch": lambda world, ns, pods, nodes: {"record": make_alarm(ns, "llm", suspects=[(1, pods[1], nodes[0])])},
    "PodNotFound": lambda world, ns, pods, nodes: {"record": _with_pod_uid(make_alarm(
        ns, "llm", suspects=[(1, "llm-worker-9", nodes[1])]))},
    # the job was enabled once (its key Secret is still there), not any more
    "JobNotEnabled": lambda world, ns, pods, nodes: {"record": make_alarm(ns, "llm", suspects=[(1, pods[1], nodes[1])]),
                                                     "key": world.plant_key(ns, "llm")},
    "UnsignedAlarm": lambda world, ns, pods, nodes: {"record": make_alarm(ns, "llm", suspects=[(1, pods[1], nodes[1])]),
                                                     "sign": False},
    "BadSignature-wrong-key": lambda world, ns, pods, nodes: {
        "record": make_alarm(ns, "llm", suspects=[(1, pods[1], nodes[1])]), "key": secrets.token_bytes(32)},
    "BadSignature-tampered": _tampered,
}


@pytest.mark.parametrize("case", sorted(REJECTIONS))
def test_rejected_alarms_touch_nothing(world, case):
    reason = case.split("-")[0]
    ns = f"reject-{case.lower()}"
    ids, nodes, pods = start_training(world, ns, enabled=(reason != "JobNotEnabled"))
    sample = f'sdcguard_alarms_rejected_total{{reason="{reason}"}}'
    before = metric(world, sample)
    event = world.alarm_event(ns, **REJECTIONS[case](world, ns, pods, nodes))
    world.wait(lambda: world.event_annotation(ns, event), what="intake annotation")
    assert world.event_annotation(ns, event) == f"rejected:{reason}"
    assert world.incidents(ns) == []
    assert [world.node_state(n) for n in nodes] == [(False, None)] * 3
    assert not world.job_suspended(ns, "llm")
    assert world.wait(lambda: metric(world, sample) == before + 1, what="rejection metric")
    reports = world.wait(lambda: [e for e in world.core.list_namespaced_event(ns).items
                                  if e.reason == "AlarmRejected"], what="AlarmRejected Event")
    assert reason in reports[0].message and reports[0].type == "Warning"


def test_alarm_events_are_watched_with_a_server_side_field_selector(world):
    watches = [r for r in world.kube.emulator  # every request the emulator has served (kmock's view)
               if r.resource == "v1/events" and r.params.get("watch") in ("true", "True")]
    assert watches and all(r.params.get("fieldSelector") == "reason=SilentDataCorruption" for r in watches)
