"""Bytes each rank contributes per check, as the world size and the parameter count grow.

    .venv/bin/python bench/exchange_bytes.py

For W in (2, 4, 6) ranks (gloo, 2 ranks per node) and two model sizes, runs a few steps twice —
ordinary steps (check 1 only), then steps that are all audited and weight-checked (checks 1, 2, 3)
— and reads sdcguard's own traffic counters (`sdcguard.checks.exchange.TRAFFIC`: what this rank put into
each exchange, before any collective algorithm copies it). Columns: check 1's norms; agreements
(16-byte all-reduces: on an audit step one covers checks 1, 2 and 3; check 3 after the update has
its own); digests (the note sent with the batch: the digest of the owner's pass, 16 B); the batch
and its 8-byte size; details (only on a mismatch). A check that scales sends a fixed-size digest
whatever W and the parameter count; batches scale with the batch, not the model.
"""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

STEPS = 4


def worker(out: str, width: int, audited: bool) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    import sdcguard
    from sdcguard.checks.exchange import TRAFFIC

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.ReLU(), torch.nn.Linear(width, 64))
    ddp = DistributedDataParallel(model)
    guard = sdcguard.Guard(ddp, torch.optim.SGD(model.parameters(), lr=1e-3),
                           lambda m, b: F.mse_loss(m(b[0]), b[1]),
                           config=sdcguard.Config(audit_every=int(audited), weight_check_every=int(audited),
                                                  ranks_per_node=2))
    TRAFFIC.clear()
    g = torch.Generator().manual_seed(rank)
    for step in range(STEPS):
        guard.train_step(step, (torch.randn(32, 64, generator=g), torch.randn(32, 64, generator=g)))
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        Path(out).write_text(json.dumps({"params": params, "traffic": {k: v / STEPS for k, v in TRAFFIC.items()}}))
    dist.destroy_process_group()


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]), sys.argv[4] == "audited")
        return 0
    print(f"{'steps':8s} {'W':>3s} {'params':>9s} {'norms B':>8s} {'agreements B':>13s} {'digests B':>10s} "
          f"{'batch B':>8s} {'details B':>10s}  (per rank per step)")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for mode, world, width in [(m, w, p) for m in ("ordinary", "audited") for w in (2, 4, 6) for p in (64, 4096)]:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp, "r.json")
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            f"--nproc_per_node={world}", __file__, "--worker", str(out), str(width), mode],
                           check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            r = json.loads(out.read_text())
        t = r["traffic"]
        print(f"{mode:8s} {world:3d} {r['params']:9d} {t.get('norms', 0):8.0f} {t.get('agreements', 0):13.0f} "
              f"{t.get('digests', 0):10.0f} {t.get('batches', 0):8.0f} {t.get('details', 0):10.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
