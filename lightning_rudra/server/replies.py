"""The replies a parameter server (:class:`~lightning_rudra.server.model_server.ModelServer`) settles once its lock
is released: futures with their values or exceptions (:data:`Outcomes`, :func:`resolve`), the pushes that wait in a
hardsync round (:class:`RoundWaiter`), the replies a closed round or the held pushes let go (:class:`Released`), and
a push's reply with the weights it carries (:func:`push_reply`). No RPC here."""

from typing import Any, NamedTuple

from torch.futures import Future

from lightning_rudra.core.update import PushReply
from lightning_rudra.core.weights import Weights

Outcomes = list[tuple[Future, Any]]  # futures to resolve once the lock is released: a value, or an exception


class RoundWaiter(NamedTuple):
    """A push that waits for the end of its hardsync round: its reply, its learner, and what became of its
    gradient (:class:`~lightning_rudra.core.update.PushResult`'s ``status`` and ``staleness``)."""

    reply: Future
    learner: int
    status: str
    staleness: int


class Released(NamedTuple):
    """The replies to the pushes that waited in closed hardsync rounds, and the weights they carry."""

    outcomes: Outcomes
    weights: Weights


def resolve(outcomes: Outcomes) -> None:
    """Resolve each future not yet done with its value, or fail it with its exception."""
    for future, value in outcomes:
        if future.done():
            continue
        if isinstance(value, BaseException):
            future.set_exception(value)
        else:
            future.set_result(value)


def push_reply(status: str, staleness: int, lr_scale: float, weights: Weights) -> PushReply:
    """A push's reply: what became of its gradient (``status``, ``staleness``), the rate's scale, and ``weights``."""
    return PushReply(status, staleness, lr_scale, weights.params, weights.buffers, weights.clock)
