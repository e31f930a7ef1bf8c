"""How the strategy starts its learners: ``popen`` (the script run again per learner) and ``spawn``/``forkserver``."""

import os
from typing import Any, Callable

from lightning_fabric.plugins import ClusterEnvironment
from lightning_fabric.plugins.environments import LightningEnvironment
from pytorch_lightning.strategies.launchers import _SubprocessScriptLauncher

from lightning_rudra.strategy.launchers.popen import PopenLauncher
from lightning_rudra.strategy.launchers.spawn import SpawnLauncher
from lightning_rudra.strategy.server_nodes import ServerNodeLauncher, check_server_node_job
from lightning_rudra.transport.rpc_world import free_port


def launcher_for(
    strategy: Any, environment: ClusterEnvironment, report: Callable[[int, str, tuple[str, int]], None]
) -> Any:
    """The launcher of ``strategy.start_method``: with ``min_learners``, the strategy's own, which let the other
    learners train on when one is lost (``report`` hears of it); without, Lightning's for ``popen``. A server node's
    own (:class:`~lightning_rudra.strategy.server_nodes.ServerNodeLauncher`); None where the processes are created
    outside (torchrun, SLURM, a learner started by a launcher) or simulated."""
    check_server_node_job(strategy.server_nodes, strategy.num_servers, strategy.num_nodes, environment)
    if strategy.server_nodes and strategy.node_rank >= strategy.num_nodes:  # a server node: servers, no learner
        return ServerNodeLauncher(strategy, environment)
    if strategy.simulate or environment.creates_processes_externally:
        return None
    pick_main_port(environment)
    if strategy.start_method == "popen" and strategy.min_learners is None:
        return _SubprocessScriptLauncher(environment, strategy.num_processes, strategy.num_nodes)
    if strategy.start_method == "popen":
        return PopenLauncher(
            environment,
            strategy.num_processes,
            strategy.num_nodes,
            min_learners=strategy.min_learners,
            report=report,
            max_restarts=strategy.max_restarts,
        )
    return SpawnLauncher(strategy, strategy.start_method)


def pick_main_port(environment: ClusterEnvironment) -> None:
    """Where Lightning's own environment would pick ``MASTER_PORT`` (none set), pick it outside the ephemeral range:
    Lightning binds port 0, and that port can become some connection's source port before learner 0 binds it."""
    if type(environment) is LightningEnvironment and not {"MASTER_PORT", "STANDALONE_PORT"} & os.environ.keys():
        os.environ["MASTER_PORT"] = str(free_port())
