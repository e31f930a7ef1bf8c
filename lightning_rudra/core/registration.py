"""What learner 0 gives a server to start from (:class:`Registration`), as plain data: from the learner, through its
client and RPC, to the server. Words as in :mod:`lightning_rudra.core.protocol`."""

from dataclasses import dataclass
from typing import Any, Optional

from torch import Tensor

from lightning_rudra.core.config import ProtocolConfig
from lightning_rudra.core.optimizers import OptimizerSpec
from lightning_rudra.core.stats import Stats


@dataclass(frozen=True)
class Registration:
    """A server's part of the model: the ``config`` of the protocol, the starting weights and buffers (flat lists of
    tensors), the ``specs`` of the optimizers it rebuilds to apply the updates, and on resume the ``stats`` and the
    ``optimizer_states`` saved. ``shared_memory``: the weights live in the server's shared memory (on its host);
    ``module``: what a learner that rejoins must match (:func:`~lightning_rudra.server.rejoins.describe_module`)."""

    config: ProtocolConfig
    params: list[Tensor]
    buffers: list[Tensor]
    specs: list[OptimizerSpec]
    stats: Optional[Stats] = None
    shared_memory: bool = True
    optimizer_states: Optional[list[dict[str, Any]]] = None
    module: Optional[dict[str, Any]] = None
