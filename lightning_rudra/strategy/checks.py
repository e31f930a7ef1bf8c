"""What a LightningModule and a Trainer may combine with RudraStrategy, and the strategy's own arguments.

Every learner runs the same checks on the same module, optimizers and callbacks at setup, before any learner
waits on another, so a combination that cannot work under a parameter server ends every learner at once, with
an error that names the part at fault and what to do instead. docs/support.md lists each
case and its test.
"""

import inspect
import math
from typing import Callable, Optional, Sequence

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import LearningRateFinder, ModelCheckpoint, Timer
from pytorch_lightning.core.optimizer import _MockOptimizer
from pytorch_lightning.utilities import GradClipAlgorithmType, rank_zero_warn
from pytorch_lightning.utilities.model_helpers import is_overridden
from torch.nn.parameter import is_lazy
from torch.optim import Optimizer

from lightning_rudra.core.errors import ConfigurationError
from lightning_rudra.core.clipping import refuse_softsync
from lightning_rudra.core.compensation import check_optimizer, parse_compensation
from lightning_rudra.core.config import OVERLAP_BLOCKS, ProtocolConfig, validate_blocking, validate_n, validate_rounds
from lightning_rudra.core.node_plan import refusal
from lightning_rudra.core.optimizers import OptimizerSpec
from lightning_rudra.strategy.options import StrategyOptions
from lightning_rudra.strategy.server_nodes import check_server_nodes


SAMPLINGS = ("shared", "static")
START_METHODS = ("popen", "spawn", "forkserver")


def check_blocking(on_stale: str, overlap: bool, simulate: Optional[int]) -> None:
    """on_stale='block' (its own values: :func:`lightning_rudra.core.config.validate_options`) with the strategy's
    other arguments."""
    if on_stale != "block":
        return
    if overlap:
        raise ConfigurationError(OVERLAP_BLOCKS)
    if simulate is not None:
        raise ConfigurationError(
            f"on_stale='block' cannot be simulated (simulate={simulate!r}): the timing model orders the simulated "
            "learners' pushes, and none of them can be held back. Use real learners, or on_stale='drop'."
        )


def check_buckets(bucket_cap_mb: Optional[float], simulate: Optional[int]) -> None:
    """``bucket_cap_mb``: a size, where pushes cross a link."""
    if bucket_cap_mb is None:
        return
    if (
        isinstance(bucket_cap_mb, bool)
        or not isinstance(bucket_cap_mb, (int, float))
        or not 0 < bucket_cap_mb < math.inf
    ):
        raise ConfigurationError(
            f"bucket_cap_mb={bucket_cap_mb!r} is not valid: expected a size in MiB > 0 (25 is DDP's), or None to push "
            "after the backward pass."
        )
    if simulate:
        raise ConfigurationError(
            f"bucket_cap_mb={bucket_cap_mb!r} is not available with simulate: simulated learners push to a server in "
            "their own process, through no link. Leave bucket_cap_mb unset with simulate."
        )


