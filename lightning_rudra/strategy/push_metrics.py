"""What a learner's pushes came back with, logged as metrics: mean and largest staleness, the server's clock and
the learning rate the server applied."""

from typing import Any


class PushMetrics:
    """Mixed into :class:`~lightning_rudra.RudraStrategy`: its ``_learner`` reports every push here."""

    def _reset_push_metrics(self) -> None:
        self._accepted = self._staleness_sum = self._staleness_max = 0  # this learner's accepted pushes
        self._lr_scales: dict[int, float] = {}  # optimizer -> the rate its newest update applied, as a fraction

    def _record_push(self, optimizer: int, status: str, staleness: int, lr_scale: float) -> None:
        if status in ("accepted", "queued"):  # queued (several optimizers): σ when it reached the server
            self._accepted += 1
            self._staleness_sum += staleness
            self._staleness_max = max(self._staleness_max, staleness)
        self._lr_scales[optimizer] = lr_scale

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().training_step(*args, **kwargs)
        # Under automatic optimization the push follows training_step, so these describe the previous steps.
        # Logged only where Lightning writes logs (and at an epoch's end): logging costs more than a small step.
        trainer = self.lightning_module.trainer
        if self._accepted and (trainer._logger_connector.should_update_logs
                               or trainer.fit_loop.epoch_loop.batch_progress.is_last_batch):
            module = self.lightning_module
            module.log("staleness_mean", self._staleness_sum / self._accepted, prog_bar=True, on_step=True)
            module.log("staleness_max", float(self._staleness_max), prog_bar=True, on_step=True)
            module.log("server_clock", float(self._learner.client.timestamp), prog_bar=True, on_step=True)
            # the rate the server applied (LearningRateMonitor shows the learners' rate, before modulation)
            for index, scale in self._lr_scales.items():
                name = "lr_applied" if len(self.optimizers) == 1 else f"lr_applied_{index}"
                module.log(name, self.optimizers[index].param_groups[0]["lr"] * scale, on_step=True)
        return output
