"""Hardsync clipping by norm over several servers' parts (:mod:`lightning_rudra.core.clipping`): a round whose
clipping waits for the other servers' squared norms of their parts (:attr:`Server.awaiting_norm`) sends its own to
them and applies once it has them all. Its methods run under the
:class:`~lightning_rudra.server.model_server.ModelServer`'s lock; what they send goes out once it is released."""

import math
from typing import Any, Sequence

from lightning_rudra.core.protocol import Server

Part = tuple[int, int, int, float]  # (server, optimizer, round, squared norm of that server's part)


class NormExchange:
    def __init__(self, server: int) -> None:
        """``server``: which of the servers this one is."""
        self.server = server
        self.norms: dict[tuple[int, int], dict[int, float]] = {}  # (optimizer, round) -> server -> its part
        self.outbox: list[Part] = []  # this server's parts, to send once the lock is released (to server, ...)
        self.holders: dict[int, tuple[int, ...]] = {}  # per optimizer, the servers its pushes named (a fixed cut)

    def pushed(self, optimizer: int, clippings: Sequence[Any]) -> None:
        """A push's clippings, as the server took them: the servers that hold a part of ``optimizer``."""
        for clipping in clippings:
            if clipping.global_norm:
                self.holders[optimizer] = clipping.servers

    def applied(self, core: Server, closed: list[int]) -> list[int]:
        """Of the optimizers whose wait just ``closed``, those whose update applied. A hardsync round clipped by norm
        over several servers' parts waits for the others' (:meth:`add`): this server's part is sent to them."""
        for optimizer in closed:
            if optimizer in core.awaiting_norm:
                wait = core.awaiting_norm[optimizer][0]
                self.holders[optimizer] = wait.servers
                self.norms.setdefault((optimizer, wait.round), {})[self.server] = wait.partial
                self.outbox += [
                    (other, optimizer, wait.round, wait.partial) for other in wait.servers if other != self.server
                ]
        return [
            optimizer for optimizer in closed if optimizer not in core.awaiting_norm or self._apply(core, optimizer)
        ]

    def _apply(self, core: Server, optimizer: int) -> bool:
        """Apply the update of ``optimizer`` waiting for the other servers' parts of its norm, if all are here."""
        wait = core.awaiting_norm[optimizer][0]
        parts = self.norms.get((optimizer, wait.round), {})
        if not set(wait.servers) <= parts.keys():
            return False
        for key in [key for key in self.norms if key[0] == optimizer and key[1] <= wait.round]:
            del self.norms[key]  # this round's, and any of a round that applied here without waiting (none summed)
        core.apply_norm(optimizer, sum(parts[server] for server in wait.servers) ** 0.5)
        return True

    def add(self, core: Server, server: int, optimizer: int, round: int, partial: float) -> bool:
        """Server ``server``'s squared norm of its part of the gradient of ``optimizer``'s hardsync round ``round``;
        whether the update it completes applied. Refused by name (and kept nowhere) unless it comes from another
        server that holds a part, for an optimizer of this model, for the round open here or the next, and is the
        first value for that part: a caller cannot overwrite a part, nor fill this server with parts."""
        where = f"a part of the gradient's norm from server {server} for round {round} of optimizer {optimizer}"
        if optimizer >= len(core.optimizers):
            raise ValueError(f"{where} is refused: expected one of 0 to {len(core.optimizers) - 1}.")
        holders = self.holders.get(optimizer)
        if server == self.server or (holders is not None and server not in holders):
            among = f"among {holders}" if holders is not None else f"than this one ({self.server})"
            raise ValueError(f"{where} is refused: expected another server {among}.")
        waiting = core.awaiting_norm.get(optimizer)
        open_round = core.rounds[optimizer] + (0 if waiting is not None else 1)
        if round not in (open_round, open_round + 1):
            raise ValueError(
                f"{where} is refused: expected round {open_round} or {open_round + 1} (the round open on this "
                "server, or the next)."
            )
        parts = self.norms.setdefault((optimizer, round), {})
        if server in parts:
            raise ValueError(f"{where} is refused: server {server} sent already ({parts[server]}); the first holds.")
        parts[server] = partial
        return waiting is not None and waiting[0].round == round and self._apply(core, optimizer)

    def take_outbox(self) -> list[Part]:
        outbox, self.outbox = self.outbox, []
        return outbox

    def clear(self) -> None:
        """Training cannot go on: no round applies any more, nothing more is sent."""
        self.norms, self.outbox = {}, []


def check_part(server: Any, optimizer: Any, round: Any, partial: Any) -> None:
    """A part of a norm as it arrives: refused by name if it is not (server, optimizer, round, squared norm)."""
    numbers = (server, optimizer, round)
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in numbers) or not (
        isinstance(partial, float) and math.isfinite(partial) and partial >= 0
    ):
        raise ValueError(
            f"round_norm{(server, optimizer, round, partial)!r} is not valid: expected a server, an optimizer and "
            "a round (integers >= 0) and a squared norm (a finite float >= 0)."
        )
