"""The drill's small deterministic model and data: everything derives from one seed."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..checks.rng import forward_seed

FEATURES, WIDTH, CLASSES = 16, 32, 4
SITE, PARAM = "embed", "hidden.weight"
"""Where the drill's faults strike unless a fault names its own target: forward faults in the first
layer's output, every other kind in the hidden layer's weight (element 0)."""


class DrillModel(nn.Module):
    """An MLP with LayerNorm and dropout: enough structure for every fault kind to land."""

    def __init__(self, dropout: float = 0.1) -> None:
        super().__init__()
        self.embed = nn.Linear(FEATURES, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.drop = nn.Dropout(dropout)
        self.hidden = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(F.gelu(self.norm(self.embed(x))))
        return self.head(F.gelu(self.hidden(h)))


TP_PLAN = {"hidden": "colwise", "head": "rowwise"}
"""The drill's tensor-parallel plan (``--tp``): the hidden layer column-wise, the head row-wise
(Megatron's MLP pair: one all-reduce per forward, after the head)."""


def tp_local_shape(name: str, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    """Pure: the shape of a rank's tensor-parallel shard of the drill model's parameter ``name``."""
    if tp == 1:
        return shape
    layer, kind = name.rsplit(".", 1)
    style = TP_PLAN.get(layer)
    if style == "colwise":  # weight and bias split along the output features
        return (shape[0] // tp, *shape[1:])
    if style == "rowwise" and kind == "weight":  # along the input features; the bias is replicated
        return (shape[0], shape[1] // tp)
    return shape


def make_batch(seed: int, step: int, rank: int, micro: int, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s micro-batch ``micro`` of step ``step``; labels come from a fixed teacher."""
    teacher = torch.Generator().manual_seed(seed)
    weights = torch.randn(FEATURES, CLASSES, generator=teacher)
    gen = torch.Generator().manual_seed(forward_seed(seed + 1, step, rank, micro))
    x = torch.randn(size, FEATURES, generator=gen)
    return x, (x @ weights).argmax(dim=1)


def loss_fn(module: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(module(x), y)
