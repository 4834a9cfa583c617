"""A small LightningModule sharded with FSDP2 in ``configure_model``, as Lightning documents it for
``ModelParallelStrategy``: nothing in it knows sdcguard."""
import lightning as L
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


class ShardedClassifier(L.LightningModule):
    """An MLP with a LayerNorm classifying 4 classes; each Linear is an FSDP2 unit, ``self.model`` the root.

    ``replicate=1`` shards over Lightning's ``data_parallel`` mesh (pure FSDP); ``replicate=R``
    builds an HSDP mesh of R replicas, each sharded over world_size / R ranks."""

    def __init__(self, features: int = 16, hidden: int = 32, classes: int = 4, lr: float = 1e-2,
                 replicate: int = 1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.lr, self.replicate = lr, replicate
        self.model = torch.nn.Sequential(
            torch.nn.Linear(features, hidden), torch.nn.LayerNorm(hidden), torch.nn.GELU(),
            torch.nn.Linear(hidden, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, classes),
        )

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        tp = self.device_mesh["tensor_parallel"]
        if tp.size() > 1:  # tensor_parallel_size > 1: the second hidden layer column-wise, the head row-wise
            parallelize_module(self.model, tp, {"3": ColwiseParallel(), "5": RowwiseParallel()})
        if self.replicate > 1:  # HSDP: (replicate, shard) over the same ranks
            shape, names = (self.replicate, mesh.size() // self.replicate), ("replicate", "shard")
            if tp.size() > 1:  # the same TP groups (Lightning's fastest dimension) inside a 3-D mesh
                shape, names = (*shape, tp.size()), (*names, "tensor_parallel")
            mesh = init_device_mesh(mesh.device_type, shape, mesh_dim_names=names)
            mesh = mesh["replicate", "shard"] if tp.size() > 1 else mesh
        for layer in (self.model[0], self.model[3], self.model[5]):
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)  # the root last: the LayerNorm's parameters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
