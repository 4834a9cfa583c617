"""Chaos soak of the whole operator loop: signed alarms in, node replacements out, faults everywhere.

    python bench/chaos_soak.py --seconds 300 --jobs 4 --suspects 6 --seed 1    # the long variant
    (tests/test_chaos.py runs a short one, tens of seconds, in CI)

Real parts: the Kubernetes API emulator (sdcguard.sandbox.apiserver, with resourceVersion/409 and
server-side fault injection), the SageMaker emulator (sdcguard.sandbox.sagemaker, with random faults),
and two ``sdcguard operator`` processes with leader election.  While a stream of alarms arrives —
valid ones for several jobs and nodes, duplicates of them, and invalid ones (unsigned, wrongly
signed, naming a node the pod is not on, naming a job that is not enabled) — at random:

- an operator process is SIGKILLed (and started again, as the Deployment would);
- the API server answers the operator 500 / 409 / 429 or stalls for seconds;
- SageMaker throttles, fails with InternalServerError before or after the call took effect, or
  answers slower than the operator's read timeout;
- a person approves or denies each NodeReplacement after a while (or never), and releases the
  storm-guard slot of a failed one.

Then the faults stop and the operator must converge.  Invariants (each violation is listed):

1. every valid alarm has exactly one incident: the one of its fault, recording its Event;
2. at most ``maxConcurrentSuspectNodes`` nodes labelled suspect at any moment (replayed from every
   stored version of every node, ordered by resourceVersion);
3. exactly one effective StartClusterHealthCheck per NodeReplacement; at most one effective
   BatchReplaceClusterNodes per approved one, made after the approval; none for denied or
   undecided ones;
4. no invalid alarm touched anything: rejected, no incident, its nodes never labelled or cordoned,
   its job never suspended;
5. convergence: once faults stop (and every replacement still waiting is decided), every alarm is
   handled, every incident resolved and every replacement final within the timeout.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import random
import secrets
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from conftest import OPERATOR_USER, OperatorWorld, free_port, make_alarm, new_instance  # noqa: E402

MAX_SUSPECTS = 2
TERMINAL = ("Replaced", "Failed", "Denied")


@dataclass
class Fault:
    """One fault of one job: its alarms (the first and its duplicates) name one suspect node."""

    job: str
    step: int
    node: str
    instance: str
    pod: str
    events: list[str] = field(default_factory=list)


@dataclass
class Figures:
    alarms_valid: int = 0
    alarms_duplicate: int = 0
    alarms_invalid: int = 0
    kills: int = 0
    self_exits: int = 0
    api_faults: dict[str, int] = field(default_factory=dict)
    stale_writes_refused: int = 0
    aws_faults: int = 0
    aws_calls: int = 0
    approved: int = 0
    denied: int = 0
    undecided: int = 0
    released: int = 0
    replaced: int = 0
    failed: int = 0
    max_suspect_nodes: int = 0
    converge_seconds: float = 0.0
    final: dict[str, str] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["violations"] = len(self.violations)
        out["api_faults_total"] = sum(self.api_faults.values())
        return out


class Replicas:
    """Two operator processes; a killed or exited one is started again (as by the Deployment).
    Started and killed from the calling thread only (PR_SET_PDEATHSIG ties them to it)."""

    def __init__(self, world: OperatorWorld, rng: random.Random, env: dict[str, str]) -> None:
        self.world, self.rng, self.env = world, rng, env
        self.procs: dict[str, Any] = {}
        self.generation = 0
        self.kills = self.self_exits = 0
        for slot in ("a", "b"):
            self.start(slot)

    def start(self, slot: str) -> None:
        self.generation += 1
        self.procs[slot] = self.world.spawn_operator(f"{slot}{self.generation}", POD_NAME=f"op-{slot}",
                                                     SDCGUARD_WEBHOOK_PORT=str(free_port()),
                                                     SDCGUARD_METRICS_PORT=str(free_port()), **self.env)

    def kill_one(self) -> None:
        slot = self.rng.choice(sorted(self.procs))
        proc = self.procs[slot]
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
            self.kills += 1
        self.start(slot)

    def revive(self) -> None:
        for slot, proc in list(self.procs.items()):
            if proc.poll() is not None:  # exited by itself (e.g. lost its Lease in an API stall)
                self.self_exits += 1
                self.start(slot)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


class Soak:
    def __init__(self, workdir: pathlib.Path, *, seconds: float, jobs: int, suspects: int, seed: int,
                 api_fault_rate: float, aws_fault_rate: float, kill_every: tuple[float, float],
                 converge_timeout: float, min_aws_faults: int = 1, max_extra_seconds: float = 60.0,
                 health_seconds: float = 15.0) -> None:
        self.rng = random.Random(seed)
        self.seconds, self.converge_timeout = seconds, converge_timeout
        # The SageMaker calls come late in an incident (after the health check is due), so a short
        # run can end its fault phase before any call was faulted; it then runs on (bounded) until
        # ``min_aws_faults`` have struck, so every run exercises the AWS retry paths.
        self.min_aws_faults = min_aws_faults if aws_fault_rate > 0 else 0
        self.max_extra_seconds = max_extra_seconds
        # A deep health check outlasts an operator fail-over, as in production (InstanceStress and
        # DCGM level 4 run for many minutes, a new leader takes over in seconds). One that ends
        # sooner can be started twice: a replica that made the call dies before recording it, and
        # its successor finds the node Running again. The operator then starts another check
        # (never a second replacement); "exactly one StartClusterHealthCheck" assumes this.
        self.health_seconds = health_seconds
        self.api_fault_rate, self.aws_fault_rate, self.kill_every = api_fault_rate, aws_fault_rate, kill_every
        self.seed = seed
        self.world = OperatorWorld(
            workdir, SDCGUARD_MAX_CONCURRENT_SUSPECT_NODES=str(MAX_SUSPECTS), SDCGUARD_POLL_SECONDS="0.5",
            SDCGUARD_RETRY_SECONDS="0.3", SDCGUARD_RETRY_MAX_SECONDS="2", SDCGUARD_STORM_GUARD_RECHECK_SECONDS="1",
            SDCGUARD_AWS_READ_TIMEOUT="2", SDCGUARD_AWS_CONNECT_TIMEOUT="2", SDCGUARD_MAX_THROTTLE_RETRIES="30")
        self.figures = Figures()
        self.faults: list[Fault] = []
        self.pending: list[Fault] = []  # faults whose first alarm is still to be sent
        self.invalid_events: list[str] = []
        self.decisions: dict[str, tuple[str, float]] = {}  # NodeReplacement -> (decision, time)
        self.decide_at: dict[str, float] = {}
        self.evidence: dict[str, Any] = {}  # what a violation saw, written to <workdir>/evidence.json
        self.workdir = workdir
        self.build(jobs, suspects)

    # -- the cluster ------------------------------------------------------------------------
    def build(self, jobs: int, suspects: int) -> None:
        w = self.world
        self.ns = "soak"
        for j in range(jobs):
            job = f"train{j}"
            ids = [new_instance() for _ in range(suspects + 1)]
            nodes = [w.node(i) for i in ids]
            pods = w.training(self.ns, job, nodes)
            for rank in range(1, suspects + 1):
                self.faults.append(Fault(job, 100 * (j + 1) + rank, nodes[rank], ids[rank], pods[rank]))
            self.reporters = getattr(self, "reporters", {})
            self.reporters[job] = (0, pods[0], nodes[0])
        decoy_ids = [new_instance() for _ in range(2)]
        self.decoy_nodes = [w.node(i) for i in decoy_ids]
        self.decoy_pods = w.training(self.ns, "decoy", self.decoy_nodes, enabled=False)
        self.rng.shuffle(self.faults)
        self.pending = list(self.faults)

    def record(self, fault: Fault) -> dict[str, Any]:
        return make_alarm(self.ns, fault.job, step=fault.step, suspects=[(1, fault.pod, fault.node)],
                          reporter=self.reporters[fault.job])

    def send_valid(self) -> None:
        sent = [f for f in self.faults if f.events]
        if sent and (not self.pending or self.rng.random() < 0.3):
            fault = self.rng.choice(sent)  # a duplicate: another rank, or a resent Event
            self.figures.alarms_duplicate += 1
        elif self.pending:
            fault = self.pending.pop()
            self.figures.alarms_valid += 1
        else:
            return
        fault.events.append(self.world.alarm_event(self.ns, self.record(fault), key=self.keys[fault.job]))

    def send_invalid(self) -> None:
        w, kind = self.world, self.rng.choice(("unsigned", "bad-signature", "wrong-node", "not-enabled"))
        step = 9000 + self.figures.alarms_invalid
        if kind == "not-enabled":
            record = make_alarm(self.ns, "decoy", step=step, suspects=[(1, self.decoy_pods[1], self.decoy_nodes[1])],
                                reporter=(0, self.decoy_pods[0], self.decoy_nodes[0]))
            name = w.alarm_event(self.ns, record, key=secrets.token_bytes(32))
        else:
            fault = self.rng.choice(self.faults)
            node = self.decoy_nodes[self.rng.randrange(2)]  # the pod is not there: acting would touch a decoy
            record = make_alarm(self.ns, fault.job, step=step, suspects=[(1, fault.pod, node)],
                                reporter=self.reporters[fault.job])
            name = w.alarm_event(self.ns, record, sign=kind != "unsigned",
                                 key=secrets.token_bytes(32) if kind == "bad-signature" else self.keys[fault.job])
        self.invalid_events.append(name)
        self.figures.alarms_invalid += 1

    # -- people ---------------------------------------------------------------------------
    def people(self, final: bool = False) -> None:
        """Decide PendingApproval replacements after a random delay (approve 60 %, deny 30 %, leave
        undecided 10 % while the faults last); release failed ones."""
        w, now = self.world, time.time()
        for item in w.custom.list_cluster_custom_object("sdcguard.dev", "v1", "nodereplacements")["items"]:
            name, status, spec = item["metadata"]["name"], item.get("status") or {}, item.get("spec") or {}
            if status.get("phase") == "Failed" and not spec.get("release"):
                w.custom.patch_cluster_custom_object("sdcguard.dev", "v1", "nodereplacements", name,
                                                     {"spec": {"release": True, "releaseReason": "soak"}})
                self.figures.released += 1
            if status.get("phase") != "PendingApproval" or (name in self.decisions and not (
                    final and not self.decisions[name][0])):
                continue
            if name not in self.decide_at:
                self.decide_at[name] = now + (0.0 if final else self.rng.uniform(0.3, 4.0))
            if now < self.decide_at[name]:
                continue
            roll = self.rng.random()
            decision = "Approved" if roll < 0.6 else "Denied" if roll < 0.9 or final else None
            if decision is None:
                self.decisions[name] = ("", now)
                continue
            if name in self.decisions:  # left undecided through the faults; denied at the end
                self.figures.undecided += 1
            self.decisions[name] = (decision, time.time())
            w.custom.patch_cluster_custom_object("sdcguard.dev", "v1", "nodereplacements", name,
                                                 {"spec": {"decision": decision}})

    # -- the run ----------------------------------------------------------------------------
    def run(self) -> Figures:
        w, f = self.world, self.figures
        replicas = Replicas(w, self.rng, {"SDCGUARD_LEASE_SECONDS": "4", "SDCGUARD_RENEW_SECONDS": "3"})
        try:
            self.keys = {job: w.alarm_key(self.ns, job, timeout=90) for job in self.reporters}
            w.kube.inject(self.api_fault_rate, users={OPERATOR_USER}, seed=self.seed, stall=(0.5, 2.5))
            w.aws.chaos(self.aws_fault_rate, seed=self.seed, slow=3.0, health_seconds=self.health_seconds)
            started = time.monotonic()
            next_kill = started + self.rng.uniform(*self.kill_every)
            next_alarm = started + 1.0
            aws_faults, counted_at = 0, 0.0
            while True:
                now = time.monotonic()
                if now - started >= self.seconds:
                    if now - counted_at >= 1.0:
                        aws_faults, counted_at = _faulted(w.aws.calls()), now
                    if aws_faults >= self.min_aws_faults or now - started >= self.seconds + self.max_extra_seconds:
                        break
                if now >= next_alarm:
                    self.send_invalid() if self.rng.random() < 0.25 else self.send_valid()
                    next_alarm = now + self.rng.uniform(0.3, 1.5)
                if now >= next_kill:
                    replicas.kill_one()
                    next_kill = now + self.rng.uniform(*self.kill_every)
                replicas.revive()
                self.people()
                time.sleep(0.1)
            while self.pending:  # every fault gets at least its first alarm
                self.send_valid()
            w.kube.inject(0)
            w.aws.chaos(0)
            f.api_faults = dict(w.kube.emulator.faults.counts)
            quiet = time.monotonic()
            self.converge(replicas)
            f.converge_seconds = round(time.monotonic() - quiet, 1)
            f.kills, f.self_exits = replicas.kills, replicas.self_exits
        finally:
            replicas.close()
        self.check()
        return f

    def converge(self, replicas: Replicas) -> None:
        deadline = time.monotonic() + self.converge_timeout
        last = ""
        while time.monotonic() < deadline:
            replicas.revive()
            self.people(final=True)
            last = self.unsettled()
            if not last:
                return
            time.sleep(0.3)
        self.figures.violations.append(f"not converged {self.converge_timeout:g}s after the faults stopped: {last}")

    def unsettled(self) -> str:
        w = self.world
        for name in [e for f in self.faults for e in f.events] + self.invalid_events:
            if not w.event_annotation(self.ns, name):
                return f"alarm Event {name} not handled"
        for item in w.incidents(self.ns):
            status = item.get("status") or {}
            if status.get("phase") not in ("Resolved", "Contained"):
                return f"incident {item['metadata']['name']} in {status.get('phase')}"
        for item in w.custom.list_cluster_custom_object("sdcguard.dev", "v1", "nodereplacements")["items"]:
            phase = (item.get("status") or {}).get("phase")
            decided = self.decisions.get(item["metadata"]["name"], ("", 0))[0]
            if phase not in TERMINAL or (phase == "Failed" and not (item.get("status") or {}).get("released")):
                return f"NodeReplacement {item['metadata']['name']} in {phase} (decision {decided or 'none'})"
        return ""

    def labelled_now(self) -> list[str]:
        return [n.metadata.name for n in self.world.core.list_node().items
                if (n.metadata.labels or {}).get("sdcguard.dev/suspect") == "true"]

    # -- invariants --------------------------------------------------------------------------
    def check(self) -> None:
        w, f, v = self.world, self.figures, self.figures.violations
        from sdcguard_operator.incident import incident_name

        incidents = {i["metadata"]["name"]: i for i in w.incidents(self.ns)}
        expected = set()
        for fault in self.faults:
            name = incident_name(self.record(fault))
            expected.add(name)
            found = incidents.get(name)
            if found is None:
                v.append(f"fault {fault.job}/{fault.step}: no incident")
                continue
            recorded = {found["spec"]["event"]} | {d["event"] for d in (found.get("status") or {}).get("duplicates") or []}
            for event in fault.events:
                outcome = w.event_annotation(self.ns, event) or ""
                if outcome.split(":", 1)[-1] != name or event not in recorded:
                    v.append(f"alarm Event {event} of {name}: intake {outcome!r}, recorded {event in recorded}")
        for name in set(incidents) - expected:
            v.append(f"unexpected incident {name}")
        # 2. the storm guard, over every stored version of every node, in resourceVersion order
        store = w.kube.emulator._objects._objects
        versions = []
        for (resource, _, name), obj in list(store.items()):
            if resource.plural != "nodes":
                continue
            for version in obj.history:
                if version is not None:
                    meta = version.raw.get("metadata") or {}
                    versions.append((int(meta.get("resourceVersion") or 0), name,
                                     (meta.get("labels") or {}).get("sdcguard.dev/suspect") == "true",
                                     bool((version.raw.get("spec") or {}).get("unschedulable"))))
        labelled: set[str] = set()
        for _, name, is_suspect, cordoned in sorted(versions):
            (labelled.add if is_suspect else labelled.discard)(name)
            f.max_suspect_nodes = max(f.max_suspect_nodes, len(labelled))
            if name in self.decoy_nodes and (is_suspect or cordoned):
                v.append(f"decoy node {name} touched (an invalid alarm acted)")
        if f.max_suspect_nodes > MAX_SUSPECTS:
            v.append(f"{f.max_suspect_nodes} nodes labelled suspect at once (limit {MAX_SUSPECTS})")
        # 3. AWS calls per NodeReplacement
        calls = w.aws.calls()
        f.aws_calls = len(calls)
        f.aws_faults = _faulted(calls)
        for item in w.custom.list_cluster_custom_object("sdcguard.dev", "v1", "nodereplacements")["items"]:
            name, status = item["metadata"]["name"], item.get("status") or {}
            instance = item["spec"]["instanceId"]
            health = [c for c in calls if c["action"] == "StartClusterHealthCheck" and instance in c["ids"]
                      and c["effective"]]
            if len(health) != 1:
                v.append(f"{name}: {len(health)} effective StartClusterHealthCheck calls")
                self.evidence[name] = {"status": status, "calls": [c for c in calls if instance in c["ids"]]}
            replaced = [c for c in calls if c["action"] == "BatchReplaceClusterNodes" and instance in c["ids"]
                        and c["effective"]]
            decision, decided_at = self.decisions.get(name, ("", 0.0))
            f.approved += decision == "Approved"
            f.denied += decision == "Denied"
            f.replaced += status.get("phase") == "Replaced"
            f.failed += status.get("phase") == "Failed"
            if decision == "Approved":
                if len(replaced) > 1 or any(c["time"] < decided_at for c in replaced):
                    v.append(f"{name}: {len(replaced)} effective BatchReplaceClusterNodes (approved at {decided_at})")
                    self.evidence[name] = {"status": status, "calls": [c for c in calls if instance in c["ids"]]}
            elif replaced:
                v.append(f"{name}: BatchReplaceClusterNodes for a {decision or 'undecided'} replacement")
                self.evidence[name] = {"status": status, "calls": [c for c in calls if instance in c["ids"]]}
        # 4. invalid alarms
        for event in self.invalid_events:
            outcome = w.event_annotation(self.ns, event) or ""
            if not outcome.startswith("rejected:"):
                v.append(f"invalid alarm Event {event}: {outcome!r}")
        if w.job_suspended(self.ns, "decoy"):
            v.append("the decoy job was suspended")
        f.stale_writes_refused = w.kube.emulator.conflicts
        for name, item in incidents.items():
            status = item.get("status") or {}
            held = [c["message"] for c in status.get("conditions") or [] if c["type"] == "StormGuard"
                    and c["status"] == "True"]
            f.final[name] = f"{status.get('phase')} {status.get('replacements')}" + (f" held {held}" if held else "")
        for node in self.labelled_now():
            f.final[node] = "labelled suspect"
        if self.evidence:
            (self.workdir / "evidence.json").write_text(json.dumps(self.evidence, indent=1, default=str))

    def close(self) -> None:
        self.world.close()


def _faulted(calls: list[dict[str, Any]]) -> int:
    """How many of the SageMaker calls a fault struck (an error answer, or a fault after the effect)."""
    return sum(1 for c in calls if c.get("fault") or c["outcome"] not in ("ok", "failed"))


def soak(workdir: pathlib.Path, **options: Any) -> Figures:
    run = Soak(workdir, **options)
    try:
        return run.run()
    finally:
        run.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=300.0, help="how long faults are injected")
    p.add_argument("--jobs", type=int, default=4)
    p.add_argument("--suspects", type=int, default=6, help="suspect nodes (faults) per job")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--api-fault-rate", type=float, default=0.08)
    p.add_argument("--aws-fault-rate", type=float, default=0.25)
    p.add_argument("--kill-every", type=float, nargs=2, default=(3.0, 8.0), metavar=("MIN", "MAX"))
    p.add_argument("--converge-timeout", type=float, default=300.0,
                   help="seconds to converge once faults stop (health checks still take --health-seconds each)")
    p.add_argument("--health-seconds", type=float, default=15.0,
                   help="how long each emulated deep health check lasts at least (longer than a fail-over)")
    p.add_argument("--workdir", default=None)
    args = p.parse_args(argv)
    workdir = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="chaos-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    figures = soak(workdir, seconds=args.seconds, jobs=args.jobs, suspects=args.suspects, seed=args.seed,
                   api_fault_rate=args.api_fault_rate, aws_fault_rate=args.aws_fault_rate,
                   kill_every=tuple(args.kill_every), converge_timeout=args.converge_timeout,
                   health_seconds=args.health_seconds)
    print(json.dumps(figures.summary(), indent=1))
    for violation in figures.violations:
        print("VIOLATION:", violation, file=sys.stderr)
    print(f"operator logs: {workdir}", file=sys.stderr)
    return 1 if figures.violations else 0


if __name__ == "__main__":
    sys.exit(main())
