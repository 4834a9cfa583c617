"""SDCIncident (operator/incident.py): one per fault, its containment flow and its recovery plan.

The tests marked ``operator`` run on the shared world (tests/conftest.py): real kopf, real
kubernetes client and kubectl against the Kubernetes emulator, real boto3 against the local
SageMaker endpoint. Naming and the recovery plan are pure functions, tested in-process.
"""
from __future__ import annotations

import pytest
from conftest import CLUSTER, GROUP, make_alarm, phase, start_training

from sdcguard.contract import names
from sdcguard_operator import incident


@pytest.mark.emulator
@pytest.mark.operator
def test_happy_path_event_to_replaced(world):
    ns = "happy"
    ids, nodes, pods = start_training(world, ns)
    record = make_alarm(ns, "llm", suspects=[(1, pods[1], nodes[1])], reporter=(0, pods[0], nodes[0]),
                        window=(31, 40), last_good_checkpoint_step=19, steps_at_risk=21, last_audited_step=30,
                        last_weights_verified_step=38, last_good_checkpoint_sha256="5a" * 32)
    event = world.alarm_event(ns, record)

    name = "llm-replay-40"
    world.wait(lambda: world.event_annotation(ns, event) == f"incident:{name}", what="intake annotation")
    world.wait(lambda: world.job_suspended(ns, "llm"), what="job suspended")
    world.wait(lambda: world.node_state(nodes[1]) == (True, "true"), what="node cordoned + labelled")
    assert world.node_state(nodes[0]) == (False, None) and world.node_state(nodes[2]) == (False, None)

    world.wait(lambda: phase(world, nodes[1]) == "PendingApproval", what="PendingApproval")
    assert [world.aws.calls("StartClusterHealthCheck", i) for i in (ids[0], ids[2])] == [[], []]
    checks = world.aws.calls("StartClusterHealthCheck", ids[1])
    assert len(checks) == 1 and checks[0]["outcome"] == "ok"
    assert checks[0]["detail"] == [{"InstanceGroupName": GROUP, "InstanceIds": [ids[1]],
                                    "DeepHealthChecks": ["InstanceStress", "InstanceConnectivity"]}]
    nrep = world.replacement(nodes[1])
    assert nrep["spec"]["instanceId"] == ids[1] and nrep["spec"]["clusterName"] == CLUSTER
    assert nrep["spec"]["incidents"] == [f"{ns}/{name}"]
    assert nrep["status"]["healthCheck"]["result"] == "Passed"
    assert [world.aws.calls("BatchReplaceClusterNodes", i) for i in ids] == [[], [], []]  # nothing without approval

    opened = world.incident(ns, name)
    assert opened["spec"]["suspects"] == [{"rank": 1, "pod": pods[1], "node": nodes[1],
                                           "pod_uid": world.core.read_namespaced_pod(pods[1], ns).metadata.uid}]
    assert opened["spec"]["lastGoodCheckpoint"] == "checkpoint-19.pt"
    assert opened["status"]["resumeFrom"] == "checkpoint-19.pt"
    assert (opened["status"]["resumeFromStep"], opened["status"]["stepsAtRisk"]) == (19, 21)
    # issue 19: the checkpoint's manifest step and sha256 as the alarm named them, not a drill
    assert (opened["spec"]["lastGoodCheckpointStep"], opened["spec"]["lastGoodCheckpointSha256"],
            opened["status"]["resumeFromSha256"], opened["spec"]["drill"]) == (19, "5a" * 32, "5a" * 32, False)
    assert opened["status"]["suspectWindow"] == {"firstStep": 31, "lastStep": 40, "range": "31-40"}
    assert (opened["status"]["lastAuditedStep"], opened["status"]["lastWeightsVerifiedStep"]) == (30, 38)
    assert opened["status"]["nodes"][nodes[1]]["instanceId"] == ids[1]
    timeline = [t["event"] for t in opened["status"]["timeline"]]
    assert timeline[:4] == ["Opened", "JobSuspended", "NodeCordoned", "ReplacementCreated"], timeline

    approve = world.kubectl("sdcguard", "approve", nodes[1], "--reason", "replay mismatch twice")
    assert approve.returncode == 0, approve.stderr
    assert approve.stdout.strip() == f"nodereplacement {nodes[1]} ({nodes[1]}) approved by tester"
    world.wait(lambda: phase(world, nodes[1]) == "Replaced", what="Replaced")
    replaces = [c for i in ids for c in world.aws.calls("BatchReplaceClusterNodes", i)]
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


