"""The parameter server's state over futures: :class:`~lightning_rudra.core.protocol.Server` shared by concurrent
learners, plus the shared epoch's pools (``shared_epochs.py``), its shared memory (``shared_side.py``), the learners'
rendezvous for collectives (``gatherings.py``), who is in the run (``membership.py``) and who comes back
(``rejoins.py``). No RPC here: :mod:`lightning_rudra.server.process` serves it.

Nothing blocks: whatever must wait (a hardsync round, a collective, the end of training) gets a
``torch.futures.Future`` that the call completing the wait resolves. Such waits have no time limit, since waiting
for a slow learner is not an error; instead every learner sends a heartbeat, and a learner whose process ended,
or that is silent for longer than the timeout, is lost: every wait fails at once with a message that names it, or,
with ``min_learners``, completes with the learners left (whether or not the model is registered yet: validate, test
and predict never register one). What the server has to say (a loss, a rejoin) it logs once the lock is released and
every wait is settled: writing to its stderr can fail or block, and must not stop the learners left.
"""

import logging
import threading
from typing import Any, Callable, Hashable, Optional, Sequence

from torch.futures import Future

from lightning_rudra.core.epoch import EpochPlan
from lightning_rudra.server.gatherings import Gatherings, deadlock
from lightning_rudra.server.membership import Membership
from lightning_rudra.core.optimizers import OptimizerSpec
from lightning_rudra.core.protocol import ProtocolConfig, Server
from lightning_rudra.core.compression import WeightDeltas
from lightning_rudra.core.update import PushReply
from lightning_rudra.server.rejoins import Rejoins
from lightning_rudra.server.shared_epochs import SharedEpochs
from lightning_rudra.transport.elastic import incarnation_of
from lightning_rudra.server.shared_side import SharedSide
from lightning_rudra.server.waits import open_waits
from lightning_rudra.core.stats import Stats
from lightning_rudra.transport.logs import SlowWaits, waits_after

log = logging.getLogger(__name__)

Outcomes = list[tuple[Future, Any]]  # futures to resolve once the lock is released: a value, or an exception


def _settle(outcomes: Outcomes) -> None:
    for future, value in outcomes:
        if future.done():
            continue
        if isinstance(value, BaseException):
            future.set_exception(value)
        else:
            future.set_result(value)


