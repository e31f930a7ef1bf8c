"""Staleness per optimizer: σ of a gradient counts the updates, since the weights it came from, that changed its
optimizer's parameters. Plain Python.

The server's clock counts every update of the model, whichever optimizer made it; a GAN's step (one backward, then
the discriminator's and the generator's updates) would otherwise make the second gradient one update stale although
nothing it updates had moved, and the staleness rules (``max_staleness``, the modulations, the compensation) would
treat it so even with one learner. An optimizer's parameters change with its own updates and with those of any
optimizer that shares a parameter with it; with one optimizer σ is the paper's i − j.
"""

from bisect import bisect_right
from typing import Optional, Sequence


class OptimizerClocks:
    """Which updates changed each optimizer's parameters, since the oldest weights a learner may still push from.

    ``touches[k]``: the optimizers whose updates change optimizer k's parameters (k among them). For an optimizer
    that every update changes, σ is the clock's count and nothing is kept; for the others, the clocks of the updates
    that changed theirs, newer than the oldest timestamp of the learners' last pushes of that optimizer (a
    learner's gradients for one optimizer come from weights no older than its previous one's).
    """

    def __init__(self, touches: Sequence[frozenset[int]], num_learners: int, clock: int) -> None:
        self.touches = list(touches)
        self.updates: list[list[int]] = [[] for _ in self.touches]  # per optimizer, clocks after the updates
        self.last_push = {(learner, k): clock for learner in range(num_learners) for k in range(len(self.touches))}

    def _every_update(self, optimizer: int) -> bool:
        return len(self.touches[optimizer]) == len(self.touches)

    def staleness(self, optimizer: int, timestamp: int, clock: int) -> int:
        """σ of a gradient of ``optimizer`` from the weights of ``timestamp``, applied at ``clock``."""
        if self._every_update(optimizer):
            return clock - timestamp
        updates = self.updates[optimizer]
        return len(updates) - bisect_right(updates, timestamp)

    def oldest(self, clock: int, optimizer: Optional[int] = None) -> int:
        """The oldest timestamp a learner may still push a gradient (of ``optimizer``; None: of any) from
        (``clock`` if no learner pushes)."""
        return min((timestamp for (_, k), timestamp in self.last_push.items() if optimizer in (None, k)), default=clock)

    def pushed(self, learner: int, optimizer: int, timestamp: int) -> None:
        self.last_push[learner, optimizer] = timestamp

    def updated(self, optimizer: int, clock: int) -> None:
        """``optimizer`` made the update that produced ``clock``."""
        for k, touched in enumerate(self.touches):
            if self._every_update(k):
                continue
            if optimizer in touched:
                self.updates[k].append(clock)
            # no gradient of k is that old any more (an optimizer never stepped keeps no other's updates alive)
            del self.updates[k][: bisect_right(self.updates[k], self.oldest(clock, k))]

    def left(self, learner: int) -> None:
        """``learner`` pushes no more (finished or lost): it holds no old weights."""
        for key in [key for key in self.last_push if key[0] == learner]:
            del self.last_push[key]

    def joined(self, learner: int, clock: int) -> None:
        """``learner`` is back: it pushes from the weights of ``clock`` on."""
        for k in range(len(self.touches)):
            self.last_push[learner, k] = clock
