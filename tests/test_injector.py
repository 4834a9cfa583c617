"""The fault injector on a user's own model, in one process: each kind strikes the named target's
element, at its step only, through compile / DataParallel wrappers; bad names fail clearly."""
import copy

import pytest
import torch
from torch import nn

from sdcguard.checks.replay import _replay_mode
from sdcguard.faults import FaultInjector, FaultTargetError

torch.set_num_threads(1)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.body(x))


X = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))


def bits(t):
    return t.detach().reshape(-1).view(torch.int32)


def capture(module):
    """What ``module`` outputs, as the rest of the model sees it (after the injector's hook)."""
    seen = []
    module.register_forward_hook(lambda m, a, out: seen.append(out.detach().clone()))
    return seen


def run(injector, model, optimizer=None, steps=4, replay_at=()):
    """Each step: begin_step, forward + backward (in replay mode at ``replay_at``), the update."""
    grads = []
    for step in range(steps):
        injector.begin_step(step)
        model.zero_grad(set_to_none=True)
        if step in replay_at:
            with _replay_mode():
                model(X).sum().backward()
        else:
            model(X).sum().backward()
        grads.append(model.head.weight.grad.clone())
        if optimizer is not None:
            optimizer.step()
    return grads


def test_forward_faults_strike_the_named_sites_element_at_their_step_only():
    model = Net()
    clean = model.body[0](X).detach()
    injector = FaultInjector(["forward-nan:rank=0:step=2:element=5", "forward-scale:rank=0:step=3:magnitude=8"], rank=0)
    injector.install(model, site="body.0")
    seen = capture(model.body[0])
    run(injector, model)
    assert torch.equal(seen[0], clean) and torch.equal(seen[1], clean)
    assert torch.isnan(seen[2]).nonzero().tolist() == [[0, 5]]  # flat element 5 of a (5, 8) output
    changed = (seen[3] != clean).nonzero().tolist()
    assert changed == [[0, 0]] and seen[3][0, 0] == clean[0, 0] * 8
    assert [(e["step"], e["target"]) for e in injector.fired] == [(2, "body.0[5]"), (3, "body.0[0]")]


def test_local_gradient_faults_strike_the_named_parameter():
    model = Net()
    injector = FaultInjector(["grad-inf:rank=1:step=1:element=4", "grad-bitflip:rank=1:step=2:element=3",
                              "grad-inf:rank=0:step=3"], rank=1)  # the last is rank 0's
    injector.install(model, param="head.weight")
    grads = run(injector, model)
    clean = grads[0]
    assert torch.isinf(grads[1]).reshape(-1).nonzero().tolist() == [[4]]
    flipped = (bits(grads[2]) ^ bits(clean)).nonzero().reshape(-1).tolist()
    assert flipped == [3] and (bits(grads[2]) ^ bits(clean))[3] == 1 << 22 and torch.isfinite(grads[2]).all()
    assert torch.equal(grads[3], clean)
    assert injector.describe() == ["grad-inf:rank=1:step=1:element=4 -> local gradient of head.weight[4]",
                                   "grad-bitflip:rank=1:step=2:element=3 -> local gradient of head.weight[3]"]


def test_replay_side_and_persistent_faults():
    model = Net()
    injector = FaultInjector(["grad-inf:rank=0:step=1:during=replay", "grad-inf:rank=0:step=4:every=2:element=1"], 0)
    injector.install(model, param="head.weight")
    grads = run(injector, model, steps=7, replay_at=(1, 2))
    infinite = [s for s, g in enumerate(grads) if not torch.isfinite(g).all()]
    assert infinite == [1, 4, 6]  # the replay at 1 (not the own pass), then 4, 6: own passes
    assert [e["step"] for e in injector.fired] == [1, 4, 6]
    injector.remove()
    # a transient own-pass fault leaves the replays alone
    injector = FaultInjector(["grad-inf:rank=0:step=1"], 0)
    injector.install(model, param="head.weight")
    assert all(torch.isfinite(g).all() for g in run(injector, model, steps=3, replay_at=(1,)))


