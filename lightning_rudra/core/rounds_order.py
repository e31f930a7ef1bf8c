"""When simulated learners push under K-batch-sync and backup learners (:mod:`lightning_rudra.core.rounds`), and
which batch each one trains. Plain Python; the counterpart of :func:`~lightning_rudra.core.timing.push_order` for
the protocols whose late gradients are not applied.

Their real learners draw from the shared epoch (:mod:`lightning_rudra.core.epoch`), and so do the simulated ones
here: the epoch's batches form one pool, dealt to whichever learner is ready next, a late gradient's batch back
into it, to another learner first. Who is ready when follows from the timing model and the protocol's replies: a
batchsync push and a late push are answered at once, a backup round's pushes when it closes. The server's rules
are replayed here only to know those moments; the in-process server still decides every push itself, and agrees
as long as no gradient is refused (a NaN, which this order does not foresee, only shifts which pushes are late).
"""

import heapq
from dataclasses import dataclass
from typing import AbstractSet, Optional, Sequence

from lightning_rudra.core.timing import TimingModel


@dataclass(frozen=True)
class RoundStep:
    """One push in a simulated epoch: ``learner`` trains the pool's batch ``batch`` (its place in the epoch's
    order) and pushes it at ``moment`` (from the epoch's start, in the timing model's units); ``away``: the learners out of batches by then, which a backup round does not wait for;
    batchsync's pacing (:mod:`lightning_rudra.server.pacing`): ``released``, the learners whose replies waited and
    were answered since the step before, the round still open, and ``waits``, whether this push's reply waits;
    ``again``: the batch was dealt again (a gradient of it came late before)."""

    learner: int
    batch: int
    away: frozenset[int]
    released: frozenset[int] = frozenset()
    waits: bool = False
    moment: float = 0.0
    again: bool = False


@dataclass(frozen=True)
class RoundsStart:
    """The server as a simulated epoch starts: ``held[r]``, the clock of the weights learner r holds, the clock,
    the gradients of the current weights already in batchsync's open round, and the learners in backup's."""

    k: int  # gradients a batchsync round takes (0: backup's rounds)
    backup: int
    held: Sequence[int]
    clock: int
    received: int = 0
    in_round: AbstractSet[int] = frozenset()


def rounds_order(start: RoundsStart, batches: int, timing: TimingModel, done: Sequence[int]) -> list[RoundStep]:
    """The pushes of one epoch of ``batches`` batches, in the order they reach the server: learner r has made
    ``done[r]`` steps before it. Every learner starts the epoch at the same moment (as :func:`push_order`'s do)."""
    return _Epoch(start, batches, timing, done).run()


