"""NodeReplacement (operator/replacement.py): health check, the decision, BatchReplaceClusterNodes, each once.

The tests marked ``operator`` run the real operator (subprocess) against the Kubernetes emulator
and the local SageMaker endpoint, which counts every AWS action itself and can be scripted per
instance (slow answers, throttling, errors before or after the call takes effect). Most share the
session's world (tests/conftest.py); the restart test kills its own operator and builds its own.
"""
from __future__ import annotations

import datetime
import json
import time

import pytest
from sdcguard.contract import names
from conftest import (CLUSTER, GROUP, approved_replacement, dump, make_alarm, metric, new_instance, phase,
                      start_training)

pytestmark = [pytest.mark.emulator, pytest.mark.operator]


def test_failed_health_check_is_recorded(world):
    ns = "hcfail"
    ids, nodes, pods = start_training(world, ns)
    world.aws.script(ids[0], health="fail", health_polls=2)
    world.alarm_event(ns, make_alarm(ns, "llm", check="nonfinite-local", step=3, suspects=[(0, pods[0], nodes[0])],
                                     reporter=(1, pods[1], nodes[1])))
    world.wait(lambda: phase(world, nodes[0]) == "PendingApproval", what="PendingApproval")
    status = world.replacement(nodes[0])["status"]
    assert status["healthCheck"]["result"] == "Failed", dump(status)
    assert any(c["type"] == "HealthCheckPassed" and c["status"] == "False" for c in status["conditions"])
    # the incident reads the replacement's progress from its watch events: a moment later
    world.wait(lambda: "ReplacementHealthCheckFailed" in [
        t["event"] for t in world.incident(ns, "llm-nonfinite-local-3")["status"]["timeline"]], what="incident noted")


def test_pending_since_the_health_check_and_gone_once_it_moves_on(world):
    """The pending-approval gauge the PrometheusRule alerts on, computed from the object's status:
    the time the replacement entered PendingApproval, while it waits; no series once decided."""
    ns = "pending-gauge"
    ids, nodes, pods = start_training(world, ns, n_nodes=2)
    world.alarm_event(ns, make_alarm(ns, "llm", suspects=[(1, pods[1], nodes[1])], reporter=(0, pods[0], nodes[0])))
    world.wait(lambda: phase(world, nodes[1]) == "PendingApproval", what="PendingApproval")
    since = next(t["time"] for t in world.replacement(nodes[1])["status"]["timeline"]
                 if t["event"] == "HealthCheckPassed")
    expected = datetime.datetime.fromisoformat(since.replace("Z", "+00:00")).timestamp()
    sample = (f'sdcguard_replacement_pending_approval_timestamp_seconds'  # labels as exposed: sorted
              f'{{node="{nodes[1]}",nodereplacement="{nodes[1]}"}}')
    world.wait(lambda: metric(world, sample) == expected, what="the gauge at the time PendingApproval began")
    assert world.kubectl("sdcguard", "deny", nodes[1], "--reason", "false alarm").returncode == 0
    world.wait(lambda: phase(world, nodes[1]) == "Denied", what="Denied")
    # Denied is terminal (no more timer ticks): the series goes with the move itself
    world.wait(lambda: f'nodereplacement="{nodes[1]}"' not in world.metrics(), what="the series gone")


