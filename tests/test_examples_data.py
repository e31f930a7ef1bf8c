"""Fast single-process checks of the examples' data, networks and training step."""

import pickle
from types import SimpleNamespace

import numpy as np
import pytest
import pytorch_lightning as pl
import torch

from examples.cifar10 import CIFAR10_FOLDER, CIFAR10_URL, CIFAR10DataModule, PaperCIFAR10Net
from examples.common import print_staleness
from examples.mnist1d import MNIST1DClassifier, MNIST1DDataModule


def _mnist1d(stage: str = "fit", **kwargs) -> MNIST1DDataModule:
    dm = MNIST1DDataModule(**kwargs)
    dm.setup(stage)
    return dm


def test_mnist1d_shapes_and_labels():
    dm = _mnist1d(num_samples=1000, test_fraction=0.2, batch_size=16)
    assert len(dm.test_set) == 200 and len(dm.train_set) + len(dm.val_set) == 800 and len(dm.val_set) == 80
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (16, 40) and x.dtype == torch.float32 and y.dtype == torch.int64
    labels = torch.cat([dm.train_set.tensors[1], dm.val_set.tensors[1], dm.test_set.tensors[1]])
    assert set(labels.tolist()) == set(range(10))


def test_mnist1d_is_deterministic_per_seed_and_keeps_global_rng():
    np.random.seed(123)
    expected = np.random.rand()
    np.random.seed(123)
    a = _mnist1d(num_samples=500, seed=1)
    assert np.random.rand() == expected  # mnist1d reseeds NumPy; the datamodule restores its state
    b = _mnist1d(num_samples=500, seed=1)
    c = _mnist1d(num_samples=500, seed=2)
    assert torch.equal(a.train_set.tensors[0], b.train_set.tensors[0])
    assert torch.equal(a.test_set.tensors[1], b.test_set.tensors[1])
    assert not torch.equal(a.train_set.tensors[0], c.train_set.tensors[0])


def _write_fake_cifar(root, n: int = 20) -> None:
    folder = root / CIFAR10_FOLDER
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), b"labels": rng.integers(0, 10, n).tolist()}
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f)


def test_cifar10_reads_python_batches(tmp_path):
    _write_fake_cifar(tmp_path)
    dm = CIFAR10DataModule(data_dir=str(tmp_path), batch_size=8, download=False)
    dm.prepare_data()
    dm.setup("fit")
    assert len(dm.train_set) == 100 and len(dm.test_set) == 20
    x, y = dm.train_set.tensors
    assert x.shape == (100, 3, 32, 32) and x.dtype == torch.float32
    assert y.dtype == torch.int64 and 0 <= y.min() and y.max() <= 9
    torch.testing.assert_close(x.mean(dim=(0, 2, 3)), torch.zeros(3), atol=1e-4, rtol=0)
    torch.testing.assert_close(x.std(dim=(0, 2, 3)), torch.ones(3), atol=1e-4, rtol=0)
    xb, yb = next(iter(dm.test_dataloader()))
    assert xb.shape == (8, 3, 32, 32) and yb.shape == (8,)


def test_cifar10_missing_files_error_names_directory(tmp_path):
    dm = CIFAR10DataModule(data_dir=str(tmp_path), download=False)
    dm.prepare_data()  # download=False: must not try the network
    with pytest.raises(FileNotFoundError) as info:
        dm.setup("fit")
    message = str(info.value)
    assert str(tmp_path / CIFAR10_FOLDER) in message and "data_batch_1" in message and CIFAR10_URL in message


def test_paper_cifar10_net_size_and_output():
    net = PaperCIFAR10Net()
    assert 80_000 <= sum(p.numel() for p in net.parameters()) <= 100_000
    assert net(torch.zeros(2, 3, 32, 32)).shape == (2, 10)


def test_mnist1d_classifier_learns_in_one_epoch():
    pl.seed_everything(0)
    dm = MNIST1DDataModule(num_samples=512, batch_size=16)
    model = MNIST1DClassifier(optimizer="adam", lr=0.01)  # SGD's first epoch is too slow for a clear margin
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    before = trainer.validate(model, datamodule=dm, verbose=False)[0]["val_loss"]
    trainer.fit(model, datamodule=dm)
    after = trainer.validate(model, datamodule=dm, verbose=False)[0]["val_loss"]
    assert after < before - 0.1  # seeds 0-4 all gave 0.27-0.45


def test_print_staleness(capsys):
    print_staleness(SimpleNamespace(clock=5, gradients=12, dropped=1, staleness={0: 2, 1: 6, 3: 3, 4: 0}))
    out = capsys.readouterr().out
    assert "updates applied: 5, gradients: 12, dropped: 1" in out
    assert "mean σ = 1.36, max σ = 3" in out and "σ=0: 2, σ=1: 6, σ=3: 3" in out
