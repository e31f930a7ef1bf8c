"""The parameter server process: :class:`~lightning_rudra.protocol.Server` behind torch.distributed.rpc,
plus the shared epoch's pools (:mod:`lightning_rudra.epoch`) and the learners' rendezvous for collectives.

Handlers never block an RPC thread: whatever must wait (a hardsync round, a collective, the end of
training) returns a ``torch.futures.Future`` from an ``@rpc.functions.async_execution`` function, and the
push that completes the wait resolves it. Such waits have no time limit, since waiting for a slow learner is
not an error; instead every learner sends a heartbeat, and a learner silent for longer than the timeout is
lost: every wait fails at once with a message that names it.
The strategy starts it with :func:`lightning_rudra.client.start_server`.
"""

import argparse
import json
import os
import socket
import threading
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed.rpc as rpc
from torch.futures import Future

from lightning_rudra.epoch import EpochPlan, EpochPool
from lightning_rudra.optimizers import OptimizerSpec
from lightning_rudra.protocol import ProtocolConfig, Server, Stats
from lightning_rudra.rpc_world import init_rpc, quiet_peers_leaving, set_rpc_counters, shutdown_rpc
from lightning_rudra.shm import SharedNames, SharedWeights


def _fail(futures: list[Future], reason: Optional[str]) -> None:
    for future in futures:
        if not future.done():
            future.set_exception(RuntimeError(reason))


