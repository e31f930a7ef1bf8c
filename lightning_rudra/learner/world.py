"""A learner joining and leaving one stage's RPC world: checking the rendezvous' port, starting the server
processes it starts, an elastic run's incarnations, and, when the servers run on server nodes, the
rendezvous' store kept by learner 0. Nothing here knows about Lightning."""

import json
import time
from typing import Optional, Sequence

import torch.distributed as dist

from lightning_rudra.learner.client import LearnerClient
from lightning_rudra.server import launch
from lightning_rudra.server.membership import ended, this_process
from lightning_rudra.transport.elastic import LearnerId, RunStore, forget_before_joining, job_id, run_at
from lightning_rudra.transport.rpc_world import (
    JOIN_MARGIN_S,
    StageWorld,
    check_port_free,
    init_rpc,
    publish_rpc_counters,
    rendezvous_store,
    set_rpc_counters,
    shutdown_rpc,
    withdraw_rpc_counters,
)

_COUNTING_S = 10.0  # beyond rpc_timeout, for a busy server to count a silent learner lost


class RendezvousStores:
    """Learner 0's stores of the rendezvous (host, port), made at the first stage that meets there with
    ``learner_store`` and kept for the process's life: every later stage meets in the same store (keys apart by
    torch's RPC init counter). Process-wide by need (:data:`RENDEZVOUS_STORES`): a second Trainer in the same script
    has a strategy of its own, and the server nodes' next stage meets it in the same store."""

    def __init__(self) -> None:
        self._stores: dict[tuple[str, int], dist.TCPStore] = {}

    def keep(self, host: str, port: int, timeout: float, publish: bool) -> None:
        """The store at host:port, made at the first stage that meets there; with ``publish`` (servers on server
        nodes in this stage), this process's RPC counters in it: a server node's new server process starts from
        them. :meth:`withdraw` takes them out again, before the servers can end, so that a server node's next stage
        waits for its own."""
        if (host, port) not in self._stores:
            self._stores[host, port] = rendezvous_store(host, port, timeout)
        if publish:
            publish_rpc_counters(self._stores[host, port])

    def withdraw(self) -> None:
        """This stage's RPC counters out of every store (a server node's next stage must not read them)."""
        for store in self._stores.values():
            withdraw_rpc_counters(store)


RENDEZVOUS_STORES = RendezvousStores()  # learner 0's, for the process's life (see the class)


def join(rank: int, world: StageWorld) -> tuple[list[LearnerClient], list[launch.ServerProcess]]:
    """Join ``world`` as learner ``rank``, with one server process per entry of ``world.started_by`` (the learner
    that starts it, on its host; learner 0 starts the first, which hosts the rendezvous, and checks the port).
    Returns a client per server and the server processes this learner started. In an elastic world a process for
    a learner that was lost takes its place (its clients' ``rank`` carries a nonzero incarnation), finds the servers
    it would start running (they outlive the learner that started them), and must then ask each server to rejoin.
    A server started by None runs on a server node, which starts it itself. With ``world.learner_store`` (a run
    with server nodes, every stage) learner 0 keeps the rendezvous' store (:class:`RendezvousStores`), which every
    process joins as a client.

    Args:
        rank: this learner's number.
        world: the stage's world, the same on every learner.
    """
    processes: list[launch.ServerProcess] = []
    try:
        store, incarnation = _open_store(rank, world)
        if not incarnation:
            processes = _start_servers(rank, world)
        if world.elastic and store is None:  # learner 0 of a new run: its first server hosts the store
            store = RunStore(world.host, world.port, world.timeout)
        if store is not None and incarnation:
            forget_before_joining(store, rank)
        _meet(rank, world, incarnation)
        if store is not None and not incarnation:
            store.arrive(world.num_learners + world.num_servers)
    except BaseException:
        _kill(processes, world.timeout)
        raise
    learner = LearnerId(rank, incarnation)
    clients = [
        LearnerClient(learner, world.timeout, _where(started_by, world.host), server, world.host)
        for server, started_by in enumerate(world.started_by)
    ]
    return clients, processes


def _open_store(rank: int, world: StageWorld) -> tuple[Optional[RunStore], int]:
    """Before the servers start: learner 0 keeps the rendezvous' store (``learner_store``) or checks the port; in an
    elastic world, the run's store and this process's incarnation (0: one of the run's first processes)."""
    host, port, timeout = world.host, world.port, world.timeout
    if rank == 0 and world.learner_store:
        RENDEZVOUS_STORES.keep(host, port, timeout, publish=None in world.started_by)
        return None, 0
    if rank == 0:
        return _port_or_run(host, port, timeout, world.elastic)
    if world.elastic:
        store = RunStore(host, port, timeout)
        return store, _incarnation(store, rank, f"{host}:{port}")
    return None, 0


