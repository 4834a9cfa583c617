"""Real multi-process drills (gloo, 3 nodes x 2 ranks): each fault caught by the right check, at
the right step, naming exactly the right rank and node. Several faults share one launch: the drill
replaces the suspects and resumes from the newest verified state before each alarm's suspect
window, and ends bit for bit where the same drill without faults ends (20 steps, 2 micro-batches)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess


def drill(tmp_path_factory, name, *args, stale_alarm=False):
    out = tmp_path_factory.mktemp(name)
    if stale_alarm:  # what an earlier run left in the same spool, published by its sidecar
        from sdcguard.contract import alarm, spool
        me = {"rank": 0, "pod": None, "node": "drill-node-0"}
        record = alarm.make_alarm(alarm_id="0123456789ab-1-replay-step4", job=None, check="replay", step=4,
                                  suspect_ranks=[0], identities={0: me}, ambiguous=False, reporter_rank=0,
                                  evidence={}, last_verified_step=0, last_good_checkpoint=None)
        record["time"] = "2026-01-01T00:00:00.000Z"
        (out / "spool" / spool.PUBLISHED_DIR).mkdir(parents=True)
        spool.write_alarm(out / "spool" / spool.PUBLISHED_DIR, record)
    proc = subprocess.run(
        [sys.executable, "-m", "sdcguard.cli", "drill", "--nodes", "3", "--ranks-per-node", "2",
         "--report", str(out / "report.json"), "--spool", str(out / "spool"), *args],
        capture_output=True, text=True, timeout=600,
    )
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() else None
    return proc, report, out


SAME_RUN = ["--steps", "20", "--micro-batches", "2"]  # what the bitwise comparisons share


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    return drill(tmp_path_factory, "clean", *SAME_RUN, "--audit-every", "4", "--weight-check-every", "1",
                 stale_alarm=True)


@pytest.fixture(scope="module")
def many_faults(tmp_path_factory):
    return drill(
        tmp_path_factory, "many", *SAME_RUN, "--audit-every", "5", "--weight-check-every", "2",
        "--on-alarm", "resume", "--checkpoint-every", "3",
        "--inject", "forward-nan:rank=0:step=2",       # rank 0 is the culprit, like any other
        "--inject", "grad-inf:rank=5:step=3",
        "--inject", "reduce-nan:step=5",
        "--inject", "optimizer-scale:rank=1:step=8",
        "--inject", "weight-swap:rank=2:step=11",
        "--inject", "weight-bitflip:rank=0:step=13",
    )


EXPECTED = [  # kind, check, step, suspect rank (None: no rank can be named), checkpoint to resume from
    ("forward-nan", "nonfinite-local", 2, 0, "step-0.pt"),
    ("grad-inf", "nonfinite-local", 3, 5, "step-0.pt"),
    ("reduce-nan", "nonfinite-reduced", 5, None, "step-3.pt"),   # check 4 verified the reduction at 4
    ("optimizer-scale", "weights", 8, 1, "step-6.pt"),      # weights suspect since step 7
    ("weight-swap", "weights", 12, 2, "step-9.pt"),         # weights suspect since step 11
    ("weight-bitflip", "weights", 14, 0, "step-12.pt"),
]


def test_each_fault_is_caught_by_its_check_naming_its_rank_and_node(many_faults):
    proc, report, _ = many_faults
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert report["passed"] and report["unexplained_alarms"] == []
    assert [r["outcome"] for r in report["injected"]] == ["caught"] * len(EXPECTED)
    alarms = sorted(report["alarms"], key=lambda a: a["step"])
    assert len(alarms) == len(EXPECTED)  # exactly one record per fault, not one per rank
    for alarm, (kind, check, step, rank, _) in zip(alarms, EXPECTED):
        assert (alarm["check"], alarm["step"], alarm["ambiguous"]) == (check, step, False), kind
        if rank is None:
            assert alarm["suspect_ranks"] == [] and alarm["suspects"] == []
        else:
            assert alarm["suspect_ranks"] == [rank]
            assert alarm["suspects"] == [{"rank": rank, "pod": None, "node": f"drill-node-{rank // 2}",
                                          "gpu": {"index": rank % 2, "uuid": None}}]  # on CPU: the local slot
            assert alarm["reporter"]["rank"] != rank  # a suspect never reports on itself
        assert alarm["job"] is None  # outside Kubernetes


def test_each_alarm_names_the_last_good_checkpoint_and_the_run_resumes_from_it(many_faults):
    _, report, _ = many_faults
    alarms = sorted(report["alarms"], key=lambda a: a["step"])
    assert [Path(a["last_good_checkpoint"]).name for a in alarms] == [e[4] for e in EXPECTED]
    assert report["resumed_from"] == [e[4] for e in EXPECTED]
    for alarm, recovery in zip(alarms, report["recoveries"]):
        assert recovery["alarm"] == alarm["id"]
        assert recovery["resume_step"] == alarm["last_good_checkpoint_step"] < alarm["suspect_window"]["first_step"]


def test_the_recovered_run_ends_bitwise_where_the_clean_run_ends(many_faults, replay_faults, clean):
    digest = clean[1]["final_weights_digest"]
    assert digest is not None
    assert many_faults[1]["final_weights_digest"] == replay_faults[1]["final_weights_digest"] == digest


def test_evidence_says_what_differed(many_faults):
    _, report, _ = many_faults
    by_step = {a["step"]: a for a in report["alarms"]}
    # a non-finite local gradient is named once a replay on another node does not reproduce it
    assert by_step[2]["evidence"]["non_finite_ranks"] == [0]
    assert by_step[2]["evidence"]["confirmation"]["0"]["reproduced"] is False
    assert by_step[3]["evidence"]["non_finite_ranks"] == [5]
    reduced = {k: v for k, v in by_step[5]["evidence"].items() if k.startswith("reduced_grad_")}
    assert list(reduced.values()) == ["nan"]  # the key names the measure (it differs on audit steps)
    assert by_step[12]["evidence"]["differing_parameters"] == {"2": {"count": 1, "names": ["hidden.weight"]}}
    assert by_step[12]["suspect_window"] == {"first_step": 11, "last_step": 12}


def test_alarms_in_the_spool_are_the_reported_ones(many_faults):
    _, report, out = many_faults
    spooled = sorted(p.name for p in (out / "spool").glob("*.alarm.json"))
    assert spooled == sorted(a["id"].replace("/", "_") + ".alarm.json" for a in report["alarms"])


def test_timeline_is_printed(many_faults):
    proc, _, _ = many_faults
    assert "[drill] step    2  ALARM silent data corruption: check nonfinite-local at step 2: rank 0 node drill-node-0" in proc.stdout
    assert "[drill] verdict  weight-swap:rank=2:step=11: CAUGHT" in proc.stdout
    assert "[drill] drill PASSED" in proc.stdout


def test_clean_run_raises_no_alarm(clean):
    proc, report, out = clean
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # (the spool's published/ holds an earlier run's alarm: not this run's)
    assert report["alarms"] == [] and report["stopped_at_step"] is None
    assert report["steps_completed"] == 20 and report["passed"]
    assert not list((out / "spool").glob("*.alarm.json"))
    stats = [json.loads((out / "spool" / "stats" / f"rank-{r}.json").read_text()) for r in range(6)]
    assert all(s["schema"] == "sdcguard.dev/stats/v1" and s["alarms"] == 0 for s in stats)
    assert stats[0]["node"] == "drill-node-0" and stats[5]["node"] == "drill-node-2"
    assert set(stats[0]["checks"]) == {"nonfinite", "replay", "weights", "reduce_checksum"}
    assert len(set(map(str, report["final_weight_digests"].values()))) == 1  # replicas agree
    assert report["final_weights_digest"] == report["final_weight_digests"]["0"]


def test_stop_mode_stops_every_rank_at_the_alarm(tmp_path_factory):
    """Here check 3 before the checkpoint at step 5 raises (inside save_checkpoint): an alarm like any other."""
    proc, report, _ = drill(tmp_path_factory, "stop", "--steps", "12", "--audit-every", "0",
                            "--weight-check-every", "3", "--checkpoint-every", "5",
                            "--inject", "weight-bitflip:rank=4:step=4", "--inject", "grad-inf:rank=1:step=10")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert report["stopped_at_step"] == 5 and report["steps_completed"] == 5
    [alarm] = report["alarms"]
    assert (alarm["check"], alarm["step"], alarm["suspect_ranks"]) == ("weights", 5, [4])
    assert alarm["suspect_window"] == {"first_step": 4, "last_step": 5}  # weights verified after step 3
    assert Path(alarm["last_good_checkpoint"]).name == "step-0.pt"
    assert [r["outcome"] for r in report["injected"]] == ["caught", "not-reached"]
    assert report["recoveries"] == [] and report["final_weights_digest"] is None  # rank 4 still differs


@pytest.fixture(scope="module")
def replay_faults(tmp_path_factory):
    """No checkpoints: each resume is from an in-memory copy of weights check 3 verified."""
    return drill(
        tmp_path_factory, "replay", *SAME_RUN, "--audit-every", "4", "--weight-check-every", "2",
        "--on-alarm", "resume",
        "--inject", "grad-bitflip:rank=3:step=4",                    # transient, in the owner's pass
        "--inject", "forward-scale:rank=0:step=8",                   # transient, rank 0
        "--inject", "forward-scale:rank=2:step=12:during=replay",    # the culprit is the replayer
        "--inject", "grad-bitflip:rank=5:step=14:every=2",           # persistent: 14, 16, ...
    )


def test_replay_catches_finite_corruption_and_names_the_culprit(replay_faults):
    proc, report, _ = replay_faults
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert report["passed"] and report["unexplained_alarms"] == []
    assert [r["outcome"] for r in report["injected"]] == ["caught"] * 4
    alarms = sorted(report["alarms"], key=lambda a: a["step"])
    got = [(a["check"], a["step"], a["suspect_ranks"], a["ambiguous"]) for a in alarms]
    assert got == [("replay", 4, [3], False), ("replay", 8, [0], False),
                   ("replay", 12, [2], False), ("replay", 16, [5], False)]
    assert alarms[0]["suspects"] == [{"rank": 3, "pod": None, "node": "drill-node-1", "gpu": {"index": 1, "uuid": None}}]


def test_without_checkpoints_the_drill_resumes_from_the_newest_verified_copy_before_the_window(replay_faults):
    _, report, _ = replay_faults
    got = [(r["suspect_window"]["first_step"], r["resume_step"], r["resumed_from"]) for r in report["recoveries"]]
    # each window starts after the last passing audit; weights were verified every 2 steps
    assert got == [(1, 0, None), (5, 4, None), (9, 8, None), (13, 12, None)]


def test_replay_evidence_and_attribution_paths(replay_faults):
    _, report, _ = replay_faults
    by_step = {a["step"]: a["evidence"] for a in report["alarms"]}
    # transient in the owner's pass: the tie-break replayer agrees with the ring replayer
    assert by_step[4]["tiebreaks"] == [{"replayer": 1, "owner": 3, "third": 5, "agrees_with": "replayer"}]
    assert by_step[4]["pairs"][0]["differing_parameters"] == {"count": 1, "names": ["hidden.weight"]}
    # transient in the replay: the third opinion agrees with the owner
    assert by_step[12]["tiebreaks"][0]["agrees_with"] == "owner"
    # persistent: two mismatching pairs share the culprit, no tie-break needed
    assert {(p["replayer"], p["owner"]) for p in by_step[16]["pairs"]} == {(3, 5), (5, 1)}
    assert by_step[16]["tiebreaks"] == []
    assert by_step[8]["pairs"][0]["loss_bits_owner"] != by_step[8]["pairs"][0]["loss_bits_replay"]


def test_two_nodes_detect_but_cannot_attribute_and_the_pods_environment_changes_nothing(tmp_path_factory):
    """The drill run as a release test inside an enabled job's pod, with everything the webhook
    sets there. Before: its ranks took SDCGUARD_SPOOL (the sidecar's: the synthetic alarm would
    have been published and acted on), SDCGUARD_AUDIT_EVERY (here 0: the fault would escape),
    POD_NAME / NODE_NAME (every rank one node), and judged their own alarm MISSED."""
    out = tmp_path_factory.mktemp("two-nodes")
    sidecar_spool = out / "sidecar-spool"
    sidecar_spool.mkdir()
    pod_env = {"SDCGUARD_SPOOL": str(sidecar_spool), "SDCGUARD_AUDIT_EVERY": "0", "SDCGUARD_WEIGHT_CHECK_EVERY": "0",
               "SDCGUARD_RANKS_PER_NODE": "1", "SDCGUARD_SEED": "9", "SDCGUARD_JOB_NAME": "llm",
               "SDCGUARD_JOB_KIND": "PyTorchJob", "SDCGUARD_JOB_UID": "0b5e6f1c", "POD_NAME": "llm-worker-0",
               "POD_NAMESPACE": "team-a", "NODE_NAME": "hyperpod-i-0123456789abcdef0", "POD_UID": "9d1c",
               "LOCAL_WORLD_SIZE": "8"}
    proc = subprocess.run(
        [sys.executable, "-m", "sdcguard.cli", "drill", "--nodes", "2", "--ranks-per-node", "2",
         "--steps", "6", "--audit-every", "3", "--inject", "grad-bitflip:rank=1:step=3",
         "--report", str(out / "report.json")],
        capture_output=True, text=True, timeout=600, env={**os.environ, **pod_env},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((out / "report.json").read_text())
    [alarm] = report["alarms"]
    assert (alarm["check"], alarm["step"], alarm["ambiguous"]) == ("replay", 3, True)
    assert alarm["suspect_ranks"] == [1, 3]
    assert [s["node"] for s in alarm["suspects"]] == ["drill-node-0", "drill-node-1"]
    assert alarm["drill"] is True and alarm["job"] is None and alarm["reporter"]["pod"] is None
    assert report["injected"][0]["outcome"] == "caught-ambiguous"
    assert list(sidecar_spool.iterdir()) == []  # nothing reached the sidecar's spool
