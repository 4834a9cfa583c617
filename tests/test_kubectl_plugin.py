"""``kubectl sdcguard incidents``: the real kubectl finds the plugin on PATH and reads the
incidents from the Kubernetes emulator; no operator runs (the incidents are written as the
operator writes them, including one from an older operator and one not yet opened).

The last test (marked ``operator``) reads what the real operator wrote on the shared world
(tests/conftest.py): ``kubectl sdcguard incidents`` and ``history``, and the CRDs' printer columns
in ``kubectl get``. Approving and denying with the plugin: tests/test_approval.py, test_admission.py.
"""
from __future__ import annotations

import datetime
import json
import os
import pathlib
import re
import subprocess
import sys

import kubernetes
import pytest
from conftest import KUBECTL, condition, make_alarm, phase, start_training
from sdcguard.sandbox.apiserver import start_emulator

from sdcguard_operator import history, kubectl_plugin

pytestmark = pytest.mark.emulator

COLUMNS = ["NAMESPACE", "NAME", "JOB", "CHECK", "STEP", "SUSPECTS", "WINDOW", "RESUME-FROM", "SHA256", "AT-RISK",
           "DRILL", "REPEAT", "TELEMETRY", "PHASE", "AGE"]
GPU = "GPU-8f3c2a10-1111-2222-3333-444455556666"
INVENTORY = {"recordedAt": "2026-03-30T10:00:01Z",
             "pods": [{"pod": "llm-worker-0", "uid": "p0", "node": "hyperpod-i-0aaaaaaaaaaaaaaaa", "phase": "Running",
                       "replicaType": "master", "replicaIndex": "0"},
                      {"pod": "llm-worker-3", "uid": "p3", "node": "hyperpod-i-0123456789abcdef0", "phase": "Running",
                       "replicaType": "worker", "replicaIndex": "3"}],
             "nodes": {"hyperpod-i-0aaaaaaaaaaaaaaaa": {"instanceId": "i-0aaaaaaaaaaaaaaaa"},
                       "hyperpod-i-0123456789abcdef0": {"instanceId": "i-0123456789abcdef0"}}}