@pytest.mark.slow  # a world of its own: make test-slow
def test_a_phase_whose_watch_event_was_lost_still_resolves_the_incident(make_world):
    """The incident takes its replacements' phases from their watch events, in a handler kopf does
    not retry: with the incident's status writes refused while the denial lands, that one write
    was lost and the incident waited in AwaitingApproval for good (until an operator restart).
    Now a waiting incident re-reads its replacements every SDCGUARD_RESYNC_SECONDS (1 s here)."""
    world = make_world(SDCGUARD_RESYNC_SECONDS="1")
    ns = "lost-phase-event"
    ids, nodes, pods = start_training(world, ns, n_nodes=2)
    world.alarm_event(ns, make_alarm(ns, "llm", check="replay", step=21, suspects=[(1, pods[1], nodes[1])],
                                     reporter=(0, pods[0], nodes[0])))
    world.wait(lambda: phase(world, nodes[1]) == "PendingApproval", what="PendingApproval")
    status_path = f"/apis/{names.GROUP}/{names.VERSION}/namespaces/{ns}/{names.INCIDENTS}/llm-replay-21/status"
    world.wait(lambda: world.incident(ns, "llm-replay-21")["status"].get("phase") == "AwaitingApproval",
               what="AwaitingApproval")
    world.kube.reject("PATCH", status_path, 500, times=1000)
    try:
        assert world.kubectl("sdcguard", "deny", nodes[1], "--reason", "false alarm").returncode == 0
        world.wait(lambda: phase(world, nodes[1]) == "Denied", what="Denied")
        # the replacement's watch event was handled, and its write refused (not left for later)
        world.wait(lambda: world.kube.emulator.rejections_left.get(("PATCH", status_path), 1000) < 1000,
                   what="the incident's status write refused")
        time.sleep(0.5)
        assert world.incident(ns, "llm-replay-21")["status"]["phase"] == "AwaitingApproval"
    finally:
        world.kube.reject("PATCH", status_path, 500, times=0)
    world.wait(lambda: world.incident(ns, "llm-replay-21")["status"].get("phase") == "Resolved",
               what="the incident resolved by its resync", timeout=30)


@pytest.mark.parametrize("kind", ["throttle", "in-use", "not-found"])
def test_aws_errors_by_kind(world, kind):
    ns = f"aws-{kind}"
    ids, nodes, pods = start_training(world, ns, n_nodes=2)
    script = {"throttle": ["throttle", "throttle", "ok"], "in-use": ["in-use", "ok"], "not-found": ["not-found"]}
    world.aws.script(ids[1], replace=script[kind])
    world.alarm_event(ns, make_alarm(ns, "llm", suspects=[(1, pods[1], nodes[1])], reporter=(0, pods[0], nodes[0])))
    world.wait(lambda: phase(world, nodes[1]) == "PendingApproval", what="PendingApproval")
    assert world.kubectl("sdcguard", "approve", nodes[1]).returncode == 0
    final = "Failed" if kind == "not-found" else "Replaced"
    world.wait(lambda: phase(world, nodes[1]) == final, what=final)
    calls = world.aws.calls("BatchReplaceClusterNodes", ids[1])
    status = world.replacement(nodes[1])["status"]
    if kind == "throttle":
        assert [c["outcome"] for c in calls] == ["ThrottlingException", "ThrottlingException", "ok"]
        assert status["replace"]["throttled"] == 2
        assert [t["event"] for t in status["timeline"]].count("Throttled") == 2
    elif kind == "in-use":
        assert [c["outcome"] for c in calls] == ["failed", "ok"]
        assert status["replace"]["waits"] == 1 and status["replace"]["lastError"] == "InstanceIdInUse"
    else:
        assert [c["outcome"] for c in calls] == ["failed"]  # never retried
        assert status["replace"]["error"] == "InstanceIdNotFound"
        assert "does not exist" in status["replace"]["message"]
        failed = [c for c in status["conditions"] if c["type"] == "Failed"][0]
        assert failed["reason"] == "InstanceIdNotFound" and "does not exist" in failed["message"]
        assert "sdcguard_replacements_total{phase=\"Failed\"}" in world.metrics()


def test_transient_errors_are_retried_only_when_describe_shows_no_effect(world):
    """A transient BatchReplaceClusterNodes error (a 500 InternalServerError, a ``Failed`` entry
    with ``InternalServerError``) is retried only after DescribeClusterNode shows that the attempt
    did not take effect; an error that came *after* the call took effect is recognised the same
    way and not retried."""
    node, instance = approved_replacement(world, "retry", "a", ["internal", "ok-then-500"], step=10)
    world.wait(lambda: phase(world, node) == "Replaced", timeout=60, what="Replaced")
    calls = world.aws.calls("BatchReplaceClusterNodes", instance)
    # 1: InternalServerError entry, no effect -> Describe says Running -> retried;
    # 2: took effect, then answered 500 -> Describe says ShuttingDown -> followed, never called again.
    assert [(c["outcome"], c["effective"]) for c in calls] == [("failed", False), ("ok", True)], calls
    status = world.replacement(node)["status"]
    assert status["replace"]["recovered"] is True and status["replace"]["attempts"] == 2, dump(status)
    describes = [c for c in world.aws.calls("DescribeClusterNode", instance)]
    assert len(describes) >= 2
    events = [t["event"] for t in status["timeline"]]
    # an InternalServerError and a 500 are SageMaker being unavailable, not throttling: their own budget
    assert events.count("Unavailable") == 2 and events.count("Throttled") == 0, events
    assert events.count("ReplaceRequested") == 1 and status["replace"]["unavailable"] == 2, events
    # Replaced gives the slot back: the node stays cordoned, unlabelled.
    assert world.node_state(node) == (True, None)


