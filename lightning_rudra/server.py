"""The parameter server process: :class:`~lightning_rudra.protocol.Server` behind torch.distributed.rpc.

Handlers never block an RPC thread: whatever must wait (a hardsync round, a collective, the end of
training) returns a ``torch.futures.Future`` from an ``@rpc.functions.async_execution`` function, and the
push that completes the wait resolves it.
The strategy starts it with :func:`lightning_rudra.client.start_server`.
"""

import argparse
import json
import os
import threading
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed.rpc as rpc
from torch.futures import Future

from lightning_rudra.protocol import OptimizerSpec, ProtocolConfig, Server, Stats

SERVER_NAME = "server"


def learner_name(rank: int) -> str:
    return f"learner{rank}"


def _done(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


class ParameterServer:
    """A :class:`Server` shared by concurrent learners, plus a rendezvous for the strategy's collectives.

    A push reply is ``(status, staleness, params, buffers, clock)``: what became of the gradient, then the
    newest weights (flat) and their timestamp. hardsync replies wait for the end of the round.
    """

    def __init__(self, num_learners: int) -> None:
        self.num_learners = num_learners
        self.core: Optional[Server] = None
        self.lock = threading.Lock()
        self.registered: Future = Future()
        self.round_waiters: dict[int, list[tuple[Future, str, int]]] = {}
        self.gatherings: dict[int, tuple[Future, list[Any], set[int]]] = {}
        self.finished: set[int] = set()
        self.finish_waiters: list[Future] = []
        self.left: set[int] = set()
        self.all_left = threading.Event()

    def register(self, config: ProtocolConfig, params, buffers, specs: list[OptimizerSpec],
                 stats: Optional[Stats]) -> None:
        """Learner 0 hands over the initial weights, the optimizers and, on resume, the statistics."""
        with self.lock:
            if self.core is not None:
                raise RuntimeError("the parameter server was registered twice")
            self.core = Server(config, params, buffers, specs, stats)
        self.registered.set_result(None)

    def pull(self) -> Future:
        return self.registered.then(lambda _: self._locked(self.core.pull))

    def push(self, learner: int, optimizer: int, grads, has_grad, timestamp: int, hparams, buffers) -> Future:
        with self.lock:
            core = self._core()
            result = core.push(learner, optimizer, grads, has_grad, timestamp, hparams, buffers)
            if core.config.protocol == "hardsync" and not result.closed:
                future: Future = Future()
                self.round_waiters.setdefault(optimizer, []).append((future, result.status, result.staleness))
                return future
            weights = core.pull()
            waiters = self.round_waiters.pop(optimizer, []) if result.closed else []
        for future, status, staleness in waiters:
            future.set_result((status, staleness, *weights))
        return _done((result.status, result.staleness, *weights))

    def finish(self, learner: int) -> Future:
        """A learner is done training; resolves, once all are, with the final weights."""
        with self.lock:
            core = self._core()
            closed = core.finish(learner)
            weights = core.pull()
            released = [w for i in closed for w in self.round_waiters.pop(i, [])]
            self.finished.add(learner)
            future: Future = Future()
            self.finish_waiters.append(future)
            done = self.finished == set(range(self.num_learners))
            everyone = self.finish_waiters if done else []
        for waiter, status, staleness in released:
            waiter.set_result((status, staleness, *weights))
        for waiter in everyone:
            waiter.set_result(weights)
        return future

    def gather(self, sequence: int, learner: int, obj: Any) -> Future:
        """The ``sequence``-th collective of every learner: resolves with the list of all their objects."""
        if learner not in range(self.num_learners):
            raise ValueError(f"learner {learner!r} is unknown: expected 0..{self.num_learners - 1}")
        with self.lock:
            future, objs, seen = self.gatherings.setdefault(sequence, (Future(), [None] * self.num_learners, set()))
            objs[learner] = obj
            seen.add(learner)
            complete = len(seen) == self.num_learners
            if complete:
                del self.gatherings[sequence]
        if complete:
            future.set_result(objs)
        return future

    def leave(self, learner: int) -> None:
        with self.lock:
            self.left.add(learner)
            if len(self.left) == self.num_learners:
                self.all_left.set()

    def stats(self) -> dict[str, Any]:
        return self._locked(lambda: self._core().stats.to_dict())

    def optimizer_state(self, optimizer: int) -> dict[str, Any]:
        return self._locked(lambda: self._core().optimizer_state(optimizer))

    def load_optimizer_state(self, optimizer: int, state: dict[str, Any]) -> None:
        self._locked(lambda: self._core().load_optimizer_state(optimizer, state))

    def _core(self) -> Server:
        if self.core is None:
            raise RuntimeError("the parameter server holds no weights yet: learner 0 has not registered the model")
        return self.core

    def _locked(self, fn: Callable[[], Any]) -> Any:
        with self.lock:
            return fn()


# The RPC entry points run in the server process, on its one ParameterServer.
_server: Optional[ParameterServer] = None


def _call(method: str, *args: Any) -> Any:
    return getattr(_server, method)(*args)


@rpc.functions.async_execution
def _call_async(method: str, *args: Any) -> Future:
    return getattr(_server, method)(*args)  # raising here, before any future, reaches the caller


def _exit_when_orphaned(parent_pid: int) -> None:
    """The learner that started this server died: nobody will ever ask us to stop."""
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(3)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description="lightning_rudra parameter server (started by RudraStrategy)")
    parser.add_argument("--init-method", required=True, help="tcp://host:port of the learners' RPC rendezvous")
    parser.add_argument("--rpc-counters", type=json.loads, required=True, help="see client.rpc_counters")
    parser.add_argument("--learners", type=int, required=True)
    parser.add_argument("--timeout", type=float, required=True, help="seconds, for every RPC call")
    parser.add_argument("--parent-pid", type=int, required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, min(4, (os.cpu_count() or 1) // 2)))
    threading.Thread(target=_exit_when_orphaned, args=(args.parent_pid,), daemon=True).start()
    from lightning_rudra.client import init_rpc, set_rpc_counters, shutdown_rpc

    global _server
    _server = ParameterServer(args.learners)
    set_rpc_counters(args.rpc_counters)
    init_rpc(SERVER_NAME, args.learners, args.learners + 1, args.init_method, args.timeout)
    # Learners leave at the end of every Trainer stage; if learner 0 dies instead, _exit_when_orphaned ends us.
    _server.all_left.wait()
    shutdown_rpc()

