"""The update gate (sdcguard.gate) on a bare optimizer: no update outside an open, checked step;
the count of which step's update the weights hold. The device gate (``Config(device_gate=True)``):
a masked update leaves the weights and the fused optimizer's step counter untouched, composes with
a GradScaler's found_inf, and in a Guard raises the synchronous gate's alarm one step later, never
letting a checkpoint be written past it; a clean run is bit for bit the plain run — in one
process, and over DDP on 2 gloo ranks (this file is also that run's worker)."""
import os

import pytest
import torch

from sdcguard.errors import UncheckedUpdate
from sdcguard.gate import UpdateGate


def optimizer():
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    return torch.optim.SGD([p], lr=0.1)


def test_an_update_needs_an_open_step_whose_checks_passed():
    opt = optimizer()
    gate = UpdateGate(opt)
    with pytest.raises(UncheckedUpdate, match="outside a checked step"):
        opt.step()
    gate.open(4)
    with pytest.raises(UncheckedUpdate, match="at step 4 before s.check"):
        opt.step()
    gate.allow()
    opt.step()
    assert gate.updates_through == 4
    gate.close(done=True)
    with pytest.raises(UncheckedUpdate):
        opt.step()


def test_the_count_follows_done_steps_and_resumes():
    gate = UpdateGate(optimizer())
    gate.open(0)
    gate.close(done=True)       # e.g. a GradScaler skip: done, unapplied
    assert gate.updates_through == 0
    gate.open(1)
    gate.close(done=False)      # an alarm: the weights still stand for step 0
    assert gate.updates_through == 0
    gate.resumed_at(41)
    assert gate.updates_through == 41
    gate.open(42)
    with pytest.raises(RuntimeError, match="still open"):
        gate.open(43)


# -- the device gate: the update held back by the fused kernel, decided without a host sync -----

def fused(kind="adamw", momentum=0.0):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5))
    p.grad = torch.randn(5)
    if kind == "sgd":
        return p, torch.optim.SGD([p], lr=0.1, momentum=momentum, fused=True)
    return p, (torch.optim.AdamW if kind == "adamw" else torch.optim.Adam)([p], lr=0.1, fused=True)


@pytest.mark.parametrize("kind", ["adam", "adamw", "sgd"])
def test_a_masked_update_changes_neither_the_weights_nor_the_step_counter(kind):
    p, opt = fused(kind)
    gate = UpdateGate(opt)
    for step, failed in enumerate([0.0, 1.0, 0.0]):
        before = p.detach().clone()
        gate.open(step)
        gate.allow_masked(torch.tensor(failed))
        opt.step()
        gate.close(done=True)
        assert torch.equal(p.detach(), before) == bool(failed), (step, failed)
        assert "found_inf" not in opt.__dict__  # handed to the kernel for the one step only
    if kind != "sgd":
        assert float(opt.state[p]["step"]) == 2.0  # the masked step did not count


def test_a_clean_masked_run_is_bitwise_the_plain_run():
    p, opt = fused("adamw")
    q, plain = fused("adamw")
    gate = UpdateGate(opt)
    for step in range(4):
        gate.open(step)
        gate.allow_masked(torch.zeros(()))
        opt.step()
        gate.close(done=True)
        plain.step()
    assert torch.equal(p, q) and torch.equal(opt.state[p]["exp_avg_sq"], plain.state[q]["exp_avg_sq"])


@pytest.mark.parametrize("scaler_found, mine, applied", [(0.0, 0.0, True), (1.0, 0.0, False), (0.0, 1.0, False)])
def test_the_mask_adds_to_a_grad_scalers_found_inf(scaler_found, mine, applied):
    p, opt = fused("adamw")
    gate = UpdateGate(opt)
    before = p.detach().clone()
    gate.open(0)
    gate.allow_masked(torch.tensor(mine))
    theirs = torch.tensor(scaler_found)
    opt.found_inf = theirs  # what GradScaler.step sets before optimizer.step() (and deletes after)
    opt.step()
    assert opt.found_inf is theirs  # put back for the scaler
    del opt.found_inf
    assert (not torch.equal(p.detach(), before)) == applied


