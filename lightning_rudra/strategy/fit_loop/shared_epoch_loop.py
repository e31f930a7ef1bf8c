""":class:`SharedEpochLoop`, for real learners drawing from the shared epoch
(:class:`~lightning_rudra.learner.sampler.SharedEpochSampler`): whatever Lightning counts in a learner's own
batches is recounted in the epoch's batches, all learners together, because learners now take different numbers:

- the epoch ends when its pool is drained (Lightning never stops a learner at a batch count);
- ``limit_train_batches=k`` means k·λ batches per epoch (what λ learners take under DDP), a fraction the same
  fraction of the pool;
- ``max_steps`` means the run ends once the learners together have drawn max_steps·λ windows of batches;
- ``estimated_stepping_batches`` (read in ``configure_optimizers``) is one learner's steps, as under DDP, and
  step-interval LR schedulers follow the epoch's progress, not the learner's own steps: the batch at place p of
  the epoch is trained at the rate DDP's learners train their batch p // λ at (a fast learner takes more
  batches, and would otherwise run its schedule ahead of the others, past its end);
- validation (``val_check_interval``) runs at the same places in the epoch for every learner, so that its
  collectives meet: every ``val_check_interval`` fraction of the pool (or every k·λ batches for an int k),
  and every learner meets the others at a barrier first.
"""

import dataclasses
import math
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.optim.lr_scheduler import LRScheduler

from lightning_rudra.core.errors import ConfigurationError
from lightning_rudra.learner.learner import Learner
from lightning_rudra.learner.sampler import SharedEpochSampler


