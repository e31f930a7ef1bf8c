"""Stale Synchronous Parallel (``on_stale="block"``): instead of dropping a gradient staler than ``max_staleness``
(s), the server holds back the pushes whose updates would make one so. Plain Python; the server's protocol
(:mod:`lightning_rudra.core.protocol`) asks :class:`StaleGate` before it takes a push, and applies the held pushes
it lets go.

Words as in :mod:`lightning_rudra.core.protocol`. Every learner has one gradient outstanding: the one it computes
now, from weights no older than those the server handed it last (its reply's clock: the lower bound the server
knows), or its push, held. An update applies c gradients (async: 1; n-softsync: ⌊λ'/n⌋), so the outstanding
gradients, taken oldest first (which keeps the largest σ smallest), would be applied at known clocks: the one at
place m (from 0), with r gradients already received towards the open update at clock i, at i + ⌊(r + m) / c⌋. A push
is taken if, once it is, every other outstanding gradient could still be applied so with σ <= s; else it is held,
its reply with it (the learner waits, as under hardsync), until the gradients before it came. The oldest outstanding
gradient is always taken: it goes first in that order anyway, and so no push is held for ever while the learner it
waits for still trains. A learner that finished, was lost, or waits at a collective (it pushes nothing until the
others come) holds nobody back.

σ <= s is kept as long as s >= ⌊(λ + c - 2) / c⌋ (:func:`~lightning_rudra.core.config.min_blocking_staleness`):
then taking the oldest first keeps every outstanding gradient within s, and a learner's next gradient, from the
newest weights, comes last. Where it cannot be kept (fewer learners left make c smaller; a learner back from a
collective with weights from before it), the gradient staler than s is dropped and counted, as with
``on_stale="drop"``. Only one optimizer: see :class:`StaleGate`.
"""

from typing import AbstractSet, Optional

from lightning_rudra.core.update import Push


class StaleGate:
    """Which pushes the server takes now and which it holds back (one optimizer).

    With several optimizers a learner pushes them one after the other, each waiting for the reply of the one
    before: a push of one optimizer held for a learner whose push of another is held in turn would wait for ever,
    so the server refuses ``on_stale="block"`` with more than one.
    """

    def __init__(self, bound: int, num_learners: int, clock: int) -> None:
        self.bound = bound
        # learner -> the clock of the weights the server handed it last: its next gradient comes from them or newer
        self.handed = {learner: clock for learner in range(num_learners)}
        self.held: list[Push] = []  # in the order they came
        self.away: AbstractSet[int] = frozenset()  # learners waiting at a collective

    def holds(self, learner: int) -> bool:
        return any(push.learner == learner for push in self.held)

    def may_take(self, push: Push, active: AbstractSet[int], clock: int, received: int, c: int) -> bool:
        """Whether ``push`` may be applied now (``received``: gradients towards the open update, of ``c``)."""
        others = sorted(self._outstanding(push.learner, active))
        if not others or push.timestamp <= others[0]:
            return True
        return all(clock + (received + 1 + m) // c - t <= self.bound for m, t in enumerate(others))

    def hold(self, push: Push) -> None:
        self.held.append(push)

    def next_ready(self, active: AbstractSet[int], clock: int, received: int, c: int) -> Optional[Push]:
        """The oldest held push that may be applied now, taken out of the held ones; None if none may."""
        for push in sorted(self.held, key=lambda p: p.timestamp):
            if self.may_take(push, active, clock, received, c):
                self.held.remove(push)
                return push
        return None

    def applied(self, learner: int, clock: int) -> None:
        """``learner``'s push was applied; its reply hands it the weights of ``clock`` (or newer)."""
        self.handed[learner] = clock

    def left(self, learner: int) -> None:
        """``learner`` computes no more (finished or lost): it holds nobody back."""
        self.handed.pop(learner, None)

    def discard(self, learner: int) -> Optional[Push]:
        """``learner`` is lost: its held push, if any, taken out (its gradient may lie in shared memory that goes
        with its process)."""
        mine = [push for push in self.held if push.learner == learner]
        self.held = [push for push in self.held if push.learner != learner]
        return mine[0] if mine else None

    def joined(self, learner: int, clock: int) -> None:
        self.handed[learner] = clock

    def _outstanding(self, learner: int, active: AbstractSet[int]) -> list[int]:
        """The timestamps of the gradients outstanding but ``learner``'s: held pushes, and the weights handed to
        every learner still training, not at a collective, with no push held."""
        held = {push.learner for push in self.held}
        computing = [
            t for who, t in self.handed.items() if who != learner and who in active and who not in held | self.away
        ]
        return computing + [push.timestamp for push in self.held if push.learner != learner]
