"""The weights as a server hands them out, as plain data: a pull's, a reply's or the final ones (:class:`Weights`),
and what a checkpoint holds of one server (:class:`Snapshot`). Words as in :mod:`lightning_rudra.core.protocol`."""

from typing import Any, NamedTuple, Optional

from torch import Tensor

from lightning_rudra.core.stats import Stats


class Weights(NamedTuple):
    """The weights and buffers, flat as the server keeps them (None: read them from shared memory), and their
    timestamp: the clock that made them."""

    params: Optional[list[Tensor]]
    buffers: Optional[list[Tensor]]
    clock: int


class Snapshot(NamedTuple):
    """What a checkpoint holds of one server, all of one clock: its weights and buffers (flat), the clock, every
    optimizer's state (with the compensation rules') and a copy of the statistics."""

    params: list[Tensor]
    buffers: list[Tensor]
    clock: int
    states: list[dict[str, Any]]
    stats: Stats
