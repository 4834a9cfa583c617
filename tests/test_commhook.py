"""The comm hook (sdcguard.checks.commhook) in one gloo process: DDP with the hook computes the
same gradient bits as without it, and the recorder holds what the checks read — the local and
the local squared norms, the reduced checksums, check 4's vote, and on audit steps each parameter's fingerprint."""
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from sdcguard.checks.commhook import GradientRecorder, record_then_reduce
from sdcguard.checks.norms import squared_norm
from sdcguard.fingerprint import fingerprint, fingerprint_sums


@pytest.fixture
def group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def grads(hooked: bool, audit: bool = False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    ddp = DDP(model)
    recorder = None
    if hooked:
        recorder = GradientRecorder(list(model.parameters()))
        ddp.register_comm_hook(recorder, record_then_reduce)
        recorder.begin_step(audit, 0)
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
    ddp(x).square().mean().backward()
    return [p.grad.clone() for p in model.parameters()], recorder


def test_the_hook_changes_no_gradient_bit(group):
    plain, _ = grads(hooked=False)
    hooked, recorder = grads(hooked=True)
    assert all(torch.equal(a, b) for a, b in zip(plain, hooked))
    assert recorder.local and recorder.local.keys() == recorder.reduced.keys()


def test_the_recorder_holds_what_the_checks_read(group):
    hooked, recorder = grads(hooked=True, audit=True)
    local, reduced = recorder.rows(torch.device("cpu")).tolist()
    assert local == pytest.approx(sum(float(squared_norm(g)) for g in hooked), rel=1e-6)
    # one rank: the reduced bucket is the local one, so its checksum is the local checksum
    assert reduced == pytest.approx(sum(float(t[0]) for t in recorder.local.values()), rel=1e-12)
    x, y = recorder.vote(torch.device("cpu")).tolist()
    assert abs(x) <= y  # one rank: the local and reduced checksums agree within the bound
    assert recorder.fingerprints() == ([], {i: fingerprint(g) for i, g in enumerate(hooked)})
    assert recorder.checks_reduction  # DDP's own mean: check 4 runs


def test_no_fingerprints_off_audit_steps(group):
    _, recorder = grads(hooked=True, audit=False)
    assert recorder.fingerprints() == ([], {})


def test_fingerprints_of_every_bucket_reach_the_host_in_one_read(group, monkeypatch):
    """Small buckets (DDP rebuilds them after the first step): each parameter's fingerprint, as
    ``fingerprint`` gives it, with one host read for all the buckets and the step's losses, not
    one per bucket."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    ddp = DDP(model, bucket_cap_mb=1e-4)
    recorder = GradientRecorder(list(model.parameters()))
    ddp.register_comm_hook(recorder, record_then_reduce)
    for step in range(2):
        recorder.begin_step(True, step)
        ddp(torch.randn(5, 6, generator=torch.Generator().manual_seed(step))).square().mean().backward()
    assert len(recorder.pending) >= 2
    reads = []
    tolist = torch.Tensor.tolist

    def counted(self, *args, **kwargs):
        reads.append(tuple(self.shape))
        return tolist(self, *args, **kwargs)

    losses = [torch.tensor(0.25), torch.tensor(1.5)]
    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    found_losses, found = recorder.fingerprints(fingerprint_sums(losses))
    monkeypatch.undo()
    assert found == {i: fingerprint(p.grad) for i, p in enumerate(model.parameters())}
    assert found_losses == [fingerprint(loss) for loss in losses]
    assert reads == [(6, 2)]
