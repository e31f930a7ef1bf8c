"""Staleness per optimizer: σ of a gradient counts the updates, since the weights it came from, that changed its
optimizer's parameters and that its learner's own program did not make first. Plain Python.

The server's clock counts every update of the model, whichever optimizer made it; a GAN's step (one backward, then
the discriminator's and the generator's updates) would otherwise make the second gradient one update stale although
nothing it updates had moved, and the staleness rules (``max_staleness``, the modulations, the compensation) would
treat it so even with one learner. An optimizer's parameters change with its own updates and with those of any
optimizer that shares a parameter with it; with one optimizer σ is the paper's i − j.

A learner's own steps of its other optimizers since its last step of this one (an update made of its gradients
alone) are not staleness either: one process makes them in the same order, so one learner stays plain torch even
when its optimizers share a parameter or a gradient is accumulated over another optimizer's steps.
"""

from bisect import bisect_right
from typing import NamedTuple, Optional, Sequence

# the updates kept per optimizer and learner: a gradient older than them is stale by every update since its
# weights (the paper's i − j, never fewer than the updates of its parameters)
UPDATES_PER_LEARNER = 64


class UpdateMade(NamedTuple):
    """One update, as a later gradient's σ needs it."""

    clock: int  # the clock after it
    optimizer: int
    author: Optional[int]  # the learner whose gradients alone it applied (None: several learners')


class OwnSteps(NamedTuple):
    """The updates of a gradient's own learner that are no staleness to it: those it made with its other optimizers
    after its previous push of this one (clock ``since``) and before this push (clock ``until``)."""

    learner: int
    since: int
    until: int


def _clock(update: UpdateMade) -> int:
    return update.clock


class OptimizerClocks:
    """Which updates changed each optimizer's parameters, since the oldest weights a gradient may still come from.

    ``touches[k]``: the optimizers whose updates change optimizer k's parameters (k among them). With one optimizer
    σ is the clock's count and nothing is kept. Otherwise, per optimizer, the updates that changed its parameters,
    newer than the oldest timestamp of the learners' last pushes of it and of its gradients still waiting for their
    update (a learner's gradients for one optimizer come from weights no older than its previous one's), and at most
    ``capacity`` of them (``UPDATES_PER_LEARNER`` per learner, and more than ``max_staleness``, so that dropping
    stays exact).
    """

    def __init__(
        self, touches: Sequence[frozenset[int]], num_learners: int, clock: int, max_staleness: Optional[int] = None
    ) -> None:
        self.touches = list(touches)
        self.capacity = max(UPDATES_PER_LEARNER * num_learners, (max_staleness or 0) + 1)
        self.updates: list[list[UpdateMade]] = [[] for _ in self.touches]
        # per optimizer: a timestamp older than this may have lost updates to pruning (σ then counts them all)
        self.exact_from = [clock] * len(self.touches)
        self.last_push = {(learner, k): clock for learner in range(num_learners) for k in range(len(self.touches))}
        self.pushed_at: dict[tuple[int, int], int] = {}  # (learner, optimizer) -> the clock its last push came at
        self.waiting: list[list[int]] = [[] for _ in self.touches]  # timestamps of gradients waiting for an update

    def own_steps(self, learner: int, optimizer: int, clock: int) -> OwnSteps:
        """The own steps of a gradient of ``optimizer`` that ``learner`` pushes now, at ``clock``."""
        return OwnSteps(learner, self.pushed_at.get((learner, optimizer), -1), clock)

    def staleness(self, optimizer: int, timestamp: int, clock: int, own: Optional[OwnSteps] = None) -> int:
        """σ of a gradient of ``optimizer`` from the weights of ``timestamp``, applied at ``clock``; ``own``: its
        learner's steps that are no staleness."""
        if len(self.touches) == 1 or timestamp < self.exact_from[optimizer]:
            return clock - timestamp
        updates = self.updates[optimizer]
        first = bisect_right(updates, timestamp, key=_clock)
        if own is None:
            return len(updates) - first
        begin = max(first, bisect_right(updates, own.since, key=_clock))
        end = bisect_right(updates, own.until, key=_clock)
        mine = sum(1 for u in updates[begin:end] if u.author == own.learner and u.optimizer != optimizer)
        return len(updates) - first - mine

    def oldest(self, clock: int, optimizer: Optional[int] = None) -> int:
        """The oldest timestamp a gradient (of ``optimizer``; None: of any) may still be applied from: the
        learners' last pushes and the gradients waiting (``clock`` if none)."""
        pushed = [timestamp for (_, k), timestamp in self.last_push.items() if optimizer in (None, k)]
        waiting = [t for k, timestamps in enumerate(self.waiting) if optimizer in (None, k) for t in timestamps]
        return min(pushed + waiting, default=clock)

    def pushed(self, learner: int, optimizer: int, timestamp: int, clock: int) -> None:
        """``learner`` pushed a gradient of ``optimizer`` from the weights of ``timestamp`` at ``clock``."""
        self.last_push[learner, optimizer] = timestamp
        self.pushed_at[learner, optimizer] = clock

    def queued(self, optimizer: int, timestamp: int) -> None:
        """A gradient of ``optimizer`` waits for its update with its σ still open: its updates stay kept."""
        self.waiting[optimizer].append(timestamp)

    def applied(self, optimizer: int) -> None:
        """The gradients of ``optimizer`` that waited have their σ."""
        self.waiting[optimizer].clear()

    def updated(self, optimizer: int, clock: int, author: Optional[int]) -> None:
        """``optimizer`` made the update that produced ``clock``, of ``author``'s gradients alone (None: of
        several learners')."""
        if len(self.touches) == 1:
            return
        for k, touched in enumerate(self.touches):
            updates = self.updates[k]
            if optimizer in touched:
                updates.append(UpdateMade(clock, optimizer, author))
            # no gradient of k is that old any more (an optimizer never stepped keeps no other's updates alive
            # beyond the capacity)
            drop = max(bisect_right(updates, self.oldest(clock, k), key=_clock), len(updates) - self.capacity)
            if drop > 0:
                self.exact_from[k] = max(self.exact_from[k], updates[drop - 1].clock)
                del updates[:drop]

    def left(self, learner: int) -> None:
        """``learner`` pushes no more (finished or lost): it holds no old weights (its gradients still waiting
        keep theirs)."""
        for key in [key for key in self.last_push if key[0] == learner]:
            del self.last_push[key]

    def joined(self, learner: int, clock: int) -> None:
        """``learner`` is back: it pushes from the weights of ``clock`` on."""
        for k in range(len(self.touches)):
            self.last_push[learner, k] = clock
            self.pushed_at[learner, k] = clock
