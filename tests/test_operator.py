"""The operator end to end: real kopf (subprocess), real kubernetes client and kubectl against the
Kubernetes emulator, real boto3 against the local SageMaker endpoint.

One world (emulators + operator) serves this module; every test uses its own namespace, job and
nodes, and the storm guard is raised so the tests cannot hold each other back (it has its own
module, test_operator_stormguard.py). NodeReplacement writes pass the operator's admission webhook
(the emulator calls it as the API server would), and every alarm Event is signed with its job's key.
"""
from __future__ import annotations

import json
import re
import secrets

import pytest
from conftest import CLUSTER, GROUP, dump, make_alarm, new_instance

from sdcguard.contract import alarm, events

pytestmark = [pytest.mark.emulator, pytest.mark.operator]


@pytest.fixture(scope="module")
def world(make_world):
    return make_world(admission=True, SDCGUARD_MAX_CONCURRENT_SUSPECT_NODES="50")


def _setup(world, ns: str, n_nodes: int = 3, enabled: bool = True):
    ids = [new_instance() for _ in range(n_nodes)]
    nodes = [world.node(i) for i in ids]
    pods = world.training(ns, "llm", nodes, enabled=enabled)
    return ids, nodes, pods


def _phase(world, name):
    return (world.replacement(name).get("status") or {}).get("phase")


def test_happy_path_event_to_replaced(world):
    ns = "happy"
    ids, nodes, pods = _setup(world, ns)
    record = make_alarm(ns, "llm", suspects=[(1, pods[1], nodes[1])], reporter=(0, pods[0], nodes[0]),
                        window=(31, 40), last_good_checkpoint_step=19, steps_at_risk=21, last_audited_step=30,
                        last_weights_verified_step=38, last_good_checkpoint_sha256="5a" * 32)
    event = world.alarm_event(ns, record)

    name = "llm-replay-40"
    world.wait(lambda: world.event_annotation(ns, event) == f"incident:{name}", what="intake annotation")
    world.wait(lambda: world.job_suspended(ns, "llm"), what="job suspended")
    world.wait(lambda: world.node_state(nodes[1]) == (True, "true"), what="node cordoned + labelled")
    assert world.node_state(nodes[0]) == (False, None) and world.node_state(nodes[2]) == (False, None)

    world.wait(lambda: _phase(world, nodes[1]) == "PendingApproval", what="PendingApproval")
    checks = world.aws.calls("StartClusterHealthCheck")
    assert len(checks) == 1 and checks[0]["outcome"] == "ok"
    assert checks[0]["detail"] == [{"InstanceGroupName": GROUP, "InstanceIds": [ids[1]],
                                    "DeepHealthChecks": ["InstanceStress", "InstanceConnectivity"]}]
    nrep = world.replacement(nodes[1])
    assert nrep["spec"]["instanceId"] == ids[1] and nrep["spec"]["clusterName"] == CLUSTER
    assert nrep["spec"]["incidents"] == [f"{ns}/{name}"]
    assert nrep["status"]["healthCheck"]["result"] == "Passed"
    assert world.aws.calls("BatchReplaceClusterNodes") == []  # nothing without approval

    incident = world.incident(ns, name)
    assert incident["spec"]["suspects"] == [{"rank": 1, "pod": pods[1], "node": nodes[1],
                                             "pod_uid": world.core.read_namespaced_pod(pods[1], ns).metadata.uid}]
    assert incident["spec"]["lastGoodCheckpoint"] == "checkpoint-19.pt"
    assert incident["status"]["resumeFrom"] == "checkpoint-19.pt"
    assert (incident["status"]["resumeFromStep"], incident["status"]["stepsAtRisk"]) == (19, 21)
    # issue 19: the checkpoint's manifest step and sha256 as the alarm named them, not a drill
    assert (incident["spec"]["lastGoodCheckpointStep"], incident["spec"]["lastGoodCheckpointSha256"],
            incident["status"]["resumeFromSha256"], incident["spec"]["drill"]) == (19, "5a" * 32, "5a" * 32, False)
    assert incident["status"]["suspectWindow"] == {"firstStep": 31, "lastStep": 40, "range": "31-40"}
    assert (incident["status"]["lastAuditedStep"], incident["status"]["lastWeightsVerifiedStep"]) == (30, 38)
    assert incident["status"]["nodes"][nodes[1]]["instanceId"] == ids[1]
    events = [t["event"] for t in incident["status"]["timeline"]]
    assert events[:4] == ["Opened", "JobSuspended", "NodeCordoned", "ReplacementCreated"], events

    approve = world.kubectl("sdcguard", "approve", nodes[1], "--reason", "replay mismatch twice")
    assert approve.returncode == 0, approve.stderr
    assert approve.stdout.strip() == f"nodereplacement {nodes[1]} ({nodes[1]}) approved by tester"
    world.wait(lambda: _phase(world, nodes[1]) == "Replaced", what="Replaced")
    replaces = world.aws.calls("BatchReplaceClusterNodes")
    assert [c["ids"] for c in replaces] == [[ids[1]]] and replaces[0]["outcome"] == "ok"
    nrep = world.replacement(nodes[1])
    assert nrep["status"]["decision"]["decision"] == "Approved"
    assert nrep["status"]["decision"]["reason"] == "replay mismatch twice"
    assert (nrep["status"]["decision"]["by"], nrep["status"]["decision"]["groups"]) == (
        "tester", ["system:authenticated"])  # from the API server's authentication, via admission
    assert nrep["status"]["target"] == {"nodeName": nodes[1], "instanceId": ids[1], "clusterName": CLUSTER,
                                        "instanceGroup": GROUP}
    assert ids[1] not in world.aws.node_statuses(CLUSTER)  # the old instance is gone
    world.wait(lambda: world.incident(ns, name)["status"]["phase"] == "Resolved", what="incident resolved")
    again = world.kubectl("sdcguard", "deny", nodes[1])
    assert again.returncode == 1 and "decisions are final" in again.stderr


