"""The pipeline drill (``sdcguard drill --pp M --replicate R``): the drill model split into M stages
(``torch.distributed.pipelining``, 1F1B), each stage replicated R times by DDP, under sdcguard's
Pipeline layout. In-process: the config the flags give and what is refused before anything starts,
where each fault strikes (the stage its rank holds), and the judge's pipeline expectations (step 0
never audited; an ambiguous alarm must name the faulted stage's ranks, or for a NaN its replica's).
Under real processes (gloo, PP 2 x 3 replicas on 3 nodes x 2 ranks): every fault kind on a stage,
each caught by its check at its step naming its rank (or its stage pair, ambiguous), the run
resumed from the checkpoint each alarm names, ending bit for bit where the clean run does. With each
stage sharded by FSDP2 (``--pp 2 --shard S --replicate R``): the flags and refusals in-process; under
processes HSDP 2 x 2 (8 ranks: every kind caught, check 3 naming a shard's two replicas, bitwise
recovery) and pure FSDP over 3 (6 ranks: the weight and update faults escape, and say so)."""
import argparse
import json
import subprocess
import sys

import pytest

from sdcguard.drill import launch
from sdcguard.drill.pipeline import (
    STAGE_LAYERS, faults_of_rank, layers_at, resolve_fault, stage_defaults, stage_holding, stages_at,
)
from sdcguard.drill.report import pipeline_grid
from sdcguard.faults.judge import Schedule, judge_faults, pipeline_candidates
from sdcguard.faults.spec import FaultTargetError, parse_fault


def config(*argv):
    parser = argparse.ArgumentParser()
    launch.add_arguments(parser)
    return launch.config_from_args(parser.parse_args(list(argv)))


# -- the flags -----------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, layout", [
    (["--pp", "2", "--replicate", "3"], (2, 3, 3, 6, "1f1b")),       # a replica per node of 2 ranks
    (["--pp", "3", "--replicate", "2", "--ranks-per-node", "3"], (3, 2, 2, 6, "1f1b")),
    (["--pp", "2", "--replicate", "2", "--nodes", "1", "--ranks-per-node", "4", "--schedule", "gpipe"],
     (2, 2, 1, 4, "gpipe")),
    (["--pp", "2", "--replicate", "3", "--schedule", "interleaved"], (2, 3, 3, 6, "interleaved")),
])
def test_the_pipeline_follows_the_flags(argv, layout):
    cfg = config(*argv)
    assert (cfg["pp"], cfg["replicate"], cfg["nodes"], cfg["world_size"], cfg["schedule"]) == layout
    assert "shard" not in cfg and "tp" not in cfg


def test_the_ddp_drill_config_has_no_pipeline():
    assert "pp" not in config("--nodes", "3") and "schedule" not in config("--nodes", "3")


@pytest.mark.parametrize("argv, message", [
    (["--pp", "2"], "--pp needs --replicate R >= 2"),
    (["--pp", "2", "--replicate", "1", "--nodes", "1"], "--pp needs --replicate R >= 2"),
    (["--pp", "2", "--replicate", "2", "--tp", "2"], "pipeline x tensor parallelism is not supported"),
    (["--pp", "2", "--shard", "2", "--replicate", "2", "--tp", "2"], "pipeline x tensor parallelism is not supported"),
    (["--pp", "4", "--replicate", "2"], "at most 3 stages"),
    (["--pp", "0"], "--pp must be >= 1"),
    (["--schedule", "gpipe"], "--schedule needs --pp M"),
    (["--pp", "3", "--replicate", "2", "--schedule", "interleaved"], "--schedule interleaved needs --pp 2"),
    # interleaved: rank 1 holds stages 1 and 3 (norm, drop, head); the hidden layer is stage 2, on rank 0
    (["--pp", "2", "--replicate", "3", "--schedule", "interleaved", "--inject",
      "weight-swap:rank=1:step=2:param=hidden.weight"],
     "rank 1 holds pipeline stages 1, 3 (norm, drop, head) of replica 0; hidden.weight is in stage 2"),
    (["--pp", "2", "--replicate", "2", "--nodes", "3"], "--replicate 2 x --pp 2 = 4 ranks, but the job has 6"),
    (["--pp", "2", "--replicate", "3", "--on-alarm", "resume"], "needs --checkpoint-every K"),
    # rank 0 holds stage 0 (embed, norm, drop): the head is stage 1's
    (["--pp", "2", "--replicate", "3", "--inject", "grad-bitflip:rank=0:step=2:param=head.weight"],
     "rank 0 holds pipeline stage 0 (embed, norm, drop) of replica 0; head.weight is in stage 1"),
    (["--pp", "2", "--replicate", "3", "--inject", "forward-scale:rank=3:step=2:site=embed"],
     "rank 3 holds pipeline stage 1 (hidden, head) of replica 1; embed is in stage 0"),
    (["--pp", "2", "--replicate", "3", "--inject", "forward-scale:rank=3:step=2:site=hiden"],
     "the drill model has no 'hiden'"),
    (["--pp", "2", "--replicate", "3", "--inject", "weight-swap:rank=1:step=2:element=4096"],
     "element 4096 is out of range for hidden.weight"),
])
def test_what_a_pipeline_cannot_drill_is_refused_before_anything_starts(argv, message):
    with pytest.raises(launch.DrillInputError) as info:
        config(*argv)
    assert message in str(info.value)


