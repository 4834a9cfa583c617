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
    plural = resource["resource"] + (f"/{request['subResource']}" if request.get("subResource") else "")
    if not any(resource["group"] in r["apiGroups"] and plural in r["resources"]
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


def _status_sealed_like_the_operator(world, name: str, status: dict[str, Any]) -> str:
    """The seal the operator puts on a NodeReplacement status it writes (kube.StatusSeal)."""
    import json
    secret = world.core.read_namespaced_secret(names.MASTER_KEY_SECRET, "default")
    key = base64.b64decode(secret.data["key"])
    text = json.dumps({k: v for k, v in status.items() if k not in ("conditions", "seal")}, sort_keys=True,
                      separators=(",", ":"))
    parts = ("seal/v1", "NodeReplacementStatus", name, hashlib.sha256(text.encode()).hexdigest())
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
                                                   {"status": {"target": target, "seal": _status_sealed_like_the_operator(
                                                       world, foreign, {"target": target})}})
    world.wait(lambda: phase(world, foreign) == "PendingApproval", what="PendingApproval")

    denied = world.kubectl("sdcguard", "deny", foreign, "--reason", "not ours")
    assert denied.returncode == 0, denied.stderr
    world.wait(lambda: phase(world, foreign) == "Denied", what="Denied")
    assert world.node_state(foreign) == (True, None)  # still cordoned: sdcguard never cordoned it
    timeline = world.replacement(foreign)["status"]["timeline"]
    assert "left as it is" in timeline[-1]["message"], timeline[-1]



# -- Medium and Low findings of review 3 (items 3-7, 9-10) -------------------------------------------


@pytest.mark.emulator
@pytest.mark.operator
def test_a_status_write_cannot_fake_the_health_check_or_reach_release(world):
    """Attack (security review 3, MEDIUM 3): whoever may write ``nodereplacements/status`` wrote
    ``healthCheck: {result: Failed, message: ...}`` (what the approver reads before approving),
    ``phase: PendingApproval`` (skipping the deep health check) or ``phase: Failed`` (``release``
    then freed the node's storm-guard slot and unlabelled it). The operator took each as its own
    record. Now every status write of the operator carries a seal (an HMAC under its master key over
    all but the conditions); a status without a valid one is marked ``StatusSealed=False``, never
    acted on (no health check skipped, no release), and the kubectl plugin shows "unsealed status"
    and refuses to approve it."""
    ns = "status-seal"
    ids, nodes, pods = start_training(world, ns, n_nodes=2)
    world.alarm_event(ns, make_alarm(ns, "llm", step=11, suspects=[(1, pods[1], nodes[1])],
                                     reporter=(0, pods[0], nodes[0])))
    world.wait(lambda: phase(world, nodes[1]) == "PendingApproval", what="PendingApproval")
    assert world.replacement(nodes[1])["status"]["seal"].startswith("v1=")
    forged = world.kubectl("patch", "nodereplacement", nodes[1], "--subresource=status", "--type=merge", "-p",
                           '{"status": {"phase": "Failed", "healthCheck": {"result": "Failed", '
                           '"message": "GPU 3: uncorrectable ECC errors"}}}')
    assert forged.returncode == 0, forged.stderr
    world.wait(lambda: any(c["type"] == "StatusSealed" and c["status"] == "False"
                           for c in world.replacement(nodes[1])["status"].get("conditions", [])), what="marked")
    released = world.kubectl("sdcguard", "release", nodes[1])
    assert released.returncode != 0 and "unsealed status" in released.stderr, released
    # the release request reaches the operator anyway (a plain patch): the forged Failed is not acted on
    assert world.kubectl("patch", "nodereplacement", nodes[1], "--type=merge", "-p",
                         '{"spec": {"release": true}}').returncode == 0
    approve = world.kubectl("sdcguard", "approve", nodes[1])
    assert approve.returncode != 0 and "unsealed status" in approve.stderr, approve
    import time
    time.sleep(1.5)  # several reconciles (poll 0.3 s)
    assert world.node_state(nodes[1]) == (True, "true")  # still cordoned and labelled: the slot is held
    assert "released" not in world.replacement(nodes[1])["status"]
    assert world.aws.calls("BatchReplaceClusterNodes", ids[1]) == []


