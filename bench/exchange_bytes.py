"""Bytes each rank contributes per check, as the world size and the parameter count grow.

    .venv/bin/python bench/exchange_bytes.py

For W in (2, 4, 6) ranks (gloo, 2 ranks per node) and two model sizes, runs a few steps with
checks 1, 2 and 3 on every step and reads sdcguard's own traffic counters (`sdcguard.exchange.TRAFFIC`:
what this rank put into each exchange, before any collective algorithm copies it). A check that
scales sends a fixed-size digest whatever W and the parameter count; batches for the replay scale
with the batch, not the model; details are sent only on a mismatch.
"""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

STEPS = 4


def worker(out: str, width: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    import sdcguard
    from sdcguard.exchange import TRAFFIC

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.ReLU(), torch.nn.Linear(width, 64))
    ddp = DistributedDataParallel(model)
    guard = sdcguard.Guard(ddp, torch.optim.SGD(model.parameters(), lr=1e-3),
                           lambda m, b: F.mse_loss(m(b[0]), b[1]),
                           config=sdcguard.Config(audit_every=1, weight_check_every=1, ranks_per_node=2))
    TRAFFIC.clear()
    g = torch.Generator().manual_seed(rank)
    for step in range(STEPS):
        guard.train_step(step, (torch.randn(32, 64, generator=g), torch.randn(32, 64, generator=g)))
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        Path(out).write_text(json.dumps({"params": params, "traffic": {k: v / STEPS for k, v in TRAFFIC.items()}}))
    dist.destroy_process_group()


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]))
        return 0
    print(f"{'W':>3s} {'params':>9s} {'norms B':>8s} {'digests B':>10s} {'batch B':>8s} {'details B':>10s}  (per rank per step, checks 1+2+3)")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for world in (2, 4, 6):
        for width in (64, 4096):
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp, "r.json")
                subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                f"--nproc_per_node={world}", __file__, "--worker", str(out), str(width)],
                               check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                r = json.loads(out.read_text())
            t = r["traffic"]
            print(f"{world:3d} {r['params']:9d} {t.get('norms', 0):8.0f} {t.get('digests', 0):10.0f} "
                  f"{t.get('batches', 0):8.0f} {t.get('details', 0):10.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