def test_help_says_how_ranks_map_onto_the_pipeline():
    assert "rank r holds stage r % M of replica r // M" in launch.DESCRIPTION
    assert "--pp with --tp is refused" in launch.DESCRIPTION


# -- FSDP2 over each stage (--pp M --shard S --replicate R) ------------------------------------------

@pytest.mark.parametrize("argv, layout", [
    (["--pp", "2", "--shard", "2", "--replicate", "2"], (2, 2, 2, 4, 8)),    # HSDP: 4 pipelines, one per node
    (["--pp", "2", "--shard", "3"], (2, 3, 1, 3, 6)),                        # pure FSDP, R defaults to 1
    (["--pp", "2", "--shard", "3", "--nodes", "3"], (2, 3, 1, 3, 6)),        # R from the job's size
    (["--pp", "3", "--shard", "1", "--replicate", "2", "--ranks-per-node", "3"], (3, 1, 2, 2, 6)),
    (["--pp", "2", "--shard", "2", "--replicate", "2", "--schedule", "interleaved"], (2, 2, 2, 4, 8)),
])
def test_a_sharded_pipeline_follows_the_flags(argv, layout):
    cfg = config(*argv)
    assert (cfg["pp"], cfg["shard"], cfg["replicate"], cfg["nodes"], cfg["world_size"]) == layout
    assert "tp" not in cfg


@pytest.mark.parametrize("argv, message", [
    (["--pp", "2", "--shard", "1"], "--pp with --shard 1 needs --replicate R >= 2"),
    (["--pp", "2", "--shard", "0"], "--shard must be >= 1"),
    (["--pp", "2", "--shard", "2", "--replicate", "0"], "--replicate must be >= 1"),
    (["--pp", "2", "--shard", "2", "--replicate", "2", "--nodes", "3"],
     "--replicate 2 x --shard 2 x --pp 2 = 8 ranks, but the job has 6"),
    (["--pp", "2", "--shard", "4", "--nodes", "3"], "--shard 4 x --pp 2 does not divide the job's 6 ranks"),
    (["--pp", "2", "--shard", "2", "--replicate", "2", "--on-alarm", "resume"], "needs --checkpoint-every K"),
    # rank 5: stage 1 of pipeline 2 = shard 2 of 3; head.weight has 4 rows: FSDP2 gives shard 2 none
    (["--pp", "2", "--shard", "3", "--inject", "weight-swap:rank=5:step=2:param=head.weight"],
     "shard 2 of head.weight (shape (4, 32), over 3 shards) is empty"),
    (["--pp", "2", "--shard", "3", "--inject", "reduce-scale:step=2:param=head.bias"], "shard 2 of head.bias"),
    # rank 1: shard 0 of hidden.weight, 16 of its 32 rows (512 elements)
    (["--pp", "2", "--shard", "2", "--replicate", "2", "--inject", "optimizer-scale:rank=1:step=2:element=600"],
     "element 600 is not in shard 0 of hidden.weight"),
    (["--pp", "2", "--shard", "2", "--replicate", "2", "--inject", "grad-bitflip:rank=0:step=2:param=head.weight"],
     "rank 0 holds pipeline stage 0 (embed, norm, drop) of replica 0; head.weight is in stage 1"),
])
def test_what_a_sharded_pipeline_cannot_drill_is_refused_before_anything_starts(argv, message):
    with pytest.raises(launch.DrillInputError) as info:
        config(*argv)
    assert message in str(info.value)


