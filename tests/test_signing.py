"""Signed alarms end to end (docs/design.md §4): the operator's per-job key Secrets, the library's spool record
signed by the real sidecar process with the key the operator made, verified by the real operator,
key rotation, and ``SDCGUARD_REQUIRE_SIGNED_ALARMS=false``.

(The three rejections — no signature, wrong key, tampered text — touching nothing are
``test_intake.py::test_rejected_alarms_touch_nothing``.)
"""
from __future__ import annotations

import base64
import secrets

import pytest
from conftest import make_alarm, new_instance
from test_sidecar import SecretVolume, Sidecar

from sdcguard.contract import alarm, events, names, spool

pytestmark = [pytest.mark.emulator, pytest.mark.operator, pytest.mark.timeout(240)]

NS = "keys"


def _job(world, name: str, enabled: bool) -> dict:
    world.job(NS, name, enabled)
    return world.custom.get_namespaced_custom_object("kubeflow.org", "v1", NS, "pytorchjobs", name)


def _secret(world, job: str):
    return world.core.read_namespaced_secret(f"sdcguard-alarm-key-{job}", NS)


@pytest.fixture(scope="module")
def world(make_world):
    world = make_world(start=False, SDCGUARD_MAX_CONCURRENT_SUSPECT_NODES="50", SDCGUARD_KEY_RECHECK_SECONDS="0.5")
    world.jobs = {"early": _job(world, "early", True), "plain": _job(world, "plain", False),
                  "kept": _job(world, "kept", True)}
    world.kept_key = secrets.token_bytes(40)  # written before the operator ran, not derived by it
    world.core.create_namespaced_secret(NS, {
        "metadata": {"name": "sdcguard-alarm-key-kept", "namespace": NS, "ownerReferences": [
            {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": "kept", "uid": world.jobs["kept"]["metadata"]["uid"]}]},
        "type": "Opaque", "data": {"key": base64.b64encode(world.kept_key).decode()}})
    world.start_operator()
    return world


def test_enabled_jobs_get_a_key_secret_also_those_older_than_the_operator(world):
    late = _job(world, "late", True)
    for job in (world.jobs["early"], late):
        name = job["metadata"]["name"]
        key = world.alarm_key(NS, name)
        secret = _secret(world, name)
        assert secret.type == "Opaque" and list(secret.data) == [names.ALARM_KEY_DATA_KEY]
        assert len(key) >= 32
        [owner] = secret.metadata.owner_references
        assert (owner.api_version, owner.kind, owner.name, owner.uid) == (
            "kubeflow.org/v1", "PyTorchJob", name, job["metadata"]["uid"])
    assert world.alarm_key(NS, "early") != world.alarm_key(NS, "late")
    # 409: the operator writes the key derived for the job over it (it never reads a tenant Secret)
    world.wait(lambda: world.alarm_key(NS, "kept") != world.kept_key, what="the kept key replaced")
    assert len(world.alarm_key(NS, "kept")) == 32
    with pytest.raises(Exception) as missing:
        _secret(world, "plain")
    assert getattr(missing.value, "status", None) == 404  # never for a job that is not enabled
    # enabling a job later gives it its key
    world.custom.patch_namespaced_custom_object("kubeflow.org", "v1", NS, "pytorchjobs", "plain",
                                                {"metadata": {"annotations": {"sdcguard.dev/enabled": "true"}}})
    assert len(world.alarm_key(NS, "plain")) >= 32
    assert "sdcguard_alarm_keys_created_total 3.0" in world.metrics()  # early, late, plain


def test_spool_record_signed_by_the_sidecar_opens_an_incident_and_survives_a_key_rotation(world, tmp_path):
    ns = "e2e"
    ids = [new_instance() for _ in range(3)]
    nodes = [world.node(i) for i in ids]
    pods = world.training(ns, "llm", nodes)
    volume = SecretVolume(tmp_path / "key")  # what the kubelet mounts into the sidecar
    old = volume.write(world.alarm_key(ns, "llm"))
    spool_dir = tmp_path / "spool"
    sidecar = Sidecar(spool_dir, world.kube.kubeconfig, volume.path)
    try:
        first = make_alarm(ns, "llm", step=40, suspects=[(1, pods[1], nodes[1])], reporter=(0, pods[0], nodes[0]))
        spool.write_alarm(spool_dir, world.with_uids(first))  # the library's own spool writer
        event = events.event_name(first["id"])
        world.wait(lambda: world.event_annotation(ns, event) == "incident:llm-replay-40", what="incident from the sidecar")
        posted = world.core.read_namespaced_event(event, ns).metadata.annotations
        assert posted[names.ALARM_SIGNATURE_ANNOTATION] == events.alarm_signature(old, alarm.dumps(first))
        world.wait(lambda: world.node_state(nodes[1]) == (True, "true"), what="suspect cordoned")

        # someone writes another key into the Secret: the operator does not take it (its keys are
        # derived from its master key and the job's uid) and writes the job's key back
        rogue = secrets.token_bytes(32)
        world.core.patch_namespaced_secret("sdcguard-alarm-key-llm", ns,
                                           {"data": {"key": base64.b64encode(rogue).decode()}})
        forged = world.alarm_event(ns, make_alarm(ns, "llm", step=60, suspects=[(2, pods[2], nodes[2])]), key=rogue)
        world.wait(lambda: world.event_annotation(ns, forged), what="rogue-key intake")
        assert world.event_annotation(ns, forged) == "rejected:BadSignature"
        world.wait(lambda: world.alarm_key(ns, "llm") == old, what="the job's key written back")
        second = make_alarm(ns, "llm", check="weights", step=50, suspects=[(2, pods[2], nodes[2])],
                            reporter=(0, pods[0], nodes[0]))
        spool.write_alarm(spool_dir, world.with_uids(second))
        world.wait(lambda: world.event_annotation(ns, events.event_name(second["id"])) == "incident:llm-weights-50",
                   what="second incident")
        assert {i["metadata"]["name"] for i in world.incidents(ns)} == {"llm-replay-40", "llm-weights-50"}
    finally:
        assert sidecar.stop() == 0


def test_a_recreated_job_gets_a_new_key_and_old_signatures_stop_counting(world):
    """Attack (issue 20, 4): verification did not check that the key Secret belonged to the current
    job: a job deleted and recreated under the same name kept the old key, so alarms signed for the
    earlier job (captured, or from a pod of it still running) stayed valid. Now the key is derived
    from the job's uid: the recreated job's Secret is rewritten (new key, new owner) and the old
    key's signatures are refused."""
    ns = "recreated"
    nodes = [world.node(new_instance())]
    world.training(ns, "llm", nodes)
    old_uid, old_key = world.job_uid(ns, "llm"), world.alarm_key(ns, "llm")
    captured = make_alarm(ns, "llm", step=5, suspects=[(0, "llm-worker-0", nodes[0])])
    world.with_uids(captured)
    world.custom.delete_namespaced_custom_object("kubeflow.org", "v1", ns, "pytorchjobs", "llm")
    world.core.delete_namespaced_pod("llm-worker-0", ns)
    world.wait(lambda: ns not in {j["metadata"]["namespace"] for j in world.custom.list_cluster_custom_object(
        "kubeflow.org", "v1", "pytorchjobs")["items"] if j["metadata"]["name"] == "llm"},
        what="the job gone (kopf removes its finalizer)")
    world.job(ns, "llm")  # the emulator has no garbage collector: the old Secret is still there
    world.pod(ns, "llm-worker-0", "llm", nodes[0])
    new_uid = world.job_uid(ns, "llm")
    world.wait(lambda: _owner_uid(world, ns) == new_uid, what="the Secret owned by the new job")
    assert world.alarm_key(ns, "llm") != old_key and old_uid != new_uid
    replayed = world.alarm_event(ns, captured, key=old_key)
    world.wait(lambda: world.event_annotation(ns, replayed), what="old-key intake")
    assert world.event_annotation(ns, replayed) == "rejected:BadSignature"
    resigned = world.alarm_event(ns, make_alarm(ns, "llm", step=6, suspects=[(0, "llm-worker-0", nodes[0])],
                                                job_uid=old_uid))
    world.wait(lambda: world.event_annotation(ns, resigned), what="old-uid intake")
    assert world.event_annotation(ns, resigned) == "rejected:JobUidMismatch"
    assert world.incidents(ns) == [] and world.node_state(nodes[0]) == (False, None)


def _owner_uid(world, ns):
    return world.core.read_namespaced_secret("sdcguard-alarm-key-llm", ns).metadata.owner_references[0].uid


def test_unsigned_alarms_pass_only_when_signatures_are_not_required(make_world):
    world = make_world(SDCGUARD_REQUIRE_SIGNED_ALARMS="false", SDCGUARD_MAX_CONCURRENT_SUSPECT_NODES="50")
    ns = "migrating"
    ids = [new_instance() for _ in range(2)]
    nodes = [world.node(i) for i in ids]
    pods = world.training(ns, "llm", nodes)
    unsigned = world.alarm_event(ns, make_alarm(ns, "llm", suspects=[(1, pods[1], nodes[1])],
                                                reporter=(0, pods[0], nodes[0])), sign=False)
    world.wait(lambda: world.event_annotation(ns, unsigned) == "incident:llm-replay-40", what="unsigned accepted")
    assert "sdcguard_alarms_unsigned_accepted_total 1.0" in world.metrics()
    assert "is unsigned; accepted because SDCGUARD_REQUIRE_SIGNED_ALARMS=false" in world.log()
    forged = world.alarm_event(ns, make_alarm(ns, "llm", step=41, suspects=[(0, pods[0], nodes[0])],
                                              reporter=(1, pods[1], nodes[1])), key=secrets.token_bytes(32))
    world.wait(lambda: world.event_annotation(ns, forged), what="forged intake")
    assert world.event_annotation(ns, forged) == "rejected:BadSignature"  # a wrong signature never passes
    assert world.node_state(nodes[0]) == (False, None)
