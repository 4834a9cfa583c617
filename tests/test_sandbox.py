"""``sdcguard demo`` closes the whole loop in the sandbox; ``sdcguard sandbox`` serves it until
stopped. Both leave nothing running (every process that carries the work directory is gone)."""
from __future__ import annotations

import json
import os
import pathlib
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest

pytestmark = [pytest.mark.emulator, pytest.mark.operator, pytest.mark.multiprocess]
BINDIR = pathlib.Path(sys.prefix) / "bin"
ENV = {**os.environ, "PATH": f"{BINDIR}:{os.environ.get('PATH', '')}", "PYTHONSAFEPATH": "1"}


def _left_running(marker: str, exclude: int) -> list[str]:
    """Processes (other than ``exclude`` and this one) whose command line or environment names ``marker``."""
    found = []
    for proc in pathlib.Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) in (os.getpid(), exclude):
            continue
        try:
            text = (proc / "cmdline").read_bytes() + (proc / "environ").read_bytes()
            state = (proc / "stat").read_text().split(")")[-1].split()[0]
        except OSError:
            continue
        if marker.encode() in text and state != "Z":
            command = (proc / "cmdline").read_bytes().replace(b"\0", b" ")[:200]
            found.append(f"{proc.name}: {command!r}")
    return found


@pytest.mark.timeout(400)
def test_demo_closes_the_loop_and_stops_everything(tmp_path: pathlib.Path) -> None:
    workdir, report = tmp_path / "demo", tmp_path / "demo-report.json"
    started = time.monotonic()
    done = subprocess.run([str(BINDIR / "sdcguard"), "demo", "--workdir", str(workdir), "--report", str(report)],
                          capture_output=True, text=True, timeout=300, env=ENV)
    took = time.monotonic() - started
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-8000:]
    drill = json.loads(report.read_text())
    assert drill["passed"] and len(drill["alarms"]) == 1
    alarm = drill["alarms"][0]
    # The ranks took the sandbox's identities: the alarm names a real pod and node of the job.
    suspect = alarm["suspects"][0]
    assert alarm["check"] == "replay" and alarm["step"] == 8 and suspect["rank"] == 3
    assert suspect["pod"] == "llm-pretrain-worker-1" and suspect["node"].startswith("hyperpod-i-")
    # ... and signed their uids, as the downward API gives a real pod (the operator compares them)
    assert {k: alarm["job"][k] for k in ("kind", "name", "namespace")} == {
        "kind": "PyTorchJob", "name": "llm-pretrain", "namespace": "demo"}
    assert alarm["job"]["uid"] and suspect["pod_uid"] and alarm["drill"] is True
    assert alarm["suspect_window"] == {"first_step": 5, "last_step": 8} and alarm["last_good_checkpoint_step"] == 4
    # The real sidecar published it (moved to published/), and the operator acted on it.
    assert list((workdir / "spool" / "published").glob(f"{alarm['id']}*"))
    assert "sidecar injected into every pod" in out
    assert re.search(r"PendingApproval\s+Failed", out), out[-6000:]
    assert "approved by oncall@example.com (groups: sdcguard-approvers)" in out
    assert re.search(r"Replaced\s+Failed\s+Approved", out)
    assert f"{suspect['node']} cordoned: True" in out and "suspended: True" in out
    assert "approved by oncall@example.com (recorded by the admission webhook)" in out
    assert "pytorchjob.kubeflow.org/llm-pretrain patched" in out  # the person resumes the job
    assert "No resources found in demo namespace" in out  # while suspended
    assert "resume from" in out and "step-4.pt (step 4)" in out and "4 steps at risk" in out
    assert re.search(r"OK .*step-4\.pt: step 4, .* on an audited step", out)
    # The replaced node's pod came back on the fresh node, not on the suspect one.
    [moved] = re.findall(r"llm-pretrain-worker-1\s+Running\s+(hyperpod-i-\w+)", out)[-1:]
    assert moved != suspect["node"]
    assert "BatchReplaceClusterNodes accepted" in out and "instance replaced by fresh hardware" in out
    assert _left_running(str(workdir), exclude=-1) == []
    print(f"demo took {took:.0f}s")


