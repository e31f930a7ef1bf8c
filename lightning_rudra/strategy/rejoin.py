"""A learner's part in an elastic run (``RudraStrategy(min_learners=k)``): every learner tells the servers where it
starts each epoch, and a process that takes a lost learner's place (restarted by the launcher, or started by hand
with the lost learner's environment) asks to rejoin, waits to be admitted at the start of an epoch
(:mod:`lightning_rudra.server.rejoins`), and takes the run's place there: Lightning's epoch and global step, the LR
schedulers' positions, the count of collectives, the run's elapsed time (``max_time``). Until then its
collectives stay its own."""

import warnings
from typing import Any, Optional, Sequence

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Timer

from lightning_rudra.learner.client import LearnerClient
from lightning_rudra.server.rejoins import Admission, describe_module
from lightning_rudra.strategy.collectives import Collectives


def describe(module: torch.nn.Module, optimizers: Sequence[Any]) -> dict[str, Any]:
    """What a rejoining process must share with the run (checked by the server before it is admitted)."""
    return describe_module(
        [(name, tuple(p.shape)) for name, p in module.named_parameters()],
        [f"{type(o).__module__}.{type(o).__qualname__}" for o in optimizers],
    )


class RejoinRequest:
    """The learner's side of rejoining, for one stage: this process's request to rejoin, if it takes a lost
    learner's place, what it takes on admission (the servers answer from their
    :class:`~lightning_rudra.server.rejoins.RejoinAdmissions`), and the progress reports of every learner of an
    elastic run."""

    def __init__(self) -> None:
        self.admission: Optional[Admission] = None
        self.hparams: list[list[dict[str, Any]]] = []  # the servers' hyper-parameters per optimizer and group
        self.over = False  # training ended before this process was admitted
        self.first_epoch = False  # admitted, and its first epoch has not started yet

    def ask(self, clients: Sequence[LearnerClient], module: dict[str, Any]) -> None:
        """Wait until every server admits this process (at an epoch's start), or training ends."""
        futures = [client.rejoin(module) for client in clients]
        replies = [client.result(future) for client, future in zip(clients, futures)]
        if any(reply is None for reply in replies):
            self.over = True
            return
        self.admission, self.hparams = replies[0]
        self.first_epoch = True

    def start(self, trainer: "pl.Trainer", shared_epoch: bool) -> None:
        """At ``on_train_start``: the fit loop goes on from the run's epoch and global step, the LR schedulers from
        their positions there (``shared_epoch``: under the shared epoch, whose step-interval schedulers catch up by the
        epoch's progress themselves); without a scheduler, the optimizers take the servers' hyper-parameters (the
        others' last ones). A process admitted too late only stops."""
        if self.over:
            trainer.should_stop = True
            return
        if self.admission is None:
            return
        epoch, step = self.admission.epoch, self.admission.global_step
        for timer in (cb for cb in trainer.callbacks if isinstance(cb, Timer)):  # type: ignore[attr-defined]
            # max_time counts the run's time, not this process's (Lightning types the offset int, restores a float)
            timer._offset = self.admission.elapsed  # type: ignore[assignment]
        fit_loop = trainer.fit_loop
        for tracker in (fit_loop.epoch_progress.total, fit_loop.epoch_progress.current):
            # _ProcessedTrackers, which Lightning declares as their base class
            tracker.ready = tracker.started = tracker.processed = tracker.completed = epoch  # type: ignore[attr-defined]
        epoch_loop = fit_loop.epoch_loop
        if trainer.lightning_module.automatic_optimization:
            steps = epoch_loop.automatic_optimization.optim_progress.optimizer.step.total
        else:
            steps = epoch_loop.manual_optimization.optim_step_progress.total
        steps.ready = steps.completed = step
        epoch_loop._batches_that_stepped = step
        configs = [c for c in trainer.lr_scheduler_configs if not c.reduce_on_plateau]
        with warnings.catch_warnings():  # torch's "lr_scheduler.step() before optimizer.step()": on purpose here
            warnings.simplefilter("ignore", UserWarning)
            for config in configs:
                count = epoch if config.interval == "epoch" else 0 if shared_epoch else step
                for _ in range(count // config.frequency):
                    trainer.lightning_module.lr_scheduler_step(config.scheduler, None)
        if not configs:
            for optimizer, groups in zip(trainer.optimizers, self.hparams):
                for group, hparams in zip(optimizer.param_groups, groups):
                    group.update(hparams)

    def epoch_started(self, trainer: "pl.Trainer", clients: Sequence[LearnerClient], collectives: Collectives) -> None:
        """At every epoch's start: a rejoined learner's collectives meet the others' from here on; every learner
        tells the servers where it starts (a process waiting to rejoin is admitted once all have)."""
        if self.first_epoch:
            assert self.admission is not None
            clients[0].continue_collectives(self.admission.collectives)
            collectives.rejoined()
            self.first_epoch = False
        for client in clients:
            client.progress(trainer.current_epoch, trainer.global_step)
