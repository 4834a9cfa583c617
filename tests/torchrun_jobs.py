"""Launching the integration tests' training jobs: ``torchrun`` on gloo with one thread per rank,
the job's settings from its own flags (never from an ``SDCGUARD_*`` the test process inherited),
and the files every rank and the spool leave behind."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def job_env(spool: Path | None = None, **extra: str) -> dict[str, str]:
    """The environment of a job: the test's own minus ``SDCGUARD_*``, one thread per rank (bitwise
    replays need equal thread counts), ``PYTHONSAFEPATH`` as the Makefile sets it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SDCGUARD_")}
    env.update(OMP_NUM_THREADS="1", PYTHONSAFEPATH="1", **extra)
    if spool is not None:
        env["SDCGUARD_SPOOL"] = str(spool)
    return env


def command(ranks: int, script: Path | str, *argv: Any) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
            str(script), *map(str, argv)]


def torchrun(ranks: int, script: Path | str, *argv: Any, spool: Path | None = None, timeout: float = 900,
             check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run the job to its end; with ``check``, fail the test with the end of its output unless it exits 0."""
    proc = subprocess.run(command(ranks, script, *argv), capture_output=True, text=True, timeout=timeout,
                          env=job_env(spool), cwd=ROOT)
    if check:
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return proc


def start(ranks: int, script: Path | str, *argv: Any, spool: Path | None = None) -> subprocess.Popen[str]:
    """Start the job and return at once (jobs that run side by side: start-up dominates them)."""
    return subprocess.Popen(command(ranks, script, *argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=job_env(spool), cwd=ROOT)


def rank_results(out: Path, ranks: int, *, present_only: bool = False) -> list[dict[str, Any]]:
    """Every rank's ``result-rank<r>.json`` (with ``present_only``, those that were written)."""
    paths = [out / f"result-rank{r}.json" for r in range(ranks)]
    return [json.loads(p.read_text()) for p in paths if not present_only or p.exists()]


def spooled_alarms(spool: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(Path(spool).glob("*.alarm.json"))]


def spooled_stats(spool: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted((Path(spool) / "stats").glob("rank-*.json"))]
