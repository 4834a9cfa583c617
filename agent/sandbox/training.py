"""An enabled training job in the sandbox, wired as the chart wires one in a real cluster.

:func:`start_training_job` builds, in a running :class:`~.cluster.Sandbox` whose operator is up:
HyperPod nodes, a PyTorchJob annotated ``sdcguard.dev/enabled`` and one worker pod per node
(created through the operator's pod webhook, so they carry the injected sidecar and its env), the
job's alarm key written as a file the way the kubelet mounts the Secret into the sidecar
container, and that sidecar — the real ``sdcguard sidecar`` — running against the sandbox's API
as the pod's service account. It writes ``placement.json``, which ``sdcguard drill --placement``
reads so that its ranks run as those pods on those nodes.

:class:`StandIns` plays the two parts of a real cluster that are neither sdcguard nor emulated
APIs: the training operator (a suspended job's pods are deleted; when it is resumed they are
created again on the job's nodes) and HyperPod's node lifecycle (a replaced instance's node leaves
the cluster and the fresh instance joins under its own name).

One sidecar stands for the pods' sidecars: on one machine every rank writes to one spool (in a
cluster each pod has its own ``emptyDir`` and its own sidecar; the records are the same).
"""
from __future__ import annotations

import json
import logging
import pathlib
import subprocess
import threading
from dataclasses import dataclass, field
from typing import Any

from ..child_process import die_with_parent
from ..contract import names
from .cluster import SDCGUARD, Sandbox, new_instance

log = logging.getLogger("sdcguard.sandbox")

APPROVERS_GROUP = "sdcguard-approvers"
"""The group the sandbox's approver belongs to; granted the ``approve`` verb, as the chart's
``sdcguard-approver`` ClusterRole would be bound to it."""


@dataclass
class TrainingJob:
    namespace: str
    job: str
    nodes: list[str]
    """Pod i runs on nodes[i] (updated when a node is replaced)."""
    instances: list[str]
    pods: list[str]
    spool: pathlib.Path
    placement: pathlib.Path
    approver_kubeconfig: pathlib.Path
    approver: str
    sidecar: subprocess.Popen[bytes] | None = None
    sidecar_log: pathlib.Path | None = None
    settings: dict[str, str] = field(default_factory=dict)
    """The pod env the webhook injected into the training container (``SDCGUARD_*``)."""
    replaced: list[tuple[str, str]] = field(default_factory=list)
    """(old node, new node) for every node HyperPod replaced."""

    def stop_sidecar(self, timeout: float = 30) -> None:
        """SIGTERM, as the kubelet stops a native sidecar: it publishes what is left, then exits."""
        if self.sidecar is not None and self.sidecar.poll() is None:
            self.sidecar.terminate()
            try:
                self.sidecar.wait(timeout)
            except subprocess.TimeoutExpired:
                self.sidecar.kill()
                self.sidecar.wait(10)
        self.sidecar = None


