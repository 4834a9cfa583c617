"""The incident as evidence and the repeat-offender record, as pure functions (no process, no API):
operator/report.py, operator/history.py, the resume record (contract/resume.py) and what the
operator makes of it (resume_intake.resumed_status), and the retention rule (retention.expired).

The same functions against the API emulator, the real kubectl and the real operator:
tests/test_kubectl_plugin.py."""
from __future__ import annotations

import json

import pytest

from sdcguard.contract import events, names, resume, spool
from sdcguard_operator import history, incident, report, resume_intake, retention
from sdcguard_operator.settings import Settings

SHA = "ab" * 32
GPU = "GPU-8f3c2a10-1111-2222-3333-444455556666"
DAY = 86400.0
NOW = history.seconds("2026-03-31T00:00:00Z")


def _incident(name="llm-replay-4200", *, time="2026-03-30T10:00:00Z", node="hyperpod-i-0123456789abcdef0",
              gpu=GPU, job_uid="uid-1", status=None, drill=False, ns="ml"):
    suspect = {"rank": 13, "pod": "llm-worker-3", "node": node, "pod_uid": "p3",
               **({"gpu": {"index": 5, "uuid": gpu}} if gpu else {})}
    reporter = {"rank": 0, "pod": "llm-worker-0", "node": "hyperpod-i-0aaaaaaaaaaaaaaaa", "pod_uid": "p0",
                "gpu": {"index": 0, "uuid": None}}
    alarm = {"id": "a1", "time": time, "check": "replay", "step": 4200, "suspect_ranks": [13], "suspects": [suspect],
             "reporter": reporter, "evidence": {"pairs": [[13, 14]], "digests": {"13": "dead", "14": "beef"}},
             "steps_at_risk": 200, "last_audited_step": 4100, "last_good_checkpoint_kept_from": None}
    return {"metadata": {"namespace": ns, "name": name, "creationTimestamp": time},
            "spec": {"job": {"kind": "PyTorchJob", "name": "llm", "namespace": ns}, "jobUid": job_uid,
                     "check": "replay", "step": 4200, "ambiguous": False, "suspects": [suspect], "reporter": reporter,
                     "alarmId": "a1", "alarm": alarm, "alarmSignature": "v1=" + "0" * 64, "drill": drill,
                     "lastGoodCheckpoint": "s3://ckpt/step-4000.pt", "lastGoodCheckpointStep": 4000,
                     "lastGoodCheckpointSha256": SHA, "lastVerifiedStep": 4100,
                     "suspectWindow": {"firstStep": 4101, "lastStep": 4200}},
            "status": status if status is not None else {}}


INVENTORY = {"recordedAt": "2026-03-30T10:00:01Z",
             "pods": [{"pod": "llm-worker-0", "uid": "p0", "node": "hyperpod-i-0aaaaaaaaaaaaaaaa", "phase": "Running",
                       "replicaType": "master", "replicaIndex": "0"},
                      {"pod": "llm-worker-3", "uid": "p3", "node": "hyperpod-i-0123456789abcdef0", "phase": "Running",
                       "replicaType": "worker", "replicaIndex": "3"}],
             "nodes": {"hyperpod-i-0aaaaaaaaaaaaaaaa": {"instanceId": "i-0aaaaaaaaaaaaaaaa", "cluster": "c"},
                       "hyperpod-i-0123456789abcdef0": {"instanceId": "i-0123456789abcdef0", "cluster": "c"}}}


# -- the hardware record -------------------------------------------------------------------------

def test_durations_read_like_the_chart_values() -> None:
    assert [history.parse_duration(t) for t in ("30d", "12h", "90m", "45s", "7", "1.5d")] == \
        [30 * DAY, 12 * 3600, 90 * 60, 45, 7, 1.5 * DAY]
    for bad in ("", "30x", "-1d", "d"):
        with pytest.raises(ValueError):
            history.parse_duration(bad)
    assert history.show_duration(30 * DAY) == "30d" and history.show_duration(90) == "90s"