OFFENDERS = [{"kind": "gpu", "id": GPU, "node": "hyperpod-i-0123456789abcdef0",
              "incidents": ["ml/llm-weights-300", "ml/llm-replay-4200"], "jobs": 1}]
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
            "stepsAtRisk": 200, "inventory": INVENTORY, "repeatOffenders": OFFENDERS,
            "replacements": {"hyperpod-i-0123456789abcdef0": "PendingApproval", "hyperpod-i-0ffffffffffffffff": "Failed"},
            "timeline": [{"time": "2026-03-30T10:00:02Z", "event": "Opened", "message": "replay alarm"}]},
         {"lastGoodCheckpointSha256": SHA, "lastGoodCheckpointStep": 4000, "drill": True}),
        ("ml", "llm-weights-300", older, {"phase": "Resolved", "resumeFrom": "s3://ckpt/llm/step-250.pt"}, {}),
        ("research", "bert-nonfinite-reduced-5", fresh, None, {}),
        ("zz", "evil-replay-9", forged, {"phase": "AwaitingApproval", "resumeFrom": f"ckpt.pt{ESCAPES}"},
         {"job": {**forged["job"], "name": f"evil{ESCAPES}"}}),
    ]:
        custom.create_namespaced_custom_object("sdcguard.dev", "v1", ns, "sdcincidents",
                                               _incident(ns, name, record, status, **spec))
    custom.create_cluster_custom_object("sdcguard.dev", "v1", "nodereplacements", {
        "apiVersion": "sdcguard.dev/v1", "kind": "NodeReplacement", "metadata": {"name": node},
        "spec": {"nodeName": node, "instanceId": "i-0123456789abcdef0", "clusterName": "c", "incidents": ["ml/llm-replay-4200"],
                 "decision": "Denied", "decidedBy": "alice@example.com"},
        "status": {"phase": "Denied", "seal": "written by the operator", "healthCheck": {"result": "Passed"},
                   "decision": {"decision": "Denied", "by": "alice@example.com", "groups": ["oncall"],
                                "reason": f"health check passed{ESCAPES}", "time": "2026-03-30T10:30:00Z"},
                   "timeline": [{"time": "2026-03-30T10:10:00Z", "event": "HealthCheckPassed", "message": "passed"}]}})
    record = {}
    for name, when, job_uid in (("ml/llm-weights-300", "2026-03-01T00:00:00Z", "u0"),
                                ("ml/llm-replay-4200", "2026-03-30T00:00:00Z", "u1"),
                                ("research/bert-replay-9", "2026-03-29T00:00:00Z", "u2")):
        for key in (history.gpu_key("i-0123456789abcdef0", GPU),) if "bert" not in name else \
                ("instance.i-0bbbbbbbbbbbbbbbb",):
            history.add(record, key, {"incident": name, "jobUid": job_uid, "time": when,
                                      "node": "hyperpod-i-0123456789abcdef0"})
    legacy = {f"gpu.{GPU}": json.dumps([{"incident": "evil/forged", "jobUid": "x", "time": "2026-03-30T00:00:00Z"}])}
    kubernetes.client.CoreV1Api(emulator.api_client()).create_namespaced_config_map("sdcguard", {
        "metadata": {"name": "sdcguard-hardware-history", "annotations": {history.WINDOW_ANNOTATION: str(3650 * 86400)}},
        "data": {**history.dump(record), **legacy}})  # an older operator's cluster-wide GPU key: not shown
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
     "REPEAT": f"gpu:{GPU}(2)", "TELEMETRY": "-", "PHASE": "AwaitingApproval"},
    # opened by an older operator: the window from the spec, no step or risk invented
    {"NAMESPACE": "ml", "NAME": "llm-weights-300", "JOB": "llm", "CHECK": "weights", "STEP": "300",
     "SUSPECTS": "hyperpod-i-0fedcba9876543210", "WINDOW": "300-300", "RESUME-FROM": "s3://ckpt/llm/step-250.pt",
     "SHA256": "-", "AT-RISK": "-", "DRILL": "-", "REPEAT": "?", "TELEMETRY": "-", "PHASE": "Resolved"},
    # not yet opened, no suspect rank, no verified checkpoint
    {"NAMESPACE": "research", "NAME": "bert-nonfinite-reduced-5", "JOB": "bert", "CHECK": "nonfinite-reduced",
     "STEP": "5", "SUSPECTS": "-", "WINDOW": "5-5", "RESUME-FROM": "none", "SHA256": "-", "AT-RISK": "-",
     "DRILL": "-", "REPEAT": "?", "TELEMETRY": "-", "PHASE": "-"},
    # issue 20, 8: escape sequences that would clear the screen and paint "APPROVED" are gone
    {"NAMESPACE": "zz", "NAME": "evil-replay-9", "JOB": "evilAPPROVED: healthy", "CHECK": "replay", "STEP": "9",
     "SUSPECTS": "-", "WINDOW": "9-9", "RESUME-FROM": "ckpt.ptAPPROVED: healthy", "SHA256": "-", "AT-RISK": "-",
     "DRILL": "-", "REPEAT": "?", "TELEMETRY": "-", "PHASE": "AwaitingApproval"},
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


