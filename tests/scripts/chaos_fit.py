"""One host's part of the chaos soak (tests/strategy/test_soak_chaos.py): async, two hosts with two learners each,
one server (on host 0), ``min_learners=2`` and restarts without limit in practice, trained for ``MINUTES``.

Each learner process appends ``<epoch> <sample ids>`` per batch to ``<dir>/ids<rank>-<pid>`` and keeps
``<pushes> <accepted>`` in ``<dir>/counts<rank>-<pid>``; it kills itself (kill -9) at its next batch once
``<dir>/kill<rank>`` exists (the test's way into another pid namespace), removing the file first. The learners log
their streams' opening (DEBUG), which names the port the test resets. Learner 0 prints one ``RESULT`` line: the
server's statistics and the model's test accuracy.

    python chaos_fit.py DIR MINUTES
"""

import logging
import os
import random
import signal
import sys
import time

import pytorch_lightning as pl
import torch

from lightning_rudra import RudraStrategy
from tests.lightning_models import quiet_trainer
from tests.script_runs import print_result

CLASSES, FEATURES, SAMPLES = 10, 20, 2048


def blobs(num_samples: int, seed: int) -> torch.utils.data.TensorDataset:
    """Ten overlapping Gaussian classes: about 90 % is what an MLP can reach, so a worse run shows."""
    centers = torch.randn(CLASSES, FEATURES, generator=torch.Generator().manual_seed(0)) * 1.2
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, CLASSES, (num_samples,), generator=g)
    x = centers[y] + torch.randn(num_samples, FEATURES, generator=g)
    return torch.utils.data.TensorDataset(x, y, torch.arange(num_samples))


def accuracy(net: torch.nn.Module) -> float:
    x, y, _ = blobs(4000, seed=1).tensors
    with torch.no_grad():
        return (net(x).argmax(1) == y).float().mean().item()


class Chaotic(pl.LightningModule):
    def __init__(self, directory: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(FEATURES, 64), torch.nn.ReLU(), torch.nn.Linear(64, CLASSES))
        self.directory = directory
        self.steps = 0

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, f"{name}{self.global_rank}-{os.getpid()}")

    def on_train_start(self) -> None:
        self.random = random.Random(self.global_rank * 1000 + os.getpid())
        self.ids = open(self._path("ids"), "a")
        if self.trainer.is_global_zero:
            print("TRAINING", flush=True)

    def training_step(self, batch, batch_idx):
        kill = os.path.join(self.directory, f"kill{self.global_rank}")
        if os.path.exists(kill):
            os.remove(kill)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(self.random.uniform(0.0, 0.02))
        x, y, _ = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.steps += 1  # the push is answered: under async the step waits for its reply
        self.ids.write(f"{self.trainer.current_epoch} {' '.join(map(str, batch[2].tolist()))}\n")
        self.ids.flush()
        path = self._path("counts")
        with open(path + ".partial", "w") as file:
            file.write(f"{self.steps} {self.trainer.strategy._push_metrics.accepted}")
        os.replace(path + ".partial", path)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


if __name__ == "__main__":
    directory, minutes = sys.argv[1], float(sys.argv[2])
    logging.basicConfig(stream=sys.stderr, format="%(name)s: %(message)s")
    logging.getLogger("lightning_rudra.transport.stream").setLevel(logging.DEBUG)
    # a cut of up to 30 s must not count a learner or the server lost: silence is allowed for longer than that
    strategy = RudraStrategy(protocol="async", rpc_timeout=45, min_learners=2, max_restarts=1000, num_servers=1)
    data = torch.utils.data.DataLoader(blobs(SAMPLES, seed=0), batch_size=16, shuffle=True)
    trainer = quiet_trainer(strategy, 2, num_nodes=2, max_time={"seconds": minutes * 60}, max_epochs=-1)
    model = Chaotic(directory)
    trainer.fit(model, data)
    if trainer.is_global_zero:
        print_result(stats=strategy.stats.to_dict(), accuracy=accuracy(model.net))
