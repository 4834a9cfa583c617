"""``sdcguard drill``: a real multi-process DDP run (FSDP2 with ``--shard``, a pipeline with ``--pp``) with
injected faults, judged and reported.

It is the first-run demo and the user's fault-injection release test. The parent process checks
every argument before any process starts, launches one worker per rank (simulated node ``k`` is
``drill-node-<k>``, or the pod and node ``--placement`` names: the sandbox's, so that the alarm
names real objects), streams their timeline, then judges the alarms and writes the JSON report.
Exit status: 0 drill passed, 1 a fault was missed or misattributed, a resume was unsafe or an
alarm is unexplained, 2 bad input, 3 the run itself failed.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping

from ..contract import alarm as _alarm
from ..child_process import die_with_parent
from ..contract import names, spool
from .report import build_report, print_summary
from ..faults.spec import SHARD_SIDE, FaultSpec, FaultSpecError, parse_fault


DESCRIPTION = """\
A real multi-process DDP (with --shard, FSDP2; with --pp, a pipeline) training of a small model with the faults you
inject, judged and reported: the first-run demo and the fault-injection release test.

Safe inside an enabled pod: the drill takes no setting from the environment. Its checks run on its
flags and defaults only (SDCGUARD_AUDIT_EVERY, SDCGUARD_WEIGHT_CHECK_EVERY, ... are ignored), each
simulated node k is drill-node-k (POD_NAME and NODE_NAME are ignored; --placement names real pods
and nodes), and its alarms go to its own temporary spool (SDCGUARD_SPOOL is ignored; --spool DIR
sends them to DIR, e.g. a sidecar's). Every record it writes carries "drill": true.

Sharded (--shard S [--replicate R]): the same drill with the model sharded by FSDP2's fully_shard
(one unit per layer, then the root) over a (replicate, shard) mesh of consecutive ranks, as torchtitan
builds it: rank r holds shard r % S of replica r // S. R = 1 is pure FSDP over S ranks; R > 1 is
HSDP; S = 1 (R >= 2) is R replicas of unsharded FSDP2 units (no reduce-scatter: check 4 covers
the all-reduce). Shard groups must lie within a node (S divides --ranks-per-node; HSDP's usual layout: the
reduce-scatter inside a node, the all-reduce across nodes) or span whole nodes (--ranks-per-node
divides S). Without --nodes / --world-size the job has R x S ranks. With one replica check 3 has
nothing to compare: a weight or optimizer fault then escapes (the report says why).

Tensor parallel (--tp T, with --shard S, default 1): the model's hidden layer column-wise and its
head row-wise over T consecutive ranks (parallelize_module, before fully_shard over the data-parallel
(replicate, shard) mesh): rank r is TP rank r % T of the TP group r // T, which trains on one batch.
The job has R x S x T ranks; a TP group lies within a node (T divides --ranks-per-node). A fault
in one rank's forward reaches its whole TP group: the group is named.

Pipeline parallel (--pp M --replicate R, M = 2 or 3): the model split into M stages
(torch.distributed.pipelining, --schedule 1f1b, gpipe or interleaved (two stages per rank, M = 2);
the last stage holds the head and the loss), each stage replicated R >= 2 times by DDP: rank r holds stage r % M of replica r // M (a
replica's pipeline on M consecutive ranks, so the replay ring, the same stage of another replica,
crosses nodes). A fault's param= / site= must name what its rank's stage holds; a reduce-* fault
without a rank strikes the stage holding its parameter. With DDP the schedule's first step is never
audited; with --on-alarm resume a pipeline resumes from a checkpoint (--checkpoint-every K).
With --shard S (--pp M --shard S --replicate R, R default 1) each stage is sharded by FSDP2 over
its R x S ranks instead: R x S pipelines (rank r: pipeline r // M, shard (r // M) % S of replica
r // (M x S)); R = 1 is pure FSDP (a weight or optimizer fault then escapes: no replica for check 3),
R >= 2 HSDP. --pp with --tp is refused (pipeline x tensor parallelism is not supported).

Exit status: 0 passed, 1 a fault missed or misattributed / an unsafe resume / an unexplained
alarm, 2 bad input, 3 the run itself failed."""


class DrillInputError(ValueError):
    """Bad drill arguments: reported on one line, exit status 2, nothing started."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, help="simulated nodes N (default 3, or W / R)")
    parser.add_argument("--world-size", type=int, help="ranks W in all (default N x R)")
    parser.add_argument("--ranks-per-node", type=int, default=2, help="ranks per node R (default 2)")
    parser.add_argument("--shard", type=int, metavar="S",
                        help="shard the model with FSDP2 over S consecutive ranks (a shard group: within a node, "
                             "or whole nodes); default: DDP")
    parser.add_argument("--tp", type=int, metavar="T", default=1,
                        help="tensor parallel over T consecutive ranks within a node (needs FSDP2: --shard S, "
                             "default 1); the job has R x S x T ranks")
    parser.add_argument("--pp", type=int, metavar="M", default=1,
                        help="pipeline parallel: the model split into M stages (2 or 3) on M consecutive ranks, "
                             "each stage replicated R times by DDP (needs --replicate R >= 2; the job has R x M "
                             "ranks) or, with --shard S, sharded by FSDP2 over R x S ranks (R x S x M ranks)")
    parser.add_argument("--schedule", choices=("1f1b", "gpipe", "interleaved"), default="1f1b",
                        help="with --pp: the pipeline schedule (default 1f1b; interleaved: interleaved 1F1B, two "
                             "stages per rank, --pp 2 only)")
    parser.add_argument("--replicate", type=int, metavar="R",
                        help="with --pp: R replicas of the pipeline; with --shard: R replicas of each shard (HSDP over (R, S); 1 = pure FSDP); default: the "
                             "job's ranks / S; without --nodes / --world-size the job has R x S ranks")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    parser.add_argument("--audit-every", type=int, default=5, help="check 2 interval, 0 = off (default 5)")
    parser.add_argument("--weight-check-every", type=int, default=2, help="check 3 interval, 0 = audit steps only (default 2)")
    parser.add_argument("--micro-batches", type=int, default=1, help="micro-batches per step (default 1)")
    parser.add_argument("--inject", action="append", default=[], metavar="KIND:rank=R:step=S[:magnitude=X][:every=K]",
                        help="a fault to inject (repeatable); also :during=replay, :element=N, "
                             ":site=PATH (forward-*) or :param=NAME (the rest)")
    parser.add_argument("--on-alarm", choices=("stop", "resume"), default="stop",
                        help="stop at the first alarm, or replace the suspects and resume from the newest "
                             "verified state before the alarm's suspect window")
    parser.add_argument("--checkpoint-every", type=int, default=0,
                        help="save a verified checkpoint every K steps; resume restarts from the alarm's last good checkpoint")
    parser.add_argument("--checkpoint-dir", type=Path, metavar="DIR",
                        help="keep the checkpoints here (default: the drill's temporary directory, removed at the end)")
    parser.add_argument("--report", type=Path, help="write the JSON report here")
    parser.add_argument("--spool", type=Path, help="alarm spool directory (default: a temporary one)")
    parser.add_argument("--placement", type=Path, metavar="FILE",
                        help='JSON {"namespace", "job", "job_uid", "nodes": [{"pod", "node", "pod_uid"}, ...]} (uids '
                             "optional): simulated node k runs as that pod on that node of that job (what the "
                             "downward API gives a real pod; sdcguard demo writes it for its sandbox)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                        help="gloo on CPU; auto picks nccl when enough GPUs exist")
    parser.add_argument("--timeout", type=int, default=300, help="collective timeout in seconds")


def config_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Validate everything up front; raise DrillInputError with a one-line message."""
    for name in ("nodes", "world_size", "ranks_per_node", "steps", "micro_batches", "timeout"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise DrillInputError(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("audit_every", "weight_check_every", "checkpoint_every"):
        if getattr(args, name) < 0:
            raise DrillInputError(f"--{name.replace('_', '-')} must be >= 0")
    if args.checkpoint_dir is not None and not args.checkpoint_every:
        raise DrillInputError("--checkpoint-dir needs --checkpoint-every")
    if args.checkpoint_dir is not None and args.checkpoint_dir.exists() and not args.checkpoint_dir.is_dir():
        raise DrillInputError(f"--checkpoint-dir {args.checkpoint_dir} is not a directory")
    pp = _pp(args)
    if pp > 1:
        return _pipeline_config(args, pp)
    tp = _tp(args)
    mesh = _mesh(args)
    if mesh is not None and args.world_size is None and args.nodes is None and args.replicate is not None:
        nodes, world = _layout(None, mesh[0] * mesh[1] * tp, args.ranks_per_node)
    else:
        nodes, world = _layout(args.nodes, args.world_size, args.ranks_per_node)
    if mesh is not None:
        mesh = _check_mesh(mesh, world, args.ranks_per_node, tp)
    try:
        faults = [parse_fault(text, world) for text in args.inject]
        _check_targets(faults, mesh, tp)
    except FaultSpecError as exc:
        raise DrillInputError(str(exc)) from None
    sharded = {} if mesh is None else {"replicate": mesh[0], "shard": mesh[1], **({"tp": tp} if tp > 1 else {})}
    return _common(args, sharded, nodes, world, faults)


def _common(args: argparse.Namespace, layout: dict[str, Any], nodes: int, world: int,
            faults: list[FaultSpec]) -> dict[str, Any]:
    return {**layout,
        "nodes": nodes, "ranks_per_node": args.ranks_per_node, "world_size": world,
        "steps": args.steps, "audit_every": args.audit_every,
        "weight_check_every": args.weight_check_every, "micro_batches": args.micro_batches,
        "checkpoint_every": args.checkpoint_every,
        "faults": [f.as_dict() for f in faults], "on_alarm": args.on_alarm, "seed": args.seed,
        "backend": _backend(args.backend, world), "timeout_s": args.timeout,
        "print_every": max(1, args.steps // 10),
        "placement": _placement(args.placement, nodes) if args.placement else None,
        "checkpoint_dir": str(args.checkpoint_dir.resolve()) if args.checkpoint_dir else None,
    }


def _placement(path: Path, nodes: int) -> dict[str, Any]:
    """The ``--placement`` file, checked: a pod and a node per simulated node, and the job."""
    try:
        placement = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise DrillInputError(f"--placement {path}: {exc}") from None
    entries = placement.get("nodes") if isinstance(placement, dict) else None
    if not isinstance(entries, list) or len(entries) != nodes or not all(
            isinstance(e, dict) and isinstance(e.get("pod"), str) and isinstance(e.get("node"), str) and e["pod"]
            and e["node"] for e in entries):
        raise DrillInputError(f"--placement {path}: needs \"nodes\": a list of {nodes} {{\"pod\", \"node\"}} objects")
    for key in ("namespace", "job"):
        if not isinstance(placement.get(key), str) or not placement[key]:
            raise DrillInputError(f"--placement {path}: needs \"{key}\"")
    uids = [placement.get("job_uid"), *(e.get("pod_uid") for e in entries)]
    if not all(u is None or (isinstance(u, str) and u) for u in uids):
        raise DrillInputError(f"--placement {path}: \"job_uid\" and each \"pod_uid\" must be non-empty strings")
    return {"namespace": placement["namespace"], "job": placement["job"], "job_uid": placement.get("job_uid"),
            "nodes": [{"pod": e["pod"], "node": e["node"], "pod_uid": e.get("pod_uid")} for e in entries]}


def _check_targets(faults: list[FaultSpec], mesh: tuple[int, int] | None = None, tp: int = 1) -> None:
    """Faults that name their own target are checked against the drill model (needs torch); on a
    sharded drill every fault that strikes a shard is, against the shards of the ranks it strikes
    (with tensor parallelism: of the rank's TP shard)."""
    shard_side = mesh is not None and any(f.info.corrupts in SHARD_SIDE for f in faults)
    if shard_side or any(f.site is not None or f.param is not None or f.element is not None for f in faults):
        import torch
        from ..faults.injector import FaultInjector
        from .model import PARAM, SITE, DrillModel
        model = DrillModel()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        for fault in faults:
            FaultInjector([fault], fault.rank or 0).install(model, optimizer, site=SITE, param=PARAM)
            if mesh is not None and fault.info.corrupts != "forward":
                from ..faults.sharded import check_sharded_fault
                from ..faults.targets import resolve_parameter
                from .model import tp_local_shape
                name, parameter = resolve_parameter(model, fault.param if fault.param is not None else PARAM)
                shards = mesh[1]
                check_sharded_fault(fault, name, tp_local_shape(name, tuple(parameter.shape), tp), shards,
                                    lambda rank: (rank // tp) % shards, fault.element if fault.element is not None else 0)


def _mesh(args: argparse.Namespace) -> tuple[int, int | None] | None:
    """(R or None, S) from --replicate / --shard, or None for DDP."""
    if args.shard is None:
        if args.replicate is not None:
            raise DrillInputError("--replicate needs --shard S (HSDP is R replicas of S shards)")
        return None
    if args.shard < 1:
        raise DrillInputError("--shard must be >= 1")
    if args.shard == 1 and (args.replicate or 0) < 2 and (args.tp or 1) == 1:
        raise DrillInputError("--shard 1 needs --replicate R >= 2 (R replicas of unsharded FSDP2 units); "
                              "one rank has nothing to compare with")
    if args.replicate is not None and args.replicate < 1:
        raise DrillInputError("--replicate must be >= 1")
    return args.replicate if args.replicate is not None else None, args.shard  # type: ignore[return-value]


def _check_mesh(mesh: tuple[int | None, int], world: int, per_node: int, tp: int = 1) -> tuple[int, int]:
    """(R, S) checked against the job: R x S (x T) ranks, shard groups within a node or whole nodes,
    tensor-parallel groups within a node."""
    replicate, shard = mesh
    if replicate is None:
        if world % (shard * tp):
            raise DrillInputError(f"--shard {shard}{f' x --tp {tp}' if tp > 1 else ''} does not divide the job's "
                                  f"{world} ranks")
        replicate = world // (shard * tp)
    if replicate * shard * tp != world:
        raise DrillInputError(f"--replicate {replicate} x --shard {shard}{f' x --tp {tp}' if tp > 1 else ''} = "
                              f"{replicate * shard * tp} ranks, but the job has {world}")
    if per_node % tp:
        raise DrillInputError(f"a tensor-parallel group of {tp} consecutive ranks would straddle nodes of {per_node} "
                              "ranks: --tp must divide --ranks-per-node")
    span = shard * tp  # the ranks of one replica
    if per_node % span and span % per_node:
        raise DrillInputError(f"a replica's {span} consecutive ranks would straddle nodes of {per_node} ranks: "
                              f"--shard{' x --tp' if tp > 1 else ''} must divide --ranks-per-node or be a multiple of it")
    if replicate * shard < 2:
        raise DrillInputError("tensor parallelism alone leaves no data-parallel replica to compare with: give "
                              "--replicate or --shard so that the job has 2 data-parallel ranks at least")
    return replicate, shard


def _pp(args: argparse.Namespace) -> int:
    """M from --pp, with what the pipeline drill refuses (for now) checked up front."""
    pp = args.pp if args.pp is not None else 1
    if pp < 1:
        raise DrillInputError("--pp must be >= 1")
    if pp == 1:
        if args.schedule != "1f1b":
            raise DrillInputError("--schedule needs --pp M (a pipeline of M >= 2 stages)")
        return 1
    if (args.tp or 1) > 1:
        raise DrillInputError("--pp with --tp: pipeline x tensor parallelism is not supported (sdcguard's pipeline "
                              "layout refuses tensor-parallel stages); drill a pipeline with --pp M --replicate R "
                              "(DDP over each stage) or --pp M --shard S [--replicate R] (FSDP2), or tensor "
                              "parallelism with --tp T --shard S")
    if pp > 3:
        raise DrillInputError(f"--pp {pp}: the drill model has three layers, so at most 3 stages")
    if args.schedule == "interleaved" and pp != 2:
        raise DrillInputError(f"--schedule interleaved needs --pp 2: two stages per rank, and the drill model has "
                              f"four parts (not {2 * pp} stages)")
    if args.shard is not None:
        if args.shard < 1:
            raise DrillInputError("--shard must be >= 1")
        if args.replicate is not None and args.replicate < 1:
            raise DrillInputError("--replicate must be >= 1")
        if args.shard == 1 and (args.replicate or 1) < 2:
            raise DrillInputError("--pp with --shard 1 needs --replicate R >= 2 (R replicas of each stage's unsharded "
                                  "FSDP2 units); one rank per stage has nothing to compare with")
        return pp
    if args.replicate is None or args.replicate < 2:
        raise DrillInputError("--pp needs --replicate R >= 2: each stage is compared with its replicas "
                              "(one replica of a stage has nothing to compare with; or shard each stage: "
                              "--shard S)")
    return pp


def _pipeline_config(args: argparse.Namespace, pp: int) -> dict[str, Any]:
    """The pipeline drill's config: R replicas of M consecutive ranks (drill/pipeline.py); with
    --shard S, R x S pipelines of M consecutive ranks, each stage sharded by FSDP2 over its R x S ranks."""
    shard = args.shard
    per_stage = shard or 1  # ranks per stage per replica
    if args.world_size is None and args.nodes is None:
        replicate = args.replicate if args.replicate is not None else 1
        nodes, world = _layout(None, replicate * per_stage * pp, args.ranks_per_node)
    else:
        nodes, world = _layout(args.nodes, args.world_size, args.ranks_per_node)
        if args.replicate is None and world % (per_stage * pp):
            raise DrillInputError(f"{f'--shard {shard} x ' if shard else ''}--pp {pp} does not divide the job's "
                                  f"{world} ranks")
        replicate = args.replicate if args.replicate is not None else world // (per_stage * pp)
    what = f"--replicate {replicate}{f' x --shard {shard}' if shard else ''} x --pp {pp}"
    if replicate * per_stage * pp != world:
        raise DrillInputError(f"{what} = {replicate * per_stage * pp} ranks, but the job has {world}")
    if shard is not None and replicate * shard < 2:
        raise DrillInputError(f"{what}: one rank per stage has nothing to compare with: give --shard S >= 2 or "
                              "--replicate R >= 2")
    if args.on_alarm == "resume" and not args.checkpoint_every:
        raise DrillInputError("--pp with --on-alarm resume needs --checkpoint-every K: a pipeline resumes through "
                              "guard.load_checkpoint, whose first step reduces as the uninterrupted run did "
                              "(docs/pipeline.md)")
    from . import pipeline
    try:
        faults = [parse_fault(text, world) for text in args.inject]
        pipeline.check_faults(faults, pp, args.schedule, shard)
    except FaultSpecError as exc:
        raise DrillInputError(str(exc)) from None
    layout = {"pp": pp, "replicate": replicate, "schedule": args.schedule, **({"shard": shard} if shard else {})}
    return _common(args, layout, nodes, world, faults)


def _tp(args: argparse.Namespace) -> int:
    """T from --tp, which needs the FSDP2 drill (the data-parallel dimensions sharded by fully_shard)."""
    tp = args.tp if args.tp is not None else 1
    if tp < 1:
        raise DrillInputError("--tp must be >= 1")
    if tp > 1 and args.shard is None:
        args.shard = 1  # tensor parallel over FSDP2 units that are not sharded: R replicas
        if args.replicate is None and args.world_size is None and args.nodes is None:
            raise DrillInputError("--tp needs the data-parallel size: give --replicate R (and --shard S), or "
                                  "--nodes / --world-size")
    return tp


def _layout(nodes: int | None, world: int | None, per_node: int) -> tuple[int, int]:
    """(N, W) from whichever of --nodes / --world-size was given, checked against R."""
    if world is None:
        nodes = 3 if nodes is None else nodes
        return nodes, nodes * per_node
    if world % per_node:
        raise DrillInputError(f"world size {world} is not divisible by --ranks-per-node {per_node}")
    if nodes is not None and nodes * per_node != world:
        raise DrillInputError(f"--world-size {world} != --nodes {nodes} x --ranks-per-node {per_node}")
    return world // per_node, world


def run(cfg: dict[str, Any], report_path: Path | None, spool_dir: Path | None) -> int:
    """Launch the ranks, wait, judge, print and write the report; return the exit status."""
    with tempfile.TemporaryDirectory(prefix="sdcguard-drill-") as workdir:
        cfg = {**cfg, "workdir": workdir, "spool": str(spool_dir or Path(workdir, "spool"))}
        _print_header(cfg)
        started = time.time()
        codes = _launch(cfg)
        results = [_read_json(Path(workdir, f"rank-{r}.json")) for r in range(cfg["world_size"])]
        if any(codes) or None in results:
            print(f"[drill] run failed: worker exit codes {codes}", file=sys.stderr)
            return 3
        alarms = _alarms_since(cfg["spool"], started)
    report = build_report(cfg, results, alarms)
    print_summary(report)
    if report_path:
        report_path.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
        print(f"[drill] report written to {report_path}")
    return 0 if report["passed"] else 1


def _launch(cfg: dict[str, Any]) -> list[int]:
    config_path = Path(cfg["workdir"], "config.json")
    config_path.write_text(json.dumps(cfg))
    procs = []
    for rank in range(cfg["world_size"]):
        env = {
            **rank_environment(os.environ),
            "RANK": str(rank), "WORLD_SIZE": str(cfg["world_size"]),
            "LOCAL_RANK": str(rank % cfg["ranks_per_node"]),
            "LOCAL_WORLD_SIZE": str(cfg["ranks_per_node"]),
            "OMP_NUM_THREADS": "1",
        }
        procs.append(subprocess.Popen([sys.executable, "-m", "sdcguard.drill.worker", str(config_path)], env=env,
                                      preexec_fn=die_with_parent))
    try:
        return [p.wait() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def rank_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The parent's environment less what describes the job the drill may run inside: the
    ``SDCGUARD_*`` settings, the downward-API identity and torchrun's rendezvous. The worker
    reads none of it (its Config comes from the drill's flags); dropping it keeps it so."""
    dropped = {names.ENV_POD_NAME, names.ENV_POD_NAMESPACE, names.ENV_NODE_NAME, names.ENV_POD_UID,
               "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID"}
    return {k: v for k, v in environ.items() if k not in dropped and not k.startswith("SDCGUARD_")}


def _alarms_since(spool_dir: str, started: float) -> list[dict[str, Any]]:
    """This run's alarm records: in the spool, or already moved to ``published/`` by a sidecar
    (a sidecar may move one while we read), and none an earlier run left in the same spool."""
    records: dict[str, dict[str, Any]] = {}
    published = Path(spool_dir, spool.PUBLISHED_DIR)
    for path in spool.list_alarms(spool_dir) + spool.list_alarms(published):
        for candidate in (path, published / path.name):
            try:
                record = _alarm.loads(candidate.read_text())
            except FileNotFoundError:
                continue
            if _alarm.rfc3339_seconds(record["time"]) >= started - 1.0:  # the record's time has milliseconds
                records[record["id"]] = record
            break
    return sorted(records.values(), key=lambda a: a["time"])


def _backend(choice: str, world: int) -> str:
    if choice != "auto":
        return choice
    try:
        import torch
        return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "gloo"
    except ImportError:
        return "gloo"


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _print_header(cfg: dict[str, Any]) -> None:
    faults = ", ".join(str(FaultSpec(**f)) for f in cfg["faults"]) or "none"
    if cfg.get("pp"):
        pp = cfg["pp"]
        if cfg.get("shard"):
            shard, replicate = cfg["shard"], cfg["replicate"]
            mesh = (f"HSDP {replicate} replicas x {shard} shards" if replicate > 1
                    else f"pure FSDP over {shard} ranks, one replica: no check 3")
            print(f"[drill] pipeline: {pp} stages ({cfg['schedule']}), each sharded by FSDP2 ({mesh}); rank r holds "
                  f"stage r % {pp} of pipeline r // {pp}, shard (r // {pp}) % {shard} of replica "
                  f"r // {pp * shard}", flush=True)
        else:
            print(f"[drill] pipeline: {pp} stages ({cfg['schedule']}) x {cfg['replicate']} replicas (DDP over each "
                  f"stage); rank r holds stage r % {pp} of replica r // {pp}", flush=True)
    elif cfg.get("shard"):
        mesh = (f"HSDP {cfg['replicate']} replicas x {cfg['shard']} shards" if cfg["replicate"] > 1
                else f"FSDP over {cfg['shard']} ranks (one replica)")
        tp = cfg.get("tp", 1)
        if tp > 1:
            print(f"[drill] sharded: {mesh}, x tensor parallel over {tp} ranks; rank r is TP rank r % {tp} of "
                  f"shard (r // {tp}) % {cfg['shard']} of replica r // {cfg['shard'] * tp}", flush=True)
        else:
            print(f"[drill] sharded: {mesh}; rank r holds shard r % {cfg['shard']} of replica r // {cfg['shard']}",
                  flush=True)
    print(f"[drill] {cfg['nodes']} nodes x {cfg['ranks_per_node']} ranks ({cfg['backend']}), "
          f"{cfg['steps']} steps, audit every {cfg['audit_every'] or 'never'}, "
          f"weight check every {cfg['weight_check_every'] or 'audit step'}", flush=True)
    print(f"[drill] injecting: {faults}", flush=True)
