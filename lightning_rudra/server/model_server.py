"""The model's data path of the parameter server, over futures: :class:`~lightning_rudra.core.protocol.Server` shared
by concurrent learners (the model's registration, pulls, pushes and hardsync rounds, the collectives, the shared
epoch, the end of training, what a checkpoint holds), plus the shared epoch's pools (``shared_epochs.py``), its shared
memory (``shared_side.py``), the learners' rendezvous for collectives (``gatherings.py``) and the servers' exchange
of their parts of a hardsync round's gradient norm (``norm_exchange.py``); the replies it holds back (in a round, or
by ``on_stale='block'``) are ``owed_replies.py``'s, and those it settles once its lock is released ``replies.py``'s.
:class:`~lightning_rudra.server.parameter_server.ParameterServer` adds who is alive. No RPC here.

Nothing blocks: whatever must wait (a hardsync round, a collective, the end of training) gets a
``torch.futures.Future`` that the call completing the wait resolves. Such waits have no time limit, since waiting
for a slow learner is not an error (the learners lost fail or complete them: ``parameter_server.py``). What the server
has to say (a loss, a rejoin) it logs once the lock is released and every wait is settled: writing to its stderr can
fail or block, and must not stop the learners left.
"""

import logging
import threading
import time
from dataclasses import replace
from typing import Any, Callable, Optional, Sequence

from torch.futures import Future

from lightning_rudra.core.epoch import EpochPlan
from lightning_rudra.core.errors import ServerLostError
from lightning_rudra.server.gatherings import Gatherings, deadlock
from lightning_rudra.server.membership import Membership
from lightning_rudra.server.norm_exchange import NormExchange, check_part
from lightning_rudra.server.owed_replies import OwedReplies, lr_scale
from lightning_rudra.server.pacing import RoundPacing
from lightning_rudra.core.protocol import Server
from lightning_rudra.core.compression import WeightDeltas
from lightning_rudra.core.update import Push
from lightning_rudra.server.rejoins import RejoinAdmissions
from lightning_rudra.server.replies import Outcomes, Released, push_reply, resolve
from lightning_rudra.server.shared_epochs import SharedEpochs
from lightning_rudra.server.shared_side import SharedSide
from lightning_rudra.core.registration import Registration
from lightning_rudra.core.weights import Snapshot
from lightning_rudra.transport import timeline
from lightning_rudra.transport.logs import SlowWaits, waits_after

log = logging.getLogger(__name__)


