"""The Helm chart, the plain manifests, the example objects, the IAM policy and the image recipes.

Real tools only: `helm lint` / `helm template` (v4, installed by `make tools`), the output checked
with `kubernetes-validate --strict`, the examples with the CRDs' own openAPIV3Schema (via
jsonschema), the webhook's real mutation applied to the example job's pod templates.
"""
from __future__ import annotations

import base64
import copy
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

import sdcguard_operator.admission as admission
import sdcguard_operator.pod_mutation as pod_mutation
import sdcguard_operator.webhook as webhook
from sdcguard.contract import names

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "sdcguard"
DEPLOY = ROOT / "deploy"
HELM = shutil.which("helm") or str(ROOT / ".venv" / "bin" / "helm")
K8S_VERSION = "1.32.0"
CONTROLLER = "system:serviceaccount:kubeflow:training-operator"
"""Kubeflow's training operator: who creates a PyTorchJob's pods (chart default webhook.jobControllerUsers)."""

pytestmark = pytest.mark.timeout(120)

EVERYWHERE = ["--set", "rbac.clusterWideSecrets=true"]
"""Serve every namespace (``operator.namespaces`` []): cluster-wide Secret writes, asked for explicitly."""

VALUE_SETS: dict[str, list[str]] = {
    "all-namespaces": EVERYWHERE,
    "irsa-cert-manager-monitors": [
        "--set", "serviceAccount.irsaRoleArn=arn:aws:iam::123456789012:role/sdcguard",
        "--set", "webhook.tls.mode=cert-manager",
        "--set", "webhook.tls.certManager.issuerRef.name=corp-ca,webhook.tls.certManager.issuerRef.kind=ClusterIssuer",
        "--set", "metrics.serviceMonitor.enabled=true,metrics.podMonitor.enabled=true",
        "--set", "operator.clusterName=ml-cluster,operator.awsRegion=us-west-2",
        "--set", "operator.namespaces={ml,research},operator.logLevel=DEBUG",
    ],
    "own-secret-renamed": [
        "--set", "webhook.tls.mode=secret,webhook.tls.existingSecret=my-tls",
        "--set", "webhook.tls.caBundle=" + base64.b64encode(b"-----BEGIN CERTIFICATE-----").decode(),
        "--set", "fullnameOverride=guard,approver.name=guard-approver", *EVERYWHERE,
        "--set-json", "operator.deepHealthChecks=[]",
    ],
    "no-webhook-no-rbac": [
        "--set", "webhook.enabled=false,rbac.create=false,approver.create=false",
        "--set", "serviceAccount.create=false,serviceAccount.name=existing",
    ],
}


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([HELM, *args], capture_output=True, text=True, timeout=60)


