"""Where an audit step's time goes: a per-phase account, per rank, against a plain step of the same run.

    .venv/bin/python bench/phases.py [--steps 60] [--ranks 3] [--sharded RxS] [--counts 2]

Launches gloo ranks (one thread each) training bench/gpt.py's TinyGPT, DDP on ``--ranks`` ranks or
FSDP2 over an ``R x S`` (replicate, shard) mesh with ``--sharded RxS`` (``fully_shard`` per block
and on the root, as bench/overhead.py). Four things run on their own replica, **interleaved one
step at a time** (the order rotates every step, a barrier before each), so that a burst of noise on
this shared machine lands on all of them alike:

  plain     zero_grad, forward + backward, AdamW (FSDP2: the same on the sharded replica);
  ordinary  the same through ``guard.step`` with audits off (checks 1 and 4 only);
  audit     the same through ``guard.step`` with ``audit_every=1`` (checks 1-4, the ring replay);
  floor     what a replay must cost: the bare module's forward + backward (DDP: ``autograd.grad``
            on the bare module; FSDP2: a replica with gradient reduction off), as bench/overhead.py.

Each audit step is cut into phases by wrapping the library's own functions for this run (a
benchmark may; the library is not changed). Wall time (``perf_counter``), **exclusive**: a phase's
figure leaves out the phases it calls (the replay's "forward + backward" is what is left of the
replay once its buffers, fingerprints and FSDP bookkeeping are taken out), so the phases never
overlap and add up, with "the rest" (the original forward, backward and update), to the step. A
figure is the median over the steps of that phase's time on that rank, printed in ms and as a
share of the same rank's median plain step. Bottom lines: the audit step against the plain step,
the ordinary checked step and the floor, as medians of per-step differences (paired by step).

``--counts N`` then runs N more audit steps and N plain ones under bench/step_account.py's
counters (tensor methods that read a value to the host; every c10d collective with its payload
bytes): host syncs and collectives per phase of an audit step, beside the plain step's.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterator

HERE = Path(__file__).resolve().parent
CONFIGS = ("plain", "ordinary", "audit", "floor")
REST = "the rest: original forward + backward + update"
REST_ORDINARY = "(the same rest in an ordinary checked step)"
AGREEMENT = "agreement + vote all-reduces 16 B, waited together (wait for the slowest replay)"
"""On an audit step check 1's vote travels during the audit and is waited for with the agreement
(its start is the "vote all-reduce" phase)."""


class Clock:
    """Exclusive wall time per phase of the current step, on every thread."""

    def __init__(self) -> None:
        self.tls = threading.local()
        self.lock = threading.Lock()
        self.step: dict[str, float] = defaultdict(float)
        self.on = False
        self.counting = False

    def stack(self) -> list[list[Any]]:
        if not hasattr(self.tls, "stack"):
            self.tls.stack = []
        return self.tls.stack

    def in_replay(self) -> bool:
        return any(name.startswith("replay") for name, _ in self.stack())

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if not self.on:
            yield
            return
        stack = self.stack()
        stack.append([name, 0.0])
        started = time.perf_counter()
        try:
            if self.counting:
                import step_account
                with step_account.label(name):
                    yield
            else:
                yield
        finally:
            spent = time.perf_counter() - started
            _, inner = stack.pop()
            if stack:
                stack[-1][1] += spent
            with self.lock:
                self.step[name] += spent - inner

    def take(self) -> dict[str, float]:
        with self.lock:
            out, self.step = dict(self.step), defaultdict(float)
        return out


def instrument(clock: Clock, sharded: bool) -> None:
    """Wrap the library's functions, each as the phase it does (see the module docstring)."""
    import sdcguard.step
    from sdcguard import verification
    from sdcguard.checks import audit, commhook, exchange, reduce_checksum, replay
    from sdcguard.contract import stats
    from sdcguard.layouts import base as layouts_base
    from sdcguard.layouts import data_parallel, fsdp

    def fn(phase: str, inner: Callable[..., Any], in_replay: str | None = None) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            with clock.phase(in_replay if in_replay and clock.in_replay() else phase):
                return inner(*args, **kwargs)
        return timed

    def cm(phase: str, inner: Callable[..., Any]) -> Callable[..., Any]:
        """A context manager's entry and exit as ``phase``, not its body."""
        @contextlib.contextmanager
        def timed(*args: Any, **kwargs: Any) -> Iterator[Any]:
            with clock.phase(phase):
                manager = inner(*args, **kwargs)
                value = manager.__enter__()
            try:
                yield value
            except BaseException:
                with clock.phase(phase):
                    if not manager.__exit__(*sys.exc_info()):
                        raise
            else:
                with clock.phase(phase):
                    manager.__exit__(None, None, None)
        return timed

    layout = fsdp.Sharded if sharded else data_parallel.DataParallel
    patches: list[tuple[Any, str, str, str | None]] = [
        (sdcguard.step, "fingerprint_sums", "owner's recording: loss fingerprint", None),
        (replay.ForwardBuffers, "__call__", "owner's recording: forward buffers", None),
        (reduce_checksum.ChecksumWeights, "terms", "checks 1+4: comm hook (every step)", None),
        (reduce_checksum.ChecksumWeights, "checksum", "checks 1+4: comm hook (every step)", None),
        (layout, "vote", "checks 1+4: vote (every step)", None),
        (verification, "sum_votes", "checks 1+4: vote all-reduce 16 B (every step)", None),
        (verification, "start_sum", "checks 1+4: vote all-reduce 16 B (every step)", None),
        (verification, "judge_checksum", "checks 1+4: judge (every step)", None),
        (sdcguard.step.Step, "record", "step record (payload)", None),
        (layout, "own_pass", "own pass: fingerprints to host", None),
        (replay.PassResult, "digest", "digests (own pass, replay)", None),
        (verification, "serialize", "ring post: serialize the batch", None),
        (layout, "post_batch", "ring post: sizes + notes round trip, bytes posted", None),
        (layout, "fingerprint_weights", "weights fingerprint (check 3 before the update)", None),
        (layout, "weights_token", "weights token (sharded: the replica group's 16 B agreement)", None),
        (layouts_base, "wait", "weights token (sharded: the replica group's 16 B agreement)", None),
        (exchange.Incoming, "receive", "ring post: wait for + load the batch", None),
        (audit.Replayer, "run", "replay: forward + backward", None),
        (replay, "snapshot_buffers", "replay: buffers saved / put back", "replay: buffers saved / put back"),
        (replay, "load_buffers", "replay: buffers saved / put back", "replay: buffers saved / put back"),
        (replay, "_result", "replay: gradient fingerprints", None),
        (replay, "fingerprint", "replay: loss fingerprints", None),
        (verification, "start_agreement", AGREEMENT, None),
        (verification, "wait", AGREEMENT, None),
        (verification, "gather_digests", "judges: digests gathered (mismatch only)", None),
        (verification.Verifier, "_weights_verified", "judges (clean step: bookkeeping)", None),
        (stats.CheckStats, "timed", "statistics", None),
        (stats.CheckStats, "flush", "statistics", None),
    ]
    if sharded:
        from sdcguard.sharding import reduce_record
        from sdcguard.sharding import replay as sreplay
        patches += [
            (sreplay.ShardedReplayer, "run", "replay: forward + backward", None),
            # what Sharded.replay adds around the receive and the replay: the readiness agreement
            (fsdp.Sharded, "replay", "replay: readiness agreement 16 B (sharded)", None),
            (reduce_record, "fingerprint_sums", "owner's recording: unit input fingerprints",
             "replay: gradient fingerprints"),
            (sreplay, "to_fingerprints", "replay: gradient fingerprints", None),
            (sreplay, "fingerprint", "replay: loss fingerprints", None),
            (sreplay, "snapshot_buffers", "replay: buffers saved / put back", None),
            (sreplay, "load_buffers", "replay: buffers saved / put back", None),
        ]
    else:
        patches += [(commhook.GradientRecorder, "record_fingerprints",
                     "owner's recording: bucket fingerprints (comm hook)", None)]
    for owner, name, phase, in_replay in patches:
        if hasattr(owner, name):  # (an older tree, for an A/B, may lack one)
            setattr(owner, name, fn(phase, getattr(owner, name), in_replay))
    sdcguard.step.deterministic = cm("determinism switching", sdcguard.step.deterministic)
    if sharded:
        from sdcguard.sharding import replay as sreplay
        sreplay._isolated = cm("replay: FSDP2 state set aside / put back", sreplay._isolated)