def start_training_job(sandbox: Sandbox, *, namespace: str = "demo", job: str = "llm-pretrain", nodes: int = 3,
                       annotations: dict[str, str] | None = None, approver: str = "oncall@example.com") -> TrainingJob:
    """The job, its nodes and pods, the mounted key and the running sidecar (see the module doc)."""
    # (no Namespace object: the emulator serves namespaced objects without one)
    instances = [new_instance() for _ in range(nodes)]
    node_names = [sandbox.node(i) for i in instances]
    sandbox.job(namespace, job, annotations=annotations)
    key = sandbox.alarm_key(namespace, job, timeout=60)  # the operator writes it for an enabled job
    pods = [f"{job}-worker-{i}" for i in range(nodes)]
    for pod, node in zip(pods, node_names):
        sandbox.pod(namespace, pod, job, node)
    workdir = sandbox.workdir
    key_file = workdir / "secrets" / f"{names.ALARM_KEY_SECRET_PREFIX}{job}" / names.ALARM_KEY_DATA_KEY
    key_file.parent.mkdir(parents=True, exist_ok=True)
    key_file.touch(mode=0o600)
    key_file.write_bytes(key)
    spool = workdir / "spool"
    spool.mkdir(exist_ok=True)
    sandbox.kube.grant(f"group:{APPROVERS_GROUP}", "approve", f"{names.REPLACEMENTS}.{names.GROUP}")
    approver_kubeconfig = sandbox.user(approver.split("@")[0], approver, [APPROVERS_GROUP])
    training = TrainingJob(namespace=namespace, job=job, nodes=node_names, instances=instances, pods=pods,
                           spool=spool, placement=workdir / "placement.json", approver_kubeconfig=approver_kubeconfig,
                           approver=approver, settings=_injected_env(sandbox, namespace, pods[0]))
    write_placement(sandbox, training)
    env = {**sandbox.env, "KUBECONFIG": str(sandbox.user("sidecar", f"system:serviceaccount:{namespace}:default")),
           names.ENV_POD_NAME: pods[0], names.ENV_POD_NAMESPACE: namespace, names.ENV_NODE_NAME: node_names[0]}
    training.sidecar_log = workdir / "sidecar.log"
    with open(training.sidecar_log, "wb") as out:
        training.sidecar = subprocess.Popen(
            [*SDCGUARD, "sidecar", "--spool", str(spool), "--key-file", str(key_file), "--metrics-host", "127.0.0.1",
             "--metrics-port", "0", "--poll-interval", "0.2", "--log-format", "plain"],
            env=env, stdout=out, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
    return training


def write_placement(sandbox: Sandbox, training: TrainingJob) -> None:
    """``placement.json`` for ``sdcguard drill --placement``: simulated node k runs as pod k on node k,
    with the uids the downward API would give it (the pod's, and its job's) for the drill to sign."""
    live = {p.metadata.name: p.metadata.uid for p in sandbox.core.list_namespaced_pod(
        training.namespace, label_selector=f"{names.JOB_NAME_LABEL}={training.job}").items}
    training.placement.write_text(json.dumps({
        "namespace": training.namespace, "job": training.job,
        "job_uid": sandbox.job_uid(training.namespace, training.job),
        "nodes": [{"pod": pod, "node": node, **({"pod_uid": live[pod]} if pod in live else {})}
                  for pod, node in zip(training.pods, training.nodes)]}, indent=1) + "\n")


def _pod(sandbox: Sandbox, namespace: str, pod: str) -> Any:
    return sandbox.core.read_namespaced_pod(pod, namespace)


def _injected_env(sandbox: Sandbox, namespace: str, pod: str) -> dict[str, str]:
    """``SDCGUARD_*`` values the pod webhook put into the training container (empty without it)."""
    containers = _pod(sandbox, namespace, pod).spec.containers or []
    env = (containers[0].env or []) if containers else []
    return {e.name: e.value for e in env if e.name.startswith("SDCGUARD_") and e.value is not None}


def injected_sidecar(sandbox: Sandbox, namespace: str, pod: str) -> bool:
    """Whether the pod webhook added the sidecar container (as a native sidecar init container)."""
    spec = _pod(sandbox, namespace, pod).spec
    return any(c.name == names.SIDECAR_CONTAINER for c in (spec.init_containers or []) + spec.containers)


def key_mounted_in(sandbox: Sandbox, namespace: str, pod: str) -> list[str]:
    """The containers of the pod that mount the job's alarm key volume."""
    spec = _pod(sandbox, namespace, pod).spec
    return [c.name for c in (spec.init_containers or []) + spec.containers
            if any(m.name == names.ALARM_KEY_VOLUME for m in c.volume_mounts or [])]


class StandIns:
    """The training operator's and HyperPod's parts (module doc), polled from a daemon thread."""

    def __init__(self, sandbox: Sandbox, training: TrainingJob, interval: float = 0.3) -> None:
        self.sandbox, self.training, self.interval = sandbox, training, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sandbox-stand-ins", daemon=True)

    def start(self) -> "StandIns":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.replace_nodes()
                self.follow_suspension()
            except Exception:  # noqa: BLE001 — a stand-in must not die of one failed request
                log.exception("sandbox stand-ins: retrying")

    def replace_nodes(self) -> None:
        """HyperPod: an instance gone from the SageMaker cluster takes its node with it; the fresh
        instance that took its place joins as ``hyperpod-<id>`` (the pod follows when the job runs)."""
        sandbox, training = self.sandbox, self.training
        statuses = sandbox.aws.node_statuses(sandbox.cluster)
        fresh = [i for i in statuses if i not in training.instances]
        for index, instance in enumerate(list(training.instances)):
            if instance in statuses or not fresh:
                continue
            old, new_id = training.nodes[index], fresh.pop(0)
            sandbox.core.delete_node(old)
            new = sandbox.node(new_id, register=False)  # SageMaker already has it
            training.instances[index], training.nodes[index] = new_id, new
            training.replaced.append((old, new))
            write_placement(sandbox, training)

    def follow_suspension(self) -> None:
        """The training operator: a suspended job has no pods; a running one has one per node."""
        sandbox, training = self.sandbox, self.training
        suspended = sandbox.job_suspended(training.namespace, training.job)
        existing = {p.metadata.name for p in sandbox.core.list_namespaced_pod(
            training.namespace, label_selector=f"{names.JOB_NAME_LABEL}={training.job}").items}
        recreated = False
        for pod, node in zip(training.pods, training.nodes):
            if suspended and pod in existing:
                sandbox.core.delete_namespaced_pod(pod, training.namespace)
            elif not suspended and pod not in existing:
                sandbox.pod(training.namespace, pod, training.job, node)
                recreated = True
        if recreated:  # new pods, new uids
            write_placement(sandbox, training)
