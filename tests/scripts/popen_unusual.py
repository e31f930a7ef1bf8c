"""Hardsync with the popen launcher (a parametrized module cannot be pickled for spawn): train the module with
sparse gradients, a float64 parameter and weight normalization, and save learner 0's final weights to argv[1]."""

import sys

import torch

from lightning_rudra import RudraStrategy
from tests.lightning_models import Unusual, flat, loader, quiet_trainer

if __name__ == "__main__":
    model = Unusual()
    trainer = quiet_trainer(RudraStrategy(protocol="hardsync", rpc_timeout=60), 2, max_epochs=2)
    trainer.fit(model, loader(8))
    if trainer.is_global_zero:
        torch.save({"params": flat(model.parameters()), "clock": trainer.strategy.stats.clock}, sys.argv[1])
