"""The tenant boundary (docs/design.md §9, issue 20): a job's alarm can touch only that job's own nodes.

One world (emulators + the real operator, admission on) serves the module; each test has its own
namespaces, jobs and nodes. Every test is an attack from the issue: its docstring says what the
attack did before, the test shows it refused and nothing touched. The legitimate flow through the
same checks is tests/test_intake.py, test_incident.py (the happy path) and the rest, which
must stay green.
"""
from __future__ import annotations

import datetime
import time

import pytest
from conftest import make_alarm, new_instance

from sdcguard.contract import alarm

pytestmark = [pytest.mark.emulator, pytest.mark.operator]


@pytest.fixture(scope="module")
def world(make_world):
    return make_world(admission=True, SDCGUARD_MAX_CONCURRENT_SUSPECT_NODES="50",
                      SDCGUARD_MAX_SUSPECT_NODES_PER_JOB="1", SDCGUARD_MAX_SUSPECT_NODES_PER_NAMESPACE="2",
                      SDCGUARD_MAX_ALARM_AGE_SECONDS="900")


def _setup(world, ns: str, job: str = "llm", n: int = 2):
    nodes = [world.node(new_instance()) for _ in range(n)]
    return nodes, world.training(ns, job, nodes)


def _outcome(world, ns: str, event: str) -> str:
    return world.wait(lambda: world.event_annotation(ns, event), what=f"intake of {event}")


def _ago(seconds: float) -> str:
    then = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=seconds)
    return then.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def test_a_decoy_pod_cannot_aim_an_alarm_at_another_tenants_node(world):
    """Attack (issue 20, 1): anyone who may create pods in a namespace with an enabled job created
    ``decoy`` with the job-name label and spec.nodeName set to another team's node (no owner), and
    its injected sidecar signed an alarm naming it: the operator suspended the job, cordoned the
    other team's node and started a health check there. Intake now wants the suspect pod controlled
    by the job itself (owner uid); a pod claiming the job as owner with another uid is refused too."""
    ns, victim_ns = "tenant-a", "tenant-b"
    nodes, pods = _setup(world, ns)
    victim_nodes, _ = _setup(world, victim_ns, job="other", n=1)
    world.pod(ns, "decoy", "llm", victim_nodes[0], owned=False)
    forged_owner = world.core.create_namespaced_pod(ns, {
        "metadata": {"name": "decoy-2", "labels": {"training.kubeflow.org/job-name": "llm"},
                     "ownerReferences": [{"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": "llm",
                                          "uid": "0ld00000-0000-4000-8000-000000000000", "controller": True}]},
        "spec": {"nodeName": victim_nodes[0], "containers": [{"name": "x", "image": "x:1"}]}})
    assert forged_owner.metadata.uid
    for decoy in ("decoy", "decoy-2"):
        event = world.alarm_event(ns, make_alarm(ns, "llm", step=7, suspects=[(1, decoy, victim_nodes[0])],
                                                 reporter=(0, pods[0], nodes[0])))
        assert _outcome(world, ns, event) == "rejected:PodNotInJob"
    assert world.node_state(victim_nodes[0]) == (False, None)
    assert world.incidents(ns) == [] and not world.job_suspended(ns, "llm")
    assert world.aws.calls("StartClusterHealthCheck") == [] or all(
        victim_nodes[0][9:] not in c["ids"] for c in world.aws.calls("StartClusterHealthCheck"))


def test_a_replayed_alarm_counts_once_also_after_its_incident_is_gone(world):
    """Attack (issue 20, 2): duplicates were recognised by Event name while the incident existed;
    a captured signed alarm reposted under a new name after the incident was cleaned up suspended
    the job and cordoned the node again. Now every alarm id goes into the job's ledger (a ConfigMap
    owned by the job, outliving incidents): the replay is ReplayedAlarm."""
    ns = "replay"
    nodes, pods = _setup(world, ns)
    record = make_alarm(ns, "llm", step=40, suspects=[(1, pods[1], nodes[1])], reporter=(0, pods[0], nodes[0]))
    first = world.alarm_event(ns, record)
    assert _outcome(world, ns, first) == "incident:llm-replay-40"
    world.wait(lambda: world.node_state(nodes[1]) == (True, "true"), what="cordoned")
    ledger = world.core.read_namespaced_config_map("sdcguard-alarms-llm", ns)
    assert ledger.metadata.owner_references[0].uid == world.job_uid(ns, "llm") and record["id"] in ledger.data
    # the incident is cleaned up, the job resumed, the node given back ...
    world.custom.delete_namespaced_custom_object("sdcguard.dev", "v1", ns, "sdcincidents", "llm-replay-40")
    world.wait(lambda: world.incidents(ns) == [], what="incident gone")
    world.custom.patch_namespaced_custom_object("kubeflow.org", "v1", ns, "pytorchjobs", "llm",
                                                {"spec": {"runPolicy": {"suspend": False}}})
    # ... and the captured Event is posted again under a new name (same signed text)
    replayed = world.alarm_event(ns, record)
    assert replayed != first and _outcome(world, ns, replayed) == "rejected:ReplayedAlarm"
    time.sleep(1)
    assert world.incidents(ns) == [] and not world.job_suspended(ns, "llm")