@pytest.mark.emulator
@pytest.mark.operator
def test_six_events_for_one_fault_make_one_incident(world):
    ns = "dedup"
    ids, nodes, pods = start_training(world, ns)
    events = []
    for reporter in range(6):  # every rank reports the same fault, plus resends
        record = make_alarm(ns, "llm", check="replay", step=100, suspects=[(1, pods[1], nodes[1])],
                            reporter=(reporter % 3, pods[reporter % 3], nodes[reporter % 3]))
        events.append(world.alarm_event(ns, record))
    world.wait(lambda: all(world.event_annotation(ns, e) for e in events), what="all six Events handled")
    outcomes = sorted(world.event_annotation(ns, e).split(":")[0] for e in events)
    assert outcomes == ["incident"] + ["joined"] * 5
    world.wait(lambda: phase(world, nodes[1]) == "PendingApproval", what="PendingApproval")
    assert len(world.incidents(ns)) == 1
    joined = world.incident(ns, "llm-replay-100")
    assert joined["status"]["alarmCount"] == 6 and len(joined["status"]["duplicates"]) == 5
    assert [world.node_state(n)[1] for n in nodes] == [None, "true", None]
    assert len(world.aws.calls("StartClusterHealthCheck", ids[1])) == 1


@pytest.mark.emulator
@pytest.mark.operator
def test_a_409_to_the_create_of_an_incident_that_is_not_there_still_opens_it(world):
    """An overloaded API server answers 409 to writes it did not do (the chaos soak's injected
    faults). Read as "the incident exists", the join met a 404 and a valid alarm ended as the
    rejection IntakeError (CI, stop 38); the alarm ledger's create had the same flaw, and the job's
    alarm key Secret waited for the next recheck. Now a create answered 409 with nothing there is
    tried again."""
    ns = "create-conflict"
    world.kube.reject("POST", f"/api/v1/namespaces/{ns}/secrets", 409, times=1)  # the job's alarm key's create
    ids, nodes, pods = start_training(world, ns)
    world.kube.reject("POST", f"/apis/{names.GROUP}/{names.VERSION}/namespaces/{ns}/{names.INCIDENTS}", 409, times=2)
    world.kube.reject("POST", f"/api/v1/namespaces/{ns}/configmaps", 409, times=2)  # the alarm ledger's create
    event = world.alarm_event(ns, make_alarm(ns, "llm", check="replay", step=7, suspects=[(1, pods[1], nodes[1])]))
    world.wait(lambda: world.event_annotation(ns, event), what="intake annotation")
    assert world.event_annotation(ns, event) == "incident:llm-replay-7"
    world.wait(lambda: phase(world, nodes[1]) == "PendingApproval", what="PendingApproval")
    assert world.incident(ns, "llm-replay-7")["status"].get("alarmCount", 1) == 1


@pytest.mark.emulator
@pytest.mark.operator
def test_a_409_to_the_create_of_a_node_replacement_that_is_not_there_is_created_again(world):
    """The same answer to the NodeReplacement's create: read as "it exists", the read that followed
    met a 404 and containment failed with it ("Handler 'incident_contain' failed with an exception
    ...: (404)"), to be retried whole by kopf. Now the create is tried again at once, under the
    same name, and containment does not fail."""
    ns = "replacement-create-conflict"
    ids, nodes, pods = start_training(world, ns)
    path = f"/apis/{names.GROUP}/{names.VERSION}/{names.REPLACEMENTS}"
    logged = len(world.log())
    world.kube.reject("POST", path, 409, times=2)
    world.alarm_event(ns, make_alarm(ns, "llm", check="replay", step=8, suspects=[(1, pods[1], nodes[1])]))
    world.wait(lambda: phase(world, nodes[1]) == "PendingApproval", what="PendingApproval")
    assert ("POST", path) not in world.kube.emulator.rejections  # both refusals were used up
    assert [r["metadata"]["name"] for r in world.replacements() if r["spec"]["nodeName"] == nodes[1]] == [nodes[1]]
    failed = [line for line in world.log()[logged:].splitlines() if "failed with an exception" in line and "(404)" in line]
    assert failed == [], failed


