"""K-batch-sync's pacing (:class:`RoundPacing`): whose reply waits for the round to close.

Dutta et al.'s K-batch-sync interrupts every learner when a round closes, so that no learner goes on computing on
weights the round has left. A learner here cannot be interrupted mid-step: a gradient it starts on weights whose
round then closes comes late, and the whole step is lost. So a push that does not close its round is answered at
once (its learner gives another gradient of the same weights) only if that gradient can come before the round
closes; otherwise its reply waits for the round, and its learner then computes on the new weights. The server
judges by each learner's step time, measured from its reply to its next push: it holds the reply of learner L if
the gradients still computing on the current weights, each due at its reply's time plus its step, would close the
round no later than L's next one. With equally fast learners and K = λ every learner then gives one gradient per
round, as under hardsync; a learner faster by a whole step gives several; a straggler's still come late.

A held reply waits only while the learners computing on the current weights can still close the round: when a
learner leaves them (it pushed and waits too, its gradient was refused, it went to a collective, finished or was
lost, or is overdue: twice its step time late, as a stalled one is) the server asks again (:meth:`RoundPacing.enough`;
for the overdue, its watch asks every second at most) and answers the held ones if they cannot. Plain Python;
runs under the :class:`~lightning_rudra.server.model_server.ModelServer`'s lock.
"""

from typing import AbstractSet

from lightning_rudra.core.protocol import Server

# the weight of a learner's newest step time in its estimate: steps vary, a straggler stays one
NEWEST = 0.5
# a gradient later than this many of its learner's steps (plus GRACE seconds) is not waited for: the learner may
# have stalled, in its own code or a collective of its own; the server's watch answers the replies held for it
OVERDUE = 2.0
GRACE = 0.05


class RoundPacing:
    """Per learner: when it was handed which weights, and its step time (from the reply to the next push)."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.handed: dict[int, tuple[float, int]] = {}  # learner -> (when, clock) of the weights it computes on
        self.step: dict[int, float] = {}  # learner -> estimated seconds from a reply to its next push
        self.waiting: set[int] = set()  # learners whose reply waits for the round

    def handed_out(self, learner: int, now: float, clock: int) -> None:
        """``learner`` computes on the weights of ``clock`` from ``now``: its reply, or its first weights (else the
        first round would answer every push but the last at once, and their next gradients would come late)."""
        self.handed[learner] = (now, clock)
        self.waiting.discard(learner)

    def back(self, learners: AbstractSet[int], now: float) -> None:
        """``learners`` come back from a collective: their next steps start now, on the weights they hold (else,
        after a wait of two steps, they would all count as overdue, and the next round would answer every push at
        once)."""
        for learner in learners & self.handed.keys():
            self.handed[learner] = (now, self.handed[learner][1])

    def pushed(self, learner: int, now: float) -> None:
        """``learner``'s push arrived: its step time is measured, and it computes no more until its reply."""
        if learner in self.handed:
            since, _ = self.handed.pop(learner)
            took = now - since
            self.step[learner] = took if learner not in self.step else NEWEST * took + (1 - NEWEST) * self.step[learner]

    def hold(self, learner: int, now: float, core: Server, away: AbstractSet[int]) -> bool:
        """Whether the reply to ``learner``'s push (taken, its round still open) waits for the round, the learners of
        ``away`` waiting at a collective; if it does, ``learner`` is waiting from now."""
        received, _ = core.open_update()
        if not self.waits(learner, now, core.clock, received, core.active - away - self.waiting):
            return False
        self.waiting.add(learner)
        return True

    def cannot_close(self, core: Server, away: AbstractSet[int], now: float) -> bool:
        """Whether replies wait for a round that the learners computing (not ``away``, not waiting, not overdue)
        cannot close: then they are answered."""
        received, _ = core.open_update()
        computing = core.active - away - self.waiting
        return bool(self.waiting) and not self.enough(core.clock, received, computing, now)

    def waits(self, learner: int, now: float, clock: int, received: int, computing: AbstractSet[int]) -> bool:
        """Whether ``learner``'s reply should wait for the round at ``clock`` (``received`` of its K gradients in,
        ``computing``: the learners that may still push in it): the others' gradients due would close it before its
        next one."""
        needed = self.k - received
        if needed <= 0 or learner not in self.step:
            return False
        due = sorted(self._due(clock, computing - {learner}, now))
        return len(due) >= needed and now + self.step[learner] >= due[needed - 1]

    def enough(self, clock: int, received: int, computing: AbstractSet[int], now: float) -> bool:
        """Whether the learners computing on the weights of ``clock`` can still bring the round its K gradients."""
        return len(self._due(clock, computing, now)) >= self.k - received

    def forget(self, learner: int) -> None:
        """``learner`` was lost: a new process measures its own steps."""
        self.handed.pop(learner, None)
        self.step.pop(learner, None)
        self.waiting.discard(learner)

    def _due(self, clock: int, computing: AbstractSet[int], now: float) -> list[float]:
        """When the gradients computing on the weights of ``clock`` are due (an unmeasured learner's: now), but those
        overdue: a learner more than ``OVERDUE`` of its steps (or of the slowest measured) past its reply may have
        stalled, and nobody waits for it."""
        slowest = max(self.step.values(), default=0.0)
        due = []
        for who, (since, at) in self.handed.items():
            step = self.step.get(who, slowest)
            if at == clock and who in computing and now <= since + OVERDUE * step + GRACE:
                due.append(since + self.step.get(who, 0.0))
        return due