def test_a_grad_fault_indexes_the_full_parameter_on_a_sharded_pipeline():
    # the local gradient is the full one (FSDP2's reduce-scatter input): element 600 is rank 1's to corrupt
    cfg = config("--pp", "2", "--shard", "2", "--replicate", "2", "--inject", "grad-bitflip:rank=1:step=2:element=600")
    assert cfg["faults"][0]["element"] == 600


def _report(cfg, faults, alarms):
    from sdcguard.drill.report import build_report
    cfg = {**cfg, "faults": [parse_fault(f).as_dict() for f in faults]}
    results = [{"rank": r, "fired": [], "recoveries": [], "stopped_at_step": None, "steps_completed": cfg["steps"],
                "final_weights": "d"} for r in range(cfg["world_size"])]
    return build_report(cfg, results, alarms)


def test_pure_fsdp_stages_report_weight_and_update_faults_as_escaping_check_3():
    cfg = config("--pp", "2", "--shard", "3", "--steps", "10", "--audit-every", "2", "--weight-check-every", "1")
    report = _report(cfg, ["weight-bitflip:rank=0:step=3", "optimizer-scale:rank=4:step=5",
                           "forward-scale:rank=3:step=4:every=2"], [alarm("a", "replay", 4, [3], False)])
    weight, update, forward = report["injected"]
    assert weight["outcome"] == update["outcome"] == "escaped" and weight["alarm"] is None
    assert "one replica (pure FSDP)" in weight["why"] and "one replica (pure FSDP)" in update["why"]
    assert forward["outcome"] == "caught" and report["passed"]
    # an alarm of check 3 there would be a false one: the drill claims no catch it did not make
    report = _report(cfg, ["weight-bitflip:rank=0:step=3"], [alarm("w", "weights", 3, [0], False)])
    assert report["injected"][0]["outcome"] == "escaped" and report["unexplained_alarms"] == ["w"]
    assert not report["passed"]


def test_hsdp_stages_are_weight_checked_and_audited_from_the_first_step():
    cfg = config("--pp", "2", "--shard", "2", "--replicate", "2", "--steps", "10", "--audit-every", "2",
                 "--weight-check-every", "1")
    report = _report(cfg, ["weight-swap:rank=3:step=5", "forward-scale:rank=1:step=0"],
                     [alarm("w", "weights", 5, [3, 7], True), alarm("f", "replay", 0, [1], False)])
    swap, forward = report["injected"]
    assert swap["outcome"] == "caught-ambiguous" and swap["named"] == [3, 7]  # stage 1's two replicas of shard 1
    assert forward["expected_step"] == 0 and forward["outcome"] == "caught"  # FSDP2 stages: step 0 is audited
    ddp = config("--pp", "2", "--replicate", "3", "--steps", "10", "--audit-every", "2")
    assert _report(ddp, ["forward-scale:rank=1:step=0"], [])["injected"][0]["outcome"] == "escaped"


# -- where faults strike ------------------------------------------------------------------------

def test_the_last_stage_holds_the_head_and_every_layer_is_held_once():
    for pp, stages in STAGE_LAYERS.items():
        assert len(stages) == pp and "head" in stages[-1]
        held = sorted(layer for layers in stages for layer in layers)
        assert held == sorted(["embed", "norm", "drop", "hidden", "head"])
    assert stage_holding("hidden.weight", 2) == 1 and stage_holding("module.embed.bias", 3) == 0
    assert stage_holding("nothing.weight", 2) is None


def test_a_fault_without_a_target_strikes_its_stages_default():
    assert stage_defaults(0, 2) == ("embed", "embed.weight")
    assert stage_defaults(1, 2) == ("hidden", "hidden.weight")
    assert stage_defaults(2, 3) == ("head", "head.weight")
    assert resolve_fault(parse_fault("weight-swap:rank=2:step=3"), 2).param == "embed.weight"   # rank 2: stage 0
    assert resolve_fault(parse_fault("forward-scale:rank=5:step=3"), 2).site == "hidden"        # rank 5: stage 1
    assert resolve_fault(parse_fault("reduce-scale:step=3"), 2).param == "hidden.weight"        # no rank: the default
    with pytest.raises(FaultTargetError):
        resolve_fault(parse_fault("grad-inf:rank=1:step=3:param=embed.weight"), 2)


