"""The alarm schema and the spool: records validate, round-trip, and land atomically."""
import json
import math
import re

import pytest

from sdcguard.contract import alarm

from sdcguard.contract import spool

IDENTITIES = {r: {"rank": r, "pod": f"job-worker-{r}", "node": f"hyperpod-i-0abc{r}"} for r in range(4)}


def _record(**overrides):
    args = dict(
        alarm_id="run1-1-weights-step7", job={"kind": "PyTorchJob", "name": "llm", "namespace": "ml"},
        check=alarm.CHECK_WEIGHTS, step=7, suspect_ranks=[2], identities=IDENTITIES, ambiguous=False,
        reporter_rank=0, evidence={"norm": float("nan"), "big": float("inf")}, last_verified_step=6,
        last_good_checkpoint=None,
    )
    args.update(overrides)
    return alarm.make_alarm(**args)


def test_record_has_every_required_field_and_resolved_suspects():
    record = _record()
    assert set(alarm.REQUIRED_FIELDS) <= set(record)
    assert record["schema"] == "sdcguard.dev/alarm/v1"
    assert record["suspects"] == [{"rank": 2, "pod": "job-worker-2", "node": "hyperpod-i-0abc2"}]
    assert record["reporter"]["rank"] == 0
    assert record["time"].endswith("Z")


def test_non_finite_evidence_becomes_strict_json():
    text = alarm.dumps(_record())
    parsed = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    assert parsed["evidence"] == {"norm": "nan", "big": "inf"}
    assert alarm.loads(text) == parsed


@pytest.mark.parametrize("mutate, message", [
    (lambda r: r.pop("suspects"), "lacks required fields: suspects"),
    (lambda r: r.update(schema="sdcguard.dev/alarm/v2"), "unsupported alarm schema"),
    (lambda r: r.update(step=-1), "step must be"),
    (lambda r: r.update(step=True), "step must be"),
    (lambda r: r.update(suspect_ranks=[2, 3]), "one {rank, pod, node} per suspect"),
    (lambda r: r.update(job={"name": "x"}), "job must be null"),
    (lambda r: r.update(ambiguous="no"), "ambiguous must be a boolean"),
    (lambda r: r["reporter"].pop("node"), "reporter.node"),
])
def test_invalid_records_are_rejected_with_the_field_named(mutate, message):
    record = _record()
    mutate(record)
    with pytest.raises(alarm.AlarmError, match=message.replace("{", r"\{").replace("}", r"\}")):
        alarm.validate(record)


RECOVERY = dict(suspect_window={"first_step": 5, "last_step": 7}, last_audited_step=4, last_weights_verified_step=4,
                steps_at_risk=3, last_good_checkpoint_sha256="5a" * 32, last_good_checkpoint_step=4,
                last_good_checkpoint_kept_from=None, drill=True)


def test_additive_fields_are_typed_and_present_only_when_given():
    """The recovery fields are named fields of the schema (no free-form extras): a record of an
    older library lacks them, one given is in the record as given, and the typed view reads them."""
    bare = _record()
    assert not set(alarm.ADDITIVE_FIELDS) & set(bare)
    full = _record(last_good_checkpoint="ckpt.pt", **RECOVERY)
    assert {k: full[k] for k in RECOVERY} == RECOVERY
    typed = alarm.Alarm.parse(alarm.loads(alarm.dumps(full)))
    assert typed.suspect_window == alarm.SuspectWindow(first_step=5, last_step=7)
    assert (typed.steps_at_risk, typed.last_good_checkpoint_step, typed.drill) == (3, 4, True)
    assert typed.suspects == (alarm.Identity(rank=2, pod="job-worker-2", node="hyperpod-i-0abc2"),)
    older = alarm.Alarm.parse(bare)
    assert older.steps_at_risk is None and older.suspect_window is None and older.drill is False
    with pytest.raises(TypeError, match="steps_at_rsik"):
        _record(steps_at_rsik=3)


@pytest.mark.parametrize("field, value, message", [
    ("steps_at_risk", -1, "steps_at_risk must be"),
    ("steps_at_risk", "3", "steps_at_risk must be"),
    ("last_good_checkpoint_step", 4.0, "last_good_checkpoint_step must be"),
    ("last_audited_step", True, "last_audited_step must be"),
    ("last_good_checkpoint_sha256", "XYZ", "last_good_checkpoint_sha256 must be"),
    ("suspect_window", {"first_step": 8, "last_step": 7}, "must not be after"),
    ("suspect_window", {"first_step": 1}, "suspect_window must be"),
    ("drill", "yes", "drill must be"),
])
def test_bad_additive_fields_are_refused_when_built_and_when_parsed(field, value, message):
    with pytest.raises(alarm.AlarmError, match=message):
        _record(**{field: value})
    record = _record()
    record[field] = value
    with pytest.raises(alarm.AlarmError, match=message):
        alarm.loads(json.dumps(record))