def render(args: list[str], namespace: str = "sdcguard") -> list[dict[str, Any]]:
    done = helm("template", "sdcguard", str(CHART), "--namespace", namespace, "--include-crds", *args)
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    return {name: render(args) for name, args in VALUE_SETS.items()}


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_chart_lints_and_renders_valid_kubernetes_objects(name: str, tmp_path: Path) -> None:
    lint = helm("lint", "--strict", str(CHART), *VALUE_SETS[name])
    assert lint.returncode == 0, lint.stdout + lint.stderr
    done = helm("template", "sdcguard", str(CHART), "--namespace", "sdcguard", "--include-crds", *VALUE_SETS[name])
    assert done.returncode == 0, done.stderr
    out = tmp_path / "rendered.yaml"
    out.write_text(done.stdout)
    check = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "-k", K8S_VERSION, str(out)],
                           capture_output=True, text=True, timeout=120)
    if check.returncode != 0 and "No module named kubernetes_validate" in check.stderr:
        check = subprocess.run([shutil.which("kubernetes-validate") or "kubernetes-validate", "--strict", "-k",
                                K8S_VERSION, str(out)], capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "ERROR" not in check.stdout
    passed = re.findall(r"passed for resource (\S+)", check.stdout)
    assert any(p.startswith("deployment/") for p in passed)


def test_values_schema_rejects_bad_settings() -> None:
    for bad in ("webhook.tls.mode=bogus", "operator.maxConcurrentSuspectNodes=-1", "webhook.timeoutSeconds=31",
                "operator.deepHealthChecks={Reboot}", "serviceAccount.irsaRoleArn=not-an-arn", "typo=1"):
        done = helm("template", "x", str(CHART), *EVERYWHERE, "--set", bad)
        assert done.returncode != 0, f"{bad} was accepted"


def test_webhook_configuration_matches_the_server_and_never_blocks_pods(rendered: dict[str, Any]) -> None:
    docs = rendered["all-namespaces"]
    [mwc] = by_kind(docs, "MutatingWebhookConfiguration")
    assert [h["name"] for h in mwc["webhooks"]] == ["pods.sdcguard.dev", "nodereplacements.sdcguard.dev"]
    hook = mwc["webhooks"][0]
    assert hook["failurePolicy"] == "Ignore" and hook["sideEffects"] == "None"
    assert hook["rules"] == [{"apiGroups": [""], "apiVersions": ["v1"], "resources": ["pods"],
                              "operations": ["CREATE"], "scope": "Namespaced"}]
    # every pod (issue 20, 4: any pod could mount a key Secret), of the namespaces served only
    assert "objectSelector" not in hook
    assert "sdcguard" in hook["namespaceSelector"]["matchExpressions"][0]["values"]
    assert len(hook["namespaceSelector"]["matchExpressions"]) == 1  # namespaces [] = all
    [scoped] = by_kind(rendered["irsa-cert-manager-monitors"], "MutatingWebhookConfiguration")
    assert scoped["webhooks"][0]["namespaceSelector"]["matchExpressions"][1] == {
        "key": "kubernetes.io/metadata.name", "operator": "In", "values": ["ml", "research"]}
    svc_ref = hook["clientConfig"]["service"]
    assert svc_ref["path"] == f"/{webhook.HANDLER_ID}"  # kopf serves the handler at its id
    [service] = by_kind(docs, "Service")
    assert service["metadata"]["name"] == svc_ref["name"]
    port = next(p for p in service["spec"]["ports"] if p["port"] == svc_ref["port"])
    [deployment] = by_kind(docs, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    [operator] = pod["containers"]
    assert port["targetPort"] in [p["name"] for p in operator["ports"]]
    env = {e["name"]: e.get("value") for e in operator["env"]}
    assert env["SDCGUARD_WEBHOOK_CERT_DIR"] in [m["mountPath"] for m in operator["volumeMounts"]]
    assert env["SDCGUARD_SIDECAR_IMAGE"] == "ghcr.io/sdcguard/sdcguard-agent:0.1.0"
    assert operator["livenessProbe"]["httpGet"]["port"] == "health" and operator["readinessProbe"]
    assert operator["resources"]["requests"] and deployment["spec"]["replicas"] == 2
    assert pod["securityContext"]["runAsNonRoot"] is True


def test_two_replicas_elect_a_leader_and_one_alone_may_skip_it(rendered: dict[str, Any]) -> None:
    [deployment] = by_kind(rendered["all-namespaces"], "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    [operator] = pod["containers"]
    env = {e["name"]: e.get("value") for e in operator["env"]}
    assert deployment["spec"]["replicas"] == 2 and deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    assert operator["command"][:2] == ["sdcguard", "operator"] and env["SDCGUARD_LEADER_ELECTION"] == "true"
    assert env["SDCGUARD_LEADER_LEASE"] == "sdcguard-operator"
    assert int(env["SDCGUARD_RENEW_SECONDS"]) < int(env["SDCGUARD_LEASE_SECONDS"])
    assert pod["affinity"]["podAntiAffinity"]  # not both replicas on one node
    [binding] = [b for b in by_kind(rendered["all-namespaces"], "RoleBinding") if b["roleRef"]["kind"] == "Role"]
    assert binding["metadata"]["namespace"] == "sdcguard"
    refused = helm("template", "x", str(CHART), *EVERYWHERE, "--set", "operator.leaderElection.enabled=false")
    assert refused.returncode != 0 and "leaderElection" in refused.stderr
    single = render([*EVERYWHERE, "--set", "operator.replicas=1", "--set", "operator.leaderElection.enabled=false"])
    [deployment] = by_kind(single, "Deployment")
    assert deployment["spec"]["replicas"] == 1


def test_nodereplacement_webhook_fails_closed_on_the_main_resource_only(rendered: dict[str, Any]) -> None:
    docs = rendered["all-namespaces"]
    [mwc] = by_kind(docs, "MutatingWebhookConfiguration")
    pods, hook = mwc["webhooks"]
    assert hook["failurePolicy"] == "Fail" and hook["sideEffects"] == "None"
    assert hook["rules"] == [{"apiGroups": ["sdcguard.dev"], "apiVersions": ["v1"], "resources": ["nodereplacements"],
                              "operations": ["CREATE", "UPDATE"], "scope": "Cluster"}]  # not nodereplacements/status
    assert hook["clientConfig"]["service"]["path"] == f"/{admission.HANDLER_ID}"
    assert hook["clientConfig"]["service"]["name"] == pods["clientConfig"]["service"]["name"]
    assert hook["clientConfig"]["caBundle"] == pods["clientConfig"]["caBundle"]
    assert "namespaceSelector" not in hook and "objectSelector" not in hook
    [deployment] = by_kind(docs, "Deployment")
    spec = deployment["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
    assert env["SDCGUARD_OPERATOR_USERNAME"] == f"system:serviceaccount:sdcguard:{spec['serviceAccountName']}"
    assert env["SDCGUARD_REQUIRE_SIGNED_ALARMS"] == "true"
    off = render([*EVERYWHERE, "--set", "operator.requireSignedAlarms=false"])
    env = {e["name"]: e.get("value") for e in by_kind(off, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["SDCGUARD_REQUIRE_SIGNED_ALARMS"] == "false"


def test_alarm_keys_are_written_only_where_alarms_are_accepted_and_no_secret_is_read(rendered: dict[str, Any]) -> None:
    """Issue 20, 6: with namespaces [] (the default) the operator could read every Secret in the
    cluster. Now it derives each job's key from its master key: it writes key Secrets in the
    namespaces served and reads no Secret but its master key, in its own namespace."""
    everywhere = rendered["all-namespaces"]
    keys = [r for r in by_kind(everywhere, "ClusterRole") if r["metadata"]["name"] == "sdcguard-alarm-keys"]
    # delete: a foreign object of the operator's per-job names is replaced (issue 32, 7; confined by
    # the admission policy to those names)
    assert [_granted(r) for r in keys] == [{("", "secrets", "create"), ("", "secrets", "patch"),
                                            ("", "secrets", "delete"), ("", "configmaps", "get"),
                                            ("", "configmaps", "create"), ("", "configmaps", "patch"),
                                            ("", "configmaps", "delete")}]
    for docs in rendered.values():
        for role in by_kind(docs, "ClusterRole") + by_kind(docs, "Role"):
            for rule in role["rules"]:
                if "secrets" in rule["resources"] and {"get", "list", "watch"} & set(rule["verbs"]):
                    assert role["kind"] == "Role" and rule.get("resourceNames") == ["sdcguard-master-key"], role
    [binding] = [b for b in by_kind(everywhere, "ClusterRoleBinding") if b["roleRef"]["name"] == "sdcguard-alarm-keys"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "sdcguard", "namespace": "sdcguard"}]
    key_bindings = lambda docs: [b for b in by_kind(docs, "RoleBinding")  # noqa: E731
                                 if b["roleRef"]["name"] == "sdcguard-alarm-keys"]
    assert not key_bindings(everywhere)
    scoped = rendered["irsa-cert-manager-monitors"]  # operator.namespaces={ml,research}
    assert not [b for b in by_kind(scoped, "ClusterRoleBinding") if b["roleRef"]["name"] == "sdcguard-alarm-keys"]
    bindings = key_bindings(scoped)
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["ml", "research"]
    assert all(b["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                "name": "sdcguard-alarm-keys"} for b in bindings)
    assert not any(("", "secrets", v) in _granted(r) for r in by_kind(everywhere, "ClusterRole")
                   if r["metadata"]["name"] != "sdcguard-alarm-keys" for v in ("get", "list", "watch", "create", "patch"))


def test_default_values_grant_no_cluster_wide_secret_writes() -> None:
    """Attack (security review 3, HIGH 1): with the default values (``operator.namespaces: []``) the
    chart bound ``secrets create/patch`` (and ConfigMaps) in every namespace to the operator's
    service account: a ``kubernetes.io/service-account-token`` Secret minted any account's token, a
    PATCH answer read any Secret, a patch of kube-system/aws-auth made an IAM role cluster-admin.
    Now the chart renders that grant only when ``rbac.clusterWideSecrets`` asks for it (else it
    fails naming the value), never without the ValidatingAdmissionPolicy that confines it to the
    operator's own objects (tests/test_security_round3.py evaluates its CEL); listing the namespaces
    served binds the grant there only."""
    refused = helm("template", "sdcguard", str(CHART), "--namespace", "sdcguard")
    assert refused.returncode != 0
    assert "rbac.clusterWideSecrets" in refused.stderr and "operator.namespaces" in refused.stderr, refused.stderr
    unconfined = helm("template", "sdcguard", str(CHART), "--namespace", "sdcguard", *EVERYWHERE,
                      "--set", "admissionPolicy.enabled=false")
    assert unconfined.returncode != 0 and "admissionPolicy.enabled" in unconfined.stderr, unconfined.stderr

    def secret_bindings(docs: list[dict[str, Any]]) -> list[tuple[str, str]]:
        writers = {r["metadata"]["name"] for r in by_kind(docs, "ClusterRole") if {("", "secrets", "create"), (
            "", "secrets", "patch")} & _granted(r)}
        return sorted((b["kind"], b["metadata"].get("namespace", "")) for b in by_kind(docs, "ClusterRoleBinding")
                      + by_kind(docs, "RoleBinding") if b["roleRef"]["name"] in writers)

    scoped = render(["--set", "operator.namespaces={ml,research}"])
    assert secret_bindings(scoped) == [("RoleBinding", "ml"), ("RoleBinding", "research")]
    assert secret_bindings(render(EVERYWHERE)) == [("ClusterRoleBinding", "")]
    for docs in (scoped, render(EVERYWHERE), render(["--set", "operator.namespaces={ml}", "--set", "rbac.create=false"])):
        [policy] = by_kind(docs, "ValidatingAdmissionPolicy")
        [binding] = by_kind(docs, "ValidatingAdmissionPolicyBinding")
        assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}
        assert policy["spec"]["failurePolicy"] == "Fail"
    plain = [d for d in yaml.safe_load_all((DEPLOY / "sdcguard.yaml").read_text()) if d]
    assert secret_bindings(plain) == [("ClusterRoleBinding", "")] and by_kind(plain, "ValidatingAdmissionPolicy")


def test_self_signed_certificate_is_valid_for_the_service_and_matches_the_ca_bundle(rendered: dict[str, Any]) -> None:
    from cryptography import x509

    docs = rendered["all-namespaces"]
    [secret] = by_kind(docs, "Secret")
    [mwc] = by_kind(docs, "MutatingWebhookConfiguration")
    ca_pem = base64.b64decode(mwc["webhooks"][0]["clientConfig"]["caBundle"])
    assert ca_pem == base64.b64decode(secret["data"]["ca.crt"])
    ca = x509.load_pem_x509_certificate(ca_pem)
    cert = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["tls.crt"]))
    cert.verify_directly_issued_by(ca)
    dns_names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName)
    service = mwc["webhooks"][0]["clientConfig"]["service"]
    assert f"{service['name']}.{service['namespace']}.svc" in dns_names
    [deployment] = by_kind(docs, "Deployment")
    volumes = deployment["spec"]["template"]["spec"]["volumes"]
    assert {"name": "webhook-tls", "secret": {"secretName": secret["metadata"]["name"]}} in volumes


def test_other_value_sets_render_what_they_ask_for(rendered: dict[str, Any]) -> None:
    irsa = rendered["irsa-cert-manager-monitors"]
    [sa] = by_kind(irsa, "ServiceAccount")
    assert sa["metadata"]["annotations"]["eks.amazonaws.com/role-arn"] == "arn:aws:iam::123456789012:role/sdcguard"
    [cert] = by_kind(irsa, "Certificate")
    assert cert["spec"]["issuerRef"] == {"name": "corp-ca", "kind": "ClusterIssuer"} and not by_kind(irsa, "Issuer")
    [mwc] = by_kind(irsa, "MutatingWebhookConfiguration")
    assert mwc["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == f"sdcguard/{cert['metadata']['name']}"
    assert "caBundle" not in mwc["webhooks"][0]["clientConfig"] and not by_kind(irsa, "Secret")
    assert by_kind(irsa, "ServiceMonitor") and by_kind(irsa, "PodMonitor")
    env = {e["name"]: e.get("value") for e in by_kind(irsa, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert (env["SDCGUARD_CLUSTER_NAME"], env["SDCGUARD_REGION"], env["SDCGUARD_NAMESPACES"]) == (
        "ml-cluster", "us-west-2", "ml,research")
    assert "eks.amazonaws.com/role-arn" not in (by_kind(rendered["all-namespaces"], "ServiceAccount")[0]["metadata"]
                                                .get("annotations") or {})

    own = rendered["own-secret-renamed"]
    [deployment] = by_kind(own, "Deployment")
    assert deployment["metadata"]["name"] == "guard-operator"
    assert {"name": "webhook-tls", "secret": {"secretName": "my-tls"}} in deployment["spec"]["template"]["spec"]["volumes"]
    assert not by_kind(own, "Secret") and not by_kind(own, "Certificate")
    assert {d["metadata"]["name"] for d in by_kind(own, "ClusterRole")} == {"guard-operator", "guard-alarm-keys",
                                                                    "guard-approver"}

    bare = rendered["no-webhook-no-rbac"]
    assert not by_kind(bare, "MutatingWebhookConfiguration") and not by_kind(bare, "ClusterRole")
    assert not by_kind(bare, "ServiceAccount")
    spec = by_kind(bare, "Deployment")[0]["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == "existing"
    assert "SDCGUARD_WEBHOOK_CERT_DIR" not in {e["name"] for e in spec["containers"][0]["env"]}


def test_operator_environment_names_are_ones_the_code_reads(rendered: dict[str, Any]) -> None:
    """Every variable the chart sets is spelled in the operator, or in the shared names it imports."""
    sources = "".join(p.read_text() for p in (ROOT / "operator").glob("*.py"))
    sources += (ROOT / "agent" / "contract" / "names.py").read_text()
    [deployment] = by_kind(rendered["irsa-cert-manager-monitors"], "Deployment")
    variables = {e["name"] for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    unread = sorted(n for n in variables if f'"{n}"' not in sources)
    assert unread == []


def _readme_rbac_table(title_line: str) -> set[tuple[str, str, str]]:
    text = (CHART / "README.md").read_text()
    section = text.split(title_line, 1)[1]
    rows: set[tuple[str, str, str]] = set()
    for line in section.splitlines()[2:]:
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = [c.strip().strip("`") for c in line.strip("|").split("|")]
        if cells[0] in ("apiGroup", "---"):
            continue
        for verb in cells[2].replace("`", "").split(","):
            rows.add((cells[0].strip('"'), cells[1], verb.strip()))
    return rows


def _granted(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
            for v in rule["verbs"]}


def test_every_granted_verb_is_justified_in_the_chart_readme(rendered: dict[str, Any]) -> None:
    roles = {r["metadata"]["name"]: r for r in by_kind(rendered["all-namespaces"], "ClusterRole")}
    operator_role, approver_role = roles["sdcguard-operator"], roles["sdcguard-approver"]
    assert _granted(operator_role) == _readme_rbac_table("grants exactly these verbs")
    assert _granted(roles["sdcguard-alarm-keys"]) == _readme_rbac_table("it grants:")
    [own] = [r for r in by_kind(rendered["all-namespaces"], "Role") if r["metadata"]["name"] == "sdcguard-operator"]
    assert _granted(own) == _readme_rbac_table("need to take turns safely:")
    assert _granted(approver_role) == _readme_rbac_table("ClusterRole (`approver.create`) is for people:")
    # delete only incidents past their retention (incidents.retention, operator/retention.py)
    assert {(g, r, v) for g, r, v in _granted(operator_role) if v in ("delete", "update", "*")} == {
        ("sdcguard.dev", "sdcincidents", "delete")}
    # delete only to replace a foreign per-job key Secret or ledger, which the admission policy
    # confines to those names (test_security_round3: the policy lets the operator delete only them)
    assert {(g, r, v) for g, r, v in _granted(roles["sdcguard-alarm-keys"]) if v in ("delete", "update", "*")} == {
        ("", "secrets", "delete"), ("", "configmaps", "delete")}
    assert {("sdcguard.dev", "nodereplacements", "patch"), ("sdcguard.dev", "nodereplacements", "approve")} <= \
        _granted(approver_role)
    assert not any(v == "approve" for _, _, v in _granted(operator_role))  # the operator never decides


def test_chart_crds_and_plain_manifests_do_not_drift(tmp_path: Path) -> None:
    """`make manifests` (deploy/render.sh) output must equal what is committed."""
    sources = sorted(p.name for p in (DEPLOY / "crds").glob("*.yaml"))
    assert sources == ["nodereplacement.yaml", "sdcincident.yaml"]
    env = {"PATH": f"{Path(HELM).parent}:/usr/bin:/bin", "HOME": str(tmp_path)}
    done = subprocess.run([str(DEPLOY / "render.sh"), str(tmp_path)], capture_output=True, text=True,
                          timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    sandbox = DEPLOY.parent / "agent" / "sandbox" / "crds"
    for copies in (CHART / "crds", sandbox):
        for name in sources:
            assert (copies / name).read_bytes() == (DEPLOY / "crds" / name).read_bytes(), \
                f"{copies}/{name} differs from deploy/crds/{name}: run make manifests"
        assert sorted(p.name for p in copies.iterdir()) == sources
    assert (tmp_path / "deploy" / "sdcguard.yaml").read_text() == (DEPLOY / "sdcguard.yaml").read_text(), \
        "deploy/sdcguard.yaml is stale: run make manifests"
    plain = [d for d in yaml.safe_load_all((DEPLOY / "sdcguard.yaml").read_text()) if d]
    assert not by_kind(plain, "Secret")  # no private key in a committed manifest
    for doc in plain:
        if doc["apiVersion"].startswith(("cert-manager.io", "monitoring.coreos.com")):
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("name", ["sdcincident.yaml", "nodereplacement.yaml"])
def test_crds_have_schema_status_and_printer_columns(name: str) -> None:
    crd = yaml.safe_load((DEPLOY / "crds" / name).read_text())
    version = crd["spec"]["versions"][0]
    assert crd["spec"]["group"] == "sdcguard.dev" and version["name"] == "v1"
    assert version["subresources"] == {"status": {}}
    columns = {c["name"] for c in version["additionalPrinterColumns"]}
    props = version["schema"]["openAPIV3Schema"]["properties"]
    assert {"spec", "status"} <= set(props)
    if crd["spec"]["names"]["kind"] == "SDCIncident":
        assert crd["spec"]["scope"] == "Namespaced"
        assert {"Job", "Check", "Step", "Suspects", "Window", "Resume-From", "At-Risk", "Phase", "Age"} <= columns
        status = props["status"]["properties"]
        assert {"resumeFrom", "resumeFromStep", "suspectWindow", "stepsAtRisk"} <= set(status)
    else:
        assert crd["spec"]["scope"] == "Cluster"
        assert {"Node", "Instance", "Phase", "Decision", "Age"} <= columns
        assert props["spec"]["properties"]["decision"]["enum"] == ["", "Approved", "Denied"]


def crd_validator(crd_file: Path) -> jsonschema.Draft7Validator:
    """The CRD's openAPIV3Schema as JSON Schema; fields the schema does not declare are errors
    (the API server would prune them silently: in an example that is a typo)."""
    crd = yaml.safe_load(crd_file.read_text())
    schema = copy.deepcopy(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])

    def convert(node: Any) -> Any:
        if isinstance(node, list):
            return [convert(n) for n in node]
        if not isinstance(node, dict):
            return node
        out = {k: convert(v) for k, v in node.items() if not k.startswith("x-kubernetes-") and k != "nullable"}
        if node.get("nullable") and "type" in out:
            out["type"] = [out["type"], "null"]
        if "properties" in node and "additionalProperties" not in node and not node.get(
                "x-kubernetes-preserve-unknown-fields") and node is not schema["properties"].get("metadata"):
            out["additionalProperties"] = False
        return out

    converted = convert(schema)
    converted["properties"]["metadata"] = {"type": "object"}
    return jsonschema.Draft7Validator(converted, format_checker=jsonschema.FormatChecker())


@pytest.mark.parametrize("example, crd", [("sdcincident.yaml", "sdcincident.yaml"),
                                          ("nodereplacement.yaml", "nodereplacement.yaml")])
def test_example_objects_follow_the_crd_schemas(example: str, crd: str) -> None:
    validator = crd_validator(DEPLOY / "crds" / crd)
    obj = yaml.safe_load((DEPLOY / "examples" / example).read_text())
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(obj)]
    assert errors == []
    broken = copy.deepcopy(obj)
    broken["spec"]["typo"] = 1
    broken["spec"].pop(next(iter(validator.schema["properties"]["spec"]["required"])))
    assert len(list(validator.iter_errors(broken))) == 2  # the validator is not vacuous


def test_example_pytorchjob_is_enabled_and_its_mutated_pods_are_valid() -> None:
    job = yaml.safe_load((DEPLOY / "examples" / "pytorchjob.yaml").read_text())
    annotations = job["metadata"]["annotations"]
    how, warnings = pod_mutation.plan(job["metadata"]["name"], annotations)
    assert how is not None and warnings == []
    for replica, spec in job["spec"]["pytorchReplicaSpecs"].items():
        uid = "0b1d0000-0000-4000-8000-000000000001"  # the job's, as the API server gave it
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {
            "name": f"{job['metadata']['name']}-{replica.lower()}-0", "namespace": job["metadata"]["namespace"],
            "labels": {names.JOB_NAME_LABEL: job["metadata"]["name"]},
            "ownerReferences": [{"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": job["metadata"]["name"],
                                 "uid": uid, "controller": True, "blockOwnerDeletion": True}]},
            "spec": spec["template"]["spec"]}
        mutated, notes = pod_mutation.mutated(pod, annotations, pod_mutation.SidecarSettings(
            job_controllers=(CONTROLLER,)), uid, CONTROLLER)
        assert mutated is not None and notes == []
        kubernetes_validate.validate(mutated, K8S_VERSION, strict=True)


def test_iam_policy_allows_exactly_the_sagemaker_actions_the_operator_calls() -> None:
    policy = json.loads((DEPLOY / "iam-policy.json").read_text())
    called = set(re.findall(r'_call\(settings, "(\w+)"', (ROOT / "operator" / "hyperpod.py").read_text()))
    assert called, "operator/hyperpod.py makes no SageMaker calls?"
    [statement] = policy["Statement"]
    assert statement["Effect"] == "Allow"
    assert set(statement["Action"]) == {f"sagemaker:{a}" for a in called}
    assert re.fullmatch(r"arn:aws:sagemaker:[A-Z_]+:[A-Z_]+:cluster/[A-Z_]+", statement["Resource"])


@pytest.mark.parametrize("dockerfile, requirements, module", [
    ("Dockerfile.agent", "agent-requirements.txt", "sdcguard.sidecar.publisher"),
    ("Dockerfile.operator", "operator-requirements.txt", "sdcguard_operator.main"),
])
def test_images_are_pinned_multi_stage_non_root_and_torch_free(dockerfile: str, requirements: str, module: str) -> None:
    text = (ROOT / dockerfile).read_text()
    bases = re.findall(r"^ARG PYTHON_IMAGE=(\S+)$", text, re.M)  # by digest: tests/test_security_supply_chain.py
    assert len(bases) == 1 and re.fullmatch(r"python:\d+\.\d+\.\d+-slim-\w+@sha256:[0-9a-f]{64}", bases[0])
    assert len(re.findall(r"^FROM ", text, re.M)) == 2 and "COPY --from=build" in text
    users = re.findall(r"^USER (\S+)$", text, re.M)
    assert users and all(u.split(":")[0] not in ("0", "root") for u in users)
    assert f"deploy/images/{requirements}" in text and module in text
    pins = [line.rstrip(" \\") for line in (DEPLOY / "images" / requirements).read_text().splitlines()
            if line and not line.startswith(("#", " "))]  # the --hash lines below each pin are indented
    assert all(re.fullmatch(r"[A-Za-z0-9_.-]+==[A-Za-z0-9_.+-]+", p) for p in pins)
    packages = {p.split("==")[0].lower().replace("_", "-") for p in pins}
    assert "torch" not in packages and "numpy" not in packages
    assert {"kubernetes", "prometheus-client"} <= packages
    if module == "sdcguard_operator.main":
        assert {"kopf", "boto3"} <= packages


def test_notes_tell_the_next_steps() -> None:
    def notes(*args: str) -> str:
        done = helm("install", "sdcguard", str(CHART), "--namespace", "sdcguard", "--dry-run=client", *EVERYWHERE, *args)
        assert done.returncode == 0, done.stderr
        return done.stdout.split("NOTES:", 1)[1]

    plain = notes()
    assert "AWS access (HyperPod health checks and node replacement) is NOT configured" in plain
    assert 'sdcguard.dev/enabled: "true"' in plain and "--clusterrole=sdcguard-approver" in plain
    with_role = notes("--set", "serviceAccount.irsaRoleArn=arn:aws:iam::123456789012:role/sdc")
    assert "assumes arn:aws:iam::123456789012:role/sdc (IRSA)" in with_role
    assert "webhook is disabled" in notes("--set", "webhook.enabled=false")
