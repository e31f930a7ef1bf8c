"""One host's part of a run over several hosts (tests/test_hosts.py): hardsync on the regression module, however
the processes were launched (Lightning's launcher, torchrun or SLURM's variables). Learner 0 prints one JSON line
with the weights it returns and the server's statistics.

Arguments: num_nodes, devices (learners per host), max_epochs.
"""

import json
import sys

from lightning_rudra import RudraStrategy
from tests.lightning_models import Regression, flat, loader, quiet_trainer

if __name__ == "__main__":
    num_nodes, devices, epochs = (int(arg) for arg in sys.argv[1:4])
    trainer = quiet_trainer(RudraStrategy(protocol="hardsync", rpc_timeout=20), devices, num_nodes=num_nodes,
                            max_epochs=epochs)
    model = Regression()
    trainer.fit(model, loader(8))
    if trainer.is_global_zero:
        print("RESULT " + json.dumps({"params": flat(model.parameters()).tolist(), "learners": trainer.world_size,
                                      "stats": trainer.strategy.stats.to_dict()}), flush=True)
