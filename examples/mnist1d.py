"""MNIST-1D with a small 1-D CNN, trained through ``LightningCLI``.

Run from the repository root (``fit`` trains, then tests and prints ``final test accuracy: ...``)::

    python -m examples.mnist1d fit --config examples/configs/mnist1d_async.yaml
    python -m examples.mnist1d --config examples/configs/mnist1d_async.yaml   # same: fit + test

Without ``lightning_rudra``, add ``--trainer.strategy=auto --trainer.devices=1``.
"""

import random
from typing import Literal, Optional

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

from examples.common import ClassifierModule, TensorDataModule, run_cli


def generate_mnist1d(num_samples: int, seed: int, test_fraction: float) -> dict:
    """Generate MNIST-1D in memory (``make_dataset`` neither downloads nor writes files).

    Returns mnist1d's dict with ``x`` [N, 40] float64, ``y`` [N] int64 and ``x_test``/``y_test``;
    mnist1d makes ``num_samples // 10`` samples per class.
    """
    from mnist1d.data import get_dataset_args, make_dataset  # here: the model alone needs no data package

    args = get_dataset_args()
    args.num_samples, args.seed, args.train_split = num_samples, seed, 1.0 - test_fraction
    # make_dataset reseeds the global `random` and NumPy generators: restore them afterwards so that
    # building the data does not silently reset the rest of the run's randomness.
    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        return make_dataset(args)
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)


class MNIST1DDataModule(TensorDataModule):
    """MNIST-1D, generated deterministically from ``seed`` in every process.

    ``test_fraction`` of the samples form the test split; the last ``val_fraction`` of the remaining
    training samples are held out for validation (the test split is never used for validation).
    """

    def __init__(
        self,
        num_samples: int = 4000,
        seed: int = 42,
        batch_size: int = 32,
        test_fraction: float = 0.2,
        val_fraction: float = 0.1,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.train_set: Optional[TensorDataset] = None
        self.val_set: Optional[TensorDataset] = None
        self.test_set: Optional[TensorDataset] = None

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        hp = self.hparams
        data = generate_mnist1d(hp.num_samples, hp.seed, hp.test_fraction)
        x, y = torch.tensor(data["x"], dtype=torch.float32), torch.tensor(data["y"])
        n_val = int(len(y) * hp.val_fraction)
        self.train_set = TensorDataset(x[: len(y) - n_val], y[: len(y) - n_val])
        self.val_set = TensorDataset(x[len(y) - n_val :], y[len(y) - n_val :])
        self.test_set = TensorDataset(torch.tensor(data["x_test"], dtype=torch.float32), torch.tensor(data["y_test"]))


class MNIST1DClassifier(ClassifierModule):
    """Three strided 1-D convolutions and a linear layer: [B, 40] -> [B, 10] logits."""

    def __init__(
        self,
        lr: float = 0.05,
        momentum: float = 0.9,
        optimizer: Literal["sgd", "adam"] = "sgd",
        weight_decay: float = 0.0,
        channels: int = 32,
    ) -> None:
        super().__init__(num_classes=10)
        self.save_hyperparameters()
        c = channels
        self.net = nn.Sequential(
            nn.Unflatten(1, (1, 40)),  # [B, 40] -> [B, 1, 40]
            nn.Conv1d(1, c, 5, stride=2, padding=1),
            nn.ReLU(),  # 40 -> 19
            nn.Conv1d(c, c, 3, stride=2, padding=1),
            nn.ReLU(),  # 19 -> 10
            nn.Conv1d(c, c, 3, stride=2, padding=1),
            nn.ReLU(),  # 10 -> 5
            nn.Flatten(),
            nn.Linear(c * 5, 10),
        )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        hp = self.hparams
        if hp.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay)
        if hp.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=hp.lr, momentum=hp.momentum, weight_decay=hp.weight_decay)
        raise ValueError(f"optimizer must be 'sgd' or 'adam', got {hp.optimizer!r}")


def main() -> None:
    run_cli(MNIST1DClassifier, MNIST1DDataModule)


if __name__ == "__main__":
    main()
