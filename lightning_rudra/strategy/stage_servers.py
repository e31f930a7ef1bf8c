"""The servers of one Trainer stage, as the strategy meets them: where the learners meet (the port, under
torchrun through its store), who starts which server process, telling them of a learner the launcher saw end,
and leaving them when the stage ends (agreeing on the next stage's port first)."""

import os
from subprocess import Popen
from typing import Any, Callable, Optional

from lightning_fabric.plugins import ClusterEnvironment

from lightning_rudra.learner.client import LearnerClient, join, leave
from lightning_rudra.strategy.launchers.popen import PopenLauncher
from lightning_rudra.transport.rpc_world import free_port, port_from_agent_store, quiet_peers_leaving
from lightning_rudra.core.stats import Stats

# Where the learners meet for the next stage in these processes, agreed at the end of the last one. Of the process,
# not of a strategy: a second Trainer in a popen script is a later stage in the same processes, and on the first
# stage's port a fast learner would join that stage's rendezvous while its server process is still closing it.
_next_port: Optional[int] = None


class StageServers:
    """Mixed into :class:`~lightning_rudra.RudraStrategy`: its RPC world for a stage."""

    cluster_environment: Optional[ClusterEnvironment]
    global_rank: int
    is_global_zero: bool
    num_learners: int
    num_nodes: int
    num_processes: int
    num_servers: Optional[int]
    min_learners: Optional[int]
    rpc_timeout: float
    stats: Optional[Stats]
    _launcher: Any
    _failed: Optional[str]  # this stage failed on this learner: why
    _rendezvous: int  # stages met through torchrun's store
    _gather: Callable[[Any], dict[int, Any]]  # ServerCollectives'

    def _reset_stage_servers(self) -> None:
        self._clients: list[LearnerClient] = []  # one per server process
        self._client: Optional[LearnerClient] = None  # the first server's: collectives, the shared epoch
        self._server_processes: list[Popen] = []  # those this learner started

    def _join_servers(self) -> None:
        """Meet the other learners and the servers; the learners that start a server start it first."""
        assert self.cluster_environment is not None
        env = self.cluster_environment
        global _next_port
        agreed, _next_port = _next_port, None  # a stage that fails agrees on none: the next meets on main_port
        port = agreed or env.main_port
        if agreed is None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            self._rendezvous += 1  # the same count on every learner: one per stage
            key = f"lightning_rudra/port/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{self._rendezvous}"
            port = port_from_agent_store(self.global_rank, env.main_address, port, self.rpc_timeout, key)
        self._clients, self._server_processes = join(self.global_rank, self.num_learners, env.main_address, port,
                                                     self.rpc_timeout, self.min_learners, self._server_starters())
        self._client = self._clients[0]

    def _server_starters(self) -> list[int]:
        """Per server process, the learner that starts it: the first learner of node s mod num_nodes."""
        return [(shard % self.num_nodes) * self.num_processes for shard in range(self.num_servers or self.num_nodes)]

    def _report_lost(self, learner: int, why: str) -> None:
        """The launcher (in this learner's process) saw ``learner``'s process end."""
        for client in self._clients:
            try:
                client.report(learner, why)
            except Exception:  # the server is gone or refused: this run's own errors say what happened
                pass

    def _leave_servers(self) -> None:
        """Every learner leaves each server (saying why if this stage failed here); a popen launcher ends the
        learners lost and still running."""
        with quiet_peers_leaving():
            if self._failed is None:
                self._agree_on_next_port()
            leave(self._clients, self._server_processes, min(self.rpc_timeout, 30.0), self._failed)
        if isinstance(self._launcher, PopenLauncher) and self.stats is not None:
            self._launcher.end_lost(sorted(self.stats.lost))
        self._reset_stage_servers()

    def _agree_on_next_port(self) -> None:
        """A later stage in the same processes (popen: ``fit`` then ``test``, or a second Trainer) must not meet
        on this stage's port: a fast learner could reach the old rendezvous while learner 0 is still closing it."""
        global _next_port
        try:
            _next_port = self._gather(free_port() if self.is_global_zero else None)[0]
        except Exception:  # a peer is gone: this run is over anyway
            _next_port = None
