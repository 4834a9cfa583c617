"""Approval at admission (docs/design.md §6): AdmissionReviews for NodeReplacements over HTTPS to kopf's real
admission server, exactly as the API server sends them, and the CRD's own validation rules.

The operator runs in a thread with only the NodeReplacement admission handler registered. The
SubjectAccessReviews it asks are answered by the Kubernetes emulator from a small policy: ``alice``
and the group ``oncall`` hold ``approve``; ``pat`` holds nothing (in a real cluster: ``patch``
only, which is what lets a request reach the webhook at all). The CRD's CEL rules are evaluated
with ``cel-python`` the way the API server applies them (transition rules: a field's rule when the
field is in both the old and the new object; the spec's rules on every update).

The last test (marked ``operator``) drives the same rules end to end on the shared world
(tests/conftest.py): ``kubectl sdcguard`` and ``kubectl patch`` against the real operator, whose
webhook the Kubernetes emulator calls as the API server would.
"""
from __future__ import annotations

import base64
import copy
import json
import pathlib
import uuid
from typing import Any, Iterator

import jsonpatch
import pytest
import yaml
from conftest import make_alarm, phase, start_training

import sdcguard_operator.admission as admission
import sdcguard_operator.kube as operator_kube
from sdcguard.sandbox.apiserver import SAR_PATH, start_emulator
from test_webhook import WebhookOperator

pytestmark = [pytest.mark.emulator, pytest.mark.timeout(120)]

ROOT = pathlib.Path(__file__).resolve().parents[1]
OPERATOR = "system:serviceaccount:sdcguard:sdcguard"
ALICE = {"username": "alice", "uid": "a11ce", "groups": ["sre", "system:authenticated"],
         "extra": {"authentication.kubernetes.io/credential-id": ["JTI=1"]}}
PAT = {"username": "pat", "uid": "9a7", "groups": ["system:authenticated"]}
CAROL = {"username": "carol", "uid": "ca201", "groups": ["oncall", "system:authenticated"]}
OPERATOR_USER = {"username": OPERATOR, "uid": "0b", "groups": ["system:serviceaccounts", "system:authenticated"]}


def replacement(**spec: Any) -> dict[str, Any]:
    base = {"nodeName": "hyperpod-i-0123456789abcdef0", "instanceId": "i-0123456789abcdef0",
            "clusterName": "ml-cluster", "instanceGroup": "workers", "incidents": ["ml/llm-replay-40"]}
    return {"apiVersion": "sdcguard.dev/v1", "kind": "NodeReplacement",
            "metadata": {"name": "hyperpod-i-0123456789abcdef0", "uid": "f00d", "resourceVersion": "7"},
            "spec": {**base, **spec}, "status": {"phase": "PendingApproval"}}


def review(operation: str, user: dict[str, Any], new: dict[str, Any], old: dict[str, Any] | None = None) -> dict:
    """An ``admission.k8s.io/v1`` AdmissionReview as the API server posts it."""
    gvk = {"group": "sdcguard.dev", "version": "v1", "kind": "NodeReplacement"}
    gvr = {"group": "sdcguard.dev", "version": "v1", "resource": "nodereplacements"}
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": str(uuid.uuid4()), "kind": gvk, "resource": gvr, "requestKind": gvk, "requestResource": gvr,
        "name": new["metadata"]["name"], "operation": operation, "userInfo": user, "object": new,
        "oldObject": old, "dryRun": False,
        "options": {"apiVersion": "meta.k8s.io/v1", "kind": f"{operation.title()}Options"}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebhookOperator]:
    workdir = tmp_path_factory.mktemp("admission")
    saved = operator_kube._client
    operator_kube._client = None  # the operator's client, built from this module's KUBECONFIG
    with start_emulator(workdir) as kube:
        kube.grant("user:alice", "approve", "nodereplacements.sdcguard.dev")
        kube.grant("group:oncall", "approve", "nodereplacements.sdcguard.dev")
        kube.grant("user:pat", "patch", "nodereplacements.sdcguard.dev")
        operator = WebhookOperator(kube, workdir, handler_id=admission.HANDLER_ID,
                                   env={"SDCGUARD_OPERATOR_USERNAME": OPERATOR})
        try:
            yield operator
        finally:
            operator.stop()
            operator_kube._client = saved


def patched(obj: dict[str, Any], response: dict[str, Any]) -> dict[str, Any]:
    assert response["allowed"] is True, response
    if "patch" not in response:
        return copy.deepcopy(obj)
    assert response["patchType"] == "JSONPatch"
    return jsonpatch.apply_patch(obj, json.loads(base64.b64decode(response["patch"])))


def denied(response: dict[str, Any], code: int) -> str:
    assert response["allowed"] is False, response
    assert response["status"]["code"] == code, response
    return response["status"]["message"]


