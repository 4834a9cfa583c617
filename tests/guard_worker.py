"""One rank of the library test, launched by tests/test_guard.py under torchrun (3 ranks, gloo).

Six scenarios share one launch, each writing what it saw to OUT/<scenario>-rank<r>.json:
  clean      plain DDP vs the same run under sdcguard (audit and weight check on every step,
             dropout, BatchNorm, 2 micro-batches), then a checkpoint saved and reloaded;
  scaler     GradScaler: an overflow that reproduces (no alarm, step skipped), then an injected
             grad-inf (alarm naming the rank), then a refused checkpoint;
  threads    unequal thread counts with audits on: a clear ConfigurationError at start-up;
  huge       finite float64 gradients whose squared norms would overflow if check 1 summed them over
             ranks: check 1 carries square roots, so nothing overflows (no alarm, step applied);
  replay_fails  rank 1's loss_fn raises while it replays rank 2's batch: every rank raises the
             same ReplayError (none hangs in the audit's agreement), and the step is not applied;
  confirmation_fails  the same in the replay that confirms rank 2's non-finite gradient (no
             audit): the same ReplayError everywhere, none left in the confirmation's gather;
  tiebreak_fails  rank 2's gradient corrupted, and the third opinion's replay (rank 0) fails: the
             alarm names both ranks of the pair (ambiguous), none left in the tie-break's broadcast;
  checkpoint_failures  a save whose state rank 0 cannot pickle, a load of a file one rank cannot
             see: an error on every rank, none left in the next collective;
  exchange   the agreement all-reduce (equal digests, one differing, one veto, digests that differ
             only past the bits it compares) and the ring transfer with its note;
  step_api   the user's own loop through guard.step (weight= accumulation, clipping, a scheduler,
             audits and weight checks on every step) against the same loop on plain DDP, bit for bit;
  data_inf   no GradScaler: one rank's batch makes an Inf loss wherever it is computed: the replay
             reproduces it, NonFiniteGradient on every rank, no alarm, nobody named;
  compiled   torch.compile(ddp) and DDP(torch.compile(module)) under audits on every step: no false
             alarm, and the same weights as the eager run;
  checksum   check 4 over real gloo all-reduces: adversarial-but-honest gradients (huge dynamic
             range, cancellation across ranks, zeros, near-overflow, subnormals) in float32,
             bfloat16 and float16 buckets raise nothing; a reduction that scales one element is
             caught as reduce-checksum naming nobody, the step not applied.
"""
import contextlib
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import sdcguard
from sdcguard.checkpoint import CheckpointError, load_checkpoint
from sdcguard.config import Config
from sdcguard.faults.spec import parse_fault
from sdcguard.fingerprint import digest, fingerprint
from sdcguard.faults.injector import FaultInjector
from sdcguard.checks.rng import forward_seed, seeded

STEPS, MICRO = 6, 2


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.2)
        self.out = nn.Linear(16, 3)

    def forward(self, x):
        return self.out(self.drop(F.relu(self.bn(self.inp(x)))))


def classify(module, batch):
    x, y = batch
    return F.cross_entropy(module(x), y)


def regress(module, batch):
    x, y = batch
    return F.mse_loss(module(x).sum(dim=1), y)


def batch(step, rank, micro, n=12):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    x = torch.randn(n, 8, generator=g)
    return x, (x[:, :3] * torch.tensor([1.0, -1.0, 0.5])).argmax(dim=1)


def state_digest(model, optimizer):
    """Bitwise summary of parameters, buffers, .grad and optimizer state."""
    tensors = [t for t in model.parameters()] + [b for b in model.buffers()]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    for st in optimizer.state.values():
        tensors += [v for v in st.values() if torch.is_tensor(v)]
    return digest(fingerprint(t) for t in tensors).hex()


def fresh(seed=0):
    torch.manual_seed(seed)
    model = Net()
    ddp = DistributedDataParallel(model)
    return model, ddp, torch.optim.AdamW(model.parameters(), lr=1e-2)


