"""The replies a parameter server (:class:`~lightning_rudra.server.model_server.ModelServer`) owes but holds back, and
their release: pushes that wait for the end of a hardsync round (or, paced, of a batchsync round), per optimizer, and
pushes held back by ``on_stale='block'``, per learner. Called under the server's lock; the futures released are
settled once it is released (:func:`~lightning_rudra.server.replies.resolve`). No RPC here."""

import time
from typing import Optional

from torch.futures import Future

from lightning_rudra.core.protocol import Server
from lightning_rudra.core.weights import Weights
from lightning_rudra.server.pacing import RoundPacing
from lightning_rudra.server.replies import Outcomes, Released, RoundWaiter, push_reply
from lightning_rudra.server.shared_side import SharedSide


class OwedReplies:
    """What :class:`ModelServer` owes its learners: :attr:`in_rounds` (optimizer -> the pushes waiting in its round)
    and :attr:`held` (learner -> the reply to its push held back). ``shared``: where the weights of a reply come
    from (its learners' shared memory, or a copy)."""

    def __init__(self, shared: SharedSide) -> None:
        self.shared = shared
        self.in_rounds: dict[int, list[RoundWaiter]] = {}
        self.held: dict[int, Future] = {}
        self.pacing: Optional[RoundPacing] = None  # batchsync: whose reply waits for the round (pacing.py)

    def wait_in_round(self, optimizer: int, learner: int, status: str, staleness: int) -> Future:
        reply: Future = Future()
        self.in_rounds.setdefault(optimizer, []).append(RoundWaiter(reply, learner, status, staleness))
        return reply

    def hold(self, learner: int) -> Future:
        reply = self.held[learner] = Future()
        return reply

    def learners_in_rounds(self) -> list[int]:
        return sorted({waiter.learner for waiting in self.in_rounds.values() for waiter in waiting})

    def release_rounds(self, core: Server, closed: list[int], pusher: Optional[int] = None) -> Released:
        """The replies to the pushes that waited in the rounds of the ``closed`` optimizers, and the weights they
        carry (also for ``pusher``, which did not wait)."""
        released = [(waiter, optimizer) for optimizer in closed for waiter in self.in_rounds.pop(optimizer, [])]
        learners = ([] if pusher is None else [pusher]) + [waiter.learner for waiter, _ in released]
        weights = self.weights(core, learners)
        if self.pacing is not None:  # what each of them computes on from now
            now = time.monotonic()
            for who in set(learners) & core.active:
                self.pacing.handed_out(who, now, weights.clock)
        return Released(
            [
                (waiter.reply, push_reply(waiter.status, waiter.staleness, lr_scale(core, optimizer), weights))
                for waiter, optimizer in released
            ],
            weights,
        )

    def release_held(self, core: Server, waiting: set[int], pusher: Optional[int] = None) -> Released:
        """``on_stale='block'``: the replies to the held pushes that may go now (:meth:`Server.release`, which
        applies them; a push whose application raised fails with its error), and the weights they carry (also for
        ``pusher``, whose push was taken). The learners ``waiting`` at a collective hold nobody back."""
        released = core.release(waiting & core.active)
        learners = ([] if pusher is None else [pusher]) + [push.learner for push, _ in released]
        if not learners:
            return Released([], Weights(None, None, core.clock))
        weights = self.weights(core, learners)
        return Released(
            [
                (
                    self.held.pop(push.learner),
                    result
                    if isinstance(result, Exception)
                    else push_reply(result.status, result.staleness, lr_scale(core, push.optimizer), weights),
                )
                for push, result in released
            ],
            weights,
        )

    def weights(self, core: Server, learners: list[int]) -> Weights:
        return self.shared.reply(learners, core)

    def lose(self, learner: int, error: Exception) -> Outcomes:
        """``learner`` was lost: its replies owed fail with ``error`` (a held push is not applied; a gradient in a
        round stays there, as :meth:`Server.remove` decides)."""
        owed = [self.held.pop(learner)] if learner in self.held else []
        for optimizer, waiting in list(self.in_rounds.items()):
            owed += [waiter.reply for waiter in waiting if waiter.learner == learner]
            self.in_rounds[optimizer] = [waiter for waiter in waiting if waiter.learner != learner]
        return [(reply, error) for reply in owed]

    def take_all(self) -> list[Future]:
        """Training cannot go on: every reply owed, taken from the books (to be failed)."""
        owed = [waiter.reply for waiting in self.in_rounds.values() for waiter in waiting] + list(self.held.values())
        self.in_rounds, self.held = {}, {}
        return owed


def lr_scale(core: Server, optimizer: int) -> float:
    """The rate's scale of ``optimizer``'s last update (1 before any)."""
    update = core.last_updates[optimizer]
    return update.lr_scale if update is not None else 1.0
