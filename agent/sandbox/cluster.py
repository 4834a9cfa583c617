"""A stand-in HyperPod cluster on 127.0.0.1: the API emulator, the SageMaker endpoint, the real operator.

A SANDBOX, never a production path (see :mod:`.kube` and :mod:`.sagemaker` for what they do not
emulate). :class:`Sandbox` holds both emulators and runs ``sdcguard operator`` as a subprocess
against them, with the environment the chart would give it, authenticated as its own service
account. It also builds what a HyperPod cluster holds: nodes named ``hyperpod-i-…`` with the
SageMaker labels (each one registered in the SageMaker cluster too), PyTorchJobs and their pods.

The test suite's operator world is this class plus test-only helpers (tests/conftest.py), so what
the tests prove is what the sandbox runs.

Users (bearer tokens, written as kubeconfigs in the work directory): ``tester`` (the default
kubeconfig), the operator (``OPERATOR_USER``), and whatever :meth:`Sandbox.user` adds.
"""
from __future__ import annotations

import base64
import os
import pathlib
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Callable

from ..child_process import die_with_parent
from ..contract import names
from .apiserver import start_emulator
from .sagemaker import start_aws

CLUSTER = "ml-cluster"
GROUP = "workers"
OPERATOR_USER = "system:serviceaccount:sdcguard:sdcguard"
ADMISSION_WEBHOOK = "nodereplacements.sdcguard.dev"
POD_WEBHOOK = "pods.sdcguard.dev"
BINDIR = pathlib.Path(sys.prefix) / "bin"
#: The environment's own kubectl (``make tools`` puts one there), else the one on PATH.
KUBECTL = str(BINDIR / "kubectl") if (BINDIR / "kubectl").exists() else shutil.which("kubectl") or "kubectl"
INSTANCE_TYPE = "ml.p5.48xlarge"

#: The ``sdcguard`` command: the console script beside this Python, else the module.
SDCGUARD = [str(BINDIR / "sdcguard")] if (BINDIR / "sdcguard").exists() else [sys.executable, "-m", "sdcguard.cli"]
WORKDIR_ENV = "SDCGUARD_SANDBOX_DIR"
"""Set in every process the sandbox starts (its work directory): what "nothing left running" looks for."""

#: Short operator delays, so a sandbox incident takes seconds (the chart's defaults are minutes).
FAST_SETTINGS = {
    "SDCGUARD_POLL_SECONDS": "0.3", "SDCGUARD_RETRY_SECONDS": "0.2", "SDCGUARD_RETRY_MAX_SECONDS": "1",
    "SDCGUARD_STORM_GUARD_RECHECK_SECONDS": "0.5", "SDCGUARD_LEASE_SECONDS": "4", "SDCGUARD_RENEW_SECONDS": "3",
    "SDCGUARD_AWS_READ_TIMEOUT": "5",
}


class SandboxError(AssertionError):
    """A step of the sandbox did not happen: a wait timed out or the operator exited (the message
    ends with the operator's log), or a command failed.

    An ``AssertionError``: in tests a timed-out wait is a failed expectation."""


def workdir_problem(path: pathlib.Path | None) -> str | None:
    """Why ``--workdir`` cannot hold a sandbox (it must be new or an empty directory), or None."""
    if path is not None and path.exists() and (not path.is_dir() or any(path.iterdir())):
        return f"--workdir {path} is not an empty directory"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def new_instance() -> str:
    """A fresh EC2-style instance id (``i-`` and 17 hex digits)."""
    return "i-" + secrets.token_hex(9)[:17]


