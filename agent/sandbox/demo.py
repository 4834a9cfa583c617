"""``sdcguard demo`` (``make demo``): the whole loop once, on this machine, in the sandbox.

1. A stand-in HyperPod cluster (:mod:`.cluster`): three ``hyperpod-i-…`` nodes, an enabled
   PyTorchJob with a worker pod on each (the sidecar injected by the operator's pod webhook), the
   real operator, the real sidecar (:mod:`.training`).
2. A real 6-rank DDP run on CPU (``sdcguard drill``), its ranks running as those pods on those
   nodes. A GPU of the second node starts adding wrong values to its gradients at step
   ``FAULT_STEP`` and keeps doing so; nothing crashes, every replica agrees. The ring replay of
   the next audit step names it; the alarm reaches back to the last passing audit.
3. The sidecar publishes the signed alarm; the operator verifies it, opens the SDCIncident,
   suspends the job, cordons the node, runs the deep health check (the sandbox's SageMaker fails
   it on that instance, as a real failing GPU would fail it) and opens a NodeReplacement that
   waits for a person.
4. The demo shows ``kubectl get sdcincidents,nodereplacements``, approves with
   ``kubectl sdcguard approve`` as an on-call engineer (the admission webhook records who), waits
   for ``Replaced`` (the sandbox stands in for HyperPod: the fresh instance joins as a node).
5. The on-call engineer resumes the job (``kubectl patch``; the sandbox stands in for the
   training operator: the pods come back, one on the new node), and the demo prints the timeline,
   ending with the checkpoint to resume from, checked with ``sdcguard verify-checkpoint``.

It stops everything it started (``--keep`` leaves the sandbox up until Ctrl-C instead); exit 0
when the loop closed, 1 when a step did not happen (what was waited for is printed), 2 bad input.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from ..contract import names
from ..child_process import die_with_parent, stop_on_sigterm
from ..contract.alarm import rfc3339_seconds
from ..contract.phases import IncidentPhase, ReplacementPhase
from .cluster import BINDIR, KUBECTL, SDCGUARD, Sandbox, SandboxError, workdir_problem
from .training import StandIns, TrainingJob, injected_sidecar, key_mounted_in, start_training_job

NODES, RANKS_PER_NODE, STEPS = 3, 2, 12
AUDIT_EVERY, WEIGHT_CHECK_EVERY, CHECKPOINT_EVERY = 4, 2, 2
FAULT_RANK, FAULT_STEP = 3, 6
FAULT = f"grad-bitflip:rank={FAULT_RANK}:step={FAULT_STEP}:every=1"
"""From step 6 on, rank 3 (node 1, local GPU 1) flips a bit of its local gradient every step:
finite, plausible, averaged into every replica by the all-reduce."""
HEALTH_MESSAGE = "InstanceStress: GPU 1 failed the matrix-multiply stress test (mismatched results)"


class Demo:
    def __init__(self, workdir: pathlib.Path, report: pathlib.Path | None) -> None:
        self.workdir, self.report_path = workdir, report
        self.started = time.time()
        self.suspect = ""
        self.fault_seen: float | None = None
        self.resumed_at: float | None = None
        self.drill: dict[str, Any] = {}

    # -- output ---------------------------------------------------------------------------------
    def say(self, text: str = "") -> None:
        print(text, flush=True)

    def section(self, title: str) -> None:
        self.say(f"\n== {title} " + "=" * max(0, 74 - len(title)))

    def elapsed(self, when: float | None = None) -> str:
        return f"+{(when if when is not None else time.time()) - self.started:5.1f}s"

    def show(self, sandbox: Sandbox, *args: str, kubeconfig: pathlib.Path | None = None) -> str:
        """Run kubectl as a user would, print the command and its output."""
        who = "" if kubeconfig is None else f"KUBECONFIG={kubeconfig.name} "
        self.say(f"$ {who}kubectl {shlex.join(args)}")
        done = sandbox.kubectl(*args, kubeconfig=kubeconfig)
        output = (done.stdout + done.stderr).rstrip()
        self.say("\n".join("  " + line for line in output.splitlines()))
        if done.returncode != 0:
            raise SandboxError(f"kubectl {' '.join(args)} exited {done.returncode}: {output}")
        return done.stdout

    # -- the loop -------------------------------------------------------------------------------
    def run(self, keep: bool) -> int:
        self.section("1. a stand-in HyperPod cluster on 127.0.0.1 (sdcguard sandbox)")
        self.say(f"work directory (kubeconfigs, logs, spool, checkpoints): {self.workdir}")
        with Sandbox(self.workdir, admission=True, pod_webhook=True) as sandbox:
            sandbox.start_operator()
            training = start_training_job(sandbox, nodes=NODES, annotations={
                names.AUDIT_EVERY_ANNOTATION: str(AUDIT_EVERY),
                names.WEIGHT_CHECK_EVERY_ANNOTATION: str(WEIGHT_CHECK_EVERY)})
            stand_ins = StandIns(sandbox, training).start()
            try:
                self.cluster(sandbox, training)
                self.train(sandbox, training)
                pending = self.contain(sandbox, training)
                self.approve(sandbox, training, pending)
                self.resume(sandbox, training)
                self.timeline(sandbox, training)
                if keep:
                    from .serve import instructions, wait_for_interrupt
                    self.say(instructions(sandbox, training))
                    wait_for_interrupt()
            finally:
                stand_ins.stop()
                training.stop_sidecar()
        self.say(f"\n[demo] everything it started has stopped; logs and kubeconfigs in {self.workdir}")
        return 0

    def cluster(self, sandbox: Sandbox, training: TrainingJob) -> None:
        self.say(f"Kubernetes API {sandbox.kube.url}, SageMaker {sandbox.aws.url} (both emulated: a sandbox)")
        self.show(sandbox, "get", "nodes", "-L", names.HYPERPOD_GROUP_LABEL)
        self.show(sandbox, "get", "pods", "-n", training.namespace, "-o", "wide")
        injected = all(injected_sidecar(sandbox, training.namespace, pod) for pod in training.pods)
        settings = ", ".join(f"{k}={v}" for k, v in sorted(training.settings.items()))
        self.say(f"pod webhook: sidecar {'injected into every pod' if injected else 'NOT injected'}; "
                 f"training container env {settings or '(none)'}")
        mounts = {tuple(key_mounted_in(sandbox, training.namespace, pod)) for pod in training.pods}
        self.say(f"alarm key Secret {names.ALARM_KEY_SECRET_PREFIX}{training.job} created by the operator; "
                 f"mounted in: {', '.join(sorted({c for m in mounts for c in m})) or 'no container'}")
        if not injected or mounts != {(names.SIDECAR_CONTAINER,)}:
            raise SandboxError("the operator's pod webhook did not inject the sidecar with the key mounted in it only")
        # The stand-in for a failing GPU: HyperPod's stress test fails on the instance the fault is on.
        sandbox.aws.script(training.instances[FAULT_RANK // RANKS_PER_NODE], health="fail",
                           health_message=HEALTH_MESSAGE, health_polls=2)

    def train(self, sandbox: Sandbox, training: TrainingJob) -> None:
        self.section(f"2. training: {NODES} nodes x {RANKS_PER_NODE} ranks (DDP over gloo), fault {FAULT}")
        self.suspect = training.nodes[FAULT_RANK // RANKS_PER_NODE]
        self.say(f"rank {FAULT_RANK} runs on {self.suspect}: from step {FAULT_STEP} its gradients are silently wrong")
        report = self.report_path or self.workdir / "drill-report.json"
        command = [*SDCGUARD, "drill", "--nodes", str(NODES), "--ranks-per-node", str(RANKS_PER_NODE),
                   "--steps", str(STEPS), "--audit-every", str(AUDIT_EVERY),
                   "--weight-check-every", str(WEIGHT_CHECK_EVERY), "--checkpoint-every", str(CHECKPOINT_EVERY),
                   "--inject", FAULT, "--placement", str(training.placement), "--spool", str(training.spool),
                   "--checkpoint-dir", str(self.workdir / "checkpoints"), "--report", str(report)]
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                preexec_fn=die_with_parent, env=sandbox.env)
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                self.say(f"  {self.elapsed()} | {line.rstrip()}")
                if self.fault_seen is None and f"step {FAULT_STEP:4d}" in line:
                    self.fault_seen = time.time()
            code = proc.wait()
        finally:
            if proc.poll() is None:  # interrupted: the drill stops its ranks and removes its files
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()  # its ranks die with it (die_with_parent)
                    proc.wait(10)
        if code != 0:
            raise SandboxError(f"the drill exited {code} (see above)")
        self.drill = json.loads(report.read_text())

    def contain(self, sandbox: Sandbox, training: TrainingJob) -> dict[str, Any]:
        self.section("3. the operator: verify, record, suspend, cordon, health check, ask a person")
        ns = training.namespace
        incident = sandbox.wait(lambda: _one(sandbox.incidents(ns)), timeout=60, what="the SDCIncident")
        name = incident["metadata"]["name"]
        pending = ReplacementPhase.PENDING_APPROVAL
        replacement = sandbox.wait(lambda: _one([r for r in sandbox.replacements()
                                                 if (r.get("status") or {}).get("phase") == pending]),
                                   timeout=60, what="a NodeReplacement in PendingApproval")
        sandbox.wait(lambda: (sandbox.incident(ns, name).get("status") or {}).get("phase")
                     == IncidentPhase.AWAITING_APPROVAL,
                     timeout=30, what="the incident to await approval")
        self.show(sandbox, "get", "sdcincidents,nodereplacements", "-n", ns)
        suspect = replacement["spec"]["nodeName"]
        cordoned, label = sandbox.node_state(suspect)
        self.say(f"job {ns}/{training.job} suspended: {sandbox.job_suspended(ns, training.job)}; "
                 f"node {suspect} cordoned: {cordoned}, label {names.SUSPECT_LABEL}={label}")
        sandbox.wait(lambda: not sandbox.core.list_namespaced_pod(ns).items, timeout=30,
                     what="the suspended job's pods to be deleted", require_operator=True)
        self.say("(the sandbox, standing in for the training operator, deleted the suspended job's pods)")
        self.show(sandbox, "get", "pods", "-n", ns)
        return replacement

    def approve(self, sandbox: Sandbox, training: TrainingJob, replacement: dict[str, Any]) -> None:
        self.section(f"4. a person decides: {training.approver} approves the replacement")
        name = replacement["metadata"]["name"]
        self.show(sandbox, "sdcguard", "approve", name, "--reason", "stress test failed on GPU 1; replace it",
                  kubeconfig=training.approver_kubeconfig)
        sandbox.wait(lambda: (sandbox.replacement(name).get("status") or {}).get("phase") == ReplacementPhase.REPLACED,
                     timeout=60, what=f"NodeReplacement {name} to be Replaced", require_operator=True)
        ns = training.namespace
        sandbox.wait(lambda: all((i.get("status") or {}).get("phase") == IncidentPhase.RESOLVED
                                for i in sandbox.incidents(ns)),
                     timeout=30, what="the incident to be Resolved", require_operator=True)
        sandbox.wait(lambda: training.replaced, timeout=30, what="the fresh instance's node")
        for old, new in training.replaced:
            self.say(f"(the sandbox, standing in for HyperPod: {old} left the cluster, the fresh instance "
                     f"joined as {new})")
        self.show(sandbox, "get", "sdcincidents,nodereplacements", "-n", ns)
        self.show(sandbox, "sdcguard", "incidents", kubeconfig=training.approver_kubeconfig)

    def resume(self, sandbox: Sandbox, training: TrainingJob) -> None:
        """Resuming is the person's step (the operator never restarts a job): unsuspend it, with the
        training script pointed at the incident's resumeFrom."""
        self.section(f"5. {training.approver} resumes the job")
        ns = training.namespace
        self.show(sandbox, "patch", "pytorchjob", training.job, "-n", ns, "--type", "merge",
                  "-p", '{"spec": {"runPolicy": {"suspend": false}}}', kubeconfig=training.approver_kubeconfig)
        self.resumed_at = time.time()
        placed = dict(zip(training.pods, training.nodes))
        sandbox.wait(lambda: {p.metadata.name: p.spec.node_name for p in sandbox.core.list_namespaced_pod(ns).items}
                     == placed, timeout=30, what="the job's pods on its nodes again")
        self.show(sandbox, "get", "pods", "-n", ns)

    def timeline(self, sandbox: Sandbox, training: TrainingJob) -> None:
        """Fault → alarm → published → incident → cordon → health check → approval → replaced →
        where to resume, in causal order. API timestamps have whole seconds (rounded down), so a
        row never shows earlier than the row before it."""
        self.section("the timeline")
        incident = _one(sandbox.incidents(training.namespace)) or {}
        replacement = _one(sandbox.replacements()) or {}
        alarm = self.drill["alarms"][0]
        status, spec = incident.get("status") or {}, replacement.get("spec") or {}
        events = {e["event"]: e for e in status.get("timeline") or []}
        events.update({f"nr:{e['event']}": e for e in (replacement.get("status") or {}).get("timeline") or []})
        published = sorted(training.spool.joinpath("published").glob(f"{alarm['id']}*"))
        struck = sorted(f["step"] for f in self.drill.get("fired", []) if FAULT_RANK in f["ranks"])
        rows: list[tuple[float | None, str]] = [
            (self.fault_seen, f"fault injected on rank {FAULT_RANK} ({self.suspect}) at steps "
                              f"{', '.join(map(str, struck)) or 'none'}"),
            (rfc3339_seconds(alarm["time"]), f"alarm '{alarm['check']}' at step {alarm['step']}: rank "
                                    f"{', '.join(str(r) for r in alarm['suspect_ranks'])} named; suspect window "
                                    f"{alarm['suspect_window']['first_step']}..{alarm['suspect_window']['last_step']}"),
            # st_ctime: when the sidecar moved the record to published/, after the Event existed
            (published[0].stat().st_ctime if published else None, "the sidecar published the signed alarm Event"),
        ]
        for key, text in (("Opened", "operator verified the signature; SDCIncident opened"),
                          ("JobSuspended", f"job {training.namespace}/{training.job} suspended"),
                          ("NodeCordoned", f"{self.suspect} cordoned and labelled suspect"),
                          ("nr:HealthCheckRequested", "deep health check started (StartClusterHealthCheck)"),
                          ("nr:HealthCheckFailed", "deep health check failed: NodeReplacement pending approval"),
                          ("nr:Approved", f"approved by {spec.get('decidedBy')} (recorded by the admission webhook)"),
                          ("nr:ReplaceRequested", "BatchReplaceClusterNodes accepted"),
                          ("nr:Replaced", "instance replaced by fresh hardware"),
                          ("Resolved", "incident resolved")):
            if key in events:
                rows.append((rfc3339_seconds(events[key]["time"]), text))
        rows.append((self.resumed_at, f"{training.approver} resumes the job (from the checkpoint below)"))
        shown = 0.0
        for when, text in rows:
            shown = max(shown, when - self.started) if when is not None else shown
            self.say(f"  +{shown:5.1f}s  {text}")
        window = alarm.get("suspect_window") or {}
        resume = str(status.get("resumeFrom"))
        self.say(f"\nresume from {resume} (step {status.get('resumeFromStep')}): the newest checkpoint before "
                 f"the suspect window {window.get('first_step')}..{window.get('last_step')}; "
                 f"{status.get('stepsAtRisk')} steps at risk")
        self.verify(sandbox, resume)
        self.say(f"[demo] the loop closed in {time.time() - self.started:.0f}s")

    def verify(self, sandbox: Sandbox, checkpoint: str) -> None:
        """``sdcguard verify-checkpoint`` on the resume point, as the person resuming would."""
        self.say(f"$ sdcguard verify-checkpoint {checkpoint}")
        done = subprocess.run([*SDCGUARD, "verify-checkpoint", checkpoint], capture_output=True,
                              text=True, env=sandbox.env, timeout=120)
        self.say("\n".join("  " + line for line in (done.stdout + done.stderr).rstrip().splitlines()))
        if done.returncode != 0:
            raise SandboxError(f"the resume checkpoint did not verify (exit {done.returncode})")


