"""One rank of tests/test_budget.py under torchrun (2 gloo ranks, one per node): the integrity budget.

Scenarios in one launch, each writing OUT/<scenario>-rank<r>.json:
  tight    max_overhead=1e-9 (nothing fits): starting every 3, the interval goes to the cap (6);
  loose    max_overhead=1e6 (everything fits): starting every 3, the interval goes to 1;
  count    the same ordinary and audit steps under a fixed schedule and under a budget, counted with
           bench/step_account.py's counting: what the budget adds to each kind of step.
"""
import json
import pathlib
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import sdcguard
from sdcguard.config import Config

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))

CAP, START, STEPS = 6, 3, 20


def loss_fn(module, batch):
    x, y = batch
    return ((module(x) - y) ** 2).mean()


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 8, generator=g)
    return x, x[:, :4].sum(dim=1, keepdim=True).expand(16, 4).contiguous()


def replica():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    model = DistributedDataParallel(module)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def adapt(out, name, budget, rank):
    model, opt = replica()
    spool = out / f"spool-{name}"
    guard = sdcguard.Guard(model, opt, loss_fn, config=Config(
        max_overhead=budget, max_audit_interval=CAP, audit_every=START, weight_check_every=2,
        ranks_per_node=1, spool=str(spool)))
    steps = []
    for step in range(STEPS):
        audit = guard.is_audit_step(step)
        guard.train_step(step, batch(step, rank))
        steps.append({"step": step, "audit": audit, "interval": guard.budget.interval,
                      "last_audited": guard.history.last_audited_step})
    guard.close()
    stats = json.loads((spool / "stats" / f"rank-{rank}.json").read_text())
    (out / f"{name}-rank{rank}.json").write_text(json.dumps({
        "steps": steps, "alarms": guard.alarms_raised, "stats": stats,
        "last_audited_step": guard.history.last_audited_step}))


def count(out, rank):
    import step_account as sa

    runs = {}
    for name, config in (("fixed", Config(audit_every=0, weight_check_every=0, ranks_per_node=1)),
                         ("budget", Config(max_overhead=0.03, max_audit_interval=1000, weight_check_every=0,
                                           ranks_per_node=1))):
        model, opt = replica()
        runs[name] = (model, opt, sdcguard.Guard(model, opt, loss_fn, config=config))

    def one(name, step, audit):
        model, opt, guard = runs[name]
        opt.zero_grad(set_to_none=True)
        with guard.step(step, audit=audit) as s:
            s.backward(batch(step, rank))
            s.check()
            opt.step()

    kinds = {"ordinary": False, "audit": True}
    counts = {kind: {name: sa.Counts() for name in runs} for kind in kinds}
    for step in range(12):
        kind = "audit" if step % 2 else "ordinary"
        for name in runs:
            dist.barrier()
            if step < 4:  # warm-up: DDP's buckets, AdamW's state, every check's first use
                one(name, step, kinds[kind])
            else:
                with sa.counting(counts[kind][name]):
                    one(name, step, kinds[kind])
    summary = {kind: {name: sa.summarize(c, 4)["total"] for name, c in by.items()} for kind, by in counts.items()}
    budget = runs["budget"][2].budget
    (out / f"count-rank{rank}.json").write_text(json.dumps({
        "summary": summary, "decisions": budget.decisions, "interval": budget.interval}))
    for _, _, guard in runs.values():
        guard.close()


def main():
    out = pathlib.Path(sys.argv[1])
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    adapt(out, "tight", 1e-9, rank)
    adapt(out, "loose", 1e6, rank)
    count(out, rank)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
