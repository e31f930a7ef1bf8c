"""SSP in the runtime model (:class:`SspGate`): the rule of :class:`lightning_rudra.core.ssp.StaleGate`, in plain
Python, on the clocks the simulation hands out (:mod:`lightning_rudra.core.runtime.simulation`)."""

import bisect
from typing import Optional


class SspGate:
    """Which held push the server may take, with ``bound`` (``max_staleness``), ``learners`` learners and
    ``per_update`` gradients an update. It keeps, per learner, the clock its next gradient comes from as the gate
    sees it (a held push's, an active learner's handed weights'), those clocks sorted, and the oldest clock handed
    out (None until found again)."""

    def __init__(self, bound: int, learners: int, per_update: int) -> None:
        self.bound = bound
        self.learners = learners
        self.per_update = per_update
        self.entry: dict[int, int] = {}
        self.entries: list[int] = []
        self.oldest_handed: Optional[int] = 0

    def may_take(self, learner: int, timestamp: int, clock: int, received: int, handed: dict[int, int]) -> bool:
        """Whether the server may take ``learner``'s push of a gradient from the weights of ``timestamp`` at
        ``clock``, with ``received`` gradients towards the open update (``handed``: each learner's clock)."""
        c, bound = self.per_update, self.bound
        # at once where even the oldest weights handed out, after every learner's gradient, stay within the bound
        # (every timestamp below is one of them or newer)
        if self.oldest_handed is None:
            self.oldest_handed = min(handed.values())
        if clock + (received + self.learners) // c - self.oldest_handed <= bound:
            return True
        # the others' clocks, oldest first: the m-th of them is applied after this push and m more, and must stay
        # within the bound; past the clock that every later one meets, none is looked at
        mine = self.entry.get(learner)
        others = len(self.entries) - (mine is not None)
        enough = clock + (received + others) // c - bound
        m = 0
        for t in self.entries:
            if mine is not None and t == mine:
                mine = None  # its own, once
                continue
            if (m == 0 and timestamp <= t) or t >= enough:
                return True
            if clock + (received + 1 + m) // c - t > bound:
                return False
            m += 1
        return True

    def enter(self, learner: int, now: Optional[int]) -> None:
        """``learner``'s clock as the gate sees it now (None: inactive and not held)."""
        old = self.entry.pop(learner, None)
        if old is not None:
            del self.entries[bisect.bisect_left(self.entries, old)]
        if now is not None:
            self.entry[learner] = now
            bisect.insort(self.entries, now)

    def handing(self, old: int) -> None:
        """A learner that held the weights of ``old`` is handed newer ones: the oldest may move."""
        if old == self.oldest_handed:
            self.oldest_handed = None