def _plugin(kube, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([KUBECTL, "sdcguard", *args], env=_env(kube), capture_output=True, text=True, timeout=60)


def test_kubectl_sdcguard_report_is_the_incident_as_evidence(kube) -> None:
    done = _plugin(kube, "report", "llm-replay-4200")
    assert done.returncode == 0, done.stderr
    text = done.stdout
    for line in ("SDCIncident ml/llm-replay-4200   phase AwaitingApproval",
                 "check replay at step 4200", 'evidence pairs: [[0, 2]]',
                 "suspect rank 13: pod llm-worker-3 on node hyperpod-i-0123456789abcdef0 (instance i-0123456789abcdef0)",
                 "Inventory at the time (2026-03-30T10:00:01Z): 2 pods, 2 nodes, 2 instances",
                 "pod llm-worker-3 (worker 3, Running) on node hyperpod-i-0123456789abcdef0 instance i-0123456789abcdef0",
                 "suspect window 4101-4200; 200 steps at risk",
                 f"named by the alarm: s3://ckpt/llm/step-4000.pt step 4000 sha256 {SHA}",
                 "resumed from: not yet", "HealthCheckPassed  by sdcguard operator",
                 "Denied  by alice@example.com (groups: oncall)",
                 "NodeReplacement hyperpod-i-0ffffffffffffffff: not found (last phase the incident read: Failed)",
                 f"gpu {GPU} on node hyperpod-i-0123456789abcdef0: 2 incidents in 1 jobs",
                 "Telemetry: not recorded", "Cost: not recorded"):
        assert line in text, (line, text)
    assert "\x1b" not in text and "health check passedAPPROVED: healthy" in text  # the reason, cleaned
    as_json = _plugin(kube, "report", "llm-replay-4200", "-n", "ml", "-o", "json")
    assert as_json.returncode == 0, as_json.stderr
    built = json.loads(as_json.stdout)
    assert built["affected"]["ranks"] == [13] and built["checkpoints"]["named"]["sha256"] == SHA
    assert [d["what"] for d in built["decisions"]] == ["Opened", "HealthCheckPassed", "Denied"]
    assert built["inventory"]["instances"] == ["i-0123456789abcdef0", "i-0aaaaaaaaaaaaaaaa"]
    older = _plugin(kube, "report", "llm-weights-300")  # opened by an older operator: says what it lacks
    assert older.returncode == 0 and "Inventory at the time: not recorded" in older.stdout, older.stderr
    forged = _plugin(kube, "report", "evil-replay-9", "-n", "zz")
    assert forged.returncode == 0 and not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", forged.stdout)
    missing = _plugin(kube, "report", "nothing-here")
    assert missing.returncode == 1 and "sdcincident nothing-here: not found" in missing.stderr


def test_kubectl_sdcguard_history_ranks_the_operators_record_and_falls_back_to_the_incidents(kube) -> None:
    done = _plugin(kube, "history", "--operator-namespace", "sdcguard")
    assert done.returncode == 0, done.stderr
    header, *rows = [line.split() for line in done.stdout.splitlines()]
    assert header == kubectl_plugin.HISTORY_COLUMNS
    assert rows[0][:7] == ["gpu", GPU, "hyperpod-i-0123456789abcdef0", "2", "2", "2", "yes"]
    assert len(rows) == 2  # the legacy key left out
    assert rows[0][8] == "ml/llm-weights-300,ml/llm-replay-4200"
    assert rows[1][:7] == ["instance", "i-0bbbbbbbbbbbbbbbb", "hyperpod-i-0123456789abcdef0", "1", "1", "1", "-"]
    # a window of a week ending now: none of these alarms (March 2026) is recent, nothing repeats
    narrow = _plugin(kube, "history", "--operator-namespace", "sdcguard", "--window", "7d")
    assert narrow.returncode == 0, narrow.stderr
    assert [line.split()[3:7] for line in narrow.stdout.splitlines()[1:]] == [["0", "2", "2", "-"], ["0", "1", "1", "-"]]
    fallback = _plugin(kube, "history", "--operator-namespace", "nowhere")
    assert fallback.returncode == 0 and "ranking the incidents that still exist instead" in fallback.stderr
    # the incidents' own record: the drill (llm-replay-4200) left out, a node without instance by its name
    assert [line.split()[:5] for line in fallback.stdout.splitlines()[1:]] == [
        ["node", "hyperpod-i-0fedcba9876543210", "hyperpod-i-0fedcba9876543210", "1", "1"]]


def test_kubectl_sdcguard_replacements_shows_the_repeat_offenders_beside_the_decision(kube) -> None:
    done = _plugin(kube, "replacements")
    assert done.returncode == 0, done.stderr
    header, *rows = [line.split() for line in done.stdout.splitlines()]
    assert header == kubectl_plugin.REPLACEMENT_COLUMNS
    assert rows[0][:8] == ["hyperpod-i-0123456789abcdef0", "hyperpod-i-0123456789abcdef0", "i-0123456789abcdef0",
                           "Denied", "Passed", "Denied", f"gpu:{GPU}(2)", "ml/llm-replay-4200"]


def test_the_retention_deletes_only_settled_incidents_past_it(kube, monkeypatch) -> None:
    from prometheus_client import REGISTRY

    from sdcguard_operator import contain, metrics, retention
    from sdcguard_operator import kube as operator_kube
    from sdcguard_operator.settings import Settings

    monkeypatch.setattr(operator_kube, "_client", kube.api_client())
    custom = kubernetes.client.CustomObjectsApi(kube.api_client())
    core = kubernetes.client.CoreV1Api(kube.api_client())
    for name, state in (("old-resolved", "Resolved"), ("old-waiting", "AwaitingApproval"), ("old-holding", "Contained")):
        custom.create_namespaced_custom_object("sdcguard.dev", "v1", "retention", "sdcincidents", {
            "apiVersion": "sdcguard.dev/v1", "kind": "SDCIncident", "metadata": {"name": name, "namespace": "retention"},
            "spec": {"job": {"kind": "PyTorchJob", "name": "j", "namespace": "retention"}, "check": "replay", "step": 1,
                     "suspects": [], "alarmId": name},
            "status": {"phase": state, "timeline": [{"time": "2026-01-01T00:00:00Z", "event": state, "message": ""}]}})
    # old-holding: Contained, its node cordoned but not localized, so its storm-guard slot stays taken
    settings = Settings.from_env({"SDCGUARD_INCIDENT_RETENTION": "2d", "POD_NAMESPACE": "sdcguard-retention"})
    core.create_namespaced_config_map("sdcguard-retention", {
        "metadata": {"name": contain.LEDGER},
        "data": {"hyperpod-i-0cccccccccccccccc": contain.slot_value("retention/old-holding", "j")}})
    metrics.TELEMETRY_CORROBORATED.labels("retention/old-resolved").set(1)
    later = history.seconds("2026-01-01T00:00:00Z") + 3 * 86400
    bodies = {i["metadata"]["name"]: i for i in custom.list_namespaced_custom_object(
        "sdcguard.dev", "v1", "retention", "sdcincidents")["items"]}
    created = history.seconds(bodies["old-resolved"]["metadata"].get("creationTimestamp"))
    now = max(later, (created or 0) + 3 * 86400)  # past the retention from whichever is later
    assert not retention.collect(bodies["old-resolved"], Settings.from_env({"SDCGUARD_INCIDENT_RETENTION": "0"}), now)
    assert not retention.collect(bodies["old-waiting"], settings, now)
    assert not retention.collect(bodies["old-holding"], settings, now)  # would orphan the slot (and the node)
    assert retention.collect(bodies["old-resolved"], settings, now)
    assert REGISTRY.get_sample_value("sdcguard_incident_telemetry_corroborated",
                                     {"incident": "retention/old-resolved"}) is None  # its series went with it
    left = [i["metadata"]["name"] for i in custom.list_namespaced_custom_object(
        "sdcguard.dev", "v1", "retention", "sdcincidents")["items"]]
    assert sorted(left) == ["old-holding", "old-waiting"]
    core.patch_namespaced_config_map(contain.LEDGER, "sdcguard-retention",
                                     {"data": {"hyperpod-i-0cccccccccccccccc": None}})  # the slot given back
    assert retention.collect(bodies["old-holding"], settings, now)


def test_a_tenants_alarms_naming_another_teams_node_and_gpu_record_nothing_against_them(kube, monkeypatch) -> None:
    """Review finding 1 against the API: team-b's jobs (two of them, so that their own repeats would
    count) sign alarms naming team-a's node and the UUID of its GPU. Only nodes whose storm-guard
    slot the incident holds are recorded, GPUs under the machine they were reported from, instances
    from the node objects (no incident status is read): team-a's next genuine incident on that GPU
    is no repeat offender, and its node is not labelled."""
    from sdcguard.contract import names
    from sdcguard_operator import contain, offenders
    from sdcguard_operator import kube as operator_kube
    from sdcguard_operator.settings import Settings

    monkeypatch.setattr(operator_kube, "_client", kube.api_client())
    core = kubernetes.client.CoreV1Api(kube.api_client())
    victim, own = "hyperpod-i-0aaaa00000000000a", "hyperpod-i-0bbbb00000000000b"
    for node in (victim, own):
        core.create_node({"metadata": {"name": node}})
    settings = Settings.from_env({"POD_NAMESPACE": "sdcguard-offenders"})
    core.create_namespaced_config_map("sdcguard-offenders", {"metadata": {"name": contain.LEDGER}, "data": {}})

    def slot(node: str, ref: str | None) -> None:
        core.patch_namespaced_config_map(contain.LEDGER, "sdcguard-offenders", {"data": {
            node: contain.slot_value(ref, "j") if ref else None}})

    def spec(ns: str, uid: str, *nodes: str) -> dict:
        return {"job": {"name": "j", "namespace": ns}, "jobUid": uid, "check": "replay", "step": 1,
                "alarm": {"time": operator_kube.now(), "suspects": [
                    {"rank": i, "node": n, "gpu": {"index": 0, "uuid": GPU}} for i, n in enumerate(nodes)]}}
    found = []
    for i in (1, 2):
        ref = f"team-b/t{i}"
        slot(own, ref)  # cordoned for it: its own node; the victim's was refused (shared, or its pod not there)
        found = offenders.record(ref, spec("team-b", f"tenant-{i}", victim, own), settings)
        slot(own, None)
    # two of team-b's jobs on its own machine: that machine is a repeat offender, nothing else
    assert [(o["kind"], o["node"], o["jobs"]) for o in found] == [("instance", own, 2), ("gpu", own, 2)]
    stored = core.read_namespaced_config_map("sdcguard-hardware-history", "sdcguard-offenders").data
    assert sorted(stored) == [history.gpu_key("i-0bbbb00000000000b", GPU), "instance.i-0bbbb00000000000b"]
    slot(victim, "team-a/v1")
    assert offenders.record("team-a/v1", spec("team-a", "victim", victim), settings) == []
    assert names.REPEAT_OFFENDER_LABEL not in (core.read_node(victim).metadata.labels or {})
    slot(victim, None)


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
    assert cells[6:13] == ["31-40", "checkpoint-19.pt", "(step", "19)", "5a" * 6, "21", "-"]
    assert cells[13:16] == ["-", "-", "Resolved"]  # no repeat offender, no telemetry (no Prometheus here)
    assert ours["llm-weights-7"][8:11] == ["-", "-", "yes"]
    history = world.kubectl("sdcguard", "history", "--operator-namespace", "default")  # the operator's namespace
    assert history.returncode == 0, history.stderr
    lines = [line.split() for line in history.stdout.splitlines()]
    assert lines[0] == kubectl_plugin.HISTORY_COLUMNS
    assert [row[:7] + row[8:] for row in lines[1:] if row[1] == ids[1]] == [
        ["instance", ids[1], nodes[1], "1", "1", "1", "-", f"{ns}/llm-replay-40"]], history.stdout
    assert not any(row[1] == ids[2] for row in lines[1:])  # a drill says nothing about the hardware
    evidence = world.kubectl("sdcguard", "report", "llm-replay-40", "-n", ns, "-o", "json")
    assert evidence.returncode == 0, evidence.stderr
    built = json.loads(evidence.stdout)
    assert [p["pod"] for p in built["inventory"]["pods"]] == pods
    assert built["inventory"]["instances"] == sorted(ids)
    assert built["affected"]["suspects"][0]["instanceId"] == ids[1]
    decided = [(d["what"], d["who"]) for d in built["decisions"]]
    for step in (("Opened", "sdcguard operator"), ("JobSuspended", "sdcguard operator"),
                 ("NodeCordoned", "sdcguard operator"), ("HealthCheckPassed", "sdcguard operator"),
                 ("Approved", "tester"), ("ReplaceRequested", "sdcguard operator"), ("Replaced", "sdcguard operator"),
                 ("Resolved", "sdcguard operator")):
        assert step in decided, (step, decided)
    assert decided.index(("Approved", "tester")) < decided.index(("Replaced", "sdcguard operator"))
    text = world.kubectl("sdcguard", "report", "llm-replay-40", "-n", ns)
    assert text.returncode == 0 and "Inventory at the time" in text.stdout and "Approved  by tester" in text.stdout
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


@pytest.mark.operator
def test_a_repeat_offender_is_flagged_and_the_resume_reaches_the_incident(world, tmp_path):
    """Two jobs' alarms name one GPU of one instance, the second after the first's replacement was
    denied and the node given back: the second incident flags both as repeat offenders (status,
    condition, node label, ``incidents``, ``history``). Then the first job's run
    resumes: its resume record goes through the real publisher, signed with the job's key, and the
    operator records it on that job's incident only; a record for that job signed with the other
    job's key, or posted from another namespace, is rejected."""
    from prometheus_client import CollectorRegistry

    from sdcguard.contract import events, names, resume, spool
    from sdcguard.sidecar.metrics import PublisherMetrics
    from sdcguard.sidecar.publisher import Identity, KubeEventSink, Publisher
    from sdcguard.sidecar.signing import AlarmKey

    ns, gpu = "offender", "GPU-0a1b2c3d-4e5f-6789-abcd-ef0123456789"
    ids, nodes, pods = start_training(world, ns)
    bert = world.training(ns, "bert", nodes)  # another job on the same nodes
    first = make_alarm(ns, "llm", suspects=[(1, pods[1], nodes[1])], reporter=(0, pods[0], nodes[0]), window=(31, 40),
                       last_good_checkpoint_step=19, steps_at_risk=21, last_good_checkpoint_sha256="5a" * 32)
    first["suspects"][0]["gpu"] = {"index": 3, "uuid": gpu}
    world.alarm_event(ns, first)
    opened = world.wait(lambda: "repeatOffenders" in (world.incident(ns, "llm-replay-40").get("status") or {}),
                        what="the first incident judged")
    assert opened and world.incident(ns, "llm-replay-40")["status"]["repeatOffenders"] == []
    # denied (the health check passed): the node is given back, uncordoned, its storm-guard slot free,
    # and bert goes on running there. Only a node sdcguard cordons for an incident counts for it.
    world.wait(lambda: phase(world, nodes[1]) == "PendingApproval", what="PendingApproval")
    assert world.kubectl("sdcguard", "deny", nodes[1], "--reason", "health check passed").returncode == 0
    world.wait(lambda: world.node_state(nodes[1]) == (False, None), what="the node given back")
    second = make_alarm(ns, "bert", step=12, suspects=[(4, bert[1], nodes[1])], reporter=(0, bert[0], nodes[0]))
    second["suspects"][0]["gpu"] = {"index": 3, "uuid": gpu}
    world.alarm_event(ns, second)
    found = world.wait(lambda: (world.incident(ns, "bert-replay-12").get("status") or {}).get("repeatOffenders"),
                       what="the repeat offenders of the second incident")
    behind = [f"{ns}/llm-replay-40", f"{ns}/bert-replay-12"]
    assert [(o["kind"], o["id"], o["node"], o["incidents"], o["jobs"]) for o in found] == [
        ("instance", ids[1], nodes[1], behind, 2), ("gpu", gpu, nodes[1], behind, 2)]
    assert condition(world.incident(ns, "bert-replay-12"), "RepeatOffender")["status"] == "True"
    node = world.core.read_node(nodes[1]).metadata
    assert node.labels[names.REPEAT_OFFENDER_LABEL] == "true"
    assert all(ref in node.annotations[names.REPEAT_OFFENDER_ANNOTATION] for ref in behind)
    listing = world.kubectl("sdcguard", "incidents")
    assert listing.returncode == 0, listing.stderr
    [row] = [line for line in listing.stdout.splitlines() if line.startswith(f"{ns} ") and " bert-replay-12 " in line]
    assert f"instance:{ids[1]}(2),gpu:{gpu}(2)" in row
    ranked = world.kubectl("sdcguard", "history", "--operator-namespace", "default")
    assert ranked.returncode == 0, ranked.stderr
    rows = {tuple(line.split()[:2]): line.split() for line in ranked.stdout.splitlines()[1:]}
    assert rows[("gpu", gpu)][3:7] == ["2", "2", "2", "yes"] and rows[("gpu", gpu)][8] == ",".join(behind)
    assert rows[("instance", ids[1])][3:7] == ["2", "2", "2", "yes"]

    # the resume, through the real publisher (the sidecar's code) as the pod's service account
    key_file = tmp_path / "key"
    key_file.write_bytes(world.alarm_key(ns, "llm"))
    spool_dir = tmp_path / "spool"
    job = {"kind": "PyTorchJob", "name": "llm", "namespace": ns, "uid": world.job_uid(ns, "llm")}
    record = resume.make_resume(resume_id="run9-resume-step19", job=job, path="checkpoint-19.pt", step=19,
                                sha256="5a" * 32, reporter={"rank": 0, "pod": pods[0], "node": nodes[0]})
    spool.write_resume(spool_dir, record)
    sink = KubeEventSink(str(world.user("sidecar-offender", f"system:serviceaccount:{ns}:default")))
    publisher = Publisher(spool_dir, sink, Identity(ns, pods[0], nodes[0]), PublisherMetrics(CollectorRegistry()),
                          AlarmKey(key_file))
    assert publisher.run_once() and spool.list_records(spool_dir) == []
    resumed = world.wait(lambda: (world.incident(ns, "llm-replay-40").get("status") or {}).get("resumed"),
                         what="the resume on the incident")
    assert {k: resumed[k] for k in ("path", "step", "sha256", "pod", "matchesNamedCheckpoint", "beforeSuspectWindow")} \
        == {"path": "checkpoint-19.pt", "step": 19, "sha256": "5a" * 32, "pod": pods[0],
            "matchesNamedCheckpoint": True, "beforeSuspectWindow": True}
    event = events.resume_event_name(record["id"])
    assert world.event_annotation(ns, event) == "resumed:llm-replay-40"
    assert "resumed" not in (world.incident(ns, "bert-replay-12").get("status") or {})  # another job's incident
    report = world.kubectl("sdcguard", "report", "llm-replay-40", "-n", ns)
    assert "resumed from: checkpoint-19.pt step 19" in report.stdout and "(the checkpoint named)" in report.stdout

    # the tenant boundary: a resume for llm signed with bert's key, and one posted from another namespace
    forged = resume.make_resume(resume_id="forged-1", job=job, path="evil.pt", step=39, sha256=None,
                                reporter={"rank": 0, "pod": bert[0], "node": nodes[0]})
    for where, key in ((ns, world.alarm_key(ns, "bert")), ("elsewhere", world.alarm_key(ns, "llm"))):
        body = events.build_resume_event(forged, key=key)
        body["metadata"]["namespace"] = where
        body["metadata"]["name"] += f"-{where}"
        world.core.create_namespaced_event(where, body)
        world.wait(lambda: world.event_annotation(where, body["metadata"]["name"]), what="the forged resume's outcome")
        assert world.event_annotation(where, body["metadata"]["name"]) == \
            ("rejected:BadSignature" if where == ns else "rejected:NamespaceMismatch")
    assert world.incident(ns, "llm-replay-40")["status"]["resumed"]["path"] == "checkpoint-19.pt"