class Sandbox:
    """Both emulators, and the real operator as a subprocess that can be killed and restarted.

    ``admission``: NodeReplacement writes go through the operator's admission webhook (as the
    chart configures the API server to); ``pod_webhook``: pod creations go through its pod
    mutating webhook (the sidecar is injected). ``settings``: ``SDCGUARD_*`` for the operator.
    """

    def __init__(self, workdir: pathlib.Path | str, *, admission: bool = False, pod_webhook: bool = False,
                 cluster: str = CLUSTER, **settings: str) -> None:
        import kubernetes

        self.workdir = pathlib.Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.cluster = cluster
        self.kube = start_emulator(self.workdir)
        self.aws = start_aws()
        self.api = self.kube.api_client()
        self.core = kubernetes.client.CoreV1Api(self.api)
        self.custom = kubernetes.client.CustomObjectsApi(self.api)
        self.metrics_port = free_port()
        self.webhook_port = free_port()  # the pod and NodeReplacement webhooks register in the same kopf
        # The caller's own SDCGUARD_* / AWS_* settings must not reach the sandbox's processes.
        inherited = {k: v for k, v in os.environ.items() if not k.startswith(("SDCGUARD_", "AWS_"))}
        if pod_webhook and not settings.get("SDCGUARD_JOB_CONTROLLER_USERS"):
            # the sandbox creates the job's pods as its own user, not as Kubeflow's training operator
            settings.setdefault("SDCGUARD_ALLOW_ANY_JOB_CONTROLLER", "true")
        if not admission:  # as the chart sets it without the NodeReplacement webhook: nobody records deciders
            settings.setdefault("SDCGUARD_REQUIRE_ADMISSION_DECISIONS", "false")
        self.env = {**inherited, **self.aws.env(), "KUBECONFIG": str(self.kube.kubeconfig), "KUBECTL": KUBECTL,
                    WORKDIR_ENV: str(self.workdir), "PYTHONSAFEPATH": "1",
                    "PATH": f"{BINDIR}:{os.environ.get('PATH', '')}",
                    "SDCGUARD_CLUSTER_NAME": cluster, "SDCGUARD_METRICS_PORT": str(self.metrics_port),
                    "SDCGUARD_WEBHOOK_PORT": str(self.webhook_port), "SDCGUARD_OPERATOR_USERNAME": OPERATOR_USER,
                    **FAST_SETTINGS, **settings}
        self.operator_env = {**self.env, "KUBECONFIG": str(self.kube.add_user("operator", OPERATOR_USER))}
        self.admission_url = f"http://127.0.0.1:{self.webhook_port}/{names.REPLACEMENT_WEBHOOK_ID}"
        self.pod_webhook_url = f"http://127.0.0.1:{self.webhook_port}/{names.POD_WEBHOOK_ID}"
        if admission:
            self.kube.grant("user:tester", "approve", f"{names.REPLACEMENTS}.{names.GROUP}")
            self.admission(True)
        if pod_webhook:  # as the chart registers it: pods are admitted unchanged while it is down
            self.kube.admit("v1/pods", self.pod_webhook_url, POD_WEBHOOK, failure_policy="Ignore")
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def admission(self, on: bool) -> None:
        """Route NodeReplacement writes through the operator's webhook (or stop, as if it were uninstalled)."""
        self.kube.admit(f"{names.GROUP}/{names.VERSION}/{names.REPLACEMENTS}", self.admission_url if on else None,
                        ADMISSION_WEBHOOK)

    def user(self, token: str, username: str, groups: list[str] | None = None) -> pathlib.Path:
        """Authenticate ``token`` as ``username``; returns a kubeconfig for that user."""
        return self.kube.add_user(token, username, groups)

    # -- the operator process -------------------------------------------------------------------
    def start_operator(self, via_kopf: bool = False) -> None:
        """``sdcguard operator``, or ``kopf run -m sdcguard_operator.main --standalone`` with ``via_kopf``."""
        self.starts += 1
        command = [str(BINDIR / "kopf"), "run", "-m", "sdcguard_operator.main", "--standalone", "--all-namespaces"] \
            if via_kopf else [*SDCGUARD, "operator"]
        with open(self.workdir / f"operator-{self.starts}.log", "wb") as log:
            self.proc = subprocess.Popen(command, env=self.operator_env, stdout=log, stderr=subprocess.STDOUT,
                                         preexec_fn=die_with_parent)
        if self.kube.emulator.webhooks:  # those writes fail (failurePolicy Fail) until it listens
            self.wait(lambda: listening(self.webhook_port), timeout=60, what="the operator's webhooks",
                      require_operator=True)

    def spawn_operator(self, tag: str, **env: str) -> subprocess.Popen[bytes]:
        """One more ``sdcguard operator`` replica (a second pod of the Deployment), logging to
        ``operator-<tag>.log``; the caller kills it. Replicas share the metrics and webhook ports'
        settings, so a later one serves neither: give it its own with ``env``."""
        with open(self.workdir / f"operator-{tag}.log", "ab") as log:
            return subprocess.Popen([*SDCGUARD, "operator"], env={**self.operator_env, **env},
                                    stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)

    def kill_operator(self) -> None:
        """SIGKILL: no graceful shutdown, exactly like a crashed pod."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def log(self) -> str:
        return "".join(p.read_text(errors="replace") for p in sorted(self.workdir.glob("operator-*.log")))

    def close(self) -> None:
        self.kill_operator()
        self.aws.stop()
        self.kube.stop()

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- what the cluster holds -------------------------------------------------------------------
    def node(self, instance_id: str | None = None, *, name: str | None = None, labelled: bool = True,
             provider_id: str | None = None, group: str = GROUP, register: bool = True) -> str:
        """A HyperPod node (also registered in the SageMaker cluster, unless ``register=False``);
        returns its name."""
        instance_id = instance_id or new_instance()
        name = name or f"hyperpod-{instance_id}"
        labels = {names.HYPERPOD_CLUSTER_LABEL: self.cluster, names.HYPERPOD_GROUP_LABEL: group,
                  "node.kubernetes.io/instance-type": INSTANCE_TYPE} if labelled else {}
        body: dict[str, Any] = {"metadata": {"name": name, "labels": labels}, "spec": {}}
        if provider_id:
            body["spec"]["providerID"] = provider_id
        self.core.create_node(body)
        if register:
            self.aws.add_cluster(self.cluster, {instance_id: group})
        return name

    def job(self, namespace: str, name: str, enabled: bool = True, annotations: dict[str, str] | None = None) -> str:
        """A PyTorchJob (not suspended), enabled for sdcguard unless ``enabled=False``; its uid."""
        annotations = {**({names.ENABLED_ANNOTATION: "true"} if enabled else {}), **(annotations or {})}
        return self.custom.create_namespaced_custom_object(names.JOB_GROUP, names.JOB_VERSION, namespace, names.JOB_PLURAL, {
            "apiVersion": f"{names.JOB_GROUP}/{names.JOB_VERSION}", "kind": names.JOB_KIND,
            "metadata": {"name": name, "namespace": namespace, "annotations": annotations},
            "spec": {"runPolicy": {"suspend": False}, "pytorchReplicaSpecs": {}}})["metadata"]["uid"]

    def job_uid(self, namespace: str, name: str) -> str:
        return self.custom.get_namespaced_custom_object(names.JOB_GROUP, names.JOB_VERSION, namespace,
                                                        names.JOB_PLURAL, name)["metadata"]["uid"]

    def pod(self, namespace: str, name: str, job: str, node: str, *, owned: bool = True) -> str:
        """A worker pod of ``job`` bound to ``node``, labelled and owned (controlling ownerReference,
        the job's live uid) as the training operator makes it; ``owned=False``: a pod anyone could
        create with the job's label. Returns its uid."""
        meta: dict[str, Any] = {"name": name, "namespace": namespace,
                                "labels": {names.JOB_NAME_LABEL: job, "training.kubeflow.org/replica-type": "worker"}}
        if owned:
            meta["ownerReferences"] = [{"apiVersion": names.JOB_API_VERSION, "kind": names.JOB_KIND, "name": job,
                                        "uid": self.job_uid(namespace, job), "controller": True,
                                        "blockOwnerDeletion": True}]
        return self.core.create_namespaced_pod(namespace, {
            "metadata": meta, "spec": {"nodeName": node, "containers": [{"name": "pytorch", "image": "train:1"}]},
            "status": {"phase": "Running"}}).metadata.uid

    def training(self, namespace: str, job: str, nodes: list[str], enabled: bool = True,
                 annotations: dict[str, str] | None = None) -> list[str]:
        """A job with one pod per node (pod i on nodes[i]); returns the pod names."""
        self.job(namespace, job, enabled, annotations)
        pods = [f"{job}-worker-{i}" for i in range(len(nodes))]
        for pod, node in zip(pods, nodes):
            self.pod(namespace, pod, job, node)
        return pods

    def alarm_key(self, namespace: str, job: str, timeout: float = 45) -> bytes:
        """The job's signing key, from the Secret the operator creates (waits for it)."""
        secret = self.wait(lambda: self.core.read_namespaced_secret(f"{names.ALARM_KEY_SECRET_PREFIX}{job}", namespace),
                           timeout=timeout, what=f"alarm key Secret of {namespace}/{job}")
        return base64.b64decode(secret.data[names.ALARM_KEY_DATA_KEY])

    # -- reading state ----------------------------------------------------------------------------
    def incidents(self, namespace: str) -> list[dict[str, Any]]:
        return self.custom.list_namespaced_custom_object(names.GROUP, names.VERSION, namespace, names.INCIDENTS)["items"]

    def incident(self, namespace: str, name: str) -> dict[str, Any]:
        return self.custom.get_namespaced_custom_object(names.GROUP, names.VERSION, namespace, names.INCIDENTS, name)

    def replacements(self) -> list[dict[str, Any]]:
        return self.custom.list_cluster_custom_object(names.GROUP, names.VERSION, names.REPLACEMENTS)["items"]

    def replacement(self, name: str) -> dict[str, Any]:
        return self.custom.get_cluster_custom_object(names.GROUP, names.VERSION, names.REPLACEMENTS, name)

    def node_state(self, name: str) -> tuple[bool, str | None]:
        """(cordoned, the suspect label's value)."""
        node = self.core.read_node(name)
        return bool(node.spec.unschedulable), (node.metadata.labels or {}).get(names.SUSPECT_LABEL)

    def job_suspended(self, namespace: str, name: str) -> bool:
        job = self.custom.get_namespaced_custom_object(names.JOB_GROUP, names.JOB_VERSION, namespace,
                                                       names.JOB_PLURAL, name)
        return bool(job["spec"].get("runPolicy", {}).get("suspend"))

    def event_annotation(self, namespace: str, name: str) -> str | None:
        """What the operator's intake wrote on an alarm Event (``accepted:…`` / ``rejected:…``)."""
        return (self.core.read_namespaced_event(name, namespace).metadata.annotations or {}).get(names.INTAKE_ANNOTATION)

    def kubectl(self, *args: str, kubeconfig: pathlib.Path | None = None) -> subprocess.CompletedProcess[str]:
        """Real kubectl (and so ``kubectl sdcguard``) as ``tester``, or as the user of ``kubeconfig``."""
        env = self.env if kubeconfig is None else {**self.env, "KUBECONFIG": str(kubeconfig)}
        return subprocess.run([KUBECTL, *args], env=env, capture_output=True, text=True, timeout=60)

    def metrics(self) -> str:
        import urllib.request
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as response:
            return response.read().decode()

    def wait(self, predicate: Callable[[], Any], timeout: float = 45, what: str = "condition",
             require_operator: bool = False) -> Any:
        """Poll until ``predicate()`` is truthy (API errors count as "not yet"); else SandboxError
        with the operator log's tail — at once if ``require_operator`` and the operator has exited."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            if require_operator and (self.proc is None or self.proc.poll() is not None):
                code = None if self.proc is None else self.proc.returncode
                raise SandboxError(f"the operator is not running (exit status {code}) while waiting for "
                                     f"{what}\n--- operator log tail ---\n" + self.log()[-6000:])
            try:
                last = predicate()
            except Exception as exc:  # noqa: BLE001 - e.g. 404 before the object exists
                last = exc
            else:
                if last:
                    return last
            time.sleep(0.1)
        raise SandboxError(f"timed out waiting for {what} (last: {last!r})\n--- operator log tail ---\n"
                             + self.log()[-6000:])