def test_status_seal_covers_everything_the_operator_acts_on_or_shows() -> None:
    from sdcguard_operator import kube
    seal = kube.StatusSeal(lambda name, text: "v1=" + hmac.new(b"k" * 32, f"{name}\0{text}".encode(),
                                                                hashlib.sha256).hexdigest())
    status = {"phase": "PendingApproval", "target": {"nodeName": "n"}, "healthCheck": {"result": "Passed"},
              "timeline": [{"event": "HealthCheckPassed", "message": "ok"}],
              "conditions": [{"type": "HealthCheckPassed", "status": "True"}]}
    status["seal"] = seal.make("n", status)
    assert seal.valid("n", status) and not seal.valid("other", status)
    for field, value in (("phase", "Failed"), ("healthCheck", {"result": "Failed", "message": "forged"}),
                         ("decision", {"decision": "Approved"}), ("released", {"by": "x"}),
                         ("timeline", [{"event": "HealthCheckFailed"}])):
        assert not seal.valid("n", {**status, field: value}), field
    assert seal.valid("n", {**status, "conditions": []})  # conditions are the operator's markers: not sealed
    assert seal.valid("n", {}) and not seal.valid("n", {"phase": "PendingApproval"})
    assert kube.merge_patch({"a": {"b": 1, "c": 2}, "d": 1}, {"a": {"b": None, "e": 3}, "d": None}) == {
        "a": {"c": 2, "e": 3}}


@pytest.mark.emulator
@pytest.mark.operator
def test_a_tenant_alarm_does_not_cordon_a_node_shared_with_another_namespace(world):
    """Attack (security review 3, MEDIUM 4): a tenant pinned a replica of its own enabled job to
    another team's node (nodeName / affinity) and raised a correctly signed alarm naming it: the
    operator cordoned that node and proposed it for replacement. Now a suspect node that also runs
    pods of another namespace (DaemonSets and kube-system aside) is not cordoned: the incident is
    recorded with condition SharedNode for a person to decide, and no NodeReplacement is opened."""
    ns, victim = "tenant-aim", "other-team"
    ids, nodes, pods = start_training(world, ns, n_nodes=2)
    world.training(victim, "theirs", [nodes[1]])  # the other team's job runs on the node aimed at
    world.alarm_event(ns, make_alarm(ns, "llm", step=13, suspects=[(1, pods[1], nodes[1])],
                                     reporter=(0, pods[0], nodes[0])))
    name = "llm-replay-13"
    status = world.wait(lambda: (s := world.incident(ns, name).get("status") or {}).get("phase") == "Contained"
                        and s, what="contained")
    shared = next(c for c in status["conditions"] if c["type"] == "SharedNode")
    assert shared["status"] == "True" and victim not in shared["message"]  # no other tenant's name leaks
    assert world.node_state(nodes[1]) == (False, None)
    assert [r for r in world.replacements() if r["spec"]["nodeName"] == nodes[1]] == []
    assert world.aws.calls("StartClusterHealthCheck", ids[1]) == []