I0, I1 = "i-0123456789abcdef0", "i-0bbbbbbbbbbbbbbbb"
N0, N1 = f"hyperpod-{I0}", f"hyperpod-{I1}"


def test_an_incident_names_its_instance_and_gpu_and_a_node_without_instance_by_name() -> None:
    body = _incident()
    # the operator passes the nodes it cordoned for the incident, with instance ids from the node objects
    assert history.hardware(body["spec"], {N0: I0}) == [(f"instance.{I0}", N0), (f"gpu.{I0}.{GPU}", N0)]
    assert history.hardware(body["spec"], {N1: I1}) == []  # a suspect node not held for it records nothing
    on_cpu = _incident(node="ip-10-0-0-7.ec2.internal", gpu=None)  # no instance, no GPU: the node's name
    assert history.hardware(on_cpu["spec"], {"ip-10-0-0-7.ec2.internal": None}) == [
        ("node.ip-10-0-0-7.ec2.internal", "ip-10-0-0-7.ec2.internal")]
    off_aws = _incident(node="gpu-7")  # a GPU off AWS: under its node's name
    assert history.hardware(off_aws["spec"], {"gpu-7": None}) == [("node.gpu-7", "gpu-7"), (f"gpu.gpu-7.{GPU}", "gpu-7")]
    # the plugin's fallback view reads the incident's status: inventory, else localization's record
    assert history.claimed(body["spec"], {"inventory": INVENTORY}) == {N0: I0}
    assert history.instance_of("n", {"nodes": {"n": {"instanceId": "i-0fedcba9876543210"}}}) == "i-0fedcba9876543210"


def _record(*incidents):
    record: dict = {}
    for body in incidents:
        meta = body["metadata"]
        for key, node in history.hardware(body["spec"], history.claimed(body["spec"], body["status"])):
            history.add(record, key, history.entry(f"{meta['namespace']}/{meta['name']}", body["spec"], node))
    return record


def test_more_than_one_incident_of_two_jobs_within_the_window_makes_a_repeat_offender() -> None:
    first = _incident("a", time="2026-03-01T00:00:00Z", status={"inventory": INVENTORY})
    second = _incident("b", time="2026-03-30T00:00:00Z", job_uid="uid-2", status={"inventory": INVENTORY})
    record = _record(first, second)
    assert not history.add(record, f"gpu.{I0}.{GPU}", history.entry("ml/b", second["spec"], "x"))  # a retry adds nothing
    keys = history.hardware(second["spec"], {N0: I0})
    found = history.offenders(record, keys, 31 * DAY, NOW)
    assert [(o["kind"], o["id"], o["node"], o["incidents"], o["jobs"]) for o in found] == [
        ("instance", I0, N0, ["ml/a", "ml/b"], 2), ("gpu", GPU, N0, ["ml/a", "ml/b"], 2)]
    assert history.offenders(record, keys, 10 * DAY, NOW) == []  # the first one is older than the window
    assert history.offenders(_record(second), keys, 31 * DAY, NOW) == []  # one incident is no repeat
    # one job's own alarms, however many, never make a repeat offender (the label outlives the job)
    again = _incident("c", time="2026-03-29T00:00:00Z", job_uid="uid-2", status={"inventory": INVENTORY})
    assert history.offenders(_record(again, second), keys, 31 * DAY, NOW) == []


