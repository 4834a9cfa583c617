"""Checkpoints of sharded (FSDP2) models (sdcguard.sharding.dcp): the manifest's rules in-process,
then one torchrun launch of 4 gloo ranks (tests/fsdp_checkpoint_worker.py) — HSDP 2 x 2 saved at
step 1 and again at step 3 into one directory, resumed by a fresh run from the directory a compute
fault's alarm names, bit for bit on the uninterrupted run; corrupted copies refused on load and by
``sdcguard verify-checkpoint``; pure FSDP over 4 saved and resumed — and the directories it left,
verified offline."""
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sdcguard import recovery
from sdcguard.checkpoint import CheckpointError
from sdcguard.cli import main as cli
from sdcguard.sharding import dcp_manifest

HERE = Path(__file__).parent


# -- pure parts ----------------------------------------------------------------------------------

def _manifest(**over):
    files = {".metadata": "a" * 64, "__0_0.distcp": "b" * 64, "__1_0.distcp": "c" * 64}
    reports = [{"digest": "d0", "chunks": [[[0], [2]]]}, {"digest": "d1", "chunks": [[[2], [1]]]},
               {"digest": "d0", "chunks": [[[0], [2]]]}, {"digest": "d1", "chunks": [[[2], [1]]]}]
    args = dict(step=3, files=files, grid=[[0, 1], [2, 3]], weights_verified=True, model_key="model",
                state_keys=["optimizer", "sdcguard"], parameters=["w"], reports=reports, recorded={"audited_step": 2})
    args.update(over)
    return dcp_manifest.build(**args)


def test_the_identity_is_one_sha256_over_the_file_list_as_sha256sum_prints_it():
    manifest = _manifest()
    lines = "".join(f"{sha}  {name}\n" for name, sha in sorted(manifest["files"].items()))
    assert manifest["sha256"] == hashlib.sha256(lines.encode()).hexdigest()
    assert [s["ranks"] for s in manifest["shards"]] == [[0, 2], [1, 3]]
    assert manifest["mesh"] == {"replicas": 2, "shards": 2, "grid": [[0, 1], [2, 3]]}
    assert dcp_manifest.check_form(manifest, "ckpt", expect_step=3, expect_sha256=manifest["sha256"].upper())


def test_a_manifest_is_refused_when_edited_or_not_the_one_an_alarm_named():
    manifest = _manifest()
    with pytest.raises(CheckpointError, match="now holds the checkpoint of step 3, not step 1"):
        dcp_manifest.check_form(manifest, "ckpt", expect_step=1)
    with pytest.raises(CheckpointError, match="not the checkpoint the alarm named"):
        dcp_manifest.check_form(manifest, "ckpt", expect_sha256="0" * 64)
    edited = json.loads(json.dumps(manifest))
    edited["files"]["__1_0.distcp"] = "e" * 64        # a file's hash changed, the identity not
    with pytest.raises(CheckpointError, match="not that of its own file list"):
        dcp_manifest.check_form(edited, "ckpt")
    edited = json.loads(json.dumps(manifest))
    edited["files"]["../escape"] = "f" * 64
    with pytest.raises(CheckpointError, match="malformed"):
        dcp_manifest.check_form(edited, "ckpt")


def test_replicas_of_a_shard_that_differ_at_the_save_are_never_written():
    reports = [{"digest": "d0", "chunks": []}, {"digest": "d1", "chunks": []},
               {"digest": "XX", "chunks": []}, {"digest": "d1", "chunks": []}]
    with pytest.raises(CheckpointError, match=r"replicas \[0, 2\] of shard 0 hold different weights"):
        _manifest(reports=reports)


def test_files_are_judged_by_name_and_hash():
    manifest = _manifest()
    assert dcp_manifest.judge_files(manifest, dict(manifest["files"]), list(manifest["files"])) == []
    problems = dcp_manifest.judge_files(manifest, {"__1_0.distcp": "9" * 64, "__0_0.distcp": None},
                                        [".metadata", "__1_0.distcp", "stray"])
    assert problems == ["files missing: ['__0_0.distcp']", "files its manifest does not list: ['stray']",
                        f"__1_0.distcp was modified after it was written: sha256 {'9' * 64} != manifest {'c' * 64}"]
    assert dcp_manifest.judge_files(manifest, {"__0_0.distcp": None}) == ["__0_0.distcp is missing"]
    assert dcp_manifest.judge_shard(manifest, 1, "d1") is None
    assert "shard 1 (ranks [1, 3])" in dcp_manifest.judge_shard(manifest, 1, "zz")