def test_the_operator_creates_and_maintains_its_objects(server: WebhookOperator) -> None:
    created = replacement()
    response = server.post(review("CREATE", OPERATOR_USER, created))
    assert patched(created, response) == created and "patch" not in response
    joined = replacement(incidents=["ml/llm-replay-40", "ml/llm-weights-41"])
    assert patched(joined, server.post(review("UPDATE", OPERATOR_USER, joined, created))) == joined
    annotated = replacement()
    annotated["metadata"]["annotations"] = {"sdcguard.dev/last-handled-configuration": "{}"}  # kopf's own marks
    assert server.post(review("UPDATE", PAT, annotated, created))["allowed"] is True


def test_a_decision_records_the_authenticated_user_over_what_the_client_claims(server: WebhookOperator) -> None:
    old = replacement()
    new = replacement(decision="Approved", decidedBy="bob", decidedByGroups=["admins"], decisionReason="replay x2")
    before = len(server.kube.emulator.access_reviews)
    out = patched(new, server.post(review("UPDATE", ALICE, new, old)))
    assert out["spec"]["decidedBy"] == "alice" and out["spec"]["decidedByGroups"] == ["sre", "system:authenticated"]
    assert (out["spec"]["decision"], out["spec"]["decisionReason"]) == ("Approved", "replay x2")
    assert out["spec"]["instanceId"] == old["spec"]["instanceId"]
    [asked] = server.kube.emulator.access_reviews[before:]
    assert asked["spec"] == {"user": "alice", "groups": ["sre", "system:authenticated"], "uid": "a11ce",
                             "extra": {"authentication.kubernetes.io/credential-id": ["JTI=1"]},
                             "resourceAttributes": {"group": "sdcguard.dev", "resource": "nodereplacements",
                                                    "verb": "approve", "name": old["metadata"]["name"]}}
    group_member = patched(replacement(decision="Denied"), server.post(
        review("UPDATE", CAROL, replacement(decision="Denied"), old)))
    assert group_member["spec"]["decidedBy"] == "carol"


def test_deciding_needs_approve_not_patch(server: WebhookOperator) -> None:
    for decision in ("Approved", "Denied"):
        message = denied(server.post(review("UPDATE", PAT, replacement(decision=decision), replacement())), 403)
        assert message.startswith("pat may not decide NodeReplacement hyperpod-i-0123456789abcdef0")
        assert "RBAC verb approve on nodereplacements.sdcguard.dev" in message
    # a decision at creation is a decision too (and nobody but the operator creates these)
    assert denied(server.post(review("CREATE", PAT, replacement(decision="Approved"))), 403)
    assert server.kube.emulator.access_reviews[-1]["spec"]["user"] == "pat"


def test_a_failed_access_review_refuses(server: WebhookOperator) -> None:
    server.kube.reject("POST", SAR_PATH, 500)
    try:
        message = denied(server.post(review("UPDATE", ALICE, replacement(decision="Approved"), replacement())), 403)
    finally:
        server.kube.emulator.rejections.clear()
    assert "alice may not decide" in message and "the SubjectAccessReview failed" in message


DECIDED = {"decision": "Approved", "decidedBy": "alice", "decidedByGroups": ["sre"], "decisionReason": "x2"}


@pytest.mark.parametrize("case, user, old, new, code, text", [
    ("decision-changed", ALICE, DECIDED, {**DECIDED, "decision": "Denied"}, 422,
     "spec.decision is final: Approved cannot become Denied"),
    ("decision-cleared", ALICE, DECIDED, {**DECIDED, "decision": ""}, 422, "Approved cannot become empty"),
    ("decider-rewritten", ALICE, DECIDED, {**DECIDED, "decidedBy": "mallory"}, 422,
     "spec.decidedBy: the record of a decision is final"),
    ("reason-rewritten", ALICE, DECIDED, {**DECIDED, "decisionReason": "never mind"}, 422,
     "spec.decisionReason: the record of a decision is final"),
    ("decider-forged", PAT, {}, {"decidedBy": "alice"}, 422, "never written by a client"),
    ("instance-changed", ALICE, {}, {"instanceId": "i-0fedcba9876543210"}, 422,
     "spec.instanceId: the target of a NodeReplacement is fixed"),
    ("group-removed", ALICE, {}, {"instanceGroup": None}, 422, "spec.instanceGroup"),
    ("node-and-cluster", PAT, {}, {"nodeName": "hyperpod-i-0fedcba9876543210", "clusterName": "other"}, 422,
     "spec.nodeName, spec.clusterName"),
    ("incidents", ALICE, {}, {"incidents": ["default/other"]}, 403, "spec.incidents is written by the sdcguard operator"),
])
def test_refusals_say_why(server: WebhookOperator, case: str, user: dict, old: dict, new: dict, code: int,
                          text: str) -> None:
    before, after = replacement(**old), replacement(**{**old, **new})
    after["spec"] = {k: v for k, v in after["spec"].items() if v is not None}
    assert text in denied(server.post(review("UPDATE", user, after, before)), code)


