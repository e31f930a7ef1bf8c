"""RudraStrategy: any LightningModule trains through a parameter server instead of DDP.

Every optimizer step pushes the learner's gradient to the server and continues from the weights the
protocol gives back. There is deliberately no default torch.distributed process group: since Lightning
2.6 its presence makes every training batch a collective, which would turn async training into lock-step.
Collectives (barrier, broadcast, reduce, all_gather) go through the server instead.
"""

from subprocess import Popen
from typing import Any, Literal, Optional, Union

import pytorch_lightning as pl
import torch
from lightning_fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning_fabric.utilities.types import ReduceOp
from lightning_utilities.core.apply_func import apply_to_collection
from pytorch_lightning.accelerators import Accelerator
from pytorch_lightning.plugins.precision import Precision
from pytorch_lightning.strategies import ParallelStrategy
from pytorch_lightning.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from pytorch_lightning.trainer.states import TrainerFn
from torch import Tensor
from torchmetrics import MaxMetric, MeanMetric, Metric

from lightning_rudra.client import LearnerClient, free_port, join, leave
from lightning_rudra.learner import Learner, LearnerOptimizer
from lightning_rudra.protocol import PROTOCOLS, ProtocolConfig, Stats, validate_n, validate_options

_REDUCTIONS = {"sum": torch.sum, "mean": torch.mean, "avg": torch.mean, "max": torch.amax, "min": torch.amin,
               "product": torch.prod}


