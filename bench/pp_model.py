"""The pipeline benchmarks' model family (bench/pipeline.py's): blocks of LayerNorm, Linear, GELU,
dropout, Linear with a residual, two per stage, a 10-way head on the last stage; a replica's batch
of 16 rows, its labels a function of the inputs; gradient clipping over the whole pipeline.
Imported by bench/overhead.py ``--pp`` (torch imported by the caller's worker, never at launch)."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

WIDTH = 64
MICRO_BATCHES = 4


class Block(nn.Module):
    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.norm, self.fc, self.proj, self.drop = nn.LayerNorm(width), nn.Linear(width, 4 * width), \
            nn.Linear(4 * width, width), nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.proj(F.gelu(self.fc(self.norm(x)))))


def stage_module(index: int, num_stages: int, width: int = WIDTH) -> nn.Module:
    """Stage ``index``: the same weights on every replica (seeded by the index)."""
    torch.manual_seed(index)
    layers: list[nn.Module] = [Block(width), Block(width)]
    if index == num_stages - 1:
        layers.append(nn.Linear(width, 10))
    return nn.Sequential(*layers)


def batch(step: int, replica: int, width: int = WIDTH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + replica)
    x = torch.randn(16, width, generator=g)
    return x, (x[:, :10].sum(1) * 7).long().remainder(10)


def clip(modules, group) -> None:
    """Clip to norm 1 over the whole pipeline (every stage's gradients, summed over ``group``)."""
    grads = [p.grad for m in modules for p in m.parameters() if p.grad is not None]
    total = torch.stack([g.pow(2).sum() for g in grads]).sum()
    dist.all_reduce(total, group=group)
    coef = min(1.0, 1.0 / (float(total.sqrt()) + 1e-6))
    for g in grads:
        g.mul_(coef)