def test_the_operator_alone_may_change_its_fields() -> None:
    old, new = replacement()["spec"], replacement(instanceId="i-0fedcba9876543210")["spec"]
    assert admission.judge("UPDATE", old, new, OPERATOR, OPERATOR).allowed  # the CRD rules still refuse it
    assert not admission.judge("UPDATE", old, new, OPERATOR, None).allowed  # no operator user configured: nobody
    assert admission.judge("UPDATE", old, {**old, "decision": "Approved"}, "alice", OPERATOR).deciding == "Approved"


# -- the CRD's x-kubernetes-validations, evaluated ------------------------------------------------

def crd_spec_schema() -> dict[str, Any]:
    crd = yaml.safe_load((ROOT / "deploy" / "crds" / "nodereplacement.yaml").read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def test_the_crd_makes_the_target_immutable_and_decisions_final() -> None:
    spec = crd_spec_schema()
    for field in admission.TARGET_FIELDS:
        assert {"rule": "self == oldSelf", "message": f"spec.{field} is immutable"} in \
            spec["properties"][field]["x-kubernetes-validations"]
    rules = [r["rule"] for r in spec["x-kubernetes-validations"]]
    assert "has(self.instanceGroup) == has(oldSelf.instanceGroup)" in rules
    assert any("oldSelf.decision" in r for r in rules) and any("oldSelf.decidedBy" in r for r in rules)
    assert "nullable" not in spec["properties"]["instanceGroup"]  # a null would skip its rule


def cel_refusals(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """The messages of the CRD rules an update from ``old`` to ``new`` spec breaks."""
    celpy = pytest.importorskip("celpy", reason="cel-python (pip install cel-python) evaluates the CRD's CEL rules")
    env = celpy.Environment()
    spec = crd_spec_schema()

    def broken(rules: list[dict[str, str]], self_: Any, old_self: Any) -> list[str]:
        out = []
        for rule in rules:
            program = env.program(env.compile(rule["rule"]))
            if not program.evaluate({"self": celpy.json_to_cel(self_), "oldSelf": celpy.json_to_cel(old_self)}):
                out.append(rule["message"])
        return out

    refusals = broken(spec["x-kubernetes-validations"], new, old)
    for field, schema in spec["properties"].items():
        if field in old and field in new:  # a transition rule runs where both values exist
            refusals += broken(schema.get("x-kubernetes-validations", []), new[field], old[field])
    return refusals


SPEC = replacement()["spec"]


@pytest.mark.parametrize("case, old, new, refused", [
    ("approve", SPEC, {**SPEC, "decision": "Approved", "decidedBy": "alice"}, []),
    ("from-empty", {**SPEC, "decision": ""}, {**SPEC, "decision": "Denied"}, []),
    ("operator-joins-incident", SPEC, {**SPEC, "incidents": ["a/b", "c/d"]}, []),
    ("flip", {**SPEC, "decision": "Approved"}, {**SPEC, "decision": "Denied"}, ["spec.decision is final once set"]),
    ("clear", {**SPEC, "decision": "Denied"}, {k: v for k, v in SPEC.items()}, ["spec.decision is final once set"]),
    ("decider", {**SPEC, "decidedBy": "alice"}, {**SPEC, "decidedBy": "bob"}, ["spec.decidedBy is final once recorded"]),
    ("instance", SPEC, {**SPEC, "instanceId": "i-0fedcba9876543210"}, ["spec.instanceId is immutable"]),
    ("node", SPEC, {**SPEC, "nodeName": "other"}, ["spec.nodeName is immutable"]),
    ("cluster", SPEC, {**SPEC, "clusterName": "other"}, ["spec.clusterName is immutable"]),
    ("group", SPEC, {**SPEC, "instanceGroup": "other"}, ["spec.instanceGroup is immutable"]),
    ("group-dropped", SPEC, {k: v for k, v in SPEC.items() if k != "instanceGroup"}, ["spec.instanceGroup is immutable"]),
    ("group-added", {k: v for k, v in SPEC.items() if k != "instanceGroup"}, SPEC, ["spec.instanceGroup is immutable"]),
])
def test_crd_rules_hold_without_the_webhook(case: str, old: dict, new: dict, refused: list[str]) -> None:
    assert cel_refusals(old, new) == refused


@pytest.mark.operator
def test_deciding_needs_the_approve_verb_and_the_target_is_fixed_at_admission(world):
    ns = "admission"
    ids, nodes, pods = start_training(world, ns, n_nodes=2)
    world.alarm_event(ns, make_alarm(ns, "llm", suspects=[(1, pods[1], nodes[1])], reporter=(0, pods[0], nodes[0])))
    world.wait(lambda: phase(world, nodes[1]) == "PendingApproval", what="PendingApproval")
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
    world.wait(lambda: phase(world, nodes[1]) == "Denied", what="Denied")
    assert world.replacement(nodes[1])["status"]["decision"]["by"] == "carol"
    assert world.aws.calls("BatchReplaceClusterNodes", ids[1]) == []
