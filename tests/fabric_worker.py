"""One torchrun job, several short runs of examples/fabric in turn (start-up is paid once): each
plan entry runs train.py's or train_plain.py's ``main`` in this process (the process group stays
up between runs) with its own SDCGUARD_* settings, or prepares a file for the next run. Each run
writes OUT/<name>/result-rank<R>.json (see examples/fabric/harness.py).

    torchrun --nproc_per_node=2 tests/fabric_worker.py PLAN.json

A plan entry: {"name", "script": "train" | "plain", "flags": [...], "env": {"SDCGUARD_...": ...}},
where a flag "sha256-of:PATH" becomes the sha256 PATH's manifest records; or {"tamper": PATH,
"copy_to": DIR}: rank 0 copies the checkpoint and its manifest and flips one byte of the copy.
"""
import json
import os
import shutil
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "fabric"
sys.path.insert(0, str(EXAMPLE))

import torch.distributed as dist  # noqa: E402

import train  # noqa: E402
import train_plain  # noqa: E402


def resolve(flag: str) -> str:
    if flag.startswith("sha256-of:"):
        path = flag.split(":", 1)[1]
        return json.loads(Path(f"{path}.sdcguard.json").read_text())["sha256"]
    return flag


def tamper(path: str, directory: str) -> None:
    if int(os.environ["RANK"]) == 0:
        target = Path(directory) / Path(path).name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, target)
        shutil.copy(f"{path}.sdcguard.json", f"{target}.sdcguard.json")
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 1
        target.write_bytes(bytes(data))
    dist.barrier()


def main() -> None:
    plan = json.loads(Path(sys.argv[1]).read_text())
    for entry in plan:
        if "tamper" in entry:
            tamper(entry["tamper"], entry["copy_to"])
            continue
        for var in [v for v in os.environ if v.startswith("SDCGUARD_")]:
            del os.environ[var]
        os.environ.update(entry.get("env", {}))
        script = train if entry["script"] == "train" else train_plain
        script.main([resolve(f) for f in entry["flags"]], teardown=False)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
