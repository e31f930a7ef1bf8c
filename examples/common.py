"""Pieces shared by the examples: the classifier's steps and metrics, and the command line."""

import sys
from typing import Any, Optional

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.cli import LightningCLI
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy


class ClassifierModule(pl.LightningModule):
    """Cross-entropy classifier; subclasses build ``self.net`` and define ``configure_optimizers``."""

    net: torch.nn.Module

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.val_acc = MulticlassAccuracy(num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes, average="micro")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "val", self.val_acc)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "test", self.test_acc)

    def _evaluate(self, batch: Any, stage: str, accuracy: MulticlassAccuracy) -> None:
        x, y = batch
        logits = self(x)
        self.log(f"{stage}_loss", F.cross_entropy(logits, y), sync_dist=True)
        accuracy(logits, y)
        # Lightning computes (and torchmetrics syncs across processes) a logged Metric at epoch end.
        self.log(f"{stage}_acc", accuracy, sync_dist=True)


class TensorDataModule(pl.LightningDataModule):
    """Loaders over in-memory datasets that ``setup`` puts in ``train_set``, ``val_set`` and ``test_set``;
    subclasses save ``batch_size`` and ``num_workers`` as hyper-parameters."""

    train_set: TensorDataset
    val_set: TensorDataset
    test_set: TensorDataset

    def _loader(self, dataset: TensorDataset, shuffle: bool) -> DataLoader:
        return DataLoader(
            dataset, batch_size=self.hparams.batch_size, shuffle=shuffle, num_workers=self.hparams.num_workers
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, shuffle=False)


def print_staleness(stats: Any) -> None:
    """Summarise ``RudraStrategy.stats``: ``clock``, ``gradients``, ``dropped``, ``staleness`` (σ -> count)."""
    hist = {int(s): int(c) for s, c in sorted(stats.staleness.items()) if c}
    total = sum(hist.values())
    mean = sum(s * c for s, c in hist.items()) / total if total else 0.0
    rejected = getattr(stats, "rejected", None)  # non-finite gradients, when the strategy counts them
    print(
        f"updates applied: {stats.clock}, gradients: {stats.gradients}, dropped: {stats.dropped}"
        + ("" if rejected is None else f", rejected: {rejected}")
    )
    print(f"staleness: mean σ = {mean:.2f}, max σ = {max(hist, default=0)}")
    print("staleness histogram: " + ", ".join(f"σ={s}: {c}" for s, c in hist.items()))


class FitTestCLI(LightningCLI):
    """``LightningCLI`` whose ``fit`` also tests the final model and prints a summary on rank 0."""

    def after_fit(self) -> None:
        stats = getattr(self.trainer.strategy, "stats", None)  # RudraStrategy's training statistics
        results = self.trainer.test(self.model, datamodule=self.datamodule)
        if not self.trainer.is_global_zero:
            return
        if stats is not None:
            print_staleness(stats)
        if "test_acc" in results[0]:
            print(f"final test accuracy: {results[0]['test_acc']:.3f}")
        else:  # a model without an accuracy, such as the language model: its loss
            print(f"final test loss: {results[0]['test_loss']:.3f}")


def run_cli(model_class: type, datamodule_class: type, args: Optional[list[str]] = None) -> FitTestCLI:
    """Run ``LightningCLI`` with the usual subcommands, or fit + test when none is given.

    ``python -m examples.X fit --config C`` and ``python -m examples.X --config C`` both train, test and
    print ``final test accuracy: ...``; ``validate``/``test``/``predict`` behave as in ``LightningCLI``.
    """
    argv = sys.argv[1:] if args is None else args
    has_subcommand = bool(argv) and argv[0] in LightningCLI.subcommands()
    cli = FitTestCLI(
        model_class, datamodule_class, save_config_kwargs={"overwrite": True}, run=has_subcommand, args=args
    )
    if not has_subcommand:
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        cli.after_fit()
    return cli