def test_a_target_changed_behind_the_webhook_fails_the_replacement_and_replaces_nothing(world):
    ns = "retarget"
    ids, nodes, pods = start_training(world, ns, n_nodes=2)
    world.alarm_event(ns, make_alarm(ns, "llm", suspects=[(1, pods[1], nodes[1])], reporter=(0, pods[0], nodes[0])))
    world.wait(lambda: phase(world, nodes[1]) == "PendingApproval", what="PendingApproval")
    world.admission(False)  # no webhook (nor CEL rules: the emulator has none) stops this now
    try:
        patched = world.kubectl("patch", "nodereplacement", nodes[1], "--type=merge", "-p",
                                json.dumps({"spec": {"instanceId": ids[0], "decision": "Approved"}}))
        assert patched.returncode == 0, patched.stderr
    finally:
        world.admission(True)
    world.wait(lambda: phase(world, nodes[1]) == "Failed", what="Failed")
    status = world.replacement(nodes[1])["status"]
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "TargetChanged" and ids[0] in failed["message"] and ids[1] in failed["message"]
    assert status["target"]["instanceId"] == ids[1]
    assert world.aws.calls("BatchReplaceClusterNodes", ids[0]) == []
    assert world.aws.calls("BatchReplaceClusterNodes", ids[1]) == []
    assert world.node_state(nodes[1]) == (True, "true") and world.node_state(nodes[0]) == (False, None)


def test_a_pre_created_or_status_approved_nodereplacement_is_never_acted_on(world):
    """Attack (issue 20, 5): a NodeReplacement pre-created under the name the operator would use,
    decision already set, was adopted; and a merge patch of nodereplacements/status setting
    decision Approved (no spec.decision, nobody recorded by admission: /status passes no admission)
    was followed by BatchReplaceClusterNodes. Now the operator seals what it creates and passes over
    anything else (next name), and acts only on spec.decision recorded by admission that the status
    agrees with."""
    ns = "upgrade"
    ids, nodes, pods = start_training(world, ns, n_nodes=3)
    world.admission(False)  # the webhook also refuses such a create; this holds without it
    try:
        world.custom.create_cluster_custom_object("sdcguard.dev", "v1", "nodereplacements", {
            "apiVersion": "sdcguard.dev/v1", "kind": "NodeReplacement", "metadata": {"name": nodes[0]},
            "spec": {"nodeName": nodes[0], "instanceId": ids[0], "clusterName": CLUSTER, "instanceGroup": GROUP,
                     "incidents": [f"{ns}/llm-replay-9"], "decision": "Approved", "decidedBy": "tester"},
            "status": {"phase": "PendingApproval", "healthCheck": {"result": "Skipped"}}})
    finally:
        world.admission(True)
    world.alarm_event(ns, make_alarm(ns, "llm", step=9, suspects=[(0, pods[0], nodes[0]), (1, pods[1], nodes[1])],
                                     reporter=(2, pods[2], nodes[2])))
    incident = world.wait(lambda: (i := world.incident(ns, "llm-replay-9")).get("status", {}).get("replacements")
                          and len(i["status"]["replacements"]) == 2 and i, what="two replacements")
    assert incident["status"]["nodes"][nodes[0]]["replacement"] == f"{nodes[0]}-2"  # the planted one passed over
    planted = world.wait(lambda: [c for c in (world.replacement(nodes[0]).get("status") or {}).get("conditions", [])
                                  if c["type"] == "CreatedByOperator"], what="planted one marked")
    assert planted[0]["status"] == "False" and planted[0]["reason"] == "NotCreatedByOperator"
    world.wait(lambda: phase(world, nodes[1]) == "PendingApproval", what="PendingApproval")
    forged = world.kubectl("patch", "nodereplacement", nodes[1], "--subresource=status", "--type=merge", "-p",
                           json.dumps({"status": {"decision": {"decision": "Approved", "by": "tester"}}}))
    assert forged.returncode == 0, forged.stderr
    # (issue 32, 3: a status write breaks the operator's status seal, so it is refused before the
    # decision is even compared)
    world.wait(lambda: any(c["type"] == "StatusSealed" and c["reason"] == "StatusNotSealed"
                           for c in world.replacement(nodes[1])["status"].get("conditions", [])), what="refused")
    time.sleep(1.5)  # several reconciles (poll 0.3 s)
    assert world.aws.calls("BatchReplaceClusterNodes", ids[0]) == []
    assert world.aws.calls("BatchReplaceClusterNodes", ids[1]) == []
    assert phase(world, nodes[1]) == "PendingApproval" and world.replacement(nodes[0])["status"]["phase"] == \
        "PendingApproval"


