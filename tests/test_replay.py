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