def test_deny_with_plain_kubectl_patch_uncordons(world):
    ns = "deny"
    ids, nodes, pods = _setup(world, ns)
    world.alarm_event(ns, make_alarm(ns, "llm", check="weights", step=7, suspects=[(2, pods[2], nodes[2])],
                                     drill=True))  # issue 19: a drill's alarm is acted on, and shown as one
    world.wait(lambda: _phase(world, nodes[2]) == "PendingApproval", what="PendingApproval")
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
    world.wait(lambda: _phase(world, nodes[2]) == "Denied", what="Denied")
    assert world.node_state(nodes[2]) == (False, None)
    nrep = world.replacement(nodes[2])
    assert nrep["status"]["decision"]["decision"] == "Denied"
    assert nrep["status"]["decision"]["by"] == "tester"  # a plain patch is attributed all the same
    assert world.aws.calls("BatchReplaceClusterNodes", ids[2]) == []
    # one-way: a later Approved is refused at admission
    again = world.kubectl("patch", "nodereplacement", nodes[2], "--type=merge", "-p", '{"spec":{"decision":"Approved"}}')
    assert again.returncode != 0 and "spec.decision is final: Denied cannot become Approved" in again.stderr
    assert world.replacement(nodes[2])["spec"]["decision"] == "Denied"
    world.wait(lambda: _phase(world, nodes[2]) == "Denied", what="still Denied")
    assert world.aws.calls("BatchReplaceClusterNodes", ids[2]) == []


def test_failed_health_check_is_recorded(world):
    ns = "hcfail"
    ids, nodes, pods = _setup(world, ns)
    world.aws.script(ids[0], health="fail", health_polls=2)
    world.alarm_event(ns, make_alarm(ns, "llm", check="nonfinite-local", step=3, suspects=[(0, pods[0], nodes[0])],
                                     reporter=(1, pods[1], nodes[1])))
    world.wait(lambda: _phase(world, nodes[0]) == "PendingApproval", what="PendingApproval")
    status = world.replacement(nodes[0])["status"]
    assert status["healthCheck"]["result"] == "Failed", dump(status)
    assert any(c["type"] == "HealthCheckPassed" and c["status"] == "False" for c in status["conditions"])
    incident = world.incident(ns, "llm-nonfinite-local-3")
    assert "ReplacementHealthCheckFailed" in [t["event"] for t in incident["status"]["timeline"]]


