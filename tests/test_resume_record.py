"""A run that starts from a checkpoint leaves a resume record in the spool (agent/reporting.py,
``Guard.resumed``): the checkpoint's path, manifest step and sha256, for the sidecar to publish and
the operator to record on the job's incident (tests/test_kubectl_plugin.py follows it from the
spool through the real publisher to the incident). In one process, with the Guard's own store."""
import json

import torch
from torch import nn

import sdcguard
from sdcguard.checkpoint import manifest_path
from sdcguard.config import Config
from sdcguard.contract import resume, spool

JOB = {"kind": "PyTorchJob", "name": "llm", "namespace": "ml", "uid": "0000beef-0000-4000-8000-000000000000"}


def make(**cfg):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return sdcguard.Guard(model, opt, lambda m, b: ((m(b[0]).squeeze(-1) - b[1]) ** 2).mean(), config=Config(**cfg))


def train(guard, steps):
    for step in steps:
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        guard.train_step(step, (x, x.sum(dim=1)))


def test_resuming_from_a_checkpoint_spools_its_identity_for_the_incident(tmp_path):
    first = make()
    train(first, range(3))
    path = first.save_checkpoint(tmp_path / "ckpt.pt")
    sha = json.loads(manifest_path(path).read_text())["sha256"]
    outside = tmp_path / "outside"  # no job (not in Kubernetes): nothing is spooled
    make(spool=str(outside)).load_checkpoint(path)
    assert spool.list_records(outside) == []
    inside = tmp_path / "spool"
    resumed = make(spool=str(inside), job=JOB, pod="llm-worker-0", node="node-a")
    assert resumed.load_checkpoint(path) == 2
    [written] = spool.list_records(inside)
    record = resume.loads(written.read_text())
    assert record["job"] == JOB and record["checkpoint"] == {"path": str(path), "step": 2, "sha256": sha}
    assert record["reporter"]["rank"] == 0 and record["reporter"]["pod"] == "llm-worker-0"
    assert spool.list_alarms(inside) == []  # not an alarm: the library waits for none
