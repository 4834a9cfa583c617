"""Two operator replicas with leader election: the leader is SIGKILLed at random moments of one
incident's whole flow (alarm → cordon → health check → approval → replacement) and started again
as a new follower; every AWS action still happens exactly once, counted by the SageMaker emulator,
and only the Lease holder acts.  Both replicas serve the webhooks all along.
"""
from __future__ import annotations

import json
import random
import time
import urllib.request

import pytest
from conftest import dump, free_port, make_alarm, new_instance

pytestmark = [pytest.mark.emulator, pytest.mark.operator]

LEASE = dict(SDCGUARD_LEASE_SECONDS="3", SDCGUARD_RENEW_SECONDS="2")


class Replicas:
    """Two ``sdcguard operator`` processes, each with its own ports, restarted when killed."""

    def __init__(self, world, seed: int) -> None:
        self.world = world
        self.rng = random.Random(seed)
        self.procs: dict[str, object] = {}
        self.ports: dict[str, int] = {}
        self.kills: list[str] = []
        self.killed: set[str] = set()
        self.generation = 0
        for slot in ("a", "b"):
            self.start(slot)

    def start(self, slot: str) -> None:
        self.generation += 1
        self.ports[slot] = free_port()
        self.procs[slot] = self.world.spawn_operator(
            f"{slot}{self.generation}", POD_NAME=f"op-{slot}", SDCGUARD_WEBHOOK_PORT=str(self.ports[slot]),
            SDCGUARD_METRICS_PORT=str(free_port()), **LEASE)

    def holder(self) -> str | None:
        import kubernetes
        try:
            lease = kubernetes.client.CoordinationV1Api(self.world.api).read_namespaced_lease(
                "sdcguard-operator", "default")
        except Exception:  # noqa: BLE001 — no Lease yet
            return None
        return lease.spec.holder_identity or None

    def kill_leader(self, why: str) -> bool:
        holder = self.holder()
        if holder in self.killed:
            return False  # its Lease has not expired yet: nobody leads at the moment
        for slot, proc in self.procs.items():
            if holder and holder.startswith(f"op-{slot}-") and proc.poll() is None:
                proc.kill()
                proc.wait(10)
                self.kills.append(f"{why} ({holder})")
                self.killed.add(holder)
                self.start(slot)
                return True
        return False

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def _admission_review_answered(port: int) -> bool:
    review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": "u1", "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "resource": {"group": "", "version": "v1", "resource": "pods"}, "operation": "CREATE",
        "userInfo": {"username": "tester"}, "namespace": "default",
        "object": {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "default",
                                                                    "labels": {"training.kubeflow.org/job-name": "x"}},
                   "spec": {"containers": [{"name": "c", "image": "i"}]}}}}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/sdcguard-pod-inject", method="POST",
                                     data=json.dumps(review).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            return json.loads(answer.read())["response"]["allowed"] is True
    except Exception:  # noqa: BLE001
        return False


def test_leader_killed_at_random_points_acts_exactly_once(make_world):
    world = make_world(start=False, SDCGUARD_POLL_SECONDS="0.3")
    ns = "leader"
    ids = [new_instance() for _ in range(3)]
    nodes = [world.node(i) for i in ids]
    pods = world.training(ns, "llm", nodes)
    suspect, instance = nodes[1], ids[1]
    # Slow AWS answers and a few health polls widen the windows in which a kill lands mid-call.
    world.aws.script(instance, health_polls=4, health_delay=1.0, replace_polls=4, replace_delay=1.0)
    replicas = Replicas(world, seed=14)

    def drive(done, timeout: float, what: str, kill_on=None) -> None:
        """Wait for ``done()`` while killing whoever leads at random moments, as a node failure would,
        and once as soon as ``kill_on()`` holds (an AWS call in flight).
        (From this thread: the replicas die with the thread that started them, PR_SET_PDEATHSIG.)"""
        deadline, next_kill = time.monotonic() + timeout, time.monotonic() + replicas.rng.uniform(1.0, 4.0)
        while time.monotonic() < deadline:
            try:
                if kill_on is not None and kill_on() and replicas.kill_leader(
                        f"t={time.monotonic() - started:.1f}s, a call in flight ({what})"):
                    kill_on = None
                if done():
                    return
            except Exception:  # noqa: BLE001 — not there yet
                pass
            if time.monotonic() >= next_kill:
                replicas.kill_leader(f"t={time.monotonic() - started:.1f}s, waiting for {what}")
                next_kill = time.monotonic() + replicas.rng.uniform(1.5, 3.5)
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}; kills {replicas.kills}\n" + world.log()[-6000:])

    try:
        world.wait(replicas.holder, timeout=60, what="a leader")
        from sdcguard.contract import names  # noqa: F401 — the webhooks are served by both replicas
        for slot in ("a", "b"):
            world.wait(lambda s=slot: _admission_review_answered(replicas.ports[s]), timeout=60,
                       what=f"replica {slot}'s pod webhook")
        started = time.monotonic()
        world.alarm_event(ns, make_alarm(ns, "llm", step=70, suspects=[(1, pods[1], suspect)],
                                         reporter=(0, pods[0], nodes[0])), key=world.alarm_key(ns, "llm", 90))
        drive(lambda: (world.replacement(suspect).get("status") or {}).get("phase") == "PendingApproval",
              120, "PendingApproval", kill_on=lambda: world.aws.calls("StartClusterHealthCheck", instance))
        world.custom.patch_cluster_custom_object("sdcguard.dev", "v1", "nodereplacements", suspect,
                                                 {"spec": {"decision": "Approved", "decisionReason": "chaos"}})
        drive(lambda: (world.replacement(suspect).get("status") or {}).get("phase") == "Replaced", 120, "Replaced",
              kill_on=lambda: world.aws.calls("BatchReplaceClusterNodes", instance))
        time.sleep(2)
        for slot in ("a", "b"):  # the replicas alive now, one of them a follower, both admit pods
            world.wait(lambda s=slot: _admission_review_answered(replicas.ports[s]), timeout=60,
                       what=f"replica {slot}'s pod webhook after the kills")
    finally:
        replicas.close()

    effective = lambda action: [c for c in world.aws.calls(action, instance) if c["effective"]]  # noqa: E731
    assert len(effective("StartClusterHealthCheck")) == 1, world.aws.calls("StartClusterHealthCheck", instance)
    assert len(effective("BatchReplaceClusterNodes")) == 1, world.aws.calls("BatchReplaceClusterNodes", instance)
    assert len(world.aws.calls("StartClusterHealthCheck", instance)) == 1
    assert len(world.aws.calls("BatchReplaceClusterNodes", instance)) == 1
    status = world.replacement(suspect)["status"]
    events = [t["event"] for t in status["timeline"]]
    for once in ("Opened", "HealthCheckRequested", "Approved", "ReplaceRequested", "Replaced"):
        assert events.count(once) == 1, (once, events)
    incidents = world.incidents(ns)
    assert len(incidents) == 1, dump(incidents)
    timeline = [t["event"] for t in incidents[0]["status"]["timeline"]]
    assert timeline.count("Opened") == 1 and timeline.count("NodeCordoned") == 1, timeline
    # the chaos did happen: the leader was killed with each AWS call in flight (and at random
    # moments besides, as many as the flow left time for)
    assert sum("a call in flight" in k for k in replicas.kills) == 2, replicas.kills
    print(f"leader kills: {replicas.kills}")