def test_a_masked_first_sgd_step_reports_its_empty_momentum_buffers():
    p, opt = fused("sgd", momentum=0.9)
    gate = UpdateGate(opt)
    gate.open(0)
    fresh = gate.allow_masked(torch.ones(()))
    opt.step()
    assert fresh == [p]  # the Guard drops their buffers when the run goes on
    gate.close(done=True)
    gate.open(1)
    fresh = gate.allow_masked(torch.zeros(()))
    opt.step()
    assert fresh == []  # the buffer exists now: a later masked step leaves it as it was


@pytest.mark.parametrize("make, why", [
    (lambda ps: torch.optim.AdamW(ps, lr=0.1), "fused=True in every param group"),
    (lambda ps: torch.optim.RMSprop(ps, lr=0.1), "Adam, AdamW or SGD with fused=True"),
])
def test_the_device_gate_refuses_an_optimizer_it_cannot_hold_back(make, why):
    from sdcguard.gate import device_gate_refusal
    assert why in device_gate_refusal(make([torch.nn.Parameter(torch.ones(2))]))
    assert device_gate_refusal(torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1, fused=True)) is None


# -- the device gate in a Guard (one process: check 1's local half) ------------------------------

def _run(device_gate, bad_step=None, steps=5, save_at=None, tmp_path=None):
    import sdcguard
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)

    def loss_fn(m, batch):
        return m(batch).square().mean()

    guard = sdcguard.Guard(model, opt, loss_fn, config=sdcguard.Config(
        audit_every=0, weight_check_every=0, device_gate=device_gate))
    seen = {"raised": None, "weights": {}}
    try:
        for step in range(steps):
            x = torch.randn(6, 4, generator=torch.Generator().manual_seed(step))
            if step == bad_step:
                x[0, 0] = float("inf")
            if step == save_at:
                guard.save_checkpoint(tmp_path / "ckpt.pt")
            guard.train_step(step, x)
            seen["weights"][step] = [p.detach().clone() for p in model.parameters()]
    except (sdcguard.NonFiniteGradient, sdcguard.SDCDetected) as exc:
        seen["raised"] = (type(exc).__name__, exc.step, step)
    seen["final"] = [p.detach().clone() for p in model.parameters()]
    seen["opt_step"] = float(next(iter(opt.state.values()))["step"])
    seen["updates_through"] = guard.updates_through
    return seen


def test_a_clean_device_gated_run_is_bitwise_the_synchronous_one():
    a, b = _run(False), _run(True)
    assert all(torch.equal(x, y) for x, y in zip(a["final"], b["final"])) and a["opt_step"] == b["opt_step"] == 5


def test_a_failed_check_holds_the_update_back_on_the_device_and_raises_one_step_later():
    sync, device = _run(False, bad_step=2), _run(True, bad_step=2)
    assert sync["raised"] == ("NonFiniteGradient", 2, 2)      # at step 2's check
    assert device["raised"] == ("NonFiniteGradient", 2, 3)    # the same, read at step 3's check
    # Neither step 2's update nor step 3's was applied: the weights are those after step 1.
    assert all(torch.equal(x, y) for x, y in zip(device["final"], device["weights"][1]))
    assert all(torch.equal(x, y) for x, y in zip(sync["final"], device["final"]))
    assert device["opt_step"] == sync["opt_step"] == 2.0
    # Step 2 is done with (unapplied), step 3 never was: a checkpoint now would hold step 2.
    assert device["updates_through"] == sync["updates_through"] == 2


def test_no_checkpoint_is_written_past_a_verdict_still_on_the_device(tmp_path):
    seen = _run(True, bad_step=2, save_at=3, tmp_path=tmp_path)
    assert seen["raised"] == ("NonFiniteGradient", 2, 3)      # the save read the verdict first
    assert not (tmp_path / "ckpt.pt").exists()


def test_the_device_gate_is_refused_for_an_unfused_optimizer():
    import sdcguard
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match="fused=True"):
        sdcguard.Guard(model, torch.optim.AdamW(model.parameters()), lambda m, b: m(b).sum(),
                       config=sdcguard.Config(device_gate=True))
    with pytest.raises(ValueError, match="device_gate must be True or False"):
        sdcguard.Config(device_gate="yes")


