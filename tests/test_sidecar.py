"""The sidecar (`sdcguard sidecar`, docs/design.md §4/§7) as a real process against kmock over HTTP.

Records are written by the library's own spool writer; Events are read back through the official
client. "API server down" is a real outage: the sidecar's kubeconfig points at a port where
nothing listens until a TCP proxy to the emulator is opened there. The signing key is a file laid
out as the kubelet lays out a Secret volume (``key -> ..data/key``, ``..data`` a symlink swapped
atomically on an update).
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

import kubernetes
import pytest

from sdcguard.sandbox.apiserver import start_emulator, write_kubeconfig
from sdcguard.contract import alarm
from sdcguard.contract import events
from sdcguard.contract import names
from sdcguard.contract import spool
from sdcguard.sidecar.publisher import Backoff
from sdcguard.contract.stats import CheckStats

pytestmark = [pytest.mark.emulator, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Any:
    with start_emulator(tmp_path_factory.mktemp("kube")) as running:
        yield running


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def record(alarm_id: str, *, namespace: str, check: str = alarm.CHECK_REPLAY, step: int = 40,
           suspects: list[int] = [3]) -> dict[str, Any]:
    identities = {r: {"rank": r, "pod": f"llm-worker-{r // 2}", "node": f"hyperpod-i-0{r // 2:016x}"}
                  for r in range(6)}
    return alarm.make_alarm(
        alarm_id=alarm_id, job={"kind": "PyTorchJob", "name": "llm", "namespace": namespace},
        check=check, step=step, suspect_ranks=suspects, identities=identities, ambiguous=False,
        reporter_rank=0, evidence={"pairs": [[3, 5]]}, last_verified_step=step - 1,
        last_good_checkpoint="checkpoint-19.pt")


class SecretVolume:
    """A Secret volume as the kubelet writes it: ``<dir>/key -> ..data/key``, ``..data -> ..<version>``."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.versions = 0
        self.path = self.dir / names.ALARM_KEY_DATA_KEY

    def write(self, key: bytes) -> bytes:
        self.versions += 1
        version = self.dir / f"..v{self.versions}"
        version.mkdir()
        (version / names.ALARM_KEY_DATA_KEY).write_bytes(key)
        (self.dir / "..data_tmp").symlink_to(version.name)
        os.replace(self.dir / "..data_tmp", self.dir / "..data")  # the atomic swap
        if not self.path.is_symlink():
            self.path.symlink_to(f"..data/{names.ALARM_KEY_DATA_KEY}")
        return key


class Sidecar:
    """`python -m sdcguard.cli sidecar ...` with short intervals; its log is kept for assertions.
    Signs with a fresh key in a Secret-like volume unless ``key_file`` names another file."""

    def __init__(self, spool_dir: Path, kubeconfig: Path, key_file: Path | None = None, *extra: str) -> None:
        self.port = free_port()
        self.log = spool_dir.parent / f"sidecar-{self.port}.log"
        if key_file is None:
            self.volume = SecretVolume(spool_dir.parent / f"key-{self.port}")
            self.key = self.volume.write(secrets.token_bytes(32))
            key_file = self.volume.path
        env = {**os.environ, "POD_NAME": "llm-worker-0", "POD_NAMESPACE": "fallback", "NODE_NAME": "node-a"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sdcguard.cli", "sidecar", "--spool", str(spool_dir), "--kubeconfig",
             str(kubeconfig), "--metrics-host", "127.0.0.1", "--metrics-port", str(self.port),
             "--poll-interval", "0.2", "--backoff-initial", "0.2", "--backoff-max", "0.8", "--settle", "0.5",
             "--drain", "2", "--key-file", str(key_file), *extra],
            env=env, stdout=subprocess.DEVNULL, stderr=open(self.log, "w"))
        wait_for(lambda: self.get("/healthz")[0] == 200, "sidecar HTTP endpoint")

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=2) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, ""
        except OSError:
            return 0, ""

    def metric(self, sample: str) -> float | None:
        for line in self.get("/metrics")[1].splitlines():
            if line.startswith(sample + " "):
                return float(line.rsplit(" ", 1)[1])
        return None

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(15)

    def output(self) -> str:
        return self.log.read_text()


