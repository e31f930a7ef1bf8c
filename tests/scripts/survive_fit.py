"""Learner 1 fails at its third batch (``exit`` or ``stop``: SIGSTOP) under the popen launcher with
min_learners=1; learner 0 trains on. Learner 0 prints one JSON line: the final weights, the server's statistics
and the pids of the learners it launched.
"""

import sys

from lightning_rudra import RudraStrategy
from tests.lightning_models import FailingLearner, flat, loader, quiet_trainer
from tests.script_runs import print_result

if __name__ == "__main__":
    how, epochs = sys.argv[1], int(sys.argv[2])
    model = FailingLearner(how)
    strategy = RudraStrategy(protocol="hardsync", rpc_timeout=5, min_learners=1)
    trainer = quiet_trainer(strategy, 2, max_epochs=epochs)
    trainer.fit(model, loader(8))
    if trainer.is_global_zero:
        print_result(
            weights=flat(model.parameters()).tolist(),
            stats=strategy.stats.to_dict(),
            children=[p.pid for p in getattr(strategy.launcher, "procs", [])],
        )
