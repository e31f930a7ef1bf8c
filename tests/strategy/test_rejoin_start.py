"""Where a process admitted into an elastic run starts, in Lightning (in-process, no RPC): the run's epoch, global
step and elapsed time, which ``max_time`` counts. (Real processes: test_rejoin.py.)"""

import pytorch_lightning as pl
from pytorch_lightning.callbacks import Timer

from lightning_rudra.server.rejoins import Admission
from lightning_rudra.strategy.rejoin import RejoinRequest
from tests.lightning_models import Regression


def test_an_admitted_process_takes_the_runs_epoch_step_and_time():
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_time={"seconds": 100}, logger=False, enable_progress_bar=False
    )
    trainer.strategy.connect(Regression())
    rejoin = RejoinRequest()
    rejoin.admission = Admission(epoch=2, global_step=30, collectives=4, elapsed=42.5)
    rejoin.start(trainer, shared_epoch=True)
    [timer] = [cb for cb in trainer.callbacks if isinstance(cb, Timer)]
    assert timer.time_elapsed() == 42.5  # so max_time ends this process with the others, not 100 s after it came
    assert trainer.current_epoch == 2 and trainer.global_step == 30