@pytest.mark.parametrize("kind", ["throttle", "in-use", "not-found"])
def test_aws_errors_by_kind(world, kind):
    ns = f"aws-{kind}"
    ids, nodes, pods = _setup(world, ns, n_nodes=2)
    script = {"throttle": ["throttle", "throttle", "ok"], "in-use": ["in-use", "ok"], "not-found": ["not-found"]}
    world.aws.script(ids[1], replace=script[kind])
    world.alarm_event(ns, make_alarm(ns, "llm", suspects=[(1, pods[1], nodes[1])], reporter=(0, pods[0], nodes[0])))
    world.wait(lambda: _phase(world, nodes[1]) == "PendingApproval", what="PendingApproval")
    assert world.kubectl("sdcguard", "approve", nodes[1]).returncode == 0
    final = "Failed" if kind == "not-found" else "Replaced"
    world.wait(lambda: _phase(world, nodes[1]) == final, what=final)
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


def test_six_events_for_one_fault_make_one_incident(world):
    ns = "dedup"
    ids, nodes, pods = _setup(world, ns)
    events = []
    for reporter in range(6):  # every rank reports the same fault, plus resends
        record = make_alarm(ns, "llm", check="replay", step=100, suspects=[(1, pods[1], nodes[1])],
                            reporter=(reporter % 3, pods[reporter % 3], nodes[reporter % 3]))
        events.append(world.alarm_event(ns, record))
    world.wait(lambda: all(world.event_annotation(ns, e) for e in events), what="all six Events handled")
    outcomes = sorted(world.event_annotation(ns, e).split(":")[0] for e in events)
    assert outcomes == ["incident"] + ["joined"] * 5
    world.wait(lambda: _phase(world, nodes[1]) == "PendingApproval", what="PendingApproval")
    assert len(world.incidents(ns)) == 1
    incident = world.incident(ns, "llm-replay-100")
    assert incident["status"]["alarmCount"] == 6 and len(incident["status"]["duplicates"]) == 5
    assert [world.node_state(n)[1] for n in nodes] == [None, "true", None]
    assert len(world.aws.calls("StartClusterHealthCheck", ids[1])) == 1


def test_alarm_without_suspects_suspends_and_cordons_nothing(world):
    ns = "reduced"
    ids, nodes, pods = _setup(world, ns, n_nodes=2)
    event = world.alarm_event(ns, make_alarm(ns, "llm", check="nonfinite-reduced", step=5,
                                             reporter=(0, pods[0], nodes[0])))
    world.wait(lambda: (world.incident(ns, "llm-nonfinite-reduced-5").get("status") or {}).get("phase") == "Contained",
               what="incident contained")
    assert world.event_annotation(ns, event) == "incident:llm-nonfinite-reduced-5"
    assert world.job_suspended(ns, "llm")
    assert [world.node_state(n) for n in nodes] == [(False, None), (False, None)]


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


def _metric(world, sample: str) -> float:
    found = re.search(rf"^{re.escape(sample)} (\S+)$", world.metrics(), re.M)
    return float(found.group(1)) if found else 0.0