def test_chart_ships_per_namespace_and_per_job_limits_below_the_cluster_wide_one() -> None:
    """Attack (security review 3, MEDIUM 4, second half): with per namespace = per job = cluster-wide
    = 2, one tenant held every storm-guard slot and real alarms elsewhere waited."""
    [deployment] = [d for d in _rendered("--set", "rbac.clusterWideSecrets=true") if d["kind"] == "Deployment"]
    env = {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    cluster = int(env["SDCGUARD_MAX_CONCURRENT_SUSPECT_NODES"])
    assert int(env["SDCGUARD_MAX_SUSPECT_NODES_PER_NAMESPACE"]) < cluster
    assert int(env["SDCGUARD_MAX_SUSPECT_NODES_PER_JOB"]) < cluster
    assert env["SDCGUARD_ALLOW_SHARED_NODES"] == "false"


def test_an_ephemeral_container_cannot_mount_the_key_volume() -> None:
    """Attack (security review 3, MEDIUM 5): the pod webhook matched only ``pods`` CREATE, so
    ``kubectl debug --profile=general`` (an ephemeral container through ``pods/ephemeralcontainers``)
    could mount the sidecar's key volume and read the job's alarm key. Now a fail-closed validating
    webhook on that subresource refuses any ephemeral container that mounts the key volume or reads
    an alarm-key Secret; the chart registers it. (``kubectl exec`` into the sidecar still reads the
    key: exec rights on an enabled job's pods are key rights, see the threat model.)"""
    from sdcguard_operator import pod_mutation
    pod = {"metadata": {"name": "llm-worker-0", "namespace": "ml"}, "spec": {
        "volumes": [{"name": names.ALARM_KEY_VOLUME, "secret": {"secretName": "sdcguard-alarm-key-llm"}},
                    {"name": "copy", "projected": {"sources": [{"secret": {"name": "sdcguard-alarm-key-llm"}}]}},
                    {"name": "data", "emptyDir": {}}],
        "containers": [{"name": "pytorch", "image": "train:1"}]}}
    old = {**pod, "spec": {**pod["spec"], "ephemeralContainers": [{"name": "old", "image": "busybox"}]}}

    def debug(**container: Any) -> dict[str, Any]:
        return {**pod, "spec": {**pod["spec"], "ephemeralContainers": old["spec"]["ephemeralContainers"] + [
            {"name": "debugger", "image": "busybox", **container}]}}
    assert pod_mutation.ephemeral_key_references(debug(volumeMounts=[{"name": "data", "mountPath": "/d"}]), old) == []
    for attempt in (dict(volumeMounts=[{"name": names.ALARM_KEY_VOLUME, "mountPath": "/k"}]),
                    dict(volumeMounts=[{"name": "copy", "mountPath": "/k"}]),
                    dict(env=[{"name": "K", "valueFrom": {"secretKeyRef": {"name": "sdcguard-alarm-key-llm",
                                                                            "key": "key"}}}]),
                    dict(envFrom=[{"secretRef": {"name": "sdcguard-alarm-key-llm"}}])):
        assert pod_mutation.ephemeral_key_references(debug(**attempt), old), attempt
    docs = _rendered("--set", "rbac.clusterWideSecrets=true")
    [vwc] = [d for d in docs if d["kind"] == "ValidatingWebhookConfiguration"]
    [hook] = vwc["webhooks"]
    assert hook["failurePolicy"] == "Fail" and hook["clientConfig"]["service"]["path"] == \
        "/" + names.EPHEMERAL_WEBHOOK_ID
    assert hook["rules"] == [{"apiGroups": [""], "apiVersions": ["v1"], "resources": ["pods/ephemeralcontainers"],
                              "operations": ["UPDATE"], "scope": "Namespaced"}]


def test_a_forged_controller_reference_gets_no_key_with_the_shipped_defaults() -> None:
    """Attack (security review 3, MEDIUM 6): ``webhook.jobControllerUsers`` was empty by default, so
    anyone who may create pods in the namespace wrote a controller ownerReference naming the victim
    job (its uid is readable) and got the job's sidecar, and with it the job's key. Now the chart
    ships the Kubeflow training operator's service account, and with none configured the webhook
    injects nothing unless ``webhook.allowAnyJobController`` says so explicitly."""
    from sdcguard_operator import pod_mutation
    uid = "0b1d0000-0000-4000-8000-000000000001"
    pod = {"metadata": {"name": "llm-worker-9", "namespace": "ml", "labels": {names.JOB_NAME_LABEL: "llm"},
                        "ownerReferences": [{"apiVersion": names.JOB_API_VERSION, "kind": names.JOB_KIND,
                                             "name": "llm", "uid": uid, "controller": True}]},
           "spec": {"containers": [{"name": "steal", "image": "mallory:1"}]}}
    enabled = {names.ENABLED_ANNOTATION: "true"}
    unset = pod_mutation.SidecarSettings.from_env({})
    out, warnings = pod_mutation.mutated(pod, enabled, unset, uid, "system:serviceaccount:ml:mallory")
    assert out is None and "no job controller is configured" in warnings[-1]
    [deployment] = [d for d in _rendered("--set", "rbac.clusterWideSecrets=true") if d["kind"] == "Deployment"]
    env = {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    shipped = pod_mutation.SidecarSettings.from_env(env)
    assert shipped.job_controllers == ("system:serviceaccount:kubeflow:training-operator",)
    assert not shipped.allow_any_job_controller
    out, _ = pod_mutation.mutated(pod, enabled, shipped, uid, "system:serviceaccount:ml:mallory")
    assert out is None
    out, _ = pod_mutation.mutated(pod, enabled, shipped, uid, "system:serviceaccount:kubeflow:training-operator")
    assert out is not None
    explicit = pod_mutation.SidecarSettings.from_env({"SDCGUARD_ALLOW_ANY_JOB_CONTROLLER": "true"})
    assert pod_mutation.mutated(pod, enabled, explicit, uid, "anyone")[0] is not None


@pytest.mark.emulator
@pytest.mark.operator
def test_a_pre_created_ledger_or_key_secret_does_not_suppress_alarms(world):
    """Attack (security review 3, MEDIUM 7): the tenant pre-created ``sdcguard-alarms-<job>`` as an
    ``immutable`` ConfigMap (or filled it to ~1 MiB): every ledger claim failed with 422, kopf
    retried and then dropped the alarm with no rejection, metric or alert. The same trick on
    ``sdcguard-alarm-key-<job>`` (immutable, the attacker's key) left the attacker's key in the
    sidecar. Now the operator adopts only its own objects (its label, this job as owner, mutable,
    not oversized) and deletes and recreates any other; a failure in intake is a counted rejection."""
    import secrets as random
    ns = "pre-created"
    attacker_key = random.token_bytes(32)
    world.core.create_namespaced_secret(ns, {
        "metadata": {"name": names.ALARM_KEY_SECRET_PREFIX + "llm", "namespace": ns}, "type": "Opaque",
        "immutable": True, "data": {"key": base64.b64encode(attacker_key).decode()}})
    _, nodes, pods = start_training(world, ns, n_nodes=2)
    world.wait(lambda: not world.core.read_namespaced_secret(names.ALARM_KEY_SECRET_PREFIX + "llm", ns).immutable,
               what="the foreign key Secret replaced")
    assert world.alarm_key(ns, "llm") != attacker_key
    world.core.create_namespaced_config_map(ns, {
        "metadata": {"name": names.ALARM_LEDGER_PREFIX + "llm", "namespace": ns}, "immutable": True,
        "data": {f"junk-{i}": "x" * 1000 for i in range(100)}})
    world.alarm_event(ns, make_alarm(ns, "llm", step=15, suspects=[(1, pods[1], nodes[1])],
                                     reporter=(0, pods[0], nodes[0])))
    world.wait(lambda: (world.incident(ns, "llm-replay-15").get("status") or {}).get("phase"), what="incident")
    ledger = world.core.read_namespaced_config_map(names.ALARM_LEDGER_PREFIX + "llm", ns)
    assert not ledger.immutable and ledger.metadata.owner_references[0].uid == world.job_uid(ns, "llm")
    assert not any(k.startswith("junk-") for k in ledger.data or {})


def test_the_policy_lets_the_operator_delete_only_its_per_job_names(policy):
    """Replacing a foreign object needs DELETE; the admission policy confines it to the operator's
    per-job names (never the master key, never another Secret)."""
    delete = _request("secrets", "DELETE", "ml")
    assert _admit(policy, delete, None, _secret(names.ALARM_KEY_SECRET_PREFIX + "llm", "ml", labelled=False)) == []
    assert _admit(policy, delete, None, _secret("db-password", "ml")) != []
    assert _admit(policy, _request("secrets", "DELETE", RELEASE_NS), None, _secret(names.MASTER_KEY_SECRET,
                                                                                   RELEASE_NS)) != []
    cm = {**_secret(names.ALARM_LEDGER_PREFIX + "llm", "ml", labelled=False), "kind": "ConfigMap"}
    assert _admit(policy, _request("configmaps", "DELETE", "ml"), None, cm) == []
    assert _admit(policy, _request("configmaps", "DELETE", "kube-system"), None,
                  {**cm, "metadata": {"name": "aws-auth", "namespace": "kube-system"}}) != []


class _Log:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def warning(self, text: str) -> None:
        self.lines.append(text)

    info = warning


def _event(text: str, namespace: str = "ml") -> dict[str, Any]:
    return {"metadata": {"name": "sdcguard-alarm-x", "namespace": namespace, "annotations": {
        names.ALARM_ANNOTATION: text, names.ALARM_SIGNATURE_ANNOTATION: "v1=" + "0" * 64}},
        "involvedObject": {"kind": "Pod", "name": "p", "namespace": namespace}}


def test_a_crafted_alarm_is_a_counted_rejection_never_a_crash(monkeypatch):
    """Attack (security review 3, LOW 9): intake parsed the alarm before checking its HMAC; a record
    nested a few thousand levels deep made the parser raise RecursionError, which was no rejection:
    kopf retried the Event and dropped it, nothing counted. A name with a trailing newline passed the
    ``^...$`` patterns; a U+202E in the checkpoint path reordered what people read. Now size and
    nesting are capped before parsing, any parser failure is MalformedAlarm, the patterns match
    whole strings, and Unicode format characters are refused in shown fields and stripped from
    everything the plugin prints."""
    import json
    from conftest import make_alarm as alarm_of
    from sdcguard.contract import alarm as alarm_schema
    from sdcguard_operator import intake, kubectl_plugin, validate
    from sdcguard_operator.settings import Settings
    monkeypatch.setattr(intake.kopf, "event", lambda *a, **k: None)
    settings = Settings()
    for text, why in (("[" * 5000 + "]" * 5000, "nests deeper"), ("{" + " " * (70 * 1024) + "}", "longer than")):
        outcome = intake.handle(_event(text), settings, _Log())
        assert outcome == "rejected:MalformedAlarm", (outcome, why)
        with pytest.raises(validate.Rejected, match=why):
            validate.parse(_event(text), settings)
    good = alarm_of("ml", "llm")
    for path, value in ((("job", "name"), "llm\n"), (("last_good_checkpoint",), "ckpt-\u202egp.pt")):
        record = json.loads(json.dumps(good))
        target = record
        for part in path[:-1]:
            target = target[part]
        target[path[-1]] = value
        with pytest.raises(validate.Rejected) as refused:
            validate.parse(_event(alarm_schema.dumps(record)), settings)
        assert refused.value.reason == "MalformedAlarm", path
    assert kubectl_plugin.clean("resume from ckpt-\u202egp.pt\u200b") == "resume from ckpt-gp.pt"


def test_an_unexpected_failure_in_intake_is_a_rejection_not_a_silent_drop(monkeypatch):
    """Attack (security review 3, MEDIUM 7, second half): any exception in intake other than a
    rejection (a 422 on the ledger, a record of unexpected shape) went to kopf's retries and then
    the alarm was dropped: no rejection, metric or alert. Now it is the rejection ``IntakeError``
    (counted in sdcguard_alarms_rejected_total, which SdcguardAlarmsRejected alerts on); a transient
    API error is retried, and on kopf's last try it is an IntakeError as well."""
    import kubernetes as k8s
    from sdcguard_operator import intake, metrics, signature_check
    from sdcguard_operator.settings import Settings
    monkeypatch.setattr(intake.kopf, "event", lambda *a, **k: None)

    def boom(*_: Any, **__: Any) -> Any:
        raise k8s.client.ApiException(status=422, reason="Invalid")
    monkeypatch.setattr(signature_check, "presented", boom)
    before = metrics.ALARMS_REJECTED.labels("IntakeError")._value.get()
    assert intake.handle(_event("{}"), Settings(), _Log(), final=False) == "rejected:IntakeError"
    assert metrics.ALARMS_REJECTED.labels("IntakeError")._value.get() == before + 1

    def busy(*_: Any, **__: Any) -> Any:
        raise k8s.client.ApiException(status=503, reason="Unavailable")
    monkeypatch.setattr(signature_check, "presented", busy)
    with pytest.raises(k8s.client.ApiException):
        intake.handle(_event("{}"), Settings(), _Log(), final=False)
    assert intake.handle(_event("{}"), Settings(), _Log(), final=True) == "rejected:IntakeError"


def test_alarm_events_are_rate_limited_per_namespace():
    """Attack (security review 3, LOW 10): nothing limited how many alarm Events a namespace could
    make the operator handle (each costs API reads and writes). Now a token bucket per namespace
    rejects the excess as ``RateLimited`` before any API call; other namespaces are unaffected."""
    from sdcguard_operator import intake
    from sdcguard_operator.settings import Settings
    settings = Settings(alarm_rate_per_minute=60.0, alarm_burst=3)
    limiter = intake.RateLimiter()
    assert [limiter.allow("flood", settings, now=100.0) for _ in range(4)] == [True, True, True, False]
    assert limiter.allow("quiet", settings, now=100.0)
    assert limiter.allow("flood", settings, now=101.0) and not limiter.allow("flood", settings, now=101.0)
    # kopf's retry of an Event already let through spends no second token (a valid alarm whose
    # first try met a transient API error is not turned away by the flood around it)
    retried = intake.RateLimiter()
    assert retried.allow("busy", settings, now=200.0, key="uid-1")
    assert [retried.allow("busy", settings, now=200.0) for _ in range(3)] == [True, True, False]
    assert retried.allow("busy", settings, now=200.0, key="uid-1")
    assert not retried.allow("busy", settings, now=200.0, key="uid-2")
    docs = _rendered("--set", "rbac.clusterWideSecrets=true")
    [policy] = [d for d in docs if d["kind"] == "NetworkPolicy"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert sorted(p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]) == [
        "health", "metrics", "webhook"]
