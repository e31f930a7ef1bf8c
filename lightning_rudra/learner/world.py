"""A learner joining and leaving one stage's RPC world: checking the rendezvous' port, starting the server
processes it is the starter of, an elastic run's incarnations, and, when the servers run on server nodes, the
rendezvous' store kept by learner 0. Nothing here knows about Lightning."""

import json
import subprocess
import time
from typing import Optional, Sequence

import torch.distributed as dist

from lightning_rudra.learner.client import LearnerClient
from lightning_rudra.server import process as _server
from lightning_rudra.server.membership import ended, this_process
from lightning_rudra.transport.elastic import LearnerId, RunStore, forget_before_joining, job_id, run_at
from lightning_rudra.transport.rpc_world import (
    JOIN_MARGIN_S,
    check_port_free,
    init_rpc,
    publish_rpc_counters,
    rendezvous_store,
    set_rpc_counters,
    shutdown_rpc,
    withdraw_rpc_counters,
)

_COUNTING_S = 10.0  # beyond rpc_timeout, for a busy server to count a silent learner lost
# learner 0's stores of the rendezvous (host, port), made at the first stage that meets there with learner_store and
# kept for the process's life: every later stage meets in the same store (keys apart by torch's RPC init counter)
_stores: dict[tuple[str, int], dist.TCPStore] = {}


def join(
    rank: int,
    num_learners: int,
    host: str,
    port: int,
    timeout: float,
    min_learners: Optional[int] = None,
    starters: Sequence[Optional[int]] = (0,),
    comeback: float = 0.0,
    learner_store: bool = False,
) -> tuple[list[LearnerClient], list[subprocess.Popen]]:
    """Join the RPC world of ``num_learners`` learners and one server process per entry of ``starters`` (the
    learner that starts it, on its host; learner 0 starts the first, which hosts the rendezvous, and checks the
    port). Returns a client per server and the server processes this learner started. With ``min_learners`` the
    world is elastic: a process for a learner that was lost takes its place (its clients' ``rank`` carries a
    nonzero incarnation), finds the servers it would start running (they outlive the learner that started them),
    and must then ask each server to rejoin; ``comeback``: seconds the servers wait for lost learners to come back
    when fewer than ``min_learners`` are left. A starter None: that server runs on a server node, which starts it
    itself. ``learner_store`` (a run with server nodes, every stage): learner 0 keeps the rendezvous' store
    (:func:`_keep_store`), which every process joins as a client."""
    init_method = f"tcp://{host}:{port}"
    processes = []
    incarnation = 0
    try:
        store: Optional[RunStore] = None
        if rank == 0 and learner_store:
            _keep_store(host, port, timeout, publish=None in starters)
        elif rank == 0:
            store, incarnation = _port_or_run(host, port, timeout, elastic=min_learners is not None)
        elif min_learners is not None:
            store = RunStore(host, port, timeout)
            incarnation = _incarnation(store, rank, f"{host}:{port}")
        for shard, starter in enumerate(starters):
            if starter == rank and not incarnation:
                processes.append(
                    _server.start_server(
                        init_method,
                        num_learners,
                        timeout,
                        min_learners,
                        shard=shard,
                        starters=starters,
                        comeback=comeback,
                        learner_store=learner_store,
                    )
                )
        if min_learners is not None and store is None:  # learner 0 of a new run: its first server hosts the store
            store = RunStore(host, port, timeout)
        if store is not None and incarnation:
            forget_before_joining(store, rank)
        try:
            init_rpc(
                rank,
                num_learners,
                init_method,
                timeout,
                len(starters),
                elastic=store is not None,
                incarnation=incarnation,
                learner_store=learner_store,
            )
        except RuntimeError as error:
            if not learner_store:
                raise
            raise RuntimeError(
                f"learner {rank}: the {num_learners} learners and the {len(starters)} server(s) of the server nodes did "
                f"not all meet at {host}:{port} within {timeout + JOIN_MARGIN_S:g} s (rpc_timeout + {JOIN_MARGIN_S:g}): "
                "start every server node (NODE_RANK num_nodes and up) and every learner node with the same script, "
                f"MASTER_ADDR and MASTER_PORT ({error})"
            ) from error
        if store is not None and not incarnation:
            store.arrive(num_learners + len(starters))
    except BaseException:
        for process in processes:
            process.kill()
            process.wait()
        raise
    hosts = [_where(starter, host) for starter in starters]
    learner = LearnerId(rank, incarnation)
    return [LearnerClient(learner, timeout, where, shard, host) for shard, where in enumerate(hosts)], processes


def _where(starter: Optional[int], host: str) -> str:
    """Where a server runs, as far as a learner knows before its heartbeats say it exactly."""
    if starter is None:
        return "a server node"
    return host if starter == 0 else f"the host of learner {starter}"


def _keep_store(host: str, port: int, timeout: float, publish: bool) -> None:
    """Learner 0's store of the rendezvous at host:port (the servers of server nodes, which start on their own, join
    it), made at the first stage that meets there; with ``publish`` (servers on server nodes in this stage), this
    process's RPC counters in it: a server node's new server process starts from them. :func:`leave` takes them out
    again, before the servers can end, so that a server node's next stage waits for its own."""
    if (host, port) not in _stores:
        _stores[host, port] = rendezvous_store(host, port, timeout)
    if publish:
        publish_rpc_counters(_stores[host, port])


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
    processes: Sequence[subprocess.Popen],
    timeout: float,
    error: Optional[str] = None,
    elastic: bool = False,
) -> None:
    """Leave the RPC world; a learner that started server processes then waits (bounded) for them to exit, unless
    it failed in an ``elastic`` run: there the servers outlive it, for the others and for its new process. Learner 0
    first takes this stage's RPC counters out of its stores (a server node's next stage must not read them)."""
    for store in _stores.values():
        withdraw_rpc_counters(store)
    for client in clients:
        try:
            client.leave(error)
        except Exception:
            pass  # the server is gone, or went as this learner left last: nothing is left to say to it
    shutdown_rpc()
    for process in processes if error is None or not elastic else []:
        _server.stop_server(process, timeout)
