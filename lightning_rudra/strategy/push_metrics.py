"""What a learner's pushes came back with, logged as metrics: mean and largest staleness, the server's clock and
the learning rate the server applied."""

from typing import Any

import pytorch_lightning as pl


class PushMetrics:
    """One learner's pushes as the server answered them (its ``Learner`` reports each one to :meth:`record`),
    logged by :meth:`log` after each training step."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.accepted = self.staleness_sum = self.staleness_max = 0  # this learner's accepted pushes
        self.lr_scales: dict[int, float] = {}  # optimizer -> the rate its newest update applied, as a fraction

    def record(self, optimizer: int, status: str, staleness: int, lr_scale: float) -> None:
        if status in ("accepted", "queued"):  # queued (several optimizers): σ when it reached the server
            self.accepted += 1
            self.staleness_sum += staleness
            self.staleness_max = max(self.staleness_max, staleness)
        self.lr_scales[optimizer] = lr_scale

    def log(self, module: "pl.LightningModule", clock: int, optimizers: list[Any]) -> None:
        """Under automatic optimization the push follows training_step, so these describe the previous steps.
        Logged only where Lightning writes logs (and at an epoch's end): logging costs more than a small step."""
        trainer = module.trainer
        if not self.accepted or not (
            trainer._logger_connector.should_update_logs or trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        ):
            return
        module.log("staleness_mean", self.staleness_sum / self.accepted, prog_bar=True, on_step=True)
        module.log("staleness_max", float(self.staleness_max), prog_bar=True, on_step=True)
        module.log("server_clock", float(clock), prog_bar=True, on_step=True)
        # the rate the server applied (LearningRateMonitor shows the learners' rate, before modulation and compensation)
        for index, scale in self.lr_scales.items():
            name = "lr_applied" if len(optimizers) == 1 else f"lr_applied_{index}"
            module.log(name, optimizers[index].param_groups[0]["lr"] * scale, on_step=True)