class _Epoch:
    """One simulated epoch, event by event (a push reaching the server), the server's state replayed."""

    def __init__(self, start: RoundsStart, batches: int, timing: TimingModel, done: Sequence[int]) -> None:
        self.k, self.backup, self.timing = start.k, start.backup, timing
        self.learners = len(start.held)
        self.steps = list(done)  # per learner, steps taken (where its timing goes on)
        self.pool = list(range(batches - 1, -1, -1))  # batches not yet dealt, the next last
        self.redeal: list[tuple[int, int]] = []  # (batch, learner whose gradient of it came late)
        self.away: set[int] = set()
        self.clock, self.held = start.clock, list(start.held)
        self.received, self.in_round = start.received, set(start.in_round)
        self.parked: list[int] = []  # learners whose push waits for the round
        self.released: set[int] = set()  # batchsync: answered since the step before, the round still open
        self.returned: set[int] = set()  # late batches dealt again to the learner they came late from
        self.pushed: set[int] = set()  # batches pushed at least once
        self.order: list[RoundStep] = []
        self.events: list[tuple[float, int, int, int]] = []  # (moment, learner, batch, its weights' clock)

    def run(self) -> list[RoundStep]:
        for learner in range(self.learners):
            self._take(learner, 0.0)
        while self.events:
            moment, learner, batch, timestamp = heapq.heappop(self.events)
            away, released, self.released = frozenset(self.away), frozenset(self.released), set()
            waits = False
            if timestamp < self.clock:  # late: not applied, its batch back into the pool
                self.redeal.append((batch, learner))
                self._answer(learner, moment)
            elif self.k:  # batchsync: answered at once, unless its next gradient would come late (pacing)
                self.received += 1
                if self.received >= self.k:
                    self.clock, self.received = self.clock + 1, 0
                    self._answer(learner, moment)
                    self._answer_parked(moment)
                elif self._paced(learner, moment):
                    waits = True
                    self.parked.append(learner)
                else:
                    self._answer(learner, moment)
            else:  # backup: waits for its round
                self.in_round.add(learner)
                self.parked.append(learner)
                self._close_if_ready(moment)
            self.order.append(RoundStep(learner, batch, away, released, waits, moment, batch in self.pushed))
            self.pushed.add(batch)
            if self.k:
                self._release_if_short(moment)
        return self.order

    def _paced(self, learner: int, moment: float) -> bool:
        """:class:`~lightning_rudra.server.pacing.RoundPacing`'s rule, with the step times known: the gradients
        computing on the current weights would close the round no later than ``learner``'s next one (the server
        does not know whether it has a batch left: it may not)."""
        due = sorted(finish for finish, who, _, at in self.events if at == self.clock and who != learner)
        needed = self.k - self.received
        mine = moment + self.timing.duration(learner, self.steps[learner])
        return len(due) >= needed and mine >= due[needed - 1]

    def _answer_parked(self, moment: float) -> None:
        parked, self.parked = sorted(self.parked), []
        for learner in parked:
            self._answer(learner, moment)

    def _release_if_short(self, moment: float) -> None:
        """batchsync: replies waiting for a round the learners computing can no longer close are answered."""
        computing = sum(1 for _, _, _, at in self.events if at == self.clock)
        if self.parked and computing < self.k - self.received:
            self.released |= set(self.parked)
            self._answer_parked(moment)

    def _answer(self, learner: int, moment: float) -> None:
        self.held[learner] = self.clock
        self._take(learner, moment)

    def _close_if_ready(self, moment: float) -> None:
        """Backup's rule (:func:`~lightning_rudra.core.rounds.round_ready`, every learner still training): a closed
        round's learners get the new weights and go on."""
        everyone = set(range(self.learners))
        taken = len(self.in_round) >= max(1, self.learners - self.backup)
        if not self.in_round or not (taken or everyone - self.away <= self.in_round):
            return
        self.clock += 1
        self.in_round.clear()
        self._answer_parked(moment)

    def _take(self, learner: int, moment: float) -> None:
        """``learner``, ready at ``moment``, takes its next batch, or has none left."""
        batch = self._next_batch(learner)
        if batch is None:
            self.away.add(learner)
            if not self.k:  # a backup round waits no longer for it: the server closes it when it next hears
                self._close_if_ready(moment)
            return  # (batchsync: run() answers the replies waiting that it leaves short)
        finish = moment + self.timing.duration(learner, self.steps[learner])
        self.steps[learner] += 1
        heapq.heappush(self.events, (finish, learner, batch, self.held[learner]))

    def _next_batch(self, learner: int) -> Optional[int]:
        """A late batch of another learner first, then a new one, then its own late one, once, or again if the
        others are all out of batches (as :meth:`EpochPool.draw <lightning_rudra.core.epoch.EpochPool.draw>` deals:
        the others are then at the epoch's end, which every learner reaches before the next starts)."""
        alone = set(range(self.learners)) - self.away <= {learner}
        for i, (batch, late_from) in enumerate(self.redeal):
            mine = not self.pool and (alone or batch not in self.returned)
            if late_from != learner or mine:
                del self.redeal[i]
                if late_from == learner:
                    self.returned.add(batch)
                return batch
        return self.pool.pop() if self.pool else None
