"""One host's part of the chaos soak (tests/strategy/test_soak_chaos.py): async, two hosts with two learners each,
one server (on host 0), ``min_learners=2`` and restarts without limit in practice, trained for ``MINUTES``.

Each learner process appends ``<epoch> <sample ids>`` per batch to ``<dir>/ids<rank>-<pid>`` and keeps
``<pushes> <accepted>`` in ``<dir>/counts<rank>-<pid>`` (the elastic soak's module); it kills itself (kill -9) at its next batch once
``<dir>/kill<rank>`` exists (the test's way into another pid namespace), removing the file first. The learners log
their streams' opening (DEBUG), which names the port the test resets. Learner 0 prints one ``RESULT`` line: the
server's statistics and the model's test accuracy.

    python chaos_fit.py DIR MINUTES
"""

import logging
import os
import signal
import sys

import torch

from lightning_rudra import RudraStrategy
from tests.lightning_models import quiet_trainer
from tests.script_runs import print_result
from tests.strategy.test_soak_rejoin import Soaked, accuracy, blobs

SAMPLES = 2048


class Chaotic(Soaked):
    """The elastic soak's module, that kills itself when the test asks and says when training starts."""

    def on_train_start(self) -> None:
        super().on_train_start()
        if self.trainer.is_global_zero:
            print("TRAINING", flush=True)

    def training_step(self, batch, batch_idx):
        kill = os.path.join(self.directory, f"kill{self.global_rank}")
        if os.path.exists(kill):
            os.remove(kill)
            os.kill(os.getpid(), signal.SIGKILL)
        return super().training_step(batch, batch_idx)


if __name__ == "__main__":
    directory, minutes = sys.argv[1], float(sys.argv[2])
    logging.basicConfig(stream=sys.stderr, format="%(name)s: %(message)s")
    logging.getLogger("lightning_rudra.transport.stream_client").setLevel(logging.DEBUG)
    # a cut of up to 30 s must not count a learner or the server lost: silence is allowed for longer than that
    strategy = RudraStrategy(protocol="async", rpc_timeout=45, min_learners=2, max_restarts=1000, num_servers=1)
    data = torch.utils.data.DataLoader(blobs(SAMPLES, seed=0), batch_size=16, shuffle=True)
    trainer = quiet_trainer(strategy, 2, num_nodes=2, max_time={"seconds": minutes * 60}, max_epochs=-1)
    model = Chaotic(directory)
    trainer.fit(model, data)
    if trainer.is_global_zero:
        print_result(stats=strategy.stats.to_dict(), accuracy=accuracy(model))
