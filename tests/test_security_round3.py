"""The two HIGH findings of the third security review, each proved by the attack it stops.

1. The operator's service account was one step from cluster-admin: with the default values it could
   create and patch any Secret in any namespace (a ``kubernetes.io/service-account-token`` Secret
   mints a token for any service account; a PATCH answer returns the whole Secret) and patch any
   PyTorchJob (its pod template included). The chart now ships a ValidatingAdmissionPolicy that
   confines the operator's writes to the Secrets it owns and to ``spec.runPolicy.suspend``, and
   renders cluster-wide Secret rights only when ``rbac.clusterWideSecrets`` asks for them. The
   policy's CEL is evaluated here with cel-python against allowed and forbidden requests.
2. A status write opened a replacement for any node: the operator took the keys of an
   SDCIncident's free-form ``status.nodes`` as its cordoned suspects. It now acts only on nodes of
   the verified ``spec.suspects`` that hold the incident's storm-guard slot (a ledger only the
   operator writes), and a denial uncordons only a node whose slot one of the replacement's
   incidents holds. Proved through the real operator against the API emulator (tests/conftest.py).
"""
from __future__ import annotations

import base64
import hashlib
import hmac
from pathlib import Path
from typing import Any

import celpy
import celpy.celtypes
import kubernetes
import pytest
from conftest import CLUSTER, GROUP, OPERATOR_USER, make_alarm, new_instance, phase, start_training

from sdcguard.contract import names

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "sdcguard"
RELEASE_NS = "sdcguard"
OPERATOR_SA = f"system:serviceaccount:{RELEASE_NS}:sdcguard"


# -- 1. the ValidatingAdmissionPolicy ---------------------------------------------------------------


def _rendered(*args: str) -> list[dict[str, Any]]:
    from test_chart import render
    return render(list(args), namespace=RELEASE_NS)


