"""settle_buckets puts back everything but DDP's bucket layout, and refuses to run through a comm
hook (one gloo process; tests/test_example_gpt.py shows a resumed run then ends bit for bit where
the uninterrupted one does)."""
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import sdcguard


@pytest.fixture
def group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _loss(model, batch):
    return model(batch).square().mean()


def test_random_state_buffers_and_gradients_are_put_back(group):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Dropout(0.5))
    model = DDP(net)
    net[0].weight.grad = torch.full_like(net[0].weight, 7.0)  # e.g. left from an accumulation
    buffers = [b.clone() for b in net.buffers()]
    rng = torch.get_rng_state()
    sdcguard.settle_buckets(model, _loss, torch.randn(8, 4, generator=torch.Generator().manual_seed(1)))
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(a, b) for a, b in zip(net.buffers(), buffers))
    assert torch.equal(net[0].weight.grad, torch.full_like(net[0].weight, 7.0)) and net[0].bias.grad is None


def test_refused_once_a_comm_hook_is_registered(group):
    model = DDP(torch.nn.Linear(4, 4))

    def hook(state, bucket):
        future = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    model.register_comm_hook(None, hook)
    with pytest.raises(RuntimeError, match="before a comm hook is registered"):
        sdcguard.settle_buckets(model, _loss, torch.randn(2, 4))


def test_one_process_has_nothing_to_settle():
    net = torch.nn.Linear(4, 4)
    sdcguard.settle_buckets(net, _loss, torch.randn(2, 4))
    assert net.weight.grad is None
