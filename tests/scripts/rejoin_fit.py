"""An elastic run under the popen launcher: 2 learners, async, ``min_learners=1``. Learner 1's first process kills
itself (kill -9) at its third batch of epoch 1 (it writes ``<dir>/killed`` first); a process that takes its place
trains on. Each learner appends ``<pid> <epoch> <sample ids>`` per batch to ``<dir>/ids<rank>``. Learner 0 prints
one JSON line: the server's statistics and the pids of the learners it launched.

    python rejoin_fit.py DIR MAX_RESTARTS EPOCHS [WIDTH] [NODES]

``EPOCHS`` 0: train until ``<dir>/stop`` exists. ``WIDTH`` (default 16) changes the module: a process started with
another one is refused when it asks to rejoin. ``NODES`` 2: one learner on each of two nodes, one server (on node 0).
"""

import json
import os
import signal
import sys
import time

import torch

from lightning_rudra import RudraStrategy
from tests.lightning_models import Regression, quiet_trainer, regression_data


class Recorded(Regression):
    def __init__(self, directory: str, width: int) -> None:
        super().__init__(lr=0.01)
        self.directory = directory
        self.net = torch.nn.Sequential(torch.nn.Linear(6, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))

    def training_step(self, batch, batch_idx):
        x, y, ids = batch
        marker = os.path.join(self.directory, "killed")
        if self.global_rank == 1 and self.trainer.current_epoch == 1 and batch_idx == 2 and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        if self.global_rank == 0 and os.path.exists(os.path.join(self.directory, "stop")):
            self.trainer.should_stop = True  # the shared epoch stops every learner at once
        time.sleep(0.05 if self.global_rank == 0 else 0.02)
        with open(os.path.join(self.directory, f"ids{self.global_rank}"), "a") as file:
            file.write(f"{os.getpid()} {self.trainer.current_epoch} {' '.join(map(str, ids.tolist()))}\n")
        return super().training_step((x, y), batch_idx)


if __name__ == "__main__":
    directory, max_restarts, epochs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    width = int(sys.argv[4]) if len(sys.argv) > 4 else 16
    nodes = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    x, y = regression_data().tensors
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y, torch.arange(len(x))), batch_size=8)
    strategy = RudraStrategy(
        protocol="async", rpc_timeout=5, min_learners=1, max_restarts=max_restarts, num_servers=1 if nodes > 1 else None
    )
    trainer = quiet_trainer(strategy, 2 // nodes, num_nodes=nodes, max_epochs=epochs or 10_000)
    trainer.fit(Recorded(directory, width), data)
    if trainer.is_global_zero:
        children = [p.pid for p in getattr(strategy.launcher, "procs", [])]
        print("RESULT " + json.dumps({"stats": strategy.stats.to_dict(), "children": children}))
