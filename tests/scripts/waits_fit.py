"""Learner 1 is slow to set up (``seconds``) under the popen launcher: learner 0 and the server wait for it at the
setup barrier. Run with ``RUDRA_LOG_WAITS`` set, the waits are logged; learner 0 prints the server's statistics."""

import sys
import time

from lightning_rudra import RudraStrategy
from tests.lightning_models import Regression, loader, quiet_trainer
from tests.script_runs import print_result


class SlowSetup(Regression):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def setup(self, stage: str) -> None:
        if self.global_rank == 1:
            time.sleep(self.seconds)


if __name__ == "__main__":
    trainer = quiet_trainer(RudraStrategy(protocol="async", rpc_timeout=30), 2, max_epochs=1)
    trainer.fit(SlowSetup(float(sys.argv[1])), loader(8))
    if trainer.is_global_zero:
        print_result(stats=trainer.strategy.stats.to_dict())