def test_a_checkpoint_never_cross_checked_is_never_named_nor_kept():
    flat = recovery.Checkpoint(2, "flat", None, "s2", cross_checked=False)
    history = recovery.History(last_weights_verified_step=None, last_reduction_verified_step=5, checkpoints=[flat])
    fields = recovery.recovery_fields("reduce-checksum", 6, history)
    assert fields["last_good_checkpoint"] is None and fields["steps_at_risk"] == 7
    plan = recovery.plan_save(history, "flat", 5, keep=True)
    assert plan.keep is None and plan.dropped == (flat,)
    checked = recovery.Checkpoint(2, "hsdp", 0, "s2")
    history = recovery.History(last_audited_step=0, last_weights_verified_step=2, checkpoints=[checked])
    assert recovery.plan_save(history, "hsdp", 5, keep=True).keep is checked  # as for DDP


# -- under torchrun ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp-checkpoint")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                           str(HERE / "fsdp_checkpoint_worker.py"), str(out)], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]

    def result(scenario):
        return [json.loads((out / f"{scenario}-rank{r}.json").read_text()) for r in range(4)]
    result.out = out
    return result


@pytest.mark.multiprocess
def test_hsdp_resumed_from_the_checkpoint_an_alarm_names_ends_bit_for_bit_on_the_clean_run(run):
    for r in run("hsdp"):
        replay = r["replay"]
        kept = str(run.out / "ckpt.sdcguard-step1")
        assert (replay["last_good_checkpoint"], replay["last_good_checkpoint_step"]) == (kept, 1)
        assert replay["last_good_checkpoint_kept_from"] == str(run.out / "ckpt")
        resumed = r["resumed"]
        assert resumed["step"] == 1 and resumed["updates_through"] == 1
        assert resumed["losses"] == {s: bits for s, bits in r["losses"].items() if int(s) > 1}
        assert resumed["final"] == r["final"] and resumed["lr"] == r["lr"]   # shards, optimizer, scheduler
        assert resumed["seen"] == 17                                         # a plain extra value, loaded back
        assert resumed["checkpoints"] == [[1, kept]]
    finals = [r["final"] for r in run("hsdp")]
    assert finals[0] == finals[2] and finals[1] == finals[3] and finals[0] != finals[1]  # replicas of a shard


