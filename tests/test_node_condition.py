"""What the rest of the cluster sees (operator/node_condition.py, operator/nvsentinel.py, operator/replacement.py).

The node condition ``SilentDataCorruptionSuspected``, set on cordon and cleared by the replacement,
a denial or a release (before the storm-guard slot is given back, never after), is tested with the real operator, the real client and kmock (the sandbox's API
emulator, which merges a strategic-merge patch's conditions by ``type`` as the API server does);
the admission policy's rule for ``nodes/status`` with cel-python; NVSentinel's ``ExternalFault``
against its published schema (tests/fixtures/nvsentinel-externalfault.crd.yaml, applied by the
emulator server-side as a real API server applies a CRD's schema); HyperPod's own
``node-health-status`` marks with the operator's flow against the local SageMaker endpoint.
"""
from __future__ import annotations

import copy
import pathlib
import re
import secrets
from typing import Any

import kmock
import pytest
import yaml
from conftest import condition, dump, new_instance, phase, start_training

from sdcguard.contract import alarm, names
from sdcguard.sandbox import crd_schema
from sdcguard.sandbox.apiserver import ALL_VERBS, strategic_merge
from sdcguard_operator import contain, node_condition, nvsentinel
from sdcguard_operator.settings import Settings

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "nvsentinel-externalfault.crd.yaml"
UUID = "GPU-8b2c1a7e-3f4d-4e5a-9b6c-0d1e2f3a4b5c"
REASON = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")  # metav1.Condition's reason


def gpu_alarm(namespace: str, job: str, step: int, suspects: list[tuple[int, str, str, dict[str, Any] | None]],
              reporter: tuple[int, str, str], check: str = "replay") -> dict[str, Any]:
    """An alarm record whose identities carry their GPUs, as the library now writes them."""
    identities: dict[int, dict[str, Any]] = {}
    for rank, pod, node, gpu in suspects:
        identities[rank] = {"rank": rank, "pod": pod, "node": node, **({"gpu": gpu} if gpu is not None else {})}
    identities[reporter[0]] = {"rank": reporter[0], "pod": reporter[1], "node": reporter[2],
                               "gpu": {"index": 0, "uuid": None}}
    return alarm.make_alarm(
        alarm_id=secrets.token_hex(6), job={"kind": "PyTorchJob", "name": job, "namespace": namespace},
        check=check, step=step, suspect_ranks=[s[0] for s in suspects], identities=identities, ambiguous=False,
        reporter_rank=reporter[0], evidence={"pairs": [[0, 1]]}, last_verified_step=step - 1,
        last_good_checkpoint="checkpoint-19.pt", suspect_window={"first_step": step - 3, "last_step": step})


def node_conditions(world, node: str) -> dict[str, dict[str, Any]]:
    status = world.core.read_node(node).to_dict().get("status") or {}
    return {c["type"]: c for c in status.get("conditions") or []}


def ours(world, node: str) -> dict[str, Any] | None:
    return node_conditions(world, node).get(names.NODE_CONDITION)


FOREIGN = [  # what kubelet and node-problem-detector keep on a node: never touched by sdcguard
    {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "kubelet is posting ready status",
     "lastHeartbeatTime": "2026-01-01T00:00:00Z", "lastTransitionTime": "2026-01-01T00:00:00Z"},
    {"type": "KernelDeadlock", "status": "False", "reason": "KernelHasNoDeadlock", "message": "kernel has no deadlock",
     "lastHeartbeatTime": "2026-01-01T00:00:00Z", "lastTransitionTime": "2026-01-01T00:00:00Z"},
]


def with_foreign_conditions(world, node: str) -> None:
    world.core.patch_node_status(node, {"status": {"conditions": copy.deepcopy(FOREIGN)}})


def foreign_kept(world, node: str) -> bool:
    found = node_conditions(world, node)
    return all({k: str(v) for k, v in found[c["type"]].items() if v is not None and k != "last_heartbeat_time"}
               == {k: str(v) for k, v in _snake(c).items() if k != "last_heartbeat_time"} for c in FOREIGN)


def _snake(c: dict[str, Any]) -> dict[str, Any]:
    """A condition as the client's to_dict() spells it (snake case, datetimes)."""
    import datetime
    out = {}
    for key, value in c.items():
        name = re.sub(r"([A-Z])", lambda m: "_" + m.group(1).lower(), key)
        out[name] = datetime.datetime.fromisoformat(value.replace("Z", "+00:00")) if name.endswith("_time") else value
    return out


# -- pure parts ------------------------------------------------------------------------------------


@pytest.mark.parametrize("check,expected", [("replay", "Replay"), ("nonfinite-local", "NonfiniteLocal"),
                                            ("reduce-checksum", "ReduceChecksum"), ("weights", "Weights"),
                                            ("4xx", "Check4xx")])
def test_the_reason_is_the_check_in_camel_case(check: str, expected: str) -> None:
    assert node_condition.reason(check) == expected
    assert REASON.match(node_condition.reason(check))