def wait_for(condition: Callable[[], Any], what: str, timeout: float = 45.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = condition()
        if result:
            return result
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def alarm_events(kube: Any, namespace: str) -> list[Any]:
    api = kubernetes.client.CoreV1Api(kube.api_client())
    return [e for e in api.list_namespaced_event(namespace).items if e.reason == names.EVENT_REASON]


def published(spool_dir: Path) -> list[str]:
    d = spool_dir / "published"
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


def test_publishes_each_record_once_quarantines_corrupt_files_and_exports_stats(kube: Any, tmp_path: Path) -> None:
    spool_dir = tmp_path / "spool"
    replay = record("job1-replay-step40", namespace="ml")
    reduced = record("job1-nonfinite-reduced-step41", namespace="ml", check=alarm.CHECK_NONFINITE_REDUCED,
                     step=41, suspects=[])
    spool.write_alarm(spool_dir, replay)
    spool.write_alarm(spool_dir, reduced)
    (spool_dir / "broken.alarm.json").write_text('{"schema": "sdcguard.dev/alarm/v1", "id": ')
    # A writer that does not rename atomically is still writing this one (it keeps changing):
    late = record("job1-weights-step42", namespace="ml", check=alarm.CHECK_WEIGHTS, step=42)
    growing = spool_dir / "late.alarm.json"
    growing.write_text(alarm.dumps(late)[:50])
    os.utime(growing, (time.time() + 60, time.time() + 60))
    stats = CheckStats({"rank": 0, "pod": "llm-worker-0", "node": "node-a"}, None)
    stats.steps, stats.last_step, stats.last_verified_step = 41, 41, 39
    stats.runs, stats.seconds = {"replay": 4, "weights": 9}, {"replay": 1.5, "weights": 0.25}
    stats.flush(str(spool_dir), force=True)

    sidecar = Sidecar(spool_dir, kube.kubeconfig)
    try:
        wait_for(lambda: len(published(spool_dir)) == 2 and (spool_dir / "quarantine").is_dir(), "publishing")
        got = {e.metadata.name: e for e in alarm_events(kube, "ml")}
        assert set(got) == {events.event_name(replay["id"]), events.event_name(reduced["id"])}
        first = got[events.event_name(replay["id"])]
        assert first.type == "Warning" and first.source.component == "sdcguard-agent"
        assert first.involved_object.kind == "Pod" and first.involved_object.name == "llm-worker-1"
        assert alarm.loads(first.metadata.annotations[names.ALARM_ANNOTATION]) == replay
        signature = first.metadata.annotations[names.ALARM_SIGNATURE_ANNOTATION]
        assert signature == events.alarm_signature(sidecar.key, first.metadata.annotations[names.ALARM_ANNOTATION])
        assert signature.startswith("v1=") and len(signature) == 3 + 64
        assert "check replay at step 40" in first.message and "\n" not in first.message
        second = got[events.event_name(reduced["id"])]
        assert second.involved_object.name == "llm-worker-0"  # no suspect: the reporter's pod
        assert (spool_dir / "quarantine" / "broken.alarm.json").exists()
        assert "quarantined corrupt spool file broken.alarm.json" in sidecar.output()
        assert spool.list_alarms(spool_dir) == [growing]  # not quarantined while it changes
        growing.write_text(alarm.dumps(late))
        wait_for(lambda: len(published(spool_dir)) == 3, "the completed record")
        assert events.event_name(late["id"]) in {e.metadata.name for e in alarm_events(kube, "ml")}
        assert spool.list_alarms(spool_dir) == []

        # A crash after the Event was created but before the file moved: the retry collides (409).
        spool.write_alarm(spool_dir, replay)
        wait_for(lambda: len(published(spool_dir)) == 4, "the retried record to be set aside")
        assert len(alarm_events(kube, "ml")) == 3
        assert "already exists" in sidecar.output()

        assert sidecar.metric('sdcguard_sidecar_alarms_published_total{check="replay"}') == 1.0
        assert sidecar.metric('sdcguard_sidecar_alarms_published_total{check="nonfinite-reduced"}') == 1.0
        assert sidecar.metric('sdcguard_sidecar_alarms_published_total{check="weights"}') == 1.0
        assert sidecar.metric("sdcguard_sidecar_alarms_already_published_total") == 1.0
        assert sidecar.metric("sdcguard_sidecar_alarms_quarantined_total") == 1.0
        assert sidecar.metric("sdcguard_sidecar_spool_backlog") == 0.0
        assert sidecar.metric('sdcguard_checks_total{check="replay",rank="0"}') == 4.0
        assert sidecar.metric('sdcguard_check_seconds_total{check="weights",rank="0"}') == 0.25
        assert sidecar.metric('sdcguard_last_verified_step{rank="0"}') == 39.0
        assert sidecar.metric('sdcguard_steps_total{rank="0"}') == 41.0
        assert sidecar.get("/healthz")[0] == 200
    finally:
        assert sidecar.stop() == 0


class TcpProxy:
    """Forwards 127.0.0.1:port to a target: the API server "comes back" when this opens."""

    def __init__(self, port: int, target: tuple[str, int]) -> None:
        self.target = target
        self.server = socket.create_server(("127.0.0.1", port))
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.server.close()


def test_records_written_while_the_api_server_is_down_are_published_once_it_returns(kube: Any, tmp_path: Path) -> None:
    spool_dir = tmp_path / "spool"
    port = free_port()
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", f"http://127.0.0.1:{port}")
    sidecar = Sidecar(spool_dir, kubeconfig)
    proxy = None
    try:
        ids = [f"job2-weights-step{s}" for s in (10, 20, 30)]
        for i, alarm_id in enumerate(ids):
            spool.write_alarm(spool_dir, record(alarm_id, namespace="outage", check=alarm.CHECK_WEIGHTS,
                                                step=10 * (i + 1)))
            time.sleep(0.4)
        wait_for(lambda: (sidecar.metric('sdcguard_sidecar_publish_errors_total{reason="unreachable"}') or 0) >= 2,
                 "failed attempts while the API server is down")
        assert len(spool.list_alarms(spool_dir)) == 3 and published(spool_dir) == []
        wait_for(lambda: sidecar.metric("sdcguard_sidecar_spool_backlog") == 3.0, "the backlog gauge")
        assert sidecar.get("/healthz")[0] == 200  # an outage is not a reason to restart the sidecar

        proxy = TcpProxy(port, ("127.0.0.1", int(kube.url.rsplit(":", 1)[1])))
        ids.append("job2-weights-step40")
        spool.write_alarm(spool_dir, record(ids[-1], namespace="outage", check=alarm.CHECK_WEIGHTS, step=40))
        wait_for(lambda: len(published(spool_dir)) == 4, "the backlog to be published")
        event_names = sorted(e.metadata.name for e in alarm_events(kube, "outage"))
        assert event_names == sorted(events.event_name(i) for i in ids)  # none lost, none twice
        steps = sorted(json.loads(e.metadata.annotations[names.ALARM_ANNOTATION])["step"]
                       for e in alarm_events(kube, "outage"))
        assert steps == [10, 20, 30, 40]
        assert sidecar.metric('sdcguard_sidecar_alarms_published_total{check="weights"}') == 4.0
        assert "it stays in the spool" in sidecar.output()
    finally:
        assert sidecar.stop() == 0
        if proxy:
            proxy.close()


def test_an_event_the_api_server_rejects_is_quarantined_and_does_not_block_the_spool(
        kube: Any, tmp_path: Path) -> None:
    # The API server refuses this namespace's Events as invalid (422), e.g. an oversized annotation.
    kube.reject("POST", "/api/v1/namespaces/rejecting/events", 422)
    spool_dir = tmp_path / "spool"
    spool.write_alarm(spool_dir, record("job4-replay-step1", namespace="rejecting", step=1))
    time.sleep(0.05)  # oldest first: the rejected record comes before the good one
    spool.write_alarm(spool_dir, record("job4-replay-step2", namespace="accepting", step=2))
    sidecar = Sidecar(spool_dir, kube.kubeconfig)
    try:
        wait_for(lambda: published(spool_dir) and (spool_dir / "quarantine").is_dir(), "both records handled")
        assert published(spool_dir) == ["job4-replay-step2.alarm.json"]
        assert [e.metadata.name for e in alarm_events(kube, "accepting")] == [events.event_name("job4-replay-step2")]
        assert "rejected the Event for job4-replay-step1.alarm.json" in sidecar.output()
        assert sidecar.metric('sdcguard_sidecar_publish_errors_total{reason="422"}') == 1.0
    finally:
        assert sidecar.stop() == 0


def test_sigterm_drains_then_stops_leaving_unpublished_records_in_the_spool(tmp_path: Path) -> None:
    spool_dir = tmp_path / "spool"
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", f"http://127.0.0.1:{free_port()}")
    sidecar = Sidecar(spool_dir, kubeconfig)
    spool.write_alarm(spool_dir, record("job3-replay-step5", namespace="gone", step=5))
    wait_for(lambda: "it stays in the spool" in sidecar.output(), "a failed attempt")
    started = time.monotonic()
    assert sidecar.stop() == 0
    assert time.monotonic() - started < 10  # --drain 2: bounded by the pod's grace period
    assert len(spool.list_alarms(spool_dir)) == 1  # kept for the next sidecar (same emptyDir)
    lines = [json.loads(line) for line in sidecar.output().splitlines()]  # structured logs
    assert any("stopping with 1 unpublished record(s)" in line["message"] and line["level"] == "ERROR"
               for line in lines)


def _signature(kube: Any, namespace: str, alarm_id: str) -> str | None:
    api = kubernetes.client.CoreV1Api(kube.api_client())
    annotations = api.read_namespaced_event(events.event_name(alarm_id), namespace).metadata.annotations or {}
    return annotations.get(names.ALARM_SIGNATURE_ANNOTATION)


def test_records_wait_for_the_key_and_are_signed_with_the_current_key_after_rotation(
        kube: Any, tmp_path: Path) -> None:
    spool_dir = tmp_path / "spool"
    volume = SecretVolume(tmp_path / "key")  # mounted, but the operator has not written the Secret yet
    sidecar = Sidecar(spool_dir, kube.kubeconfig, volume.path)
    try:
        first = record("job5-replay-step1", namespace="signed", step=1)
        spool.write_alarm(spool_dir, first)
        wait_for(lambda: (sidecar.metric('sdcguard_sidecar_publish_errors_total{reason="no-key"}') or 0) >= 2,
                 "passes without a key")
        assert alarm_events(kube, "signed") == [] and len(spool.list_alarms(spool_dir)) == 1
        assert "alarms wait in the spool until it appears" in sidecar.output()

        old = volume.write(secrets.token_bytes(32))
        wait_for(lambda: len(published(spool_dir)) == 1, "the record, once the key is there")
        text = alarm.dumps(first)
        assert _signature(kube, "signed", first["id"]) == events.alarm_signature(old, text)
        assert events.signature_matches(old, text, _signature(kube, "signed", first["id"]))

        new = volume.write(secrets.token_bytes(48))  # the Secret replaced mid-job: the kubelet swaps ..data
        second = record("job5-replay-step2", namespace="signed", step=2)
        spool.write_alarm(spool_dir, second)
        wait_for(lambda: len(published(spool_dir)) == 2, "the record after the rotation")
        assert _signature(kube, "signed", second["id"]) == events.alarm_signature(new, alarm.dumps(second))
        assert not events.signature_matches(old, alarm.dumps(second), _signature(kube, "signed", second["id"]))
        assert "the alarm key changed (rotated)" in sidecar.output()

        volume.write(b"short")  # not a usable key: wait again rather than sign with it
        third = record("job5-replay-step3", namespace="signed", step=3)
        spool.write_alarm(spool_dir, third)
        wait_for(lambda: "fewer than 32" in sidecar.output(), "the short key refused")
        assert len(spool.list_alarms(spool_dir)) == 1
    finally:
        assert sidecar.stop() == 0


def test_allow_unsigned_publishes_without_a_key(kube: Any, tmp_path: Path) -> None:
    spool_dir = tmp_path / "spool"
    sidecar = Sidecar(spool_dir, kube.kubeconfig, tmp_path / "absent" / "key", "--allow-unsigned")
    try:
        spool.write_alarm(spool_dir, record("job6-replay-step1", namespace="unsigned", step=1))
        wait_for(lambda: len(published(spool_dir)) == 1, "the unsigned record")
        assert _signature(kube, "unsigned", "job6-replay-step1") is None
    finally:
        assert sidecar.stop() == 0


def test_event_names_are_deterministic_valid_and_distinct() -> None:
    import re

    dns = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    ids = ["3f2a9c1b7e4d-1-replay-step40", "A/B c", "a-b-c", "x" * 400, "--"]
    event_names = [events.event_name(i) for i in ids]
    assert event_names == [events.event_name(i) for i in ids]
    assert all(dns.match(n) and len(n) <= 253 for n in event_names)
    assert len(set(event_names)) == len(event_names)


def test_backoff_doubles_up_to_its_ceiling_and_resets() -> None:
    import random

    b = Backoff(0.5, 4.0, random.Random(1))
    delays = [b.next() for _ in range(6)]
    assert all(0.25 <= d <= 0.5 for d in delays[:1]) and all(2.0 <= d <= 4.0 for d in delays[3:])
    b.reset()
    assert b.next() <= 0.5


def test_sidecar_never_imports_torch() -> None:
    code = ("import sys, sdcguard.cli, sdcguard.sidecar.publisher, sdcguard.sidecar.metrics, sdcguard.contract.events; "
            "sdcguard.sidecar.publisher.build_parser(); "
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')); "
            "print(bad); sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


TRAINING_EXIT = """
import sys
from sdcguard.contract import spool
spool_dir, alarm_id, record = sys.argv[1], sys.argv[2], __import__("json").loads(sys.argv[3])
spool.write_alarm(spool_dir, record)
ok = spool.wait_published(spool_dir, alarm_id, timeout=float(sys.argv[4]))
print("published" if ok else "not-confirmed")
sys.exit(3)  # the SDCDetected exception leaves the training process either way
"""


def test_an_alarm_raised_while_the_api_server_is_down_is_published_during_the_grace_period(
        kube: Any, tmp_path: Path) -> None:
    """The training process raises, waits (bounded) for the confirmation, exits; the pod ends
    (SIGTERM to the sidecar) while the API server is still down; it comes back within the grace
    period and the sidecar publishes the record before it stops."""
    spool_dir = tmp_path / "spool"
    port = free_port()
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", f"http://127.0.0.1:{port}")
    sidecar = Sidecar(spool_dir, kubeconfig, None, "--grace-period", "20")
    alarm_id = "job9-replay-step7"
    rec = record(alarm_id, namespace="grace", step=7)
    training = subprocess.run([sys.executable, "-c", TRAINING_EXIT, str(spool_dir), alarm_id, json.dumps(rec), "1.5"],
                              capture_output=True, text=True, timeout=60)
    assert training.returncode == 3 and training.stdout.strip() == "not-confirmed", training.stderr
    assert spool.state(spool_dir, alarm_id) == "pending"
    sidecar.proc.send_signal(signal.SIGTERM)  # the pod is ending; the API server is still down
    time.sleep(3)
    assert sidecar.proc.poll() is None  # still trying, within the grace period
    proxy = TcpProxy(port, ("127.0.0.1", int(kube.url.rsplit(":", 1)[1])))
    try:
        assert sidecar.proc.wait(20) == 0
        assert spool.published(spool_dir, alarm_id) and spool.state(spool_dir, alarm_id) == "published"
        assert [e.metadata.name for e in alarm_events(kube, "grace")] == [events.event_name(alarm_id)]
        assert "spool empty; stopping" in sidecar.output()
        # The confirmation the library waits for is there now: a second wait returns at once.
        assert spool.wait_published(spool_dir, alarm_id, timeout=0)
    finally:
        proxy.close()


def test_wait_published_is_bounded_and_gives_up_early_on_a_quarantined_record(tmp_path: Path) -> None:
    spool_dir = tmp_path / "spool"
    spool.write_alarm(spool_dir, record("job9-replay-step8", namespace="x", step=8))
    clock = [0.0]
    assert not spool.wait_published(spool_dir, "job9-replay-step8", timeout=5, clock=lambda: clock[0],
                                    sleep=lambda s: clock.__setitem__(0, clock[0] + s))
    assert clock[0] == pytest.approx(5.0)
    (spool_dir / "quarantine").mkdir()
    spool.alarm_path(spool_dir, "job9-replay-step8").rename(spool_dir / "quarantine" / "job9-replay-step8.alarm.json")
    assert spool.state(spool_dir, "job9-replay-step8") == "quarantined"
    assert not spool.wait_published(spool_dir, "job9-replay-step8", timeout=3600)  # at once
    assert spool.state(spool_dir, "never-written") == "missing"


def test_an_event_name_taken_in_advance_cannot_suppress_the_alarm(kube: Any, tmp_path: Path) -> None:
    """Attack (issue 20, 3): the Event name follows from the alarm id (run_id-n-check-step, run_id
    is in every checkpoint manifest), and the sidecar took 409 on create as "published before".
    Someone who may create Events pre-created the likely names, and the real alarm was dropped
    without a trace. Now the sidecar reads the Event of that name: not this alarm's annotation and
    signature, so it publishes under a fresh name (a digest of the signature nobody can foresee),
    counts it and logs it; the alert SDCGuardAlarmEventNameTaken fires on that counter."""
    spool_dir = tmp_path / "spool"
    api = kubernetes.client.CoreV1Api(kube.api_client())
    real = record("job7-replay-step40", namespace="squat", step=40)
    planted = api.create_namespaced_event("squat", {
        "metadata": {"name": events.event_name(real["id"]), "namespace": "squat",
                     "annotations": {names.ALARM_ANNOTATION: "{}"}},
        "type": "Normal", "reason": "Squatted", "message": "taken in advance",
        "involvedObject": {"apiVersion": "v1", "kind": "Pod", "name": "llm-worker-1", "namespace": "squat"}})
    assert planted.metadata.name == events.event_name(real["id"])
    sidecar = Sidecar(spool_dir, kube.kubeconfig)
    try:
        spool.write_alarm(spool_dir, real)
        wait_for(lambda: len(published(spool_dir)) == 1, "the record published under another name")
        [event] = alarm_events(kube, "squat")
        assert event.metadata.name.startswith(events.event_name(real["id"]) + "-")
        text = event.metadata.annotations[names.ALARM_ANNOTATION]
        assert alarm.loads(text) == real
        assert events.signature_matches(sidecar.key, text, event.metadata.annotations[names.ALARM_SIGNATURE_ANNOTATION])
        assert sidecar.metric("sdcguard_sidecar_event_name_taken_total") == 1.0
        assert sidecar.metric("sdcguard_sidecar_alarms_already_published_total") in (None, 0.0)
        assert "someone took its name" in sidecar.output()
        # the same record again (a crash before the file moved): the fresh-name Event is recognised
        spool.write_alarm(spool_dir, real)
        wait_for(lambda: len(published(spool_dir)) == 2, "the retried record set aside")
        assert len(alarm_events(kube, "squat")) == 1
    finally:
        assert sidecar.stop() == 0