def check_arguments(  # 9 params: the strategy's own arguments as the user gave them, before any default fills in
    protocol: str,
    sampling: Optional[str],
    rpc_timeout: float,
    start_method: str,
    overlap: bool,
    min_learners: Optional[int] = None,
    num_servers: Optional[int] = None,
    max_restarts: int = 0,
    backup: int = 0,
) -> None:
    """RudraStrategy's own arguments, as it is built (the protocol's are :func:`lightning_rudra.core.config.validate_options`)."""
    if start_method not in START_METHODS:
        raise ConfigurationError(
            f"start_method={start_method!r} is not supported: expected 'popen', 'spawn' or 'forkserver'."
        )
    if overlap and protocol == "hardsync":
        raise ConfigurationError(
            "overlap=True is not available with protocol='hardsync': computing on weights one "
            "update old would make every gradient stale (σ = 1). Use softsync or async."
        )
    if sampling is not None and sampling not in SAMPLINGS:
        raise ConfigurationError(
            f"sampling={sampling!r} is not supported: expected 'shared', 'static' or None (shared "
            "under softsync and async, static under hardsync)."
        )
    if sampling == "shared" and protocol == "hardsync" and not backup:
        raise ConfigurationError(
            "sampling='shared' is not available with protocol='hardsync': a hardsync round takes "
            "one batch from every learner, so every learner needs the same number of batches. "
            "Use sampling='static' (or leave it unset), or protocol='softsync' or 'async'."
        )
    late = "protocol='batchsync'" if protocol == "batchsync" else f"backup={backup}" if backup else None
    if sampling == "static" and late is not None:
        raise ConfigurationError(
            f"sampling='static' is not available with {late}: a gradient that comes after its round closed is not "
            "applied, and its batch must be dealt again, to whichever learner asks next (a straggler would be late "
            "with every batch of its own part). Leave sampling unset (shared)."
        )
    if not rpc_timeout > 0:
        raise ConfigurationError(f"rpc_timeout={rpc_timeout!r} is not valid: expected a number of seconds > 0.")
    if min_learners is not None and (
        isinstance(min_learners, bool) or not isinstance(min_learners, int) or min_learners < 1
    ):
        raise ConfigurationError(
            f"min_learners={min_learners!r} is not valid: expected an integer >= 1 (train on while that "
            "many learners are left), or None (a lost learner ends training)."
        )
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ConfigurationError(
            f"max_restarts={max_restarts!r} is not valid: expected an integer >= 0 (times each lost learner's "
            "process is restarted)."
        )
    if max_restarts and min_learners is None:
        raise ConfigurationError(
            f"max_restarts={max_restarts} needs min_learners: without it a lost learner ends the run, and there is "
            "nothing to rejoin. Set RudraStrategy(min_learners=k, max_restarts=r)."
        )
    if num_servers is not None and (
        isinstance(num_servers, bool) or not isinstance(num_servers, int) or num_servers < 1
    ):
        raise ConfigurationError(
            f"num_servers={num_servers!r} is not valid: expected an integer >= 1 (server processes, "
            "each owning a part of the parameters), or None (one per node)."
        )


def check_min_learners(min_learners: Optional[int], num_learners: int, simulate: Optional[int]) -> None:
    """Once λ is known (the Trainer is built)."""
    if min_learners is None:
        return
    if simulate:
        raise ConfigurationError(
            f"min_learners={min_learners} has no meaning with simulate={simulate}: simulated learners "
            "are never lost. Leave min_learners unset."
        )
    if min_learners > num_learners:
        raise ConfigurationError(
            f"min_learners={min_learners} is more than the {num_learners} learners of this run "
            "(devices × num_nodes): expected 1 <= min_learners <= λ."
        )


def check_num_servers(num_servers: Optional[int], simulate: Optional[int]) -> None:
    if simulate and num_servers not in (None, 1):
        raise ConfigurationError(
            f"num_servers={num_servers} has no meaning with simulate={simulate}: simulated learners "
            "share one in-process server. Leave num_servers unset."
        )


def check_node_aggregation(  # 6 params: node_aggregation and the options it cannot go with
    node_aggregation: Optional[bool],
    protocol: str,
    min_learners: Optional[int],
    simulate: Optional[int],
    server_nodes: int = 0,
    backup: int = 0,
) -> None:
    """``node_aggregation``, and ``server_nodes`` (:func:`~lightning_rudra.strategy.server_nodes.check_server_nodes`)."""
    check_server_nodes(server_nodes, min_learners, simulate)
    if node_aggregation not in (None, True, False):
        raise ConfigurationError(
            f"node_aggregation={node_aggregation!r} is not valid: expected None (on where it applies), True or False."
        )
    why = refusal(protocol, min_learners, simulate, backup) if node_aggregation else None
    if why is not None:
        raise ConfigurationError(
            f"node_aggregation=True cannot be used with {why}. Leave node_aggregation unset (None: on only where it "
            "applies) or set it to False."
        )


def is_placeholder(optimizer: Optimizer) -> bool:
    """Lightning's stand-in when ``configure_optimizers`` returns None: training runs and nothing steps."""
    return isinstance(optimizer, _MockOptimizer)


