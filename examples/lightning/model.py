"""A small LightningModule, written as a Lightning user writes one: nothing in it knows sdcguard."""
import lightning as L
import torch
import torch.nn.functional as F


class TinyClassifier(L.LightningModule):
    """An MLP with a LayerNorm classifying 4 classes; AdamW with a step-decayed learning rate."""

    def __init__(self, features: int = 16, hidden: int = 32, classes: int = 4, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()  # stored in every checkpoint (an AttributeDict)
        self.lr = lr
        self.net = torch.nn.Sequential(
            torch.nn.Linear(features, hidden), torch.nn.LayerNorm(hidden), torch.nn.GELU(),
            torch.nn.Linear(hidden, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
