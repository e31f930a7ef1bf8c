"""The servers of one Trainer stage, as the strategy meets them: where the learners meet (the port, under
torchrun through its store), who starts which server process, telling them of a learner the launcher saw end,
and leaving them when the stage ends (agreeing on the next stage's port first)."""

import os
from typing import Optional

from lightning_fabric.plugins import ClusterEnvironment

from lightning_rudra.learner.client import LearnerClient
from lightning_rudra.learner.world import join, leave
from lightning_rudra.server.launch import ServerProcess
from lightning_rudra.transport.elastic import incarnation_of
from lightning_rudra.transport.rpc_world import StageWorld, free_port, port_from_agent_store, quiet_peers_leaving

REJOIN_WAIT_S = 60.0  # a restarted process's back-off (<= 10 s), start and imports (seconds, more when busy)


class NextStagePort:
    """Where the learners meet for the next stage in these processes, agreed at the end of the last one.
    Process-wide by need (:data:`NEXT_STAGE_PORT`), not of a strategy: a second Trainer in a popen script is a later
    stage in the same processes, with a strategy of its own, and on the first stage's port a fast learner would join
    that stage's rendezvous while its server process is still closing it."""

    def __init__(self) -> None:
        self._port: Optional[int] = None

    def take(self) -> Optional[int]:
        """The agreed port, once: a stage that fails agrees on none, and the next meets on ``main_port``."""
        port, self._port = self._port, None
        return port

    def agree(self, port: Optional[int]) -> None:
        self._port = port


NEXT_STAGE_PORT = NextStagePort()  # of the process (see the class)


class StageServers:
    """The RPC world of :class:`~lightning_rudra.RudraStrategy` for one stage: the clients of the server processes,
    those this learner started, and how many stages met through torchrun's store. One object for the strategy's
    life (its launcher reports lost learners to it), emptied at the end of each stage."""

    def __init__(self, rpc_timeout: float, min_learners: Optional[int], max_restarts: int = 0) -> None:
        """The strategy's options for every stage: ``rpc_timeout``, ``min_learners`` (an elastic run) and
        ``max_restarts`` (the launcher restarts lost learners, which the servers then await back)."""
        self.rpc_timeout, self.min_learners, self.max_restarts = rpc_timeout, min_learners, max_restarts
        self.rendezvous = 0  # stages met through torchrun's store: the same count on every learner
        self.reset()

    def reset(self) -> None:
        self.clients: list[LearnerClient] = []  # one per server process
        self.client: Optional[LearnerClient] = None  # the first server's: collectives, the shared epoch
        self.processes: list[ServerProcess] = []  # the server processes this learner started
        self.elastic = False  # min_learners: the servers outlive the learners that started them

    def join(
        self,
        env: ClusterEnvironment,
        rank: int,
        num_learners: int,
        started_by: list[Optional[int]],
        learner_store: bool = False,
    ) -> None:
        """Meet the other learners and the servers; the learners that start a server start it first.

        Args:
            env: Lightning's cluster environment: where the learners meet (``main_address``, ``main_port``).
            rank: this learner's number.
            num_learners: λ.
            started_by: per server process, the learner that starts it (None: a server node does).
            learner_store: a run with server nodes: every stage meets on ``MASTER_PORT``, in learner 0's store,
                which lives as long as its process.
        """
        agreed = NEXT_STAGE_PORT.take()
        port = env.main_port if learner_store else agreed or env.main_port
        if agreed is None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            port = self._port_from_torchrun(rank, env, port)
        world = StageWorld(
            env.main_address,
            port,
            num_learners,
            self.rpc_timeout,
            tuple(started_by),
            self.min_learners,
            self._rejoin_wait(),
            learner_store,
        )
        self.clients, self.processes = join(rank, world)
        self.client = self.clients[0]
        self.elastic = world.elastic

    def _port_from_torchrun(self, rank: int, env: ClusterEnvironment, port: int) -> int:
        """Under torchrun, learner 0's free port for this stage, through torchrun's store."""
        self.rendezvous += 1
        # an elastic run's workers that torchrun restarted meet their servers again on the same port
        restart = "" if self.min_learners is not None else f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        key = f"lightning_rudra/port/{restart}{self.rendezvous}"
        return port_from_agent_store(rank, env.main_address, port, self.rpc_timeout, key)

    def _rejoin_wait(self) -> float:
        """Lost learners that will be restarted (``max_restarts``, or torchrun's ``--max-restarts``, which restarts
        every worker at once) are awaited back for ``REJOIN_WAIT_S`` more than ``rpc_timeout`` when fewer than
        ``min_learners`` are left."""
        torchrun_restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
        restarted = self.max_restarts or torchrun_restarts
        return self.rpc_timeout + REJOIN_WAIT_S if self.min_learners is not None and restarted else 0.0

    @property
    def rejoining(self) -> bool:
        """This process takes a lost learner's place (an elastic run's new process)."""
        return self.client is not None and incarnation_of(self.client.rank) > 0

    def report_lost(self, learner: int, why: str, process: tuple[str, int]) -> None:
        """The launcher (in this learner's process) saw ``learner``'s ``process`` (machine, pid) end."""
        for client in self.clients:
            try:
                client.report(learner, why, process)
            except Exception:  # the server is gone or refused: this run's own errors say what happened
                pass

    def leave(self, failed: Optional[str], is_global_zero: bool) -> None:
        """Every learner leaves each server, saying why if this stage failed here (``failed``)."""
        with quiet_peers_leaving():
            if failed is None:
                self._agree_on_next_port(is_global_zero)
            leave(self.clients, self.processes, min(self.rpc_timeout, 30.0), failed, self.elastic)
        self.reset()

    def _agree_on_next_port(self, is_global_zero: bool) -> None:
        """A later stage in the same processes (popen: ``fit`` then ``test``, or a second Trainer) must not meet
        on this stage's port: a fast learner could reach the old rendezvous while learner 0 is still closing it."""
        assert self.client is not None
        try:
            NEXT_STAGE_PORT.agree(self.client.gather(free_port() if is_global_zero else None)[0])
        except Exception:  # a peer is gone: this run is over anyway
            NEXT_STAGE_PORT.agree(None)