def test_identities_carry_a_typed_pod_uid_and_gpu():
    identities = {r: {**who, "pod_uid": f"uid-{r}", "gpu": {"index": r, "uuid": None}} for r, who in IDENTITIES.items()}
    record = _record(identities=identities, job={"kind": "PyTorchJob", "name": "llm", "namespace": "ml", "uid": "j1"})
    typed = alarm.Alarm.parse(record)
    assert typed.job == alarm.Job(kind="PyTorchJob", name="llm", namespace="ml", uid="j1")
    assert typed.suspects[0].pod_uid == "uid-2" and typed.suspects[0].gpu == alarm.Gpu(index=2, uuid=None)
    for mutate, message in [(lambda r: r["suspects"][0].update(gpu={"index": -1}), "suspects[].gpu"),
                            (lambda r: r["reporter"].update(pod_uid=7), "reporter.pod_uid"),
                            (lambda r: r["job"].update(uid=["x"]), "job.uid")]:
        broken = json.loads(alarm.dumps(record))
        mutate(broken)
        with pytest.raises(alarm.AlarmError, match=re.escape(message)):
            alarm.validate(broken)


def test_gpu_uuid_as_nvidia_smi_prints_it_and_older_records_without_gpus_still_parse():
    uuid = "GPU-8b2c1a7e-3f4d-4e5a-9b6c-0d1e2f3a4b5c"
    identities = {r: {**who, "gpu": {"index": r, "uuid": uuid if r == 2 else None}} for r, who in IDENTITIES.items()}
    record = alarm.loads(alarm.dumps(_record(identities=identities)))
    assert record["suspects"][0]["gpu"] == {"index": 2, "uuid": uuid}
    assert alarm.Alarm.parse(record).suspects[0].gpu == alarm.Gpu(index=2, uuid=uuid)
    assert alarm.gpu_text(record["suspects"][0]["gpu"]) == f"GPU 2 ({uuid})"
    assert alarm.gpu_text({"index": 1, "uuid": None}) == "GPU 1" and alarm.gpu_text(None) == ""
    old = alarm.loads(alarm.dumps(_record()))  # a record of a library from before the GPU field
    assert "gpu" not in old["suspects"][0] and alarm.Alarm.parse(old).suspects[0].gpu is None
    for bad in ("8b2c1a7e-3f4d-4e5a-9b6c-0d1e2f3a4b5c",  # torch's own str(): no GPU- prefix
                "GPU-8B2C1A7E-3F4D-4E5A-9B6C-0D1E2F3A4B5C", "GPU-0; rm -rf /", 3):
        broken = json.loads(alarm.dumps(record))
        broken["suspects"][0]["gpu"]["uuid"] = bad
        with pytest.raises(alarm.AlarmError, match=re.escape("suspects[].gpu")):
            alarm.validate(broken)


def test_loads_rejects_garbage():
    with pytest.raises(alarm.AlarmError, match="not valid JSON"):
        alarm.loads("{half a record")
    with pytest.raises(alarm.AlarmError, match="JSON object"):
        alarm.loads("[1, 2]")


def test_json_safe_keeps_finite_values():
    assert alarm.json_safe({"a": [1.5, -math.inf], 3: None}) == {"a": [1.5, "-inf"], "3": None}


def test_spool_write_is_atomic_and_listed(tmp_path):
    record = _record()
    path = spool.write_alarm(tmp_path / "spool", record)
    assert path.name == "run1-1-weights-step7.alarm.json"
    assert alarm.loads(path.read_text()) == json.loads(alarm.dumps(record))
    # a half-written temporary file (a crash mid-write) is never listed
    (tmp_path / "spool" / ".other.alarm.json.123.tmp").write_text("{")
    assert spool.list_alarms(tmp_path / "spool") == [path]
    assert not list((tmp_path / "spool").glob(".run1*"))  # no temporary file of ours is left


def test_spool_refuses_an_invalid_record(tmp_path):
    record = _record()
    record["check"] = ""
    with pytest.raises(alarm.AlarmError):
        spool.write_alarm(tmp_path, record)
    assert list(tmp_path.iterdir()) == []


def test_alarm_module_needs_no_torch():
    import subprocess
    import sys
    code = "import sys, sdcguard.contract.alarm, sdcguard.contract.spool, sdcguard.faults.spec; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
