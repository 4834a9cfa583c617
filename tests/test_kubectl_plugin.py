"""``kubectl sdcguard incidents``: the real kubectl finds the plugin on PATH and reads the
incidents from the Kubernetes emulator; no operator runs (the incidents are written as the
operator writes them, including one from an older operator and one not yet opened).

The last test (marked ``operator``) reads what the real operator wrote on the shared world
(tests/conftest.py): ``kubectl sdcguard incidents`` and ``history``, and the CRDs' printer columns
in ``kubectl get``. Approving and denying with the plugin: tests/test_approval.py, test_admission.py.
"""
from __future__ import annotations

import datetime
import os
import pathlib
import re
import subprocess
import sys

import kubernetes
import pytest
from conftest import KUBECTL, make_alarm, phase, start_training
from sdcguard.sandbox.apiserver import start_emulator

from sdcguard_operator import kubectl_plugin

pytestmark = pytest.mark.emulator

COLUMNS = ["NAMESPACE", "NAME", "JOB", "CHECK", "STEP", "SUSPECTS", "WINDOW", "RESUME-FROM", "SHA256", "AT-RISK",
           "DRILL", "PHASE", "AGE"]
SHA = "ab12" * 16
ESCAPES = "\x1b[2J\x1b[1;1H\x1b]0;ok\x07\x9b32mAPPROVED: healthy\x1b[0m"


def _incident(ns: str, name: str, record: dict, status: dict | None, **spec: object) -> dict:
    window = record["suspect_window"]
    body = {"apiVersion": "sdcguard.dev/v1", "kind": "SDCIncident", "metadata": {"name": name, "namespace": ns},
            "spec": {"job": record["job"], "check": record["check"], "step": record["step"], "ambiguous": False,
                     "suspects": record["suspects"], "reporter": record["reporter"],
                     "suspectWindow": {"firstStep": window["first_step"], "lastStep": window["last_step"]},
                     "lastVerifiedStep": record["last_verified_step"],
                     "lastGoodCheckpoint": record["last_good_checkpoint"], "alarmId": record["id"],
                     "event": f"sdcguard-{name}", "alarm": record, **spec}}
    if status is not None:
        body["status"] = status
    return body


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory):
    emulator = start_emulator(tmp_path_factory.mktemp("plugin"))
    custom = kubernetes.client.CustomObjectsApi(emulator.api_client())
    node = "hyperpod-i-0123456789abcdef0"
    current = make_alarm("ml", "llm", step=4200, window=(4101, 4200), suspects=[(13, "llm-worker-3", node)],
                         checkpoint="s3://ckpt/llm/step-4000.pt", last_good_checkpoint_step=4000, steps_at_risk=200)
    older = make_alarm("ml", "llm", check="weights", step=300, checkpoint="s3://ckpt/llm/step-250.pt",
                       suspects=[(2, "llm-worker-1", "hyperpod-i-0fedcba9876543210")])
    fresh = make_alarm("research", "bert", check="nonfinite-reduced", step=5, checkpoint=None)
    # written past the CRD's patterns (an API server without them, or an older CRD): the plugin
    # must still print no control character
    forged = make_alarm("zz", "evil", step=9, checkpoint=f"ckpt.pt{ESCAPES}")
    for ns, name, record, status, spec in [
        ("ml", "llm-replay-4200", current, {
            "phase": "AwaitingApproval", "resumeFrom": "s3://ckpt/llm/step-4000.pt", "resumeFromStep": 4000,
            "resumeFromSha256": SHA, "suspectWindow": {"firstStep": 4101, "lastStep": 4200, "range": "4101-4200"},
            "stepsAtRisk": 200}, {"lastGoodCheckpointSha256": SHA, "lastGoodCheckpointStep": 4000, "drill": True}),
        ("ml", "llm-weights-300", older, {"phase": "Resolved", "resumeFrom": "s3://ckpt/llm/step-250.pt"}, {}),
        ("research", "bert-nonfinite-reduced-5", fresh, None, {}),
        ("zz", "evil-replay-9", forged, {"phase": "AwaitingApproval", "resumeFrom": f"ckpt.pt{ESCAPES}"},
         {"job": {**forged["job"], "name": f"evil{ESCAPES}"}}),
    ]:
        custom.create_namespaced_custom_object("sdcguard.dev", "v1", ns, "sdcincidents",
                                               _incident(ns, name, record, status, **spec))
    yield emulator
    emulator.stop()