def plain_run(rank):
    """The reference: DDP without sdcguard, dropout seeded per (step, rank) the same way."""
    model, ddp, opt = fresh()
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        for i in range(MICRO):
            with ddp.no_sync() if i < MICRO - 1 else contextlib.nullcontext():
                with seeded(forward_seed(0, step, rank, i), torch.device("cpu")):
                    loss = classify(ddp, batch(step, rank, i))
                (loss / MICRO).backward()
        opt.step()
    return state_digest(model, opt)


def clean(rank, out):
    reference = plain_run(rank)
    model, ddp, opt = fresh()
    guard = sdcguard.Guard(ddp, opt, classify, config=Config(audit_every=1, weight_check_every=1))
    rng_before = torch.get_rng_state()
    for step in range(STEPS):
        guard.train_step(step, micro_batches=[batch(step, rank, i) for i in range(MICRO)])
    rng_after = torch.get_rng_state()
    guarded = state_digest(model, opt)
    path = guard.save_checkpoint(os.path.join(out, "ckpt.pt"), STEPS - 1)
    reloaded = Net()
    state = load_checkpoint(path, reloaded)
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), reloaded.parameters()))
    return {
        "reference": reference, "guarded": guarded, "alarms": guard.alarms_raised,
        "rng_untouched": torch.equal(rng_before, rng_after),
        "checkpoint": path, "checkpoint_step": state["step"], "reloaded_equal": same,
        "checkpoints": guard.checkpoints,
    }


def scaler(rank, out):
    torch.manual_seed(0)
    model = Net()
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    grad_scaler = torch.amp.GradScaler("cpu")
    injector = FaultInjector([parse_fault("grad-inf:rank=2:step=3", 3)], rank)
    injector.install(model.inp, model.out.weight, opt)
    guard = sdcguard.Guard(ddp, opt, regress, scaler=grad_scaler,
                           config=Config(audit_every=2, weight_check_every=1, ranks_per_node=1))
    seen = {"steps": {}}
    for step in range(5):
        injector.begin_step(step)
        x, _ = batch(step, rank, 0)
        y = x.sum(dim=1)
        if step == 1 and rank == 1:
            y = y * 1e36  # an honest overflow: this batch overflows wherever it is computed
        before = [p.detach().clone() for p in model.parameters()]
        scale = grad_scaler.get_scale()
        try:
            guard.train_step(step, (x, y))
        except sdcguard.SDCDetected as exc:
            seen["alarm"] = exc.alarm
            break
        changed = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
        seen["steps"][step] = {"applied": changed, "scale_before": scale, "scale_after": grad_scaler.get_scale()}
    try:
        guard.save_checkpoint(os.path.join(out, "after-alarm.pt"), 3)
        seen["refused"] = None
    except CheckpointError as exc:
        seen["refused"] = str(exc)
    return seen


def threads(rank, out):
    torch.set_num_threads(1 + (rank == 2))
    model, ddp, opt = fresh()
    try:
        sdcguard.Guard(ddp, opt, classify, config=Config(audit_every=10))
        return {"error": None}
    except sdcguard.ConfigurationError as exc:
        return {"error": str(exc)}
    finally:
        torch.set_num_threads(1)


