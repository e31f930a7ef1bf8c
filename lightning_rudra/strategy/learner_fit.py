"""One ``fit`` on a learner, as :class:`~lightning_rudra.RudraStrategy`'s hooks drive it: the
:class:`~lightning_rudra.learner.learner.Learner` (its optimizers' steps push and pull), Lightning's fit loop refitted
for the shared epoch or for simulated learners (``fit_loop/``), the callback that runs first at each epoch's start
and end and at the end of training, and in an elastic run this process's rejoining (``rejoin.py``). Made in
``setup`` and ``on_train_start``; undone at the end of training, or at teardown when training failed."""

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback
from typing_extensions import override

from lightning_rudra.core.config import ProtocolConfig
from lightning_rudra.learner.client import LearnerClient
from lightning_rudra.learner.learner import Learner
from lightning_rudra.learner.node import aggregate
from lightning_rudra.learner.server_client import ServerClient
from lightning_rudra.learner.simulation import SimulatedClient
from lightning_rudra.strategy.checkpoints import Resumed
from lightning_rudra.strategy.checks import is_placeholder, warn_of_meetings_per_batch
from lightning_rudra.strategy.fit_loop.shared_epoch_loop import SharedEpochLoop
from lightning_rudra.strategy.fit_loop.simulated import SimulatedEpochLoop
from lightning_rudra.strategy.rejoin import RejoinRequest, describe
from lightning_rudra.strategy.shared_epoch import check_late_batches, start_shared_epoch
from lightning_rudra.strategy.simulated_epoch import start_simulation


class Aggregation(NamedTuple):
    """Where the learners decide on node-local aggregation (:func:`~lightning_rudra.learner.node.aggregate`)."""

    node: int  # this learner's node rank
    timeout: float  # rpc_timeout
    announce: bool  # learner 0: it warns if aggregation turns off


@dataclass(frozen=True)
class FitPlan:
    """How this learner trains one ``fit``, as the strategy decides at ``setup``: the learner's options, how it
    starts (learner 0 registers, a new process for a lost learner rejoins) and how its epochs run."""

    num_learners: int
    overlap: bool
    shared_memory: bool
    compression: Optional[str]
    bucket_cap_mb: Optional[float]  # pushes to other hosts in buckets during the backward pass
    on_push: Callable[[int, str, int, float], None]  # told of every push (the logged push metrics)
    config: Optional[ProtocolConfig]  # learner 0 of a new run registers the model with the protocol's options
    resumed: Resumed  # the checkpoint this stage resumes from
    rejoining: Sequence[LearnerClient]  # a process that takes a lost learner's place asks these servers to rejoin
    aggregation: Optional[Aggregation]  # where the learners decide on node-local aggregation
    simulated: bool  # simulated learners in this process
    shared_epoch: bool  # sampling="shared": the learners draw from the epoch pool
    hardsync: bool
    discards_late: bool = False  # batchsync, backup: a late gradient's batches are dealt again (the shared epoch)