def _start_servers(rank: int, world: StageWorld) -> list[launch.ServerProcess]:
    """The server processes that learner ``rank`` starts, on its host."""
    processes: list[launch.ServerProcess] = []
    try:
        for server, started_by in enumerate(world.started_by):
            if started_by == rank:
                processes.append(launch.start_server(world, server))
    except BaseException:
        _kill(processes, world.timeout)
        raise
    return processes


def _kill(processes: Sequence[launch.ServerProcess], timeout: float) -> None:
    for process in processes:
        process.kill()
        launch.stop_server(process, timeout)


def _meet(rank: int, world: StageWorld, incarnation: int) -> None:
    """Join the RPC world; with server nodes, a failure to meet says what to start where."""
    try:
        init_rpc(world, rank, incarnation=incarnation)
    except RuntimeError as error:
        if not world.learner_store:
            raise
        raise RuntimeError(
            f"learner {rank}: the {world.num_learners} learners and the {world.num_servers} server(s) of the server "
            f"nodes did not all meet at {world.host}:{world.port} within {world.timeout + JOIN_MARGIN_S:g} s "
            f"(rpc_timeout + {JOIN_MARGIN_S:g}): start every server node (NODE_RANK num_nodes and up) and every "
            f"learner node with the same script, MASTER_ADDR and MASTER_PORT ({error})"
        ) from error


def _where(started_by: Optional[int], host: str) -> str:
    """Where a server runs (``started_by``: the learner that starts it), as far as a learner knows before its
    heartbeats say it exactly."""
    if started_by is None:
        return "a server node"
    return host if started_by == 0 else f"the host of learner {started_by}"


def _port_or_run(host: str, port: int, timeout: float, elastic: bool) -> tuple[Optional[RunStore], int]:
    """Learner 0 checks that the rendezvous' port is free. In an elastic run a process that takes lost learner 0's
    place finds it held by the run's first server: returns that run's store and this process's incarnation."""
    try:
        check_port_free(host, port)
        return None, 0
    except RuntimeError:
        store = run_at(host, port, timeout) if elastic else None
        if store is None or store.status(0)[0] == "new":  # not a run, or one that learner 0 never joined
            raise
        return store, _incarnation(store, 0, f"{host}:{port}")


def _incarnation(store: RunStore, rank: int, where: str) -> int:
    """0 for one of the run's first processes; a new number for a process that takes lost learner ``rank``'s place.
    Refuses one whose learner is alive, and one that belongs to another run."""
    # the server counts a process of its machine lost within about a second, one elsewhere within rpc_timeout
    deadline = time.monotonic() + store.timeout + _COUNTING_S
    while True:
        state, value = store.status(rank)
        if state == "lost":
            if store.read("job") != job_id():
                raise RuntimeError(
                    f"this process (job {job_id() or 'none'}) cannot take learner {rank}'s place in the run at {where}: "
                    f"that run belongs to job {store.read('job') or 'none'}. Check MASTER_ADDR and MASTER_PORT."
                )
            set_rpc_counters(store.read("rpc_counters"))
            return store.next_incarnation()
        if state == "new":
            if store.joined():
                raise RuntimeError(
                    f"the run at {where} is under way with all its learners, and learner {rank} was never lost there: "
                    "is this process part of another run (another job, MASTER_PORT or NODE_RANK)?"
                )
            return 0
        process = json.loads(value) or ["", 0]
        # the server may not have seen yet that the process it knows ended (a restart right after a crash): one of
        # this machine is refused at once if it runs; one elsewhere once the server had time to count it lost
        here = process[0] == this_process()[0]
        if (here and not ended(int(process[1]))) or time.monotonic() > deadline:
            raise RuntimeError(
                f"learner {rank} of the run at {where} is alive (process {process[1]}), so this process cannot take its "
                "place: start one only for a learner that was lost (see docs/rejoin.md)."
            )
        time.sleep(0.2)


def leave(
    clients: Sequence[LearnerClient],
    processes: Sequence[launch.ServerProcess],
    timeout: float,
    error: Optional[str] = None,
    elastic: bool = False,
) -> None:
    """Leave the RPC world; a learner that started server processes then waits (bounded) for them to exit, unless
    it failed in an ``elastic`` run: there the servers outlive it, for the others and for its new process. Learner 0
    first takes this stage's RPC counters out of its stores (a server node's next stage must not read them)."""
    RENDEZVOUS_STORES.withdraw()
    for client in clients:
        try:
            client.leave(error)
        except Exception:
            pass  # the server is gone, or went as this learner left last: nothing is left to say to it
    shutdown_rpc()
    for process in processes if error is None or not elastic else []:
        launch.stop_server(process, timeout)