def test_optimizer_and_stored_weight_faults():
    model, reference = Net(), Net()
    injector = FaultInjector(["optimizer-scale:rank=2:step=1:element=2:magnitude=8:param=body.0.weight",
                              "weight-bitflip:rank=2:step=2:element=6", "weight-swap:rank=2:step=3:element=23"], 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    injector.install(model, optimizer, param="head.weight")
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    reference(X).sum().backward()
    ref_opt.step()
    injector.begin_step(0)
    model(X).sum().backward()
    optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
    injector.begin_step(1)
    model.zero_grad()
    reference.zero_grad()
    model(X).sum().backward()
    reference(X).sum().backward()
    optimizer.step()
    ref_opt.step()
    w, r = model.body[0].weight.view(-1), reference.body[0].weight.view(-1)
    assert (w != r).nonzero().reshape(-1).tolist() == [2] and w[2] == r[2] * 8
    before = model.head.weight.detach().clone().view(-1)
    injector.begin_step(2)  # between steps: one mantissa bit of element 6
    after = model.head.weight.detach().view(-1)
    assert (bits(after) ^ bits(before)).nonzero().reshape(-1).tolist() == [6]
    assert (bits(after) ^ bits(before))[6] == 1 << 20
    before = after.clone()
    injector.begin_step(3)  # the last element swaps with the one before it
    assert after[23] == before[22] and after[22] == before[23] and torch.equal(after[:22], before[:22])


class FakeBucket:
    """What a comm hook sees of a DDP bucket: its parameters laid end to end in one buffer."""

    def __init__(self, params):
        self._params = params
        self._buffer = torch.ones(sum(p.numel() for p in params))

    def parameters(self):
        return self._params

    def buffer(self):
        return self._buffer

    def index(self):
        return 0


def test_reduce_faults_wrap_your_own_reduce_hook():
    model = Net()
    calls = []

    def doubling_hook(state, bucket):  # the user's own reduction, with its own state
        state.append(bucket.index())
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer() * 2)
        return fut

    injector = FaultInjector(["reduce-nan:step=1:element=5", "reduce-scale:step=2:every=2:magnitude=10:param=body.0.bias"], 3)
    injector.install(model, param="head.weight")
    hook, state = injector.reduce_hook_around(doubling_hook, calls)
    everything = FakeBucket(list(model.parameters()))  # body.0.weight 32, body.0.bias 8, head.weight 24, head.bias 3
    elsewhere = FakeBucket([model.head.bias])

    def reduce(step, bucket):
        injector.begin_step(step)
        return hook(state, bucket).wait()

    assert torch.equal(reduce(0, everything), torch.full((67,), 2.0))
    assert torch.equal(reduce(1, elsewhere), torch.full((3,), 2.0))  # not the target's bucket: not spent
    out = reduce(1, everything)
    assert torch.isnan(out).nonzero().reshape(-1).tolist() == [32 + 8 + 5]
    assert torch.equal(reduce(1, everything), torch.full((67,), 2.0))  # transient: once
    for step in (2, 4):
        out = reduce(step, everything)
        assert (out != 2).nonzero().reshape(-1).tolist() == [32] and out[32] == 20
    assert len(calls) == 6
    assert [(e["kind"], e["step"], e["target"]) for e in injector.fired] == [
        ("reduce-nan", 1, "head.weight[5]"), ("reduce-scale", 2, "body.0.bias[0]"), ("reduce-scale", 4, "body.0.bias[0]")]


def test_check_4_applies_exactly_when_the_wrapped_reduction_averages_like_ddp():
    injector = FaultInjector([], 0)

    def compressing(state, bucket):
        return state

    def averaging(state, bucket):
        return state

    averaging.averages_like_ddp = True
    assert injector.reduce_hook_around()[0].averages_like_ddp  # DDP's mean
    assert injector.reduce_hook_around(averaging)[0].averages_like_ddp
    assert not getattr(injector.reduce_hook_around(compressing)[0], "averages_like_ddp", False)
    assert injector.reduce_hook.averages_like_ddp


def test_names_resolve_through_compile_and_data_parallel():
    model = Net()
    compiled = torch.compile(model, backend="eager")
    for site in ("body.0", "_orig_mod.body.0"):
        injector = FaultInjector(["forward-nan:rank=0:step=1"], 0)
        injector.install(compiled, site=site)
        assert injector.targets[0].obj is model.body[0] and injector.targets[0].name == "body.0"
        injector.remove()
    wrapped = nn.DataParallel(model)  # DDP's `module.` prefix, without a process group
    injector = FaultInjector(["grad-inf:rank=0:step=1"], 0)
    injector.install(wrapped, param="module.head.weight")
    assert injector.targets[0].obj is model.head.weight and injector.targets[0].name == "head.weight"
    model.body = torch.compile(model.body, backend="eager")  # a compiled submodule
    injector.install(model, param="body.0.weight")
    assert injector.targets[0].obj is model.body._orig_mod[0].weight and injector.targets[0].name == "body.0.weight"