@pytest.mark.emulator
@pytest.mark.operator
def test_a_retried_alarm_event_does_not_join_the_incident_it_opened(world):
    """The incident is created, then the write of the outcome onto the Event fails: kopf retries
    the handler, which found the incident and joined it as a duplicate of itself (alarmCount 2, a
    DuplicateAlarm naming the opening Event, the outcome "joined:"). Now the Event that opened
    the incident is recognised."""
    ns = "outcome-write-fails"
    ids, nodes, pods = start_training(world, ns)
    event_name = "sdcguard-alarm-outcome-retry"
    world.kube.reject("PATCH", f"/api/v1/namespaces/{ns}/events/{event_name}", 500, times=1)
    event = world.alarm_event(ns, make_alarm(ns, "llm", check="replay", step=9, suspects=[(1, pods[1], nodes[1])]),
                              name=event_name)
    world.wait(lambda: world.event_annotation(ns, event), what="intake annotation")
    assert world.event_annotation(ns, event) == "incident:llm-replay-9"
    status = world.incident(ns, "llm-replay-9")["status"]
    assert status.get("alarmCount", 1) == 1 and "DuplicateAlarm" not in [t["event"] for t in status["timeline"]], status
    assert ("PATCH", f"/api/v1/namespaces/{ns}/events/{event_name}") not in world.kube.emulator.rejections


@pytest.mark.emulator
@pytest.mark.operator
def test_an_incident_the_operator_did_not_create_is_never_acted_on(world):
    """Attack (issue 20, 6): anyone who may create SDCIncidents wrote one by hand, naming a node of
    another tenant (and a job in another namespace); the operator reconciled it like its own:
    suspended the job, cordoned the node, opened a NodeReplacement. Now an incident needs the
    operator's seal over a signed alarm, and spec.job.namespace must be its own namespace."""
    victim_ns, ns = "older-victim", "older"
    ids, nodes, pods = start_training(world, victim_ns, n_nodes=1)
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


def test_incident_names_are_dns_safe_and_distinct():
    record = {"job": {"name": "LLM_pretrain"}, "check": "nonfinite-local", "step": 12}
    assert incident.incident_name(record) == "llm-pretrain-nonfinite-local-12"
    long_a = incident.incident_name({"job": {"name": "x" * 80 + "a"}, "check": "replay", "step": 1})
    long_b = incident.incident_name({"job": {"name": "x" * 80 + "b"}, "check": "replay", "step": 1})
    assert len(long_a) <= 63 and long_a != long_b


def test_recovery_plan_comes_from_the_alarm_and_is_null_where_an_older_record_is_silent():
    spec = {"step": 40, "lastGoodCheckpoint": "s3://ckpt/step-19.pt", "suspectWindow": {"firstStep": 31, "lastStep": 40},
            "alarm": {"last_good_checkpoint_step": 19, "steps_at_risk": 21, "last_audited_step": 30,
                      "last_weights_verified_step": 38}}
    assert incident.recovery(spec) == {
        "resumeFrom": "s3://ckpt/step-19.pt", "resumeFromStep": 19, "resumeFromSha256": None, "stepsAtRisk": 21,
        "suspectWindow": {"firstStep": 31, "lastStep": 40, "range": "31-40"},
        "lastAuditedStep": 30, "lastWeightsVerifiedStep": 38}
    assert incident.resume_text(incident.recovery(spec)) == "s3://ckpt/step-19.pt (step 19)"
    # steps at risk follow from the checkpoint's step when the record does not say
    spec["alarm"] = {"last_good_checkpoint_step": 25}
    assert incident.recovery(spec)["stepsAtRisk"] == 15
    # an older record: nothing is guessed; values of the wrong type are dropped (the CRD wants integers)
    old = incident.recovery({"step": 7, "lastGoodCheckpoint": None, "suspectWindow": {"firstStep": 7},
                             "alarm": {"steps_at_risk": "many", "last_audited_step": True}})
    assert old == {"resumeFrom": None, "resumeFromStep": None, "resumeFromSha256": None, "stepsAtRisk": None, "lastAuditedStep": None,
                   "lastWeightsVerifiedStep": None, "suspectWindow": {"firstStep": 7, "lastStep": None, "range": "7-?"}}
    assert incident.resume_text(old) == "no verified checkpoint"