class ModelServer:
    """A :class:`Server` shared by concurrent learners. A push's reply is a :class:`PushReply`; hardsync replies
    wait for the end of the round. Learners that mapped the server's shared memory push ``grads=None`` (the gradient
    is in their buffer) and get ``None`` for the weights, which they read themselves."""

    def __init__(  # 7 params: the server process's settings, each its own option
        self,
        num_learners: int,
        timeout: float = 60.0,
        min_learners: Optional[int] = None,
        announce: bool = True,
        rejoin_wait: float = 0.0,
        name: str = "the parameter server",
        server: int = 0,
    ) -> None:
        """``announce``: log each loss and rejoin at INFO, which a server process writes to its stderr (with several
        servers, the first does; the others at DEBUG); ``rejoin_wait``: see
        :class:`~lightning_rudra.server.membership.Membership`; ``name``: this server, in what it logs; ``server``:
        which of the servers this is."""
        self.num_learners = num_learners
        self.announce = announce
        self.address: Optional[str] = None  # where the learners reach this process, for their messages
        self.membership = Membership(num_learners, timeout, min_learners, rejoin_wait)
        self.core: Optional[Server] = None
        self.lock = threading.Lock()
        self.registered: Future = Future()
        self.gatherings = Gatherings()
        self.finished: set[int] = set()
        self.finish_waiters: list[Future] = []
        self.epochs = SharedEpochs(num_learners)
        self.failure: Optional[str] = None  # why training cannot go on, once it cannot
        self.failed_with: type[RuntimeError] = RuntimeError  # the class of the errors that say it
        self.shared = SharedSide(num_learners)
        self.owed = OwedReplies(self.shared)  # the replies held back: in rounds, or by on_stale='block'
        self.rejoins = RejoinAdmissions(self.membership, self._log_later)
        self.on_lost: Optional[Callable[[int, str], None]] = None  # told of each loss, outside the lock
        self._lost_queue: list[tuple[int, str]] = []
        # per compression, the float32 weights each learner's process holds (its replies' weights travel as
        # differences from them: process.py's push_deltas); forgotten once that process is lost or leaves
        self.weight_deltas: dict[str, WeightDeltas] = {}
        self._told: list[tuple[int, str]] = []  # (level, message) to log once the lock is released
        self.attaching: set[int] = set()  # learners waiting for the model to be registered
        self.waits = SlowWaits(log, name, waits_after())
        # hardsync clipping by norm over several servers' parts (core.clipping), and the sending of this server's
        # part to another, outside the lock
        self.server = server
        self.norm_exchange = NormExchange(server)
        self.send_norm: Optional[Callable[[int, int, int, float], None]] = None  # (to server, optimizer, round, norm²)

    def register(self, registration: Registration) -> None:
        """Learner 0 hands over the initial weights, the optimizers and, on resume, the statistics and the
        optimizers' states: all in place before any learner pulls. With ``shared_memory`` the weights live in
        shared memory, or, if it cannot be allocated, in plain memory (the learners are told why). ``module``:
        what a learner that rejoins must match (:func:`~lightning_rudra.server.rejoins.describe_module`).

        Args:
            registration: this server's part of the model, as learner 0 sends it.
        """
        config = registration.config
        with self.lock:
            if self.registered.done():  # learner 0 was lost first: its process, woken up, is refused
                self.registered.wait()
            if self.core is not None:
                raise RuntimeError("the parameter server was registered twice")
            self.rejoins.module = registration.module
            core = self.shared.server(registration) if registration.shared_memory else None
            try:
                core = core or Server(
                    config, registration.params, registration.buffers, registration.specs, registration.stats
                )
                core.load_optimizer_states(registration.optimizer_states or [])
            except BaseException:
                self.shared.release()  # learner 0 leaves with this error: its loss fails the waits for the model
                raise
            if config.protocol == "batchsync":
                self.owed.pacing = RoundPacing(config.gradients_per_update)
                for learner in self.shared.answered:  # attached before the model was (shared_memory=False)
                    self.owed.pacing.handed_out(learner, time.monotonic(), core.clock)
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
            if self.owed.pacing is not None and self.core is not None:  # its first step starts
                self.owed.pacing.handed_out(learner, time.monotonic(), self.core.clock)

    def pull(self) -> Future:
        self._check_alive()
        return self.registered.then(lambda registered: registered.wait() or self._locked(self._protocol().pull))

    def push(self, push: Push) -> Future:
        """A learner's gradient (:meth:`Server.push`); a node's push (``push.members``) shares its reply with them.
        ``push.grads=None``: the gradient is in the learner's shared memory.

        Args:
            push: the learner's gradient for this server, as it sent it.

        Returns:
            a future of the :class:`PushReply`, which a hardsync round resolves once it closes.
        """
        timeline.mark("received", self.server, push.learner)
        with self.lock:
            self._check_alive()
            core = self._protocol()
            if push.grads is None:
                push = replace(push, grads=self.shared.gradient(push.learner, push.optimizer, core))
            if core.config.backup:  # a backup round does not wait for the learners at a collective
                core.away = self.gatherings.waiting() & core.active
            pacing = self.owed.pacing
            now = time.monotonic() if pacing is not None else 0.0  # batchsync's pacing measures steps
            if pacing is not None:
                pacing.pushed(push.learner, now)
            result = core.push(push)
            learner, optimizer = push.learner, push.optimizer
            self.norm_exchange.pushed(optimizer, push.clipping)
            applied = self._applied([optimizer] if result.closed else [])
            # a late push (batchsync, backup) is answered at once: its round has closed
            in_round = core.config.protocol == "hardsync" and optimizer not in applied and result.status != "late"
            if pacing is not None and result.status == "accepted" and not result.closed:
                in_round = pacing.hold(learner, now, core, self.gatherings.waiting())
            held = result.status == "held"
            if in_round:
                reply = self.owed.wait_in_round(optimizer, learner, result.status, result.staleness)
                outcomes = self._give_up_if_deadlocked()
            elif core.gate is not None:  # its push taken or held, it may let held ones go
                if held:
                    reply = self.owed.hold(learner)
                outcomes, weights = self._release_held(None if held else learner)
            else:
                outcomes, weights = self._release_rounds(applied, learner)
            outcomes += self._release_paced()
            scale = lr_scale(core, optimizer)
        self._resolve_and_report(outcomes)
        if not (in_round or held):
            reply = Future()
            reply.set_result(push_reply(result.status, result.staleness, scale, weights))
        if timeline.enabled():
            reply.add_done_callback(lambda _: timeline.mark("answered", self.server, learner))
        return reply

    def _release_paced(self) -> Outcomes:
        """batchsync: the replies waiting for a round that the learners computing can no longer close, answered with
        the current weights. Called under the lock, after anything that takes a learner from them."""
        if self.owed.pacing is None or self.core is None or self.failure is not None:
            return []
        short = self.owed.pacing.cannot_close(self.core, self.gatherings.waiting(), time.monotonic())
        return self._release_rounds([0]).outcomes if short else []

    def _applied(self, closed: list[int]) -> list[int]:
        """Of the optimizers whose wait just ``closed``, those whose update applied (:class:`NormExchange`). Called
        under the lock."""
        return self.norm_exchange.applied(self._protocol(), closed)

    def round_norm(self, server: int, optimizer: int, round: int, partial: float) -> None:
        """Server ``server``'s squared norm of its part of the gradient of ``optimizer``'s hardsync round ``round``
        (:meth:`NormExchange.add`); with the last part, the update applies and the round's learners get their
        replies."""
        check_part(server, optimizer, round, partial)
        with self.lock:
            if self.failure is not None or self.core is None:
                return
            applied = self.norm_exchange.add(self.core, server, optimizer, round, partial)
            outcomes: Outcomes = self._release_rounds([optimizer]).outcomes if applied else []
        self._resolve_and_report(outcomes)

    def norm_not_sent(self, server: int, error: BaseException) -> None:
        """This server's part of a round's norm did not reach server ``server``: its round can never apply."""
        with self.lock:
            if self.failure is not None or self.membership.members <= self.finished:  # nobody waits any more
                return
            outcomes = self._give_up(
                f"{self.waits.who} could not send its part of the gradient's norm (clipping by norm over several "
                f"servers) to parameter server {server}: {error}",
                ServerLostError,
            )
        self._resolve_and_report(outcomes)

    def _release_rounds(self, closed: list[int], pusher: Optional[int] = None) -> Released:
        """:meth:`OwedReplies.release_rounds`. Called under the lock."""
        return self.owed.release_rounds(self._protocol(), closed, pusher)

    def _release_held(self, pusher: Optional[int] = None) -> Released:
        """:meth:`OwedReplies.release_held`: the learners waiting at a collective hold nobody back. Called under the
        lock."""
        return self.owed.release_held(self._protocol(), self.gatherings.waiting(), pusher)

    def finish(self, learner: int) -> Future:
        """A learner is done training; resolves, once all learners left are, with the final weights."""
        with self.lock:
            self._check_alive()
            outcomes = self._release_rounds(self._applied(self._protocol().finish(learner))).outcomes
            outcomes += self._release_held().outcomes + self._release_paced()
            self.finished.add(learner)
            future: Future = Future()
            self.finish_waiters.append(future)
            outcomes += self._complete_finish()
        self._resolve_and_report(outcomes)
        return future

    def _complete_finish(self) -> Outcomes:
        if not self.finish_waiters or not self.membership.members <= self.finished:
            return []
        weights = self.owed.weights(self._protocol(), sorted(self.membership.members))
        waiters, self.finish_waiters = self.finish_waiters, []
        self.membership.short_since = None  # training is over: nobody is awaited back
        return [(waiter, weights) for waiter in waiters] + self.rejoins.tell_training_over()

    def gather(self, sequence: int, learner: int, obj: Any) -> Future:
        """The ``sequence``-th collective of every learner: resolves with the objects of all learners left
        (learner -> object, in rank order)."""
        with self.lock:
            self._check_alive()
            future = self.gatherings.add(sequence, learner, obj)
            outcomes = self._complete_gatherings()
            if self.core is not None and self.failure is None:  # a backup round waits for nobody here
                outcomes += self._release_rounds(self._applied(self.core.meet(self.gatherings.waiting()))).outcomes
                outcomes += self._release_paced()
            if not outcomes:
                outcomes = self._give_up_if_deadlocked()
            if self.core is not None and self.failure is None:  # nobody is held back for a learner waiting here
                outcomes += self._release_held().outcomes
        self._resolve_and_report(outcomes)
        return future

    def _complete_gatherings(self) -> Outcomes:
        """The collectives every learner left has joined, answered; batchsync's pacing learns who is back. Called under
        the lock."""
        waiting = self.gatherings.waiting()
        outcomes = self.gatherings.complete(self.membership.members)
        if self.owed.pacing is not None:
            self.owed.pacing.back(waiting - self.gatherings.waiting(), time.monotonic())
        return outcomes

    def draw(  # 7 params: the learner's request (EpochPool.draw's), and which train dataloader
        self,
        pool: int,
        epoch: int,
        learner: int,
        plan: EpochPlan,
        want: int,
        trained: Optional[int] = None,
        late: Sequence[int] = (),
    ) -> tuple[Optional[Any], int, str]:
        """The next batches of the shared epoch (see :meth:`EpochPool.draw`) of train dataloader ``pool``."""
        with self.lock:
            core = self._protocol()
            alone = core.active - self.gatherings.waiting() - self.finished <= {learner}
            return self.epochs.draw(core.stats, pool, epoch, learner, plan, want, trained, late, alone)

    def stop_drawing(self, learner: int) -> None:
        """``learner`` stops training: every pool of the shared epoch is spent (:meth:`EpochPool.stop`)."""
        with self.lock:
            self.epochs.stop()

    def _resolve_and_report(self, outcomes: Outcomes) -> None:
        """Resolve ``outcomes`` once the lock is released, then log what there is to say and tell :attr:`on_lost`
        of the learners lost since."""
        resolve(outcomes)
        # most calls have nothing more (read without the lock: who adds, settles after)
        if not (self._told or self._lost_queue or self.norm_exchange.outbox):
            return
        with self.lock:
            told, self._told = self._told, []
            lost, self._lost_queue = self._lost_queue, []
            sends = self.norm_exchange.take_outbox()
        for server, optimizer, round, partial in sends:
            assert self.send_norm is not None  # the server process sets it where there are several servers
            self.send_norm(server, optimizer, round, partial)
        for level, message in told:
            log.log(level, "%s", message)
        for learner, why in lost:
            if self.on_lost is not None:
                self.on_lost(learner, why)

    def _log_later(self, message: str) -> None:
        """A loss or a rejoin, logged once the lock is released (:meth:`_resolve_and_report`). Called under the lock."""
        self._told.append((logging.INFO if self.announce else logging.DEBUG, message))

    def _give_up(self, reason: str, error: type[RuntimeError] = RuntimeError) -> Outcomes:
        """Training cannot go on: every wait fails, now and later, with ``error(reason)`` (a
        :class:`~lightning_rudra.core.errors.LearnerLostError` for a loss). Called under the lock; the caller
        settles the returned outcomes once it has released it (:func:`~lightning_rudra.server.replies.resolve`)."""
        self.failure, self.failed_with = reason, error
        self.shared.release()  # nobody maps the files any more
        self._told.append((logging.DEBUG, f"{self.waits.who}: training cannot go on: {reason}"))
        waiters = self.owed.take_all() + self.gatherings.close() + self.finish_waiters
        self.finish_waiters = []
        self.norm_exchange.clear()
        waiters += [self.registered] if not self.registered.done() else []
        return [(waiter, error(reason)) for waiter in waiters] + self.rejoins.stop(reason)

    def _give_up_if_deadlocked(self) -> Outcomes:
        """Hardsync: a learner waiting at a collective can never push the gradient that a round waits for, and
        the learner waiting in the round can never join the collective. Called under the lock."""
        if self.core is not None and self.core.config.discards_late:  # rounds close, or pace, without them
            return []
        in_round = self.owed.learners_in_rounds()
        at_collective = sorted(self.gatherings.waiting() & (self.core.active if self.core is not None else set()))
        if not (in_round and at_collective):
            return []
        return self._give_up(deadlock(at_collective[0], in_round[0]))

    def stats(self) -> dict[str, Any]:
        return self._locked(lambda: self._protocol().stats.to_dict())

    def snapshot(self) -> Snapshot:
        """What a checkpoint holds, all of one clock: weights and buffers (flat), the clock, every optimizer's
        state and the statistics."""

        def take() -> Snapshot:
            core = self._protocol()
            params, buffers, clock = core.pull()
            states = [core.optimizer_state(i) for i in range(len(core.optimizers))]
            return Snapshot(params, buffers, clock, states, core.weights_stats())

        return self._locked(take)

    def optimizer_state(self, optimizer: int) -> dict[str, Any]:
        return self._locked(lambda: self._protocol().optimizer_state(optimizer))

    def load_optimizer_state(self, optimizer: int, state: dict[str, Any]) -> None:
        self._locked(lambda: self._protocol().load_optimizer_state(optimizer, state))

    def _check_alive(self) -> None:
        if self.failure is not None:
            raise self.failed_with(self.failure)

    def _protocol(self) -> Server:
        if self.core is None:
            raise RuntimeError("the parameter server holds no weights yet: learner 0 has not registered the model")
        return self.core

    def _locked(self, fn: Callable[[], Any]) -> Any:
        with self.lock:
            return fn()