@pytest.fixture(scope="module")
def policy() -> dict[str, Any]:
    docs = _rendered("--set", "rbac.clusterWideSecrets=true")
    [vap] = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"]
    [binding] = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding"]
    assert binding["spec"]["policyName"] == vap["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    return vap


def _cel(value: Any) -> Any:
    return celpy.json_to_cel(value)


def _admit(vap: dict[str, Any], request: dict[str, Any], obj: dict[str, Any] | None,
           old: dict[str, Any] | None) -> list[str]:
    """What the API server would answer: the messages of the failed validations (empty = admitted;
    ['(not matched)'] when the policy does not apply to the request)."""
    spec = vap["spec"]
    rules = spec["matchConstraints"]["resourceRules"]
    resource = request["resource"]
    if not any(resource["group"] in r["apiGroups"] and resource["resource"] in r["resources"]
               and request["operation"] in r["operations"] for r in rules):
        return ["(not matched)"]
    env = celpy.Environment()
    activation: dict[str, Any] = {"request": _cel(request), "object": _cel(obj), "oldObject": _cel(old)}
    for condition in spec.get("matchConditions") or []:
        if not env.program(env.compile(condition["expression"])).evaluate(activation):
            return ["(not matched)"]
    variables: dict[str, Any] = {}
    for variable in spec.get("variables") or []:
        activation["variables"] = celpy.celtypes.MapType(
            {celpy.celtypes.StringType(k): v for k, v in variables.items()})
        variables[variable["name"]] = env.program(env.compile(variable["expression"])).evaluate(activation)
    activation["variables"] = celpy.celtypes.MapType({celpy.celtypes.StringType(k): v for k, v in variables.items()})
    failed = []
    for validation in spec["validations"]:
        result = env.program(env.compile(validation["expression"])).evaluate(activation)
        assert not isinstance(result, celpy.CELEvalError), f"{validation['expression']}: {result}"
        if not result and validation.get("messageExpression"):
            message = env.program(env.compile(validation["messageExpression"])).evaluate(activation)
            assert isinstance(message, str), f"{validation['messageExpression']}: {message}"
            failed.append(str(message))
        elif not result:
            failed.append(validation["message"])
    return failed


def _request(resource: str, operation: str, namespace: str, user: str = OPERATOR_SA) -> dict[str, Any]:
    group = "" if resource in ("secrets", "configmaps") else names.JOB_GROUP
    return {"operation": operation, "namespace": namespace, "userInfo": {"username": user},
            "resource": {"group": group, "version": "v1", "resource": resource}}


def _secret(name: str, namespace: str, *, type_: str = "Opaque", labelled: bool = True,
            owner: str | None = None, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace}
    if labelled:
        meta["labels"] = {"app.kubernetes.io/managed-by": "sdcguard"}
    if owner:
        meta["ownerReferences"] = [{"apiVersion": names.JOB_API_VERSION, "kind": names.JOB_KIND, "name": owner,
                                    "uid": "0b1d0000-0000-4000-8000-000000000001"}]
    if annotations:
        meta["annotations"] = annotations
    return {"apiVersion": "v1", "kind": "Secret", "type": type_, "metadata": meta, "data": {"key": "AAAA"}}


def _job(suspend: bool | None = False, image: str = "train:1", **extra: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"pytorchReplicaSpecs": {"Worker": {"replicas": 2, "template": {"spec": {
        "containers": [{"name": "pytorch", "image": image}]}}}}, **extra}
    if suspend is not None:
        spec["runPolicy"] = {"suspend": suspend, "backoffLimit": 3}
    return {"apiVersion": names.JOB_API_VERSION, "kind": names.JOB_KIND,
            "metadata": {"name": "llm", "namespace": "ml"}, "spec": spec}


def test_operator_cannot_mint_a_service_account_token_or_write_a_secret_it_does_not_own(policy):
    """Attack (security review 3, HIGH 1): with the default values the operator's service account
    held ``secrets create/patch`` in every namespace. Creating a ``kubernetes.io/service-account-token``
    Secret annotated with any service account's name made the token controller mint that account's
    token (cluster-admin's included), and a PATCH's answer is the whole Secret, so every Secret was
    readable after all. Now the chart's ValidatingAdmissionPolicy admits the operator's Secret writes
    only for type Opaque, its names (``sdcguard-alarm-key-<job>`` owned by that PyTorchJob; the master
    key in the release namespace) and its label; other users are not matched."""
    key = names.ALARM_KEY_SECRET_PREFIX + "llm"
    create, update = _request("secrets", "CREATE", "ml"), _request("secrets", "UPDATE", "ml")
    allowed = _secret(key, "ml", owner="llm")
    assert _admit(policy, create, allowed, None) == []
    assert _admit(policy, update, allowed, allowed) == []  # the merge patch that puts the same key back
    master = _secret(names.MASTER_KEY_SECRET, RELEASE_NS)
    assert _admit(policy, _request("secrets", "CREATE", RELEASE_NS), master, None) == []

    token = _secret(key, "ml", type_="kubernetes.io/service-account-token", owner="llm",
                    annotations={"kubernetes.io/service-account.name": "cluster-admin-sa"})
    assert _admit(policy, create, token, None) != []
    plain_token = _secret("admin-token", "kube-system", type_="kubernetes.io/service-account-token",
                          labelled=False, annotations={"kubernetes.io/service-account.name": "admin"})
    assert _admit(policy, _request("secrets", "CREATE", "kube-system"), plain_token, None) != []
    assert _admit(policy, create, _secret("db-password", "ml", owner="llm"), None) != []  # no prefix
    assert _admit(policy, update, _secret("db-password", "ml"), _secret("db-password", "ml")) != []  # patch to read it
    assert _admit(policy, create, _secret(key, "ml", labelled=False, owner="llm"), None) != []
    assert _admit(policy, create, _secret(key, "ml", owner="other-job"), None) != []  # not its job's name
    assert _admit(policy, create, _secret(key, "ml"), None) != []  # no owner job
    assert _admit(policy, _request("secrets", "CREATE", "ml"), _secret(names.MASTER_KEY_SECRET, "ml"), None) != []
    tls = _secret("sdcguard-webhook-tls", RELEASE_NS, type_="kubernetes.io/tls")
    assert _admit(policy, _request("secrets", "CREATE", RELEASE_NS), tls, None) != []
    # the same grant held configmaps create/patch in every namespace: kube-system/aws-auth maps IAM
    # roles to system:masters on EKS
    def configmap(name: str, namespace: str, labelled: bool = True, owner: str | None = None) -> dict[str, Any]:
        return {**_secret(name, namespace, labelled=labelled, owner=owner), "kind": "ConfigMap", "type": None}
    cm_update = _request("configmaps", "UPDATE", "ml")
    ledger = configmap(names.ALARM_LEDGER_PREFIX + "llm", "ml", owner="llm")
    assert _admit(policy, _request("configmaps", "CREATE", "ml"), ledger, None) == []
    assert _admit(policy, cm_update, ledger, ledger) == []
    guard = configmap("sdcguard-storm-guard", RELEASE_NS)
    assert _admit(policy, _request("configmaps", "UPDATE", RELEASE_NS), guard, guard) == []
    aws_auth = configmap("aws-auth", "kube-system", labelled=False)
    assert _admit(policy, _request("configmaps", "UPDATE", "kube-system"), aws_auth, aws_auth) != []
    assert _admit(policy, cm_update, configmap("sdcguard-storm-guard", "ml"), None) != []  # not its namespace
    assert _admit(policy, cm_update, configmap(names.ALARM_LEDGER_PREFIX + "llm", "ml", labelled=False, owner="llm"),
                  None) != []
    # anyone else (a person, another controller) is not matched: the policy binds the operator only
    assert _admit(policy, _request("secrets", "CREATE", "ml", user="alice"), plain_token, None) == ["(not matched)"]


def test_operator_cannot_rewrite_a_pytorchjob_pod_template(policy):
    """Attack (security review 3, HIGH 1): ``pytorchjobs patch`` cluster-wide let the operator's
    account rewrite any job's pod template (an image, a hostPath, a privileged container: code on
    every node). Now the policy admits the operator's PyTorchJob updates (a patch arrives as UPDATE)
    only when ``spec`` is unchanged but for ``runPolicy.suspend`` turned on; metadata (kopf's
    finalizer) may change."""
    update = _request("pytorchjobs", "UPDATE", "ml")
    old = _job(suspend=False)
    assert _admit(policy, update, _job(suspend=True), old) == []
    first = _job(suspend=None)
    first["spec"]["runPolicy"] = {"suspend": True}  # {"spec": {"runPolicy": {"suspend": true}}} on a job without one
    assert _admit(policy, update, first, _job(suspend=None)) == []
    with_finalizer = _job(suspend=False)
    with_finalizer["metadata"]["finalizers"] = ["kopf.zalando.org/KopfFinalizerMarker"]
    assert _admit(policy, update, with_finalizer, old) == []
    assert _admit(policy, update, _job(suspend=False, image="evil:1"), old) != []
    assert _admit(policy, update, _job(suspend=True, image="evil:1"), old) != []
    assert _admit(policy, update, _job(suspend=False, nprocPerNode="8"), old) != []  # a new top-level key
    assert _admit(policy, update, _job(suspend=False), _job(suspend=False, nprocPerNode="8")) != []  # one removed
    more = _job(suspend=True)
    more["spec"]["runPolicy"]["backoffLimit"] = 100
    assert _admit(policy, update, more, old) != []
    assert _admit(policy, update, _job(suspend=False), _job(suspend=True)) != []  # resuming is a person's call
    assert _admit(policy, _request("pytorchjobs", "UPDATE", "ml", user="alice"), _job(image="evil:1"), old) == \
        ["(not matched)"]


def test_the_policy_names_the_operators_service_account_of_each_release() -> None:
    for args, user in ((["--set", "rbac.clusterWideSecrets=true"], OPERATOR_SA),
                       (["--set", "operator.namespaces={ml}", "--set", "fullnameOverride=guard"],
                        f"system:serviceaccount:{RELEASE_NS}:guard"),
                       (["--set", "operator.namespaces={ml}", "--set", "serviceAccount.name=custom"],
                        f"system:serviceaccount:{RELEASE_NS}:custom")):
        [vap] = [d for d in _rendered(*args) if d["kind"] == "ValidatingAdmissionPolicy"]
        assert [c["expression"] for c in vap["spec"]["matchConditions"]] == [f"request.userInfo.username == '{user}'"]
        assert vap["spec"]["failurePolicy"] == "Fail"


# -- 2. a status write opens no replacement ---------------------------------------------------------


def _admin_cordoned_foreign_node(world) -> tuple[str, str]:
    """Another team's HyperPod node, cordoned by an admin for maintenance: (node, instance)."""
    foreign_id = new_instance()
    foreign = world.node(foreign_id)
    world.core.patch_node(foreign, {"spec": {"unschedulable": True}})
    return foreign, foreign_id


@pytest.mark.emulator
@pytest.mark.operator
def test_status_write_opens_no_replacement_for_a_foreign_node(world):
    """Attack (security review 3, HIGH 2): whoever may write an SDCIncident's status (a tenant's
    namespace admin) wrote ``{"nodes": {"<any node>": {"cordoned": true}}, "phase": "Containing"}``.
    The leader took the keys of that free-form map as its cordoned suspects: it created a sealed
    NodeReplacement for another team's node and started its deep health check, past the storm guard
    and the pod checks. Now only nodes of the verified spec.suspects holding this incident's
    storm-guard slot are acted on."""
    ns = "status-forgery"
    _, nodes, pods = start_training(world, ns, n_nodes=2)
    foreign, foreign_id = _admin_cordoned_foreign_node(world)
    world.alarm_event(ns, make_alarm(ns, "llm", check="nonfinite-reduced", step=7, reporter=(0, pods[0], nodes[0])))
    name = "llm-nonfinite-reduced-7"
    world.wait(lambda: (world.incident(ns, name).get("status") or {}).get("phase") == "Contained", what="contained")

    world.custom.patch_namespaced_custom_object_status(names.GROUP, names.VERSION, ns, names.INCIDENTS, name, {
        "status": {"phase": "Containing", "nodes": {foreign: {"cordoned": True}}}})
    # the incident timer reconciles a Containing incident again; it leaves Containing when done
    status = world.wait(lambda: (s := world.incident(ns, name)["status"])["phase"] != "Containing" and s,
                        what="the forged status reconciled")
    assert status["phase"] == "Contained" and not status.get("replacements"), status
    assert [r["metadata"]["name"] for r in world.replacements() if r["spec"]["nodeName"] == foreign] == []
    assert world.aws.calls("StartClusterHealthCheck", foreign_id) == []
    assert world.node_state(foreign) == (True, None)  # the admin's cordon, untouched, no suspect label
    assert [world.node_state(n) for n in nodes] == [(False, None), (False, None)]


def _sealed_like_the_operator(world, name: str, target: dict[str, str]) -> str:
    """The seal the operator puts on a NodeReplacement it creates (operator/master_key.py), made with
    the master key it keeps in its namespace: an object the vulnerable release opened itself."""
    secret = world.core.read_namespaced_secret(names.MASTER_KEY_SECRET, "default")
    key = base64.b64decode(secret.data["key"])
    parts = ("seal/v1", "NodeReplacement", name, *(target.get(f, "") for f in
                                                   ("nodeName", "instanceId", "clusterName", "instanceGroup")))
    return "v1=" + hmac.new(key, "\0".join(parts).encode(), hashlib.sha256).hexdigest()


@pytest.mark.emulator
@pytest.mark.operator
def test_deny_uncordons_only_a_node_sdcguard_cordoned_for_the_replacement(world):
    """Attack (security review 3, HIGH 2, second half): the NodeReplacement the forged status made
    the operator open (sealed by the operator itself, so it survives an upgrade) is denied; the
    denial uncordoned the node although an admin, not sdcguard, had cordoned it. Now a denial
    releases a node only when one of the replacement's incidents holds the node's storm-guard slot
    (the operator cordoned it for that incident); otherwise the node is left as it is."""
    ns = "deny-foreign"
    _, nodes, pods = start_training(world, ns, n_nodes=1)
    foreign, foreign_id = _admin_cordoned_foreign_node(world)
    world.alarm_event(ns, make_alarm(ns, "llm", check="nonfinite-reduced", step=9, reporter=(0, pods[0], nodes[0])))
    incident = "llm-nonfinite-reduced-9"
    world.wait(lambda: (world.incident(ns, incident).get("status") or {}).get("phase") == "Contained",
               what="contained")
    # what the vulnerable release created (as the operator's own account, past the admission webhook)
    target = {"nodeName": foreign, "instanceId": foreign_id, "clusterName": CLUSTER, "instanceGroup": GROUP}
    as_operator = kubernetes.client.CustomObjectsApi(kubernetes.config.new_client_from_config(
        config_file=str(world.user("vulnerable-operator", OPERATOR_USER))))
    as_operator.create_cluster_custom_object(names.GROUP, names.VERSION, names.REPLACEMENTS, {
        "apiVersion": names.API_VERSION, "kind": "NodeReplacement",
        "metadata": {"name": foreign, "annotations": {
            names.SEAL_ANNOTATION: _sealed_like_the_operator(world, foreign, target)}},
        "spec": {**target, "incidents": [f"{ns}/{incident}"]}})
    as_operator.patch_cluster_custom_object_status(names.GROUP, names.VERSION, names.REPLACEMENTS, foreign,
                                                   {"status": {"target": target}})
    world.wait(lambda: phase(world, foreign) == "PendingApproval", what="PendingApproval")

    denied = world.kubectl("sdcguard", "deny", foreign, "--reason", "not ours")
    assert denied.returncode == 0, denied.stderr
    world.wait(lambda: phase(world, foreign) == "Denied", what="Denied")
    assert world.node_state(foreign) == (True, None)  # still cordoned: sdcguard never cordoned it
    timeline = world.replacement(foreign)["status"]["timeline"]
    assert "left as it is" in timeline[-1]["message"], timeline[-1]

