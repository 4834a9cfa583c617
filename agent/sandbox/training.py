"""An enabled training job in the sandbox, wired as the chart wires one in a real cluster.

:func:`start_training_job` builds, in a running :class:`~.cluster.Sandbox` whose operator is up:
HyperPod nodes, a PyTorchJob annotated ``sdcguard.dev/enabled`` and one worker pod per node
(created through the operator's pod webhook, so they carry the injected sidecar and its env), the
job's alarm key mounted as a file the way the kubelet mounts the Secret into the sidecar
container, and that sidecar — the real ``sdcguard sidecar`` — running against the sandbox's API
as the pod's service account. It writes ``placement.json``, which ``sdcguard drill --placement``
reads so that its ranks run as those pods on those nodes.

One sidecar stands for the pods' sidecars: on one machine every rank writes to one spool (in a
cluster each pod has its own ``emptyDir`` and its own sidecar; the records are the same).
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
from dataclasses import dataclass, field
from typing import Any

from ..contract import names
from .cluster import BINDIR, Sandbox, die_with_parent, new_instance

APPROVERS_GROUP = "sdcguard-approvers"
"""The group the sandbox's approver belongs to; granted the ``approve`` verb, as the chart's
``sdcguard-approver`` ClusterRole would be bound to it."""


@dataclass
class TrainingJob:
    namespace: str
    job: str
    nodes: list[str]
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
    placement = workdir / "placement.json"
    sandbox.kube.grant(f"group:{APPROVERS_GROUP}", "approve", f"{names.REPLACEMENTS}.{names.GROUP}")
    token = approver.split("@")[0]
    approver_kubeconfig = sandbox.user(token, approver, [APPROVERS_GROUP])
    training = TrainingJob(namespace=namespace, job=job, nodes=node_names, instances=instances, pods=pods,
                           spool=spool, placement=placement, approver_kubeconfig=approver_kubeconfig,
                           approver=approver, settings=_injected_env(sandbox, namespace, pods[0]))
    write_placement(training)
    sidecar_user = f"system:serviceaccount:{namespace}:default"
    env = {**os.environ, "KUBECONFIG": str(sandbox.user("sidecar", sidecar_user)),
           names.ENV_POD_NAME: pods[0], names.ENV_POD_NAMESPACE: namespace, names.ENV_NODE_NAME: node_names[0]}
    training.sidecar_log = workdir / "sidecar.log"
    training.sidecar = subprocess.Popen(
        [str(BINDIR / "sdcguard"), "sidecar", "--spool", str(spool), "--key-file", str(key_file),
         "--metrics-host", "127.0.0.1", "--metrics-port", "0", "--poll-interval", "0.2", "--log-format", "plain"],
        env=env, stdout=open(training.sidecar_log, "wb"), stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
    return training


def _injected_env(sandbox: Sandbox, namespace: str, pod: str) -> dict[str, str]:
    """``SDCGUARD_*`` values the pod webhook put into the training container (empty without it)."""
    body: Any = sandbox.core.read_namespaced_pod(pod, namespace)
    containers = body.spec.containers or []
    env = containers[0].env or [] if containers else []
    return {e.name: e.value for e in env if e.name.startswith("SDCGUARD_") and e.value is not None}


def injected_sidecar(sandbox: Sandbox, namespace: str, pod: str) -> bool:
    """Whether the pod webhook added the sidecar container (as a native sidecar init container)."""
    body: Any = sandbox.core.read_namespaced_pod(pod, namespace)
    return any(c.name == names.SIDECAR_CONTAINER for c in (body.spec.init_containers or []) + body.spec.containers)


def sync_replaced_nodes(sandbox: Sandbox, training: TrainingJob) -> list[tuple[str, str]]:
    """What HyperPod and the training operator do after a replacement: the old instance's node
    leaves the cluster, the fresh instance joins as ``hyperpod-<id>`` with the same labels, and the
    pod that ran on the old node is created again on the new one (``placement.json`` follows).
    Returns (old node, new node) pairs."""
    statuses = sandbox.aws.node_statuses(sandbox.cluster)
    fresh = [i for i in statuses if i not in training.instances]
    moved = []
    for index, instance in enumerate(list(training.instances)):
        if instance in statuses or not fresh:
            continue
        new_instance_id = fresh.pop(0)
        old = training.nodes[index]
        sandbox.core.delete_node(old)
        new = sandbox.node(new_instance_id, register=False)  # SageMaker already has it
        pod = training.pods[index]
        sandbox.core.delete_namespaced_pod(pod, training.namespace)
        sandbox.pod(training.namespace, pod, training.job, new)
        training.instances[index], training.nodes[index] = new_instance_id, new
        moved.append((old, new))
    write_placement(training)
    return moved


def write_placement(training: TrainingJob) -> None:
    """``placement.json`` for ``sdcguard drill --placement``: simulated node k runs as pod k on node k."""
    training.placement.write_text(json.dumps({"namespace": training.namespace, "job": training.job, "nodes": [
        {"pod": pod, "node": node} for pod, node in zip(training.pods, training.nodes)]}, indent=1) + "\n")