def check_trainer(trainer: "pl.Trainer") -> None:
    # trainer.callbacks: set by Lightning's callback connector, undeclared on the Trainer
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, LearningRateFinder):
            raise ConfigurationError(
                f"{type(callback).__name__} (what Tuner.lr_find adds) cannot run under RudraStrategy: its range test "
                "trains inside fit and then puts the weights back from a checkpoint on each learner, while the "
                "weights that count live on the parameter server. Find the rate on one device first "
                "(Tuner(pl.Trainer(devices=1)).lr_find(model)), then train with RudraStrategy."
            )


def check_module(module: torch.nn.Module) -> None:
    """The server needs every parameter's shape, on the learner's one device, before training starts."""
    lazy = [name for name, p in module.named_parameters() if is_lazy(p)]
    if lazy:
        raise ConfigurationError(
            f"the parameters {', '.join(lazy)} are not initialized yet (lazy modules such as nn.LazyLinear), and "
            "the parameter server needs their shapes before training starts. Materialize them before fit: run a "
            "forward pass on an example batch at the end of __init__ or in configure_model, or give the layers "
            "their input sizes (nn.Linear instead of nn.LazyLinear)."
        )
    devices: dict[str, list[str]] = {}
    for name, p in module.named_parameters():
        devices.setdefault(str(p.device), []).append(name)
    if len(devices) > 1:
        where = "; ".join(
            f"{device}: {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}" for device, names in devices.items()
        )
        raise ConfigurationError(
            f"the module's parameters are on several devices ({where}): RudraStrategy trains one whole "
            "copy of the module per learner, on that learner's device, as DDP does. Keep every "
            "parameter on one device (no model parallelism inside a learner)."
        )


def check_optimizers(
    optimizers: Sequence[Optimizer], params: Sequence[torch.Tensor], compensation: str = "none"
) -> None:
    """The server steps its own copy of each optimizer, rebuilt as ``cls(param_groups)``, with the gradients the
    learners push and no closure, and with the ``compensation`` rules."""
    for index, optimizer in enumerate(optimizers):
        if is_placeholder(optimizer):
            continue
        name = f"optimizer {index} ({type(optimizer).__name__})"
        if isinstance(optimizer, torch.optim.SparseAdam):
            raise ConfigurationError(
                f"{name} needs sparse gradients, but the learners push dense ones (sparse gradients "
                "are made dense on the learner). Use torch.optim.Adam, or SGD / Adagrad, which give "
                "the same result with dense gradients as with sparse ones."
            )
        closure = inspect.signature(optimizer.step).parameters.get("closure")
        if closure is not None and closure.default is inspect.Parameter.empty:
            raise ConfigurationError(
                f"{name} needs a closure in every step: it re-evaluates the loss at weights of its own choosing "
                "(LBFGS does, several times per step), and the parameter server only receives gradients. Use a "
                "first-order optimizer (SGD, Adam, ...), or train this module with DDP."
            )
        check_optimizer(parse_compensation(compensation), type(optimizer), name)
        spec = OptimizerSpec.from_optimizer(optimizer, params)  # refuses tensors that are not module parameters
        try:
            spec.build([torch.empty_like(p, device="meta") for p in params])
        except Exception as error:
            raise ConfigurationError(
                f"the parameter server cannot rebuild {name} as {type(optimizer).__name__}(param_groups): {error}. It "
                "steps its own copy, made from the parameter groups' values alone; an optimizer whose constructor "
                "needs more (an argument without a default, another optimizer it wraps, the model) cannot run there. Use a plain torch optimizer, "
                "or one whose settings all live in its parameter groups."
            ) from error


def check_clipping(value: float, algorithm: str, optimizer: int, config: ProtocolConfig, servers: int) -> None:
    """Clipping by norm where softsync averages c > 1 gradients per update and ``optimizer`` is cut between
    several ``servers``: refused (:func:`~lightning_rudra.core.clipping.refuse_softsync`), before any push.

    Args:
        value: the clipping's ``gradient_clip_val``.
        algorithm: ``"norm"`` or ``"value"``.
        optimizer: the index of the optimizer whose gradient is clipped.
        config: the run's protocol, n and λ.
        servers: how many servers hold a part of ``optimizer``'s parameters.
    """
    c = config.gradients_per_update if config.protocol == "softsync" else 1
    if c > 1 and servers > 1 and value > 0 and GradClipAlgorithmType(algorithm) == GradClipAlgorithmType.NORM:
        refuse_softsync(float(value), optimizer, servers, c, config.n, config.num_learners)


