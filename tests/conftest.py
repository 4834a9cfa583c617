"""Shared test set-up: the ``operator`` marker and a world for operator tests.

``OperatorWorld`` = the Kubernetes emulator (kube_emulator) + the local SageMaker endpoint
(aws_emulator) + the real operator run as a subprocess (``sdcguard operator``), with short kopf
delays.  Operator test modules build one world per module (``make_world``).

The operator authenticates as its own service account (``OPERATOR_USER``); tests and kubectl as
``tester``. ``make_world(admission=True)`` also sends NodeReplacement writes through the
operator's own admission webhook, as the chart configures the API server to, with ``tester``
granted the ``approve`` verb. Alarm Events are signed with the job's key Secret, as the sidecar
signs them (``alarm_event``).
"""
from __future__ import annotations

import json
import os
import pathlib
import secrets
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Callable

import pytest

CLUSTER = "ml-cluster"
GROUP = "workers"
OPERATOR_USER = "system:serviceaccount:sdcguard:sdcguard"
ADMISSION_WEBHOOK = "nodereplacements.sdcguard.dev"
KUBECTL = str(pathlib.Path(sys.prefix) / "bin" / "kubectl")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "operator: runs the kopf operator against the Kubernetes and AWS emulators")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _die_with_parent() -> None:
    """Linux: the operator gets SIGKILL if the test process dies first (no orphans left on CI)."""
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def new_instance() -> str:
    return "i-" + secrets.token_hex(9)[:17]