def test_the_transition_time_moves_only_when_the_status_flips() -> None:
    first = node_condition.entry(True, "Replay", "m", None, "2026-01-01T00:00:00Z")
    assert first["lastTransitionTime"] == first["lastHeartbeatTime"] == "2026-01-01T00:00:00Z"
    again = node_condition.entry(True, "Replay", "m2", first, "2026-01-01T00:05:00Z")
    assert (again["lastTransitionTime"], again["lastHeartbeatTime"]) == ("2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z")
    cleared = node_condition.entry(False, "Replaced", "m3", again, "2026-01-01T01:00:00Z")
    assert cleared["lastTransitionTime"] == "2026-01-01T01:00:00Z" and cleared["status"] == "False"
    assert cleared["type"] == names.NODE_CONDITION == "SilentDataCorruptionSuspected"


def test_the_message_names_job_ranks_gpus_step_and_incident() -> None:
    spec = {"job": {"namespace": "ml", "name": "llm"}, "check": "replay", "step": 40,
            "suspects": [{"rank": 9, "node": "n2", "gpu": {"index": 1, "uuid": UUID}},
                         {"rank": 8, "node": "n2", "gpu": {"index": 0, "uuid": None}},
                         {"rank": 3, "node": "n1"}]}
    text = node_condition.message("ml/llm-replay-40", spec, "n2")
    assert text == (f"sdcguard replay check at step 40: job ml/llm, rank 9 on GPU 1 ({UUID}); rank 8 on GPU 0; "
                    "incident ml/llm-replay-40")
    assert "rank 3 on" not in node_condition.message("ml/llm-replay-40", spec, "n1")  # no GPU named: no GPU said


def test_a_long_message_keeps_the_incident_it_speaks_for() -> None:
    spec = {"job": {"namespace": "ml", "name": "llm"}, "check": "replay", "step": 40,
            "suspects": [{"rank": r, "node": "n2", "gpu": {"index": r % 8, "uuid": UUID}} for r in range(64)]}
    text = node_condition.message("ml/llm-replay-40", spec, "n2")
    assert len(text) == node_condition.MESSAGE_MAX and text.endswith("; incident ml/llm-replay-40")
    assert node_condition.incident_of({"message": text}) == "ml/llm-replay-40"
    assert node_condition.incident_of({"message": "set by hand"}) is None and node_condition.incident_of(None) is None


def test_announced_is_true_for_the_incident_or_cleared_for_it_never_a_stale_false() -> None:
    import kubernetes

    def node(status: str | None, ref: str = "ml/a") -> Any:
        conditions = [] if status is None else [kubernetes.client.V1NodeCondition(
            type=names.NODE_CONDITION, status=status, reason="Replay", message=f"x; incident {ref}")]
        return kubernetes.client.V1Node(status=kubernetes.client.V1NodeStatus(conditions=conditions))
    assert node_condition.announced(node("True"), "ml/a") and node_condition.announced(node("True", "ml/b"), "ml/a")
    assert node_condition.announced(node("False"), "ml/a")  # cleared for it: given back, not set again
    assert not node_condition.announced(node("False", "ml/old"), "ml/a")  # an earlier incident's: set again
    assert not node_condition.announced(node(None), "ml/a")


def test_a_strategic_merge_patch_merges_conditions_by_type() -> None:
    """The emulator's server-side strategic merge (what the API server does for a node's
    ``status.conditions``, patchMergeKey ``type``), not a merge patch's whole-list replacement."""
    node = {"metadata": {"name": "n"}, "status": {"conditions": copy.deepcopy(FOREIGN), "capacity": {"cpu": "8"}}}
    ours_true = node_condition.entry(True, "Replay", "m", None, "2026-01-02T00:00:00Z")
    merged = strategic_merge(node, {"status": {"conditions": [ours_true]}}, {("status", "conditions"): "type"})
    assert merged["status"]["conditions"] == FOREIGN + [ours_true] and merged["status"]["capacity"] == {"cpu": "8"}
    ours_false = node_condition.entry(False, "Denied", "m", ours_true, "2026-01-03T00:00:00Z")
    merged = strategic_merge(merged, {"status": {"conditions": [ours_false]}}, {("status", "conditions"): "type"})
    assert merged["status"]["conditions"] == FOREIGN + [ours_false]


def test_the_library_names_each_ranks_gpu() -> None:
    """What every rank sends at start-up (checks/topology.py): on CPU the local slot and no UUID; a
    CUDA UUID (cudaDeviceProp.uuid, 16 bytes) printed as nvidia-smi and dcgm-exporter print it."""
    import torch

    from sdcguard.checks.topology import identity, local_gpu, uuid_text

    assert local_gpu(torch.device("cpu"), 3) == {"index": 3, "uuid": None}
    assert local_gpu(None, 0) == {"index": 0, "uuid": None}
    raw = bytes.fromhex("8b2c1a7e3f4d4e5a9b6c0d1e2f3a4b5c")
    assert uuid_text(raw) == UUID and alarm.GPU_UUID.match(uuid_text(raw))
    who = identity(2, "llm-worker-2", "n1", "uid-2", local_gpu(torch.device("cpu"), 2))
    assert who == {"rank": 2, "pod": "llm-worker-2", "node": "n1", "pod_uid": "uid-2", "gpu": {"index": 2, "uuid": None}}
    assert "gpu" not in identity(2, None, None, None)


# -- NVSentinel's ExternalFault against its published schema ----------------------------------------


@pytest.fixture(scope="module")
def nvsentinel_crd() -> dict[str, Any]:
    return yaml.safe_load(FIXTURE.read_text())