class RudraStrategy(ParallelStrategy):
    """Parameter-server training with the protocols of Rudra (Gupta, Zhang, Wang, ICDM 2016).

    Args:
        protocol: ``"hardsync"`` (wait for every learner, average, one update: the same as SGD with batch
            μλ), ``"softsync"`` (update after any ⌊λ/n⌋ gradients, no barrier) or ``"async"`` (every
            gradient applied on arrival).
        n: the softsync splitting parameter, 1 <= n <= λ. Mean staleness is about n.
        lr_modulation: ``"mean"`` divides each update's learning rate by the mean staleness of its
            gradients (the ICDM rule), ``"per_gradient"`` scales each gradient by 1/σ before averaging (the
            IJCAI rule), ``"none"`` keeps the learners' rate.
        max_staleness: gradients more than this many updates stale are dropped and counted; None keeps all.
        nonfinite: a gradient with NaN or Inf is refused and counted (``"skip"``) or stops training
            (``"raise"``); either way the server's weights stay as they were.
        rpc_timeout: seconds every call to the server may take, hardsync waits included. A dead learner
            stops the run within about this time.
        start_method: ``"popen"`` re-runs the script for every learner (like DDP; works with LightningCLI,
            torchrun and SLURM); ``"spawn"`` starts them with multiprocessing (works inside notebooks' scripts
            and tests).
        overlap: push and pull in the background while the next step computes, on the newest weights
            received (Rudra-adv*): higher throughput, about λ more updates of staleness. Not with hardsync.

    After ``trainer.fit``, :attr:`stats` holds the server's statistics: ``clock`` (updates applied),
    ``gradients``, ``dropped``, ``rejected`` and ``staleness`` (σ -> count).
    """

    strategy_name = "rudra"

    def __init__(
        self,
        protocol: Literal["hardsync", "softsync", "async"] = "softsync",
        n: int = 1,
        lr_modulation: Literal["none", "mean", "per_gradient"] = "mean",
        max_staleness: Optional[int] = None,
        nonfinite: Literal["skip", "raise"] = "skip",
        rpc_timeout: float = 120.0,
        start_method: Literal["popen", "spawn"] = "popen",
        overlap: bool = False,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        validate_options(protocol, n, lr_modulation, max_staleness, nonfinite)
        if start_method not in ("popen", "spawn"):
            raise ValueError(f"start_method={start_method!r} is not supported: expected 'popen' or 'spawn'.")
        if overlap and protocol == "hardsync":
            raise ValueError("overlap=True is not available with protocol='hardsync': computing on weights one "
                             "update old would make every gradient stale (σ = 1). Use softsync or async.")
        if not rpc_timeout > 0:
            raise ValueError(f"rpc_timeout={rpc_timeout!r} is not valid: expected a number of seconds > 0.")
        self.protocol = protocol
        self.n = n
        self.lr_modulation = lr_modulation
        self.max_staleness = max_staleness
        self.nonfinite = nonfinite
        self.rpc_timeout = float(rpc_timeout)
        self.start_method = start_method
        self.overlap = overlap
        self.stats: Optional[Stats] = None
        self._num_nodes = 1
        # created per stage, in the learner processes (never in __init__: spawn pickles the strategy)
        self._client: Optional[LearnerClient] = None
        self._server_process: Optional[Popen] = None
        self._learner: Optional[Learner] = None
        self._resume_stats: Optional[Stats] = None
        self._next_port: Optional[int] = None  # where the learners meet for the next stage (fit, then test...)
        self._failed = False
        self._staleness_mean = MeanMetric()
        self._staleness_max = MaxMetric()

    def __repr__(self) -> str:
        # Lightning quotes this repr when a `lightning.pytorch` Trainer refuses the strategy.
        return (f"RudraStrategy(protocol={self.protocol!r}, n={self.n}, lr_modulation={self.lr_modulation!r}) "
                "[a `pytorch_lightning` strategy: use it with `pytorch_lightning.Trainer`, not `lightning.pytorch`]")

    # ---- ranks, devices and launch -------------------------------------------------------------------
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
        """λ: one learner per process, on every node."""
        return self.num_nodes * self.num_processes

    @property
    def is_distributed(self) -> bool:
        """Makes Lightning shard the data with a DistributedSampler and sync ``self.log(..., sync_dist=True)``."""
        return True

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_learners, "rank": self.global_rank}

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_learners)

    def _configure_launcher(self) -> None:
        # Called when the Trainer is built: λ is known, no process has started yet.
        validate_n(self.protocol, self.n, self.num_learners)
        assert self.cluster_environment is not None
        if self.cluster_environment.creates_processes_externally:
            return
        if self.start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _SpawnLauncher(self)

    def setup_environment(self) -> None:
        super().setup_environment()
        self.set_world_ranks()
        assert self.cluster_environment is not None
        env = self.cluster_environment
        port = self._next_port or env.main_port
        self._client, self._server_process = join(self.global_rank, self.num_learners, env.main_address, port,
                                                  self.rpc_timeout)
        self._failed = False

    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None and self.model is not None and self._client is not None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._sync_metrics_through_server()
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.setup_optimizers(trainer)
            self._learner = Learner(self.model, self._client, self.overlap)
            self._learner.on_push = self._record_push
            if self.is_global_zero:
                self._learner.register(self._protocol_config(), self.optimizers, self._resume_stats)
            self._resume_stats = None
            self._learner.pull()  # every learner starts from learner 0's (possibly restored) weights
            self.optimizers = self._learner.wrap(self.optimizers)
        self.setup_precision_plugin()  # the learners' optimizers hold no state: it lives on the server

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def _protocol_config(self) -> ProtocolConfig:
        return ProtocolConfig(self.num_learners, self.protocol, self.n, self.lr_modulation, self.max_staleness,
                              self.nonfinite)

    # ---- training --------------------------------------------------------------------------------------
    def on_train_start(self) -> None:
        self._staleness_mean.reset()
        self._staleness_max.reset()

    def _record_push(self, status: str, staleness: int) -> None:
        if status == "accepted":
            self._staleness_mean.update(float(staleness))
            self._staleness_max.update(float(staleness))

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().training_step(*args, **kwargs)
        # Under automatic optimization the push follows training_step, so these describe the previous steps.
        if self._staleness_mean.update_count:
            module = self.lightning_module
            module.log("staleness_mean", self._staleness_mean.compute(), prog_bar=True, on_step=True)
            module.log("staleness_max", self._staleness_max.compute(), prog_bar=True, on_step=True)
            module.log("server_clock", float(self._client.timestamp), prog_bar=True, on_step=True)
        return output

    def _pull_newest(self) -> None:
        if self._learner is not None:
            self._learner.pull()

    def on_validation_start(self) -> None:
        self._pull_newest()

    def on_train_end(self) -> None:
        """Every learner stops pushing; pending softsync gradients are applied; all take the final weights."""
        if self._learner is not None:
            self._learner.finish()
            self._learner = None
            self.stats = self._client.stats()

    def on_exception(self, exception: BaseException) -> None:
        self._failed = True

    def teardown(self) -> None:
        if self._client is not None:
            if not self._failed:
                self._agree_on_next_port()
            leave(self._client, self._server_process, timeout=min(self.rpc_timeout, 30.0))
        self._client = self._server_process = self._learner = None
        self.optimizers = [o.local if isinstance(o, LearnerOptimizer) else o for o in self.optimizers]
        super().teardown()

    def _agree_on_next_port(self) -> None:
        """A later stage in the same processes (popen: ``fit`` then ``test``) must not meet on this stage's port:
        a fast learner could reach the old rendezvous while learner 0 is still closing it."""
        try:
            self._next_port = self._gather(free_port() if self.is_global_zero else None)[0]
        except Exception:  # a peer is gone: this run is over anyway
            self._next_port = None

    # ---- checkpoints -----------------------------------------------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self._pull_newest()  # a checkpoint holds the server's weights, not this learner's last copy
        return super().lightning_module_state_dict()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Optional[Any] = None) -> None:
        if self.is_global_zero and self._client is not None:
            stats = self._client.stats() if self._learner is not None else self.stats
            if stats is not None:
                checkpoint["rudra"] = {"stats": stats.to_dict()}
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        if "rudra" in checkpoint:
            self._resume_stats = Stats.from_dict(checkpoint["rudra"]["stats"])
        return checkpoint

    # ---- collectives through the server ----------------------------------------------------------------
    def _gather(self, obj: Any) -> list[Any]:
        assert self._client is not None
        sent = apply_to_collection(obj, Tensor, lambda t: t.detach().cpu())  # the server holds CPU tensors
        return self._client.gather(sent)

    def _sync_metrics_through_server(self) -> None:
        """torchmetrics syncs over torch.distributed, which this strategy leaves uninitialized on purpose:
        point the module's metrics at the server instead, so that e.g. a logged accuracy covers all learners."""
        for metric in self.lightning_module.modules():
            if isinstance(metric, Metric):
                metric.dist_sync_fn = self._gather_metric_state
                metric.distributed_available_fn = self._rpc_is_up

    def _rpc_is_up(self) -> bool:
        return self._client is not None

    def _gather_metric_state(self, tensor: Tensor, group: Optional[Any] = None) -> list[Tensor]:
        return [t.to(tensor.device) for t in self._gather(tensor)]

    def barrier(self, name: Optional[str] = None) -> None:
        if self._client is not None:
            self._gather(None)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if self._client is None:
            return obj
        received = self._gather(obj if self.global_rank == src else None)[src]
        return apply_to_collection(received, Tensor, lambda t: t.to(self.root_device))

    def reduce(self, tensor: Any, group: Optional[Any] = None,
               reduce_op: Optional[Union[ReduceOp, str]] = "mean") -> Any:
        if not isinstance(tensor, Tensor) or self._client is None:
            return tensor
        reduce = _REDUCTIONS[_reduce_op_name(reduce_op)]
        stacked = torch.stack(self._gather(tensor))
        if stacked.dtype in (torch.bool, torch.int32, torch.int64) and reduce is torch.mean:
            stacked = stacked.float()
        return reduce(stacked, dim=0).to(device=tensor.device)

    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        if sync_grads:
            raise NotImplementedError("RudraStrategy.all_gather(sync_grads=True) is not supported: gathered "
                                      "tensors travel through the server, without autograd.")
        if self._client is None:
            return tensor
        return torch.stack(self._gather(tensor)).to(tensor.device)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("rudra", cls, description="Rudra parameter server (default: 1-softsync)",
                                   override=True)
        for protocol in PROTOCOLS:
            strategy_registry.register(f"rudra_{protocol}", cls, description=f"Rudra parameter server, {protocol}",
                                       override=True, protocol=protocol)