def test_lease_rules_one_holder_takeover_only_after_expiry_and_exit_on_loss(tmp_path, monkeypatch):
    """The Elector against the emulator's Lease, with clocks of our own: a follower waits out the
    lease from when it last saw the record change; a superseded leader exits."""
    from sdcguard.sandbox.apiserver import start_emulator

    from sdcguard_operator import kube, leader
    from sdcguard_operator.settings import Settings

    with start_emulator(tmp_path) as emulator:
        monkeypatch.setattr(kube, "_client", emulator.api_client())
        settings = Settings.from_env({"SDCGUARD_LEASE_SECONDS": "10", "SDCGUARD_RENEW_SECONDS": "6"})
        now = {"a": 0.0, "b": 0.0}
        exits: list[str] = []
        a = leader.Elector(settings, identity="a", clock=lambda: now["a"], exit=lambda code: exits.append("a"))
        b = leader.Elector(settings, identity="b", clock=lambda: now["b"], exit=lambda code: exits.append("b"))
        assert a.try_acquire() is True
        assert b.try_acquire() is False  # held
        now["b"] = 9.0
        assert b.try_acquire() is False  # not yet expired as b sees it
        assert a.try_acquire() is True  # a renews: the record changes, b's wait starts again
        now["b"] = 18.0
        assert b.try_acquire() is False
        now["b"] = 28.5  # 10 s after b saw the last change
        assert b.try_acquire() is True
        lease = kubernetes_lease(emulator)
        assert lease.spec.holder_identity == "b" and lease.spec.lease_transitions == 1
        # a learns it lost: it exits at once (it must not act any longer)
        stop = __import__("threading").Event()
        a.retry = 0.01
        thread = __import__("threading").Thread(target=a.hold, args=(stop,))
        thread.start()
        thread.join(5)
        stop.set()
        assert exits == ["a"]
        b.release()
        assert kubernetes_lease(emulator).spec.holder_identity in ("", None)
        assert a.try_acquire() is True  # handed back: no need to wait for expiry


def kubernetes_lease(emulator):
    import kubernetes
    return kubernetes.client.CoordinationV1Api(emulator.api_client()).read_namespaced_lease(
        "sdcguard-operator", "default")


@pytest.mark.slow  # 60 s of lease expiry: in make test-slow, which CI runs too
def test_a_leader_whose_kopf_watcher_fails_hands_the_lease_over_and_exits(make_world):
    # kopf does not restart a watcher that failed for good (here: a 403 on the LIST of incidents,
    # as after an RBAC change); the leader must not go on holding the Lease with dead watches.
    world = make_world(start=False, **LEASE)
    world.kube.reject("GET", "/apis/sdcguard.dev/v1/sdcincidents", 403)
    world.start_operator()
    assert world.proc is not None
    code = world.proc.wait(timeout=150)  # kopf retries the LIST 9 times (~55 s) before it gives up
    log = world.log()
    assert code == 1, log[-4000:]
    assert "stopped: watcher for sdcincidents" in log and "the Lease is released" in log, log[-4000:]
    lease = world.kube.api_client()
    import kubernetes
    held = kubernetes.client.CoordinationV1Api(lease).read_namespaced_lease("sdcguard-operator", "default")
    assert not held.spec.holder_identity, held.spec  # handed over at once, not left to expire
