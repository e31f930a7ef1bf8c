"""Train with the popen launcher (Lightning re-runs this script for every learner), then test.

Learner 0 prints one JSON line: the strategy's stats, the test loss and a checksum of the final weights.
"""

import json
import sys

import torch

from lightning_rudra import RudraStrategy
from tests.lightning_models import Regression, flat, loader, quiet_trainer

if __name__ == "__main__":
    protocol, learners = sys.argv[1], int(sys.argv[2])
    model = Regression(lr=0.02, momentum=0.5)
    trainer = quiet_trainer(RudraStrategy(protocol=protocol, rpc_timeout=60), learners, max_epochs=2)
    trainer.fit(model, loader(8))
    stats = trainer.strategy.stats
    [result] = trainer.test(model, loader(64, seed=1), verbose=False)
    if trainer.is_global_zero:
        print("RESULT " + json.dumps({"stats": stats.to_dict(), "test_loss": result["test_loss"],
                                      "weights": flat(model.parameters()).sum().item(),
                                      "finite": bool(torch.isfinite(flat(model.parameters())).all())}))
