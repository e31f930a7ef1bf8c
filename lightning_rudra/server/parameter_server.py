"""The parameter server's state over futures: the model's data path (``model_server.py``) and who is alive: who is
in the run (``membership.py``) and who comes back (``rejoins.py``). No RPC here: :mod:`lightning_rudra.server.process`
serves it.

Every learner sends a heartbeat, and a learner whose process ended, or that is silent for longer than the timeout, is
lost: every wait fails at once with a message that names it, or, with ``min_learners``, completes with the learners
left (whether or not the model is registered yet: validate, test and predict never register one).
"""

import logging
import threading
from typing import Any, Callable, Hashable, Optional

from torch.futures import Future

from lightning_rudra.server.model_server import ModelServer
from lightning_rudra.server.replies import Outcomes
from lightning_rudra.core.errors import LearnerLostError
from lightning_rudra.transport.elastic import incarnation_of
from lightning_rudra.server.waits import open_waits

log = logging.getLogger(__name__)


class ParameterServer(ModelServer):
    """A :class:`ModelServer` that knows who is alive: the learners' heartbeats, the watch for the lost ones, leaves,
    their launchers' reports and rejoins. Every entry point :mod:`lightning_rudra.server.process` serves is a method of
    it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """As :class:`ModelServer` (its arguments), plus what the watch keeps of the learners' processes."""
        super().__init__(*args, **kwargs)
        self.all_left = threading.Event()
        self.on_heard: Optional[Callable[[int, Any], None]] = None  # told of each process first heard from
        self._heard: set[tuple[int, int]] = set()  # (learner, incarnation) heard from
        self.processes: dict[tuple[int, int], Any] = {}  # (learner, incarnation) -> its process, as it beats

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
            too_few = self.membership.rejoin_wait_over()
            if too_few is not None and self.failure is None:
                outcomes += self._give_up(too_few, LearnerLostError)
            self._check_all_left()
            outcomes += self._release_paced()  # a batchsync reply held for a learner now overdue
            if self.waits.on:
                waits = open_waits(self)
        self._resolve_and_report(outcomes)
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
        self._resolve_and_report(outcomes)

    def report(self, reporter: int, learner: Any, why: str, process: Any = None) -> None:
        """``reporter``'s launcher saw ``learner``'s process end (on another machine, sooner than its silence).
        ``process``: which one, (machine, pid) as :func:`~lightning_rudra.server.membership.this_process` says; a
        report about another process than the one counted or waiting to rejoin (an earlier one, late) is ignored."""
        self.membership.check_index(learner, f"report from learner {reporter} refused: it names learner {learner!r}; ")
        with self.lock:
            outcomes = []
            if not self._is_current(learner, process):
                pass
            elif learner in self.membership.members - self.membership.left and self.failure is None:
                outcomes = self._lose(learner, f"ended before training did ({why}, as its launcher saw)")
            elif learner in self.membership.joining:
                outcomes = self._join_failed(learner, f"its process ended while it waited to rejoin ({why})")
        self._resolve_and_report(outcomes)

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
                self.core is not None and not self.core.active and not self.membership.awaiting_rejoins
            )
            outcomes = self.rejoins.tell_training_over() if over else self.rejoins.admit(self._protocol())
        self._resolve_and_report(outcomes)
        return reply

    def progress(self, learner: int, epoch: int, global_step: int, collectives: int) -> None:
        """``learner`` starts ``epoch``, at ``global_step``, having made ``collectives`` collectives: a learner
        waiting to rejoin may be admitted now."""
        with self.lock:
            self.rejoins.report(learner, epoch, global_step, collectives)
            outcomes = self.rejoins.admit(self._protocol())
        self._resolve_and_report(outcomes)

    def _join_failed(self, learner: int, why: str) -> Outcomes:
        """The process waiting to rejoin as ``learner`` is gone (its RPC name is struck). Called under the lock."""
        self._lost_queue.append((learner, f"a process rejoining for it failed: {why}"))
        return self.rejoins.fail(learner, why)

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
            return self._give_up(failure, LearnerLostError)
        self.epochs.lose(learner)
        self._log_later(self.membership.loss_told(learner, why))
        outcomes = (
            self._release_rounds(self._applied(self.core.remove(learner))).outcomes if self.core is not None else []
        )
        outcomes += self._complete_gatherings() + self._complete_finish()
        outcomes += self.owed.lose(learner, LearnerLostError(f"learner {learner} was lost ({why})"))
        if self.owed.pacing is not None:
            self.owed.pacing.forget(learner)
        if self.core is not None:  # nobody is held back for it any more
            outcomes += self._release_held().outcomes + self._release_paced()
        if self.core is not None:
            outcomes += self.rejoins.admit(self.core)
        elif learner == 0 and not self.registered.done():  # only learner 0 registers the model
            never = f"{self.membership.where(0)} was lost before it registered the model (it {why}): there are no "
            self.attaching = set()
            outcomes.append((self.registered, LearnerLostError(never + "weights to pull, so training cannot start")))
        return outcomes

    def _forget_weights(self, learner: int) -> None:
        """``learner``'s process is gone: the copy of the weights it held goes too (a new process gets them
        whole). Called under the lock."""
        for deltas in self.weight_deltas.values():
            deltas.held.pop(int(learner), None)

    def _check_all_left(self) -> None:
        if self.membership.all_gone():
            self.all_left.set()