@pytest.mark.parametrize("case", sorted(REJECTIONS))
def test_rejected_alarms_touch_nothing(world, case):
    reason = case.split("-")[0]
    ns = f"reject-{case.lower()}"
    ids, nodes, pods = _setup(world, ns, enabled=(reason != "JobNotEnabled"))
    sample = f'sdcguard_alarms_rejected_total{{reason="{reason}"}}'
    before = _metric(world, sample)
    event = world.alarm_event(ns, **REJECTIONS[case](world, ns, pods, nodes))
    world.wait(lambda: world.event_annotation(ns, event), what="intake annotation")
    assert world.event_annotation(ns, event) == f"rejected:{reason}"
    assert world.incidents(ns) == []
    assert [world.node_state(n) for n in nodes] == [(False, None)] * 3
    assert not world.job_suspended(ns, "llm")
    assert world.wait(lambda: _metric(world, sample) == before + 1, what="rejection metric")
    reports = world.wait(lambda: [e for e in world.core.list_namespaced_event(ns).items
                                  if e.reason == "AlarmRejected"], what="AlarmRejected Event")
    assert reason in reports[0].message and reports[0].type == "Warning"


def test_alarm_events_are_watched_with_a_server_side_field_selector(world):
    watches = [r for r in world.kube.emulator._requests
               if r.resource == "v1/events" and r.params.get("watch") in ("true", "True")]
    assert watches and all(r.params.get("fieldSelector") == "reason=SilentDataCorruption" for r in watches)


def test_kubectl_sdcguard_history_and_incidents(world):
    listing = world.kubectl("sdcguard", "incidents")
    assert listing.returncode == 0, listing.stderr
    header, *rows = listing.stdout.splitlines()
    assert header.split() == ["NAMESPACE", "NAME", "JOB", "CHECK", "STEP", "SUSPECTS", "WINDOW", "RESUME-FROM",
                              "SHA256", "AT-RISK", "DRILL", "PHASE", "AGE"]
    [happy] = [row for row in rows if row.startswith("happy ")]
    cells = happy.split()
    assert cells[1:5] == ["llm-replay-40", "llm", "replay", "40"] and cells[5].startswith("hyperpod-i-")
    assert cells[6:13] == ["31-40", "checkpoint-19.pt", "(step", "19)", "5a" * 6, "21", "-"] and cells[13] == "Resolved"
    [drill] = [row for row in rows if row.startswith("deny ")]
    assert drill.split()[8:11] == ["-", "-", "yes"]  # no sha256 named, no step at risk; from a drill
    history = world.kubectl("sdcguard", "history")
    assert history.returncode == 0, history.stderr
    lines = history.stdout.splitlines()
    assert lines[0].split() == ["NODE", "INSTANCE", "INCIDENTS", "LAST-INCIDENT"]
    assert any(line.split()[1].startswith("i-") for line in lines[1:])
    got = world.kubectl("get", "nodereplacements")
    assert got.returncode == 0, got.stderr
    assert got.stdout.split("\n")[0].split() == ["NAME", "NODE", "INSTANCE", "PHASE", "HEALTH-CHECK", "DECISION", "AGE"]
    assert any(line.split()[3:6] == ["Replaced", "Passed", "Approved"] for line in got.stdout.splitlines()[1:])
    got = world.kubectl("get", "sdcincidents", "-n", "happy")
    assert got.returncode == 0, got.stderr
    header, row = got.stdout.splitlines()[:2]
    assert header.split() == ["NAME", "JOB", "CHECK", "STEP", "SUSPECTS", "WINDOW", "RESUME-FROM", "AT-RISK",
                              "PHASE", "AGE"]
    assert row.split()[:4] == ["llm-replay-40", "llm", "replay", "40"]
    assert row.split()[5:9] == ["31-40", "checkpoint-19.pt", "21", "Resolved"]
    wide = world.kubectl("get", "sdcincidents", "-n", "happy", "-o", "wide")
    assert wide.returncode == 0, wide.stderr
    assert wide.stdout.splitlines()[0].split()[7:10] == ["RESUME-STEP", "RESUME-SHA256", "AT-RISK"]