class Scaled(nn.Module):
    """loss = sum(w * c): the gradient is exactly c, whatever w."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4, dtype=torch.float64))

    def forward(self, c):
        return (self.w * c).sum()


def huge(rank, out):
    from sdcguard.checks.exchange import TRAFFIC

    model = Scaled()
    ddp = DistributedDataParallel(model)
    guard = sdcguard.Guard(ddp, torch.optim.SGD(model.parameters(), lr=1e-160), lambda m, c: m(c),
                           config=Config(audit_every=0, weight_check_every=0))
    # Each rank's squared norm is 4 * (6e153)**2 = 1.44e308 (finite); three of them sum to Inf.
    c = torch.full((4,), 6e153, dtype=torch.float64)
    TRAFFIC.clear()
    try:
        guard.train_step(0, c)
        alarm = None
    except sdcguard.SDCDetected as exc:
        alarm = exc.alarm
    return {"alarm": alarm, "applied": bool((model.w != 0).all()), "norm_bytes": TRAFFIC["norms"]}


def replay_fails(rank, out):
    model = Scaled()
    ddp = DistributedDataParallel(model)

    def loss_fn(module, c):
        if sdcguard.replaying() and rank == 1 and float(c[0]) == 1.0:
            raise RuntimeError("out of memory (simulated)")
        return module(c)

    guard = sdcguard.Guard(ddp, torch.optim.SGD(model.parameters(), lr=0.5), loss_fn,
                           config=Config(audit_every=1, weight_check_every=0))
    seen = {}
    for step in range(2):
        before = model.w.detach().clone()
        try:
            guard.train_step(step, torch.full((4,), float(step), dtype=torch.float64))
            seen[step] = "ok"
        except sdcguard.ReplayError as exc:
            seen[step] = {"failures": exc.failures, "step": exc.step, "applied": not torch.equal(model.w, before)}
    return seen


def confirmation_fails(rank, out):
    model = Scaled()
    ddp = DistributedDataParallel(model)

    def loss_fn(module, c):
        if sdcguard.replaying() and rank == 1:
            raise RuntimeError("out of memory (simulated)")
        return module(c)

    guard = sdcguard.Guard(ddp, torch.optim.SGD(model.parameters(), lr=0.5), loss_fn,
                           config=Config(audit_every=0, weight_check_every=0))
    try:  # rank 2's gradient is Inf; rank 1, its replayer, fails to replay the batch
        guard.train_step(0, torch.full((4,), float("inf") if rank == 2 else 1.0, dtype=torch.float64))
        return "ok"
    except sdcguard.ReplayError as exc:
        return {"failures": exc.failures, "step": exc.step, "applied": bool((model.w != 0).any()),
                "confirmation": "confirmation" in str(exc)}


def tiebreak_fails(rank, out):
    model = Scaled()
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    injector = FaultInjector([parse_fault("grad-bitflip:rank=2:step=0", 3)], rank)
    injector.install(model, opt, param="w")

    def loss_fn(module, c):
        if sdcguard.replaying() and rank == 0 and float(c[0]) == 3.0:
            raise RuntimeError("out of memory (simulated)")  # rank 0 replaying rank 2's batch: the tie-break
        return module(c)

    guard = sdcguard.Guard(ddp, opt, loss_fn, config=Config(audit_every=1, weight_check_every=0, ranks_per_node=1))
    injector.begin_step(0)
    try:  # rank 2's own gradient is corrupted: ranks 1 (its replayer) and 2 disagree; 0 breaks the tie
        guard.train_step(0, torch.full((4,), rank + 1.0, dtype=torch.float64))
        return "no alarm"
    except sdcguard.SDCDetected as exc:
        return {"suspects": sorted(s["rank"] for s in exc.alarm["suspects"]), "ambiguous": exc.alarm["ambiguous"],
                "tiebreaks": exc.alarm["evidence"].get("tiebreaks"), "applied": bool((model.w != 0).any())}


def checkpoint_failures(rank, out):
    model = Scaled()
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    guard = sdcguard.Guard(ddp, opt, lambda module, c: module(c), config=Config(audit_every=0, weight_check_every=0))
    guard.train_step(0, torch.full((4,), 1.0, dtype=torch.float64))
    seen = {}
    try:  # rank 0 writes; what it cannot pickle fails there alone (before: a RuntimeError of its own)
        guard.save_checkpoint(os.path.join(out, "unpicklable.pt"), 0, state={"model": model.state_dict(),
                                                                            "hook": lambda: None})
        seen["save"] = "saved"
    except CheckpointError as exc:
        seen["save"] = str(exc)
    good = os.path.join(out, "good.pt")
    guard.save_checkpoint(good, 0)
    guard.train_step(1, torch.full((4,), 1.0, dtype=torch.float64))  # the weights move on from the file's
    before = model.w.detach().clone()
    try:  # rank 2's node does not see the file
        guard.load_checkpoint(good if rank != 2 else os.path.join(out, "not-on-this-node.pt"))
        seen["load"] = "loaded"
    except Exception as exc:  # noqa: BLE001 - the type is what the test looks at
        seen["load"] = f"{type(exc).__name__}: {exc}"
    seen["unchanged"] = torch.equal(model.w, before)  # no rank loaded it: the replicas still agree
    return seen


def exchange(rank, out):
    from sdcguard.checks.exchange import agree, ring_post, serialize

    cpu = torch.device("cpu")
    same = bytes(range(16))
    odd = bytes([255 - rank % 2 * 2]) + same[1:]  # rank 1 differs in the first byte
    low = same[:7] + bytes([rank]) + same[8:]     # differs past the 52 bits compared
    incoming = ring_post(serialize({"from": rank}), bytes([rank]) * 16, send_to=(rank + 1) % 3,
                         recv_from=(rank - 1) % 3, device=cpu, group=None)
    return {
        "equal": agree(same, cpu, None),
        "one_differs": agree(same if rank != 1 else odd, cpu, None),
        "one_vetoes": agree(same, cpu, None, veto=rank == 2),
        "beyond_52_bits": agree(low, cpu, None),
        "received": incoming.receive(), "note": incoming.note.hex(),
    }


def step_api_run(rank, guarded):
    torch.manual_seed(0)
    model = Net()
    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    guard = sdcguard.Guard(ddp, opt, classify, config=Config(audit_every=1, weight_check_every=1)) if guarded else None
    for step in range(STEPS):
        micro = [batch(step, rank, i) for i in range(MICRO)]
        if guarded:
            with guard.step(step, micro_batches=MICRO) as s:
                for m in micro:
                    s.backward(m, weight=1 / MICRO)
                s.check()
                torch.nn.utils.clip_grad_norm_(ddp.parameters(), 0.05)
                opt.step(); sched.step(); opt.zero_grad(set_to_none=True)
            continue
        for i, m in enumerate(micro):
            with ddp.no_sync() if i < MICRO - 1 else contextlib.nullcontext():
                with seeded(forward_seed(0, step, rank, i), torch.device("cpu")):
                    loss = classify(ddp, m)
                (loss * (1 / MICRO)).backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 0.05)
        opt.step(); sched.step(); opt.zero_grad(set_to_none=True)
    return state_digest(model, opt), (guard.alarms_raised if guard else 0)


def step_api(rank, out):
    plain, _ = step_api_run(rank, guarded=False)
    guarded, alarms = step_api_run(rank, guarded=True)
    return {"plain": plain, "guarded": guarded, "alarms": alarms}


def data_inf(rank, out):
    spool = os.path.join(out, "data_inf_spool")
    model = Scaled()
    ddp = DistributedDataParallel(model)
    guard = sdcguard.Guard(ddp, torch.optim.SGD(model.parameters(), lr=0.5), lambda m, c: m(c),
                           config=Config(audit_every=0, weight_check_every=1, spool=spool, ranks_per_node=1))
    c = torch.ones(4, dtype=torch.float64) * (float("inf") if rank == 1 else 1.0)
    try:
        guard.train_step(0, micro_batches=[torch.ones(4, dtype=torch.float64), c])
        seen = {"error": None}
    except sdcguard.NonFiniteGradient as exc:
        seen = {"error": str(exc), "ranks": exc.ranks, "confirmed": exc.confirmed, "step": exc.step}
    except sdcguard.SDCDetected as exc:
        seen = {"error": "alarm", "alarm": exc.alarm}
    seen["applied"] = bool((model.w != 0).any())
    seen["alarm_files"] = sorted(os.listdir(spool)) if os.path.isdir(spool) else []
    return seen


def compiled(rank, out):
    results = {}
    for form in ("eager", "compile(ddp)", "ddp(compile)"):
        torch.manual_seed(0)
        model = Net()
        if form == "ddp(compile)":
            wrapped = DistributedDataParallel(torch.compile(model))
        else:
            wrapped = DistributedDataParallel(model)
            if form == "compile(ddp)":
                wrapped = torch.compile(wrapped)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        guard = sdcguard.Guard(wrapped, opt, classify, config=Config(audit_every=2, weight_check_every=1))
        try:
            for step in range(4):
                guard.train_step(step, micro_batches=[batch(step, rank, i) for i in range(MICRO)])
            results[form] = {"alarms": guard.alarms_raised, "digest": state_digest(model, opt), "audited": guard.history.last_audited_step}
        except sdcguard.SDCDetected as exc:
            results[form] = {"alarm": exc.alarm}
    return results


class Linear(nn.Module):
    """loss = sum(w * c): the local gradient is exactly c (in the parameter's dtype)."""

    def __init__(self, n, dtype):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(n, dtype=dtype))

    def forward(self, c):
        return (self.w * c).sum()


