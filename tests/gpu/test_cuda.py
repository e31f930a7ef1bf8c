"""Learners on a GPU (issue 37). Skipped where CUDA is not available; on a GPU machine:
``python -m pytest -m gpu tests/gpu`` (benchmarks/gpu_check.sh runs them with the GPU benchmark).
``RUDRA_GPU_TESTS_DEVICE=cpu`` runs the same tests on the CPU, to check the tests themselves where no GPU is."""

import os

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

import pytorch_lightning as pl

from lightning_rudra import RudraStrategy
from tests.lightning_models import (
    START,
    Regression,
    flat,
    loader,
    quiet_trainer,
    regression_data,
    single_process_sgd,
)

DEVICE = os.environ.get("RUDRA_GPU_TESTS_DEVICE") or ("cuda" if torch.cuda.is_available() else None)
ACCELERATOR = {"cuda": "gpu", "cpu": "cpu", None: "cpu"}[DEVICE]
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.skipif(DEVICE is None, reason="needs CUDA (or RUDRA_GPU_TESTS_DEVICE=cpu)"),
]
ATOL = 1e-5  # float32 on the GPU sums in another order than the CPU reference


class TrainsOnTheDevice(pl.Callback):
    """Fails the learner whose module or batch is not on the device while it trains: each learner runs it in its
    own process, and a learner's error ends the run (the test's module is on the CPU again after fit: Lightning's
    teardown moves it there)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        where = {p.device.type for p in pl_module.parameters()} | {batch[0].device.type}
        assert where == {DEVICE}, f"learner {trainer.global_rank} trains on {where}, not on {DEVICE}"


def on_device(strategy, devices: int = 1, **kwargs):
    callbacks = [TrainsOnTheDevice(), *kwargs.pop("callbacks", [])]
    return quiet_trainer(strategy, devices, accelerator=ACCELERATOR, callbacks=callbacks, **kwargs)


def trained_on_device(model) -> torch.Tensor:
    return flat(model.parameters()).cpu()


def test_async_with_one_learner_process_is_plain_lightning_on_the_gpu():
    # one real learner process on the GPU and a server process: the gradient crosses to the server's CPU tensors
    # and the weights come back to the device, every step
    mu, epochs = 8, 2
    model = Regression()
    strategy = RudraStrategy(protocol="async", sampling="static", start_method=START, rpc_timeout=60)
    on_device(strategy, max_epochs=epochs).fit(model, loader(mu))
    reference, data = Regression(), regression_data()
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    on_device("auto", max_epochs=epochs).fit(reference, DataLoader(data, mu, sampler=sampler))
    expected = trained_on_device(reference)
    torch.testing.assert_close(trained_on_device(model), expected, rtol=0, atol=ATOL)
    torch.testing.assert_close(expected, single_process_sgd(epochs, mu), rtol=0, atol=ATOL)


@pytest.mark.parametrize("shared_memory", [True, False])
def test_hardsync_with_two_learner_processes_on_one_gpu_equals_sgd_with_batch_mu_lambda(shared_memory):
    # Lightning refuses devices=2 on a machine with one GPU; two learners can share it as parallel_devices
    learners, mu, epochs = 2, 8, 2
    device = torch.device(DEVICE, 0) if DEVICE == "cuda" else torch.device("cpu")
    model = Regression()
    strategy = RudraStrategy(
        protocol="hardsync",
        shared_memory=shared_memory,
        parallel_devices=[device] * learners,
        start_method=START,
        rpc_timeout=60,
    )
    trainer = on_device(strategy, max_epochs=epochs)
    trainer.fit(model, loader(mu))
    torch.testing.assert_close(trained_on_device(model), single_process_sgd(epochs, mu * learners), rtol=0, atol=ATOL)
    assert trainer.strategy.stats.clock == epochs * 256 // (mu * learners)  # two learners, not one


@pytest.mark.parametrize("protocol, learners", [("hardsync", 4), ("async", 1)])
def test_simulated_learners_on_the_gpu_are_exact(protocol, learners):
    model = Regression()
    on_device(RudraStrategy(protocol=protocol, simulate=learners), max_epochs=2).fit(model, loader(8))
    torch.testing.assert_close(trained_on_device(model), single_process_sgd(2, 8 * learners), rtol=0, atol=ATOL)


def test_a_checkpoint_saved_on_the_gpu_resumes_exactly(tmp_path):
    from pytorch_lightning.callbacks import ModelCheckpoint

    whole = Regression()
    on_device(RudraStrategy(protocol="hardsync", simulate=4), max_epochs=2).fit(whole, loader(8))
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    first = on_device(
        RudraStrategy(protocol="hardsync", simulate=4), max_epochs=1, callbacks=[checkpoint], enable_checkpointing=True
    )
    first.fit(Regression(), loader(8))
    saved = torch.load(tmp_path / "last.ckpt", map_location="cpu", weights_only=False)
    assert saved["state_dict"], "the checkpoint holds the weights"
    resumed = Regression()
    trainer = on_device(RudraStrategy(protocol="hardsync", simulate=4), max_epochs=2)
    trainer.fit(resumed, loader(8), ckpt_path=str(tmp_path / "last.ckpt"))
    torch.testing.assert_close(trained_on_device(resumed), trained_on_device(whole), rtol=0, atol=ATOL)
    assert trainer.strategy.stats.clock == 16