def _done(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


class ParameterServer:
    """A :class:`Server` shared by concurrent learners, plus a rendezvous for the strategy's collectives.

    A push reply is ``(status, staleness, lr_scale, params, buffers, clock)``: what became of the gradient
    and the rate of its optimizer's newest update (a fraction of the learners' rate), then the
    newest weights (flat) and their timestamp. hardsync replies wait for the end of the round. Learners that
    mapped the server's shared memory (:mod:`lightning_rudra.shm`) push ``grads=None`` (the gradient is in
    their buffer) and get ``None`` for the weights, which they read themselves.
    """

    def __init__(self, num_learners: int, timeout: float = 60.0) -> None:
        self.num_learners = num_learners
        self.timeout = timeout
        self.core: Optional[Server] = None
        self.lock = threading.Lock()
        self.registered: Future = Future()
        self.round_waiters: dict[int, list[tuple[Future, int, str, int]]] = {}  # (reply, learner, status, σ)
        self.gatherings: dict[int, tuple[Future, list[Any], set[int]]] = {}
        self.finished: set[int] = set()
        self.finish_waiters: list[Future] = []
        self.left: set[int] = set()
        self.all_left = threading.Event()
        self.pools: dict[int, EpochPool] = {}  # per train dataloader
        self.last_heard = {learner: time.monotonic() for learner in range(num_learners)}
        self.addresses: dict[int, str] = {}  # learner -> the address it reaches this server from
        self.silent: set[int] = set()  # learners lost to silence: they will not leave
        self.lost: Optional[str] = None  # why training cannot go on, once a learner is lost
        self.shared: Optional[SharedWeights] = None
        self.shared_names: Optional[SharedNames] = None
        self.shared_grads: dict[tuple[int, int], list[Any]] = {}
        self.shared_error: Optional[str] = None  # why shared memory could not be set up
        self.mapped: set[int] = set()  # learners that read and write the shared memory
        self.answered: set[int] = set()  # learners that said whether they could map it

    def register(self, config: ProtocolConfig, params, buffers, specs: list[OptimizerSpec],
                 stats: Optional[Stats], shared_memory: bool = True,
                 optimizer_states: Optional[list[dict[str, Any]]] = None) -> None:
        """Learner 0 hands over the initial weights, the optimizers and, on resume, the statistics and the
        optimizers' states: all in place before any learner pulls. With ``shared_memory`` the weights live in
        shared memory, or, if it cannot be allocated, in plain memory (the learners are told why)."""
        with self.lock:
            if self.core is not None:
                raise RuntimeError("the parameter server was registered twice")
            if shared_memory:
                try:
                    self.core = self._server_in_shared_memory(config, params, buffers, specs, stats)
                except OSError as error:
                    self.shared_error = str(error)
            if self.core is None:
                self.core = Server(config, params, buffers, specs, stats)
            self.core.load_optimizer_states(optimizer_states or [])
        self.registered.set_result(None)

    def _server_in_shared_memory(self, config: ProtocolConfig, params, buffers, specs: list[OptimizerSpec],
                                 stats: Optional[Stats]) -> Server:
        shared = SharedWeights(socket.gethostname())  # allocation failures unlink what was made and raise
        core = Server(config, params, buffers, specs, stats, shared)
        self.shared_grads = shared.allocate_grads(self.num_learners, core.grad_layouts)
        self.shared_names = shared.names(core.flat_params, core.flat_buffers, self.shared_grads)
        self.shared = shared
        return core

    def attach(self, learner: int) -> Future:
        """Once registered: the shared memory's names (None without it), and why it is missing, if it failed."""
        self._check_alive()
        return self.registered.then(lambda registered: registered.wait() or (self.shared_names, self.shared_error))

    def attached(self, learner: int, mapped: bool) -> None:
        """A learner says whether it mapped the shared memory. Once all have, the files go: nothing is left
        in /dev/shm even if a process is killed later, and the mappings stay valid."""
        with self.lock:
            if mapped:
                self.mapped.add(learner)
            self.answered.add(learner)
            if self.shared is not None and len(self.answered) == self.num_learners:
                self.shared.unlink()

    def pull(self) -> Future:
        self._check_alive()
        return self.registered.then(lambda registered: registered.wait() or self._locked(self.core.pull))

    def push(self, learner: int, optimizer: int, grads, has_grad, timestamp: int, hparams, buffers) -> Future:
        with self.lock:
            self._check_alive()
            core = self._core()
            if grads is None:
                grads = self._shared_gradient(learner, optimizer)
            result = core.push(learner, optimizer, grads, has_grad, timestamp, hparams, buffers)
            in_round = core.config.protocol == "hardsync" and not result.closed
            if in_round:
                reply: Future = Future()
                self.round_waiters.setdefault(optimizer, []).append((reply, learner, result.status,
                                                                     result.staleness))
                failed = self._give_up_if_deadlocked()
            else:
                waiters = self.round_waiters.pop(optimizer, []) if result.closed else []
                weights = self._weights([learner] + [w[1] for w in waiters])
                lr_scale = self._lr_scale(optimizer)
        if in_round:
            _fail(failed, self.lost)
            return reply
        for future, _, status, staleness in waiters:
            future.set_result((status, staleness, lr_scale, *weights))
        return _done((result.status, result.staleness, lr_scale, *weights))

    def _lr_scale(self, optimizer: int) -> float:
        update = self._core().last_updates[optimizer]
        return update.lr_scale if update is not None else 1.0

    def _shared_gradient(self, learner: int, optimizer: int) -> list[Any]:
        if learner not in self.mapped or (learner, optimizer) not in self.shared_grads:
            raise ValueError(f"learner {learner} pushed its gradient for optimizer {optimizer} through shared "
                             "memory, but it has not mapped the server's shared memory.")
        grads = self.shared_grads[(learner, optimizer)]
        config = self._core().config
        if config.protocol == "softsync" and config.gradients_per_update > 1:
            return [g.clone() for g in grads]  # it waits for the next update, after this learner's next push
        return grads  # applied before the learner gets its reply, and so before it writes the buffer again

    def _weights(self, learners: list[int]) -> tuple:
        """What to send back with a reply: nothing but the clock if every learner reads shared memory."""
        core = self._core()
        if set(learners) <= self.mapped:
            return None, None, core.clock
        return core.pull()

    def finish(self, learner: int) -> Future:
        """A learner is done training; resolves, once all are, with the final weights."""
        with self.lock:
            self._check_alive()
            core = self._core()
            closed = core.finish(learner)
            released = [(w, self._lr_scale(i)) for i in closed for w in self.round_waiters.pop(i, [])]
            weights = self._weights(list(range(self.num_learners)))
            self.finished.add(learner)
            future: Future = Future()
            self.finish_waiters.append(future)
            done = self.finished == set(range(self.num_learners))
            everyone = self.finish_waiters if done else []
        for (waiter, _, status, staleness), lr_scale in released:
            waiter.set_result((status, staleness, lr_scale, *weights))
        for waiter in everyone:
            waiter.set_result(weights)
        return future

    def gather(self, sequence: int, learner: int, obj: Any) -> Future:
        """The ``sequence``-th collective of every learner: resolves with the list of all their objects."""
        with self.lock:
            self._check_alive()
            future, objs, seen = self.gatherings.setdefault(sequence, (Future(), [None] * self.num_learners, set()))
            objs[learner] = obj
            seen.add(learner)
            complete = len(seen) == self.num_learners
            if complete:
                del self.gatherings[sequence]
            failed = [] if complete else self._give_up_if_deadlocked()
        if complete:
            future.set_result(objs)
        _fail(failed, self.lost)
        return future

    def draw(self, pool: int, epoch: int, learner: int, plan: EpochPlan, want: int) -> tuple[Optional[Any], int, str]:
        """The next batches of the shared epoch (see :meth:`EpochPool.draw`) of train dataloader ``pool``."""
        with self.lock:
            core = self._core()
            if pool not in self.pools:
                self.pools[pool] = EpochPool(plan, self.num_learners)
            indices, position, what = self.pools[pool].draw(epoch, learner, plan, want)
            if indices is not None and pool == 0:
                count = -(-len(indices) // plan.batch_size)
                core.stats.batches[learner] = core.stats.batches.get(learner, 0) + count
            return indices, position, what

    def stop_drawing(self, learner: int) -> None:
        """``learner`` stops training: every pool of the shared epoch is spent (:meth:`EpochPool.stop`)."""
        with self.lock:
            for pool in self.pools.values():
                pool.stop()

    def check_caller(self, method: str, learner: Any) -> None:
        """A call from a learner this run does not know, or no longer counts, is refused before it changes
        anything: a learner lost to silence (a stalled process that wakes up) is not merged back in."""
        if not isinstance(learner, int) or learner not in range(self.num_learners):
            raise ValueError(f"{method} from learner {learner!r} refused: this run's learners are "
                             f"0..{self.num_learners - 1}")
        if learner in self.silent:
            raise RuntimeError(f"{method} from learner {learner} refused: it was silent for more than "
                               f"{self.timeout:g} s (rpc_timeout) and counted as lost, and it cannot rejoin this run")
        if learner in self.left:
            raise RuntimeError(f"{method} from learner {learner} refused: it has left this run")
        if method == "push" and learner in self.finished:
            raise RuntimeError(f"push from learner {learner} refused: it has finished training")

    def heartbeat(self, learner: int, address: str) -> None:
        self.last_heard[learner] = time.monotonic()
        self.addresses[learner] = address

    def watch(self) -> None:
        """Runs in its own thread: a learner that has not left and has been silent for longer than the timeout
        is lost, and every wait fails, now and later, with a message that says which learner and why."""
        while self.lost is None and not self.all_left.is_set():
            time.sleep(min(1.0, self.timeout / 4))
            now = time.monotonic()
            with self.lock:
                silent = sorted(learner for learner, heard in self.last_heard.items()
                                if learner not in self.left and now - heard > self.timeout)
                if not silent:
                    continue
                self.silent.update(silent)
                self._check_all_left()
                where = self.addresses.get(silent[0], "a host it never named")
                failed = self._give_up(f"learner {silent[0]} (on {where}) has not been heard from for more than "
                                       f"{self.timeout:g} s (rpc_timeout): its process died or hung, or its host "
                                       "cannot be reached, and training cannot go on without it")
            _fail(failed, self.lost)

    def leave(self, learner: int) -> None:
        with self.lock:
            self.left.add(learner)
            self._check_all_left()
            failed = []
            if self.core is not None and learner in self.core.active and self.lost is None:
                failed = self._give_up(f"learner {learner} left before training ended (it stopped with an error: see "
                                       "its own output), and training cannot go on without it")
        _fail(failed, self.lost)

    def _check_all_left(self) -> None:
        """Every learner has left, or is lost to silence and never will: this server's work is over."""
        if len(self.left | self.silent) == self.num_learners:
            self.all_left.set()

    def _give_up(self, reason: str) -> list[Future]:
        """Training cannot go on: every wait fails, now and later, with ``reason``. Called under the lock; the
        caller fails the returned futures once it has released it (:func:`_fail`)."""
        self.lost = reason
        waiters = [w[0] for ws in self.round_waiters.values() for w in ws]
        waiters += [f for f, _, _ in self.gatherings.values()] + self.finish_waiters
        self.round_waiters, self.gatherings, self.finish_waiters = {}, {}, []
        return waiters + ([self.registered] if not self.registered.done() else [])

    def _give_up_if_deadlocked(self) -> list[Future]:
        """Hardsync: a learner waiting at a collective can never push the gradient that a round waits for, and
        the learner waiting in the round can never join the collective. Called under the lock."""
        in_round = sorted({w[1] for ws in self.round_waiters.values() for w in ws})
        at_collective = sorted({learner for _, _, seen in self.gatherings.values() for learner in seen}
                               & (self.core.active if self.core is not None else set()))
        if not (in_round and at_collective):
            return []
        return self._give_up(
            f"learner {at_collective[0]} waits for the others at a collective (validation, a value logged with "
            f"sync_dist, a checkpoint, the end of an epoch) while learner {in_round[0]} waits in a hardsync round for "
            "its gradient, so neither can go on. Under hardsync every learner must train on the same number of "
            "batches per epoch, and theirs differ: an IterableDataset, or a sampler of your own, that yields a "
            "different number of batches on each learner? Make every learner's stream yield the same number of "
            "batches, or use protocol='softsync' or 'async', whose learners do not wait for each other.")

    def stats(self) -> dict[str, Any]:
        return self._locked(lambda: self._core().stats.to_dict())

    def snapshot(self) -> tuple:
        """What a checkpoint holds, all of one clock: weights and buffers (flat), the clock, every optimizer's
        state and the statistics."""
        def take() -> tuple:
            core = self._core()
            params, buffers, clock = core.pull()
            states = [core.optimizer_state(i) for i in range(len(core.optimizers))]
            return params, buffers, clock, states, core.stats.to_dict()
        return self._locked(take)

    def optimizer_state(self, optimizer: int) -> dict[str, Any]:
        return self._locked(lambda: self._core().optimizer_state(optimizer))

    def load_optimizer_state(self, optimizer: int, state: dict[str, Any]) -> None:
        self._locked(lambda: self._core().load_optimizer_state(optimizer, state))

    def _check_alive(self) -> None:
        if self.lost is not None:
            raise RuntimeError(self.lost)

    def _core(self) -> Server:
        if self.core is None:
            raise RuntimeError("the parameter server holds no weights yet: learner 0 has not registered the model")
        return self.core

    def _locked(self, fn: Callable[[], Any]) -> Any:
        with self.lock:
            return fn()


# The RPC entry points run in the server process, on its one ParameterServer.
_server: Optional[ParameterServer] = None


# What a learner may call, and where the calling learner is among the arguments (None: no learner argument)
ENTRY_POINTS: dict[str, Optional[int]] = {
    "register": None, "attach": 0, "attached": 0, "pull": None, "push": 0, "finish": 0, "gather": 1, "draw": 2,
    "stop_drawing": 0, "heartbeat": 0, "leave": 0, "stats": None, "snapshot": None, "optimizer_state": None,
    "load_optimizer_state": None,
}


def _entry(method: str, args: tuple) -> Callable:
    """The server's method for a call from a learner, once the call is checked: nothing changes before."""
    if method not in ENTRY_POINTS:
        raise ValueError(f"{method!r} is not a call the parameter server answers: expected one of "
                         f"{', '.join(sorted(ENTRY_POINTS))}")
    position = ENTRY_POINTS[method]
    if position is not None:
        _server.check_caller(method, args[position] if position < len(args) else None)
    return getattr(_server, method)


def _call(method: str, *args: Any) -> Any:
    return _entry(method, args)(*args)


@rpc.functions.async_execution
def _call_async(method: str, *args: Any) -> Future:
    return _entry(method, args)(*args)  # raising here, before any future, reaches the caller


def _exit_when_orphaned(parent_pid: int) -> None:
    """The learner that started this server died: nobody will ever ask us to stop."""
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    _release_shared_memory()
    os._exit(3)


def _release_shared_memory() -> None:
    if _server is not None and _server.shared is not None:
        _server.shared.unlink()


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description="lightning_rudra parameter server (started by RudraStrategy)")
    parser.add_argument("--init-method", required=True, help="tcp://host:port of the learners' RPC rendezvous")
    parser.add_argument("--rpc-counters", type=json.loads, required=True, help="see rpc_world.rpc_counters")
    parser.add_argument("--learners", type=int, required=True)
    parser.add_argument("--timeout", type=float, required=True,
                        help="seconds, for every RPC call that does not wait for other learners, and for a "
                             "learner's silence before it counts as lost")
    parser.add_argument("--parent-pid", type=int, required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, min(4, (os.cpu_count() or 1) // 2)))
    threading.Thread(target=_exit_when_orphaned, args=(args.parent_pid,), daemon=True).start()
    global _server
    _server = ParameterServer(args.learners, args.timeout)
    set_rpc_counters(args.rpc_counters)
    init_rpc(None, args.learners, args.init_method, args.timeout)
    _server.last_heard = {learner: time.monotonic() for learner in range(args.learners)}  # all have just joined
    threading.Thread(target=_server.watch, daemon=True).start()
    # Learners leave at the end of every Trainer stage; if learner 0 dies instead, _exit_when_orphaned ends us.
    with quiet_peers_leaving():
        try:
            _server.all_left.wait()
        finally:
            _release_shared_memory()
        shutdown_rpc()