class SharedEpochLoop:
    """Fits Lightning's fit loop to the shared epoch for one ``fit``: :meth:`install` at the start of training,
    :meth:`uninstall` at its end. ``samplers`` are the shared samplers of the train dataloaders, in order."""

    def __init__(self, trainer: "pl.Trainer", samplers: list[SharedEpochSampler], num_learners: int) -> None:
        self.trainer = trainer
        self.samplers = samplers
        self.num_learners = num_learners
        self.position = -1  # place in the epoch of the batch being trained on (first dataloader)
        self.in_batch = False  # from a batch's start to its end, where no two learners are at the same step
        self._points_done = 0  # validation points passed (in this epoch, or in the run if counted across epochs)
        self._points_epoch = -1
        self._max_steps = trainer.fit_loop.max_steps
        self._stopping = False  # this learner told the server that it stops
        self._spent = False  # the run's budget is spent: stop after the last batch this learner drew
        self._learner_batches = 0  # one DDP learner's batches per epoch
        self._scheduled: list[Any] = []  # the step-interval LR schedulers' configs (automatic optimization)
        self._scheduler_steps: list[int] = []  # per config: times its scheduler has stepped in this run
        self._fetched = 0  # batches fetched in this fit (first dataloader)
        self._fetched_in_epoch = (-1, 0)  # (epoch, batches fetched in it)
        self._window: list[int] = []  # the places (as _fetched counts them) of the accumulation window's batches

    def install(self, trained: int) -> None:
        """``trained``: batches trained on before the checkpoint this run resumes from (0: none)."""
        self._refuse_per_learner_counts()
        self._limit_pools(trained)
        self._count_scheduler_steps()
        if trained:
            self._resume_points()
        self._refit_loop()

    def _limit_pools(self, trained: int) -> None:
        """Each pool's batches this epoch, with Lightning's limits and ``max_steps`` counted for the whole pool."""
        trainer, fit_loop = self.trainer, self.trainer.fit_loop
        combined = fit_loop._combined_loader
        assert combined is not None
        limits = []
        for sampler in self.samplers:
            pool = sampler.plan.num_batches  # the whole epoch (len() is one learner's share)
            limit = trainer.limit_train_batches
            # Lightning applied the limit to one learner's count; the pool holds λ learners' worth
            cap = min(pool, limit * self.num_learners) if isinstance(limit, int) else int(pool * limit)
            budget = None
            if self._max_steps not in (-1, None):
                budget = max(0, self._max_steps * trainer.accumulate_grad_batches * self.num_learners - trained)
            sampler.plan = dataclasses.replace(sampler.plan, max_batches=cap, budget=budget, resumed=trained)
            sampler.on_spent = self._stop
            sampler.on_again = self._one_more_batch
            sampler.sized = False  # Lightning's fetcher must look one batch ahead to know the epoch's last
            if self._interval(cap) < cap or trainer.check_val_every_n_epoch is None:
                sampler.want = 1  # validation inside the epoch: hold few batches, so all learners reach each point
            limits.append(cap)
        combined.limits = None  # the server's pools hold the limits
        fit_loop.max_batches = max(limits)
        self._learner_batches = -(-limits[0] // self.num_learners)

    def _count_scheduler_steps(self) -> None:
        """The step-interval schedulers this loop steps, and how many steps each has taken."""
        trainer = self.trainer
        if trainer.lightning_module.automatic_optimization:
            self._scheduled = [
                c for c in trainer.lr_scheduler_configs if c.interval == "step" and not c.reduce_on_plateau
            ]
        # a resumed run's schedulers were stepped before the checkpoint: an LRScheduler counts its steps
        self._scheduler_steps = [
            c.scheduler.last_epoch
            if isinstance(c.scheduler, LRScheduler)
            else self._ddp_steps(c, trainer.current_epoch, 0)
            for c in self._scheduled
        ]

    def _resume_points(self) -> None:
        """A resumed run: the validation points before the place the epoch goes on from were passed before."""
        trainer, fit_loop = self.trainer, self.trainer.fit_loop
        plan, epoch = self.samplers[0].plan, trainer.current_epoch
        offset = epoch * plan.num_batches if trainer.check_val_every_n_epoch is None else 0
        self._points_epoch = epoch
        self._points_done = (offset + plan.resumed_at(epoch)) // self._interval(plan.num_batches)
        # learner 0's batch counter, restored in every learner, would end each one's epoch early (after as many
        # batches as learner 0 had left, or at once if it was its last): the pool ends the epoch
        fit_loop.epoch_loop.batch_progress.current.reset()
        fit_loop.epoch_loop.batch_progress.is_last_batch = False

    def _refit_loop(self) -> None:
        """Lightning's epoch loop, for this fit: the pool's schedule, its end and its validation points."""
        trainer, fit_loop = self.trainer, self.trainer.fit_loop
        # instance attributes over Lightning's methods, for this fit (uninstall pops them)
        fit_loop.epoch_loop.update_lr_schedulers = self._update_lr_schedulers  # type: ignore[method-assign]
        # Lightning made the first epoch's iterator while the samplers had a length, so it would not look ahead
        # for the last batch: make it again, for the epoch about to start, unless Lightning makes it again itself
        # (a learner that rejoins in a later epoch): one made here would draw batches that nobody trains
        for sampler in self.samplers:
            # a _ProcessedTracker, which Lightning declares as its base class
            sampler.set_epoch(fit_loop.epoch_progress.current.processed)  # type: ignore[attr-defined]
        epoch_loop = fit_loop.epoch_loop
        if not (trainer.current_epoch > 0 and not fit_loop.is_resuming and not epoch_loop.restarting):
            assert fit_loop._data_fetcher is not None  # made with the combined loader, before on_train_start
            iter(fit_loop._data_fetcher)
        fit_loop.epoch_loop.max_steps = -1  # the budget ends the run, not each learner's own step count
        fit_loop.epoch_loop._should_check_val_fx = self._should_check_val  # type: ignore[method-assign]

    def uninstall(self) -> None:
        for sampler in self.samplers:
            sampler.sized = True
        self.trainer.fit_loop.epoch_loop.max_steps = self._max_steps
        self.trainer.fit_loop.epoch_loop.__dict__.pop("_should_check_val_fx", None)
        self.trainer.fit_loop.epoch_loop.__dict__.pop("update_lr_schedulers", None)

    def on_batch_fetched(self, learner: Learner) -> None:
        """A training batch came from the DataLoader: the learner is in a batch of its own from here on, before
        any ``on_train_batch_start`` hook (whose collectives must stay local), and also for a None batch (which
        gets no such hook, but took a place in the epoch)."""
        self._count_trained()
        self.position = self.samplers[0].next_position()
        self.in_batch = True
        if self._spent and not self.samplers[0].positions:
            self.trainer.should_stop = True
        self._catch_up_schedulers(self.position // self.num_learners)

    def _count_trained(self) -> None:
        """Before a batch starts: every batch fetched before an accumulation window's first one has been trained on
        (Lightning pushes at a window's end, and an epoch's last batch ends one), which the next draw tells the
        server, so that the batches a learner holds are dealt again if it is lost."""
        trainer = self.trainer
        epoch, in_epoch = self._fetched_in_epoch
        if epoch != trainer.current_epoch:
            epoch, in_epoch = trainer.current_epoch, 0
        window = trainer.accumulate_grad_batches if trainer.lightning_module.automatic_optimization else 1
        if in_epoch % window == 0:
            self.samplers[0].trained = self._fetched
            self._window = []
        self._window.append(self._fetched)
        self._fetched += 1
        self._fetched_in_epoch = (epoch, in_epoch + 1)

    def on_late(self) -> None:
        """The push of this window's gradient came after its round closed (batchsync, backup) and was not applied:
        its batches are dealt again (told with the next draw)."""
        self.samplers[0].late += self._window
        self._window = []

    def on_train_epoch_end(self) -> None:
        """Before any other ``on_train_epoch_end``: the step schedulers reach the epoch's end. Still in a batch
        here: the module's ``on_train_batch_start`` returned -1, which ends the epoch without asking about
        validation."""
        if self.in_batch:
            trainer = self.trainer
            raise RuntimeError(
                f"on_train_batch_start returned -1 (skip the rest of the epoch) on learner {trainer.global_rank}, at "
                f"its batch {trainer.fit_loop.epoch_loop.batch_idx} of epoch {trainer.current_epoch}: under "
                "RudraStrategy's shared epoch the learners take different batches, so the others cannot skip at "
                "the same place, and validation and the epoch's end would not meet. Use limit_train_batches (it "
                "counts the batches of all learners), or RudraStrategy(sampling='static')."
            )
        if self.samplers[0].ended == "epoch":  # the epoch was drained, not the run stopped within it
            self._catch_up_schedulers(self._learner_batches)

    def _stop(self) -> None:
        """The run's budget is spent. The batches this learner drew count in it, and may still wait in the
        DataLoader's workers: stop once the last of them is fetched."""
        self._spent = True
        if not self.samplers[0].positions:
            self.trainer.should_stop = True

    def _one_more_batch(self) -> None:
        """A lost learner's batch, dealt again: Lightning ends an epoch at its batch count, which is the pool's, and
        this learner may now take more."""
        self.trainer.fit_loop.max_batches += 1

    def _refuse_per_learner_counts(self) -> None:
        trainer = self.trainer
        # this and trainer.callbacks: set by Lightning's connectors, undeclared on the Trainer
        reload = trainer.reload_dataloaders_every_n_epochs  # type: ignore[attr-defined]
        if reload:
            raise ConfigurationError(
                f"reload_dataloaders_every_n_epochs={reload} cannot be "
                "used with RudraStrategy's shared epoch yet: the learners' pools are set up once, when "
                "training starts. Use RudraStrategy(sampling='static')."
            )
        if getattr(trainer, "_val_check_time_interval", None) is not None:
            raise ConfigurationError(
                f"val_check_interval={trainer.val_check_interval!r} (a time) cannot be used with "
                "RudraStrategy's shared epoch: each learner would validate at its own moment and the "
                "collectives in validation would not meet. Use a fraction or a number of batches, or "
                "RudraStrategy(sampling='static')."
            )
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(callback, ModelCheckpoint) and callback._train_time_interval is not None:
                raise ConfigurationError(
                    f"ModelCheckpoint(train_time_interval={callback._train_time_interval}) cannot be used with "
                    "RudraStrategy's shared epoch yet. Use every_n_train_steps (learner 0's steps), every_n_epochs, "
                    "or RudraStrategy(sampling='static')."
                )

    # ---- step-interval LR schedulers at the epoch's progress ----------------------------------------------
    def _ddp_steps(self, config: Any, epoch: int, batches: int) -> int:
        """Times DDP's learners have stepped ``config``'s scheduler once each has trained ``batches`` of its batches
        in ``epoch``: Lightning steps it at the end of an accumulation window (or of the epoch) whose batch count
        is a multiple of its frequency."""
        per_epoch, window, frequency = self._learner_batches, self.trainer.accumulate_grad_batches, config.frequency

        def within(n: int) -> int:
            last_window = n == per_epoch and n % window != 0 and n % frequency == 0
            return n // math.lcm(window, frequency) + int(last_window)

        return epoch * within(per_epoch) + within(batches)

    def _catch_up_schedulers(self, batches: int) -> None:
        """Steps the step-interval schedulers as DDP's learners would have once each has trained ``batches`` of
        its batches in this epoch (none, or several, between two of this learner's batches)."""
        module, epoch = self.trainer.lightning_module, self.trainer.current_epoch
        for i, config in enumerate(self._scheduled):
            for _ in range(self._ddp_steps(config, epoch, batches) - self._scheduler_steps[i]):
                module.lr_scheduler_step(config.scheduler, None)
                self._scheduler_steps[i] += 1

    def _update_lr_schedulers(self, interval: str, update_plateau_schedulers: bool) -> None:
        """Lightning's, except for the step-interval schedulers that :meth:`_catch_up_schedulers` steps."""
        epoch_loop = self.trainer.fit_loop.epoch_loop
        if interval != "step" or update_plateau_schedulers or not self._scheduled:
            type(epoch_loop).update_lr_schedulers(epoch_loop, interval, update_plateau_schedulers)

    # ---- validation at the same places in the epoch for every learner ----------------------------------
    def _interval(self, epoch_batches: int) -> int:
        """Batches of the epoch (all learners) between validations."""
        interval = self.trainer.val_check_interval
        if isinstance(interval, int):
            return interval * self.num_learners
        return max(1, int(epoch_batches * interval))

    def _should_check_val(self, data_fetcher: Any) -> bool:
        self.in_batch = False  # Lightning asks this once per batch, after the batch's last hook
        trainer = self.trainer
        if trainer.should_stop and trainer.fit_loop._can_stop_early and not self._stopping:
            # decided by this learner alone (max_time's Timer decides inside the batch): the others must stop at
            # the same place, or one would validate (and meet) in an epoch that another never starts
            self._stopping = True
            self.samplers[0].client.stop_drawing()
        epoch_loop = trainer.fit_loop.epoch_loop
        if not epoch_loop._should_check_val_epoch():
            return False
        if trainer.should_stop and trainer.fit_loop._can_stop_early:
            return True  # every learner sees the stop together (EarlyStopping agrees; the budget is spent)
        epoch_batches = self.samplers[0].plan.num_batches
        interval = self._interval(epoch_batches)
        across_epochs = trainer.check_val_every_n_epoch is None
        epoch = trainer.current_epoch
        offset = epoch * epoch_batches if across_epochs else 0
        if not across_epochs and epoch != self._points_epoch:
            self._points_epoch, self._points_done = epoch, 0
        end = offset + epoch_batches
        if epoch_loop.batch_progress.is_last_batch:
            self._points_done = end // interval
            return end % interval == 0
        # A point counts only if every learner is sure to train on a batch past it: the others hold at most
        # the batch they train on, Lightning's prefetched one, the one asked for ahead, and the DataLoader's.
        combined = trainer.fit_loop._combined_loader
        assert combined is not None  # the fit loop's, while training
        loader = combined.flattened[0]
        ahead = 3 + (loader.num_workers * (loader.prefetch_factor or 0) if loader.num_workers else 0)
        last_point = (end - ahead * self.num_learners) // interval
        passed = min((offset + self.position + 1) // interval, last_point)
        if passed > self._points_done:
            self._points_done = passed
            return True
        return False
