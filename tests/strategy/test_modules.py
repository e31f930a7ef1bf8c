"""The long tail of LightningModules (docs/support.md): each case trains, exactly where
exactness exists, or is refused at setup with a message that names the part at fault and a remedy."""

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import LearningRateFinder
from pytorch_lightning.tuner import Tuner

from lightning_rudra import RudraStrategy
from lightning_rudra.strategy.checks import check_module, check_optimizers, check_trainer
from tests.lightning_models import (
    START,
    SWA,
    Averaging,
    Compiled,
    ProbedRudra,
    Regression,
    Unusual,
    UnevenStreams,
    WithoutOptimizer,
    flat,
    loader,
    quiet_trainer,
    single_process_sgd,
)
from tests.script_runs import run_script


class NeedsTheModel(torch.optim.SGD):
    """An optimizer whose constructor needs more than the parameter groups."""

    def __init__(self, params, model, lr=0.1):
        super().__init__(params, lr=lr)
        self.model = model


def _on_two_devices() -> torch.nn.Module:
    module = torch.nn.Linear(2, 2)
    module.weight = torch.nn.Parameter(torch.empty(2, 2, device="meta"))
    return module


@pytest.mark.parametrize(
    "module, message",
    [
        (
            lambda: torch.nn.Sequential(torch.nn.LazyLinear(3), torch.nn.Linear(3, 1)),
            r"the parameters 0.weight, 0.bias are not initialized yet .*run a forward pass on an example batch",
        ),
        (_on_two_devices, r"on several devices \(meta: weight; cpu: bias\).*Keep every parameter on one device"),
    ],
)
def test_modules_the_server_cannot_hold_are_refused_at_setup(module, message):
    with pytest.raises(ValueError, match=message):
        check_module(module())


@pytest.mark.parametrize(
    "optimizer, message",
    [
        (lambda m: torch.optim.LBFGS(m.parameters()), r"optimizer 0 \(LBFGS\) needs a closure in every step"),
        (lambda m: torch.optim.SparseAdam(m.parameters()), r"optimizer 0 \(SparseAdam\) needs sparse gradients.*Adam"),
        (
            lambda m: NeedsTheModel(m.parameters(), m),
            r"cannot rebuild optimizer 0 \(NeedsTheModel\) as NeedsTheModel\(param_groups\): .*missing 1 required",
        ),
        (
            lambda m: torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1),
            r"tensors of shapes \[\(2,\)\] that are not",
        ),
    ],
)
def test_optimizers_the_server_cannot_step_are_refused_at_setup(optimizer, message):
    module = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match=message):
        check_optimizers([optimizer(module)], list(module.parameters()))
    check_optimizers(
        [torch.optim.Adam(module.parameters()), torch.optim.Adagrad(module.parameters())], list(module.parameters())
    )  # plain optimizers pass


def test_batch_size_scaling_is_refused_by_lightning_as_for_ddp():
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=RudraStrategy(), logger=False)
    with pytest.raises(ValueError, match="Tuning the batch size is currently not supported with distributed"):
        Tuner(trainer).scale_batch_size(Regression())


def test_the_learning_rate_finder_is_refused():
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=RudraStrategy(), logger=False, callbacks=[LearningRateFinder()]
    )
    with pytest.raises(ValueError, match=r"LearningRateFinder \(what Tuner.lr_find adds\) cannot run .*devices=1"):
        check_trainer(trainer)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_lr_find_is_refused_on_every_learner_before_any_waits():
    trainer = quiet_trainer(RudraStrategy(start_method=START, rpc_timeout=20), 2, max_epochs=1)
    with pytest.raises(Exception, match="LearningRateFinder .* cannot run under RudraStrategy"):
        Tuner(trainer).lr_find(Regression(), train_dataloaders=loader(8))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sparse_gradients_float64_and_parametrized_weights_train_exactly(tmp_path):
    """Hardsync equals SGD with batch μλ for a module with an embedding with sparse gradients (pushed dense), a
    float64 parameter and weight normalization, with the popen launcher (the default): a parametrized module
    cannot be pickled for spawn."""
    out = tmp_path / "weights.pt"
    run_script(tmp_path, "popen_unusual.py", str(out))
    result = torch.load(out)
    torch.testing.assert_close(result["params"], single_process_sgd(2, 16, Unusual()), rtol=0, atol=1e-5)
    assert result["clock"] == 2 * 256 // 16


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_module_compiled_in_configure_model_trains_exactly():
    """Hardsync equals SGD with batch μλ with torch.compile in configure_model."""
    module = Compiled()
    trainer = quiet_trainer(RudraStrategy(protocol="hardsync", start_method=START, rpc_timeout=60), 2, max_epochs=2)
    trainer.fit(module, loader(8))
    torch.testing.assert_close(flat(module.parameters()), single_process_sgd(2, 16), rtol=0, atol=1e-5)
    assert trainer.strategy.stats.clock == 2 * 256 // 16


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", ["none", "empty"])
def test_a_module_without_an_optimizer_trains_without_stepping(how):
    module = WithoutOptimizer(how)
    before = flat(module.parameters())
    trainer = quiet_trainer(RudraStrategy(protocol="async", start_method=START, rpc_timeout=60), 2, max_epochs=1)
    trainer.fit(module, loader(8))
    assert torch.equal(flat(module.parameters()), before)
    stats = trainer.strategy.stats
    assert sum(stats.batches.values()) == 32  # every batch of the shared epoch was trained on
    assert stats.clock == (0 if how == "none" else 32)  # an empty optimizer still steps (on nothing)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("callback", [SWA, Averaging])
def test_weight_averaging_ends_in_the_returned_model(tmp_path, callback):
    """As under DDP, the averaged weights (SWA, or Lightning's WeightAveraging) are what fit returns, not the
    server's last weights."""
    average = tmp_path / "average.pt"
    kwargs = dict(swa_lrs=0.01, swa_epoch_start=1) if callback is SWA else {}
    strategy = ProbedRudra(protocol="hardsync", start_method=START, rpc_timeout=60)
    strategy.probe_path = str(tmp_path / "probe.pt")
    module = Regression()
    trainer = quiet_trainer(strategy, 2, max_epochs=3, callbacks=[callback(str(average), **kwargs)])
    trainer.fit(module, loader(8))
    returned = flat(module.parameters())
    assert torch.equal(returned, torch.load(average))
    server = torch.load(tmp_path / "probe.pt")["params"][0]
    assert (returned - server).abs().max() > 1e-3  # the average is not the server's final weights


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_hardsync_with_streams_of_different_lengths_ends_with_an_error_not_a_hang():
    trainer = quiet_trainer(RudraStrategy(protocol="hardsync", start_method=START, rpc_timeout=60), 2, max_epochs=2)
    with pytest.raises(Exception, match="Under hardsync every learner must train on the same number of batches"):
        trainer.fit(UnevenStreams())
