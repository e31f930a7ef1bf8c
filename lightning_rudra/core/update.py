"""A push and what became of it, as plain data: the push itself (:class:`Push`), the weight update it closed
(:class:`Update`), the server's account of it (:class:`PushResult`) and the learner's reply over RPC
(:class:`PushReply`). Words as in :mod:`lightning_rudra.core.protocol`."""

from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Sequence

from torch import Tensor

from lightning_rudra.core.clipping import Clipping


@dataclass(frozen=True)
class Push:
    """One learner's gradient for one server, as the learner builds it and the server's protocol takes it
    (:meth:`Server.push <lightning_rudra.core.protocol.Server.push>`), over RPC or the push stream unchanged.

    ``learner`` pushes for ``optimizer`` the gradient ``grads``, packed with that optimizer's gradient layout on this
    server (zeros where ``has_grad`` is False; None: it is in the learner's shared-memory buffer), computed from the
    weights of ``timestamp``, with its parameter groups' hyper-parameters ``hparams`` (its LR schedule stays in
    charge) and its flat ``buffers``. ``finite``: whether the whole gradient has no NaN or Inf, if the learner checked
    (None: the server checks its part). ``members``, ``refused``: a node's push (node-local aggregation: the gradient
    is the sum of those of ``learner`` and ``members`` but ``refused``). ``clipping``: how the server clips the
    gradient its update applies, by each in turn (:mod:`lightning_rudra.core.clipping`)."""

    learner: int
    optimizer: int
    grads: Optional[Sequence[Tensor]]
    has_grad: Tensor
    timestamp: int
    hparams: Sequence[dict[str, Any]]
    buffers: Sequence[Tensor]
    finite: Optional[bool] = None
    members: Sequence[int] = ()
    refused: Sequence[int] = ()
    clipping: Sequence[Clipping] = ()


@dataclass(frozen=True)
class Update:
    """One weight update: which optimizer, the clock it produced, σ of each gradient averaged into it, the
    factor its learning rate was multiplied by (``mean``) or each gradient was scaled by (``per_gradient``), and
    the factor the ``momentum`` compensation multiplied the rate of its first parameter group by."""

    optimizer: int
    clock: int
    staleness: tuple[int, ...]
    lr_factor: float
    gradient_scales: tuple[float, ...]
    rule_scale: float = 1.0

    @property
    def lr_scale(self) -> float:
        """The learning rate applied (first parameter group), as a fraction of the learners' rate: either
        modulation rule and the compensation's rescaling."""
        return self.lr_factor * self.rule_scale * sum(self.gradient_scales) / len(self.gradient_scales)


@dataclass(frozen=True)
class PushResult:
    """What became of one pushed gradient. ``status`` is ``accepted``, ``dropped`` (staler than the bound),
    ``rejected`` (non-finite) or ``queued`` (several optimizers: its σ, and so whether it is dropped, is decided
    when its update applies; ``staleness`` is then σ so far). ``closed`` says this push completed its
    optimizer's wait (a hardsync round, or c softsync gradients); ``update`` is the update that applied, None
    if every gradient in it was refused."""

    status: str
    staleness: int
    closed: bool = False
    update: Optional[Update] = None


class PushReply(NamedTuple):
    """What a learner gets back for a push, over RPC: what became of its gradient (``status``, ``staleness``, as
    in :class:`PushResult`), the rate its optimizer's newest update applied as a fraction of the learner's
    (``lr_scale``), and the weights to go on from, flat (``params``, ``buffers``; None: read them from shared
    memory), with their timestamp (``clock``). A hardsync reply comes at the end of the round."""

    status: str
    staleness: int
    lr_scale: float
    params: Optional[list[Tensor]]
    buffers: Optional[list[Tensor]]
    clock: int