class ParameterServer:
    """A :class:`Server` shared by concurrent learners. A push's reply is a :class:`PushReply`; hardsync replies
    wait for the end of the round. Learners that mapped the server's shared memory push ``grads=None`` (the gradient
    is in their buffer) and get ``None`` for the weights, which they read themselves."""

    def __init__(
        self,
        num_learners: int,
        timeout: float = 60.0,
        min_learners: Optional[int] = None,
        announce: bool = True,
        comeback: float = 0.0,
        name: str = "the parameter server",
    ) -> None:
        """``announce``: log each loss and rejoin at INFO, which a server process writes to its stderr (with several
        servers, the first does; the others at DEBUG); ``comeback``: see
        :class:`~lightning_rudra.server.membership.Membership`; ``name``: this server, in what it logs."""
        self.num_learners = num_learners
        self.announce = announce
        self.address: Optional[str] = None  # where the learners reach this process, for their messages
        self.membership = Membership(num_learners, timeout, min_learners, comeback)
        self.core: Optional[Server] = None
        self.lock = threading.Lock()
        self.registered: Future = Future()
        self.round_waiters: dict[int, list[tuple[Future, int, str, int]]] = {}  # (reply, learner, status, σ)
        self.gatherings = Gatherings()
        self.finished: set[int] = set()
        self.finish_waiters: list[Future] = []
        self.all_left = threading.Event()
        self.epochs = SharedEpochs(num_learners)
        self.failure: Optional[str] = None  # why training cannot go on, once it cannot
        self.shared = SharedSide(num_learners)
        self.rejoins = Rejoins(self.membership, self._announce)
        self.on_lost: Optional[Callable[[int, str], None]] = None  # told of each loss, outside the lock
        self.on_heard: Optional[Callable[[int, Any], None]] = None  # and of each process first heard from
        self._lost_queue: list[tuple[int, str]] = []
        self._heard: set[tuple[int, int]] = set()  # (learner, incarnation) heard from
        self.processes: dict[tuple[int, int], Any] = {}  # (learner, incarnation) -> its process, as it beats
        # per compression, the float32 weights each learner's process holds (its replies' weights travel as
        # differences from them: process.py's push_deltas); forgotten once that process is lost or leaves
        self.weight_deltas: dict[str, WeightDeltas] = {}
        self._told: list[tuple[int, str]] = []  # (level, message) to log once the lock is released
        self.attaching: set[int] = set()  # learners waiting for the model to be registered
        self.waits = SlowWaits(log, name, waits_after())

    def register(
        self,
        config: ProtocolConfig,
        params,
        buffers,
        specs: list[OptimizerSpec],
        stats: Optional[Stats],
        shared_memory: bool = True,
        optimizer_states: Optional[list[dict[str, Any]]] = None,
        module: Optional[dict[str, Any]] = None,
    ) -> None:
        """Learner 0 hands over the initial weights, the optimizers and, on resume, the statistics and the
        optimizers' states: all in place before any learner pulls. With ``shared_memory`` the weights live in
        shared memory, or, if it cannot be allocated, in plain memory (the learners are told why). ``module``:
        what a learner that rejoins must match (:func:`~lightning_rudra.server.rejoins.describe_module`)."""
        with self.lock:
            if self.registered.done():  # learner 0 was lost first: its process, woken up, is refused
                self.registered.wait()
            if self.core is not None:
                raise RuntimeError("the parameter server was registered twice")
            self.rejoins.module = module
            core = self.shared.server(config, params, buffers, specs, stats) if shared_memory else None
            try:
                core = core or Server(config, params, buffers, specs, stats)
                core.load_optimizer_states(optimizer_states or [])
            except BaseException:
                self.shared.release()  # learner 0 leaves with this error: its loss fails the waits for the model
                raise
            core.stats.lost = dict(self.membership.lost)  # this run's (a resumed run starts with everyone)
            for learner in self.membership.lost:
                core.remove(learner)
            self.core = core  # only a whole server: a learner lost meanwhile finds the model not registered
            self.attaching = set()
        log.debug(
            "%s: learner 0 registered the model (%s, %d learners)", self.waits.who, config.protocol, config.num_learners
        )
        self.registered.set_result(None)

    def attach(self, learner: int) -> Future:
        """Once registered: the shared memory's names (None without it), and why it is missing, if it failed."""
        self._check_alive()
        if not self.registered.done():
            with self.lock:
                self.attaching.add(learner)
        return self.registered.then(lambda registered: registered.wait() or self._locked(self.shared.offer))

    def attached(self, learner: int, mapped: bool) -> None:
        """A learner says whether it mapped the shared memory (:meth:`SharedSide.attached`)."""
        with self.lock:
            self.shared.attached(learner, mapped, self.membership.members)

    def pull(self) -> Future:
        self._check_alive()
        return self.registered.then(lambda registered: registered.wait() or self._locked(self._core().pull))

    def push(
        self,
        learner: int,
        optimizer: int,
        grads,
        has_grad,
        timestamp: int,
        hparams,
        buffers,
        finite: Optional[bool] = None,
        members: Sequence[int] = (),
        refused: Sequence[int] = (),
        clipping=None,
    ) -> Future:
        """``members``, ``refused``: a node's push (:meth:`Server.push`); ``learner`` shares the reply with them.
        ``clipping``: how the update's gradient is clipped (:meth:`Server.push`)."""
        with self.lock:
            self._check_alive()
            core = self._core()
            if grads is None:
                grads = self.shared.gradient(learner, optimizer, core)
            args = (grads, has_grad, timestamp, hparams, buffers, finite, members, refused, clipping)
            result = core.push(learner, optimizer, *args)
            in_round = core.config.protocol == "hardsync" and not result.closed
            if in_round:
                reply: Future = Future()
                self.round_waiters.setdefault(optimizer, []).append((reply, learner, result.status, result.staleness))
                outcomes = self._give_up_if_deadlocked()
            else:
                outcomes, weights = self._release_rounds([optimizer] if result.closed else [], learner)
                lr_scale = self._lr_scale(optimizer)
        self._settle(outcomes)
        if not in_round:
            reply = Future()
            reply.set_result(PushReply(result.status, result.staleness, lr_scale, *weights))
        return reply

    def _release_rounds(self, closed: list[int], pusher: Optional[int] = None) -> tuple[Outcomes, tuple]:
        """The replies to the pushes that waited in the hardsync rounds of the ``closed`` optimizers, and the
        weights they carry (also for ``pusher``, which did not wait). Called under the lock."""
        released = [(waiter, optimizer) for optimizer in closed for waiter in self.round_waiters.pop(optimizer, [])]
        weights = self._weights(([] if pusher is None else [pusher]) + [waiter[1] for waiter, _ in released])
        return [
            (future, PushReply(status, staleness, self._lr_scale(optimizer), *weights))
            for (future, _, status, staleness), optimizer in released
        ], weights

    def _lr_scale(self, optimizer: int) -> float:
        update = self._core().last_updates[optimizer]
        return update.lr_scale if update is not None else 1.0

    def _weights(self, learners: list[int]) -> tuple:
        return self.shared.reply(learners, self._core())

    def finish(self, learner: int) -> Future:
        """A learner is done training; resolves, once all learners left are, with the final weights."""
        with self.lock:
            self._check_alive()
            outcomes, _ = self._release_rounds(self._core().finish(learner))
            self.finished.add(learner)
            future: Future = Future()
            self.finish_waiters.append(future)
            outcomes += self._complete_finish()
        self._settle(outcomes)
        return future

    def _complete_finish(self) -> Outcomes:
        if not self.finish_waiters or not self.membership.members <= self.finished:
            return []
        weights = self._weights(sorted(self.membership.members))
        waiters, self.finish_waiters = self.finish_waiters, []
        self.membership.short_since = None  # training is over: nobody is awaited back
        return [(waiter, weights) for waiter in waiters] + self.rejoins.turn_away()

    def gather(self, sequence: int, learner: int, obj: Any) -> Future:
        """The ``sequence``-th collective of every learner: resolves with the objects of all learners left
        (learner -> object, in rank order)."""
        with self.lock:
            self._check_alive()
            future = self.gatherings.add(sequence, learner, obj)
            outcomes = self.gatherings.complete(self.membership.members)
            if not outcomes:
                outcomes = self._give_up_if_deadlocked()
        self._settle(outcomes)
        return future

    def draw(
        self, pool: int, epoch: int, learner: int, plan: EpochPlan, want: int, trained: Optional[int] = None
    ) -> tuple[Optional[Any], int, str]:
        """The next batches of the shared epoch (see :meth:`EpochPool.draw`) of train dataloader ``pool``."""
        with self.lock:
            return self.epochs.draw(self._core().stats, pool, epoch, learner, plan, want, trained)

    def stop_drawing(self, learner: int) -> None:
        """``learner`` stops training: every pool of the shared epoch is spent (:meth:`EpochPool.stop`)."""
        with self.lock:
            self.epochs.stop()

    def check_caller(self, method: str, learner: Any) -> None:
        """Refuses, before anything changes, a call from a learner this run does not know or no longer counts."""
        try:
            self.membership.check_caller(method, learner)
            if method == "push" and learner in self.finished:
                raise RuntimeError(f"push from learner {learner} refused: it has finished training")
        except (ValueError, RuntimeError) as refusal:
            log.debug("%s: %s", self.waits.who, refusal)
            raise

    def heartbeat(self, learner: int, address: str, process: Any = None) -> Optional[str]:
        """``process``: (machine, pid) (:func:`~lightning_rudra.server.membership.this_process`). Answers with this
        server's address."""
        if self.membership.joining.get(learner, incarnation_of(learner)) != incarnation_of(learner):
            return self.address  # a process refused while another one waits to rejoin: its end is not that one's
        self.membership.heard(learner, address, process)
        self.processes[(int(learner), incarnation_of(learner))] = process
        if (learner, incarnation_of(learner)) not in self._heard:
            self._heard.add((learner, incarnation_of(learner)))
            log.debug("%s: %s joined (process %s)", self.waits.who, self.membership.where(learner), process)
            if self.on_heard is not None:
                self.on_heard(learner, process)
        return self.address

    def watch(self) -> None:
        """Runs in its own thread: finds the learners lost (a process that ended, a learner silent for longer
        than the timeout) and applies :meth:`_lose`; logs the waits that last (``RUDRA_LOG_WAITS``). Whatever
        fails in a round of it is logged, and the watch goes on: without it, no later loss would be seen."""
        while not self.all_left.wait(min(1.0, self.membership.timeout / 4)):
            try:
                self._look()
            except Exception:
                log.exception("%s: the watch for lost learners failed, and goes on", self.waits.who)

    def _look(self) -> None:
        waits: dict[Hashable, tuple[str, str]] = {}
        with self.lock:
            outcomes = [o for learner, why in self.membership.newly_lost() for o in self._lose(learner, why)]
            for learner in self.membership.newly_failed_joins():
                outcomes += self._join_failed(learner, "its process ended or went silent while it waited")
            too_few = self.membership.comeback_over()
            if too_few is not None and self.failure is None:
                outcomes += self._give_up(too_few)
            self._check_all_left()
            if self.waits.on:
                waits = open_waits(self)
        self._settle(outcomes)
        self.waits.check(waits)

    def leave(self, learner: int, error: Optional[str] = None) -> None:
        """A learner leaves the stage; one that has not finished training, or stopped with an ``error`` (why), is
        lost."""
        with self.lock:
            outcomes = []
            training = self.core is not None and learner in self.core.active
            if error is not None and error.startswith("KeyboardInterrupt"):
                self.membership.stop_awaiting()  # the user stopped the run: nobody comes back
            if self.membership.joining.get(learner) == incarnation_of(learner):
                outcomes = self._join_failed(learner, f"it left before it was admitted ({error or 'no error'})")
            elif learner in self.membership.joining:  # another process for it, refused: the waiting one stays
                pass
            elif learner in self.membership.lost:  # a new process for it that was refused: strike its RPC name
                self._lost_queue.append((learner, self.membership.lost[learner]))
            elif (training or error) and self.failure is None:  # an error in any stage: the others must not wait
                why = f"stopped with an error ({error})" if error else "left before training ended"
                outcomes = self._lose(learner, why)
            self.membership.left.add(learner)
            self._forget_weights(learner)
            self._check_all_left()
            self._told.append((logging.DEBUG, f"{self.waits.who}: learner {learner} left ({error or 'no error'})"))
        self._settle(outcomes)

    def report(self, reporter: int, learner: Any, why: str, process: Any = None) -> None:
        """``reporter``'s launcher saw ``learner``'s process end (on another machine, sooner than its silence).
        ``process``: which one, (machine, pid) as :func:`~lightning_rudra.server.membership.this_process` says; a
        report about another process than the one counted or waiting to rejoin (an earlier one, late) is ignored."""
        with self.lock:
            outcomes = []
            if not self._is_current(learner, process):
                pass
            elif learner in self.membership.members - self.membership.left and self.failure is None:
                outcomes = self._lose(learner, f"ended before training did ({why}, as its launcher saw)")
            elif learner in self.membership.joining:
                outcomes = self._join_failed(learner, f"its process ended while it waited to rejoin ({why})")
        self._settle(outcomes)

    def _is_current(self, learner: Any, process: Any) -> bool:
        """``process`` is ``learner``'s process waiting to rejoin, or else the one counted, as far as the server
        knows (one it never heard from may be either)."""
        joining = self.membership.joining.get(learner, self.membership.incarnations.get(learner, 0))
        known = self.processes.get((learner, joining))
        return process is None or known is None or tuple(known) == tuple(process)

    def rejoin(self, learner: int, module: dict[str, Any]) -> Future:
        """A new process for lost ``learner`` (``min_learners``): resolves with ``(Admission, hyper-parameters per
        optimizer and group)`` when it is admitted, at the start of an epoch (:mod:`lightning_rudra.server.rejoins`),
        or with None if training ends first."""
        with self.lock:
            self._check_alive()
            self.rejoins.check(learner, module)
            reply: Future = Future()
            self.rejoins.ask(learner, incarnation_of(learner), reply)
            # its own process is watched, not another one for the same learner that beat last
            self.membership.watch_process(learner, self.processes.get((int(learner), incarnation_of(learner))))
            self._told.append((logging.DEBUG, f"{self.waits.who}: a new process for learner {learner} asks to rejoin"))
            # every learner finished, or none is left and none is awaited back
            over = self.finish_waiters or (
                self.core is not None and not self.core.active and not self.membership.awaiting_comeback
            )
            outcomes = self.rejoins.turn_away() if over else self.rejoins.admit(self._core())
        self._settle(outcomes)
        return reply

    def progress(self, learner: int, epoch: int, global_step: int, collectives: int) -> None:
        """``learner`` starts ``epoch``, at ``global_step``, having made ``collectives`` collectives: a learner
        waiting to rejoin may be admitted now."""
        with self.lock:
            self.rejoins.report(learner, epoch, global_step, collectives)
            outcomes = self.rejoins.admit(self._core())
        self._settle(outcomes)

    def _join_failed(self, learner: int, why: str) -> Outcomes:
        """The process waiting to rejoin as ``learner`` is gone (its RPC name is struck). Called under the lock."""
        self._lost_queue.append((learner, f"a process rejoining for it failed: {why}"))
        return self.rejoins.fail(learner, why)

    def _settle(self, outcomes: Outcomes) -> None:
        """Resolve ``outcomes`` once the lock is released, then log what there is to say and tell :attr:`on_lost`
        of the learners lost since."""
        _settle(outcomes)
        if not (self._told or self._lost_queue):  # most calls (read without the lock: who adds, settles after)
            return
        with self.lock:
            told, self._told = self._told, []
            lost, self._lost_queue = self._lost_queue, []
        for level, message in told:
            log.log(level, "%s", message)
        for learner, why in lost:
            if self.on_lost is not None:
                self.on_lost(learner, why)

    def _announce(self, message: str) -> None:
        """A loss or a rejoin, logged once the lock is released (:meth:`_settle`). Called under the lock."""
        self._told.append((logging.INFO if self.announce else logging.DEBUG, message))

    def _lose(self, learner: int, why: str) -> Outcomes:
        """``learner`` is lost: without ``min_learners`` (or too few left) training ends; otherwise every wait goes
        on with the learners left (hardsync rounds, collectives, the end of training, a new process's admission),
        registered model or not; a learner 0 lost before it registered the model fails the waits for it. Called
        under the lock."""
        if self.failure is not None:  # training is over already, for the reason every learner was given; the
            self.membership.lose(learner, why)  # server still ends once none is left (it may have no parent)
            self._check_all_left()
            return []
        failure = self.membership.lose(learner, why)
        self._check_all_left()
        self.shared.lose(learner, self.membership.members)
        self._forget_weights(learner)
        self.rejoins.progress.pop(learner, None)
        self._lost_queue.append((learner, why))
        if self.core is not None:
            self.core.stats.lost[learner] = why
            self.core.stats.record(learner, "lost", why)
        if failure is not None:
            return self._give_up(failure)
        self.epochs.lose(learner)
        self._announce(self.membership.loss_told(learner, why))
        outcomes = self._release_rounds(self.core.remove(learner))[0] if self.core is not None else []
        outcomes += self.gatherings.complete(self.membership.members) + self._complete_finish()
        if self.core is not None:
            outcomes += self.rejoins.admit(self.core)
        elif learner == 0 and not self.registered.done():  # only learner 0 registers the model
            never = f"{self.membership.where(0)} was lost before it registered the model (it {why}): there are no "
            self.attaching = set()
            outcomes.append((self.registered, RuntimeError(never + "weights to pull, so training cannot start")))
        return outcomes

    def _forget_weights(self, learner: int) -> None:
        """``learner``'s process is gone: the copy of the weights it held goes too (a new process gets them
        whole). Called under the lock."""
        for deltas in self.weight_deltas.values():
            deltas.held.pop(int(learner), None)

    def _check_all_left(self) -> None:
        if self.membership.all_gone():
            self.all_left.set()

    def _give_up(self, reason: str) -> Outcomes:
        """Training cannot go on: every wait fails, now and later, with ``reason``. Called under the lock; the
        caller settles the returned outcomes once it has released it (:func:`_settle`)."""
        self.failure = reason
        self.shared.release()  # nobody maps the files any more
        self._told.append((logging.DEBUG, f"{self.waits.who}: training cannot go on: {reason}"))
        waiters = [w[0] for ws in self.round_waiters.values() for w in ws]
        waiters += self.gatherings.close() + self.finish_waiters
        self.round_waiters, self.finish_waiters = {}, []
        waiters += [self.registered] if not self.registered.done() else []
        return [(waiter, RuntimeError(reason)) for waiter in waiters] + self.rejoins.stop(reason)

    def _give_up_if_deadlocked(self) -> Outcomes:
        """Hardsync: a learner waiting at a collective can never push the gradient that a round waits for, and
        the learner waiting in the round can never join the collective. Called under the lock."""
        in_round = sorted({w[1] for ws in self.round_waiters.values() for w in ws})
        at_collective = sorted(self.gatherings.waiting() & (self.core.active if self.core is not None else set()))
        if not (in_round and at_collective):
            return []
        return self._give_up(deadlock(at_collective[0], in_round[0]))

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
        if self.failure is not None:
            raise RuntimeError(self.failure)

    def _core(self) -> Server:
        if self.core is None:
            raise RuntimeError("the parameter server holds no weights yet: learner 0 has not registered the model")
        return self.core

    def _locked(self, fn: Callable[[], Any]) -> Any:
        with self.lock:
            return fn()