# -- the device gate over DDP (2 gloo ranks): the same alarms as the synchronous gate ------------
# One launch runs every scenario; this file is also the worker (``python tests/test_gate.py OUT``).

FAULT_STEP, STEPS = 3, 6


def _ddp_run(rank, mode, fault=None, save_at=None, out=None):
    import sdcguard
    from torch.nn.parallel import DistributedDataParallel
    from sdcguard.checks.commhook import allreduce_mean

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    ddp = DistributedDataParallel(module)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2, fused=True)
    state = {"on": False}

    def corrupt_mean(group, bucket):  # check 4's fault: one reduced element scaled
        def corrupt(fut):
            reduced = fut.value()
            if state["on"] and fault == "reduce":
                reduced[3] = reduced[3] * 1.01
            return reduced
        return allreduce_mean(group, bucket).then(corrupt)
    corrupt_mean.averages_like_ddp = True

    for p in module.parameters():  # check 1a's fault: a NaN in rank 1's own backward only
        p.register_hook(lambda g: g * float("nan") if state["on"] and fault == "nan" and rank == 1 else g)

    def loss_fn(m, batch):
        return m(batch).square().mean()

    guard = None
    if mode != "plain":
        guard = sdcguard.Guard(ddp, opt, loss_fn, reduce_hook=corrupt_mean, reduce_state=ddp.process_group,
                               config=sdcguard.Config(audit_every=0, weight_check_every=0, ranks_per_node=1,
                                                      device_gate=mode == "device"))
    seen = {"raised": None, "weights": {}, "saved": None}
    step = -1
    try:
        for step in range(STEPS):
            x = torch.randn(6, 8, generator=torch.Generator().manual_seed(100 * step + rank))
            opt.zero_grad(set_to_none=True)
            if guard is None:
                loss_fn(ddp, x).backward()
                opt.step()
            else:
                if step == save_at:
                    path = os.path.join(out, f"ckpt-{mode}.pt")
                    seen["saved"] = guard.save_checkpoint(path)
                with guard.step(step) as s:
                    state["on"] = step == FAULT_STEP
                    s.backward(x)
                    state["on"] = False
                    s.check()
                    opt.step()
            seen["weights"][step] = _digest(module)
    except sdcguard.SDCDetected as exc:
        seen["raised"] = {"check": exc.check, "step": exc.step, "suspects": exc.suspect_ranks, "at": step}
    seen["final"] = _digest(module)
    seen["opt_step"] = float(next(iter(opt.state.values()))["step"])
    seen["updates_through"] = guard.updates_through if guard is not None else None
    return seen


def _honest_run(rank, mode, kind):
    """What the device gate must not take for corruption on 2 ranks: ``scaler``, an fp16 GradScaler's
    honest overflows at start-up (confirmed by replaying at the scale the step used, not the one
    ``update()`` halved since); ``overflow``, finite gradients whose float32 squared norm overflows."""
    import sdcguard
    from torch.nn.parallel import DistributedDataParallel

    class Half(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Parameter(torch.ones(1, 1)), torch.nn.Parameter(torch.ones(1, 1))

        def forward(self, x):
            if kind == "scaler":
                return (x.half() * self.a.half()).float() + self.b
            return self.a * x + self.b * x

    module = Half()
    ddp = DistributedDataParallel(module)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16) if kind == "scaler" else None
    guard = sdcguard.Guard(ddp, opt, lambda m, x: m(x).sum(), scaler=scaler,
                           config=sdcguard.Config(audit_every=0, weight_check_every=0, ranks_per_node=1,
                                                  device_gate=mode == "device"))
    raised = None
    try:
        for step in range(4):
            big = 1.5e19 if kind == "overflow" and step == 0 else 1.0
            guard.train_step(step, torch.full((1, 1), big))
        guard.close()
    except Exception as exc:  # noqa: BLE001 - any raise is the finding
        raised = f"{type(exc).__name__}: {exc}"[:300]
    return {"raised": raised, "final": _digest(module)}


def _digest(module):
    from sdcguard.fingerprint import digest, fingerprint
    return digest([fingerprint(p.detach()) for p in module.parameters()]).hex()