def _env(kube) -> dict[str, str]:
    return {**os.environ, "KUBECONFIG": str(kube.kubeconfig), "KUBECTL": KUBECTL,
            "PATH": f"{pathlib.Path(sys.prefix) / 'bin'}:{os.environ.get('PATH', '')}"}


def _rows(text: str) -> list[dict[str, str]]:
    """The table back into cells, cut at the header's column starts (cells may hold spaces)."""
    header, *lines = text.splitlines()
    assert header.split() == COLUMNS
    starts = [m.start() for m in re.finditer(r"\S+", header)] + [None]
    return [{c: line[starts[i]:starts[i + 1]].strip() for i, c in enumerate(COLUMNS)} for line in lines]


EXPECTED = [
    {"NAMESPACE": "ml", "NAME": "llm-replay-4200", "JOB": "llm", "CHECK": "replay", "STEP": "4200",
     "SUSPECTS": "hyperpod-i-0123456789abcdef0", "WINDOW": "4101-4200",
     "RESUME-FROM": "s3://ckpt/llm/step-4000.pt (step 4000)", "SHA256": SHA[:12], "AT-RISK": "200", "DRILL": "yes",
     "PHASE": "AwaitingApproval"},
    # opened by an older operator: the window from the spec, no step or risk invented
    {"NAMESPACE": "ml", "NAME": "llm-weights-300", "JOB": "llm", "CHECK": "weights", "STEP": "300",
     "SUSPECTS": "hyperpod-i-0fedcba9876543210", "WINDOW": "300-300", "RESUME-FROM": "s3://ckpt/llm/step-250.pt",
     "SHA256": "-", "AT-RISK": "-", "DRILL": "-", "PHASE": "Resolved"},
    # not yet opened, no suspect rank, no verified checkpoint
    {"NAMESPACE": "research", "NAME": "bert-nonfinite-reduced-5", "JOB": "bert", "CHECK": "nonfinite-reduced",
     "STEP": "5", "SUSPECTS": "-", "WINDOW": "5-5", "RESUME-FROM": "none", "SHA256": "-", "AT-RISK": "-",
     "DRILL": "-", "PHASE": "-"},
    # issue 20, 8: escape sequences that would clear the screen and paint "APPROVED" are gone
    {"NAMESPACE": "zz", "NAME": "evil-replay-9", "JOB": "evilAPPROVED: healthy", "CHECK": "replay", "STEP": "9",
     "SUSPECTS": "-", "WINDOW": "9-9", "RESUME-FROM": "ckpt.ptAPPROVED: healthy", "SHA256": "-", "AT-RISK": "-",
     "DRILL": "-", "PHASE": "AwaitingApproval"},
]