def test_a_forward_fault_strikes_inside_compiled_code():
    model = Net()
    compiled = torch.compile(model, backend="eager")
    injector = FaultInjector(["forward-nan:rank=0:step=1"], 0)
    injector.install(compiled, site="body.0")  # before the first forward: compiled code sees the hook
    outputs = []
    for step in range(3):
        injector.begin_step(step)
        outputs.append(compiled(X))
    assert [bool(torch.isnan(o).any()) for o in outputs] == [False, True, False]


@pytest.mark.parametrize("fault, kwargs, message", [
    ("forward-nan:rank=0:step=1", {"site": "bdy.0"}, "no module 'bdy.0' in Net; closest: body.0"),
    ("grad-inf:rank=0:step=1", {"param": "head.wieght"}, "no parameter 'head.wieght' in Net; closest: head.weight"),
    ("grad-inf:rank=0:step=1", {"param": "head"}, "no parameter 'head' in Net; closest: head.bias, head.weight"),
    ("grad-inf:rank=0:step=1:element=24", {"param": "head.weight"},
     "element 24 is out of range for head.weight \\(shape \\(3, 8\\)\\), which has 24 elements"),
    ("forward-nan:rank=0:step=1", {"param": "head.weight"}, "pass site='PATH' to install"),
    ("weight-swap:rank=0:step=1", {}, "pass param='NAME' to install"),
    ("weight-swap:rank=0:step=1:param=one", {}, "weight-swap needs two elements; one has one"),
])
def test_bad_targets_fail_clearly(fault, kwargs, message):
    model = Net()
    model.one = nn.Parameter(torch.ones(1))
    with pytest.raises(FaultTargetError, match=message):
        FaultInjector([fault], 0).install(model, **kwargs)


def test_an_optimizer_fault_needs_the_optimizer():
    with pytest.raises(ValueError, match="need the optimizer"):
        FaultInjector(["optimizer-scale:rank=0:step=1"], 0).install(Net(), param="head.weight")


def test_an_activation_element_out_of_range_fails_at_its_step():
    model = Net()
    injector = FaultInjector(["forward-nan:rank=0:step=1:element=40"], 0)  # the output has 5 x 8
    injector.install(model, site="body.0")
    injector.begin_step(0)
    model(X)
    injector.begin_step(1)
    with pytest.raises(FaultTargetError, match=r"element 40 is out of range for the output of body.0 \(shape \(5, 8\)\)"):
        model(X)


def test_install_before_first_step_and_moves_to_a_rebuilt_model():
    injector = FaultInjector(["weight-bitflip:rank=0:step=0"], 0)
    with pytest.raises(RuntimeError, match="install"):
        injector.begin_step(0)
    first, second = Net(), Net()
    injector.install(first, param="head.weight")
    injector.install(second, param="head.weight")  # e.g. the job rebuilt after an alarm
    kept = copy.deepcopy(first.state_dict())
    injector.begin_step(0)
    assert all(torch.equal(kept[k], v) for k, v in first.state_dict().items())
    assert not torch.equal(second.head.weight, first.head.weight)


def test_the_older_form_with_objects_still_works():
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    injector = FaultInjector(["grad-inf:rank=0:step=1"], 0)
    injector.install(model.body[0], model.head.weight, optimizer)
    grads = run(injector, model)
    assert [bool(torch.isinf(g).any()) for g in grads] == [False, True, False, False]


def test_the_guard_runs_your_reduce_hook_with_the_fault_inside(tmp_path):
    """``Guard(reduce_hook=..., reduce_state=...)`` from ``reduce_hook_around``: the user's hook
    reduces, the fault lands in its result, and the Guard's checks see the corrupted gradient."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    import sdcguard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model = Net()
        ddp = DistributedDataParallel(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the weights stay: so do the gradients
        injector = FaultInjector(["reduce-scale:step=1:element=5:magnitude=4"], 0)
        injector.install(ddp, optimizer, param="module.head.weight")
        buckets = []

        def my_hook(process_group, bucket):
            buckets.append(bucket.index())
            return default_hooks.allreduce_hook(process_group, bucket)

        hook, state = injector.reduce_hook_around(my_hook, None)
        guard = sdcguard.Guard(ddp, optimizer, lambda m, batch: m(batch).sum(),
                               config=sdcguard.Config(audit_every=0, weight_check_every=0),
                               reduce_hook=hook, reduce_state=state)
        grads = []
        for step in range(3):
            injector.begin_step(step)
            guard.train_step(step, X)
            grads.append(model.head.weight.grad.clone().view(-1))
        assert torch.equal(grads[0], grads[2])
        assert (grads[1] != grads[0]).nonzero().reshape(-1).tolist() == [5] and grads[1][5] == grads[0][5] * 4
        assert len(buckets) == 3  # one bucket a step, through the user's hook
    finally:
        dist.destroy_process_group()
