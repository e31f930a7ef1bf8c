""":class:`SimulatedEpochLoop`, for λ simulated learners in one process
(:class:`~lightning_rudra.learner.simulation.SimulatedSampler`): an epoch is every virtual learner's pass over its
own part of the data, and what Lightning counts in one learner's batches is recounted for λ learners:

- ``limit_train_batches=k`` means k batches per learner and epoch (a fraction, that fraction of each part);
- ``max_steps=k`` means k steps per learner: the run ends after k·λ steps of the one process, and
  ``trainer.global_step`` counts the steps of all learners together;
- ``estimated_stepping_batches`` (read in ``configure_optimizers``) is one learner's steps, and every learner
  has its own LR schedule, as a real one: a step-interval scheduler steps after each of the learner's own
  batches, an epoch-interval one for every learner at the epoch's end.
"""

from typing import Optional

import pytorch_lightning as pl

from lightning_rudra.core.errors import ConfigurationError
from lightning_rudra.learner.learner import Learner
from lightning_rudra.learner.simulation import LearnerSchedules, SimulatedClient, SimulatedSampler


class SimulatedEpochLoop:
    """Fits Lightning's fit loop to a simulated run for one ``fit``: :meth:`install` at the start of training,
    :meth:`uninstall` at its end. ``client``: the learner's, which serves every simulated learner."""

    def __init__(
        self, trainer: "pl.Trainer", sampler: SimulatedSampler, num_learners: int, client: SimulatedClient
    ) -> None:
        self.trainer = trainer
        self.sampler = sampler
        self.num_learners = num_learners
        self.client = client
        self._max_steps: Optional[int] = None
        self.schedules: Optional[LearnerSchedules] = None

    def install(self) -> None:
        trainer, fit_loop = self.trainer, self.trainer.fit_loop
        if trainer.accumulate_grad_batches != 1:
            raise ConfigurationError(
                f"accumulate_grad_batches={trainer.accumulate_grad_batches} cannot be simulated yet: the batches of "
                "one process come from different simulated learners in turn. Use a batch size of "
                "accumulate_grad_batches times as many samples, or real learners (devices=λ)."
            )
        one = self.sampler.batches_per_learner()
        limit = trainer.limit_train_batches
        self.sampler.max_batches = min(one, limit) if isinstance(limit, int) else int(one * limit)
        combined = fit_loop._combined_loader
        assert combined is not None
        combined.limits = None  # the sampler holds the limit, per learner
        self.sampler.whole = True
        fit_loop.max_batches = len(self.sampler)
        if isinstance(trainer.val_check_interval, float):  # Lightning's rule, over the batches of all learners
            trainer.val_check_batch = max(1, int(fit_loop.max_batches * trainer.val_check_interval))
        self._schedule_per_learner()
        if self.client.server is not None and self.client.server.config.discards_late:
            self.sampler.rounds = self.client
            self.sampler.on_steps = self._steps_in_epoch
        max_steps = fit_loop.epoch_loop.max_steps
        if max_steps not in (-1, None):
            self._max_steps = max_steps
            self.sampler.budget = max_steps
            fit_loop.epoch_loop.max_steps = max_steps * self.num_learners
        # Lightning made the first epoch's iterator with its own limit and before the epoch was set: again
        self.sampler.set_epoch(fit_loop.epoch_progress.current.processed)  # type: ignore[attr-defined]
        assert fit_loop._data_fetcher is not None  # made with the combined loader, before on_train_start
        iter(fit_loop._data_fetcher)

    def uninstall(self) -> None:
        if self._max_steps is not None:
            self.trainer.fit_loop.epoch_loop.max_steps = self._max_steps
            self._max_steps = None
        self.trainer.fit_loop.epoch_loop.__dict__.pop("update_lr_schedulers", None)

    in_batch = False  # one process: collectives never wait for other learners

    def on_train_epoch_end(self) -> None:
        """Its schedules are Lightning's own, per learner; under backup learners every learner is out of batches
        now, so the round open waits for nobody (the real learners meet at the epoch's end)."""
        if self.sampler.rounds is not None:
            self.client.end_epoch()

    def _steps_in_epoch(self, steps: int) -> None:
        """batchsync, backup: late gradients' batches are trained again within the epoch."""
        self.trainer.fit_loop.max_batches = steps

    def on_batch_fetched(self, learner: Learner) -> None:
        """The batch of the next simulated learner: the module takes that learner's weights and LR schedule."""
        index = self.sampler.next_learner()
        if self.schedules is not None:
            self.schedules.switch(index)
        weights = self.client.switch(index)
        if weights is not None:
            learner.load(*weights)

    def _schedule_per_learner(self) -> None:
        trainer = self.trainer
        configs = trainer.lr_scheduler_configs if trainer.lightning_module.automatic_optimization else []
        if not configs:
            return
        for config in configs:
            if config.interval == "step" and config.frequency != 1:
                raise ConfigurationError(
                    f"an LR scheduler with interval='step' and frequency={config.frequency} cannot be simulated yet: "
                    "Lightning would count the batches of all simulated learners together, not each learner's own. "
                    "Use frequency=1 and a schedule that steps every k steps itself (e.g. StepLR(step_size=k)), or "
                    "real learners (devices=λ)."
                )
        self.schedules = LearnerSchedules(self.num_learners, [c.scheduler for c in configs], trainer.optimizers)
        trainer.fit_loop.epoch_loop.update_lr_schedulers = self._update_lr_schedulers  # type: ignore[method-assign]

    def _update_lr_schedulers(self, interval: str, update_plateau_schedulers: bool) -> None:
        """Lightning's, for the learner whose batch just ended (``interval="step"``), or for every learner (at the
        epoch's end)."""
        assert self.schedules is not None
        epoch_loop = self.trainer.fit_loop.epoch_loop
        update = type(epoch_loop).update_lr_schedulers
        for _ in self.schedules.each() if interval == "epoch" else [None]:
            update(epoch_loop, interval, update_plateau_schedulers)
