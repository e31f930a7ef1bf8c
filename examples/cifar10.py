"""The Rudra paper's CIFAR10 recipe (Gupta, Zhang, Wang, ICDM 2016), trained through ``LightningCLI``.

Run from the repository root (``fit`` trains, then tests and prints ``final test accuracy: ...``)::

    python -m examples.cifar10 fit --config examples/configs/cifar10_paper.yaml
    python -m examples.cifar10 --config examples/configs/cifar10_paper.yaml   # same: fit + test

The data are the CIFAR-10 "python version" batches, read without torchvision.
"""

import pickle
import tarfile
import urllib.request
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

from examples.common import ClassifierModule, TensorDataModule, run_cli

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR10_FOLDER = "cifar-10-batches-py"
TRAIN_FILES = [f"data_batch_{i}" for i in range(1, 6)]
TEST_FILES = ["test_batch"]


class PaperCIFAR10Net(nn.Sequential):
    """3 x (5x5 conv + 3/2 pool) and one fully connected layer: 89,578 parameters (the paper's ~90 K).

    The layout is cuda-convnet's ``layers-18pct`` without its response normalisation; its pooling rounds
    sizes up (``ceil_mode``), so the maps shrink 32 -> 16 -> 8 -> 4.
    """

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__(
            nn.Conv2d(3, 32, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(3, 2, ceil_mode=True),
            nn.Conv2d(32, 32, 5, padding=2),
            nn.ReLU(),
            nn.AvgPool2d(3, 2, ceil_mode=True),
            nn.Conv2d(32, 64, 5, padding=2),
            nn.ReLU(),
            nn.AvgPool2d(3, 2, ceil_mode=True),
            nn.Flatten(),
            nn.Linear(64 * 4 * 4, num_classes),
        )


class CIFAR10Classifier(ClassifierModule):
    """``PaperCIFAR10Net`` trained with SGD + momentum, the learning rate x ``gamma`` at each milestone epoch."""

    def __init__(
        self, lr: float = 0.001, momentum: float = 0.9, milestones: list[int] = [120, 130], gamma: float = 0.1
    ) -> None:
        super().__init__(num_classes=10)
        self.save_hyperparameters()
        self.net = PaperCIFAR10Net()

    def configure_optimizers(self) -> dict:
        hp = self.hparams
        optimizer = torch.optim.SGD(self.parameters(), lr=hp.lr, momentum=hp.momentum)
        scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=hp.milestones, gamma=hp.gamma)
        return {"optimizer": optimizer, "lr_scheduler": scheduler}  # the scheduler steps once per epoch


def _missing(folder: Path, reason: str) -> FileNotFoundError:
    files = ", ".join(TRAIN_FILES + TEST_FILES)
    return FileNotFoundError(
        f"CIFAR-10 not found in {folder} ({reason}). Expected the python-version batches {files} there. "
        f"Fetch {CIFAR10_URL} by hand and extract it into {folder.parent}."
    )


def download_cifar10(data_dir: Path) -> None:
    """Download and extract the CIFAR-10 python batches into ``data_dir`` (~170 MB)."""
    archive = data_dir / "cifar-10-python.tar.gz"
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        with urllib.request.urlopen(CIFAR10_URL, timeout=30) as response, open(archive, "wb") as out:
            while chunk := response.read(1 << 20):
                out.write(chunk)
        with tarfile.open(archive) as tar:
            tar.extractall(data_dir, filter="data")
    except (OSError, tarfile.TarError) as err:  # URLError and timeouts are OSErrors
        raise _missing(data_dir / CIFAR10_FOLDER, f"download failed: {err}") from err
    finally:
        archive.unlink(missing_ok=True)


def load_batches(folder: Path, names: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Images as uint8 [N, 3, 32, 32] and labels as int64 [N] from pickled python-version batches."""
    images, labels = [], []
    for name in names:
        with open(folder / name, "rb") as f:
            batch = pickle.load(f, encoding="bytes")
        images.append(np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
        labels.append(np.asarray(batch[b"labels"], dtype=np.int64))
    return torch.from_numpy(np.concatenate(images)), torch.from_numpy(np.concatenate(labels))


class CIFAR10DataModule(TensorDataModule):
    """CIFAR-10 from ``data_dir/cifar-10-batches-py``, normalised per channel with the training set's statistics.

    Validation uses the test batch (the paper reports test error); there is no augmentation.
    """

    def __init__(
        self, data_dir: str = "data/cifar10", batch_size: int = 128, download: bool = True, num_workers: int = 0
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.folder = Path(data_dir) / CIFAR10_FOLDER
        self.train_set: Optional[TensorDataset] = None
        self.test_set: Optional[TensorDataset] = None

    def _missing_files(self) -> list[str]:
        return [name for name in TRAIN_FILES + TEST_FILES if not (self.folder / name).is_file()]

    def prepare_data(self) -> None:
        # Lightning calls this on one process per node, so only one of them downloads.
        if self.hparams.download and self._missing_files():
            download_cifar10(self.folder.parent)

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        missing = self._missing_files()
        if missing:
            reason = f"missing {', '.join(missing)}" + ("" if self.hparams.download else "; download=False")
            raise _missing(self.folder, reason)
        train_x, train_y = load_batches(self.folder, TRAIN_FILES)
        test_x, test_y = load_batches(self.folder, TEST_FILES)
        train_x, test_x = train_x.float() / 255, test_x.float() / 255
        mean = train_x.mean(dim=(0, 2, 3), keepdim=True)
        std = train_x.std(dim=(0, 2, 3), keepdim=True)
        self.train_set = TensorDataset((train_x - mean) / std, train_y)
        self.test_set = TensorDataset((test_x - mean) / std, test_y)
        self.val_set = self.test_set


def main() -> None:
    run_cli(CIFAR10Classifier, CIFAR10DataModule)


if __name__ == "__main__":
    main()
