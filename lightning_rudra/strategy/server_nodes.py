"""Server nodes: ``RudraStrategy(server_nodes=K)`` adds K nodes that run parameter servers and no learner (BytePS's
"spare CPU machines"). The job has ``num_nodes`` learner nodes, NODE_RANK 0 to num_nodes - 1, and K server nodes,
NODE_RANK num_nodes to num_nodes + K - 1, every node running the same script with Lightning's launcher. Under
``fit``, every server runs on a server node (server s on server node s mod K, started there by the node's own
process, :class:`ServerNodeLauncher`), none on the learner nodes; learner 0 keeps the rendezvous' store, which the
first server would otherwise host. A server node's ``fit`` returns, without training, when its servers end with the
stage. Other stages (``validate``, ``test``, ``predict``) train nothing: their one server runs on node 0 as without
server nodes, and on a server node they return at once. Every stage meets on ``MASTER_PORT``, in a store that learner
0 keeps for its process's life (:mod:`lightning_rudra.learner.world`), so a later ``fit`` (a second Trainer in the
same script) meets the server nodes' next ``fit`` there."""

import os
import time
from typing import Any, Callable, Optional

from lightning_fabric.plugins import ClusterEnvironment
from lightning_fabric.plugins.environments import LightningEnvironment
from pytorch_lightning.strategies.launchers.launcher import _Launcher
from pytorch_lightning.trainer.states import TrainerFn, TrainerStatus
from pytorch_lightning.utilities import rank_zero_info

from lightning_rudra.core.errors import ConfigurationError
from lightning_rudra.server.launch import NO_LEARNERS, RUN_FAILED, ServerProcess, start_server
from lightning_rudra.transport.rpc_world import StageWorld

_POLL_S = 0.2


def check_server_nodes(server_nodes: int, min_learners: Optional[int], simulate: Optional[int]) -> None:
    """The argument, as the strategy is built."""
    if isinstance(server_nodes, bool) or not isinstance(server_nodes, int) or server_nodes < 0:
        raise ConfigurationError(
            f"server_nodes={server_nodes!r} is not valid: expected an integer >= 0 (nodes that run only parameter "
            "servers, with NODE_RANK num_nodes to num_nodes + server_nodes - 1), or 0 for none."
        )
    if server_nodes and min_learners is not None:
        raise ConfigurationError(
            f"server_nodes={server_nodes} cannot be used with min_learners={min_learners}: an elastic run keeps its "
            "store in the first server, which a server node starts on its own. Leave min_learners unset, or set "
            "server_nodes=0 (servers beside the learners)."
        )
    if server_nodes and simulate:
        raise ConfigurationError(
            f"server_nodes={server_nodes} has no meaning with simulate={simulate}: simulated learners share one "
            "in-process server. Leave server_nodes at 0."
        )


def check_server_node_job(
    server_nodes: int, num_servers: Optional[int], num_nodes: int, environment: ClusterEnvironment
) -> None:
    """Once the Trainer is built: the node's rank, the launcher and the rendezvous' port suit server nodes."""
    if not server_nodes:
        return
    if num_servers is not None and num_servers < server_nodes:
        raise ConfigurationError(
            f"num_servers={num_servers} is fewer than server_nodes={server_nodes}: a server node would run no server. "
            f"Set num_servers >= {server_nodes} (server s runs on server node s mod {server_nodes}), or leave it unset "
            "(one per server node)."
        )
    if not isinstance(environment, LightningEnvironment):
        raise ConfigurationError(
            f"server_nodes={server_nodes} needs Lightning's own launcher (MASTER_ADDR, MASTER_PORT and NODE_RANK on "
            f"each node), not {type(environment).__name__}: a server node starts no learner, which torchrun and "
            "SLURM would count as one. Start every node with `MASTER_ADDR=... MASTER_PORT=... NODE_RANK=i python "
            "train.py`."
        )
    node_rank = environment.node_rank()
    if not 0 <= node_rank < num_nodes + server_nodes:
        raise ConfigurationError(
            f"NODE_RANK={node_rank} is outside this job of num_nodes={num_nodes} learner nodes and "
            f"server_nodes={server_nodes}: expected 0 to {num_nodes - 1} for a learner node, {num_nodes} to "
            f"{num_nodes + server_nodes - 1} for a server node."
        )
    if "MASTER_PORT" not in os.environ:
        raise ConfigurationError(
            f"server_nodes={server_nodes} needs MASTER_PORT set on every node (and MASTER_ADDR to node 0's address): "
            "without it each node picks a port of its own, and the server nodes never meet the learners."
        )


