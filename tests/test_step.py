"""The step API in one process (no process group): the user's loop kept, updates refused before
the checks, NaN/Inf from the data never called SDC, checkpoints in the user's format."""
import json
import subprocess
import sys

import pytest
import torch
from torch import nn

import sdcguard
from sdcguard.checkpoint import CheckpointError, manifest_path, verify_checkpoint
from sdcguard.checks.rng import forward_seed, seeded
from sdcguard.config import Config


def make(scaler=None, **cfg):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = sdcguard.Guard(model, opt, loss_fn, scaler=scaler, config=Config(**cfg))
    return model, opt, guard


def loss_fn(module, batch):
    x, y = batch
    return ((module(x).squeeze(-1) - y) ** 2).mean()


def data(step, n=8):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(n, 4, generator=g)
    return x, x.sum(dim=1)


def plain_loop(steps, micro=2, clip=0.5):
    """The same training without sdcguard: accumulation, division, clipping, a scheduler."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    for step in range(steps):
        x, y = data(step)
        for i in range(micro):
            (loss_fn(model, (x[i::micro], y[i::micro])) / micro).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step(); sched.step(); opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()]


def test_the_users_loop_with_clipping_and_a_scheduler_is_bitwise_the_plain_loop():
    model, opt, guard = make(weight_check_every=1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    for step in range(5):
        x, y = data(step)
        with guard.step(step, micro_batches=2) as s:
            for i in range(2):
                s.backward((x[i::2], y[i::2]), divide_by=2)
            s.check()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step(); sched.step(); opt.zero_grad(set_to_none=True)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain_loop(5)))
    assert guard.last_weights_verified_step == 4



def dropout_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Tanh(), nn.Linear(8, 1))


def test_forward_and_backward_pass_are_bitwise_the_step_backward():
    # a framework that runs the forward and the backward itself (s.forward / s.backward_pass) records
    # and computes what s.backward does: the seeded forward (dropout), the weighting, the losses
    runs = []
    for split in (False, True):
        model = dropout_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        guard = sdcguard.Guard(model, opt, loss_fn, config=Config(seed=3))
        records = []
        for step in range(3):
            x, y = data(step)
            with guard.step(step, micro_batches=2) as s:
                for i in range(2):
                    micro = (x[i::2], y[i::2])
                    if split:
                        with s.forward(micro) as record:
                            loss = record(loss_fn(model, micro))
                        with s.backward_pass(divide_by=2):
                            (loss / 2).backward()
                    else:
                        s.backward(micro, divide_by=2)
                s.check()
                opt.step(); opt.zero_grad(set_to_none=True)
                records.append((s.payload().weighting, [l.item() for l in s.losses], s.loss.item()))
        runs.append(([p.detach().clone() for p in model.parameters()], records))
    (plain, plain_records), (split, split_records) = runs
    assert all(torch.equal(a, b) for a, b in zip(plain, split))
    assert split_records == plain_records and split_records[0][0][0].op == "div"


def test_forward_seeds_the_rng_per_micro_batch():
    _, _, guard = make(seed=5)
    with guard.step(7, micro_batches=2) as s:
        draws = []
        for i in range(2):
            with s.forward(data(i)) as record:
                draws.append(torch.rand(3))
                loss = record(loss_fn(guard.model, data(i)))
            with s.backward_pass():
                loss.backward()
        s.check()
    assert not torch.equal(draws[0], draws[1])
    with seeded(forward_seed(5, 7, 0, 1), torch.device("cpu")):
        assert torch.equal(torch.rand(3), draws[1])
    assert s.payload().weighting == [None, None]


def test_forward_and_backward_pass_refuse_what_cannot_be_replayed():
    _, _, guard = make()
    x = data(0)
    with pytest.raises(RuntimeError, match="recorded no loss"):
        with guard.step(0) as s:
            with s.forward(x):
                loss_fn(guard.model, x)
    with pytest.raises(RuntimeError, match=r"backward_pass\(\) without its forward"):
        with guard.step(1) as s:
            with s.backward_pass():
                pass
    with pytest.raises(RuntimeError, match=r"before the backward_pass\(\) of micro-batch 0"):
        with guard.step(2, micro_batches=2) as s:
            with s.forward(x) as record:
                record(loss_fn(guard.model, x))
            with s.forward(x) as record:
                pass
    with pytest.raises(RuntimeError, match=r"check\(\) before the backward_pass"):
        with guard.step(3) as s:
            with s.forward(x) as record:
                record(loss_fn(guard.model, x))
            s.check()
    with pytest.raises(RuntimeError, match=r"record\(\) called twice"):
        with guard.step(4) as s:
            with s.forward(x) as record:
                record(loss_fn(guard.model, x))
                record(loss_fn(guard.model, x))
    with pytest.raises(ValueError, match="not both"):
        with guard.step(5) as s:
            s.backward_pass(weight=0.5, divide_by=2)
    with pytest.raises(RuntimeError, match=r"forward\(\) was called a 2th time"):
        with guard.step(6) as s:
            for _ in range(2):
                with s.forward(x) as record:
                    loss = record(loss_fn(guard.model, x))
                with s.backward_pass():
                    loss.backward()
    # Every refused step left nothing open: the next step runs and updates as usual.
    guard.optimizer.zero_grad(set_to_none=True)
    with guard.step(7) as s:
        with s.forward(x) as record:
            loss = record(loss_fn(guard.model, x))
        with s.backward_pass():
            loss.backward()
        s.check()
        guard.optimizer.step()
    assert guard.updates_through == 7

def test_clipping_is_not_a_silent_no_op_in_train_step():
    clipped = make()
    unclipped = make()
    for step in range(3):
        clipped[2].train_step(step, data(step), clip_grad_norm=1e-3)
        unclipped[2].train_step(step, data(step))
    assert any(not torch.equal(a, b) for a, b in zip(clipped[0].parameters(), unclipped[0].parameters()))


def test_an_update_before_the_check_is_refused_loudly():
    model, opt, guard = make()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(sdcguard.UncheckedUpdate, match="before s.check"):
        with guard.step(0) as s:
            s.backward(data(0))
            opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    with pytest.raises(sdcguard.UncheckedUpdate, match="outside a checked step"):
        opt.step()


def test_a_step_that_never_checks_is_an_error():
    _, _, guard = make()
    with pytest.raises(RuntimeError, match="without s.check"):
        with guard.step(0) as s:
            s.backward(data(0))


def test_micro_batch_count_is_enforced():
    _, _, guard = make()
    with pytest.raises(RuntimeError, match="micro_batches=1"):
        with guard.step(0) as s:
            s.backward(data(0))
            s.backward(data(1))
    with pytest.raises(RuntimeError, match="ran 1 backward"):
        with guard.step(1, micro_batches=2) as s:
            s.backward(data(1))
            s.check()


def inf_batch():
    x, y = data(0)
    return x, y * float("inf")


def test_a_nonfinite_gradient_from_the_data_is_a_typed_error_not_an_alarm(tmp_path):
    model, opt, guard = make(spool=str(tmp_path))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(sdcguard.NonFiniteGradient) as err:
        guard.train_step(0, inf_batch())
    assert err.value.step == 0 and err.value.ranks == {0: 0} and err.value.confirmed is False
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert guard.alarms_raised == 0 and not list(tmp_path.glob("*.json"))


def test_on_nonfinite_skip_drops_the_step_and_counts_it():
    model, opt, guard = make(on_nonfinite="skip")
    before = [p.detach().clone() for p in model.parameters()]
    with guard.step(0) as s:
        s.backward(inf_batch())
        s.check()
        opt.step()  # allowed, and changes nothing: the gradients were dropped
    assert s.skipped and guard.nonfinite_skipped == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    guard.train_step(1, data(1))  # and training goes on
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_disabled_grad_scaler_counts_as_none():
    # nanoGPT builds GradScaler(enabled=False) for float32/bfloat16: it never skips, so an Inf
    # would reach the weights; sdcguard must not treat it as an overflow the scaler handles
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    _, _, guard = make(scaler=scaler)
    assert guard.scaler is None
    with pytest.raises(sdcguard.NonFiniteGradient):
        guard.train_step(0, inf_batch())


def test_an_enabled_scaler_keeps_its_overflow_semantics():
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
    model, _, guard = make(scaler=scaler)
    before = [p.detach().clone() for p in model.parameters()]
    guard.train_step(0, inf_batch())  # the scaler skips the step and lowers its scale
    assert scaler.get_scale() == 2.0 ** 3
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_compiled_module_in_one_process():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    compiled = torch.compile(model, backend="eager")
    guard = sdcguard.Guard(compiled, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, config=Config())
    assert guard.module is model and guard.compiled
    guard.train_step(0, data(0))


def test_a_block_compiled_in_place_counts_as_compiled():
    # torchtitan's way: block.compile() before fully_shard; audit steps must then run it eagerly
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    model[0].compile(backend="eager")
    guard = sdcguard.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, config=Config())
    assert guard.module is model and guard.compiled
    guard.train_step(0, data(0))
    plain = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    assert not sdcguard.Guard(plain, torch.optim.SGD(plain.parameters(), lr=0.1), loss_fn, config=Config()).compiled


def test_checkpoint_in_the_users_format_round_trips_and_verifies(tmp_path):
    model, opt, guard = make()
    guard.train_step(0, data(0))
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "model_args": {"n_layer": 2}, "iter_num": 0}
    path = guard.save_checkpoint(tmp_path / "ckpt.pt", 0, state)
    saved = torch.load(path, weights_only=True)
    assert sorted(saved) == ["iter_num", "model", "model_args", "optimizer"]  # flat, as the user built it
    manifest = json.loads(manifest_path(path).read_text())
    assert manifest["step"] == 0 and manifest["parameters"] == [n for n, _ in model.named_parameters()]
    assert verify_checkpoint(path).step == 0
    other, other_opt, _ = make()
    loaded = sdcguard.load_checkpoint(path, other, other_opt)
    assert loaded["model_args"] == {"n_layer": 2}
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))


def test_saving_something_else_than_the_verified_weights_is_refused(tmp_path):
    model, opt, guard = make()
    stale = {k: v.clone() for k, v in model.state_dict().items()}
    guard.train_step(0, data(0))
    with pytest.raises(CheckpointError, match="does not hold the weights check 3 just verified"):
        guard.save_checkpoint(tmp_path / "ckpt.pt", 0, {"model": stale})
    assert not (tmp_path / "ckpt.pt").exists()


def test_rank0_decides_whether_to_save(tmp_path):
    _, _, guard = make()
    assert guard.save_checkpoint(tmp_path / "no.pt", 0, when=False) is None
    assert not (tmp_path / "no.pt").exists()


def cli(*args):
    return subprocess.run([sys.executable, "-m", "sdcguard.cli", *args], capture_output=True, text=True, timeout=120)


def test_verify_checkpoint_command(tmp_path):
    model, opt, guard = make()
    guard.train_step(0, data(0))
    path = guard.save_checkpoint(tmp_path / "ckpt.pt", 0)
    good = cli("verify-checkpoint", str(path))
    assert good.returncode == 0 and good.stdout.startswith("OK ") and "step 0" in good.stdout
    blob = bytearray((tmp_path / "ckpt.pt").read_bytes())
    blob[-100] ^= 0xFF
    (tmp_path / "ckpt.pt").write_bytes(bytes(blob))
    bad = cli("verify-checkpoint", str(path))
    assert bad.returncode == 1 and "MISMATCH" in bad.stdout and "modified" in bad.stdout
    assert cli("verify-checkpoint", str(tmp_path / "missing.pt")).returncode == 2


def test_a_resumed_guard_knows_the_checkpoints_before_its_own(tmp_path):
    # a window may reach back past the checkpoint a run resumed from: the manifest lists the ones
    # before it, and a path a later save reused (it holds another step now) is left out
    model, opt, guard = make()
    for step, name in ((0, "a.pt"), (2, "b.pt"), (4, "a.pt")):
        guard.train_step(step, data(step))
        guard.save_checkpoint(tmp_path / name, step)
    _, _, resumed = make()
    assert resumed.load_checkpoint(tmp_path / "a.pt") == 4
    assert resumed.checkpoints == [(2, str(tmp_path / "b.pt")), (4, str(tmp_path / "a.pt"))]
    _, _, older = make()
    assert older.load_checkpoint(tmp_path / "b.pt") == 2
    assert older.checkpoints == [(2, str(tmp_path / "b.pt"))]  # a.pt no longer holds step 0


def test_a_guard_nobody_closes_flushes_its_statistics_when_collected_and_closing_detaches_that(tmp_path):
    import gc

    from sdcguard.contract.stats import stats_path

    def train(spool):  # a Guard local to a function that returns: never closed
        model, opt, guard = make(spool=str(spool))
        for step in range(2):
            with guard.step(step) as s:
                s.backward(data(step))
                s.check()
                opt.step()
                opt.zero_grad()

    train(tmp_path / "a")
    gc.collect()
    written = json.loads(stats_path(str(tmp_path / "a"), 0).read_text())
    assert written["steps"] == 2 and written["last_step"] == 1

    model, opt, guard = make(spool=str(tmp_path / "b"))
    guard.close()
    stats_path(str(tmp_path / "b"), 0).unlink()
    del model, opt, guard
    gc.collect()
    assert not stats_path(str(tmp_path / "b"), 0).exists()  # closed once: not written again

    # two Guards on one spool and rank (a loop that builds a new one after an alarm): the older one,
    # collected after the newer one wrote, leaves the newer one's figures in the file
    model, opt, older = make(spool=str(tmp_path / "c"))
    with older.step(0) as s:
        s.backward(data(0))
        s.check()
        opt.step()
    _, _, newer = make(spool=str(tmp_path / "c"))
    newer.flush_stats()
    finalizer = older._flush_at_end
    del older, model, opt, s
    gc.collect()
    assert not finalizer.alive  # the older Guard was collected (and its finalizer ran)
    assert json.loads(stats_path(str(tmp_path / "c"), 0).read_text())["steps"] == 0  # the newer Guard's
