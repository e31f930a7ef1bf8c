"""One host's part of a run over several hosts (tests/test_hosts.py), however its processes were launched
(Lightning's launcher, torchrun or SLURM's variables). Learner 0 prints "TRAINING" when training starts and, at
the end, one JSON line with the weights it returns and the server's statistics.

Arguments: num_nodes, devices (learners per host), max_epochs, then optionally the protocol (hardsync), seconds
each training step sleeps (0) and rpc_timeout (20).
"""

import json
import sys
import time

from lightning_rudra import RudraStrategy
from tests.lightning_models import Regression, flat, loader, quiet_trainer


class Sleepy(Regression):
    def __init__(self, sleep: float) -> None:
        super().__init__()
        self.sleep = sleep

    def on_train_start(self) -> None:
        if self.trainer.is_global_zero:
            print("TRAINING", flush=True)

    def training_step(self, batch, batch_idx):
        time.sleep(self.sleep)
        return super().training_step(batch, batch_idx)


if __name__ == "__main__":
    num_nodes, devices, epochs = (int(arg) for arg in sys.argv[1:4])
    protocol, sleep, timeout = (sys.argv[4:] + ["hardsync", "0", "20"][len(sys.argv[4:]):])[:3]
    trainer = quiet_trainer(RudraStrategy(protocol=protocol, rpc_timeout=float(timeout)), devices,
                            num_nodes=num_nodes, max_epochs=epochs)
    model = Sleepy(float(sleep))
    trainer.fit(model, loader(8))
    if trainer.is_global_zero:
        print("RESULT " + json.dumps({"params": flat(model.parameters()).tolist(), "learners": trainer.world_size,
                                      "stats": trainer.strategy.stats.to_dict()}), flush=True)