def _one(items: list[dict[str, Any]]) -> dict[str, Any] | None:
    return items[0] if len(items) == 1 else None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sdcguard demo", description=__doc__.splitlines()[0])
    p.add_argument("--workdir", type=pathlib.Path, default=None,
                   help="where the sandbox keeps kubeconfigs, logs and the spool (default: a new temporary directory)")
    p.add_argument("--report", type=pathlib.Path, default=None, help="also write the drill's JSON report here")
    p.add_argument("--keep", action="store_true", help="leave the sandbox running after the demo, until Ctrl-C")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if shutil.which(KUBECTL) is None:
        print(f"sdcguard demo: error: kubectl not found in {BINDIR} or on PATH (make tools installs it)",
              file=sys.stderr)
        return 2
    problem = workdir_problem(args.workdir)
    if problem:
        print(f"sdcguard demo: error: {problem}", file=sys.stderr)
        return 2
    workdir = args.workdir or pathlib.Path(tempfile.mkdtemp(prefix="sdcguard-demo-"))
    stop_on_sigterm()  # like Ctrl-C: everything started is stopped on the way out
    try:
        return Demo(workdir, args.report).run(args.keep)
    except SandboxError as exc:
        print(f"\n[demo] FAILED: {exc}\n[demo] logs in {workdir}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\n[demo] interrupted; everything it started has stopped; logs in {workdir}", file=sys.stderr)
        return 130