@pytest.mark.multiprocess
def test_the_overwritten_directory_keeps_the_checkpoint_an_alarm_can_still_name(run):
    r = run("hsdp")[0]
    kept1, kept3, ckpt = (str(run.out / name) for name in ("ckpt.sdcguard-step1", "ckpt.sdcguard-step3", "ckpt"))
    assert r["audited"] == 4                                     # check 2 ran (steps 0, 2, 4) and passed
    assert r["checkpoints"] == [[1, kept1], [3, ckpt]]          # saved at 1, then at 3 over it
    assert "now holds the checkpoint of step 3, not step 1" in r["overwritten"]
    # a weights fault caught at 4 reaches back to step 4 only: the directory itself, holding step 3
    assert (r["weights"]["last_good_checkpoint"], r["weights"]["last_good_checkpoint_step"]) == (ckpt, 3)
    # saved again at 5, after the audit at 4 passed: step 3 is what a compute fault can name now
    assert r["checkpoints_after"] == [[3, kept3], [5, ckpt]] and not Path(kept1).exists()
    moved = dcp_manifest.verify_directory(kept3, expect_step=3, expect_sha256=r["weights"]["last_good_checkpoint_sha256"])
    assert (moved.step, moved.replicas, moved.shards, moved.weights_verified) == (3, 2, 2, True)
    manifest = dcp_manifest.read(ckpt, expect_step=5)
    assert [(c["step"], c["path"], c["kept_from"]) for c in manifest["earlier_checkpoints"]] == [(3, kept3, ckpt)]
    assert sorted(manifest["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp"]
    assert (manifest["audited_step"], manifest["weights_verified"], manifest["mesh"]["grid"]) == (4, True, [[0, 1], [2, 3]])
    assert not any(p.name.startswith(".ckpt") for p in run.out.iterdir())   # no staging left behind


@pytest.mark.multiprocess
def test_a_changed_byte_or_a_changed_shard_is_refused_on_every_rank(run):
    results = run("hsdp")
    for r in results:
        assert "__1_0.distcp was modified after it was written" in r["bad_byte"] and r["bad_byte_untouched"]
        # the file hashes match the (rewritten) manifest; the fingerprints of shard 1 do not
        assert "not those fingerprinted at the save" in r["bad_shard"]
        assert "rank 1 (replica 0, shard 1)" in r["bad_shard"] and "rank 3 (replica 1, shard 1)" in r["bad_shard"]
        assert "shard 0" not in r["bad_shard"]
        assert "it holds files and no sdcguard manifest" in r["foreign"]
    assert (run.out / "foreign" / "notes.txt").read_text() == "mine"


@pytest.mark.multiprocess
def test_a_save_runs_check3_first_and_writes_nothing_when_a_replica_differs(run):
    for r in run("hsdp"):
        assert r["flip"] == {"check": "weights", "suspects": [1, 3]}     # two replicas: both named
        assert "raised 1 alarm(s)" in r["after_alarm"]
    assert not (run.out / "after-flip").exists() and not (run.out / ".after-flip.sdcguard-tmp").exists()


@pytest.mark.multiprocess
def test_verify_checkpoint_checks_a_directory_offline(run, capsys):
    sha = json.loads((run.out / "ckpt" / dcp_manifest.MANIFEST_NAME).read_text())["sha256"]
    assert cli(["verify-checkpoint", str(run.out / "ckpt"), "--step", "5", "--sha256", sha]) == 0
    said = capsys.readouterr().out
    assert said.startswith("OK ") and "step 5" in said and sha in said and "across 2 replicas" in said
    assert cli(["verify-checkpoint", str(run.out / "ckpt"), "--step", "1"]) == 1
    assert "not step 1" in capsys.readouterr().out
    assert cli(["verify-checkpoint", str(run.out / "bad-byte")]) == 1
    assert "__1_0.distcp was modified" in capsys.readouterr().out
    assert cli(["verify-checkpoint", str(run.out / "bad-shard")]) == 1
    said = capsys.readouterr().out
    assert "shard 1 (ranks [1, 3])" in said and "shard 0" not in said
    assert cli(["verify-checkpoint", str(run.out / "foreign")]) == 2


@pytest.mark.multiprocess
def test_a_stray_file_in_the_directory_is_refused_offline(run, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(run.out / "ckpt", copy)
    assert dcp_manifest.verify_directory(copy).step == 5  # a copy elsewhere is the same checkpoint
    (copy / "__9_0.distcp").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"files its manifest does not list: \['__9_0.distcp'\]"):
        dcp_manifest.verify_directory(copy)


@pytest.mark.multiprocess
def test_pure_fsdp_saves_and_resumes_but_no_alarm_names_a_checkpoint_never_cross_checked(run):
    for r in run("fsdp"):
        assert r["resumed"]["step"] == 1
        assert r["resumed"]["losses"] == {s: bits for s, bits in r["losses"].items() if int(s) > 1}
        assert r["resumed"]["final"] == r["final"]
        assert r["checkpoints"] == [[1, str(run.out / "flat")], [3, str(run.out / "flat-again")]]
        assert r["reduction"]["last_good_checkpoint"] is None      # listed, never named
        assert r["weights_verified"] is None and r["resumed"]["weights_verified"] is None
    assert not (run.out / "flat-again.sdcguard-step2").exists()    # nothing kept for an alarm that cannot name it
    found = dcp_manifest.verify_directory(run.out / "flat", expect_step=1)
    assert (found.replicas, found.shards, found.weights_verified) == (1, 4, False)