def test_kubectl_finds_the_plugin_and_prints_the_recovery_plan(kube) -> None:
    done = subprocess.run([KUBECTL, "sdcguard", "incidents"], env=_env(kube), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    rows = _rows(done.stdout)
    assert [{k: v for k, v in row.items() if k != "AGE"} for row in rows] == EXPECTED
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", done.stdout)  # no control character at all
    assert all(row["AGE"].endswith("s") for row in rows)  # created moments ago


def test_main_prints_the_same_table(kube, monkeypatch, capsys) -> None:
    for key in ("KUBECONFIG", "KUBECTL", "PATH"):
        monkeypatch.setenv(key, _env(kube)[key])
    assert kubectl_plugin.main(["incidents"]) == 0
    assert [{k: v for k, v in row.items() if k != "AGE"} for row in _rows(capsys.readouterr().out)] == EXPECTED


def test_main_reports_kubectl_failures(monkeypatch, capsys, tmp_path) -> None:
    monkeypatch.setenv("KUBECTL", KUBECTL)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    monkeypatch.setenv("PATH", f"{pathlib.Path(sys.prefix) / 'bin'}:{os.environ.get('PATH', '')}")
    assert kubectl_plugin.main(["incidents"]) == 1
    assert capsys.readouterr().err.startswith("kubectl sdcguard: error: ")


def test_clean_strips_every_terminal_escape_and_control_character() -> None:
    """Attack (issue 20, 8): free strings reached the plugin's output raw; an ANSI escape could
    rewrite the screen a person approves from (clear it, move the cursor, set the title)."""
    assert kubectl_plugin.clean(f"a{ESCAPES}b\x00\x07\x1bc\x85d") == "aAPPROVED: healthybd"
    assert kubectl_plugin.clean("tab\tand\nnewline stay") == "tab\tand\nnewline stay"


def test_age_reads_like_kubectl() -> None:
    now = datetime.datetime(2026, 1, 3, tzinfo=datetime.timezone.utc)
    assert [kubectl_plugin.age(stamp, now) for stamp in (
        "2026-01-02T23:59:18Z", "2026-01-02T23:50:00Z", "2026-01-02T19:00:00Z", "2025-12-30T00:00:00Z", None,
        "yesterday")] == ["42s", "10m", "5h", "4d", "-", "-"]


@pytest.mark.operator
def test_kubectl_sdcguard_history_and_incidents(world):
    ns = "listing"
    ids, nodes, pods = start_training(world, ns)
    world.alarm_event(ns, make_alarm(ns, "llm", suspects=[(1, pods[1], nodes[1])], reporter=(0, pods[0], nodes[0]),
                                     window=(31, 40), last_good_checkpoint_step=19, steps_at_risk=21,
                                     last_good_checkpoint_sha256="5a" * 32))
    world.alarm_event(ns, make_alarm(ns, "llm", check="weights", step=7, suspects=[(2, pods[2], nodes[2])],
                                     drill=True))  # no sha256 named, no step at risk; from a drill
    world.wait(lambda: phase(world, nodes[1]) == "PendingApproval", what="PendingApproval")
    assert world.kubectl("sdcguard", "approve", nodes[1]).returncode == 0
    world.wait(lambda: world.incident(ns, "llm-replay-40")["status"].get("phase") == "Resolved", what="Resolved")
    world.wait(lambda: phase(world, nodes[2]) == "PendingApproval", what="the drill's PendingApproval")

    listing = world.kubectl("sdcguard", "incidents")
    assert listing.returncode == 0, listing.stderr
    header, *rows = listing.stdout.splitlines()
    assert header.split() == COLUMNS
    ours = {row.split()[1]: row.split() for row in rows if row.startswith(f"{ns} ")}
    cells = ours["llm-replay-40"]
    assert cells[1:5] == ["llm-replay-40", "llm", "replay", "40"] and cells[5] == nodes[1]
    assert cells[6:13] == ["31-40", "checkpoint-19.pt", "(step", "19)", "5a" * 6, "21", "-"] and cells[13] == "Resolved"
    assert ours["llm-weights-7"][8:11] == ["-", "-", "yes"]
    history = world.kubectl("sdcguard", "history")
    assert history.returncode == 0, history.stderr
    lines = history.stdout.splitlines()
    assert lines[0].split() == ["NODE", "INSTANCE", "INCIDENTS", "LAST-INCIDENT"]
    assert any(line.split()[:2] == [nodes[1], ids[1]] for line in lines[1:]), history.stdout
    got = world.kubectl("get", "nodereplacements")
    assert got.returncode == 0, got.stderr
    assert got.stdout.split("\n")[0].split() == ["NAME", "NODE", "INSTANCE", "PHASE", "HEALTH-CHECK", "DECISION", "AGE"]
    assert any(line.split()[:6] == [nodes[1], nodes[1], ids[1], "Replaced", "Passed", "Approved"]
               for line in got.stdout.splitlines()[1:]), got.stdout
    got = world.kubectl("get", "sdcincidents", "-n", ns)
    assert got.returncode == 0, got.stderr
    header, *rows = got.stdout.splitlines()
    assert header.split() == ["NAME", "JOB", "CHECK", "STEP", "SUSPECTS", "WINDOW", "RESUME-FROM", "AT-RISK",
                              "PHASE", "AGE"]
    [row] = [row.split() for row in rows if row.startswith("llm-replay-40 ")]
    assert row[:4] == ["llm-replay-40", "llm", "replay", "40"]
    assert row[5:9] == ["31-40", "checkpoint-19.pt", "21", "Resolved"]
    wide = world.kubectl("get", "sdcincidents", "-n", ns, "-o", "wide")
    assert wide.returncode == 0, wide.stderr
    assert wide.stdout.splitlines()[0].split()[7:10] == ["RESUME-STEP", "RESUME-SHA256", "AT-RISK"]
