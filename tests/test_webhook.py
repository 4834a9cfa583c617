"""The pod mutating webhook (docs/design.md §5): AdmissionReviews over HTTPS to kopf's real admission server.

The operator runs in a thread with a registry holding only the webhooks (plus a login
handler for the emulator), configured the way the chart configures it: a certificate directory,
a port, the sidecar settings in the environment. PyTorchJobs live in kmock and are read back by
the webhook through the official client. The returned JSONPatch is applied with ``jsonpatch``
and the resulting pod is validated against the Kubernetes schema.
"""
from __future__ import annotations

import base64
import copy
import datetime
import ipaddress
import json
import os
import socket
import ssl
import threading
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Iterator

import jsonpatch
import kopf
import kubernetes
import kubernetes_validate
import pytest

import sdcguard_operator.main as main
import sdcguard_operator.pod_mutation as pod_mutation
import sdcguard_operator.webhook as webhook
from sdcguard.contract import names
from sdcguard.sandbox.apiserver import start_emulator, write_kubeconfig

pytestmark = [pytest.mark.emulator, pytest.mark.timeout(120)]

IMAGE = "registry.example/sdcguard-agent:test"
K8S_VERSION = "1.32.0"  # first version whose schema has native sidecars everywhere we care


def make_tls(directory: Path) -> Path:
    """A self-signed serving certificate for 127.0.0.1 (the chart's secret has the same layout)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import NameOID

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "sdcguard-webhook")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tls.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (directory / "tls.key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()))
    return directory


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WebhookOperator:
    """kopf.run() in a thread with only the webhooks registered (both, as the operator registers
    them: :func:`sdcguard_operator.main.register`), the settings read from ``env`` as at start;
    ``handler_id`` picks the one ``self.url`` points at (the pod webhook by default); HTTPS."""

    def __init__(self, kube: Any, workdir: Path, handler_id: str = webhook.HANDLER_ID,
                 env: dict[str, str] | None = None) -> None:
        self.kube = kube
        self.port = free_port()
        self.tls = make_tls(workdir / "tls")
        env = {"KUBECONFIG": str(kube.kubeconfig), "SDCGUARD_WEBHOOK_CERT_DIR": str(self.tls),
               "SDCGUARD_WEBHOOK_PORT": str(self.port), "SDCGUARD_WEBHOOK_ADDR": "127.0.0.1",
               "SDCGUARD_SIDECAR_IMAGE": IMAGE, "SDCGUARD_SIDECAR_METRICS_PORT": "9464",
               # reviews carry no user: the ownerReference alone decides here (said explicitly)
               "SDCGUARD_ALLOW_ANY_JOB_CONTROLLER": "true", **(env or {})}
        self._saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        registry = kopf.OperatorRegistry()
        main.register(registry, main.load_settings(), handlers_too=False, with_login=False)

        @kopf.on.login(registry=registry)
        def login(**kwargs: Any) -> Any:
            return kopf.login_with_kubeconfig(**kwargs)

        self.stop_flag, self.ready_flag = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=kopf.run, kwargs=dict(
            registry=registry, standalone=True, clusterwide=True,
            stop_flag=self.stop_flag, ready_flag=self.ready_flag), daemon=True)
        self.thread.start()
        assert self.ready_flag.wait(30), "kopf did not start"
        self.url = f"https://127.0.0.1:{self.port}/{handler_id}"
        self.ssl = ssl.create_default_context(cafile=str(self.tls / "tls.crt"))
        _wait_listening(self.port)

    def review(self, pod: dict[str, Any]) -> dict[str, Any]:
        """POST one AdmissionReview for creating ``pod``; return the response payload."""
        uid = str(uuid.uuid4())
        body = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
            "uid": uid, "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "requestResource": {"group": "", "version": "v1", "resource": "pods"},
            "name": pod["metadata"]["name"], "namespace": pod["metadata"]["namespace"], "operation": "CREATE",
            "userInfo": {"username": "system:serviceaccount:kubeflow:training-operator"},
            "object": pod, "oldObject": None, "dryRun": False,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"}}}
        return self.post(body)

    def post(self, review: dict[str, Any]) -> dict[str, Any]:
        """POST an AdmissionReview as the API server does; return the response payload."""
        req = urllib.request.Request(self.url, json.dumps(review).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, context=self.ssl, timeout=15) as resp:
            answer = json.loads(resp.read())
        assert answer["kind"] == "AdmissionReview" and answer["response"]["uid"] == review["request"]["uid"]
        return answer["response"]

    def stop(self) -> None:
        self.stop_flag.set()
        self.thread.join(20)
        for k, v in self._saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _wait_listening(port: int) -> None:
    import time

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise AssertionError("the webhook server did not start listening")


UIDS: dict[str, str] = {}
"""job name -> the uid the emulator gave it (a pod's controlling ownerReference names it)."""


def create_job(kube: Any, name: str, annotations: dict[str, str]) -> None:
    api = kubernetes.client.CustomObjectsApi(kube.api_client())
    UIDS[name] = api.create_namespaced_custom_object("kubeflow.org", "v1", "ml", "pytorchjobs", {
        "apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
        "metadata": {"name": name, "namespace": "ml", "annotations": annotations},
        "spec": {"pytorchReplicaSpecs": {"Worker": {"replicas": 2, "template": {"spec": {"containers": [
            {"name": "pytorch", "image": "train:1"}]}}}}}})["metadata"]["uid"]


def job_pod(job: str, index: int = 0, annotations: dict[str, str] | None = None,
            uid: str | None = None) -> dict[str, Any]:
    """A pod as the training operator creates it: job labels, controller owner, two containers."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": f"{job}-worker-{index}", "namespace": "ml", "annotations": annotations or {},
        "labels": {names.JOB_NAME_LABEL: job, "training.kubeflow.org/replica-type": "worker",
                   "training.kubeflow.org/replica-index": str(index)},
        "ownerReferences": [{"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": job,
                             "uid": uid or UIDS.get(job) or str(uuid.uuid4()), "controller": True,
                             "blockOwnerDeletion": True}]},
        "spec": {"restartPolicy": "Never", "containers": [
            {"name": "pytorch", "image": "train:1", "env": [{"name": "SDCGUARD_AUDIT_EVERY", "value": "7"}]},
            {"name": "log-shipper", "image": "shipper:1"}]}}


def apply(pod: dict[str, Any], response: dict[str, Any]) -> dict[str, Any]:
    assert response["allowed"] is True
    if "patch" not in response:
        return copy.deepcopy(pod)
    assert response["patchType"] == "JSONPatch"
    ops = json.loads(base64.b64decode(response["patch"]))
    return jsonpatch.apply_patch(pod, ops)


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebhookOperator]:
    workdir = tmp_path_factory.mktemp("webhook")
    with start_emulator(workdir) as kube:
        create_job(kube, "llm", {"sdcguard.dev/enabled": "true", "sdcguard.dev/audit-every": "50",
                                 "sdcguard.dev/weight-check-every": "5"})
        create_job(kube, "plain", {})
        create_job(kube, "sloppy", {"sdcguard.dev/enabled": "TRUE", "sdcguard.dev/audit-every": "often",
                                    "sdcguard.dev/weight-check-every": "-3"})
        operator = WebhookOperator(kube, workdir)
        try:
            yield operator
        finally:
            operator.stop()


def test_pod_of_an_annotated_job_gets_sidecar_spool_identity_and_settings(server: WebhookOperator) -> None:
    pod = job_pod("llm")
    response = server.review(pod)
    assert not response.get("warnings")
    out = apply(pod, response)
    kubernetes_validate.validate(out, K8S_VERSION, strict=True)
    spec = out["spec"]
    assert spec["volumes"] == [{"name": names.SPOOL_VOLUME, "emptyDir": {}}, {"name": names.ALARM_KEY_VOLUME, "secret": {
        "secretName": "sdcguard-alarm-key-llm", "optional": True, "defaultMode": 0o444}}]
    [sidecar] = spec["initContainers"]
    assert sidecar["name"] == names.SIDECAR_CONTAINER and sidecar["image"] == IMAGE
    assert sidecar["restartPolicy"] == "Always" and sidecar["args"][0] == "sidecar"
    # the signing key: in the sidecar only, read-only; the training containers never see it
    assert {"name": names.ALARM_KEY_VOLUME, "mountPath": names.ALARM_KEY_MOUNT, "readOnly": True} in \
        sidecar["volumeMounts"]
    assert sidecar["args"][sidecar["args"].index("--key-file") + 1] == names.ALARM_KEY_FILE
    assert names.ALARM_KEY_FILE.startswith(names.ALARM_KEY_MOUNT + "/")
    for container in spec["containers"]:
        assert all(m["name"] != names.ALARM_KEY_VOLUME for m in container["volumeMounts"])
        assert not any("KEY" in e["name"] for e in container.get("env", []))
    for container in spec["containers"] + [sidecar]:
        assert {"name": names.SPOOL_VOLUME, "mountPath": names.SPOOL_PATH} in container["volumeMounts"]
        env = env_of(container)
        assert env["SDCGUARD_SPOOL"] == names.SPOOL_PATH
        assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        assert env["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
        assert env["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
        assert env["POD_UID"] == {"fieldRef": {"fieldPath": "metadata.uid"}}  # signed as suspects[].pod_uid
    for container in spec["containers"]:
        env = env_of(container)
        assert (env["SDCGUARD_JOB_NAME"], env["SDCGUARD_JOB_KIND"]) == ("llm", "PyTorchJob")
        assert env["SDCGUARD_JOB_UID"] == UIDS["llm"]  # signed as job.uid
        assert (env["SDCGUARD_AUDIT_EVERY"], env["SDCGUARD_WEIGHT_CHECK_EVERY"]) == ("50", "5")
    assert [e["name"] for e in spec["containers"][0]["env"]].count("SDCGUARD_AUDIT_EVERY") == 1
    assert out["metadata"]["labels"][names.INJECTED_LABEL] == "true"
    assert out["metadata"]["name"] == pod["metadata"]["name"]


def test_a_pod_mutated_once_is_left_unchanged(server: WebhookOperator) -> None:
    pod = job_pod("llm", 1)
    once = apply(pod, server.review(pod))
    again = server.review(once)
    assert "patch" not in again or json.loads(base64.b64decode(again["patch"])) == []
    assert apply(once, again) == once


def test_a_burst_of_pods_of_one_job_reads_the_job_once(server: WebhookOperator) -> None:
    server.review(job_pod("llm", 4))
    before = server.kube.request_count()
    for index in range(5, 9):
        assert "patch" in server.review(job_pod("llm", index))
    assert server.kube.request_count() == before  # served from the 30 s cache


def test_pod_of_an_unannotated_job_is_admitted_unchanged(server: WebhookOperator) -> None:
    pod = job_pod("plain")
    response = server.review(pod)
    assert apply(pod, response) == pod and not response.get("warnings")


def test_bad_annotation_values_warn_and_fall_back_to_defaults(server: WebhookOperator) -> None:
    pod = job_pod("sloppy")
    response = server.review(pod)
    warnings = "\n".join(response.get("warnings", []))
    assert "sdcguard.dev/audit-every='often'" in warnings and "default (100)" in warnings
    assert "sdcguard.dev/weight-check-every='-3'" in warnings and "default (10)" in warnings
    out = apply(pod, response)
    kubernetes_validate.validate(out, K8S_VERSION, strict=True)
    env = env_of(out["spec"]["containers"][0])
    assert env["SDCGUARD_JOB_NAME"] == "sloppy"
    assert env["SDCGUARD_AUDIT_EVERY"] == "7"  # the container's own value stays; the annotation was bad
    assert "SDCGUARD_WEIGHT_CHECK_EVERY" not in env


def test_missing_job_fails_open_and_without_a_verified_owner_there_is_no_sidecar(server: WebhookOperator) -> None:
    """Before issue 20 a pod whose job could not be read still got the sidecar (and the job's key)
    from its own template annotations; the owner cannot be verified then, so it gets none."""
    pod = job_pod("ghost")
    response = server.review(pod)
    assert apply(pod, response) == pod
    assert any("PyTorchJob ml/ghost not found" in w for w in response["warnings"])
    enabled = job_pod("ghost", 1, {"sdcguard.dev/enabled": "true", "sdcguard.dev/audit-every": "20"})
    response = server.review(enabled)
    assert apply(enabled, response) == enabled
    assert any("no sidecar" in w for w in response["warnings"])


def test_a_decoy_pod_of_an_enabled_job_gets_no_sidecar(server: WebhookOperator) -> None:
    """Attack (issue 20, 1): a pod anyone may create with the job-name label of an enabled job and
    no controlling owner (or another one, or the job's name with another uid: an earlier job of
    that name) got the sidecar, and so the job's key: its alarms were signed and accepted, and
    cordoned whatever node the pod named. Now only the job's own pods (owner uid) get it."""
    for decoy in (job_pod("llm", 11), job_pod("llm", 12, uid=str(uuid.uuid4())), job_pod("llm", 13)):
        if decoy["metadata"]["name"].endswith("-11"):
            del decoy["metadata"]["ownerReferences"]
        if decoy["metadata"]["name"].endswith("-13"):
            decoy["metadata"]["ownerReferences"][0]["controller"] = False
        response = server.review(decoy)
        assert apply(decoy, response) == decoy, decoy["metadata"]["name"]
        assert any("is not controlled by PyTorchJob llm" in w for w in response["warnings"])
    assert "patch" in server.review(job_pod("llm", 14))  # the job's own pod still gets it


def test_no_container_but_the_sidecar_can_reach_a_key_secret_by_any_name() -> None:
    """Attack (issue 20, 4): only a volume named sdcguard-alarm-key was kept from training
    containers; the pod template's own secret or projected volume of sdcguard-alarm-key-<job>
    (any volume name), an env secretKeyRef or an envFrom secretRef left the key readable by the
    training container. Now each is removed, in every pod the webhook sees (enabled or not)."""
    settings = pod_mutation.SidecarSettings(image=IMAGE, allow_any_job_controller=True)
    for enabled in (True, False):
        pod = job_pod("llm" if enabled else "plain")
        spec = pod["spec"]
        spec["volumes"] = [{"name": "mine", "secret": {"secretName": "sdcguard-alarm-key-llm"}},
                           {"name": "proj", "projected": {"sources": [
                               {"secret": {"name": "sdcguard-alarm-key-other"}},
                               {"configMap": {"name": "settings"}}]}},
                           {"name": "only", "projected": {"sources": [{"secret": {"name": "sdcguard-alarm-key-llm"}}]}}]
        train = spec["containers"][0]
        train["volumeMounts"] = [{"name": n, "mountPath": f"/{n}"} for n in ("mine", "proj", "only")]
        train["env"] += [{"name": "K", "valueFrom": {"secretKeyRef": {"name": "sdcguard-alarm-key-llm", "key": "key"}}}]
        train["envFrom"] = [{"secretRef": {"name": "sdcguard-alarm-key-llm"}}, {"configMapRef": {"name": "x"}}]
        spec["initContainers"] = [{"name": names.SIDECAR_CONTAINER, "image": "evil:1",
                                   "volumeMounts": [{"name": "mine", "mountPath": "/k"}]}]
        out, warnings = pod_mutation.mutated(pod, {"sdcguard.dev/enabled": "true"} if enabled else {}, settings,
                                        UIDS.get("llm") if enabled else None)
        assert out is not None and len(warnings) >= 5, warnings
        text = json.dumps([c for c in out["spec"]["containers"]]
                          + [c for c in out["spec"].get("initContainers", []) if c.get("image") != IMAGE])
        assert "sdcguard-alarm-key" not in text, text
        for volume in out["spec"]["volumes"]:
            refs = json.dumps(volume)
            assert "sdcguard-alarm-key" not in refs or volume["name"] == names.ALARM_KEY_VOLUME, volume
        assert {"configMap": {"name": "settings"}} in next(v for v in out["spec"]["volumes"]
                                                           if v["name"] == "proj")["projected"]["sources"]
        assert train["envFrom"] != out["spec"]["containers"][0]["envFrom"] == [{"configMapRef": {"name": "x"}}]
        if enabled:
            [sidecar] = [c for c in out["spec"]["initContainers"] if c["name"] == names.SIDECAR_CONTAINER]
            assert sidecar["image"] == IMAGE
        kubernetes_validate.validate(out, K8S_VERSION, strict=True)


def test_pods_that_are_not_pytorchjob_pods_are_ignored(server: WebhookOperator) -> None:
    stray = job_pod("llm", 2)
    del stray["metadata"]["labels"][names.JOB_NAME_LABEL]
    assert apply(stray, server.review(stray)) == stray
    tfjob = job_pod("llm", 3)
    tfjob["metadata"]["ownerReferences"][0]["kind"] = "TFJob"
    assert apply(tfjob, server.review(tfjob)) == tfjob


def test_job_lookup_fails_open_within_its_timeout_when_the_api_server_is_unreachable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio
    import time

    monkeypatch.setenv("KUBECONFIG", str(write_kubeconfig(tmp_path / "kc", f"http://127.0.0.1:{free_port()}")))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    jobs = webhook.JobAnnotations(webhook.kubernetes_fetch(timeout=1.0))
    started = time.monotonic()
    annotations, problem = asyncio.run(jobs.get("ml", "llm"))
    assert annotations is None and problem and "could not read PyTorchJob ml/llm" in problem
    assert time.monotonic() - started < 3


def test_a_training_container_cannot_claim_the_key_volume_by_name() -> None:
    pod = job_pod("llm")
    pod["spec"]["volumes"] = [{"name": names.ALARM_KEY_VOLUME, "emptyDir": {}}]
    pod["spec"]["containers"][0]["volumeMounts"] = [{"name": names.ALARM_KEY_VOLUME, "mountPath": "/stolen"}]
    out, _ = pod_mutation.mutated(pod, {"sdcguard.dev/enabled": "true"}, pod_mutation.SidecarSettings(image=IMAGE, allow_any_job_controller=True),
                             pod["metadata"]["ownerReferences"][0]["uid"])
    assert out is not None
    assert [v for v in out["spec"]["volumes"] if v["name"] == names.ALARM_KEY_VOLUME] == [
        {"name": names.ALARM_KEY_VOLUME, "secret": {"secretName": "sdcguard-alarm-key-llm", "optional": True,
                                                    "defaultMode": 0o444}}]
    assert all(m["name"] != names.ALARM_KEY_VOLUME for c in out["spec"]["containers"] for m in c["volumeMounts"])


def test_plan_and_inject_are_pure_and_idempotent() -> None:
    settings = pod_mutation.SidecarSettings(image=IMAGE, allow_any_job_controller=True)
    pod = job_pod("llm")
    before = copy.deepcopy(pod)
    uid = pod["metadata"]["ownerReferences"][0]["uid"]
    out, warnings = pod_mutation.mutated(pod, {"sdcguard.dev/enabled": "true"}, settings, uid)
    assert out is not None and warnings == [] and pod == before  # the input is not touched
    again, _ = pod_mutation.mutated(out, {"sdcguard.dev/enabled": "true"}, settings, uid)
    assert again == out
    off, warnings = pod_mutation.mutated(pod, {"sdcguard.dev/enabled": "yes"}, settings, uid)
    assert off is None and "neither" in warnings[0]


def test_missing_kube_configuration_is_a_failed_lookup_not_a_failed_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    jobs = webhook.JobAnnotations(webhook.kubernetes_fetch(timeout=1.0))  # must not raise
    annotations, problem = asyncio.run(jobs.get("ml", "llm"))
    assert annotations is None and "could not read PyTorchJob ml/llm" in (problem or "")


def test_with_job_controllers_set_only_their_pods_get_the_sidecar() -> None:
    """Residual of attack 1: an ownerReference is written by whoever creates the pod; anyone who
    may create pods and read the job's uid could forge the job's. With the job controller's user
    configured (SDCGUARD_JOB_CONTROLLER_USERS, chart webhook.jobControllerUsers), the pod must also
    be created by it, as the API server authenticated the request."""
    controller = "system:serviceaccount:kubeflow:training-operator"
    settings = pod_mutation.SidecarSettings(image=IMAGE, job_controllers=(controller,))
    assert pod_mutation.SidecarSettings.from_env({"SDCGUARD_JOB_CONTROLLER_USERS": f"{controller}, other"}).job_controllers \
        == (controller, "other")
    pod = job_pod("llm", 21)
    uid = pod["metadata"]["ownerReferences"][0]["uid"]
    out, warnings = pod_mutation.mutated(pod, {"sdcguard.dev/enabled": "true"}, settings, uid, controller)
    assert out is not None and warnings == []
    forged, warnings = pod_mutation.mutated(pod, {"sdcguard.dev/enabled": "true"}, settings, uid, "mallory")
    assert forged is None and "not by the job controller" in warnings[0]


def test_injected_pods_get_a_grace_period_the_sidecar_knows_and_never_a_shorter_one() -> None:
    def injected(grace: int | None, settings: pod_mutation.SidecarSettings) -> dict:
        pod = {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "train", "image": "t"}]}}
        if grace is not None:
            pod["spec"]["terminationGracePeriodSeconds"] = grace
        how, _ = pod_mutation.plan("llm", {"sdcguard.dev/enabled": "true"})
        pod_mutation.inject(pod, how=how, sidecar=settings)
        return pod

    default = pod_mutation.SidecarSettings()
    pod = injected(None, default)
    [sidecar] = [c for c in pod["spec"]["initContainers"] if c["name"] == "sdcguard-sidecar"]
    assert pod["spec"]["terminationGracePeriodSeconds"] == 90
    assert sidecar["args"][sidecar["args"].index("--grace-period") + 1] == "90"
    longer = injected(600, default)
    assert longer["spec"]["terminationGracePeriodSeconds"] == 600
    [sidecar] = [c for c in longer["spec"]["initContainers"] if c["name"] == "sdcguard-sidecar"]
    assert sidecar["args"][sidecar["args"].index("--grace-period") + 1] == "600"
    env = pod_mutation.SidecarSettings.from_env({"SDCGUARD_SIDECAR_GRACE_SECONDS": "120"})
    assert injected(30, env)["spec"]["terminationGracePeriodSeconds"] == 120
