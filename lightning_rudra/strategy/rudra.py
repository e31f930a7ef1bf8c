"""RudraStrategy: any LightningModule trains through a parameter server instead of DDP. Every optimizer step pushes
the learner's gradient to the server and goes on from the weights the protocol gives back. There is on purpose no
torch.distributed process group (with one, Lightning 2.6 makes every training batch a collective: lock-step); ranks
and collectives do without one (``server_parallel.py``, ``collectives.py``). Under softsync and async the learners
share each epoch's batches (``shared_epoch.py``); ``simulate=λ`` trains λ virtual learners in one process
(``simulated_epoch.py``); both refit Lightning's fit loop (``fit_loop/``). The strategy owns one object per concern:
its stage's servers, collectives, checkpoints and push metrics."""

from typing import Any, Literal, Mapping, Optional, Sequence

import pytorch_lightning as pl
import torch
from lightning_fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning_fabric.utilities.distributed import _set_num_threads_if_needed
from pytorch_lightning.accelerators import Accelerator
from pytorch_lightning.plugins.precision import Precision
from pytorch_lightning.trainer.states import RunningStage, TrainerFn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_rudra.core.compensation import parse_compensation, staleness_options
from lightning_rudra.core.compression import compression_option
from lightning_rudra.core.config import validate_options, validate_rounds
from lightning_rudra.core.lookahead import StepAhead
from lightning_rudra.core.node_plan import wanted as node_wanted
from lightning_rudra.core.stats import Stats
from lightning_rudra.core.timing import Homogeneous, TimingModel
from lightning_rudra.learner.optimizer import LearnerOptimizer
from lightning_rudra.learner.server_client import ServerClient
from lightning_rudra.learner.simulation import SimulatedClient
from lightning_rudra.strategy.checkpoints import Checkpoints, keep_final_states, load_groups
from lightning_rudra.strategy.clipping import clip_on_the_learner, clip_on_the_server
from lightning_rudra.strategy.checks import (
    check_arguments,
    check_blocking,
    check_buckets,
    check_clipping,
    check_learners,
    check_module,
    check_node_aggregation,
    check_optimizers,
    check_trainer,
    check_trainer_clipping,
)
from lightning_rudra.strategy.fit_loop.shared_epoch_loop import SharedEpochLoop
from lightning_rudra.strategy.launchers import launcher_for
from lightning_rudra.strategy.launchers.popen import PopenLauncher
from lightning_rudra.strategy.options import StrategyArguments, StrategyOptions
from lightning_rudra.strategy.push_metrics import PushMetrics
from lightning_rudra.strategy.registry import flavour_hint
from lightning_rudra.strategy.server_parallel import ServerParallelStrategy
from lightning_rudra.strategy.shared_epoch import shared_dataloader
from lightning_rudra.strategy.simulated_epoch import check_simulation, simulated_dataloader
from lightning_rudra.strategy.server_nodes import stage_started_by
from lightning_rudra.strategy.stage_servers import StageServers
from lightning_rudra.strategy.learner_fit import Aggregation, FitPlan, LearnerFit