def test_stale_and_rebound_alarms_are_refused(world):
    """Attack (issue 20, 2): the alarm's time was never checked, nor whether the pod it names is
    the pod it was raised in: an old alarm (older than the freshness bound, or older than the pod
    now of that name: pod names are stable, e.g. job-worker-0) still counted. Now StaleAlarm; a
    record without the signed uids is MissingUid; one whose pod uid is not the live pod's is
    PodUidMismatch."""
    ns = "stale"
    nodes, pods = _setup(world, ns, n=3)
    cases = []
    old = make_alarm(ns, "llm", step=1, suspects=[(1, pods[1], nodes[1])], reporter=(0, pods[0], nodes[0]))
    old["time"] = _ago(3600)  # beyond SDCGUARD_MAX_ALARM_AGE_SECONDS=900
    cases.append((old, {}, "StaleAlarm", "SDCGUARD_MAX_ALARM_AGE_SECONDS"))
    before_pod = make_alarm(ns, "llm", step=2, suspects=[(1, pods[1], nodes[1])], reporter=(0, pods[0], nodes[0]))
    before_pod["time"] = _ago(300)  # fresh, but raised before this pod existed
    cases.append((before_pod, {}, "StaleAlarm", f"is older than pod {pods[1]}"))
    cases.append((make_alarm(ns, "llm", step=3, suspects=[(1, pods[1], nodes[1])]), {"uids": False}, "MissingUid",
                  "job.uid"))
    rebound = make_alarm(ns, "llm", step=4, suspects=[(2, pods[2], nodes[2])], reporter=(0, pods[0], nodes[0]))
    world.with_uids(rebound)
    world.core.delete_namespaced_pod(pods[2], ns)  # recreated under the same name: another pod
    world.pod(ns, pods[2], "llm", nodes[2])
    cases.append((rebound, {}, "PodUidMismatch", "recreated since"))
    for record, options, reason, why in cases:
        event = world.alarm_event(ns, record, **options)
        assert _outcome(world, ns, event) == f"rejected:{reason}", record["step"]
        report = world.wait(lambda: [e.message for e in world.core.list_namespaced_event(ns).items
                                     if e.reason == "AlarmRejected" and event in e.message], what="report")
        assert why in report[0], report
    assert world.incidents(ns) == [] and [world.node_state(n) for n in nodes] == [(False, None)] * 3


def test_per_job_and_per_namespace_storm_guard_and_a_held_incident_is_verified_again(world):
    """Attack (issue 20, 1 and 6): one tenant's alarms took the cluster-wide storm-guard slots, so
    real incidents elsewhere got no cordon; and an incident's spec (the suspects) could be edited
    after intake and was acted on as written. Now per-job (1 here) and per-namespace (2 here)
    limits hold beside the cluster-wide one, and every reconcile verifies the incident against its
    signed alarm again: an edited spec is refused (SpecChanged) and its node never cordoned."""
    ns = "storm-tenant"
    a_nodes, a_pods = _setup(world, ns, job="a", n=3)
    b_nodes, b_pods = _setup(world, ns, job="b", n=2)
    c_nodes, c_pods = _setup(world, ns, job="c", n=2)
    for job, nodes, pods, step in (("a", a_nodes, a_pods, 1), ("a", a_nodes, a_pods, 2), ("b", b_nodes, b_pods, 1)):
        world.alarm_event(ns, make_alarm(ns, job, step=step, suspects=[(step, pods[step], nodes[step])],
                                         reporter=(0, pods[0], nodes[0])))
        if (job, step) == ("a", 1):
            world.wait(lambda: world.node_state(a_nodes[1]) == (True, "true"), what="job a's first node cordoned")
    held = world.wait(lambda: _condition(world, ns, "a-replay-2", "StormGuard"), what="a-replay-2 held")
    assert held["reason"] == "MaxSuspectNodesPerJob"
    world.wait(lambda: world.node_state(b_nodes[1]) == (True, "true"), what="job b cordoned")
    world.alarm_event(ns, make_alarm(ns, "c", step=1, suspects=[(1, c_pods[1], c_nodes[1])],
                                     reporter=(0, c_pods[0], c_nodes[0])))
    held_c = world.wait(lambda: _condition(world, ns, "c-replay-1", "StormGuard"), what="c-replay-1 held")
    assert held_c["reason"] == "MaxSuspectNodesPerNamespace"
    assert world.node_state(a_nodes[2]) == (False, None) and world.node_state(c_nodes[1]) == (False, None)
    # someone edits the held incident: its suspect becomes a node of job c
    incident = world.incident(ns, "a-replay-2")
    suspects = [{**incident["spec"]["suspects"][0], "node": c_nodes[0]}]
    world.custom.patch_namespaced_custom_object("sdcguard.dev", "v1", ns, "sdcincidents", "a-replay-2",
                                                {"spec": {"suspects": suspects}})
    refused = world.wait(lambda: _condition(world, ns, "a-replay-2", "Verified"), what="a-replay-2 refused")
    assert (refused["status"], refused["reason"]) == ("False", "SpecChanged")
    world.wait(lambda: (world.replacement(a_nodes[1]).get("status") or {}).get("phase") == "PendingApproval",
               what="job a's first replacement waiting")
    assert world.kubectl("sdcguard", "deny", a_nodes[1]).returncode == 0  # frees a slot of job a and of the namespace
    world.wait(lambda: world.node_state(c_nodes[1]) == (True, "true"), what="job c cordoned once the slot is free")
    time.sleep(1.5)  # several storm-guard rechecks (0.5 s)
    assert world.node_state(c_nodes[0]) == (False, None)  # the edited suspect: never cordoned
    assert world.node_state(a_nodes[2]) == (False, None)


