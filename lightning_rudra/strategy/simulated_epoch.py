"""A simulated run (``RudraStrategy(simulate=λ)``) inside Lightning's fit loop.

The one train DataLoader is rebuilt around a :class:`~lightning_rudra.learner.simulation.SimulatedSampler`: an epoch is
every virtual learner's pass over its own shard, the batches of all learners in the order of their pushes.
Before each batch the module takes the weights of the learner whose batch it is. What Lightning counts in one
learner's batches is recounted for λ learners:

- ``limit_train_batches=k`` means k batches per learner and epoch (a fraction, that fraction of each shard);
- ``max_steps=k`` means k steps per learner: the run ends after k·λ steps of the one process, and
  ``trainer.global_step`` counts the steps of all learners together;
- ``estimated_stepping_batches`` (read in ``configure_optimizers``) is one learner's steps, and every learner
  has its own LR schedule, as a real one: a step-interval scheduler steps after each of the learner's own
  batches, an epoch-interval one for every learner at the epoch's end.
"""

from typing import Any, Optional

import pytorch_lightning as pl
from pytorch_lightning.trainer.states import RunningStage
from pytorch_lightning.utilities.data import _get_dataloader_init_args_and_kwargs, _reinstantiate_wrapped_cls
from torch.utils.data import DataLoader, DistributedSampler

from lightning_rudra.learner.simulation import LearnerSchedules, SimulatedClient, SimulatedSampler
from lightning_rudra.core.timing import TimingModel


def check_simulation(simulate: Optional[int], timing: Optional[TimingModel], sampling: Optional[str],
                      overlap: bool) -> None:
    """The arguments of RudraStrategy that concern simulated learners (at construction: nothing started)."""
    if simulate is None:
        if timing is not None:
            raise ValueError(f"timing={timing!r} only orders the pushes of simulated learners: set simulate=λ too, "
                             "or leave timing unset (real learners take the time they take).")
        return
    if isinstance(simulate, bool) or not isinstance(simulate, int) or simulate < 1:
        raise ValueError(f"simulate={simulate!r} is not valid: expected the number of learners to simulate, an "
                         "integer >= 1, or None for real learner processes.")
    if timing is not None and not isinstance(timing, TimingModel):
        raise ValueError(f"timing={timing!r} is not a timing model: expected one from lightning_rudra.core.timing, e.g. "
                         "Homogeneous(), Jittered(spread=0.3), Stragglers({0: 3.0}) or Measured(times).")
    if sampling == "shared":
        raise ValueError("sampling='shared' cannot be simulated: simulated learners read the fixed shards of "
                         "sampling='static' (each its own DistributedSampler shard). Leave sampling unset.")
    if overlap:
        raise ValueError("overlap=True cannot be simulated yet: a simulated learner computes on the weights of its "
                         "last reply. Leave overlap unset with simulate.")


def simulated_dataloader(dataloader: Any, num_learners: int, protocol: str, timing: TimingModel,
                         whole: bool) -> DataLoader:
    """``dataloader`` (with the single-replica DistributedSampler Lightning gave it) dealing the batches of λ
    learners, each from the shard that Lightning's DistributedSampler gives a real learner of its rank. Its length
    is every learner's batches if ``whole``, else, until training starts, one learner's: Lightning's counts read
    in ``configure_optimizers`` (``estimated_stepping_batches``) mean one learner's steps, as for real ones."""
    sampler = getattr(dataloader, "sampler", None)
    if not isinstance(dataloader, DataLoader) or type(sampler) is not DistributedSampler or not dataloader.batch_size:
        raise ValueError(
            "RudraStrategy(simulate=...) needs a train DataLoader over a map-style dataset with a batch_size and "
            "Lightning's own sampler, so that every simulated learner reads the shard a real learner of its rank "
            f"would; got {type(dataloader).__name__} with sampler {type(sampler).__name__}. An IterableDataset or a "
            "sampler of your own keeps one stream per process: run real learners (devices=λ) instead.")
    # Lightning's one-replica sampler holds the shuffle and seed (the global seed) that real learners' would
    shards = [DistributedSampler(sampler.dataset, num_replicas=num_learners, rank=r, shuffle=sampler.shuffle,
                                 seed=sampler.seed, drop_last=sampler.drop_last) for r in range(num_learners)]
    batches = SimulatedSampler(shards, dataloader.batch_size, dataloader.drop_last, protocol, timing)
    batches.whole = whole
    args, kwargs = _get_dataloader_init_args_and_kwargs(dataloader, sampler, RunningStage.TRAINING)
    # a batch sampler excludes these (DataLoader's rule)
    kwargs.update(batch_sampler=batches, sampler=None, batch_size=1, shuffle=False, drop_last=False)
    return _reinstantiate_wrapped_cls(dataloader, *args, **kwargs)