def _worker(out):
    import json
    import torch.distributed as dist
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    results = {"plain": _ddp_run(rank, "plain"), "clean": _ddp_run(rank, "device")}
    for fault in ("reduce", "nan"):
        for mode in ("sync", "device"):
            results[f"{fault}-{mode}"] = _ddp_run(rank, mode, fault)
    results["save"] = _ddp_run(rank, "device", "reduce", save_at=FAULT_STEP + 1, out=out)
    for kind in ("scaler", "overflow"):
        for mode in ("sync", "device"):
            results[f"{kind}-{mode}"] = _honest_run(rank, mode, kind)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(results, fh)
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    import json
    import subprocess
    import sys
    out = tmp_path_factory.mktemp("device-gate")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           __file__, str(out)], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.multiprocess
@pytest.mark.slow  # one 2-rank launch, ~35 s
def test_ddp_a_clean_device_gated_run_is_bitwise_plain_ddp(ddp_runs):
    for r in ddp_runs[1]:
        assert r["clean"]["raised"] is None
        assert r["clean"]["weights"] == r["plain"]["weights"] and r["clean"]["opt_step"] == STEPS


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("fault, check, suspects", [("reduce", "reduce-checksum", []), ("nan", "nonfinite-local", [1])])
def test_ddp_the_device_gate_raises_the_synchronous_alarm_one_step_later(ddp_runs, fault, check, suspects):
    for r in ddp_runs[1]:
        sync, device = r[f"{fault}-sync"], r[f"{fault}-device"]
        assert sync["raised"] == {"check": check, "step": FAULT_STEP, "suspects": suspects, "at": FAULT_STEP}
        assert device["raised"] == {**sync["raised"], "at": FAULT_STEP + 1}
        # The faulty step's update was held back on the device, the next one never allowed.
        assert device["final"] == sync["final"] == r["plain"]["weights"][str(FAULT_STEP - 1)]
        assert device["opt_step"] == sync["opt_step"] == FAULT_STEP
        assert device["updates_through"] == sync["updates_through"] == FAULT_STEP - 1


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["scaler", "overflow"])
def test_ddp_the_device_gate_raises_nothing_the_synchronous_gate_does_not(ddp_runs, kind):
    for r in ddp_runs[1]:
        assert r[f"{kind}-sync"]["raised"] is None and r[f"{kind}-device"]["raised"] is None


@pytest.mark.multiprocess
@pytest.mark.slow  # one 2-rank launch, ~35 s
def test_ddp_no_checkpoint_is_saved_past_a_failed_verdict_on_the_device(ddp_runs):
    out, runs = ddp_runs
    for r in runs:
        assert r["save"]["raised"] == {"check": "reduce-checksum", "step": FAULT_STEP, "suspects": [],
                                       "at": FAULT_STEP + 1}
        assert r["save"]["saved"] is None
    assert not (out / "ckpt-device.pt").exists()


if __name__ == "__main__":
    import sys
    _worker(sys.argv[1])


def test_with_a_grad_scaler_the_device_gate_matches_the_synchronous_gate():
    """GradScaler hands the fused optimizer its own found_inf: an overflow (here an Inf in a batch)
    is skipped by the scaler in both runs, the scale halves, and the runs stay bit for bit equal."""
    import sdcguard

    def run(device_gate):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        guard = sdcguard.Guard(model, opt, lambda m, x: m(x).square().mean(), scaler=scaler,
                               config=sdcguard.Config(audit_every=0, weight_check_every=0, device_gate=device_gate))
        scales = []
        for step in range(5):
            x = torch.randn(6, 4, generator=torch.Generator().manual_seed(step))
            if step == 2:
                x[0, 0] = float("inf")
            guard.train_step(step, x)
            scales.append(scaler.get_scale())
        guard.close()
        return [p.detach().clone() for p in model.parameters()], scales, float(next(iter(opt.state.values()))["step"])

    (sync_w, sync_scales, sync_step), (dev_w, dev_scales, dev_step) = run(False), run(True)
    assert sync_scales == dev_scales and sync_scales[2] == sync_scales[1] / 2
    assert sync_step == dev_step == 4.0  # the overflowed step did not count
    assert all(torch.equal(a, b) for a, b in zip(sync_w, dev_w))