def worker(out: str, steps: int, sharded: str | None, counts: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    sys.path.insert(0, str(HERE))
    from gpt import TinyGPT, lm_batch, lm_loss

    import sdcguard
    from sdcguard.checks.rng import forward_seed, seeded

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    clock = Clock()
    instrument(clock, bool(sharded))

    if sharded:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        replicas, shards = (int(x) for x in sharded.lower().split("x"))
        mesh = (init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard")) if replicas > 1
                else init_device_mesh("cpu", (shards,), mesh_dim_names=("shard",)))

        def replica() -> tuple[Any, Any]:
            torch.manual_seed(0)
            module = TinyGPT()
            for block in module.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(module, mesh=mesh)
            return module, module
    else:
        def replica() -> tuple[Any, Any]:
            torch.manual_seed(0)
            module = TinyGPT()
            return module, DistributedDataParallel(module)

    _, plain_model = replica()
    plain_opt = torch.optim.AdamW(plain_model.parameters(), lr=1e-3)

    def plain(step: int) -> None:
        plain_opt.zero_grad(set_to_none=True)
        with seeded(forward_seed(0, step, rank, 0), torch.device("cpu")):
            loss = lm_loss(plain_model, lm_batch(step, rank))
        loss.backward()
        plain_opt.step()

    def checked(audit_every: int) -> tuple[Callable[[int], None], Any]:
        _, model = replica()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        guard = sdcguard.Guard(model, opt, lm_loss, config=sdcguard.Config(audit_every=audit_every,
                                                                            weight_check_every=0))

        def run(step: int) -> None:
            opt.zero_grad(set_to_none=True)
            with guard.step(step) as s:
                s.backward(lm_batch(step, rank))
                s.check()
                opt.step()
        return run, guard

    ordinary, _ = checked(0)
    audited, guard = checked(1)
    bare, bare_model = replica()
    if sharded:
        bare_model.set_requires_gradient_sync(False)  # a replay reduces nothing

    def floor(step: int) -> None:
        with seeded(forward_seed(0, step, rank, 0), torch.device("cpu")):
            loss = lm_loss(bare, lm_batch(step, rank))
        if sharded:
            loss.backward()
            for p in bare.parameters():
                p.grad = None
        else:
            torch.autograd.grad(loss, list(bare.parameters()))

    fns = dict(zip(CONFIGS, (plain, ordinary, audited, floor)))
    for step in range(3):  # warm-up: lazy inits, DDP's bucket rebuild, AdamW's state
        for fn in fns.values():
            fn(step)
    walls: dict[str, list[float]] = {c: [] for c in CONFIGS}
    phases: dict[str, list[dict[str, float]]] = {"ordinary": [], "audit": []}
    for step in range(10, 10 + steps):
        k = step % len(CONFIGS)
        for name in CONFIGS[k:] + CONFIGS[:k]:
            dist.barrier()
            clock.on = name in phases
            started = time.perf_counter()
            fns[name](step)
            walls[name].append(time.perf_counter() - started)
            clock.on = False
            if name in phases:
                phases[name].append(clock.take())
    counted: dict[str, Any] = {}
    if counts:
        import step_account
        tallies = {"plain": step_account.Counts(), "audit": step_account.Counts()}
        for step in range(10 + steps, 10 + steps + counts):
            for name in ("plain", "audit"):
                dist.barrier()
                clock.on = clock.counting = name == "audit"
                with step_account.counting(tallies[name]):
                    fns[name](step)
                clock.on = clock.counting = False
                clock.take()
        counted = {name: step_account.summarize(c, counts) for name, c in tallies.items()}
    topo = guard.topology
    ring = {r: topo.replay_target(r) for r in range(topo.world_size)}
    Path(out, f"rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "walls": walls, "phases": phases, "counts": counted, "ring": ring}))
    dist.barrier()
    dist.destroy_process_group()


def single(steps: int) -> None:
    """``--single``: the cuts of issue 34 in one process, interleaved step by step in a random
    order (no collective, so no rank waits for another): a bare forward + backward, the same in
    sdcguard's deterministic mode and with torch's NaN filling of new tensors that the mode used to
    leave on, and a one-micro-batch replay as it runs now and with the per-parameter accumulation
    hooks it used to register."""
    import collections
    import random

    import torch
    import torch.utils.deterministic as fill

    sys.path.insert(0, str(HERE))
    from gpt import TinyGPT, lm_batch, lm_loss

    from sdcguard.checks import replay as rp
    from sdcguard.checks.determinism import deterministic
    from sdcguard.checks.rng import forward_seed, seeded

    torch.set_num_threads(1)
    torch.manual_seed(0)
    module = TinyGPT()
    params = list(enumerate(module.parameters()))
    payload = rp.Payload(1, 0, [lm_batch(1, 0)])

    def bare(hooks: bool = False) -> None:
        grads: dict[int, torch.Tensor] = {}
        held: collections.Counter[int] = collections.Counter()
        handles = [p.register_hook(rp._accumulator(grads, held, i)) for i, p in params] if hooks else []
        with seeded(forward_seed(0, 1, 0, 0), torch.device("cpu")):
            loss = lm_loss(module, lm_batch(1, 0))
        torch.autograd.grad(loss, [p for _, p in params])
        for handle in handles:
            handle.remove()

    def filled() -> None:
        with deterministic(True):
            fill.fill_uninitialized_memory = True
            bare()

    def replayed() -> None:
        with deterministic(True):
            rp.replay(module, lm_loss, params, payload, seed=0, device=torch.device("cpu"))

    cases = {"forward + backward": bare,
             "  in deterministic mode (as now)": lambda: _in(deterministic(True), bare),
             "  in deterministic mode, NaN-filled allocations (before)": filled,
             "  with the per-parameter hooks a replay registered (before)": lambda: bare(hooks=True),
             "one-micro-batch replay, deterministic (as now)": replayed}
    times: dict[str, list[float]] = {name: [] for name in cases}
    for fn in cases.values():
        fn()
    for _ in range(steps):
        for name in random.sample(list(cases), len(cases)):
            started = time.perf_counter()
            cases[name]()
            times[name].append(time.perf_counter() - started)
    base = _median(times["forward + backward"])
    print(f"one process, 1 thread, TinyGPT, {steps} of each interleaved in random order; medians")
    print("| pass | ms | x bare forward + backward |\n|---|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {_median(ts) * 1e3:.2f} | {_median(ts) / base:.3f} |")


def _in(manager: Any, fn: Callable[[], None]) -> None:
    with manager:
        fn()


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def account(results: list[dict[str, Any]]) -> list[str]:
    """The table: per phase and rank, the median ms and its share of that rank's median plain step."""
    lines = []
    names: list[str] = []
    for r in results:
        for step in r["phases"]["audit"]:
            names += [n for n in step if n not in names]
    per_rank = []
    for r in results:
        plain = _median(r["walls"]["plain"])
        audit_steps = r["phases"]["audit"]
        rows = {n: _median([s.get(n, 0.0) for s in audit_steps]) for n in names}
        rest = [w - sum(s.values()) for w, s in zip(r["walls"]["audit"], audit_steps)]
        rows[REST] = _median(rest)
        ordinary = [w - sum(s.values()) for w, s in zip(r["walls"]["ordinary"], r["phases"]["ordinary"])]
        rows[REST_ORDINARY] = _median(ordinary)
        per_rank.append((plain, rows))
    order = sorted(names, key=lambda n: -sum(rows[n] for _, rows in per_rank)) + [REST, REST_ORDINARY]
    head = " | ".join(f"rank {r['rank']} ms (share)" for r in results)
    lines.append(f"| phase of an audit step | {head} |")
    lines.append("|---|" + "---|" * len(results))
    for n in order:
        cells = " | ".join(f"{rows[n] * 1e3:.3f} ({rows[n] / plain:+.3f})" for plain, rows in per_rank)
        lines.append(f"| {n} | {cells} |")
    lines.append("")
    lines.append("| per step (medians; differences paired by step) | " + " | ".join(f"rank {r['rank']}" for r in results) + " |")
    lines.append("|---|" + "---|" * len(results))

    def paired(r: dict[str, Any], a: str, *minus: str) -> float:
        w = r["walls"]
        return _median([x - sum(w[m][i] for m in minus) for i, x in enumerate(w[a])])

    rows = [
        ("plain step, ms", lambda r: f"{_median(r['walls']['plain']) * 1e3:.1f}"),
        ("floor (bare forward + backward) / plain", lambda r: f"{_median(r['walls']['floor']) / _median(r['walls']['plain']):.3f}"),
        ("ordinary checked step - plain, / plain", lambda r: f"{paired(r, 'ordinary', 'plain') / _median(r['walls']['plain']):+.3f}"),
        ("audit step - plain, / plain", lambda r: f"{paired(r, 'audit', 'plain') / _median(r['walls']['plain']):+.3f}"),
        ("**audit step - ordinary - floor, / plain** (above the replay)",
         lambda r: f"**{paired(r, 'audit', 'ordinary', 'floor') / _median(r['walls']['plain']):+.3f}**"),
        ("audit phases outside the replay's forward + backward, / plain", lambda r: f"{_outside(r):+.3f}"),
    ]
    for title, cell in rows:
        lines.append(f"| {title} | " + " | ".join(cell(r) for r in results) + " |")
    return lines


def _outside(r: dict[str, Any]) -> float:
    """The audit-only phases' medians summed (checks 1+4 and the replay's forward + backward left out)."""
    plain = _median(r["walls"]["plain"])
    steps = r["phases"]["audit"]
    names = {n for s in steps for n in s if not n.startswith("checks 1+4") and n != "replay: forward + backward"}
    return sum(_median([s.get(n, 0.0) for s in steps]) for n in names) / plain


def counts_table(results: list[dict[str, Any]]) -> list[str]:
    r0 = results[0]["counts"]
    if not r0:
        return []
    lines = ["| phase of an audit step (rank 0) | host syncs | collectives (payload bytes) |", "|---|---|---|"]
    audit = r0["audit"]["by_label"]
    where = sorted(set(audit.get("sync", {})) | set(audit.get("coll", {})))
    tot_s = tot_c = tot_b = 0.0
    for w in where:
        syncs = audit.get("sync", {}).get(w, {})
        colls = audit.get("coll", {}).get(w, {})
        s = sum(syncs.values())
        c = sum(colls.values())
        b = sum(n * int(k.rsplit(" ", 2)[1]) for k, n in colls.items())
        tot_s, tot_c, tot_b = tot_s + s, tot_c + c, tot_b + b
        name = "outside the phases: the training step's own (DDP/FSDP2, AdamW)" if w == "other" else w
        lines.append(f"| {name} | {s:g} ({', '.join(f'{k} x{v:g}' for k, v in syncs.items())}) | "
                     f"{c:g} ({', '.join(f'{k} x{v:g}' for k, v in colls.items())}) |")
    plain = r0["plain"]["total"]
    ps, pc = sum(plain.get("sync", {}).values()), sum(plain.get("coll", {}).values())
    pb = sum(n * int(k.rsplit(" ", 2)[1]) for k, n in plain.get("coll", {}).items())
    lines.append(f"| **audit step, all** | {tot_s:g} | {tot_c:g} ({tot_b:,.0f} B) |")
    lines.append(f"| plain step, all | {ps:g} | {pc:g} ({pb:,.0f} B) |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="steps of each configuration")
    parser.add_argument("--ranks", type=int, default=3, help="DDP ranks")
    parser.add_argument("--sharded", metavar="RxS", help="FSDP2 over an R x S (replicate, shard) mesh instead of DDP")
    parser.add_argument("--counts", type=int, default=2, help="audit and plain steps counted after the timed ones (0: none)")
    parser.add_argument("--json", help="also write every rank's figures here")
    parser.add_argument("--single", action="store_true",
                        help="instead: the cuts of issue 34 timed in one process (see single())")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.single:
        single(args.steps)
        return 0
    if args.worker:
        worker(args.worker, args.steps, args.sharded, args.counts)
        return 0
    ranks = args.ranks
    if args.sharded:
        replicas, shards = (int(x) for x in args.sharded.lower().split("x"))
        ranks = replicas * shards
    with tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SDCGUARD_")}
        env.update(OMP_NUM_THREADS="1")
        extra = ["--sharded", args.sharded] if args.sharded else []
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
                        __file__, "--steps", str(args.steps), "--counts", str(args.counts), *extra, "--worker", tmp],
                       check=True, env=env)
        results = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(ranks)]
    if args.json:
        Path(args.json).write_text(json.dumps(results))
    model = f"FSDP2 {args.sharded} mesh (fully_shard per block and root)" if args.sharded else "DDP"
    ring = results[0]["ring"]
    print(f"{ranks} gloo ranks, 1 thread each, TinyGPT, {model}; {args.steps} steps of each of plain / ordinary "
          f"checked / audited / floor, interleaved one step at a time; medians per rank")
    print("ring (who sends whom which batch): " + ", ".join(
        f"rank {t} sends its batch to rank {r}" for r, t in sorted(ring.items(), key=lambda kv: int(kv[0]))))
    print()
    print("\n".join(account(results)))
    table = counts_table(results)
    if table:
        print(f"\nCounted over {args.counts} audit steps (bench/step_account.py's counters), per step:")
        print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