def start_simulation(trainer: "pl.Trainer", loaders: list[Any], num_learners: int,
                     client: SimulatedClient) -> "SimulatedEpochLoop":
    """The simulated epoch for this ``fit``, installed; each learner goes on from the batches ``client``'s
    statistics say it took (restored with a checkpoint)."""
    samplers = [dl.batch_sampler for dl in loaders if isinstance(getattr(dl, "batch_sampler", None), SimulatedSampler)]
    if len(loaders) != 1 or len(samplers) != 1:
        raise ValueError(f"RudraStrategy(simulate=...) trains on one train dataloader; got {len(loaders)}. Combine "
                         "them into one dataset, or run real learners (devices=λ).")
    samplers[0].taken = client.stats().batches
    loop = SimulatedEpochLoop(trainer, samplers[0], num_learners)
    loop.install()
    return loop


class SimulatedEpochLoop:
    """Fits Lightning's fit loop to a simulated run for one ``fit``: :meth:`install` at the start of training,
    :meth:`uninstall` at its end."""

    def __init__(self, trainer: "pl.Trainer", sampler: SimulatedSampler, num_learners: int) -> None:
        self.trainer = trainer
        self.sampler = sampler
        self.num_learners = num_learners
        self._max_steps: Optional[int] = None
        self.schedules: Optional[LearnerSchedules] = None

    def install(self) -> None:
        trainer, fit_loop = self.trainer, self.trainer.fit_loop
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"accumulate_grad_batches={trainer.accumulate_grad_batches} cannot be simulated yet: the batches of "
                "one process come from different simulated learners in turn. Use a batch size of "
                "accumulate_grad_batches times as many samples, or real learners (devices=λ).")
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
        max_steps = fit_loop.epoch_loop.max_steps
        if max_steps not in (-1, None):
            self._max_steps = max_steps
            self.sampler.budget = max_steps
            fit_loop.epoch_loop.max_steps = max_steps * self.num_learners
        # Lightning made the first epoch's iterator with its own limit and before the epoch was set: again
        self.sampler.set_epoch(fit_loop.epoch_progress.current.processed)
        iter(fit_loop._data_fetcher)

    def uninstall(self) -> None:
        if self._max_steps is not None:
            self.trainer.fit_loop.epoch_loop.max_steps = self._max_steps
            self._max_steps = None
        self.trainer.fit_loop.epoch_loop.__dict__.pop("update_lr_schedulers", None)

    def next_learner(self) -> int:
        learner = self.sampler.next_learner()
        if self.schedules is not None:
            self.schedules.switch(learner)
        return learner

    def _schedule_per_learner(self) -> None:
        trainer = self.trainer
        configs = trainer.lr_scheduler_configs if trainer.lightning_module.automatic_optimization else []
        if not configs:
            return
        for config in configs:
            if config.interval == "step" and config.frequency != 1:
                raise ValueError(
                    f"an LR scheduler with interval='step' and frequency={config.frequency} cannot be simulated yet: "
                    "Lightning would count the batches of all simulated learners together, not each learner's own. "
                    "Use frequency=1 and a schedule that steps every k steps itself (e.g. StepLR(step_size=k)), or "
                    "real learners (devices=λ).")
        self.schedules = LearnerSchedules(self.num_learners, [c.scheduler for c in configs], trainer.optimizers)
        trainer.fit_loop.epoch_loop.update_lr_schedulers = self._update_lr_schedulers

    def _update_lr_schedulers(self, interval: str, update_plateau_schedulers: bool) -> None:
        """Lightning's, for the learner whose batch just ended (``interval="step"``), or for every learner (at the
        epoch's end)."""
        assert self.schedules is not None
        epoch_loop = self.trainer.fit_loop.epoch_loop
        update = type(epoch_loop).update_lr_schedulers
        for _ in (self.schedules.each() if interval == "epoch" else [None]):
            update(epoch_loop, interval, update_plateau_schedulers)