def honest_gradients(kind, rank, n, dtype, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    if kind == "dynamic-range":
        top = 4 if dtype == torch.float16 else 30
        return torch.randn(n, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(-top, top, (n,), generator=g)
    if kind == "cancellation":
        base = torch.randn(n, generator=torch.Generator().manual_seed(step), dtype=torch.float64) * 1e3
        return base * (1 if rank % 2 == 0 else -1) + (torch.randn(n, generator=g, dtype=torch.float64) * 1e-3 if rank == 0 else 0)
    if kind == "zeros":
        return torch.zeros(n, dtype=torch.float64)
    if kind == "near-overflow":
        return torch.full((n,), float(torch.finfo(dtype).max) / 2, dtype=torch.float64)
    return torch.rand(n, generator=g, dtype=torch.float64) * torch.finfo(dtype).tiny * 4  # subnormal


def scale_one_element(factor):
    from sdcguard.checks.commhook import allreduce_mean

    def hook(group, bucket):
        def corrupt(fut):
            reduced = fut.value()
            reduced[7] = reduced[7] * factor
            return reduced
        return allreduce_mean(group, bucket).then(corrupt)
    hook.averages_like_ddp = True  # a mean, corrupted: what check 4 must see
    return hook


def checksum(rank, out):
    seen = {"honest_alarms": [], "honest_steps": 0, "nonfinite": []}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for step, kind in enumerate(("dynamic-range", "cancellation", "zeros", "near-overflow", "subnormal")):
            model = Linear(5000, dtype)
            ddp = DistributedDataParallel(model)
            guard = sdcguard.Guard(ddp, torch.optim.SGD(model.parameters(), lr=0.0), lambda m, c: m(c),
                                   config=Config(audit_every=0, weight_check_every=0))
            c = honest_gradients(kind, rank, 5000, dtype, step).to(dtype)
            try:
                guard.train_step(step, c)
                seen["honest_steps"] += 1
            except sdcguard.SDCDetected as exc:
                seen["honest_alarms"].append([str(dtype), kind, exc.alarm["evidence"]])
            except sdcguard.NonFiniteGradient:
                seen["nonfinite"].append(kind)  # a norm past float32's range reads as Inf: check 1's case
    model = Linear(5000, torch.float32)
    ddp = DistributedDataParallel(model)
    guard = sdcguard.Guard(ddp, torch.optim.SGD(model.parameters(), lr=0.5), lambda m, c: m(c),
                           config=Config(audit_every=0, weight_check_every=0), reduce_hook=scale_one_element(1.01),
                           reduce_state=ddp.process_group)
    c = torch.randn(5000, generator=torch.Generator().manual_seed(rank))
    try:
        guard.train_step(0, c)
        seen["corrupted"] = None
    except sdcguard.SDCDetected as exc:
        seen["corrupted"] = exc.alarm
    seen["applied"] = bool((model.w != 0).any())
    return seen


def main(out):
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    for name, scenario in (("clean", clean), ("scaler", scaler), ("threads", threads), ("huge", huge),
                           ("replay_fails", replay_fails), ("confirmation_fails", confirmation_fails),
                           ("tiebreak_fails", tiebreak_fails), ("checkpoint_failures", checkpoint_failures),
                           ("exchange", exchange), ("step_api", step_api),
                           ("data_inf", data_inf), ("compiled", compiled), ("checksum", checksum)):
        result = scenario(rank, out)
        with open(os.path.join(out, f"{name}-rank{rank}.json"), "w") as fh:
            json.dump(result, fh, default=str)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