def check_trainer_clipping(trainer: "pl.Trainer", check: Callable[[float, str, int], None], optimizers: int) -> None:
    """The Trainer's ``gradient_clip_val``, known at setup: ``check`` (:func:`check_clipping` for this run) on each of
    the ``optimizers``, before training starts. A module that clips in its own ``configure_gradient_clipping`` is
    checked at its call, where it shows."""
    if not trainer.gradient_clip_val:
        return
    if trainer.lightning_module is not None and is_overridden("configure_gradient_clipping", trainer.lightning_module):
        return
    for optimizer in range(optimizers):
        check(float(trainer.gradient_clip_val), str(trainer.gradient_clip_algorithm or "norm"), optimizer)


def warn_of_meetings_per_batch(trainer: "pl.Trainer") -> None:
    """With static parts of the data (sampling='static'), Lightning features that broadcast a decision after every batch put softsync and async
    learners in lock-step. (Under the shared epoch each learner decides for itself: no meeting.)"""
    timed = [
        f"Trainer(max_time={cb._duration:g} s)"
        for cb in trainer.callbacks  # type: ignore[attr-defined]
        if isinstance(cb, Timer) and cb._duration is not None
    ]
    timed += [
        f"ModelCheckpoint(train_time_interval={cb._train_time_interval})"
        for cb in trainer.callbacks  # type: ignore[attr-defined]
        if isinstance(cb, ModelCheckpoint) and cb._train_time_interval is not None
    ]
    if timed:
        rank_zero_warn(
            f"{' and '.join(timed)} with RudraStrategy(sampling='static'): Lightning broadcasts its "
            "decision after every training batch, so every batch becomes a meeting of all learners and "
            "softsync/async run in lock-step. Use sampling='shared' (the default under softsync and "
            "async: each learner decides on its own clock), or max_epochs/max_steps."
        )


def check_simulated_devices(simulate: Optional[int], num_nodes: int, num_processes: int) -> None:
    if simulate and num_nodes * num_processes != 1:
        raise ConfigurationError(
            f"simulate={simulate} trains every learner in this one process: use Trainer(devices=1, num_nodes=1), "
            f"not devices={num_processes}, num_nodes={num_nodes}. For real learner processes, leave simulate unset."
        )


def check_late_servers(options: StrategyOptions, num_nodes: int) -> None:
    """K-batch-sync and backup learners choose which gradients a round takes: every server must choose alike."""
    servers = options.num_servers or max(num_nodes, options.server_nodes, 1)
    if not options.discards_late or servers == 1:
        return
    late = "protocol='batchsync'" if options.protocol == "batchsync" else f"backup={options.backup}"
    raise ConfigurationError(
        f"{late} needs one parameter server, not {servers} (num_servers={options.num_servers!r}, {num_nodes} "
        "node(s)): each server would take the first gradients to reach it, which may not be the same learners', "
        "and the parts of the model would be updated from different batches. Set RudraStrategy(num_servers=1)."
    )


def check_learners(options: StrategyOptions, num_nodes: int, num_processes: int) -> None:
    """Once the Trainer is built, λ is known: the arguments that depend on it, before any process starts."""
    num_learners = options.simulate or num_nodes * num_processes
    validate_n(options.protocol, options.n, num_learners)
    validate_rounds(options.protocol, options.k, options.backup, num_learners)
    check_late_servers(options, num_nodes)
    validate_blocking(options.protocol, options.n, options.max_staleness, options.on_stale, num_learners)
    check_min_learners(options.min_learners, num_learners, options.simulate)
    check_num_servers(options.num_servers, options.simulate)
    check_simulated_devices(options.simulate, num_nodes, num_processes)