def _schema_problems(obj: dict[str, Any], crd: dict[str, Any]) -> list[str]:
    """What an API server serving ``crd`` would refuse (422) or prune (unknown fields) of ``obj``."""
    dropped: list[str] = []
    errors: list[str] = []
    crd_schema.prune(obj, crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"], "", dropped, errors, root=True)
    return errors + [f"pruned: {p}" for p in dropped]


def test_the_external_fault_has_nvsentinels_published_shape(nvsentinel_crd) -> None:
    spec = {"job": {"namespace": "ml", "name": "llm"}, "check": "replay", "step": 40, "alarmId": "abc",
            "suspects": [{"rank": 9, "node": "n2", "gpu": {"index": 1, "uuid": UUID}},
                         {"rank": 8, "node": "n2", "gpu": {"index": 0, "uuid": None}}]}
    fault = nvsentinel.external_fault("ml/llm-replay-40", spec, "n2", "2026-01-01T00:00:00Z")
    crd = nvsentinel_crd["spec"]
    assert fault["apiVersion"] == f"{crd['group']}/{crd['versions'][0]['name']}"
    assert (fault["kind"], names.NVSENTINEL_PLURAL, crd["scope"]) == (crd["names"]["kind"], crd["names"]["plural"],
                                                                      "Cluster")
    assert _schema_problems(fault, nvsentinel_crd) == [], dump(fault)
    event = fault["spec"]["healthEvent"]
    assert event["nodeName"] == "n2" and event["isFatal"] and not event["isHealthy"]
    assert event["entitiesImpacted"] == [{"entityType": "GPU", "entityValue": "1"},
                                         {"entityType": "GPU_UUID", "entityValue": UUID},
                                         {"entityType": "GPU", "entityValue": "0"}]
    assert "rank 9 on GPU 1" in event["message"] and event["metadata"]["incident"] == "ml/llm-replay-40"
    # told, not asked (NVSentinel's ADR-025): stored and exported, never quarantined, drained or remediated
    strategies = nvsentinel_crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"]["healthEvent"]["properties"]["processingStrategy"]["enum"]
    assert event["processingStrategy"] == "STORE_ONLY" and "STORE_ONLY" in strategies
    assert len(fault["metadata"]["name"]) <= 253 and re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?",
                                                                   fault["metadata"]["name"])
    # the check can fail: NVSentinel's schema refuses what it does not know
    wrong = copy.deepcopy(fault)
    wrong["spec"]["healthEvent"]["recommendedAction"] = "REPLACE_GPU"
    wrong["spec"]["healthEvent"]["gpu"] = 1
    assert len(_schema_problems(wrong, nvsentinel_crd)) == 2


# -- the admission policy: nodes/status, this condition only ------------------------------------------


@pytest.fixture(scope="module")
def policy() -> dict[str, Any]:
    from test_chart import render
    from test_security_round3 import RELEASE_NS
    [vap] = [d for d in render(["--set", "rbac.clusterWideSecrets=true"], namespace=RELEASE_NS)
             if d["kind"] == "ValidatingAdmissionPolicy"]
    return vap


def _node(conditions: list[dict[str, Any]], **status: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": "hyperpod-i-0abc", "labels": {"sagemaker.amazonaws.com/cluster-name": "c"}},
            "spec": {"providerID": "aws:///us-west-2a/i-0abc"},
            "status": {"conditions": conditions, "capacity": {"nvidia.com/gpu": "8"},
                       "addresses": [{"type": "InternalIP", "address": "10.0.0.7"}], **status}}


def test_the_policy_lets_the_operator_change_only_its_condition_in_a_node_status(policy) -> None:
    from test_security_round3 import OPERATOR_SA, _admit

    def request(user: str = OPERATOR_SA, sub: str | None = "status") -> dict[str, Any]:
        return {"operation": "UPDATE", "namespace": "", "userInfo": {"username": user}, "subResource": sub,
                "resource": {"group": "", "version": "v1", "resource": "nodes"}}

    suspected = node_condition.entry(True, "Replay", "m", None, "2026-01-02T00:00:00Z")
    old = _node(copy.deepcopy(FOREIGN))
    new = _node(copy.deepcopy(FOREIGN) + [suspected])
    assert _admit(policy, request(), new, old) == []
    cleared = _node(copy.deepcopy(FOREIGN) + [node_condition.entry(False, "Denied", "m", suspected, "2026-01-03T00:00:00Z")])
    assert _admit(policy, request(), cleared, new) == []

    not_ready = copy.deepcopy(new)
    not_ready["status"]["conditions"][0]["status"] = "False"  # NodeHealthCheck would remediate it
    gone = _node(copy.deepcopy(FOREIGN[1:]) + [suspected])
    foreign_type = _node(copy.deepcopy(FOREIGN) + [suspected, {**suspected, "type": "GpuHealthy"}])
    more_gpus = _node(copy.deepcopy(FOREIGN) + [suspected], capacity={"nvidia.com/gpu": "16"})
    redirected = _node(copy.deepcopy(FOREIGN) + [suspected], addresses=[{"type": "InternalIP", "address": "10.6.6.6"}])
    relabelled = copy.deepcopy(new)
    relabelled["metadata"]["labels"]["node-role.kubernetes.io/control-plane"] = ""
    for forbidden in (not_ready, gone, foreign_type, more_gpus, redirected, relabelled):
        assert _admit(policy, request(), forbidden, old) != [], dump(forbidden)
    assert _admit(policy, request(user="kubelet"), not_ready, old) == ["(not matched)"]
    assert _admit(policy, request(sub=None), new, old) == ["(not matched)"]  # cordon/label: the node itself