class LearnerFit:
    """What one ``fit`` made on this learner, for the strategy's hooks: the learner, Lightning's fit loop refitted,
    the callback that runs first, and this process's request to rejoin."""

    def __init__(self) -> None:
        self.learner: Optional[Learner] = None
        self.loop: Optional[Union[SharedEpochLoop, SimulatedEpochLoop]] = None  # Lightning's fit loop, refitted
        self.end_of_training: Optional[EndOfTraining] = None  # the callback, while training
        self.rejoin = RejoinRequest()  # if this process takes a lost learner's place
        self.plan: Optional[FitPlan] = None  # from setup

    @property
    def in_batch(self) -> bool:
        """Inside a training batch of the shared epoch, where the learners are not in step."""
        return self.loop is not None and self.loop.in_batch

    def setup(
        self, module: torch.nn.Module, optimizers: list[Any], clients: Sequence[ServerClient], plan: FitPlan
    ) -> list[Any]:
        """This fit's learner over ``clients``: learner 0 (given the protocol's ``config``) registers the model, on
        resume with the checkpoint's statistics and optimizer states; a process that takes a lost learner's place
        asks its servers (``rejoining``) to rejoin; every learner then pulls the weights. Returns the optimizers
        Lightning steps: wrapped, so that their steps push; with ``plan.aggregation``, after the learners decided on
        node-local aggregation (once the optimizers are laid out).

        Args:
            module: the LightningModule, on its device.
            optimizers: what ``configure_optimizers`` gave (Lightning's placeholder: nothing is pushed).
            clients: one per server (a simulated run: the one in-process server's).
            plan: the rest, decided by the strategy for this fit.
        """
        self.plan = plan
        # configure_optimizers returned None: Lightning trains without stepping, so nothing is pushed
        stepping = [] if any(map(is_placeholder, optimizers)) else optimizers
        self.learner = Learner(module, clients, plan.overlap, plan.shared_memory, plan.compression, plan.bucket_cap_mb)
        self.learner.on_push = self._pushed
        self.learner.check(stepping)
        if plan.config is not None:
            states = plan.resumed.optimizer_states
            self.learner.register(plan.config, stepping, plan.resumed.stats, states, module=describe(module, stepping))
        elif plan.rejoining:
            self.rejoin.ask(plan.rejoining, describe(module, stepping))
        if not self.rejoin.over:  # a process admitted too late only leaves
            self.learner.pull()  # every learner starts from learner 0's (possibly restored) weights
        if not stepping:
            return optimizers
        wrapped = list(self.learner.wrap(stepping))
        if plan.aggregation is not None:
            client = self.learner.clients[0]
            assert isinstance(client, LearnerClient), "simulated learners do not aggregate (refused at __init__)"
            node, timeout, announce = plan.aggregation
            aggregate(self.learner, client.gather, node, timeout, announce)
        return wrapped

    def _pushed(self, optimizer: int, status: str, staleness: int, lr_scale: float) -> None:
        assert self.plan is not None, "setup comes first"
        self.plan.on_push(optimizer, status, staleness, lr_scale)
        if status == "late" and isinstance(self.loop, SharedEpochLoop):
            self.loop.on_late()

    def start(self, trainer: "pl.Trainer", start_epoch: Callable[[], None], end_training: Callable[[], None]) -> None:
        """At ``on_train_start``: Lightning's fit loop refitted, and the callback that runs first (``start_epoch``
        and ``end_training`` are the strategy's)."""
        assert self.plan is not None, "setup comes first"
        combined = trainer.fit_loop._combined_loader
        loaders = combined.flattened if combined is not None else []
        if self.plan.simulated:
            assert self.learner is not None
            client = self.learner.client
            assert isinstance(client, SimulatedClient), "setup gives a simulated run's learner a SimulatedClient"
            self.loop = start_simulation(trainer, loaders, self.plan.num_learners, client)
        else:
            self.rejoin.start(trainer, self.plan.shared_epoch)  # before the shared epoch's first draw
            # the shared epoch goes on from the checkpoint's statistics
            plan = self.plan
            self.loop = start_shared_epoch(
                trainer, loaders, plan.num_learners, plan.resumed.stats, not plan.discards_late
            )
            if self.plan.discards_late:
                check_late_batches(trainer, self.loop)
            if self.loop is None and not self.plan.hardsync:
                warn_of_meetings_per_batch(trainer)
        # before every other callback's on_train_end, which may still change the weights (weight averaging)
        self.end_of_training = EndOfTraining(trainer, start_epoch, self.end_epoch, end_training)

    def batch_fetched(self) -> None:
        if self.loop is not None and self.learner is not None:
            self.loop.on_batch_fetched(self.learner)

    def end_epoch(self) -> None:
        if self.loop is not None:
            self.loop.on_train_epoch_end()

    def end(self) -> Optional[Learner]:
        """Training is over: Lightning's loop and callbacks are its own again, and the learner (returned, if there
        is one) has stopped pushing and holds the final weights."""
        self._restore()
        learner, self.learner = self.learner, None
        if learner is not None and not self.rejoin.over:  # a process admitted too late never joined training
            learner.finish()
        return learner

    def close(self) -> None:
        """The stage is over (training may have failed): nothing of it is left in Lightning or the module."""
        self._restore()
        if self.learner is not None:
            self.learner.unwrap()
        self.learner = None

    def _restore(self) -> None:
        if self.end_of_training is not None:
            self.end_of_training.remove()
        if self.loop is not None:
            self.loop.uninstall()
        self.loop = self.end_of_training = None


class EndOfTraining(Callback):
    """The first callback while training (:meth:`remove` at its end): ``start_epoch`` before the others'
    ``on_train_epoch_start`` (an elastic run's learners say where they start it, before any collective there),
    ``end_epoch`` before their ``on_train_epoch_end`` (the shared epoch's step schedulers reach the epoch's end),
    ``end_training`` before their ``on_train_end`` (what they then do to the weights, SWA or EMA, is what ``fit``
    returns)."""

    def __init__(
        self,
        trainer: "pl.Trainer",
        start_epoch: Callable[[], None],
        end_epoch: Callable[[], None],
        end_training: Callable[[], None],
    ) -> None:
        self.trainer, self.start_epoch, self.end_epoch, self.end_training = (
            trainer,
            start_epoch,
            end_epoch,
            end_training,
        )
        trainer.callbacks.insert(0, self)  # type: ignore[attr-defined]

    def remove(self) -> None:
        self.trainer.callbacks = [cb for cb in self.trainer.callbacks if cb is not self]  # type: ignore[attr-defined]

    @override
    def on_train_epoch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.start_epoch()

    @override
    def on_train_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.end_epoch()

    @override
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.end_training()
