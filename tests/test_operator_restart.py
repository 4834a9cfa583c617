"""Restart safety: the operator is SIGKILLed after every phase (and twice while an AWS call is in
flight) and started again; the flow completes and every AWS action happens exactly once, counted
by the local SageMaker endpoint itself.
"""
from __future__ import annotations

import time

import pytest
from conftest import dump, make_alarm, new_instance

pytestmark = [pytest.mark.emulator, pytest.mark.operator]


def test_killed_after_every_phase_repeats_no_aws_call(make_world):
    world = make_world(start=False, SDCGUARD_POLL_SECONDS="0.4")
    ns = "restart"
    ids = [new_instance() for _ in range(3)]
    nodes = [world.node(i) for i in ids]
    pods = world.training(ns, "llm", nodes)
    suspect, instance = nodes[2], ids[2]
    # Slow answers hold each AWS call in flight long enough to kill the operator mid-call.
    world.aws.script(instance, health_polls=3, health_delay=2.5, replace_polls=3, replace_delay=2.5)

    def restart(after: str) -> None:
        world.kill_operator()
        kills.append(after)
        world.start_operator()

    def nrep() -> dict:
        return world.replacement(suspect).get("status") or {}

    kills: list[str] = []
    world.start_operator()
    world.alarm_event(ns, make_alarm(ns, "llm", step=60, suspects=[(2, pods[2], suspect)],
                                     reporter=(0, pods[0], nodes[0])))

    world.wait(lambda: world.incidents(ns), what="incident")
    restart("incident opened")
    world.wait(lambda: world.node_state(suspect) == (True, "true"), what="cordon")
    restart("node cordoned")
    world.wait(lambda: world.aws.calls("StartClusterHealthCheck", instance), what="health check call in flight")
    restart("StartClusterHealthCheck in flight")  # the call took effect, its answer never arrived
    world.wait(lambda: nrep().get("healthCheck", {}).get("requestedAt"), what="health check recorded")
    restart("health check requested")
    world.wait(lambda: nrep().get("phase") == "PendingApproval", what="PendingApproval")
    world.kill_operator()
    approve = world.kubectl("sdcguard", "approve", suspect, "--reason", "approved while the operator was down")
    assert approve.returncode == 0, approve.stderr
    world.start_operator()
    world.wait(lambda: world.aws.calls("BatchReplaceClusterNodes", instance), what="replace call in flight")
    restart("BatchReplaceClusterNodes in flight")
    world.wait(lambda: nrep().get("phase") in ("Replacing", "Replaced"), what="Replacing")  # 3 polls: may be past it
    restart("replacing")
    world.wait(lambda: nrep().get("phase") == "Replaced", what="Replaced")
    restart("replaced")
    # The last kill may fall between the replacement's Replaced and its note to the incident: the
    # restarted operator makes it up when it resumes the incident (once it holds the Lease).
    world.wait(lambda: (world.incidents(ns)[0].get("status") or {}).get("phase") == "Resolved",
               what="incident resolved after the last restart")
    time.sleep(3)  # let the last operator resume everything it would resume

    assert len(kills) == 7
    health = world.aws.calls("StartClusterHealthCheck", instance)
    replaces = world.aws.calls("BatchReplaceClusterNodes", instance)
    assert [c["outcome"] for c in health] == ["ok"], health
    assert [c["outcome"] for c in replaces] == ["ok"], replaces
    status = nrep()
    assert status["phase"] == "Replaced"
    assert status["replace"].get("recovered") is True  # found in progress instead of called again
    assert status["decision"]["reason"] == "approved while the operator was down"
    events = [t["event"] for t in status["timeline"]]
    assert events.count("HealthCheckRequested") == 1 and events.count("ReplaceRequested") == 1, events
    incident = world.incidents(ns)
    assert len(incident) == 1
    timeline = [t["event"] for t in incident[0]["status"]["timeline"]]
    assert timeline.count("Opened") == 1 and timeline.count("NodeCordoned") == 1, timeline
    assert timeline.count("ReplacementCreated") == 1, dump(incident[0]["status"])
    assert incident[0]["status"]["phase"] == "Resolved"
    assert world.node_state(nodes[0]) == (False, None) and world.node_state(nodes[1]) == (False, None)
