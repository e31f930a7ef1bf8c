"""RudraStrategy: any LightningModule trains through a parameter server instead of DDP.

Every optimizer step pushes the learner's gradient to the server and continues from the weights the
protocol gives back. There is deliberately no default torch.distributed process group: since Lightning
2.6 its presence makes every training batch a collective, which would turn async training into lock-step.
Collectives (barrier, broadcast, reduce, all_gather) go through the server instead
(:mod:`lightning_rudra.strategy.collectives`). Under softsync and async the learners share each epoch's batches
(:mod:`lightning_rudra.strategy.shared_epoch`), so that a fast learner takes more of them. With ``simulate=λ`` one
process trains λ virtual learners under the same protocol code (:mod:`lightning_rudra.strategy.simulated_epoch`).
Both refit Lightning's fit loop (:mod:`lightning_rudra.strategy.fit_loop`).
"""

from typing import Any, Literal, Optional

import pytorch_lightning as pl
import torch
from lightning_fabric.plugins import CheckpointIO, ClusterEnvironment
from pytorch_lightning.accelerators import Accelerator
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.plugins.precision import Precision
from pytorch_lightning.strategies import ParallelStrategy
from pytorch_lightning.strategies.launchers import _SubprocessScriptLauncher
from pytorch_lightning.trainer.states import RunningStage, TrainerFn
from typing_extensions import override

from lightning_rudra.strategy.checkpoints import ServerCheckpoints
from lightning_rudra.strategy.collectives import ServerCollectives
from lightning_rudra.strategy.launchers.popen import PopenLauncher
from lightning_rudra.learner.learner import Learner, LearnerOptimizer, with_groups
from lightning_rudra.core.compensation import staleness_options
from lightning_rudra.core.config import PROTOCOLS, ProtocolConfig, validate_n, validate_options
from lightning_rudra.strategy.push_metrics import PushMetrics
from lightning_rudra.strategy.fit_loop import SharedEpochLoop, SimulatedEpochLoop
from lightning_rudra.strategy.shared_epoch import shared_dataloader, start_shared_epoch
from lightning_rudra.strategy.simulated_epoch import check_simulation, simulated_dataloader, start_simulation
from lightning_rudra.learner.simulation import SimulatedClient
from lightning_rudra.strategy.launchers.spawn import SpawnLauncher
from lightning_rudra.strategy.stage_servers import StageServers
from lightning_rudra.core.stats import Stats
from lightning_rudra.strategy.checks import (check_arguments, check_min_learners, check_module, check_num_servers,
                                    check_optimizers, check_trainer, is_placeholder, warn_of_meetings_per_batch)
from lightning_rudra.core.timing import Homogeneous, TimingModel