def test_the_chart_grants_node_status_patch_and_nvsentinel_only_when_enabled() -> None:
    from test_chart import by_kind, render

    def granted(docs: list[dict[str, Any]]) -> dict[str, set[tuple[str, str, str]]]:
        return {r["metadata"]["name"]: {(g, res, v) for rule in r["rules"] for g in rule["apiGroups"]
                                        for res in rule["resources"] for v in rule["verbs"]}
                for r in by_kind(docs, "ClusterRole")}

    default = render(["--set", "rbac.clusterWideSecrets=true"])
    assert ("", "nodes/status", "patch") in granted(default)["sdcguard-operator"]
    assert not any(g == names.NVSENTINEL_GROUP for rules in granted(default).values() for g, _, _ in rules)
    enabled = render(["--set", "rbac.clusterWideSecrets=true", "--set", "nvsentinel.externalFault.enabled=true"])
    assert granted(enabled)["sdcguard-nvsentinel"] == {(names.NVSENTINEL_GROUP, names.NVSENTINEL_PLURAL, "create")}
    assert any(b["roleRef"]["name"] == "sdcguard-nvsentinel" for b in by_kind(enabled, "ClusterRoleBinding"))
    [deployment] = by_kind(enabled, "Deployment")
    env = {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env[names.ENV_NVSENTINEL_EXTERNAL_FAULT] == "true"


# -- the operator: condition set on cordon, cleared by the replacement or a denial --------------------


@pytest.mark.emulator
@pytest.mark.operator
def test_cordon_sets_the_condition_and_the_replacement_clears_it(world):
    ns = "condition-replaced"
    ids, nodes, pods = start_training(world, ns, n_nodes=2)
    with_foreign_conditions(world, nodes[1])
    world.aws.script(ids[1], replace=["ok"], replace_polls=1)
    world.alarm_event(ns, gpu_alarm(ns, "llm", 40, [(1, pods[1], nodes[1], {"index": 3, "uuid": UUID})],
                                    (0, pods[0], nodes[0])))
    found = world.wait(lambda: ours(world, nodes[1]), what="the node condition")
    assert (found["status"], found["reason"]) == ("True", "Replay"), dump(found)
    assert found["message"] == (f"sdcguard replay check at step 40: job {ns}/llm, rank 1 on GPU 3 ({UUID}); "
                                f"incident {ns}/llm-replay-40")
    assert found["last_heartbeat_time"] and found["last_transition_time"]
    assert foreign_kept(world, nodes[1]), dump(node_conditions(world, nodes[1]))
    assert ours(world, nodes[0]) is None  # the reporter's node is not suspect
    incident = world.incident(ns, "llm-replay-40")
    assert incident["spec"]["suspects"][0]["gpu"] == {"index": 3, "uuid": UUID}
    listed = world.kubectl("sdcguard", "incidents")
    assert f"{nodes[1]}/gpu3({UUID})" in listed.stdout, listed.stdout + listed.stderr

    world.wait(lambda: phase(world, nodes[1]) == "PendingApproval", what="PendingApproval")
    assert world.kubectl("sdcguard", "approve", nodes[1]).returncode == 0
    world.wait(lambda: phase(world, nodes[1]) == "Replaced", what="Replaced")
    cleared = world.wait(lambda: (ours(world, nodes[1]) or {}).get("status") == "False" and ours(world, nodes[1]),
                         what="the condition cleared")
    assert cleared["reason"] == "Replaced" and ids[1] in cleared["message"], dump(cleared)
    assert cleared["last_transition_time"] > found["last_transition_time"]
    assert foreign_kept(world, nodes[1])


@pytest.mark.emulator
@pytest.mark.operator
def test_a_denial_clears_the_condition(world):
    ns = "condition-denied"
    ids, nodes, pods = start_training(world, ns, n_nodes=2)
    world.alarm_event(ns, gpu_alarm(ns, "llm", 12, [(1, pods[1], nodes[1], {"index": 0, "uuid": None})],
                                    (0, pods[0], nodes[0]), check="nonfinite-local"))
    found = world.wait(lambda: ours(world, nodes[1]), what="the node condition")
    assert (found["status"], found["reason"]) == ("True", "NonfiniteLocal") and "rank 1 on GPU 0;" in found["message"]
    world.wait(lambda: phase(world, nodes[1]) == "PendingApproval", what="PendingApproval")
    assert world.kubectl("sdcguard", "deny", nodes[1], "--reason", "false alarm").returncode == 0
    world.wait(lambda: phase(world, nodes[1]) == "Denied", what="Denied")
    cleared = world.wait(lambda: (ours(world, nodes[1]) or {}).get("status") == "False" and ours(world, nodes[1]),
                         what="the condition cleared")
    assert cleared["reason"] == "Denied" and "denied by tester: false alarm" in cleared["message"], dump(cleared)
    assert world.node_state(nodes[1]) == (False, None)


def status_path(node: str) -> str:
    return f"/api/v1/nodes/{node}/status"


def put_slot(world, node: str, value: str | None) -> None:
    """Write (or, with None, remove) a node's storm-guard slot as the operator's ledger holds it."""
    import kubernetes

    namespace = contain.ledger_namespace(Settings.from_env(world.operator_env))
    try:
        world.core.patch_namespaced_config_map(contain.LEDGER, namespace, {"data": {node: value}})
    except kubernetes.client.ApiException as exc:
        if exc.status != 404:
            raise
        world.core.create_namespaced_config_map(namespace, {"metadata": {"name": contain.LEDGER, "namespace": namespace},
                                                            "data": {node: value} if value else {}})


def slot_of(world, node: str) -> str | None:
    settings = Settings.from_env(world.operator_env)
    ledger = world.core.read_namespaced_config_map(contain.LEDGER, contain.ledger_namespace(settings))
    return (ledger.data or {}).get(node)


@pytest.mark.emulator
@pytest.mark.operator
@pytest.mark.slow  # the failure paths: make test-slow
def test_the_slot_is_kept_until_the_condition_is_cleared(world):
    """A denial clears the condition before it gives the node back: while the API refuses the node's
    status write, the node stays cordoned, labelled and in its slot (with the old order, release
    then a best-effort clear, it was given back with the condition left True for good)."""
    import time

    ns = "condition-clear-fails"
    ids, nodes, pods = start_training(world, ns, n_nodes=2)
    world.alarm_event(ns, gpu_alarm(ns, "llm", 13, [(1, pods[1], nodes[1], None)], (0, pods[0], nodes[0])))
    world.wait(lambda: (ours(world, nodes[1]) or {}).get("status") == "True", what="the node condition")
    world.wait(lambda: phase(world, nodes[1]) == "PendingApproval", what="PendingApproval")
    world.kube.reject("PATCH", status_path(nodes[1]), 500)
    try:
        assert world.kubectl("sdcguard", "deny", nodes[1], "--reason", "false alarm").returncode == 0
        world.wait(lambda: (world.replacement(nodes[1]).get("status") or {}).get("decision"), what="the decision")
        time.sleep(2)  # several passes of the replacement's timer, each refused
        assert phase(world, nodes[1]) == "PendingApproval"
        assert world.node_state(nodes[1]) == (True, "true") and slot_of(world, nodes[1]) is not None
        assert ours(world, nodes[1])["status"] == "True"
    finally:
        world.kube.reject("PATCH", status_path(nodes[1]), 500, times=0)
    world.wait(lambda: phase(world, nodes[1]) == "Denied", what="Denied")
    cleared = ours(world, nodes[1])
    assert (cleared["status"], cleared["reason"]) == ("False", "Denied"), dump(cleared)
    assert cleared["message"].endswith(f"; incident {ns}/llm-replay-13"), cleared["message"]
    assert world.node_state(nodes[1]) == (False, None) and slot_of(world, nodes[1]) is None


@pytest.mark.emulator
@pytest.mark.operator
@pytest.mark.slow  # the failure paths: make test-slow
def test_a_lost_condition_write_is_made_again_while_the_replacement_waits(world):
    """The cordon's condition write is best effort: refused once by the API, the node is cordoned
    all the same, and the open replacement's timer sets the condition (before, it never was)."""
    ns = "condition-lost-write"
    ids, nodes, pods = start_training(world, ns, n_nodes=2)
    world.kube.reject("PATCH", status_path(nodes[1]), 500, times=1)
    world.alarm_event(ns, gpu_alarm(ns, "llm", 18, [(1, pods[1], nodes[1], None)], (0, pods[0], nodes[0])))
    world.wait(lambda: world.node_state(nodes[1]) == (True, "true"), what="cordoned")
    found = world.wait(lambda: (ours(world, nodes[1]) or {}).get("status") == "True" and ours(world, nodes[1]),
                       what="the condition set by the replacement")
    assert found["message"].endswith(f"; incident {ns}/llm-replay-18"), dump(found)
    assert ("PATCH", status_path(nodes[1])) not in world.kube.emulator.rejections  # the refusal was used up


@pytest.mark.emulator
@pytest.mark.operator
@pytest.mark.slow  # the failure paths: make test-slow
def test_a_denial_clears_a_condition_left_true_without_a_slot(world):
    """The state a crash between release and clear left behind (the order before this fix), or an
    admin's hand release: no slot, no label, the condition still True for this replacement's
    incident. The denial clears it rather than leaving the node "as it is"."""
    ns = "condition-stale-true"
    ids, nodes, pods = start_training(world, ns, n_nodes=2)
    world.alarm_event(ns, gpu_alarm(ns, "llm", 14, [(1, pods[1], nodes[1], None)], (0, pods[0], nodes[0])))
    world.wait(lambda: phase(world, nodes[1]) == "PendingApproval", what="PendingApproval")
    put_slot(world, nodes[1], None)
    world.core.patch_node(nodes[1], {"spec": {"unschedulable": None},
                                     "metadata": {"labels": {names.SUSPECT_LABEL: None}}})
    assert ours(world, nodes[1])["status"] == "True"
    assert world.kubectl("sdcguard", "deny", nodes[1], "--reason", "false alarm").returncode == 0
    world.wait(lambda: phase(world, nodes[1]) == "Denied", what="Denied")
    cleared = world.wait(lambda: (ours(world, nodes[1]) or {}).get("status") == "False" and ours(world, nodes[1]),
                         what="the stale condition cleared")
    assert cleared["reason"] == "Denied" and "denied by tester: false alarm" in cleared["message"], dump(cleared)


@pytest.mark.emulator
@pytest.mark.operator
@pytest.mark.slow  # the failure paths: make test-slow
def test_a_release_after_a_failed_replacement_clears_the_condition(world):
    """``kubectl sdcguard release`` gives a Failed replacement's slot back: the condition goes
    ``False`` (reason ``Released``, who and why) though the node stays cordoned, since sdcguard no
    longer holds it (a True left there would have NodeHealthCheck act on a node a person took over)."""
    ns = "condition-released"
    ids, nodes, pods = start_training(world, ns, n_nodes=2)
    world.aws.script(ids[1], replace=["not-found"])
    world.alarm_event(ns, gpu_alarm(ns, "llm", 15, [(1, pods[1], nodes[1], None)], (0, pods[0], nodes[0])))
    world.wait(lambda: phase(world, nodes[1]) == "PendingApproval", what="PendingApproval")
    assert world.kubectl("sdcguard", "approve", nodes[1]).returncode == 0
    world.wait(lambda: phase(world, nodes[1]) == "Failed", what="Failed")
    assert ours(world, nodes[1])["status"] == "True"  # failed: the hardware is still suspect, still held
    done = world.kubectl("sdcguard", "release", nodes[1], "--reason", "retired by AWS support")
    assert done.returncode == 0, done.stdout + done.stderr
    cleared = world.wait(lambda: (ours(world, nodes[1]) or {}).get("status") == "False" and ours(world, nodes[1]),
                         what="the condition cleared")
    assert cleared["reason"] == "Released", dump(cleared)
    assert "released by tester: retired by AWS support" in cleared["message"], cleared["message"]
    world.wait(lambda: (world.replacement(nodes[1]).get("status") or {}).get("released"), what="released")
    assert world.node_state(nodes[1]) == (True, None) and slot_of(world, nodes[1]) is None


@pytest.mark.emulator
@pytest.mark.operator
@pytest.mark.slow  # the failure paths: make test-slow
def test_a_stale_false_from_an_earlier_incident_is_set_true_again(world):
    """A node cordoned and labelled for an incident whose condition write a restart (or an API
    error) took, and which still shows the ``False`` an earlier incident's denial left: the
    incident's cordon pass finds its slot and sets the condition ``True`` again (before, only a
    node with no condition at all was announced again)."""
    ns = "condition-stale-false"
    ids, nodes, pods = start_training(world, ns, n_nodes=2)
    ref = f"{ns}/llm-replay-16"
    put_slot(world, nodes[1], contain.slot_value(ref, "llm"))
    world.core.patch_node(nodes[1], {"spec": {"unschedulable": True},
                                     "metadata": {"labels": {names.SUSPECT_LABEL: "true"},
                                                  "annotations": {names.INCIDENT_ANNOTATION: ref}}})
    world.core.patch_node_status(nodes[1], {"status": {"conditions": [node_condition.entry(
        False, node_condition.DENIED, f"denied by someone (NodeReplacement x); incident {ns}/llm-replay-3", None,
        "2026-01-01T00:00:00Z")]}})
    world.alarm_event(ns, gpu_alarm(ns, "llm", 16, [(1, pods[1], nodes[1], None)], (0, pods[0], nodes[0])))
    found = world.wait(lambda: (ours(world, nodes[1]) or {}).get("status") == "True" and ours(world, nodes[1]),
                       what="the condition set True again")
    assert found["reason"] == "Replay" and found["message"].endswith(f"; incident {ref}"), dump(found)


@pytest.mark.emulator
@pytest.mark.operator
@pytest.mark.slow  # the failure paths: make test-slow
def test_a_node_that_cannot_be_localized_keeps_the_condition_while_held(world, monkeypatch):
    """A node sdcguard cordoned but cannot tie to an instance (``NotLocalized``) gets no
    NodeReplacement and keeps its slot: the condition stays ``True`` while sdcguard holds it, and
    whatever gives the slot back (``contain.release``) clears it first (reason ``Released``)."""
    import time

    from sdcguard_operator import kube as operator_kube

    ns = "condition-not-localized"
    ids = [new_instance() for _ in range(2)]
    nodes = [world.node(ids[0]), world.node(name=f"gpu-{ids[1]}", labelled=False, register=False)]
    pods = world.training(ns, "llm", nodes)
    world.alarm_event(ns, gpu_alarm(ns, "llm", 17, [(1, pods[1], nodes[1], None)], (0, pods[0], nodes[0])))
    world.wait(lambda: ((world.incident(ns, "llm-replay-17").get("status") or {}).get("nodes") or {})
               .get(nodes[1], {}).get("localizeError"), what="NotLocalized")
    world.wait(lambda: (world.incident(ns, "llm-replay-17").get("status") or {}).get("phase") == "Contained",
               what="Contained")
    world.wait(lambda: announced(world, ns, "llm-replay-17", nodes[1]), what="the condition recorded as set")
    time.sleep(1)
    assert ours(world, nodes[1])["status"] == "True" and world.node_state(nodes[1]) == (True, "true")
    assert [r for r in world.replacements() if (r.get("spec") or {}).get("nodeName") == nodes[1]] == []

    monkeypatch.setattr(operator_kube, "_client", world.kube.api_client())  # the operator's code, in-process
    assert contain.release(nodes[1], Settings.from_env(world.operator_env), keep_cordoned=True, text="given back")
    cleared = ours(world, nodes[1])
    assert (cleared["status"], cleared["reason"]) == ("False", "Released"), dump(cleared)
    assert cleared["message"] == f"given back; incident {ns}/llm-replay-17"
    assert world.node_state(nodes[1]) == (True, None) and slot_of(world, nodes[1]) is None


def announced(world, ns: str, incident: str, node: str) -> bool:
    return bool((((world.incident(ns, incident).get("status") or {}).get("nodes") or {}).get(node) or {}).get("announced"))


@pytest.mark.emulator
@pytest.mark.operator
def test_a_lost_condition_write_is_made_again_for_a_node_that_cannot_be_localized(world):
    """A node with no NodeReplacement (not localized) has no replacement timer to set a lost
    condition again: the incident's own timer does, then records it (and stops). Before, the
    cordon's one best-effort write was all, and a refusal left the held node without it for good."""
    ns = "condition-lost-not-localized"
    ids = [new_instance() for _ in range(2)]
    # named for its instance, which SageMaker does not know: NotLocalized at the first AWS answer
    # (a node named otherwise is looked for in every instance of the cluster, one call each)
    nodes = [world.node(ids[0]), world.node(ids[1], labelled=False, register=False)]
    pods = world.training(ns, "llm", nodes)
    world.kube.reject("PATCH", status_path(nodes[1]), 500, times=2)
    world.alarm_event(ns, gpu_alarm(ns, "llm", 19, [(1, pods[1], nodes[1], None)], (0, pods[0], nodes[0])))
    world.wait(lambda: ((world.incident(ns, "llm-replay-19").get("status") or {}).get("nodes") or {})
               .get(nodes[1], {}).get("localizeError"), what="NotLocalized")
    world.wait(lambda: announced(world, ns, "llm-replay-19", nodes[1]), what="the condition set by the incident's timer")
    found = ours(world, nodes[1])
    assert found["status"] == "True" and found["message"].endswith(f"; incident {ns}/llm-replay-19"), dump(found)
    assert ("PATCH", status_path(nodes[1])) not in world.kube.emulator.rejections  # both refusals were used up
    assert world.node_state(nodes[1]) == (True, "true")
    assert [r for r in world.replacements() if (r.get("spec") or {}).get("nodeName") == nodes[1]] == []


# -- HyperPod already acting on the node --------------------------------------------------------------


@pytest.mark.emulator
@pytest.mark.operator
def test_hyperpods_pending_replacement_is_followed_not_asked_for_again(world):
    ns = "hyperpod-replacing"
    ids, nodes, pods = start_training(world, ns, n_nodes=2)
    world.core.patch_node(nodes[1], {"metadata": {"labels": {names.HYPERPOD_HEALTH_LABEL: "UnschedulablePendingReplacement"}}})
    world.alarm_event(ns, gpu_alarm(ns, "llm", 7, [(1, pods[1], nodes[1], None)], (0, pods[0], nodes[0])))
    world.wait(lambda: phase(world, nodes[1]) == "PendingApproval", what="PendingApproval")
    status = world.wait(lambda: (world.replacement(nodes[1])["status"].get("hyperPod") and
                                 world.replacement(nodes[1])["status"]), what="HyperPod's mark recorded")
    assert status["hyperPod"]["nodeHealthStatus"] == "UnschedulablePendingReplacement", dump(status)
    assert condition(world.replacement(nodes[1]), "HyperPodActing")["status"] == "True"
    assert world.kubectl("sdcguard", "approve", nodes[1]).returncode == 0
    world.wait(lambda: phase(world, nodes[1]) == "Replacing", what="Replacing")
    replace = world.replacement(nodes[1])["status"]["replace"]
    assert replace["byHyperPod"] == "UnschedulablePendingReplacement" and replace["requestedAt"], dump(replace)
    assert world.aws.calls("BatchReplaceClusterNodes", ids[1]) == []
    world.wait(lambda: "ReplacementHyperPodReplacing" in [t["event"] for t in world.incident(ns, "llm-replay-7")
                                                           ["status"]["timeline"]], what="the incident noted it")
    assert world.aws.calls("BatchReplaceClusterNodes", ids[1]) == []


@pytest.mark.emulator
@pytest.mark.operator
@pytest.mark.slow  # the failure paths: make test-slow
def test_hyperpods_pending_reboot_is_waited_for(world):
    """A reboot does not take the suspect GPU out of the cluster: the approved replacement waits
    while HyperPod reboots the node, and is asked for once the mark is gone."""
    import time

    ns = "hyperpod-reboot"
    ids, nodes, pods = start_training(world, ns, n_nodes=2)
    world.aws.script(ids[1], replace=["ok"], replace_polls=1)
    world.core.patch_node(nodes[1], {"metadata": {"labels": {names.HYPERPOD_HEALTH_LABEL: "UnschedulablePendingReboot"}}})
    world.alarm_event(ns, gpu_alarm(ns, "llm", 8, [(1, pods[1], nodes[1], None)], (0, pods[0], nodes[0])))
    world.wait(lambda: phase(world, nodes[1]) == "PendingApproval", what="PendingApproval")
    world.wait(lambda: world.replacement(nodes[1])["status"].get("hyperPod"), what="HyperPod's mark recorded")
    assert world.kubectl("sdcguard", "approve", nodes[1]).returncode == 0
    time.sleep(3)  # ten polls of the replacement's timer
    assert phase(world, nodes[1]) == "PendingApproval" and world.aws.calls("BatchReplaceClusterNodes", ids[1]) == []
    world.core.patch_node(nodes[1], {"metadata": {"labels": {names.HYPERPOD_HEALTH_LABEL: "Schedulable"}}})
    world.wait(lambda: phase(world, nodes[1]) in ("Replacing", "Replaced"), what="replaced once the reboot is over")
    assert len(world.aws.calls("BatchReplaceClusterNodes", ids[1])) == 1
    events = [t["event"] for t in world.replacement(nodes[1])["status"]["timeline"]]
    assert "HyperPodActing" in events and "HyperPodDone" in events, events


@pytest.mark.emulator
@pytest.mark.operator
@pytest.mark.slow  # the failure paths: make test-slow
def test_a_replacement_hyperpod_hands_back_is_asked_for(world):
    """Left to HyperPod (its ``UnschedulablePendingReplacement`` mark), the approved replacement
    waits while the mark stands; once the mark is gone and the instance still runs, HyperPod did
    not replace it, and sdcguard asks for it itself (before, it stayed Replacing forever)."""
    import time

    ns = "hyperpod-handback"
    ids, nodes, pods = start_training(world, ns, n_nodes=2)
    world.aws.script(ids[1], replace=["ok"], replace_polls=1)
    world.core.patch_node(nodes[1], {"metadata": {"labels": {names.HYPERPOD_HEALTH_LABEL: "UnschedulablePendingReplacement"}}})
    world.alarm_event(ns, gpu_alarm(ns, "llm", 9, [(1, pods[1], nodes[1], None)], (0, pods[0], nodes[0])))
    world.wait(lambda: phase(world, nodes[1]) == "PendingApproval", what="PendingApproval")
    world.wait(lambda: world.replacement(nodes[1])["status"].get("hyperPod"), what="HyperPod's mark recorded")
    assert world.kubectl("sdcguard", "approve", nodes[1]).returncode == 0
    world.wait(lambda: phase(world, nodes[1]) == "Replacing", what="Replacing")
    time.sleep(2)  # HyperPod still marks it: followed, nothing asked for
    assert phase(world, nodes[1]) == "Replacing" and world.aws.calls("BatchReplaceClusterNodes", ids[1]) == []
    world.core.patch_node(nodes[1], {"metadata": {"labels": {names.HYPERPOD_HEALTH_LABEL: "Schedulable"}}})
    world.wait(lambda: phase(world, nodes[1]) == "Replaced", what="replaced by sdcguard's own request")
    assert len(world.aws.calls("BatchReplaceClusterNodes", ids[1])) == 1
    status = world.replacement(nodes[1])["status"]
    assert "byHyperPod" not in status["replace"] and status["replace"]["requestedAt"], dump(status["replace"])
    assert [t["event"] for t in status["timeline"]].count("ReplaceRequested") == 1, dump(status["timeline"])
    assert "HyperPodDone" in [t["event"] for t in status["timeline"]]
    assert (ours(world, nodes[1]) or {}).get("reason") == "Replaced"


# -- NVSentinel enabled: an ExternalFault for the suspect GPU -----------------------------------------


@pytest.mark.emulator
@pytest.mark.operator
def test_an_external_fault_is_created_for_the_suspect_gpu(make_world, nvsentinel_crd, monkeypatch):
    """With ``SDCGUARD_NVSENTINEL_EXTERNAL_FAULT``, the cordon also creates NVSentinel's
    ExternalFault, which the emulator stores under NVSentinel's published schema (an unknown field
    would be pruned and fail the module, a wrong type answered 422)."""
    world = make_world(start=False, SDCGUARD_NVSENTINEL_EXTERNAL_FAULT="true")
    plural = names.NVSENTINEL_PLURAL
    world.kube.emulator.resources[f"{names.NVSENTINEL_GROUP}/{names.NVSENTINEL_VERSION}/{plural}"] = \
        kmock.ResourceInfo(kind=names.NVSENTINEL_KIND, namespaced=False, singular="externalfault", verbs=ALL_VERBS,
                           shortnames=("ef",), subresources=("status",))
    monkeypatch.setitem(crd_schema.SCHEMAS, plural, nvsentinel_crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
    world.start_operator()
    ns = "nvsentinel"
    ids, nodes, pods = start_training(world, ns, n_nodes=2)
    world.alarm_event(ns, gpu_alarm(ns, "llm", 40, [(1, pods[1], nodes[1], {"index": 5, "uuid": UUID})],
                                    (0, pods[0], nodes[0])))
    world.wait(lambda: ours(world, nodes[1]), what="the node condition")

    def faults() -> list[dict[str, Any]]:
        return world.custom.list_cluster_custom_object(names.NVSENTINEL_GROUP, names.NVSENTINEL_VERSION,
                                                       plural)["items"]
    [fault] = world.wait(faults, what="the ExternalFault")
    assert _schema_problems(fault, nvsentinel_crd) == [], dump(fault)
    event = fault["spec"]["healthEvent"]
    assert event["nodeName"] == nodes[1] and event["agent"] == "sdcguard"
    assert {"entityType": "GPU_UUID", "entityValue": UUID} in event["entitiesImpacted"]
    assert {"entityType": "GPU", "entityValue": "5"} in event["entitiesImpacted"]
    assert fault["metadata"]["annotations"][names.INCIDENT_ANNOTATION] == f"{ns}/llm-replay-40"
    assert [p for p in world.kube.emulator.pruned if p.startswith(plural)] == []
