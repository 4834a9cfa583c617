"""``sdcguard sandbox``: serve a stand-in HyperPod cluster on 127.0.0.1 until Ctrl-C.

The same cluster ``sdcguard demo`` builds (:mod:`.training`): HyperPod nodes, an enabled
PyTorchJob with its pods, the real operator and the sidecar. It prints how to point ``kubectl``
at it and how to raise an alarm into it with ``sdcguard drill --placement``; then nothing happens
until you do. A SANDBOX, never a production path: emulated API server and SageMaker, no TLS, no
RBAC on ordinary requests, state in memory. Ctrl-C (or SIGTERM) stops everything it started.
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import time

from ..child_process import stop_on_sigterm
from .cluster import BINDIR, Sandbox, SandboxError, workdir_problem
from .training import StandIns, TrainingJob, start_training_job


def instructions(sandbox: Sandbox, training: TrainingJob) -> str:
    d = sandbox.workdir
    return f"""
The sandbox is up (Ctrl-C stops it). Kubernetes API {sandbox.kube.url}, SageMaker {sandbox.aws.url}.
Point kubectl at it, as the on-call approver ({training.approver}):

  export PATH={BINDIR}:$PATH KUBECONFIG={training.approver_kubeconfig}
  kubectl get nodes; kubectl get pods -n {training.namespace} -o wide
  kubectl get sdcincidents,nodereplacements -n {training.namespace}

Raise an alarm from a real DDP run whose ranks are its pods (the sidecar publishes it):

  sdcguard drill --nodes {len(training.nodes)} --ranks-per-node 2 --audit-every 4 --checkpoint-every 2 \\
      --inject grad-bitflip:rank={_rank(len(training.nodes))}:step=6:every=1 --placement {training.placement} \\
      --spool {training.spool} --checkpoint-dir {d}/checkpoints

then decide:  kubectl sdcguard approve NAME   (or deny NAME)
Logs: {d}/operator-*.log, {d}/sidecar.log
"""


def _rank(nodes: int) -> int:
    """A rank on the second node (the first one's if there is one node) of 2 ranks per node."""
    return 3 if nodes >= 2 else 1


def wait_for_interrupt() -> None:
    """Block until Ctrl-C (or SIGTERM, once ``stop_on_sigterm`` is in place)."""
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="sdcguard sandbox", description=__doc__.splitlines()[0])
    p.add_argument("--workdir", type=pathlib.Path, default=None,
                   help="kubeconfigs, logs and the spool (default: a new temporary directory)")
    p.add_argument("--nodes", type=int, default=3, help="HyperPod nodes, one worker pod each (default 3)")
    args = p.parse_args(argv)
    if args.nodes < 1:
        print("sdcguard sandbox: error: --nodes must be >= 1", file=sys.stderr)
        return 2
    problem = workdir_problem(args.workdir)
    if problem:
        print(f"sdcguard sandbox: error: {problem}", file=sys.stderr)
        return 2
    workdir = args.workdir or pathlib.Path(tempfile.mkdtemp(prefix="sdcguard-sandbox-"))
    print(f"sdcguard sandbox: starting in {workdir}", flush=True)
    stop_on_sigterm()
    try:
        with Sandbox(workdir, admission=True, pod_webhook=True) as sandbox:
            sandbox.start_operator()
            training = start_training_job(sandbox, nodes=args.nodes)
            stand_ins = StandIns(sandbox, training).start()
            try:
                print(instructions(sandbox, training), flush=True)
                wait_for_interrupt()
            finally:
                stand_ins.stop()
                training.stop_sidecar()
    except SandboxError as exc:
        print(f"sdcguard sandbox: error: {exc}\nlogs in {workdir}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    print("sdcguard sandbox: stopped", flush=True)
    return 0