def _condition(world, ns: str, name: str, type_: str) -> dict | None:
    status = world.incident(ns, name).get("status") or {}
    return next((c for c in status.get("conditions") or [] if c["type"] == type_ and
                 (type_ != "StormGuard" or c["status"] == "True")), None)


def test_alarm_strings_that_would_forge_the_approvers_screen_are_refused(world):
    """Attack (issue 20, 8): free strings of the alarm (last_good_checkpoint and others) reached
    printer columns and kubectl sdcguard raw: ANSI escapes could rewrite the screen an approver
    decides from. Intake now holds the CRD's patterns (printable, DNS names): MalformedAlarm."""
    ns = "display"
    nodes, pods = _setup(world, ns)
    record = make_alarm(ns, "llm", step=5, suspects=[(1, pods[1], nodes[1])], reporter=(0, pods[0], nodes[0]),
                        checkpoint="ckpt.pt\x1b[2J\x1b[1;1HAPPROVED: healthy node")
    event = world.alarm_event(ns, record)
    assert _outcome(world, ns, event) == "rejected:MalformedAlarm"
    assert world.incidents(ns) == [] and alarm.dumps(record)  # (the record itself is schema-valid)


def test_through_the_pod_webhook_only_the_job_controllers_own_pods_get_the_sidecar(make_world):
    """Attack (issue 20, 1), end to end: pods created through the emulator, which calls the
    operator's real pod webhook as the API server does. Before, a pod with only the job's label
    (or a forged ownerReference) got the sidecar and the job's key. Now: the job's own pod, created
    by the job controller's user, gets the sidecar, POD_UID and SDCGUARD_JOB_UID (what the library
    signs); a decoy without an owner, or with the job's ownerReference forged by another user, gets
    none."""
    controller = "system:serviceaccount:kubeflow:training-operator"
    world = make_world(pod_webhook=True, SDCGUARD_JOB_CONTROLLER_USERS=controller)
    import kubernetes

    trainer = kubernetes.client.CoreV1Api(kubernetes.config.new_client_from_config(
        config_file=str(world.user("trainer-token", controller))))
    ns, node = "hooked", world.node(new_instance())
    uid = world.job(ns, "llm")
    owner = [{"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": "llm", "uid": uid, "controller": True}]

    def pod(name: str, owners: list | None) -> dict:
        meta = {"name": name, "labels": {"training.kubeflow.org/job-name": "llm"}}
        if owners:
            meta["ownerReferences"] = owners
        return {"metadata": meta, "spec": {"nodeName": node, "containers": [{"name": "pytorch", "image": "t:1"}]}}

    own = trainer.create_namespaced_pod(ns, pod("llm-worker-0", owner))
    decoy = trainer.create_namespaced_pod(ns, pod("decoy", None))  # the right creator, no owner
    forged = world.core.create_namespaced_pod(ns, pod("forged", owner))  # right uid, wrong creator
    assert [c.name for c in own.spec.init_containers or []] == ["sdcguard-sidecar"]
    env = {e.name: (e.value or e.value_from.field_ref.field_path) for e in own.spec.containers[0].env}
    assert env["SDCGUARD_JOB_UID"] == uid and env["POD_UID"] == "metadata.uid"
    for other in (decoy, forged):
        assert not other.spec.init_containers and not any(
            v.secret for v in other.spec.volumes or [] if v.secret), other.metadata.name