def test_interleaved_ranks_hold_two_stages_looped():
    assert stages_at(0, 2, "interleaved") == (0, 2) and stages_at(1, 2, "interleaved") == (1, 3)
    assert layers_at(0, 2, "interleaved") == ("embed", "hidden")
    assert stage_defaults(1, 2, "interleaved") == ("norm", "head.weight")
    assert resolve_fault(parse_fault("grad-inf:rank=2:step=3"), 2, "interleaved").param == "hidden.weight"
    assert [f.kind for f in faults_of_rank([parse_fault("reduce-scale:step=3:param=head.bias")], 3, 2,
                                           "interleaved")] == ["reduce-scale"]


def test_a_rankless_reduce_fault_strikes_only_the_stage_holding_its_parameter():
    faults = [parse_fault("reduce-scale:step=3"), parse_fault("reduce-nan:step=4:param=embed.bias"),
              parse_fault("grad-inf:rank=1:step=5")]
    assert [(f.kind, f.param) for f in faults_of_rank(faults, 1, 2)] == [("reduce-scale", "hidden.weight"),
                                                                          ("grad-inf", "hidden.weight")]
    assert [(f.kind, f.param) for f in faults_of_rank(faults, 2, 2)] == [("reduce-nan", "embed.bias")]


# -- the judge -----------------------------------------------------------------------------------

GRID = pipeline_grid(6, 2)  # rank r: (replica r // 2, stage r % 2)


def alarm(id_, check, step, suspects, ambiguous):
    return {"id": id_, "check": check, "step": step, "suspect_ranks": suspects, "ambiguous": ambiguous}


def test_the_schedules_first_step_is_never_audited_on_a_pipeline():
    plan = Schedule(10, 2, 1, nodes=3, pipeline=GRID)
    assert not plan.audits(0) and plan.audits(2)
    assert Schedule(10, 2, 1, nodes=3).audits(0)
    verdict = judge_faults(["forward-scale:rank=1:step=0:every=2"], [alarm("a", "replay", 2, [1], False)], plan)
    assert verdict.rows[0]["expected_step"] == 2 and verdict.rows[0]["outcome"] == "caught"


def test_a_pipeline_alarm_must_name_the_faulted_stage_or_replica():
    assert pipeline_candidates(parse_fault("grad-bitflip:rank=3:step=2"), GRID) == {1, 3, 5}   # stage 1's replicas
    assert pipeline_candidates(parse_fault("forward-nan:rank=3:step=2"), GRID) == {2, 3}       # replica 1's stages
    plan = Schedule(10, 2, 1, nodes=3, pipeline=GRID)
    faults = ["grad-bitflip:rank=3:step=2", "forward-scale:rank=3:step=4", "forward-nan:rank=3:step=5",
              "forward-nan:rank=1:step=7", "weight-swap:rank=0:step=8"]
    alarms = [alarm("a", "replay", 2, [1, 3], True),           # stage 1's pair: right
              alarm("b", "replay", 4, [2, 3], True),           # replica 1's ranks: the wrong stage named
              alarm("c", "nonfinite-local", 5, [2, 3], True),  # a NaN: its replica's ranks
              alarm("d", "nonfinite-local", 7, [1, 3], True),  # not rank 1's replica
              alarm("e", "weights", 8, [0], False)]
    assert [r["outcome"] for r in judge_faults(faults, alarms, plan).rows] == [
        "caught-ambiguous", "misattributed", "caught-ambiguous", "misattributed", "caught"]
    # without the pipeline grid the judge would take b and d: the grid is what checks the stage
    unchecked = judge_faults(faults, alarms, Schedule(10, 2, 1, nodes=3)).rows
    assert unchecked[1]["outcome"] == "caught-ambiguous"