class RudraStrategy(ServerParallelStrategy, StrategyArguments):
    """Parameter-server training with the protocols of Rudra (Gupta, Zhang, Wang, ICDM 2016). Every argument in
    full, with what it costs and what it refuses: ``docs/options.md``.

    Args:
        protocol: ``"async"`` (the default: every gradient applied on arrival), ``"hardsync"`` (wait for every
            learner, average, one update: SGD with batch μλ), ``"softsync"`` (an update after any ⌊λ/n⌋
            gradients) or ``"batchsync"`` (K-batch-sync: an update after the first ``k`` gradients of the current
            weights, from any learners; a later one is not applied and its batch is dealt again).
        n: softsync's splitting parameter, 1 <= n <= λ; the mean staleness is about n. Refused above 1 under the
            other protocols.
        lr_modulation: the paper's rules, ``"mean"``, ``"per_gradient"`` or ``"none"``; set alone, no compensation.
        compensation: the server's rule for stale gradients (:mod:`lightning_rudra.core.compensation`):
            ``"momentum"``, ``"dc"``, ``"gap"``, ``"clip"``, ``"syncnorm"``, ``"dana"``, several joined by ``+`` (the
            default: ``"momentum+clip+syncnorm+dana"``), or ``"none"``.
        max_staleness: gradients more than this many updates stale are dropped and counted; None keeps all.
        on_stale: ``"drop"`` (a gradient staler than ``max_staleness`` is dropped and counted) or ``"block"`` (Stale
            Synchronous Parallel: the server holds back the pushes that would make one so, until the lagging
            learner's gradient came; none is dropped).
        k: batchsync's K, the gradients of the current weights an update averages; None: λ.
        backup: hardsync's backup learners: a round takes the first λ - ``backup`` learners' gradients, and the
            others' are not applied (their batches are dealt again).
        nonfinite: a gradient with NaN or Inf is refused and counted (``"skip"``) or stops training (``"raise"``).
        sampling: ``"shared"`` (softsync's and async's default: one pool of batches per epoch) or ``"static"``.
        rpc_timeout: seconds a call to the server may take, and a process's silence before it counts as lost.
        min_learners: None: a lost learner ends the run, as under DDP; ``k``: training goes on while k are left.
        max_restarts: with ``min_learners``, times the launcher restarts each lost learner's process, which rejoins.
        start_method: ``"popen"`` (re-runs the script, like DDP), ``"spawn"`` or ``"forkserver"``.
        overlap: push and pull while the next step computes (Rudra-adv*). Not with hardsync.
        shared_memory: learners on the server's host exchange gradients and weights through ``/dev/shm``.
        compression: ``"bf16"``: gradients pushed through RPC (to another host's server), and the weights that come
            back, travel in bfloat16, with error feedback (:mod:`lightning_rudra.core.compression`); None: in full
            precision.
        bucket_cap_mb: a gradient for a server on another host goes in buckets of about this many MiB while the
            backward pass still runs, as DDP's does (:mod:`lightning_rudra.learner.buckets`); None: after it.
        num_servers: server processes, each owning a contiguous part of the parameters; None: one per node.
        server_nodes: nodes that run only servers, NODE_RANK num_nodes and up (``fit`` puts every server there).
        node_aggregation: hardsync, several learners per node: they sum their gradients in the node's shared memory
            and make one push per round to each server on another host, whose weights they share (Rudra-adv).
            None: on wherever that applies; False: every learner pushes alone.
        simulate: λ learners simulated in this one process (``Trainer(devices=1)``); None: real learners.
        timing: with ``simulate``, the learners' step times (:mod:`lightning_rudra.core.timing`).

    Each argument reads back as an attribute (``strategy.protocol``), which cannot be changed once the strategy is
    built (:mod:`lightning_rudra.strategy.options`). After ``trainer.fit``, :attr:`stats` holds the server's
    statistics (:class:`~lightning_rudra.core.stats.Stats`).
    """

    strategy_name = "rudra"

    # 28 params: the user's arguments, each typed for LightningCLI (as DDPStrategy's); kept in one StrategyOptions
    def __init__(
        self,
        protocol: Literal["hardsync", "softsync", "async", "batchsync"] = "async",
        n: int = 1,
        lr_modulation: Optional[Literal["none", "mean", "per_gradient"]] = None,
        compensation: Optional[str] = None,
        max_staleness: Optional[int] = None,
        on_stale: Literal["drop", "block"] = "drop",
        k: Optional[int] = None,
        backup: int = 0,
        nonfinite: Literal["skip", "raise"] = "skip",
        sampling: Optional[Literal["shared", "static"]] = None,
        rpc_timeout: float = 120.0,
        min_learners: Optional[int] = None,
        max_restarts: int = 0,
        start_method: Literal["popen", "spawn", "forkserver"] = "popen",
        overlap: bool = False,
        shared_memory: bool = True,
        compression: Optional[Literal["bf16", "none"]] = None,
        bucket_cap_mb: Optional[float] = None,
        num_servers: Optional[int] = None,
        server_nodes: int = 0,
        node_aggregation: Optional[bool] = None,
        simulate: Optional[int] = None,
        timing: Optional[TimingModel] = None,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
    ) -> None:
        super().__init__(
            self._in_batch,
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        modulation, compensation = staleness_options(lr_modulation, compensation)
        validate_options(protocol, n, modulation, max_staleness, nonfinite, compensation, on_stale)
        check_blocking(on_stale, overlap, simulate)
        validate_rounds(protocol, k, backup, None, max_staleness, on_stale, overlap)
        check_arguments(
            protocol, sampling, rpc_timeout, start_method, overlap, min_learners, num_servers, max_restarts, backup
        )
        check_simulation(simulate, timing, sampling, overlap)
        check_buckets(bucket_cap_mb, simulate)
        check_node_aggregation(node_aggregation, protocol, min_learners, simulate, server_nodes, backup)
        self._options = StrategyOptions(
            protocol=protocol,
            n=n,
            lr_modulation=modulation,
            compensation=compensation,
            max_staleness=max_staleness,
            on_stale=on_stale,
            k=k,
            backup=backup,
            nonfinite=nonfinite,
            sampling=sampling or ("static" if (protocol == "hardsync" and not backup) or simulate else "shared"),
            rpc_timeout=float(rpc_timeout),
            min_learners=min_learners,
            max_restarts=max_restarts,
            start_method=start_method,
            overlap=overlap,
            shared_memory=shared_memory,
            compression=compression_option(compression),
            bucket_cap_mb=None if bucket_cap_mb is None else float(bucket_cap_mb),
            num_servers=num_servers,
            server_nodes=server_nodes,
            node_aggregation=node_aggregation,
            simulate=simulate,
            timing=(timing or Homogeneous()) if simulate else timing,
        )
        self.stats: Optional[Stats] = None
        # the RPC world of a stage (empty outside one: spawn pickles the strategy)
        self._servers = StageServers(self.rpc_timeout, min_learners, max_restarts)
        self._checkpoints = Checkpoints(protocol, n)
        self._push_metrics = PushMetrics()
        self._training = LearnerFit()  # one fit's learner, loop and rejoining
        self._failed: Optional[str] = None  # this stage failed on this learner: why
        self._pools = 0  # train dataloaders drawing from the server in this stage

    def __repr__(self) -> str:
        return (
            f"RudraStrategy(protocol={self.protocol!r}, n={self.n}, lr_modulation={self.lr_modulation!r}, "
            f"compensation={self.compensation!r}) {flavour_hint(pl.__name__)}"
        )

    # ---- ranks, devices and launch (ServerParallelStrategy has the rest) ------------------------------
    @property
    def num_learners(self) -> int:
        """λ: one learner per process, on every node, or the number of simulated learners."""
        return self.simulate or self.num_nodes * self.num_processes

    @property
    def _aggregating(self) -> bool:
        """Whether the learners decide on node-local aggregation at setup (:func:`~lightning_rudra.core.node_plan.wanted`)."""
        several_hosts = self.num_nodes > 1 or self.server_nodes > 0
        args = (self.node_aggregation, self.protocol, self.min_learners, self.simulate)
        return node_wanted(*args, several_hosts and self.num_processes > 1, self.backup)

    @override
    def _configure_launcher(self) -> None:
        # Called when the Trainer is built: λ is known, no process has started yet.
        check_learners(self._options, self.num_nodes, self.num_processes)
        assert self.cluster_environment is not None
        self._launcher = launcher_for(self, self.cluster_environment, self._servers.report_lost)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.set_world_ranks()
        self._failed = None
        self._training = LearnerFit()
        if self.simulate:
            return
        # each learner its share of the cores' threads, as Lightning's launchers give DDP's in every process (even
        # where they start none): one started by popen, torchrun or SLURM would run on every core, and λ of them
        # would crowd a small machine (MNIST-1D, 4 learners on 2 cores: 5x slower)
        _set_num_threads_if_needed(num_processes=self.num_processes)
        assert self.cluster_environment is not None
        started_by = stage_started_by(self)
        self._servers.join(
            self.cluster_environment, self.global_rank, self.num_learners, started_by, self.server_nodes > 0
        )
        assert self._servers.client is not None
        self._collectives.connect(self._servers.client, self.root_device, self._servers.rejoining)

    def _in_batch(self) -> bool:
        return self._training.in_batch

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._collectives.sync_metrics(self.model)
        fitting = trainer.state.fn == TrainerFn.FITTING
        resumed = self._checkpoints.take_resumed()  # a checkpoint given to this stage only
        if fitting:
            # every learner checks the same things, so a refusal ends them all before any waits for another
            check_trainer(trainer)
            check_module(self.model)
            self.setup_optimizers(trainer)
            check_optimizers(self.optimizers, list(self.model.parameters()), self.compensation)
            # the protocol's type: mypy checks both kinds of client against it
            clients: Sequence[ServerClient] = (
                [SimulatedClient(self.simulate)] if self.simulate else self._servers.clients
            )
            first = self.is_global_zero and not self._servers.rejoining  # registers the model and the rule
            config = self._options.protocol_config(self.num_learners) if first else None
            plan = FitPlan(
                self.num_learners,
                self.overlap,
                self.shared_memory and not self.simulate,
                self.compression,
                self.bucket_cap_mb,
                self._push_metrics.record,
                config,
                resumed,
                self._servers.clients if self._servers.rejoining else [],
                Aggregation(self.node_rank, self.rpc_timeout, self.is_global_zero) if self._aggregating else None,
                simulated=bool(self.simulate),
                shared_epoch=self.sampling == "shared",
                hardsync=self.protocol == "hardsync",
                discards_late=self._options.discards_late,
            )
            self.optimizers = self._training.setup(self.model, self.optimizers, clients, plan)
        self.setup_precision_plugin()  # the learners' optimizers hold no state: it lives on the server
        if fitting:
            # every learner has the same cut: all refuse at once, before training
            check_trainer_clipping(trainer, self._check_clipping, len(self.optimizers))
            if self._training.learner is not None:  # hardsync's servers exchange their parts of the norm
                self._training.learner.sends_norm = self.protocol != "hardsync"
                if self.overlap and "dana" in parse_compensation(self.compensation):  # overlap: stale protocols only
                    config = self._options.protocol_config(self.num_learners)
                    ahead = StepAhead(config.gradients_per_update, undo=config.max_staleness is not None)
                    self._training.learner.step_ahead = ahead
            clip_on_the_server(self.precision_plugin, self._check_clipping)  # the server clips what it applies, as DDP

    def _check_clipping(self, value: float, algorithm: str, optimizer: int) -> None:
        """:func:`check_clipping` for this run: its protocol and how many servers hold a part of ``optimizer``."""
        learner = self._training.learner
        servers = 1 if learner is None else sum(1 for link in learner.links if link.owned[optimizer])
        check_clipping(value, algorithm, optimizer, self._options.protocol_config(self.num_learners), servers)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # ---- training --------------------------------------------------------------------------------------
    @override
    def process_dataloader(self, dataloader: object) -> object:
        assert self.lightning_module is not None  # Lightning processes the dataloaders of the module it set up
        trainer = self.lightning_module.trainer
        if self.simulate and trainer.state.stage == RunningStage.TRAINING:
            assert self.timing is not None  # set whenever simulate is
            # made before the learner exists: inside configure_optimizers, which reads one learner's counts
            return simulated_dataloader(
                dataloader, self.simulate, self.protocol, self.timing, whole=self._training.learner is not None
            )
        client = self._servers.client
        if self.sampling == "shared" and client is not None and trainer.state.stage == RunningStage.TRAINING:
            shared = shared_dataloader(dataloader, client, self._pools, self.num_learners)
            if shared is not None:
                self._pools += 1
                return shared
        return dataloader

    @override
    def on_train_start(self) -> None:
        self._push_metrics.reset()
        assert self.lightning_module is not None  # set up before training
        trainer = self.lightning_module.trainer
        self._training.start(trainer, self._start_epoch, self._end_training)

    @override
    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        # A training batch starts when it is fetched: before the callbacks' and the module's on_train_batch_start,
        # which Lightning calls before the strategy's, and also for a None batch, which gets no such hook
        assert self.lightning_module is not None  # set up before any batch
        if self.lightning_module.trainer.training:
            self._training.batch_fetched()
        return super().batch_to_device(batch, device, dataloader_idx)

    @override
    def on_validation_start(self) -> None:
        if isinstance(self._training.loop, SharedEpochLoop):
            self.barrier("shared epoch: validate together")
        if self._training.learner is not None:
            self._training.learner.pull()

    @override
    def on_train_end(self) -> None:
        self._end_training()  # done already, unless training ended before on_train_start

    def _end_training(self) -> None:
        """Every learner stops pushing; pending softsync gradients are applied; all take the final weights.
        Learner 0 also keeps the final optimizer states, for ``trainer.save_checkpoint`` after ``fit``. Runs
        before the callbacks' ``on_train_end``: what they do to the weights (SWA, EMA) is what fit returns."""
        learner = self._training.end()
        if learner is not None:
            if self.is_global_zero:
                self.stats = keep_final_states(learner, self.optimizers)
            else:
                assert self._servers.client is not None
                self.stats = self._servers.client.stats()
            learner.unwrap()

    def _start_epoch(self) -> None:
        if self.min_learners is not None and self._servers.clients:
            assert self.lightning_module is not None  # training
            self._training.rejoin.epoch_started(self.lightning_module.trainer, self._servers.clients, self._collectives)

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._failed = f"{type(exception).__name__}: {exception}"[:500]

    @override
    def teardown(self) -> None:
        if self._servers.client is not None:
            self._servers.leave(self._failed, self.is_global_zero)
            if isinstance(self._launcher, PopenLauncher) and self.stats is not None:
                self._launcher.end_lost(sorted(self.stats.lost))  # those lost and still running
        self._collectives.close()
        self._training.close()  # training failed: give the Trainer its own loop back
        self._checkpoints.snapshot = None
        self._pools = 0
        self.optimizers = [o.local if isinstance(o, LearnerOptimizer) else o for o in self.optimizers]
        clip_on_the_learner(self.precision_plugin)
        super().teardown()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().training_step(*args, **kwargs)
        if self._training.learner is not None:
            assert self.lightning_module is not None  # the learner is made with it, in setup
            self._push_metrics.log(self.lightning_module, self._training.learner.client.timestamp, self.optimizers)
        return output

    # ---- checkpoints: the optimizer states live on the server (lightning_rudra.strategy.checkpoints) ----
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self._checkpoints.take_snapshot(self._training.learner if self.is_global_zero else None)
        return super().lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if not self.is_global_zero:
            return {}  # only learner 0's checkpoint is written: nothing to fetch from the server
        if isinstance(optimizer, LearnerOptimizer):
            return self._checkpoints.optimizer_state(optimizer)
        return super().optimizer_state(optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        self._checkpoints.save(
            checkpoint, filepath, storage_options, self.is_global_zero, self.stats, super().save_checkpoint
        )

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._checkpoints.loaded(checkpoint)
        return checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        load_groups(self.optimizers, checkpoint)