def test_a_tenants_alarms_naming_another_teams_gpu_or_node_do_not_count_against_it() -> None:
    """Review finding 1: GPUs were keyed by UUID cluster-wide, from the tenant's own signed alarm.
    Now a UUID counts only under the machine it was reported from, and the operator records only
    the nodes it cordoned for the incident (history.hardware gets those alone)."""
    victim = _incident("v", time="2026-03-30T00:00:00Z", ns="team-a", job_uid="victim")
    tenant = [_incident(f"t{i}", time=f"2026-03-2{i}T00:00:00Z", ns="team-b", job_uid=f"tenant-{i}", node=N1)
              for i in range(3)]  # the tenant's own node, naming the victim's GPU UUID
    record: dict = {}
    for body, held in [*((t, {N1: I1}) for t in tenant), (victim, {N0: I0})]:
        for key, node in history.hardware(body["spec"], held):
            history.add(record, key, history.entry(f"{body['metadata']['namespace']}/{body['metadata']['name']}",
                                                   body["spec"], node))
    # the tenant's alarms also name the victim's node: not cordoned for them, so not passed, not recorded
    named_victim = _incident("t9", time="2026-03-29T00:00:00Z", ns="team-b", job_uid="tenant-9")
    assert history.hardware(named_victim["spec"], {}) == []
    assert history.offenders(record, history.hardware(victim["spec"], {N0: I0}), 31 * DAY, NOW) == []
    assert sorted(record) == [f"gpu.{I0}.{GPU}", f"gpu.{I1}.{GPU}", f"instance.{I0}", f"instance.{I1}"]
    assert [o["node"] for o in history.offenders(record, history.hardware(tenant[2]["spec"], {N1: I1}), 31 * DAY,
                                                 NOW)] == [N1, N1]  # the tenant's own machine, its own jobs


def test_the_record_round_trips_prunes_old_entries_and_stays_under_the_configmap_limit() -> None:
    record = _record(_incident("a", time="2026-01-01T00:00:00Z"), _incident("b", time="2026-03-30T00:00:00Z"))
    data = history.dump(record)
    assert history.parse({**data, "junk": "x", "gpu.i-1.bad": "{not json"}) == record
    # an older operator's cluster-wide GPU key (any tenant could add to it) is dropped, then rewritten away
    assert history.parse({**data, f"gpu.{GPU}": data[f"gpu.{N0}.{GPU}"]}) == record
    pruned = history.prune(history.parse(data), NOW - 30 * DAY)
    assert {e["incident"] for entries in pruned.values() for e in entries} == {"ml/b"}
    big = {f"gpu.{I0}.GPU-{i}": [{"incident": f"ml/i{i}", "time": f"2026-03-{1 + i % 28:02d}T00:00:00Z", "pad": "x" * 2000}]
           for i in range(600)}
    cut = history.prune(big, 0)
    assert sum(len(k) + len(v) for k, v in history.dump(cut).items()) <= history.MAX_BYTES < \
        sum(len(k) + len(v) for k, v in history.dump(big).items())
    assert max(history.seconds(e["time"]) for v in big.values() for e in v) == \
        max(history.seconds(e["time"]) for v in cut.values() for e in v)  # the oldest went first


def test_history_ranks_repeat_offenders_first_and_leaves_drills_out() -> None:
    incidents = [_incident("a", time="2026-03-20T00:00:00Z", status={"inventory": INVENTORY}),
                 _incident("b", time="2026-03-29T00:00:00Z", job_uid="uid-2", status={"inventory": INVENTORY}),
                 _incident("c", time="2026-03-30T00:00:00Z", node=N1, gpu="GPU-other"),
                 _incident("d", time="2026-03-30T00:00:00Z", node=N1, gpu="GPU-other"),  # c's job again
                 _incident("drill", time="2026-03-30T00:00:00Z", node=N1, drill=True)]
    rows = history.ranking(history.of_incidents(incidents), 30 * DAY, NOW)
    assert [(r["kind"], r["id"], r["node"], r["recent"], r["jobs"], r["repeat"], r["incidents"]) for r in rows] == [
        ("instance", I0, N0, 2, 2, True, ["ml/a", "ml/b"]), ("gpu", GPU, N0, 2, 2, True, ["ml/a", "ml/b"]),
        # one job's two alarms on a machine: counted, never a repeat offender
        ("gpu", "GPU-other", N1, 2, 1, False, ["ml/c", "ml/d"]), ("node", N1, N1, 2, 1, False, ["ml/c", "ml/d"])]