def _reduce_op_name(reduce_op: Optional[Union[ReduceOp, str]]) -> str:
    if reduce_op is None:
        return "mean"
    if isinstance(reduce_op, str):
        name = reduce_op.lower()
    else:
        name = next((n for n in ("SUM", "MAX", "MIN", "PRODUCT", "AVG") if reduce_op == getattr(ReduceOp, n)), "")
        name = name.lower()
    if name not in _REDUCTIONS:
        raise ValueError(f"reduce_op={reduce_op!r} is not supported by RudraStrategy.reduce: expected one of "
                         f"{sorted(_REDUCTIONS)} or the matching torch.distributed.ReduceOp.")
    return name


class _SpawnLauncher(_MultiProcessingLauncher):
    """Brings the server's statistics back to the process that called ``fit``, with the model weights."""

    def get_extra_results(self, trainer: "pl.Trainer") -> dict[str, Any]:
        extra = super().get_extra_results(trainer)
        stats = self._strategy.stats
        extra["rudra_stats"] = stats.to_dict() if stats is not None else None
        return extra

    def update_main_process_results(self, trainer: "pl.Trainer", extra: dict[str, Any]) -> None:
        super().update_main_process_results(trainer, extra)
        if extra.get("rudra_stats") is not None:
            self._strategy.stats = Stats.from_dict(extra["rudra_stats"])

