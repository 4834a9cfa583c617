"""Approval of a NodeReplacement (operator/approval.py): Approved and Denied, one-way, acted on only once the
health check is done; Denied first, and terminal.

On the shared world (tests/conftest.py): decisions made with ``kubectl sdcguard`` and plain
``kubectl patch``, through the operator's admission webhook. Who may decide, and what admission
refuses, is tests/test_admission.py.
"""
from __future__ import annotations

import json

import pytest
from conftest import make_alarm, phase, start_training

pytestmark = [pytest.mark.emulator, pytest.mark.operator]


def test_deny_with_plain_kubectl_patch_uncordons(world):
    ns = "deny"
    ids, nodes, pods = start_training(world, ns)
    world.alarm_event(ns, make_alarm(ns, "llm", check="weights", step=7, suspects=[(2, pods[2], nodes[2])],
                                     drill=True))  # issue 19: a drill's alarm is acted on, and shown as one
    world.wait(lambda: phase(world, nodes[2]) == "PendingApproval", what="PendingApproval")
    assert world.incident(ns, "llm-weights-7")["spec"]["drill"] is True
    assert world.incident(ns, "llm-weights-7")["status"]["timeline"][0]["message"].startswith("drill weights alarm")
    assert world.node_state(nodes[2]) == (True, "true")
    status = world.incident(ns, "llm-weights-7")["status"]  # a record from an older library: no guesses
    assert status["suspectWindow"] == {"firstStep": 7, "lastStep": 7, "range": "7-7"}
    assert status["resumeFrom"] == "checkpoint-19.pt"
    assert "resumeFromStep" not in status and "stepsAtRisk" not in status  # null in a merge patch: absent
    patch = world.kubectl("patch", "nodereplacement", nodes[2], "--type=merge",
                          "-p", json.dumps({"spec": {"decision": "Denied"}}))
    assert patch.returncode == 0, patch.stderr
    world.wait(lambda: phase(world, nodes[2]) == "Denied", what="Denied")
    assert world.node_state(nodes[2]) == (False, None)
    nrep = world.replacement(nodes[2])
    assert nrep["status"]["decision"]["decision"] == "Denied"
    assert nrep["status"]["decision"]["by"] == "tester"  # a plain patch is attributed all the same
    assert world.aws.calls("BatchReplaceClusterNodes", ids[2]) == []
    # one-way: a later Approved is refused at admission
    again = world.kubectl("patch", "nodereplacement", nodes[2], "--type=merge", "-p", '{"spec":{"decision":"Approved"}}')
    assert again.returncode != 0 and "spec.decision is final: Denied cannot become Approved" in again.stderr
    assert world.replacement(nodes[2])["spec"]["decision"] == "Denied"
    world.wait(lambda: phase(world, nodes[2]) == "Denied", what="still Denied")
    assert world.aws.calls("BatchReplaceClusterNodes", ids[2]) == []


def test_early_approval_waits_for_the_health_check(world):
    ns = "early"
    ids, nodes, pods = start_training(world, ns, n_nodes=2)
    world.aws.script(ids[1], health_polls=6)
    world.alarm_event(ns, make_alarm(ns, "llm", suspects=[(1, pods[1], nodes[1])], reporter=(0, pods[0], nodes[0])))
    world.wait(lambda: (world.replacement(nodes[1]).get("status") or {}).get("healthCheck", {}).get("requestedAt"),
               what="health check requested")
    assert world.kubectl("sdcguard", "approve", nodes[1]).returncode == 0
    world.wait(lambda: phase(world, nodes[1]) == "Replaced", what="Replaced")
    timeline = [t["event"] for t in world.replacement(nodes[1])["status"]["timeline"]]
    assert timeline.index("HealthCheckPassed") < timeline.index("Approved") < timeline.index("ReplaceRequested"), \
        timeline
    assert world.replacement(nodes[1])["status"]["decision"]["by"] == "tester"
    assert len(world.aws.calls("BatchReplaceClusterNodes", ids[1])) == 1
