"""Retries that cannot double-act, and the recorded release of a failed replacement's slot.

A transient BatchReplaceClusterNodes error (a 500 InternalServerError, a ``Failed`` entry with
``InternalServerError``) is retried only after DescribeClusterNode shows that the attempt did not
take effect; an error that came *after* the call took effect is recognised the same way and not
retried.  A Failed replacement keeps its storm-guard slot until ``kubectl sdcguard release NODE``
(admitted only with the ``approve`` verb, who asked recorded by admission).
"""
from __future__ import annotations

import pytest
from conftest import dump, make_alarm, new_instance

pytestmark = [pytest.mark.emulator, pytest.mark.operator]


@pytest.fixture(scope="module")
def world(make_world):
    return make_world(admission=True, SDCGUARD_MAX_CONCURRENT_SUSPECT_NODES="1", SDCGUARD_DEEP_HEALTH_CHECKS="")


def _through(world, ns: str, job: str, script: list[str], step: int) -> tuple[str, str]:
    """One suspect node whose replacement is approved; returns (node, instance)."""
    ids = [new_instance() for _ in range(2)]
    nodes = [world.node(i) for i in ids]
    pods = world.training(ns, job, nodes)
    world.aws.script(ids[1], replace=script, replace_polls=2)
    world.alarm_event(ns, make_alarm(ns, job, step=step, suspects=[(1, pods[1], nodes[1])],
                                     reporter=(0, pods[0], nodes[0])))
    world.wait(lambda: (world.replacement(nodes[1]).get("status") or {}).get("phase") == "PendingApproval",
               what="PendingApproval")
    assert world.kubectl("sdcguard", "approve", nodes[1]).returncode == 0
    return nodes[1], ids[1]


def _phase(world, node: str) -> str | None:
    return (world.replacement(node).get("status") or {}).get("phase")


def test_transient_errors_are_retried_only_when_describe_shows_no_effect(world):
    node, instance = _through(world, "retry", "a", ["internal", "ok-then-500"], step=10)
    world.wait(lambda: _phase(world, node) == "Replaced", timeout=60, what="Replaced")
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


def test_a_failed_replacement_holds_its_slot_until_a_person_releases_it(world):
    failed, _ = _through(world, "release", "b", ["not-found"], step=20)
    world.wait(lambda: _phase(world, failed) == "Failed", what="Failed")
    assert world.node_state(failed) == (True, "true")
    ids = [new_instance() for _ in range(2)]
    nodes = [world.node(i) for i in ids]
    pods = world.training("release", "c", nodes)
    world.alarm_event("release", make_alarm("release", "c", step=30, suspects=[(1, pods[1], nodes[1])],
                                            reporter=(0, pods[0], nodes[0])))
    world.wait(lambda: any(c.get("type") == "StormGuard" and c.get("status") == "True"
                           for i in world.incidents("release") if i["spec"]["job"]["name"] == "c"
                           for c in (i.get("status") or {}).get("conditions") or []), what="StormGuard")
    assert world.node_state(nodes[1]) == (False, None)

    nobody = world.kube.add_user("nobody-token", "mallory")
    refused = world.kubectl("sdcguard", "release", failed, kubeconfig=nobody)
    assert refused.returncode != 0 and "approve" in refused.stderr, refused.stderr
    wrong = world.kubectl("sdcguard", "release", nodes[0])
    assert wrong.returncode != 0 and "no Failed NodeReplacement" in wrong.stderr

    done = world.kubectl("sdcguard", "release", failed, "--reason", "instance not found; node retired")
    assert done.returncode == 0 and "released by tester" in done.stdout, done.stdout + done.stderr
    world.wait(lambda: (world.replacement(failed).get("status") or {}).get("released"), what="released")
    released = world.replacement(failed)["status"]["released"]
    assert released["by"] == "tester" and released["reason"] == "instance not found; node retired"
    assert world.node_state(failed) == (True, None)  # still cordoned, slot given back
    world.wait(lambda: world.node_state(nodes[1]) == (True, "true"), what="held node cordoned after the release")
    again = world.kubectl("sdcguard", "release", failed)
    assert "already released" in again.stdout
    assert [t["event"] for t in world.replacement(failed)["status"]["timeline"]].count("Released") == 1


def test_a_deleted_key_secret_is_recreated_without_the_job_changing(make_world):
    world = make_world(SDCGUARD_KEY_RECHECK_SECONDS="0.5")
    world.job("keys", "llm")
    first = world.alarm_key("keys", "llm")
    world.core.delete_namespaced_secret("sdcguard-alarm-key-llm", "keys")
    second = world.wait(lambda: world.alarm_key("keys", "llm", timeout=1), timeout=30, what="the key recreated")
    assert second == first and len(second) >= 32  # the job's key, derived again (master key, job uid)