def test_early_approval_waits_for_the_health_check(world):
    ns = "early"
    ids, nodes, pods = _setup(world, ns, n_nodes=2)
    world.aws.script(ids[1], health_polls=6)
    world.alarm_event(ns, make_alarm(ns, "llm", suspects=[(1, pods[1], nodes[1])], reporter=(0, pods[0], nodes[0])))
    world.wait(lambda: (world.replacement(nodes[1]).get("status") or {}).get("healthCheck", {}).get("requestedAt"),
               what="health check requested")
    assert world.kubectl("sdcguard", "approve", nodes[1]).returncode == 0
    world.wait(lambda: _phase(world, nodes[1]) == "Replaced", what="Replaced")
    timeline = [t["event"] for t in world.replacement(nodes[1])["status"]["timeline"]]
    assert timeline.index("HealthCheckPassed") < timeline.index("Approved") < timeline.index("ReplaceRequested"), \
        timeline
    assert world.replacement(nodes[1])["status"]["decision"]["by"] == "tester"
    assert len(world.aws.calls("BatchReplaceClusterNodes", ids[1])) == 1


def test_an_incident_the_operator_did_not_create_is_never_acted_on(world):
    """Attack (issue 20, 6): anyone who may create SDCIncidents wrote one by hand, naming a node of
    another tenant (and a job in another namespace); the operator reconciled it like its own:
    suspended the job, cordoned the node, opened a NodeReplacement. Now an incident needs the
    operator's seal over a signed alarm, and spec.job.namespace must be its own namespace."""
    victim_ns, ns = "older-victim", "older"
    ids, nodes, pods = _setup(world, victim_ns, n_nodes=1)
    record = make_alarm(victim_ns, "llm", step=12, suspects=[(0, pods[0], nodes[0])], checkpoint="ckpt-8.pt")
    for where, name in ((ns, "llm-replay-12"), (victim_ns, "llm-replay-12")):
        world.custom.create_namespaced_custom_object("sdcguard.dev", "v1", where, "sdcincidents", {
            "apiVersion": "sdcguard.dev/v1", "kind": "SDCIncident", "metadata": {"name": name, "namespace": where},
            "spec": {"job": record["job"], "check": "replay", "step": 12, "ambiguous": False,
                     "suspects": record["suspects"], "reporter": record["reporter"],
                     "suspectWindow": {"firstStep": 9, "lastStep": 12}, "lastVerifiedStep": 11,
                     "lastGoodCheckpoint": "ckpt-8.pt", "alarmId": record["id"], "event": "forged",
                     "alarm": record}})
    for where, reason in ((ns, "NamespaceMismatch"), (victim_ns, "NotCreatedByOperator")):
        conditions = world.wait(lambda: [c for c in (world.incident(where, "llm-replay-12").get("status") or {})
                                         .get("conditions", []) if c["type"] == "Verified"], what="refusal")
        assert (conditions[0]["status"], conditions[0]["reason"]) == ("False", reason)
    assert world.node_state(nodes[0]) == (False, None) and not world.job_suspended(victim_ns, "llm")
    assert [r for r in world.replacements() if r["spec"]["nodeName"] == nodes[0]] == []
    assert "phase" not in world.incident(victim_ns, "llm-replay-12")["status"]


