"""The update gate (sdcguard.gate) on a bare optimizer: no update outside an open, checked step;
the count of which step's update the weights hold."""
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