def test_the_hardware_is_judged_by_its_own_timer_never_by_the_containment_path() -> None:
    """Review finding 8: the containment timer's filter had been widened to every incident without
    ``repeatOffenders``, so after an upgrade every historical incident (Resolved too) was contained
    again. Now a timer of its own judges only the contained ones (and checks the seal first)."""
    resolved = {"phase": "Resolved", "conditions": []}
    assert not incident.needs_work(resolved) and not incident.needs_history(resolved)
    for phase in ("AwaitingApproval", "Contained"):
        assert not incident.needs_work({"phase": phase}) and incident.needs_history({"phase": phase})
        assert not incident.needs_history({"phase": phase, "repeatOffenders": []})
        assert not incident.needs_history({"phase": phase, "conditions": [{"type": "Verified", "status": "False"}]})
    assert incident.needs_work({"phase": "Containing"}) and not incident.needs_history({"phase": "Containing"})
    import kopf

    from sdcguard_operator import main
    registry = kopf.OperatorRegistry()
    main.register(registry, Settings(), webhooks_too=False)
    timers = {h.id: h for h in registry._spawning.get_all_handlers()}
    assert timers["incident_history"].when is incident.needs_history and timers["incident_tick"].when is incident.needs_work


# -- the report ----------------------------------------------------------------------------------

def _replacement(name, *, sealed=True, decision="Approved"):
    return {"metadata": {"name": name},
            "spec": {"nodeName": "hyperpod-i-0123456789abcdef0", "instanceId": "i-0123456789abcdef0",
                     "decidedBy": "alice@example.com"},
            "status": {"phase": "Replaced", "healthCheck": {"result": "Failed", "message": "stress failed"},
                       "seal": "s" if sealed else None,
                       "decision": {"decision": decision, "by": "alice@example.com",
                                    "groups": ["oncall", "system:authenticated"], "reason": "GPU 5 failed stress",
                                    "time": "2026-03-30T10:20:00Z"},
                       "timeline": [{"time": "2026-03-30T10:05:00Z", "event": "HealthCheckRequested", "message": "m"},
                                    {"time": "2026-03-30T10:15:00Z", "event": "HealthCheckFailed",
                                     "message": "deep health check failed"},
                                    {"time": "2026-03-30T10:20:00Z", "event": decision, "message": "x"},
                                    {"time": "2026-03-30T10:21:00Z", "event": "ReplaceRequested", "message": "ok"},
                                    {"time": "2026-03-30T10:40:00Z", "event": "Replaced", "message": "fresh"}]}}


FULL_STATUS = {
    "phase": "Resolved", "resumeFrom": "s3://ckpt/step-4000.pt", "resumeFromStep": 4000, "resumeFromSha256": SHA,
    "suspectWindow": {"firstStep": 4101, "lastStep": 4200}, "stepsAtRisk": 200, "inventory": INVENTORY,
    "replacements": {"hyperpod-i-0123456789abcdef0": "Replaced", "gone": "Failed"},
    "repeatOffenders": [{"kind": "gpu", "id": GPU, "node": "hyperpod-i-0123456789abcdef0", "incidents": ["ml/a", "ml/b"],
                         "jobs": 2}],
    "resumed": {"time": "2026-03-30T11:00:00Z", "path": "s3://ckpt/step-4000.pt", "step": 4000, "sha256": SHA,
                "pod": "llm-worker-0", "matchesNamedCheckpoint": True, "beforeSuspectWindow": True},
    "telemetry": {"verdict": "Corroborates", "message": "DCGM shows hardware errors", "findings": ["XID 79"]},
    "cost": {"stepsAtRisk": 200, "rollbackGpuHours": 4.5},
    "timeline": [{"time": "2026-03-30T10:00:02Z", "event": "Opened", "message": "replay alarm at step 4200"},
                 {"time": "2026-03-30T10:00:03Z", "event": "NodeCordoned", "message": "cordoned"},
                 {"time": "2026-03-30T10:41:00Z", "event": "Resolved", "message": "done"},
                 {"time": "2026-03-30T11:00:01Z", "event": "Resumed", "message": "resumed"}]}


