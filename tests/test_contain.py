"""Containment (operator/contain.py): the job suspended, suspect nodes cordoned and labelled, under the storm guard.

The storm guard's tests build worlds of their own (tests/conftest.py ``make_world``): one with the
default limit (2 suspect nodes at once) run as ``kopf run -m sdcguard_operator.main``, one holding a
single node. The limit arithmetic is a pure function, tested in-process.
"""
from __future__ import annotations

import pytest
from conftest import approved_replacement, condition, make_alarm, new_instance, phase, start_training

from sdcguard_operator import contain
from sdcguard_operator.settings import Settings


@pytest.mark.emulator
@pytest.mark.operator
def test_alarm_without_suspects_suspends_and_cordons_nothing(world):
    ns = "reduced"
    ids, nodes, pods = start_training(world, ns, n_nodes=2)
    event = world.alarm_event(ns, make_alarm(ns, "llm", check="nonfinite-reduced", step=5,
                                             reporter=(0, pods[0], nodes[0])))
    world.wait(lambda: (world.incident(ns, "llm-nonfinite-reduced-5").get("status") or {}).get("phase") == "Contained",
               what="incident contained")
    assert world.event_annotation(ns, event) == "incident:llm-nonfinite-reduced-5"
    assert world.job_suspended(ns, "llm")
    assert [world.node_state(n) for n in nodes] == [(False, None), (False, None)]


@pytest.mark.emulator
@pytest.mark.operator
def test_third_suspect_node_is_held_until_a_slot_frees(make_world):
    """With maxConcurrentSuspectNodes at its default (2), three incidents on three nodes cordon
    two; the third is recorded and contained (job suspended) with the StormGuard condition, and is
    cordoned once a slot frees (a denial uncordons one node)."""
    world = make_world(via_kopf=True, admission=True)  # `kopf run -m sdcguard_operator.main`; the default limit, 2
    ns = "storm"
    ids = [new_instance() for _ in range(4)]
    nodes = [world.node(i) for i in ids]
    pods = world.training(ns, "llm", nodes)
    for rank in (1, 2, 3):  # three faults, three suspect nodes (different steps: three incidents)
        world.alarm_event(ns, make_alarm(ns, "llm", step=10 * rank, suspects=[(rank, pods[rank], nodes[rank])],
                                         reporter=(0, pods[0], nodes[0])))
    world.wait(lambda: len(world.incidents(ns)) == 3, what="three incidents")
    world.wait(lambda: sum(world.node_state(n) == (True, "true") for n in nodes) == 2, what="two cordoned")
    held = world.wait(lambda: [i for i in world.incidents(ns) if (condition(i, "StormGuard") or {}).get("status") == "True"],
                      what="StormGuard condition")
    assert len(held) == 1
    held_node = held[0]["spec"]["suspects"][0]["node"]
    assert world.node_state(held_node) == (False, None)
    assert condition(held[0], "StormGuard")["reason"] == "MaxConcurrentSuspectNodes"
    assert held_node in condition(held[0], "StormGuard")["message"]
    assert world.job_suspended(ns, "llm")  # contained all the same
    assert world.node_state(nodes[0]) == (False, None)
    assert len(world.aws.calls("StartClusterHealthCheck", held[0]["spec"]["suspects"][0]["node"][9:])) == 0
    assert "sdcguard_storm_guard_holds_total" in world.metrics()

    cordoned = [n for n in nodes[1:] if n != held_node]
    world.wait(lambda: phase(world, cordoned[0]) == "PendingApproval", what="PendingApproval")
    assert world.kubectl("sdcguard", "deny", cordoned[0], "--reason", "false alarm").returncode == 0
    world.wait(lambda: world.node_state(held_node) == (True, "true"), what="held node cordoned after the denial")
    world.wait(lambda: (condition(world.incident(ns, held[0]["metadata"]["name"]), "StormGuard") or {}).get("status")
               == "False", what="StormGuard released")
    assert world.node_state(cordoned[0]) == (False, None)
    assert sum(world.node_state(n)[1] == "true" for n in nodes) == 2


@pytest.mark.emulator
@pytest.mark.operator
def test_a_failed_replacement_holds_its_slot_until_a_person_releases_it(make_world):
    """A Failed replacement keeps its storm-guard slot until ``kubectl sdcguard release NODE``
    (admitted only with the ``approve`` verb, who asked recorded by admission)."""
    world = make_world(admission=True, SDCGUARD_MAX_CONCURRENT_SUSPECT_NODES="1", SDCGUARD_DEEP_HEALTH_CHECKS="")
    failed, _ = approved_replacement(world, "release", "b", ["not-found"], step=20)
    world.wait(lambda: phase(world, failed) == "Failed", what="Failed")
    assert world.node_state(failed) == (True, "true")
    ids = [new_instance() for _ in range(2)]
    nodes = [world.node(i) for i in ids]
    pods = world.training("release", "c", nodes)
    world.alarm_event("release", make_alarm("release", "c", step=30, suspects=[(1, pods[1], nodes[1])],
                                            reporter=(0, pods[0], nodes[0])))
    world.wait(lambda: any((condition(i, "StormGuard") or {}).get("status") == "True"
                           for i in world.incidents("release") if i["spec"]["job"]["name"] == "c"), what="StormGuard")
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


