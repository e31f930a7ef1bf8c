"""The unified ``lightning`` package: ``lightning.pytorch``'s Trainer and LightningCLI with
``lightning_rudra.lightning``, beside ``pytorch_lightning`` with ``lightning_rudra`` in the same process."""

import functools
import sys

import lightning as L
import pytest
import pytorch_lightning as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.strategies import ParallelStrategy

import lightning_rudra
import lightning_rudra.lightning as unified
from tests.lightning_models import START, RegressionSteps, flat, loader, quiet_trainer, single_process_sgd


class UnifiedRegression(RegressionSteps, L.LightningModule):
    def train_dataloader(self):
        return loader(8)


unified_trainer = functools.partial(quiet_trainer, trainer_class=L.Trainer)


@pytest.mark.parametrize(
    "name, protocol", [("rudra", "async"), ("rudra_hardsync", "hardsync"), ("rudra_async", "async")]
)
def test_each_flavour_has_its_strategy_under_the_registered_names(name, protocol):
    strategy = unified_trainer(name, 2).strategy
    assert type(strategy) is unified.RudraStrategy and isinstance(strategy, ParallelStrategy)
    assert strategy.protocol == protocol and strategy.num_learners == 2
    standalone = pl.Trainer(accelerator="cpu", devices=2, strategy=name, logger=False).strategy
    assert type(standalone) is lightning_rudra.RudraStrategy and not isinstance(standalone, ParallelStrategy)


def test_the_other_flavours_trainer_says_which_class_to_use():
    with pytest.raises(ValueError, match="with `lightning.pytorch.Trainer`, use `lightning_rudra.lightning.Rudra"):
        unified_trainer(lightning_rudra.RudraStrategy(), 2)
    with pytest.raises(ValueError, match="with `pytorch_lightning.Trainer`, use `lightning_rudra.RudraStrategy`"):
        pl.Trainer(accelerator="cpu", devices=2, strategy=unified.RudraStrategy())


def test_one_implementation_the_lightning_free_layers_shared():
    strategy_module = sys.modules[unified.RudraStrategy.__module__]
    assert strategy_module.__name__ == "lightning_rudra.lightning.strategy.rudra"
    assert strategy_module.__file__ == sys.modules["lightning_rudra.strategy.rudra"].__file__  # the same source file
    assert strategy_module.LearnerOptimizer is lightning_rudra.strategy.rudra.LearnerOptimizer  # layers 1, 2: shared
    assert unified.Stats is lightning_rudra.Stats
    assert not [c for c in unified.RudraStrategy.__mro__ if c.__module__.startswith("pytorch_lightning")]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_hardsync_through_the_unified_trainer_equals_sgd_and_checkpoints_the_server(tmp_path):
    model = UnifiedRegression()
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    trainer = unified_trainer(
        unified.RudraStrategy(protocol="hardsync", start_method=START, rpc_timeout=60),
        2,
        max_epochs=2,
        callbacks=[checkpoint],
        enable_checkpointing=True,
    )
    trainer.fit(model)
    torch.testing.assert_close(flat(model.parameters()), single_process_sgd(2, 16), rtol=0, atol=1e-5)
    assert trainer.strategy.stats.clock == 2 * 256 // 16 and trainer.strategy.stats.staleness == {0: 2 * 256 // 8}
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert saved["rudra"]["stats"]["clock"] == 32
    assert saved["optimizer_states"][0]["state"], "the server's momentum buffers are in the checkpoint"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_unified_lightning_cli_trains_from_yaml(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(f"""
trainer:
  accelerator: cpu
  devices: 2
  max_epochs: 1
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  default_root_dir: {tmp_path}
  strategy:
    class_path: lightning_rudra.lightning.RudraStrategy
    init_args:
      protocol: async
      start_method: {START}
      rpc_timeout: 60
model:
  lr: 0.02
  momentum: 0.0
""")
    cli = LightningCLI(UnifiedRegression, args=["fit", "--config", str(config)], save_config_kwargs={"overwrite": True})
    stats = cli.trainer.strategy.stats
    assert type(cli.trainer.strategy) is unified.RudraStrategy and cli.trainer.strategy.protocol == "async"
    assert stats.gradients == 256 // 8 == sum(stats.batches.values()) and len(stats.batches) == 2