def test_deciding_needs_the_approve_verb_and_the_target_is_fixed_at_admission(world):
    ns = "admission"
    ids, nodes, pods = _setup(world, ns, n_nodes=2)
    world.alarm_event(ns, make_alarm(ns, "llm", suspects=[(1, pods[1], nodes[1])], reporter=(0, pods[0], nodes[0])))
    world.wait(lambda: _phase(world, nodes[1]) == "PendingApproval", what="PendingApproval")
    mallory = world.kube.add_user("mallory-token", "mallory")  # may patch (in a real cluster), not approve
    refused = world.kubectl("sdcguard", "approve", nodes[1], kubeconfig=mallory)
    assert refused.returncode == 1
    assert f"mallory may not decide NodeReplacement {nodes[1]}" in refused.stderr
    assert "RBAC verb approve on nodereplacements.sdcguard.dev" in refused.stderr
    forged = world.kubectl("patch", "nodereplacement", nodes[1], "--type=merge", "-p", json.dumps(
        {"spec": {"decision": "Approved", "decidedBy": "tester"}}), kubeconfig=mallory)
    assert forged.returncode != 0 and "mallory may not decide" in forged.stderr
    review = world.kube.emulator.access_reviews[-1]
    assert review["spec"]["user"] == "mallory" and review["spec"]["resourceAttributes"] == {
        "group": "sdcguard.dev", "resource": "nodereplacements", "verb": "approve", "name": nodes[1]}
    # an approver may decide, but not redirect the replacement or speak for someone else
    moved = world.kubectl("patch", "nodereplacement", nodes[1], "--type=merge", "-p",
                          json.dumps({"spec": {"instanceId": ids[0]}}))
    assert moved.returncode != 0 and "spec.instanceId: the target of a NodeReplacement is fixed" in moved.stderr
    claimed = world.kubectl("patch", "nodereplacement", nodes[1], "--type=merge", "-p",
                            json.dumps({"spec": {"decidedBy": "someone-else"}}))
    assert claimed.returncode != 0 and "never written by a client" in claimed.stderr
    assert world.replacement(nodes[1])["spec"].get("decision", "") == ""
    # approval through a group binding; a client's own decidedBy is overwritten with the real user
    carol = world.kube.add_user("carol-token", "carol", groups=["oncall"])
    world.kube.grant("group:oncall", "approve", "nodereplacements.sdcguard.dev")
    done = world.kubectl("patch", "nodereplacement", nodes[1], "--type=merge", "-p", json.dumps(
        {"spec": {"decision": "Denied", "decidedBy": "mallory", "decisionReason": "false alarm"}}), kubeconfig=carol)
    assert done.returncode == 0, done.stderr
    spec = world.replacement(nodes[1])["spec"]
    assert (spec["decidedBy"], spec["decidedByGroups"]) == ("carol", ["oncall", "system:authenticated"])
    world.wait(lambda: _phase(world, nodes[1]) == "Denied", what="Denied")
    assert world.replacement(nodes[1])["status"]["decision"]["by"] == "carol"
    assert world.aws.calls("BatchReplaceClusterNodes", ids[1]) == []


def test_a_target_changed_behind_the_webhook_fails_the_replacement_and_replaces_nothing(world):
    ns = "retarget"
    ids, nodes, pods = _setup(world, ns, n_nodes=2)
    world.alarm_event(ns, make_alarm(ns, "llm", suspects=[(1, pods[1], nodes[1])], reporter=(0, pods[0], nodes[0])))
    world.wait(lambda: _phase(world, nodes[1]) == "PendingApproval", what="PendingApproval")
    world.admission(False)  # no webhook (nor CEL rules: the emulator has none) stops this now
    try:
        patched = world.kubectl("patch", "nodereplacement", nodes[1], "--type=merge", "-p",
                                json.dumps({"spec": {"instanceId": ids[0], "decision": "Approved"}}))
        assert patched.returncode == 0, patched.stderr
    finally:
        world.admission(True)
    world.wait(lambda: _phase(world, nodes[1]) == "Failed", what="Failed")
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
    ids, nodes, pods = _setup(world, ns, n_nodes=3)
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
    world.wait(lambda: _phase(world, nodes[1]) == "PendingApproval", what="PendingApproval")
    forged = world.kubectl("patch", "nodereplacement", nodes[1], "--subresource=status", "--type=merge", "-p",
                           json.dumps({"status": {"decision": {"decision": "Approved", "by": "tester"}}}))
    assert forged.returncode == 0, forged.stderr
    world.wait(lambda: any(c["type"] == "DecisionRefused" and c["reason"] == "DecisionMismatch"
                           for c in world.replacement(nodes[1])["status"].get("conditions", [])), what="refused")
    import time
    time.sleep(1.5)  # several reconciles (poll 0.3 s)
    assert world.aws.calls("BatchReplaceClusterNodes", ids[0]) == []
    assert world.aws.calls("BatchReplaceClusterNodes", ids[1]) == []
    assert _phase(world, nodes[1]) == "PendingApproval" and world.replacement(nodes[0])["status"]["phase"] == \
        "PendingApproval"
