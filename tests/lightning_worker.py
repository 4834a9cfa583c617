"""Runs an example's scripts one after another in one torchrun job (tests/test_integration_lightning.py,
tests/test_integration_lightning_fsdp.py).

    torchrun --nproc_per_node=3 tests/lightning_worker.py PLAN.json [EXAMPLE]

EXAMPLE is the folder under examples/ (default ``lightning``; ``lightning_fsdp``).

PLAN is a list of ``{"script": "train.py" | "train_plain.py", "flags": [...]}``, optionally with
``"env": {NAME: VALUE}`` (set for that run only) and
``"resume_as_alarmed": OUT`` (resume as the alarm of an earlier run in OUT says: its
last_good_checkpoint, step and sha256); its alarms and statistics go to the spool ``OUT/spool``
(``--out``'s value). Each runs in this
process as ``python SCRIPT FLAGS`` would (``runpy``), so one process launch (Lightning's import,
the process group) serves many runs. What a run raises (``SDCDetected`` ...) is the script's
result, recorded by its harness callback in its ``--out``; the next run starts once every rank is
done with this one.
"""
import json
import os
import runpy
import sys

import torch.distributed as dist

from sdcguard.child_process import exit_without_finalizing

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def resume_flags(out: str | None) -> list[str]:
    if out is None:
        return []
    with open(os.path.join(out, "result-rank0.json")) as fh:
        [alarm] = json.load(fh)["alarms"]
    return ["--resume", alarm["last_good_checkpoint"], "--expect-step", str(alarm["last_good_checkpoint_step"]),
            "--expect-sha256", alarm["last_good_checkpoint_sha256"]]


def main() -> None:
    with open(sys.argv[1]) as fh:
        plan = json.load(fh)
    example = os.path.join(EXAMPLES, sys.argv[2] if len(sys.argv) > 2 else "lightning")
    outcomes = []
    for run in plan:
        script = os.path.join(example, run["script"])
        flags = run["flags"]
        os.environ["SDCGUARD_SPOOL"] = os.path.join(flags[flags.index("--out") + 1], "spool")
        extra = run.get("env", {})  # this run's own variables (SDCGUARD_RANKS_PER_NODE ...), gone after it
        os.environ.update(extra)
        sys.argv = [script, *flags, *resume_flags(run.get("resume_as_alarmed"))]
        try:
            runpy.run_path(script, run_name="__main__")
            outcomes.append(None)
        except Exception as exc:  # noqa: BLE001 - the run's own outcome, recorded by its harness
            outcomes.append(type(exc).__name__)
        for name in extra:
            os.environ.pop(name, None)
        if dist.is_initialized():
            dist.barrier()
    if dist.is_initialized():
        dist.destroy_process_group()
    print(json.dumps({"rank": os.environ.get("RANK"), "outcomes": outcomes}))


if __name__ == "__main__":
    main()
    exit_without_finalizing(0)  # FSDP2's gloo ops at finalization (see its docstring)
