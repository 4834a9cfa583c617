"""Storm guard: with maxConcurrentSuspectNodes at its default (2), three incidents on three nodes
cordon two; the third is recorded and contained (job suspended) with the StormGuard condition, and
is cordoned once a slot frees (a denial uncordons one node).
"""
from __future__ import annotations

import pytest
from conftest import make_alarm, new_instance

pytestmark = [pytest.mark.emulator, pytest.mark.operator]


def _condition(incident: dict, type_: str) -> dict | None:
    return next((c for c in (incident.get("status") or {}).get("conditions") or [] if c["type"] == type_), None)


def test_third_suspect_node_is_held_until_a_slot_frees(make_world):
    world = make_world(via_kopf=True, admission=True)  # `kopf run -m sdcguard_operator`; the default limit, 2
    ns = "storm"
    ids = [new_instance() for _ in range(4)]
    nodes = [world.node(i) for i in ids]
    pods = world.training(ns, "llm", nodes)
    for rank in (1, 2, 3):  # three faults, three suspect nodes (different steps: three incidents)
        world.alarm_event(ns, make_alarm(ns, "llm", step=10 * rank, suspects=[(rank, pods[rank], nodes[rank])],
                                         reporter=(0, pods[0], nodes[0])))
    world.wait(lambda: len(world.incidents(ns)) == 3, what="three incidents")
    world.wait(lambda: sum(world.node_state(n) == (True, "true") for n in nodes) == 2, what="two cordoned")
    held = world.wait(lambda: [i for i in world.incidents(ns) if (_condition(i, "StormGuard") or {}).get("status") == "True"],
                      what="StormGuard condition")
    assert len(held) == 1
    held_node = held[0]["spec"]["suspects"][0]["node"]
    assert world.node_state(held_node) == (False, None)
    assert _condition(held[0], "StormGuard")["reason"] == "MaxConcurrentSuspectNodes"
    assert held_node in _condition(held[0], "StormGuard")["message"]
    assert world.job_suspended(ns, "llm")  # contained all the same
    assert world.node_state(nodes[0]) == (False, None)
    assert len(world.aws.calls("StartClusterHealthCheck", held[0]["spec"]["suspects"][0]["node"][9:])) == 0
    assert "sdcguard_storm_guard_holds_total" in world.metrics()

    cordoned = [n for n in nodes[1:] if n != held_node]
    world.wait(lambda: (world.replacement(cordoned[0]).get("status") or {}).get("phase") == "PendingApproval",
               what="PendingApproval")
    assert world.kubectl("sdcguard", "deny", cordoned[0], "--reason", "false alarm").returncode == 0
    world.wait(lambda: world.node_state(held_node) == (True, "true"), what="held node cordoned after the denial")
    world.wait(lambda: (_condition(world.incident(ns, held[0]["metadata"]["name"]), "StormGuard") or {}).get("status")
               == "False", what="StormGuard released")
    assert world.node_state(cordoned[0]) == (False, None)
    assert sum(world.node_state(n)[1] == "true" for n in nodes) == 2