class RudraStrategy(StageServers, ServerCollectives, ServerCheckpoints, PushMetrics, ParallelStrategy):
    """Parameter-server training with the protocols of Rudra (Gupta, Zhang, Wang, ICDM 2016).

    Args:
        protocol: ``"hardsync"`` (wait for every learner, average, one update: the same as SGD with batch
            μλ), ``"softsync"`` (update after any ⌊λ/n⌋ gradients, no barrier) or ``"async"`` (every
            gradient applied on arrival).
        n: the softsync splitting parameter, 1 <= n <= λ. Mean staleness is about n.
        lr_modulation: ``"mean"`` divides each update's learning rate by the mean staleness of its
            gradients (the ICDM rule), ``"per_gradient"`` scales each gradient by 1/σ before averaging (the
            IJCAI rule), ``"none"`` keeps the learners' rate. None (the default): ``"none"``.
        compensation: what the server does about stale gradients (:mod:`lightning_rudra.core.compensation`):
            ``"momentum"`` (scale the rate by c/λ; under staleness switch the optimizer's momentum off and keep the
            step per sample), ``"dc"`` (delay compensation, DC-ASGD), ``"gap"`` (gap-aware damping), several
            joined by ``+``, or ``"none"``. None (the default): ``"momentum"``, unless ``lr_modulation`` is set
            (then ``"none"``: the paper's rule alone). Hardsync is never changed.
        max_staleness: gradients more than this many updates stale are dropped and counted; None keeps all.
        nonfinite: a gradient with NaN or Inf is refused and counted (``"skip"``) or stops training
            (``"raise"``); either way the server's weights stay as they were.
        sampling: ``"shared"`` (the default under softsync and async): each epoch's samples form one pool,
            handed out batch by batch to whichever learner asks next, so a fast learner takes more batches and
            all learners end the epoch within about one batch of each other. ``"static"`` (hardsync's only
            choice): Lightning's DistributedSampler, an equal fixed shard per learner, DDP's exact data order.
        rpc_timeout: seconds a call to the server may take, and how long a learner (or the server) may stay
            silent before it counts as lost. Waiting for a slow but live learner (hardsync rounds, collectives,
            the end of training) has no time limit.
        min_learners: None (the default): a lost learner (its process ended or raised, or it was silent for
            ``rpc_timeout``) ends the run, as under DDP. ``k``: training goes on without it while at least k
            learners are left, under every protocol (softsync's c is recomputed from the learners left, hardsync
            rounds and collectives wait only for them); :attr:`stats` ``.lost`` says who was lost and why. A learner
            that runs a server (learner 0; with several servers, each node's first learner) cannot be lost: its
            loss always ends the run.
        start_method: ``"popen"`` re-runs the script for every learner (like DDP; works with LightningCLI,
            torchrun and SLURM); ``"spawn"`` starts them with multiprocessing (works inside notebooks' scripts
            and tests); ``"forkserver"`` forks them from a process that imported Lightning once, so a learner
            starts in a fraction of a second instead of the seconds an import takes (after the first ``fit``).
        overlap: push and pull in the background while the next step computes, on the newest weights
            received (Rudra-adv*): higher throughput, about λ more updates of staleness. Not with hardsync.
        shared_memory: learners on the server's host exchange gradients and weights with it through shared
            memory (``/dev/shm``), RPC carrying only control; learners on other hosts use RPC. ``False`` sends
            everything through RPC. If shared memory cannot be allocated, a warning says so and RPC is used.
        num_servers: S server processes, each owning one contiguous part of the parameters (a cut falls inside a
            parameter only if every optimizer is elementwise, as SGD and Adam are; else between parameters),
            pushed to and pulled from at once; every protocol runs on each part. They start on the nodes in turn
            (server s on node s mod num_nodes, from that node's first learner), so traffic spreads over the
            nodes. None (the default): one per node. :attr:`stats` are the first server's (all count the same
            updates; each counts σ on its own part).
        simulate: λ, the number of learners to simulate in this one process (``Trainer(devices=1)``), each with
            the weights it last received and the shard of the data a real learner of its rank reads, their pushes
            ordered by ``timing``: the paper's λ = 30 on one machine, at one learner's speed. None: real learners.
        timing: with ``simulate``, how long each learner's steps take (:mod:`lightning_rudra.core.timing`):
            ``Homogeneous()`` (the default), ``Jittered(spread, seed, slowdown)``, ``Stragglers({rank: factor})``
            or ``Measured(times)``.

    After ``trainer.fit``, :attr:`stats` holds the server's statistics: ``clock`` (updates applied),
    ``gradients``, ``dropped``, ``rejected``, ``staleness`` (σ -> count) and, under the shared epoch or simulated,
    ``batches`` (learner -> batches it took).
    """

    strategy_name = "rudra"

    def __init__(
        self,
        protocol: Literal["hardsync", "softsync", "async"] = "softsync",
        n: int = 1,
        lr_modulation: Optional[Literal["none", "mean", "per_gradient"]] = None,
        compensation: Optional[str] = None,
        max_staleness: Optional[int] = None,
        nonfinite: Literal["skip", "raise"] = "skip",
        sampling: Optional[Literal["shared", "static"]] = None,
        rpc_timeout: float = 120.0,
        min_learners: Optional[int] = None,
        start_method: Literal["popen", "spawn", "forkserver"] = "popen",
        overlap: bool = False,
        shared_memory: bool = True,
        num_servers: Optional[int] = None,
        simulate: Optional[int] = None,
        timing: Optional[TimingModel] = None,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        lr_modulation, compensation = staleness_options(lr_modulation, compensation)
        validate_options(protocol, n, lr_modulation, max_staleness, nonfinite, compensation)
        check_arguments(protocol, sampling, rpc_timeout, start_method, overlap, min_learners, num_servers)
        check_simulation(simulate, timing, sampling, overlap)
        self.protocol = protocol
        self.n = n
        self.lr_modulation = lr_modulation
        self.compensation = compensation
        self.max_staleness = max_staleness
        self.nonfinite = nonfinite
        self.rpc_timeout = float(rpc_timeout)
        self.min_learners = min_learners
        self.start_method = start_method
        self.overlap = overlap
        self.shared_memory = shared_memory
        self.num_servers = num_servers
        self.sampling = sampling or ("static" if protocol == "hardsync" or simulate else "shared")
        self.simulate = simulate
        self.timing = (timing or Homogeneous()) if simulate else timing
        self.stats: Optional[Stats] = None
        self._num_nodes = 1
        # created per stage, in the learner processes (never in __init__: spawn pickles the strategy)
        self._reset_stage_servers()
        self._learner: Optional[Learner] = None
        self._resume_stats: Optional[Stats] = None
        self._resume_optimizer_states: Optional[list[dict[str, Any]]] = None
        self._resumed: Optional[Stats] = None  # the checkpoint's statistics, while fitting from one
        self._checkpoint: Optional[tuple[list[dict[str, Any]], Stats]] = None  # learner 0: the server's snapshot
        self._rendezvous = 0  # stages met through torchrun's store
        self._failed: Optional[str] = None  # this stage failed on this learner: why
        self._pools = 0  # train dataloaders drawing from the server in this stage
        self._shared: Optional[SharedEpochLoop] = None  # while training on the shared epoch
        self._simulated: Optional[SimulatedEpochLoop] = None  # while training simulated learners
        self._end_of_training: Optional[tuple[pl.Trainer, _EndOfTraining]] = None  # the callback, while training
        self._reset_push_metrics()

    def __repr__(self) -> str:
        # Lightning quotes this repr when the other flavour's Trainer refuses the strategy.
        ours, other = (("pytorch_lightning", "lightning_rudra"), ("lightning.pytorch", "lightning_rudra.lightning"))
        if pl.__name__ != ours[0]:
            ours, other = other, ours
        return (f"RudraStrategy(protocol={self.protocol!r}, n={self.n}, lr_modulation={self.lr_modulation!r}, "
                f"compensation={self.compensation!r}) "
                f"[a `{ours[0]}` strategy: with `{other[0]}.Trainer`, use `{other[1]}.RudraStrategy`]")

    # ---- ranks, devices and launch -------------------------------------------------------------------
    @override
    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def num_learners(self) -> int:
        """λ: one learner per process, on every node, or the number of simulated learners."""
        return self.simulate or self.num_nodes * self.num_processes

    @property
    def is_distributed(self) -> bool:
        """Makes Lightning shard the data with a DistributedSampler and sync ``self.log(..., sync_dist=True)``."""
        return True

    @override
    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)

    @override
    def _configure_launcher(self) -> None:
        # Called when the Trainer is built: λ is known, no process has started yet.
        validate_n(self.protocol, self.n, self.num_learners)
        check_min_learners(self.min_learners, self.num_learners, self.simulate)
        check_num_servers(self.num_servers, self.simulate)
        if self.simulate:
            if self.num_nodes * self.num_processes != 1:
                raise ValueError(
                    f"simulate={self.simulate} trains every learner in this one process: use Trainer(devices=1, "
                    f"num_nodes=1), not devices={self.num_processes}, num_nodes={self.num_nodes}. For real learner "
                    "processes, leave simulate unset.")
            return  # no launcher: the Trainer runs in this process
        assert self.cluster_environment is not None
        if self.cluster_environment.creates_processes_externally:
            return
        if self.start_method == "popen" and self.min_learners is None:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        elif self.start_method == "popen":
            self._launcher = PopenLauncher(self.cluster_environment, self.num_processes, self.num_nodes,
                                           min_learners=self.min_learners, report=self._report_lost)
        else:
            self._launcher = SpawnLauncher(self, self.start_method)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.set_world_ranks()
        self._failed = None
        if self.simulate:
            return
        self._join_servers()

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._sync_metrics_through_server()
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            # every learner checks the same things, so a refusal ends them all before any waits for another
            check_trainer(trainer)
            check_module(self.model)
            self.setup_optimizers(trainer)
            check_optimizers(self.optimizers, list(self.model.parameters()), self.compensation)
            # configure_optimizers returned None: Lightning trains without stepping, so nothing is pushed
            stepping = [] if any(map(is_placeholder, self.optimizers)) else self.optimizers
            clients = [SimulatedClient(self.simulate)] if self.simulate else self._clients
            self._learner = Learner(self.model, clients, self.overlap, self.shared_memory and not self.simulate)
            self._learner.on_push = self._record_push
            self._learner.check(stepping)
            if self.is_global_zero:
                self._learner.register(self._protocol_config(), stepping, self._resume_stats,
                                       self._resume_optimizer_states)
            self._learner.pull()  # every learner starts from learner 0's (possibly restored) weights
            if stepping:
                self.optimizers = self._learner.wrap(stepping)
        # a checkpoint given to this stage only; the shared epoch goes on from its statistics
        self._resumed = self._resume_stats if fitting else None
        self._resume_stats = self._resume_optimizer_states = None
        self.setup_precision_plugin()  # the learners' optimizers hold no state: it lives on the server

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def _protocol_config(self) -> ProtocolConfig:
        return ProtocolConfig(self.num_learners, self.protocol, self.n, self.lr_modulation, self.max_staleness,
                              self.nonfinite, self.compensation)

    # ---- training --------------------------------------------------------------------------------------
    @override
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer
        if self.simulate and trainer.state.stage == RunningStage.TRAINING:
            # made before the learner exists: inside configure_optimizers, which reads one learner's counts
            return simulated_dataloader(dataloader, self.simulate, self.protocol, self.timing,
                                        whole=self._learner is not None)
        if self.sampling == "shared" and self._client is not None and trainer.state.stage == RunningStage.TRAINING:
            shared = shared_dataloader(dataloader, self._client, self._pools, self.num_learners)
            if shared is not None:
                self._pools += 1
                return shared
        return dataloader

    @override
    def on_train_start(self) -> None:
        self._reset_push_metrics()
        trainer = self.lightning_module.trainer
        combined = trainer.fit_loop._combined_loader
        loaders = combined.flattened if combined is not None else []
        if self.simulate:
            assert self._learner is not None
            self._simulated = start_simulation(trainer, loaders, self.num_learners, self._learner.client)
        else:
            self._shared = start_shared_epoch(trainer, loaders, self.num_learners, self._resumed)
            if self._shared is None and self.protocol != "hardsync":
                warn_of_meetings_per_batch(trainer)
        # before every other callback's on_train_end, which may still change the weights (weight averaging)
        self._end_of_training = (trainer, _EndOfTraining())
        trainer.callbacks.insert(0, self._end_of_training[1])

    @override
    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        # A training batch starts when it is fetched: before the callbacks' and the module's on_train_batch_start,
        # which Lightning calls before the strategy's, and also for a None batch, which gets no such hook
        if self.lightning_module.trainer.training:
            if self._shared is not None:
                self._shared.on_batch_fetched()
            if self._simulated is not None and self._learner is not None:
                weights = self._learner.client.switch(self._simulated.next_learner())
                if weights is not None:
                    self._learner.load(*weights)
        return super().batch_to_device(batch, device, dataloader_idx)

    def _pull_newest(self) -> None:
        if self._learner is not None:
            self._learner.pull()

    @override
    def on_validation_start(self) -> None:
        if self._shared is not None:
            self.barrier("shared epoch: validate together")
        self._pull_newest()

    @override
    def on_train_end(self) -> None:
        self._end_training()  # done already, unless training ended before on_train_start

    def _end_training(self) -> None:
        """Every learner stops pushing; pending softsync gradients are applied; all take the final weights.
        Learner 0 also keeps the final optimizer states, for ``trainer.save_checkpoint`` after ``fit``. Runs
        before the callbacks' ``on_train_end``: what they do to the weights (SWA, EMA) is what fit returns."""
        self._remove_end_of_training()
        if self._shared is not None:
            self._shared.uninstall()
            self._shared = None
        if self._simulated is not None:
            self._simulated.uninstall()
            self._simulated = None
        if self._learner is not None:
            self._learner.finish()
            if self.is_global_zero:
                states, self.stats = self._learner.snapshot()
                for optimizer, state in zip(self.optimizers, states):
                    optimizer.local.load_state_dict(with_groups(state, optimizer.local))
            else:
                self.stats = self._client.stats()
            self._learner.unwrap()
            self._learner = None

    def _remove_end_of_training(self) -> None:
        if self._end_of_training is not None:
            (trainer, callback), self._end_of_training = self._end_of_training, None
            trainer.callbacks = [cb for cb in trainer.callbacks if cb is not callback]

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._failed = f"{type(exception).__name__}: {exception}"[:500]

    @override
    def teardown(self) -> None:
        if self._client is not None:
            self._leave_servers()
        if self._shared is not None:  # training failed: give the Trainer its own loop back
            self._shared.uninstall()
        if self._simulated is not None:
            self._simulated.uninstall()
        if self._learner is not None:
            self._learner.unwrap()
        self._remove_end_of_training()
        self._learner = self._shared = self._simulated = self._checkpoint = None
        self._pools = 0
        self.optimizers = [o.local if isinstance(o, LearnerOptimizer) else o for o in self.optimizers]
        super().teardown()

    @override
    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("rudra", cls, description="Rudra parameter server (default: 1-softsync)",
                                   override=True)
        for protocol in PROTOCOLS:
            strategy_registry.register(f"rudra_{protocol}", cls, description=f"Rudra parameter server, {protocol}",
                                       override=True, protocol=protocol)


class _EndOfTraining(Callback):
    """The first callback while training: ends the shared epoch's epochs before the others' ``on_train_epoch_end``,
    and training on the server before the others' ``on_train_end``."""

    @override
    def on_train_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if trainer.strategy._shared is not None:
            trainer.strategy._shared.on_train_epoch_end()

    @override
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        trainer.strategy._end_training()