class OperatorWorld:
    """Emulators + an operator subprocess that tests can kill and restart."""

    def __init__(self, workdir: pathlib.Path, admission: bool = False, **settings: str) -> None:
        from aws_emulator import start_aws
        from kube_emulator import start_emulator
        import kubernetes

        self.workdir = workdir
        self.kube = start_emulator(workdir)
        self.aws = start_aws()
        self.api = self.kube.api_client()
        self.core = kubernetes.client.CoreV1Api(self.api)
        self.custom = kubernetes.client.CustomObjectsApi(self.api)
        self.metrics_port = free_port()
        self.webhook_port = free_port()  # the pod and NodeReplacement webhooks register in the same kopf
        self.env = {**os.environ, **self.aws.env(), "KUBECONFIG": str(self.kube.kubeconfig), "KUBECTL": KUBECTL,
                    "PATH": f"{pathlib.Path(sys.prefix) / 'bin'}:{os.environ.get('PATH', '')}",
                    "SDCGUARD_CLUSTER_NAME": CLUSTER, "SDCGUARD_POLL_SECONDS": "0.3",
                    "SDCGUARD_RETRY_SECONDS": "0.2", "SDCGUARD_RETRY_MAX_SECONDS": "1",
                    "SDCGUARD_STORM_GUARD_RECHECK_SECONDS": "0.5", "SDCGUARD_METRICS_PORT": str(self.metrics_port),
                    "SDCGUARD_WEBHOOK_PORT": str(self.webhook_port), "SDCGUARD_OPERATOR_USERNAME": OPERATOR_USER,
                    "SDCGUARD_LEASE_SECONDS": "4", "SDCGUARD_RENEW_SECONDS": "3", "SDCGUARD_AWS_READ_TIMEOUT": "5",
                    **settings}
        self.operator_env = {**self.env, "KUBECONFIG": str(self.kube.add_user("operator", OPERATOR_USER))}
        self.admission_url = f"http://127.0.0.1:{self.webhook_port}/sdcguard-nodereplacement-admission"
        if admission:
            self.kube.grant("user:tester", "approve", "nodereplacements.sdcguard.dev")
            self.admission(True)
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def admission(self, on: bool) -> None:
        """Route NodeReplacement writes through the operator's webhook (or stop, as if it were uninstalled)."""
        self.kube.admit("sdcguard.dev/v1/nodereplacements", self.admission_url if on else None, ADMISSION_WEBHOOK)

    # -- the operator process -------------------------------------------------------------------
    def start_operator(self, via_kopf: bool = False) -> None:
        """``sdcguard operator``, or ``kopf run -m sdcguard_operator --standalone`` with ``via_kopf``."""
        self.starts += 1
        log = open(self.workdir / f"operator-{self.starts}.log", "wb")
        bindir = pathlib.Path(sys.prefix) / "bin"
        command = [str(bindir / "kopf"), "run", "-m", "sdcguard_operator", "--standalone", "--all-namespaces"] \
            if via_kopf else [str(bindir / "sdcguard"), "operator"]
        self.proc = subprocess.Popen(command, env=self.operator_env, stdout=log, stderr=subprocess.STDOUT,
                                     preexec_fn=_die_with_parent)
        if self.kube.emulator.webhooks:  # NodeReplacement writes fail (failurePolicy Fail) until it listens
            self.wait(lambda: _listening(self.webhook_port), timeout=60, what="the operator's admission webhook")

    def spawn_operator(self, tag: str, **env: str) -> subprocess.Popen[bytes]:
        """One more ``sdcguard operator`` replica (a second pod of the Deployment), logging to
        ``operator-<tag>.log``; the caller kills it. Replicas share the metrics and webhook ports'
        settings, so a later one serves neither: give it its own with ``env``."""
        log = open(self.workdir / f"operator-{tag}.log", "ab")
        return subprocess.Popen([str(pathlib.Path(sys.prefix) / "bin" / "sdcguard"), "operator"],
                                env={**self.operator_env, **env}, stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=_die_with_parent)

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

    # -- cluster fixtures -------------------------------------------------------------------------
    def node(self, instance_id: str | None = None, *, name: str | None = None, labelled: bool = True,
             provider_id: str | None = None) -> str:
        """A HyperPod node (also registered in the SageMaker cluster); returns its name."""
        instance_id = instance_id or new_instance()
        name = name or f"hyperpod-{instance_id}"
        labels = {"sagemaker.amazonaws.com/cluster-name": CLUSTER,
                  "sagemaker.amazonaws.com/instance-group-name": GROUP} if labelled else {}
        body: dict[str, Any] = {"metadata": {"name": name, "labels": labels}, "spec": {}}
        if provider_id:
            body["spec"]["providerID"] = provider_id
        self.core.create_node(body)
        self.aws.add_cluster(CLUSTER, {instance_id: GROUP})
        return name

    def job(self, namespace: str, name: str, enabled: bool = True) -> None:
        annotations = {"sdcguard.dev/enabled": "true"} if enabled else {}
        self.custom.create_namespaced_custom_object("kubeflow.org", "v1", namespace, "pytorchjobs", {
            "apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
            "metadata": {"name": name, "namespace": namespace, "annotations": annotations},
            "spec": {"runPolicy": {"suspend": False}, "pytorchReplicaSpecs": {}}})

    def pod(self, namespace: str, name: str, job: str, node: str) -> None:
        self.core.create_namespaced_pod(namespace, {
            "metadata": {"name": name, "namespace": namespace,
                         "labels": {"training.kubeflow.org/job-name": job, "training.kubeflow.org/replica-type": "worker"}},
            "spec": {"nodeName": node, "containers": [{"name": "pytorch", "image": "train:1"}]}})

    def training(self, namespace: str, job: str, nodes: list[str], enabled: bool = True) -> list[str]:
        """A job with one pod per node (rank i on nodes[i]); returns the pod names."""
        self.job(namespace, job, enabled)
        pods = [f"{job}-worker-{i}" for i in range(len(nodes))]
        for pod, node in zip(pods, nodes):
            self.pod(namespace, pod, job, node)
        return pods

    def alarm_key(self, namespace: str, job: str, timeout: float = 45) -> bytes:
        """The job's signing key, from the Secret the operator creates (waits for it)."""
        import base64

        secret = self.wait(lambda: self.core.read_namespaced_secret(f"sdcguard-alarm-key-{job}", namespace),
                           timeout=timeout, what=f"alarm key Secret of {namespace}/{job}")
        return base64.b64decode(secret.data["key"])

    def plant_key(self, namespace: str, job: str, key: bytes | None = None) -> bytes:
        """A key Secret the operator did not write (e.g. left from when the job was still enabled)."""
        import base64

        key = key or secrets.token_bytes(32)
        self.core.create_namespaced_secret(namespace, {
            "metadata": {"name": f"sdcguard-alarm-key-{job}", "namespace": namespace}, "type": "Opaque",
            "data": {"key": base64.b64encode(key).decode()}})
        return key

    def alarm_event(self, namespace: str, record: dict[str, Any] | None = None, *, raw: str | None = None,
                    involved_pod: str = "unknown", sign: bool = True, key: bytes | None = None,
                    signature: str | None = None) -> str:
        """Post an alarm Event the way the sidecar does (SPEC §4), signed with the named job's key
        (``key`` instead, ``signature`` as given, or unsigned with ``sign=False``); returns the
        Event's name. Text that names no job gets a well-formed signature no key makes."""
        from sdcguard.contract import alarm, events

        text = raw if raw is not None else alarm.dumps(record) if record is not None else None
        annotations = {} if text is None else {"sdcguard.dev/alarm": text}
        if text is not None and sign:
            if signature is None:
                try:
                    job = json.loads(text)["job"]
                except (ValueError, KeyError, TypeError):
                    job = None
                if key is None and isinstance(job, dict) and job.get("name"):
                    key = self.alarm_key(job.get("namespace") or namespace, job["name"])
                signature = events.alarm_signature(key, text) if key else "v1=" + "0" * 64
            annotations["sdcguard.dev/alarm-signature"] = signature
        if record is not None and (record.get("suspects") or [record.get("reporter")])[0]:
            involved_pod = ((record.get("suspects") or [record["reporter"]])[0].get("pod")) or involved_pod
        event = self.core.create_namespaced_event(namespace, {
            "metadata": {"generateName": "sdcguard-alarm-", "namespace": namespace, "annotations": annotations},
            "type": "Warning", "reason": "SilentDataCorruption", "message": "silent data corruption detected",
            "involvedObject": {"apiVersion": "v1", "kind": "Pod", "name": involved_pod, "namespace": namespace},
            "source": {"component": "sdcguard-agent"}})
        return event.metadata.name

    # -- reading state ----------------------------------------------------------------------------
    def incidents(self, namespace: str) -> list[dict[str, Any]]:
        return self.custom.list_namespaced_custom_object("sdcguard.dev", "v1", namespace, "sdcincidents")["items"]

    def incident(self, namespace: str, name: str) -> dict[str, Any]:
        return self.custom.get_namespaced_custom_object("sdcguard.dev", "v1", namespace, "sdcincidents", name)

    def replacement(self, name: str) -> dict[str, Any]:
        return self.custom.get_cluster_custom_object("sdcguard.dev", "v1", "nodereplacements", name)

    def node_state(self, name: str) -> tuple[bool, str | None]:
        node = self.core.read_node(name)
        return bool(node.spec.unschedulable), (node.metadata.labels or {}).get("sdcguard.dev/suspect")

    def job_suspended(self, namespace: str, name: str) -> bool:
        job = self.custom.get_namespaced_custom_object("kubeflow.org", "v1", namespace, "pytorchjobs", name)
        return bool(job["spec"].get("runPolicy", {}).get("suspend"))

    def event_annotation(self, namespace: str, name: str) -> str | None:
        return (self.core.read_namespaced_event(name, namespace).metadata.annotations or {}).get("sdcguard.dev/intake")

    def kubectl(self, *args: str, kubeconfig: pathlib.Path | None = None) -> subprocess.CompletedProcess[str]:
        """Real kubectl (and so ``kubectl sdcguard``) as ``tester``, or as the user of ``kubeconfig``."""
        env = self.env if kubeconfig is None else {**self.env, "KUBECONFIG": str(kubeconfig)}
        return subprocess.run([KUBECTL, *args], env=env, capture_output=True, text=True, timeout=60)

    def metrics(self) -> str:
        import urllib.request
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as response:
            return response.read().decode()

    def wait(self, predicate: Callable[[], Any], timeout: float = 45, what: str = "condition") -> Any:
        """Poll until ``predicate()`` is truthy (API errors count as "not yet"); fail with the operator log."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            try:
                last = predicate()
            except Exception as exc:  # noqa: BLE001 - e.g. 404 before the object exists
                last = exc
            else:
                if last:
                    return last
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what} (last: {last!r})\n--- operator log tail ---\n"
                             + self.log()[-6000:])


def make_alarm(namespace: str, job: str, *, check: str = "replay", step: int = 40,
               suspects: list[tuple[int, str, str]] = (), reporter: tuple[int, str, str] | None = None,
               checkpoint: str | None = "checkpoint-19.pt", alarm_id: str | None = None,
               window: tuple[int, int] | None = None, **recovery: Any) -> dict[str, Any]:
    """A v1 alarm record via the shared schema module; suspects/reporter are (rank, pod, node).

    ``window`` is the suspect window (default: the alarm step alone); ``recovery`` adds the optional
    fields of newer libraries (``last_good_checkpoint_step``, ``steps_at_risk``, ...)."""
    from sdcguard.contract import alarm

    identities = {rank: {"rank": rank, "pod": pod, "node": node} for rank, pod, node in suspects}
    reporter = reporter or (99, f"{job}-reporter", "hyperpod-i-00000000000000000")
    identities[reporter[0]] = {"rank": reporter[0], "pod": reporter[1], "node": reporter[2]}
    return alarm.make_alarm(
        alarm_id=alarm_id or secrets.token_hex(6), job={"kind": "PyTorchJob", "name": job, "namespace": namespace},
        check=check, step=step, suspect_ranks=[r for r, _, _ in suspects], identities=identities,
        ambiguous=False, reporter_rank=reporter[0], evidence={"pairs": [[0, 2]]}, last_verified_step=step - 1,
        last_good_checkpoint=checkpoint,
        suspect_window={"first_step": (window or (step, step))[0], "last_step": (window or (step, step))[1]},
        **recovery)


@pytest.fixture(scope="module")
def make_world(tmp_path_factory: pytest.TempPathFactory):
    """``make_world(**SDCGUARD_settings) -> OperatorWorld`` (operator started); all closed at module end."""
    worlds: list[OperatorWorld] = []

    def factory(start: bool = True, via_kopf: bool = False, admission: bool = False, **settings: str) -> OperatorWorld:
        world = OperatorWorld(tmp_path_factory.mktemp("world"), admission=admission, **settings)
        worlds.append(world)
        if start:
            world.start_operator(via_kopf=via_kopf)
        return world

    yield factory
    for world in reversed(worlds):  # kmock's resolver hooks nest: stop the emulators last-in, first-out
        world.close()


def dump(obj: Any) -> str:
    return json.dumps(obj, indent=1, default=str)