def test_storm_guard_limits_per_job_and_per_namespace_beside_the_cluster_wide_one():
    s = Settings.from_env({"SDCGUARD_MAX_CONCURRENT_SUSPECT_NODES": "4", "SDCGUARD_MAX_SUSPECT_NODES_PER_JOB": "1",
                           "SDCGUARD_MAX_SUSPECT_NODES_PER_NAMESPACE": "2"})
    taken = {"n1": contain.slot_value("a/x-replay-1", "x")}
    assert contain.full(taken, "a", "x", s) == "MaxSuspectNodesPerJob"
    assert contain.full(taken, "a", "y", s) is None
    taken["n2"] = contain.slot_value("a/y-replay-1", "y")
    assert contain.full(taken, "a", "z", s) == "MaxSuspectNodesPerNamespace"
    assert contain.full(taken, "b", "x", s) is None  # the same job name elsewhere is another job
    taken.update({"n3": "", "n4": "c/old-ref"})  # a labelled node without a slot; an older operator's value
    assert contain.full(taken, "b", "x", s) == "MaxConcurrentSuspectNodes"
    defaults = Settings.from_env({"SDCGUARD_MAX_CONCURRENT_SUSPECT_NODES": "7"})
    assert (defaults.max_suspect_nodes_per_job, defaults.max_suspect_nodes_per_namespace) == (7, 7)


def slot_of(world, node: str) -> str | None:
    """The node's storm-guard slot, as the operator's ledger holds it."""
    settings = Settings.from_env(world.operator_env)
    ledger = world.core.read_namespaced_config_map(contain.LEDGER, contain.ledger_namespace(settings))
    return (ledger.data or {}).get(node)


def node_path(node: str) -> str:
    return f"/api/v1/nodes/{node}"


@pytest.mark.emulator
@pytest.mark.operator
def test_a_node_gone_after_its_slot_was_taken_gives_the_slot_back(world):
    """The slot is taken, the cordon's write refused, and the node leaves the cluster before the
    next pass (HyperPod replacing it itself). Before, the next pass recorded it missing and then
    read it again to localize it: a 404 on every retry, the incident Containing for good and the
    slot (one of two, by default) held with nothing to release it."""
    ns = "gone-after-slot"
    ids, nodes, pods = start_training(world, ns, n_nodes=2)
    world.kube.reject("PATCH", node_path(nodes[1]), 500)
    try:
        world.alarm_event(ns, make_alarm(ns, "llm", check="replay", step=31, suspects=[(1, pods[1], nodes[1])],
                                         reporter=(0, pods[0], nodes[0])))
        world.wait(lambda: slot_of(world, nodes[1]), what="the slot taken")
        world.core.delete_node(nodes[1])
    finally:
        world.kube.reject("PATCH", node_path(nodes[1]), 500, times=0)
    world.wait(lambda: (world.incident(ns, "llm-replay-31").get("status") or {}).get("phase") == "Contained",
               what="Contained")
    status = world.incident(ns, "llm-replay-31")["status"]
    assert status["nodes"][nodes[1]].get("missing") is True and not status["nodes"][nodes[1]].get("replacement")
    assert slot_of(world, nodes[1]) is None


@pytest.mark.emulator
@pytest.mark.operator
def test_a_node_refused_after_a_failed_cordon_gives_the_slot_back_and_gets_no_replacement(world):
    """The slot is taken, the cordon's write refused; the suspended job's pods are gone and another
    tenant's pod lands on the node before the next pass, which refuses it (SharedNode). Before,
    the slot, still this incident's, opened a NodeReplacement (a health check, perhaps a
    replacement) of a node running another tenant's pods."""
    ns, other = "refused-after-slot", "refused-after-slot-other"
    ids, nodes, pods = start_training(world, ns, n_nodes=2)
    world.kube.reject("PATCH", node_path(nodes[1]), 500)
    try:
        world.alarm_event(ns, make_alarm(ns, "llm", check="replay", step=32, suspects=[(1, pods[1], nodes[1])],
                                         reporter=(0, pods[0], nodes[0])))
        world.wait(lambda: slot_of(world, nodes[1]), what="the slot taken")
        world.training(other, "web", [nodes[1]])
    finally:
        world.kube.reject("PATCH", node_path(nodes[1]), 500, times=0)
    world.wait(lambda: (world.incident(ns, "llm-replay-32").get("status") or {}).get("phase") == "Contained",
               what="Contained")
    status = world.incident(ns, "llm-replay-32")["status"]
    assert status["nodes"][nodes[1]].get("refused") == "SharedNode", status["nodes"]
    assert slot_of(world, nodes[1]) is None
    assert world.node_state(nodes[1]) == (False, None)
    assert [r for r in world.replacements() if r["spec"]["nodeName"] == nodes[1]] == []
