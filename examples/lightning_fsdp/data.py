"""Synthetic data built in code (nothing is downloaded): a DataModule over a fixed tensor dataset.

Lightning gives each rank its own slice through a DistributedSampler, epoch after epoch alike.
"""
import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


class RandomData(L.LightningDataModule):
    def __init__(self, samples: int, batch_size: int, features: int = 16, seed: int = 1234) -> None:
        super().__init__()
        self.samples, self.batch_size, self.features, self.seed = samples, batch_size, features, seed

    def setup(self, stage: str) -> None:
        g = torch.Generator().manual_seed(self.seed)
        x = torch.randn(self.samples, self.features, generator=g)
        y = (x[:, :4] + 0.3 * torch.randn(self.samples, 4, generator=g)).argmax(dim=1)
        self.train_set = TensorDataset(x, y)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size)
