"""The injected-fault matrix: every fault kind once, on DDP and on sharded meshes, through the real drill.

    .venv/bin/python bench/drill_matrix.py [--mesh ddp3x2 --mesh hsdp3x2 ...] [--json OUT]

For each mesh, one ``sdcguard drill --on-alarm resume`` run (gloo, CPU) injects the nine kinds of
``sdcguard.faults.spec``, each on its own step (the compute kinds on audit steps), and the drill's
own judgement (``faults/judge.py``) says per fault: caught or not, by which check at which step, and
which ranks the alarm named. Prints one markdown table per mesh (docs/drill.md's matrix comes from
these) and exits 1 when a drill failed. Meshes:

  ddp3x2   DDP, 3 nodes x 2 ranks (the DDP drill, for comparison)
  hsdp3x2  HSDP 3 replicas x 2 shards, 3 nodes x 2 ranks (a shard group per node)
  hsdp2x2  HSDP 2 replicas x 2 shards, 1 node x 4 ranks
  fsdp4    pure FSDP over 4 ranks, 4 nodes x 1 rank (the shard group spans the nodes)
  hsdp3x1  3 replicas of unsharded FSDP2 units, 3 nodes x 1 rank (no reduce-scatter)
  tp3x2    tensor parallel over 2 ranks, 3 replicas of unsharded FSDP2 units, 3 nodes x 2 ranks (a TP
           group per node)
  pp2x3    pipeline parallel: 2 stages (1F1B) x 3 replicas (DDP over each stage), 3 nodes x 2 ranks (a
           replica per node); resumes from checkpoints every 2 steps (a pipeline resumes through
           guard.load_checkpoint)
  pp2hsdp2x2  pipeline parallel: 2 stages x HSDP 2 replicas x 2 shards over each stage, 4 nodes x 2 ranks
  pp2fsdp3    pipeline parallel: 2 stages x pure FSDP over 3 ranks per stage, 3 nodes x 2 ranks (no check
              3: the weight and update kinds escape, and the report says so)
"""
import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MESHES = {
    "ddp3x2": ["--nodes", "3", "--ranks-per-node", "2"],
    "hsdp3x2": ["--nodes", "3", "--ranks-per-node", "2", "--shard", "2", "--replicate", "3"],
    "hsdp2x2": ["--nodes", "1", "--ranks-per-node", "4", "--shard", "2", "--replicate", "2"],
    "fsdp4": ["--nodes", "4", "--ranks-per-node", "1", "--shard", "4", "--replicate", "1"],
    "hsdp3x1": ["--nodes", "3", "--ranks-per-node", "1", "--shard", "1", "--replicate", "3"],
    "tp3x2": ["--nodes", "3", "--ranks-per-node", "2", "--tp", "2", "--replicate", "3"],
    "pp2x3": ["--nodes", "3", "--ranks-per-node", "2", "--pp", "2", "--replicate", "3", "--checkpoint-every", "2"],
    "pp2hsdp2x2": ["--nodes", "4", "--ranks-per-node", "2", "--pp", "2", "--shard", "2", "--replicate", "2",
                   "--checkpoint-every", "2"],
    "pp2fsdp3": ["--nodes", "3", "--ranks-per-node", "2", "--pp", "2", "--shard", "3", "--replicate", "1",
                 "--checkpoint-every", "2"],
}

RUN = ["--steps", "18", "--audit-every", "2", "--weight-check-every", "1", "--micro-batches", "2",
       "--on-alarm", "resume"]


def faults(world: int) -> list[str]:
    """The nine kinds, one per step, on ranks spread over the mesh (the compute kinds on audit steps)."""
    r = [1 % world, 2 % world, 3 % world, 0, (world - 1), 2 % world, 1 % world]
    return [f"forward-nan:rank={r[0]}:step=2", f"forward-scale:rank={r[1]}:step=4", f"grad-inf:rank={r[2]}:step=5",
            f"grad-bitflip:rank={r[3]}:step=6", "reduce-nan:step=7", "reduce-scale:step=9",
            f"optimizer-scale:rank={r[4]}:step=11", f"weight-bitflip:rank={r[5]}:step=13",
            f"weight-swap:rank={r[6]}:step=15"]


def run(mesh: str, out: Path) -> dict:
    flags = MESHES[mesh]
    world = int(flags[1]) * int(flags[3])
    report = out / f"{mesh}.json"
    cmd = [sys.executable, "-m", "sdcguard.cli", "drill", *flags, *RUN, "--report", str(report)]
    for fault in faults(world):
        cmd += ["--inject", fault]
    started = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if not report.exists():
        raise SystemExit(f"{mesh}: the drill failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return {"mesh": mesh, "faults": faults(world), "exit": proc.returncode, "wall_s": round(time.monotonic() - started, 1),
            "report": json.loads(report.read_text())}


def table(result: dict) -> str:
    report = result["report"]
    alarms = {a["id"]: a for a in report["alarms"]}
    lines = [f"### {result['mesh']} (exit {result['exit']}, {result['wall_s']} s, "
             f"{'PASSED' if report['passed'] else 'FAILED'})", "",
             "| fault | outcome | check, step | named | why |", "|---|---|---|---|---|"]
    for row in report["injected"]:
        alarm = alarms.get(row["alarm"]) if row["alarm"] else None
        where = f"{alarm['check']}, {alarm['step']}" if alarm else "-"
        named = ("no rank" if alarm and not row["named"] else ", ".join(map(str, row["named"] or [])) or "-")
        spec = next(f for f in result["faults"] if f.startswith(row["kind"] + ":"))
        lines.append(f"| `{spec}` | {row['outcome']} | {where} | {named} | {row['why']} |")
    if report["unexplained_alarms"]:
        lines.append(f"\nunexplained alarms: {report['unexplained_alarms']}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mesh", action="append", choices=list(MESHES), help="default: all")
    parser.add_argument("--json", type=Path, help="write every run's result here")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for mesh in args.mesh or list(MESHES):
            result = run(mesh, Path(tmp))
            results.append(result)
            print(f"sdcguard drill {' '.join(MESHES[mesh] + RUN)} \\\n    "
                  + " ".join(f"--inject {f}" for f in result["faults"]))
            print(table(result) + "\n", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0 if all(r["report"]["passed"] and r["exit"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