def test_schedule_of_a_pipeline_guard_reads_its_grid():
    from types import SimpleNamespace as Obj

    from sdcguard.checks.pipeline import read_grid
    grid = read_grid([{"pp": [2 * (r // 2), 2 * (r // 2) + 1], "dp": [r % 2, r % 2 + 2, r % 2 + 4],
                       "stages": [r % 2], "num_stages": 2} for r in range(6)])
    guard = Obj(config=Obj(audit_every=2, weight_check_every=1), topology=Obj(nodes=3, world_size=6),
                layout=Obj(checks_reduction=True, checks_weights=True, grid=grid))
    plan = Schedule.of(guard, steps=10)
    assert plan.pipeline == GRID and not plan.audits(0) and plan.audits(2)
    guard.layout.replicas = Obj(audits_first_step=True)  # FSDP2 stages (layouts/pipeline_stages.FsdpStages)
    assert Schedule.of(guard, steps=10).audits(0)


# -- a real pipeline drill (gloo, 6 ranks) -------------------------------------------------------

PP = ["--pp", "2", "--replicate", "3", "--nodes", "3", "--ranks-per-node", "2"]
RUN = ["--steps", "18", "--audit-every", "2", "--weight-check-every", "1", "--micro-batches", "2",
       "--checkpoint-every", "2"]
FAULTS = [
    ("forward-nan:rank=1:step=2", "nonfinite-local", None),         # stage 1 of replica 0: replica 0 named
    ("forward-scale:rank=3:step=4:every=2", "replay", [3]),          # persistent, stage 1: three replicas name 3
    ("grad-inf:rank=2:step=5", "nonfinite-local", [2]),
    ("grad-bitflip:rank=5:step=6", "replay", None),                  # once: stage 1's pair, ambiguous
    ("reduce-nan:step=7", "nonfinite-reduced", []),                  # stage 1's all-reduce (hidden.weight)
    ("reduce-scale:step=9:param=embed.weight", "reduce-checksum", []),  # stage 0's all-reduce
    ("optimizer-scale:rank=4:step=11", "weights", [4]),
    ("weight-bitflip:rank=0:step=13", "weights", [0]),
    ("weight-swap:rank=3:step=15:param=head.weight", "weights", [3]),
]


def drill(tmp_path_factory, name, *args, timeout=600):
    out = tmp_path_factory.mktemp(name)
    proc = subprocess.run([sys.executable, "-m", "sdcguard.cli", "drill", *args, "--report", str(out / "report.json"),
                           "--spool", str(out / "spool")], capture_output=True, text=True, timeout=timeout)
    assert (out / "report.json").exists(), proc.stdout + proc.stderr
    return proc, json.loads((out / "report.json").read_text())


@pytest.mark.multiprocess
@pytest.mark.slow
def test_every_fault_kind_on_a_stage_is_caught_naming_its_rank_and_the_recovery_is_bitwise(tmp_path_factory):
    clean_proc, clean = drill(tmp_path_factory, "pp-clean", *PP, *RUN)
    assert clean_proc.returncode == 0, clean_proc.stdout + clean_proc.stderr
    assert clean["passed"] and clean["alarms"] == [] and clean["steps_completed"] == 18
    assert clean["final_weights_digest"] is not None  # every stage's replicas agree
    assert "[drill] pipeline: 2 stages (1f1b) x 3 replicas" in clean_proc.stdout

    args = [*PP, *RUN, "--on-alarm", "resume"]
    for spec, _, _ in FAULTS:
        args += ["--inject", spec]
    proc, report = drill(tmp_path_factory, "pp-faults", *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert report["passed"] and report["unexplained_alarms"] == [], proc.stdout
    alarms = {a["id"]: a for a in report["alarms"]}
    for (spec, check, named), row in zip(FAULTS, report["injected"]):
        fault = parse_fault(spec)
        assert row["expected_check"] == check and row["alarm"] is not None, (spec, row)
        got = alarms[row["alarm"]]
        assert got["check"] == check and got["step"] == fault.step, (spec, got["check"], got["step"])
        if named is None:  # ambiguous: the rank and ranks of its stage (check 2) or replica (check 1)
            assert row["outcome"] == "caught-ambiguous" and fault.rank in row["named"], (spec, row)
            assert set(row["named"]) <= pipeline_candidates(fault, pipeline_grid(6, 2)), (spec, row)
        else:
            assert row["outcome"] == "caught" and row["named"] == named, (spec, row)
        assert "resume_step" in row and row["resume_step"] < fault.step
    assert all(r["resumed_from"] is None or r["resumed_from"].startswith("step-") for r in report["recoveries"])
    # the recovered run ends bit for bit where the clean run does, every stage of every replica
    assert report["final_weight_digests"] == clean["final_weight_digests"]
    assert report["final_weights_digest"] == clean["final_weights_digest"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_interleaved_stages_are_drilled_too(tmp_path_factory):
    """Interleaved 1F1B, two stages per rank: faults in either of a rank's stages name it (or its
    stage pair), and the recovered run ends bit for bit on the clean one."""
    run = [*PP, "--schedule", "interleaved", "--steps", "10", "--audit-every", "2", "--weight-check-every", "1",
           "--checkpoint-every", "2"]
    clean_proc, clean = drill(tmp_path_factory, "pp-interleaved-clean", *run)
    assert clean_proc.returncode == 0 and clean["alarms"] == [], clean_proc.stdout + clean_proc.stderr
    faults = [("forward-scale:rank=1:step=2:every=2", "replay", [1]),               # stage 1 (norm)
              ("grad-bitflip:rank=0:step=4:param=hidden.weight", "replay", None),   # stage 2, once
              ("weight-swap:rank=3:step=5:param=norm.weight", "weights", [3]),
              ("reduce-scale:step=7:param=head.weight", "reduce-checksum", [])]
    args = [*run, "--on-alarm", "resume"]
    for spec, _, _ in faults:
        args += ["--inject", spec]
    proc, report = drill(tmp_path_factory, "pp-interleaved-faults", *args)
    assert proc.returncode == 0 and report["passed"], proc.stdout + proc.stderr
    for (spec, check, named), row in zip(faults, report["injected"]):
        assert row["expected_check"] == check and row["expected_step"] == parse_fault(spec).step, (spec, row)
        if named is None:
            assert row["outcome"] == "caught-ambiguous" and parse_fault(spec).rank in row["named"], (spec, row)
            assert set(row["named"]) <= pipeline_candidates(parse_fault(spec), pipeline_grid(6, 2)), (spec, row)
        else:
            assert row["outcome"] == "caught" and row["named"] == named, (spec, row)
    assert report["final_weights_digest"] == clean["final_weights_digest"] is not None


# -- a real sharded pipeline drill (gloo, PP 2 x HSDP 2 x 2 = 8 ranks on 4 nodes; pure FSDP 2 x 3 = 6) ----

HSDP = ["--pp", "2", "--shard", "2", "--replicate", "2", "--nodes", "4", "--ranks-per-node", "2"]
# rank r: stage r % 2 of pipeline r // 2 (one per node), shard (r // 2) % 2 of replica r // 4; check 3 compares
# a shard's two replicas (ambiguous: both named); pipelines 0..3 replay each other's batches (check 2)
HSDP_FAULTS = [
    ("forward-nan:rank=1:step=2", "nonfinite-local", None),         # stage 1 of pipeline 0: its ranks named
    ("forward-scale:rank=3:step=4:every=2", "replay", [3]),          # persistent: its own pass and its replay
    ("grad-inf:rank=2:step=5", "nonfinite-local", [2]),              # into FSDP2's reduce-scatter input
    ("grad-bitflip:rank=5:step=6", "replay", None),                  # once: stage 1's pair, ambiguous
    ("reduce-nan:step=7", "nonfinite-reduced", []),                  # stage 1's reduced shards (hidden.weight)
    ("reduce-scale:step=9:param=embed.weight", "reduce-checksum", []),  # stage 0's
    ("optimizer-scale:rank=4:step=11", "weights", None),             # shard 0 of stage 0: ranks 0 and 4
    ("weight-bitflip:rank=0:step=13", "weights", None),
    ("weight-swap:rank=3:step=15:param=head.weight", "weights", None),  # shard 1 of stage 1: ranks 3 and 7
]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_every_fault_kind_on_an_fsdp_sharded_stage_is_caught_and_the_recovery_is_bitwise(tmp_path_factory):
    clean_proc, clean = drill(tmp_path_factory, "pp-hsdp-clean", *HSDP, *RUN, timeout=1200)
    assert clean_proc.returncode == 0, clean_proc.stdout + clean_proc.stderr
    assert clean["passed"] and clean["alarms"] == [] and clean["final_weights_digest"] is not None
    assert "each sharded by FSDP2 (HSDP 2 replicas x 2 shards)" in clean_proc.stdout

    args = [*HSDP, *RUN, "--on-alarm", "resume"]
    for spec, _, _ in HSDP_FAULTS:
        args += ["--inject", spec]
    proc, report = drill(tmp_path_factory, "pp-hsdp-faults", *args, timeout=1200)  # 8 ranks: ~2 min idle
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert report["passed"] and report["unexplained_alarms"] == [], proc.stdout
    grid = pipeline_grid(8, 2)
    alarms = {a["id"]: a for a in report["alarms"]}
    for (spec, check, named), row in zip(HSDP_FAULTS, report["injected"]):
        fault = parse_fault(spec)
        assert row["expected_check"] == check and row["alarm"] is not None, (spec, row)
        got = alarms[row["alarm"]]
        assert got["check"] == check and got["step"] == fault.step, (spec, got["check"], got["step"])
        if named is None:  # ambiguous: the rank and ranks of its stage (checks 2, 3) or pipeline (check 1)
            assert row["outcome"] == "caught-ambiguous" and fault.rank in row["named"], (spec, row)
            assert set(row["named"]) <= pipeline_candidates(fault, grid), (spec, row)
            if check == "weights":  # the shard's other replica: same stage, same shard, the other replica
                assert row["named"] == sorted([fault.rank, fault.rank ^ 4]), (spec, row)
        else:
            assert row["outcome"] == "caught" and row["named"] == named, (spec, row)
        assert "resume_step" in row and row["resume_step"] < fault.step
    assert all(r["resumed_from"] is not None and r["resumed_from"].startswith("step-") for r in report["recoveries"])
    assert report["final_weights_digest"] == clean["final_weights_digest"]


PURE = ["--pp", "2", "--shard", "3", "--nodes", "3", "--ranks-per-node", "2", "--steps", "12", "--audit-every", "2",
        "--weight-check-every", "1", "--micro-batches", "2", "--checkpoint-every", "2", "--on-alarm", "resume"]
# rank r: stage r % 2 of pipeline r // 2 = shard r // 2 of the one replica: check 3 has nothing to compare
PURE_CAUGHT = [("forward-scale:rank=3:step=2:every=2", "replay", [3]),
               ("grad-inf:rank=0:step=3", "nonfinite-local", [0]),
               ("reduce-scale:step=5:param=embed.weight", "reduce-checksum", [])]
PURE_ESCAPES = ["optimizer-scale:rank=4:step=7", "weight-bitflip:rank=1:step=9", "weight-swap:rank=2:step=10"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_pure_fsdp_stages_catch_compute_faults_and_report_weight_faults_as_escaping(tmp_path_factory):
    """One replica of each stage: compute and reduction faults are caught as with HSDP; a weight or
    update fault escapes (no check 3), and the drill says so rather than claim a catch. The run
    that recovered from the caught faults ends bit for bit where the run with only the escaping
    ones does."""
    def inject(specs):
        return [a for spec in specs for a in ("--inject", spec)]
    base_proc, base = drill(tmp_path_factory, "pp-fsdp-escapes", *PURE, *inject(PURE_ESCAPES))
    assert base_proc.returncode == 0 and base["alarms"] == [], base_proc.stdout + base_proc.stderr
    assert "pure FSDP over 3 ranks, one replica: no check 3" in base_proc.stdout
    assert [r["outcome"] for r in base["injected"]] == ["escaped"] * 3
    assert {f["kind"] for f in base["fired"]} == {"optimizer-scale", "weight-bitflip", "weight-swap"}

    proc, report = drill(tmp_path_factory, "pp-fsdp-faults", *PURE,
                         *inject([spec for spec, _, _ in PURE_CAUGHT] + PURE_ESCAPES))
    assert proc.returncode == 0 and report["passed"] and report["unexplained_alarms"] == [], proc.stdout + proc.stderr
    rows = report["injected"]
    for (spec, check, named), row in zip(PURE_CAUGHT, rows):
        assert row["outcome"] == "caught" and row["expected_check"] == check and row["named"] == named, (spec, row)
        assert row["expected_step"] == parse_fault(spec).step and row["resume_step"] < parse_fault(spec).step
    for row in rows[len(PURE_CAUGHT):]:
        assert row["outcome"] == "escaped" and row["alarm"] is None and "one replica (pure FSDP)" in row["why"], row
    assert all(a["step"] < 7 for a in report["alarms"])  # nothing claims the weight faults
    assert report["final_weights_digest"] == base["final_weights_digest"] is not None
