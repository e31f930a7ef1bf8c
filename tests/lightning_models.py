"""Small LightningModules and helpers for the strategy tests (importable by spawned learners)."""

import os

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_rudra import RudraStrategy


def regression_data(num_samples: int = 256, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, 6, generator=g)
    w = torch.randn(6, 1, generator=g)
    return TensorDataset(x, torch.tanh(x @ w) + 0.05 * torch.randn(num_samples, 1, generator=g))


def loader(batch_size: int, num_samples: int = 256, seed: int = 0) -> DataLoader:
    return DataLoader(regression_data(num_samples, seed), batch_size=batch_size, shuffle=False)


def flat(params) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params])


class Regression(pl.LightningModule):
    def __init__(self, lr: float = 0.05, momentum: float = 0.9) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.lr, self.momentum = lr, momentum

    def loss(self, batch) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch), sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self.loss(batch), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


class ProbedRudra(RudraStrategy):
    """Saves what the server holds once training has ended (learner 0), for the test to compare."""

    probe_path: str = ""

    def on_train_end(self) -> None:
        super().on_train_end()
        if self.is_global_zero and self.probe_path:
            params, buffers = self._client.pull()
            lrs = [[g["lr"] for g in opt.state_dict()["param_groups"]] for opt in self.optimizers]
            torch.save({"params": params, "buffers": buffers, "lrs": lrs, "pid": os.getpid()}, self.probe_path)


def quiet_trainer(strategy, devices: int, **kwargs) -> pl.Trainer:
    options = dict(accelerator="cpu", devices=devices, strategy=strategy, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    options.update(kwargs)
    return pl.Trainer(**options)
