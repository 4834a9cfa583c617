"""False-alarm run: a fault-free drill with check 2 (and check 3) on every step.

    .venv/bin/python bench/false_alarms.py [--steps 2000] [--nodes 3] [--ranks-per-node 1]

Runs the real drill (multi-process DDP, gloo, dropout, 2 micro-batches) with no fault injected and
prints how many alarms fired over how many audited steps. Any alarm here is a false alarm.
"""
import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--ranks-per-node", type=int, default=1)
    parser.add_argument("--micro-batches", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        report_path = Path(tmp, "report.json")
        started = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "sdcguard.cli", "drill", "--nodes", str(args.nodes),
             "--ranks-per-node", str(args.ranks_per_node), "--steps", str(args.steps),
             "--audit-every", "1", "--weight-check-every", "1",
             "--micro-batches", str(args.micro_batches), "--report", str(report_path)],
            stdout=subprocess.DEVNULL,
        )
        elapsed = time.monotonic() - started
        report = json.loads(report_path.read_text())
    world = args.nodes * args.ranks_per_node
    print(f"ranks: {world} ({args.nodes} nodes x {args.ranks_per_node})")
    print(f"steps completed: {report['steps_completed']} of {args.steps}, every one audited (check 2) and weight-checked (check 3)")
    print(f"replays compared: {report['steps_completed'] * world}")
    print(f"false alarms: {len(report['alarms'])}")
    print(f"wall time: {elapsed:.0f} s")
    return 0 if proc.returncode == 0 and not report["alarms"] and report["steps_completed"] == args.steps else 1


if __name__ == "__main__":
    sys.exit(main())