def test_the_report_holds_every_section_the_release_guidance_asks_for() -> None:
    built = report.build(_incident(status=FULL_STATUS), [_replacement("hyperpod-i-0123456789abcdef0")])
    assert built["signature"] == {"check": "replay", "step": 4200, "ambiguous": False, "alarmId": "a1",
                                  "time": "2026-03-30T10:00:00Z", "signed": True, "drill": False,
                                  "evidence": {"pairs": [[13, 14]], "digests": {"13": "dead", "14": "beef"}}}
    assert built["affected"]["ranks"] == [13] and built["affected"]["instances"] == ["i-0123456789abcdef0"]
    assert built["affected"]["suspects"][0]["gpu"] == {"index": 5, "uuid": GPU}
    assert built["affected"]["reporter"]["instanceId"] == "i-0aaaaaaaaaaaaaaaa"
    assert [p["pod"] for p in built["inventory"]["pods"]] == ["llm-worker-0", "llm-worker-3"]
    assert built["inventory"]["instances"] == ["i-0123456789abcdef0", "i-0aaaaaaaaaaaaaaaa"]
    assert built["steps"]["suspectWindow"] == {"firstStep": 4101, "lastStep": 4200}
    assert built["steps"]["stepsAtRisk"] == 200 and built["steps"]["lastAuditedStep"] == 4100
    assert built["checkpoints"]["named"] == {"path": "s3://ckpt/step-4000.pt", "step": 4000, "sha256": SHA,
                                             "keptFrom": None}
    assert built["checkpoints"]["resumed"]["matchesNamedCheckpoint"] is True
    whats = [(d["what"], d["who"]) for d in built["decisions"]]
    assert whats == [("Opened", "sdcguard operator"), ("NodeCordoned", "sdcguard operator"),
                     ("HealthCheckRequested", "sdcguard operator"), ("HealthCheckFailed", "sdcguard operator"),
                     ("Approved", "alice@example.com (groups: oncall)"), ("ReplaceRequested", "sdcguard operator"),
                     ("Replaced", "sdcguard operator"), ("Resolved", "sdcguard operator"),
                     ("Resumed", "the job (its resume record, signed by its sidecar)")]
    assert built["decisions"][4]["detail"] == "GPU 5 failed stress" and built["decisions"][4]["time"] == "2026-03-30T10:20:00Z"
    assert built["telemetry"]["verdict"] == "Corroborates" and built["cost"]["rollbackGpuHours"] == 4.5
    json.dumps(built)  # what -o json prints
    text = report.render(built)
    for line in ("Fault signature", "check replay at step 4200", 'evidence digests: {"13": "dead", "14": "beef"}',
                 f"suspect rank 13: pod llm-worker-3 on node hyperpod-i-0123456789abcdef0 (instance i-0123456789abcdef0, GPU 5 {GPU})",
                 "Inventory at the time (2026-03-30T10:00:01Z): 2 pods, 2 nodes, 2 instances",
                 "suspect window 4101-4200; 200 steps at risk",
                 f"named by the alarm: s3://ckpt/step-4000.pt step 4000 sha256 {SHA}",
                 "(the checkpoint named)", "Approved  by alice@example.com (groups: oncall)",
                 "NodeReplacement gone: not found (last phase the incident read: Failed)",
                 f"gpu {GPU} on node hyperpod-i-0123456789abcdef0: 2 incidents in 2 jobs: ml/a, ml/b",
                 "Telemetry: corroborates (XID 79): DCGM shows hardware errors", "rollbackGpuHours 4.5"):
        assert line in text, (line, text)