@pytest.mark.slow  # ~40 s of operator restarts; test_leader.py kills the leader at random points in make test
def test_killed_after_every_phase_repeats_no_aws_call(make_world):
    """Restart safety: the operator is SIGKILLed after every phase (and twice while an AWS call is
    in flight) and started again; the flow completes and every AWS action happens exactly once,
    counted by the local SageMaker endpoint itself."""
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


def test_an_aws_calls_outcome_survives_transient_api_errors_and_is_written_once(tmp_path, monkeypatch):
    """The chaos soak once saw two effective StartClusterHealthCheck calls: the outcome write after
    the only describe that showed the check in progress got an API 500, and the next try's describe
    read ``Running`` (the check had ended), as if it had never started. The outcome is now retried
    in place on 5xx/429 and written once; other errors still go to kopf at once."""
    import kubernetes

    from sdcguard.sandbox.apiserver import start_emulator

    from sdcguard_operator import kube, replacement

    with start_emulator(tmp_path) as emulator:
        monkeypatch.setattr(kube, "_client", emulator.api_client())
        custom = kubernetes.client.CustomObjectsApi(emulator.api_client())
        body = custom.create_cluster_custom_object("sdcguard.dev", "v1", "nodereplacements", {
            "apiVersion": "sdcguard.dev/v1", "kind": "NodeReplacement", "metadata": {"name": "hyperpod-i-0"},
            "spec": {"nodeName": "hyperpod-i-0", "instanceId": "i-0", "clusterName": "c"}})
        path = "/apis/sdcguard.dev/v1/nodereplacements/hyperpod-i-0/status"
        requested = {"healthCheck": {"requestedAt": "2026-12-02T07:00:00Z", "attemptedBy": None}}

        emulator.reject("PATCH", path, 500, times=2)
        status = replacement._outcome(body, "healthCheck", "HealthCheckRequested", "took effect", **requested)
        assert status["healthCheck"]["requestedAt"] == "2026-12-02T07:00:00Z"
        assert replacement._outcome(body, "healthCheck", "HealthCheckRequested", "again", **requested) == status
        timeline = kube.get_replacement("hyperpod-i-0")["status"]["timeline"]
        assert [t["event"] for t in timeline] == ["HealthCheckRequested"]  # written once

        emulator.reject("PATCH", path, 403, times=2)  # not transient: kopf's retry, at once
        with pytest.raises(kubernetes.client.ApiException) as refused:
            replacement._outcome(body, "replace", "ReplaceRequested", "accepted", replace={"requestedAt": "t"})
        assert refused.value.status == 403 and emulator.emulator.rejections_left[("PATCH", path)] == 1
        emulator.reject("PATCH", path, 500, times=replacement.OUTCOME_WRITES)  # then kopf's retry takes over
        with pytest.raises(kubernetes.client.ApiException) as unavailable:
            replacement._outcome(body, "replace", "ReplaceRequested", "accepted", replace={"requestedAt": "t"})
        assert unavailable.value.status == 500 and ("PATCH", path) not in emulator.emulator.rejections
