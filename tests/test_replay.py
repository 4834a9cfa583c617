"""checks/replay.replay in one process: the gradients it sums over micro-batches are the bits
plain accumulation into ``.grad`` gives, whatever tensors the autograd engine hands it."""
from __future__ import annotations

import torch

from sdcguard.checks.replay import Payload, Weighting, replay
from sdcguard.fingerprint import fingerprint


class Shared(torch.nn.Module):
    """``a + b``: the engine hands both parameters one gradient tensor; ``c`` is broadcast."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(5, 3))
        self.b = torch.nn.Parameter(torch.randn(5, 3))
        self.c = torch.nn.Parameter(torch.randn(3))
        self.linear = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.linear(x) * (self.a + self.b) + self.c).square().sum()


def loss_fn(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x)


def test_summed_replay_gradients_are_plain_accumulation_bit_for_bit() -> None:
    torch.manual_seed(0)
    module = Shared()
    micro = [torch.randn(5, 3) for _ in range(3)]
    for x in micro:  # what the owner's backward leaves in .grad
        (loss_fn(module, x) / 3).backward()
    expected = {n: fingerprint(p.grad) for n, p in module.named_parameters()}
    module.zero_grad(set_to_none=True)
    params = list(enumerate(module.parameters()))
    payload = Payload(0, 0, micro, weighting=[Weighting("div", 3)] * 3)
    result = replay(module, loss_fn, params, payload, seed=0, device=torch.device("cpu"))
    names = [n for n, _ in module.named_parameters()]
    assert {names[i]: fp for i, fp in result.grad_fps.items()} == expected
    assert all(p.grad is None for p in module.parameters())  # the replay leaves .grad alone


def test_one_micro_batch_is_replayed_without_hooks_to_the_same_bits() -> None:
    """One micro-batch: autograd.grad's own answer is the sum (no per-parameter hook), the loss
    fingerprint is read with the gradients', and the module is left as it was."""
    torch.manual_seed(1)
    module = Shared()
    x = torch.randn(5, 3)
    loss = loss_fn(module, x) * 0.5
    loss.backward()
    expected = {n: fingerprint(p.grad) for n, p in module.named_parameters()}
    module.zero_grad(set_to_none=True)
    hooks_before = [len(p._backward_hooks or {}) for p in module.parameters()]
    params = list(enumerate(module.parameters()))
    payload = Payload(0, 0, [x], weighting=[Weighting("mul", 0.5)])
    for with_norm in (False, True):
        result = replay(module, loss_fn, params, payload, seed=0, device=torch.device("cpu"), with_norm=with_norm)
        names = [n for n, _ in module.named_parameters()]
        assert {names[i]: fp for i, fp in result.grad_fps.items()} == expected
        assert result.loss_fps == [fingerprint(loss_fn(module, x).detach())]
        assert (result.grad_sq_norm is not None) == with_norm and result.nonfinite_micro is None
    assert all(p.grad is None for p in module.parameters())
    assert [len(p._backward_hooks or {}) for p in module.parameters()] == hooks_before


def test_an_unreached_parameter_replays_as_a_zero_gradient() -> None:
    """A parameter the batch does not reach (``allow_unused``) reads as zeros, as in DDP's bucket."""
    module = Shared()
    unused = torch.nn.Parameter(torch.ones(4))
    params = list(enumerate([*module.parameters(), unused]))
    result = replay(module, loss_fn, params, Payload(0, 0, [torch.randn(5, 3)]), seed=0, device=torch.device("cpu"))
    assert result.grad_fps[len(params) - 1] == fingerprint(torch.zeros(4))


def test_deterministic_mode_fills_no_memory_and_restores_the_users_settings() -> None:
    """Audit steps and replays run deterministic kernels without torch's NaN filling of new
    tensors (a debugging aid that costs a write of every allocation); both come back as they were."""
    import torch.utils.deterministic as fill

    from sdcguard.checks.determinism import deterministic

    assert not torch.are_deterministic_algorithms_enabled() and fill.fill_uninitialized_memory
    with deterministic(True):
        assert torch.are_deterministic_algorithms_enabled() and not fill.fill_uninitialized_memory
        with deterministic(True):
            pass
        assert torch.are_deterministic_algorithms_enabled() and not fill.fill_uninitialized_memory
    assert not torch.are_deterministic_algorithms_enabled() and fill.fill_uninitialized_memory
    fill.fill_uninitialized_memory = False  # a user's own setting survives too
    try:
        with deterministic(True):
            pass
        assert not fill.fill_uninitialized_memory
    finally:
        fill.fill_uninitialized_memory = True