def servers_started_by(
    num_servers: Optional[int], num_nodes: int, num_processes: int, server_nodes: int = 0, fitting: bool = True
) -> list[Optional[int]]:
    """Per server process, the learner that starts it: the first learner of node s mod num_nodes; None for each
    server of a ``fit`` with server nodes (they start there). Other stages: one server, on node 0."""
    if server_nodes and fitting:
        return [None] * (num_servers or server_nodes)
    if server_nodes:
        return [0]
    return [(server % num_nodes) * num_processes for server in range(num_servers or num_nodes)]


def stage_started_by(strategy: Any) -> list[Optional[int]]:
    """A learner's :func:`servers_started_by` for the stage starting (``strategy.lightning_module`` is connected)."""
    fitting = strategy.lightning_module.trainer.state.fn == TrainerFn.FITTING
    return servers_started_by(
        strategy.num_servers, strategy.num_nodes, strategy.num_processes, strategy.server_nodes, fitting
    )


class ServerNodeLauncher(_Launcher):
    """A server node's launcher: under ``fit`` it starts the servers placed on this node (server s on server node
    s mod K), waits until they end with the stage (the learners leave, or one is lost: every wait of theirs is
    bounded by ``rpc_timeout``; a server whose learners never come ends after it), and returns without training.
    Other stages return at once: the learners run them with a server of their own."""

    def __init__(self, strategy: Any, environment: ClusterEnvironment) -> None:
        self.strategy = strategy
        self.environment = environment
        self.processes: list[ServerProcess] = []

    @property
    def is_interactive_compatible(self) -> bool:
        return True  # it starts servers with subprocess, not the learners' code

    @property
    def node(self) -> int:
        """This server node's number among the server nodes (0 to K - 1)."""
        return self.environment.node_rank() - self.strategy.num_nodes

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        if trainer.state.fn == TrainerFn.FITTING:
            self._serve()
        else:
            rank_zero_info(f"server node {self.node}: {trainer.state.fn.value} runs on the learner nodes alone")
        trainer.state.status = TrainerStatus.FINISHED
        return None

    def _serve(self) -> None:
        strategy, env = self.strategy, self.environment
        count = strategy.num_servers or strategy.server_nodes
        servers = [s for s in range(count) if s % strategy.server_nodes == self.node]
        learners = strategy.num_nodes * strategy.num_processes
        # every server of a fit with server nodes starts here or on another server node: none by a learner
        world = StageWorld(
            env.main_address, env.main_port, learners, strategy.rpc_timeout, (None,) * count, learner_store=True
        )
        try:
            for server in servers:
                self.processes.append(start_server(world, server, server_node=True))
            self._wait(servers, world)
        finally:
            self.kill(9)

    def _wait(self, servers: list[int], world: StageWorld) -> None:
        """Until every server of this node has ended; the first to fail ends the others and raises."""
        while True:
            codes = [process.poll() for process in self.processes]
            for server, code in zip(servers, codes):
                if code:
                    why = {
                        NO_LEARNERS: f"learner 0 never opened the rendezvous at {world.host}:{world.port} "
                        f"within rpc_timeout ({self.strategy.rpc_timeout:g} s): start the learner nodes with the same "
                        "MASTER_ADDR, MASTER_PORT, num_nodes and devices",
                        RUN_FAILED: "training failed on the learners (the line above says how; their output, why)",
                    }.get(code, "its output above says why")
                    raise RuntimeError(
                        f"server node {self.node} (NODE_RANK {self.environment.node_rank()}): parameter server "
                        f"{server} ended with exit code {code}: {why}."
                    )
            if all(code == 0 for code in codes):
                return
            time.sleep(_POLL_S)

    def kill(self, signum: Any) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait()
        self.processes = []