def test_an_older_incident_reports_what_is_missing_and_an_unsealed_replacement_shows_nothing_of_its_status() -> None:
    built = report.build(_incident(status={"phase": "AwaitingApproval",
                                           "replacements": {"hyperpod-i-0123456789abcdef0": "PendingApproval"}}),
                         [_replacement("hyperpod-i-0123456789abcdef0", sealed=False)],
                         trusted=lambda r: bool((r.get("status") or {}).get("seal")))
    assert built["inventory"] is None and built["checkpoints"]["resumed"] is None
    assert [d["who"] for d in built["decisions"]] == [report.UNSEALED]
    assert built["replacements"][0]["phase"] == report.UNSEALED
    text = report.render(built)
    assert "Inventory at the time: not recorded" in text and "resumed from: not yet" in text
    assert "Repeat offenders: not recorded" in text and "Telemetry: not recorded" in text and "Cost: not recorded" in text
    assert "alice" not in text  # an unsealed status's decision is not shown


def test_no_value_can_start_a_line_of_its_own() -> None:
    body = _incident(status={**FULL_STATUS, "resumeFrom": "ckpt.pt\nAPPROVED by admin"})
    text = report.render(report.build(body))
    assert not any(line.startswith("APPROVED") for line in text.splitlines())
    assert "ckpt.pt APPROVED by admin" in text


# -- the resume record ---------------------------------------------------------------------------

def _resume_record(path="s3://ckpt/step-4000.pt", step=4000, sha=SHA):
    return resume.make_resume(resume_id="run1-resume-step4000", job={"kind": "PyTorchJob", "name": "llm",
                                                                    "namespace": "ml", "uid": "uid-1"},
                              reporter={"rank": 0, "pod": "llm-worker-0", "node": "n0", "pod_uid": "p0", "gpu": None},
                              path=path, step=step, sha256=sha)


def test_the_resume_record_is_validated_spooled_and_signed_like_an_alarm(tmp_path) -> None:
    record = _resume_record()
    assert resume.loads(resume.dumps(record)) == record
    for broken in ({**record, "schema": "sdcguard.dev/resume/v9"}, {**record, "checkpoint": {"path": "", "step": 1}},
                   {**record, "checkpoint": {**record["checkpoint"], "sha256": "XYZ"}}, {**record, "job": None}):
        with pytest.raises(resume.ResumeError):
            resume.validate(broken)
    path = spool.write_resume(tmp_path, record)
    spool.write_json_atomic(tmp_path / "x.alarm.json", "{}")
    assert {p.name for p in spool.list_records(tmp_path)} == {path.name, "x.alarm.json"}
    assert spool.list_alarms(tmp_path) == [tmp_path / "x.alarm.json"]  # what the library waits on is unchanged
    key = b"k" * 32
    event = events.build_resume_event(record, key=key)
    text = event["metadata"]["annotations"][names.RESUME_ANNOTATION]
    assert event["reason"] == names.EVENT_REASON and event["type"] == "Normal"
    assert events.signature_matches(key, text, event["metadata"]["annotations"][names.ALARM_SIGNATURE_ANNOTATION])
    assert names.ALARM_ANNOTATION not in event["metadata"]["annotations"]
    assert event["metadata"]["name"] == events.build_resume_event(record)["metadata"]["name"]  # a resend collides
    assert resume_intake.is_resume(event) and not resume_intake.is_resume(
        {"metadata": {"annotations": {names.ALARM_ANNOTATION: "{}", names.RESUME_ANNOTATION: text}}})


