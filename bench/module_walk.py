"""Which of sdcguard's modules one step passes through, and how often it comes back to one it left.

    .venv/bin/python bench/module_walk.py [--layout ddp|hsdp|all]

A step whose code is easy to follow enters each module once and leaves it for good: reading it top
to bottom is reading the step. This bench traces, on rank 0, the Python calls and returns of one
ordinary step and one audit step (``with guard.step(...) as s: s.backward(batch); s.check();
opt.step()``) of bench/gpt.py's TinyGPT under DDP (2 gloo ranks, one per simulated node) and under
HSDP (a 2 x 2 mesh, 4 ranks), with ``sys.setprofile`` on every thread. Each event in a frame of the
``sdcguard`` package (or of this script: the user's loop) is attributed to its module, and a
per-thread stack of modules follows the calls and returns. The goal (issue 30): no return to a
module already left other than the user's own code and a shared helper — the helpers being the
leaf modules every check calls (``fingerprint``, ``checks.exchange``, ``checks.reduce_checksum``,
``checks.rng``, ``checks.norms``, ``checks.determinism``, ``contract.stats``) and the gate, which
the optimizer calls.

A move into another module by a call is a *callback* when that module is still below on the call
stack (it called something that calls back into it: ``step -> guard -> step``), a *revisit* when
it was left earlier in the step (a sequencer calling its parts in turn, or a ping-pong between two
modules), else a first *call*. Calls into the shared helpers and from the user's loop are not
counted as either. Prints, per layout and step kind: modules entered, moves by a call, callbacks
and revisits, and the pairs behind them. Run it on an older checkout (``PYTHONPATH`` pointing at
its package) to compare.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
AGENT = (HERE.parent / "agent").resolve()
USER = "<user loop>"
HELPERS = ("fingerprint", "checks.exchange", "checks.reduce_checksum", "checks.norms", "checks.rng", "gate",
           "checks.determinism", "contract.stats", "checks.verdict")
"""Leaf modules every check (or the optimizer) calls: a return to one is a call of a shared helper."""


def _module_of(filename: str) -> str | None:
    path = Path(filename)
    if filename == __file__ or path.name == Path(__file__).name:
        return USER
    try:
        rel = path.resolve().relative_to(AGENT)
    except (ValueError, OSError):
        return None
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) or "sdcguard"


class Walk:
    """Per thread, the stack of sdcguard's (and the user loop's) modules as calls and returns go."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.stacks: dict[int, list[tuple[Any, str]]] = {}
        self.entries: list[tuple[str, str, str]] = []
        """(kind, from, to) of every move into another module: ``call``, ``callback`` (into a module
        still below on the stack: a module calling back into its caller) or ``revisit`` (into a
        module left earlier in the step), and ``return``."""
        self.visited: set[str] = set()

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event not in ("call", "return"):
            return
        module = _module_of(frame.f_code.co_filename)
        if module is None:
            return
        with self.lock:
            stack = self.stacks.setdefault(threading.get_ident(), [])
            if event == "call":
                here = stack[-1][1] if stack else USER
                if module != here:
                    below = {m for _, m in stack[:-1]}
                    kind = "callback" if module in below else "revisit" if module in self.visited else "call"
                    self.entries.append((kind, here, module))
                    self.visited.add(here)
                    self.visited.add(module)
                stack.append((frame, module))
            elif stack and stack[-1][0] is frame:
                stack.pop()
                if stack and stack[-1][1] != module:
                    self.entries.append(("return", module, stack[-1][1]))

    def summary(self) -> dict[str, Any]:
        moves = [e for e in self.entries if e[0] != "return"]
        # A shared helper may be called from anywhere, again and again; the user's loop calls each
        # verb in turn: neither makes the step harder to follow.
        def counted(kind: str) -> list[str]:
            return [f"{a} -> {b}" for k, a, b in moves
                    if k == kind and b != USER and a != USER and not b.startswith(HELPERS)]
        callbacks, revisits = counted("callback"), counted("revisit")
        modules = sorted({m for _, a, b in self.entries for m in (a, b)} - {USER})
        return {"modules": len(modules), "entries": len(moves), "callbacks": len(callbacks),
                "revisits": len(revisits), "outside": sorted(set(callbacks)), "revisited": sorted(set(revisits)),
                "names": modules}


def worker(layout: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(HERE))
    from gpt import TinyGPT, lm_batch, lm_loss

    import sdcguard

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    torch.manual_seed(0)
    module = TinyGPT()
    if layout == "hsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        for block in module.blocks:
            fully_shard(block, mesh=mesh)
        model = fully_shard(module, mesh=mesh)
        per_node = 2
    else:
        from torch.nn.parallel import DistributedDataParallel
        model, per_node = DistributedDataParallel(module), 1
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = sdcguard.Guard(model, opt, lm_loss, config=sdcguard.Config(audit_every=0, weight_check_every=0,
                                                                        ranks_per_node=per_node))

    def one(step: int, audit: bool) -> None:
        opt.zero_grad(set_to_none=True)
        with guard.step(step, audit=audit) as s:
            s.backward(lm_batch(step, rank))
            s.check()
            opt.step()

    results = {}
    for step in range(3):  # warm-up: DDP's bucket rebuild, AdamW's state, first-use imports
        one(step, audit=step == 1)
    for kind, step, audit in (("ordinary", 3, False), ("audit", 4, True)):
        walk = Walk()
        if rank == 0:
            threading.setprofile(walk)
            sys.setprofile(walk)
        try:
            one(step, audit)
        finally:
            sys.setprofile(None)
            threading.setprofile(None)  # type: ignore[arg-type]
        results[kind] = walk.summary()
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    guard.close()
    dist.barrier()
    dist.destroy_process_group()


def run(layout: str) -> dict[str, Any]:
    ranks = 4 if layout == "hsdp" else 2
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "walk.json")
        env = {k: v for k, v in os.environ.items() if not k.startswith("SDCGUARD_")}
        env.update(OMP_NUM_THREADS="1", PYTHONSAFEPATH="1")
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               f"--nproc_per_node={ranks}", __file__, "--layout", layout, "--worker", out],
                              capture_output=True, text=True, env=env, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"module_walk {layout} failed:\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
        return json.loads(Path(out).read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layout", choices=("ddp", "hsdp", "all"), default="all")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--sequence", action="store_true", help="print the modules each step enters")
    args = parser.parse_args()
    if args.worker:
        worker(args.layout, args.worker)
        return 0
    print("| layout | step | modules entered | moves by a call | callbacks | revisits |")
    print("|---|---|---|---|---|---|")
    detail = []
    for layout in (("ddp", "hsdp") if args.layout == "all" else (args.layout,)):
        for kind, r in run(layout).items():
            print(f"| {layout} | {kind} | {r['modules']} | {r['entries']} | {r['callbacks']} | {r['revisits']} |")
            detail.append((layout, kind, r))
    for layout, kind, r in detail:
        if r["outside"]:
            print(f"\n{layout} {kind}: callbacks: {', '.join(r['outside'])}")
        if r["revisited"]:
            print(f"\n{layout} {kind}: revisits: {', '.join(r['revisited'])}")
        if args.sequence:
            print(f"\n{layout} {kind}: modules {', '.join(r['names'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