def _read_until(proc: subprocess.Popen[str], marker: str, timeout: float) -> str:
    """What ``proc`` printed up to the line starting with ``marker`` (or up to EOF / the timeout);
    read by a thread, so a silent process cannot hang the test."""
    assert proc.stdout is not None
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in iter(proc.stdout.readline, "")] and None,
                     daemon=True).start()
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            break
        seen.append(line)
        if line.lstrip().startswith(marker):
            break
    proc.reader = lines  # type: ignore[attr-defined]  # the rest, for the caller
    return "".join(seen)


def _rest(proc: subprocess.Popen[str], timeout: float) -> str:
    """Wait for ``proc`` to exit; what it printed after ``_read_until``."""
    proc.wait(timeout)
    time.sleep(0.2)
    lines = proc.reader  # type: ignore[attr-defined]
    return "".join(lines.get() for _ in range(lines.qsize()))


@pytest.mark.timeout(300)
def test_demo_stopped_midway_leaves_nothing_running(tmp_path: pathlib.Path) -> None:
    workdir = tmp_path / "demo"
    drill_dirs = set(pathlib.Path(tempfile.gettempdir()).glob("sdcguard-drill-*"))
    proc = subprocess.Popen([str(BINDIR / "sdcguard"), "demo", "--workdir", str(workdir)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=ENV)
    try:
        text = _read_until(proc, "+", timeout=120)  # the drill's first line: its ranks are starting
        assert "[drill]" in text, text
        time.sleep(2)
        proc.send_signal(signal.SIGTERM)
        rest = _rest(proc, timeout=60)
        assert proc.returncode == 130, text + rest
        assert "interrupted; everything it started has stopped" in rest
        time.sleep(1)  # SIGKILLed children (PR_SET_PDEATHSIG) are reaped by init
        assert _left_running(str(workdir), exclude=proc.pid) == []
        # the drill, stopped by SIGTERM, removed its temporary directory
        assert set(pathlib.Path(tempfile.gettempdir()).glob("sdcguard-drill-*")) == drill_dirs
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.mark.timeout(300)
def test_sandbox_serves_until_stopped(tmp_path: pathlib.Path) -> None:
    workdir = tmp_path / "sandbox"
    proc = subprocess.Popen([str(BINDIR / "sdcguard"), "sandbox", "--workdir", str(workdir), "--nodes", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
    try:
        text = _read_until(proc, "then decide", timeout=120)
        kubeconfig = re.search(r"KUBECONFIG=(\S+)", text)
        assert kubeconfig, text
        env = {**ENV, "KUBECONFIG": kubeconfig.group(1)}
        nodes = subprocess.run([str(BINDIR / "kubectl"), "get", "nodes", "-o", "json"], capture_output=True,
                               text=True, env=env, timeout=60)
        assert nodes.returncode == 0, nodes.stderr
        items = json.loads(nodes.stdout)["items"]
        assert len(items) == 2 and all(i["metadata"]["name"].startswith("hyperpod-i-") for i in items)
        assert all(i["metadata"]["labels"]["sagemaker.amazonaws.com/cluster-name"] for i in items)
        jobs = subprocess.run([str(BINDIR / "kubectl"), "get", "pytorchjobs", "-n", "demo", "-o", "json"],
                              capture_output=True, text=True, env=env, timeout=60)
        assert json.loads(jobs.stdout)["items"][0]["metadata"]["annotations"]["sdcguard.dev/enabled"] == "true"
        assert (workdir / "placement.json").exists()
        assert "grad-bitflip:rank=3" in text and "--checkpoint-dir" in text
        proc.send_signal(signal.SIGTERM)  # as kubectl delete / systemd / a terminal closing would
        rest = _rest(proc, timeout=60)
        assert proc.returncode == 0, text + rest
        assert "stopped" in rest
        assert _left_running(str(workdir), exclude=proc.pid) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_bad_input_is_refused(tmp_path: pathlib.Path) -> None:
    (tmp_path / "x").write_text("")
    for workdir in (tmp_path, tmp_path / "x"):  # not empty; not a directory
        for command in ("demo", "sandbox"):
            done = subprocess.run([str(BINDIR / "sdcguard"), command, "--workdir", str(workdir)], capture_output=True,
                                  text=True, timeout=60, env=ENV)
            assert done.returncode == 2 and "is not an empty directory" in done.stderr, done.stderr
    done = subprocess.run([str(BINDIR / "sdcguard"), "sandbox", "--nodes", "0"], capture_output=True,
                          text=True, timeout=60, env=ENV)
    assert done.returncode == 2 and "--nodes" in done.stderr
