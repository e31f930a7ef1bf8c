"""One host's part of a run over several hosts (tests/strategy/test_hosts.py), however its processes were launched
(Lightning's launcher, torchrun or SLURM's variables). Learner 0 prints "TRAINING" when training starts and, at
the end, one JSON line with the weights it returns and the server's statistics.

Arguments: num_nodes, devices (learners per host), max_epochs, then optionally the protocol (hardsync), seconds
each training step sleeps (0), rpc_timeout (20), the hidden layer's width (16, the regression module's), the
compression (none), node-local aggregation (auto, on or off), a learner that kills itself (RANK:STEP, none) and
the number of server nodes (0; a server node prints "SERVER NODE DONE" when its fit returns) and "again" (after
fit, validate, then fit one more epoch with a second Trainer; learner 0 prints "AGAIN" with its validation loss and
the second fit's clock), then ``bucket_cap_mb`` (none; learner 0's result then counts the buckets it sent) and
``num_servers`` (none).
"""

import json
import os
import signal
import sys
import time

import torch

from lightning_rudra import RudraStrategy
from tests.lightning_models import Regression, flat, loader, quiet_trainer
from tests.script_runs import print_result


class Wide(Regression):
    """The regression module with ``width`` hidden units: enough weights that they, not control messages, make up
    the traffic between hosts. The rate shrinks with the width (at 0.05, 4096 units diverge)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__(lr=0.05 * min(1.0, 16 / width))
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(6, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))


class Sleepy(Wide):
    def __init__(self, sleep: float, width: int, die: str = "none") -> None:
        super().__init__(width)
        self.sleep = sleep
        self.die = None if die == "none" else tuple(int(x) for x in die.split(":"))

    def on_train_start(self) -> None:
        if self.trainer.is_global_zero:
            print("TRAINING", flush=True)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        learner = self.trainer.strategy._training.learner  # gone once training ends
        bucketing = learner.bucketing
        self.buckets = None if bucketing is None else {"pieces": bucketing.pieces, **bucketing.pushes}

    def training_step(self, batch, batch_idx):
        if self.die is not None and (self.global_rank, self.global_step) == self.die:
            print(f"KILLING learner {self.global_rank}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(self.sleep)
        return super().training_step(batch, batch_idx)


if __name__ == "__main__":
    num_nodes, devices, epochs = (int(arg) for arg in sys.argv[1:4])
    protocol, sleep, timeout, width, compression, aggregation, die, server_nodes, again, buckets, servers = (
        sys.argv[4:]
        + ["hardsync", "0", "20", "16", "none", "auto", "none", "0", "no", "none", "none"][len(sys.argv[4:]) :]
    )[:11]
    node_aggregation = {"auto": None, "on": True, "off": False}[aggregation]

    def strategy():
        return RudraStrategy(
            protocol=protocol,
            rpc_timeout=float(timeout),
            compression=compression,
            node_aggregation=node_aggregation,
            server_nodes=int(server_nodes),
            bucket_cap_mb=None if buckets == "none" else float(buckets),
            num_servers=None if servers == "none" else int(servers),
        )

    trainer = quiet_trainer(strategy(), devices, num_nodes=num_nodes, max_epochs=epochs)
    model = Sleepy(float(sleep), int(width), die)
    trainer.fit(model, loader(8))
    if trainer.node_rank >= num_nodes:
        print(f"SERVER NODE DONE {trainer.state.status.value}", flush=True)
    if trainer.is_global_zero:
        print_result(
            params=flat(model.parameters()).tolist(),
            learners=trainer.world_size,
            stats=trainer.strategy.stats.to_dict(),
            buckets=getattr(model, "buckets", None),
        )
    if again == "again":
        validated = trainer.validate(model, loader(8), verbose=False)
        second = quiet_trainer(strategy(), devices, num_nodes=num_nodes, max_epochs=1)
        second.fit(model, loader(8))
        if second.node_rank >= num_nodes:
            print(f"SERVER NODE DONE {second.state.status.value}", flush=True)
        if second.is_global_zero:
            print(f"AGAIN {json.dumps({'validated': validated, 'clock': second.strategy.stats.clock})}", flush=True)