def test_the_operator_says_whether_the_run_resumed_where_the_alarm_said() -> None:
    plan = {"resumeFrom": "s3://ckpt/step-4000.pt", "resumeFromStep": 4000, "resumeFromSha256": SHA,
            "suspectWindow": {"firstStep": 4101, "lastStep": 4200}}
    same = resume_intake.resumed_status(_resume_record(), plan, "ev")
    assert same["matchesNamedCheckpoint"] and same["beforeSuspectWindow"] and same["sha256"] == SHA
    other = resume_intake.resumed_status(_resume_record("s3://ckpt/step-4150.pt", 4150, "cd" * 32), plan, "ev")
    assert not other["matchesNamedCheckpoint"] and other["beforeSuspectWindow"] is False
    overwritten = resume_intake.resumed_status(_resume_record(sha="cd" * 32), plan, "ev")  # same path, other bytes
    assert not overwritten["matchesNamedCheckpoint"]


# -- retention -----------------------------------------------------------------------------------

def test_only_a_settled_incident_past_its_retention_expires() -> None:
    old = {"metadata": {"creationTimestamp": "2026-01-01T00:00:00Z"},
           "status": {"phase": "Resolved", "timeline": [{"time": "2026-01-02T00:00:00Z", "event": "Resolved"}]}}
    replaced = {"status": {"phase": "Replaced", "timeline": [{"time": "2026-01-02T00:00:00Z", "event": "Replaced"}]}}
    now = history.seconds("2026-01-12T00:00:00Z")
    # from its last change the operator vouches for: a sealed replacement's timeline, else its creation
    assert retention.expired(old, 9 * DAY, now, replacements=[replaced])
    assert not retention.expired(old, 10.5 * DAY, now, replacements=[replaced])
    assert retention.expired(old, 10.5 * DAY, now)  # its own timeline (unsealed status) does not count
    assert not retention.expired({**old, "status": {**old["status"], "phase": "AwaitingApproval"}}, DAY, now)
    refused = {**old, "status": {"conditions": [{"type": "Verified", "status": "False"}]}}
    assert retention.expired(refused, DAY, now)
    assert not retention.expired(old, 0, now)  # 0 keeps them forever


def test_an_incident_that_still_holds_a_node_or_an_open_replacement_is_kept() -> None:
    """Review finding 7: Contained also covers a node cordoned but not localized, which keeps its
    storm-guard slot with no replacement; deleting the incident orphaned the slot and condition.
    And a status write could date the timeline back or call the incident Resolved."""
    contained = {"metadata": {"creationTimestamp": "2026-01-01T00:00:00Z"}, "status": {"phase": "Contained"}}
    now = history.seconds("2026-06-01T00:00:00Z")
    assert retention.expired(contained, DAY, now) and not retention.expired(contained, DAY, now, holds_slot=True)
    pending = {"status": {"phase": "PendingApproval", "timeline": [{"time": "2026-01-01T00:00:00Z"}]}}
    forged = {**contained, "status": {"phase": "Resolved"}}  # a status write; the replacement is still open
    assert not retention.expired(forged, DAY, now, replacements=[pending])
    dated_back = {"metadata": {"creationTimestamp": "2026-05-31T00:00:00Z"},
                  "status": {"phase": "Resolved", "timeline": [{"time": "2020-01-01T00:00:00Z"}]}}
    assert not retention.expired(dated_back, 2 * DAY, now)


def test_the_settings_take_durations_and_say_which_one_is_wrong() -> None:
    settings = Settings.from_env({"SDCGUARD_INCIDENT_RETENTION": "14d", "SDCGUARD_REPEAT_OFFENDER_WINDOW": "12h"})
    assert settings.incident_retention_seconds == 14 * DAY and settings.repeat_offender_window_seconds == 12 * 3600
    assert Settings.from_env({}).incident_retention_seconds == 90 * DAY
    with pytest.raises(ValueError, match="SDCGUARD_REPEAT_OFFENDER_WINDOW"):
        Settings.from_env({"SDCGUARD_REPEAT_OFFENDER_WINDOW": "soon"})
    with pytest.raises(ValueError, match="SDCGUARD_REPEAT_OFFENDER_WINDOW"):
        Settings.from_env({"SDCGUARD_REPEAT_OFFENDER_WINDOW": "0"})
