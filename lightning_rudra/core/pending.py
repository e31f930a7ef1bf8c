"""The gradients of one optimizer that the server has received since its last update (:class:`Pending`): the
running sum an update averages, or the gradients kept whole until it. Words as in
:mod:`lightning_rudra.core.protocol`."""

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from lightning_rudra.core.clipping import Clipping
from lightning_rudra.core.staleness import OwnSteps


@dataclass
class Gradient:
    """A pushed gradient waiting for its update with its σ still open (see ``Server.push``)."""

    grads: Sequence[Tensor]
    has_grad: Tensor
    buffers: Sequence[Tensor]
    timestamp: int
    count: int = 1  # learners whose gradients it sums (a node's push)
    own: Optional[OwnSteps] = None  # its learner's steps that are no staleness to it
    learners: tuple[int, ...] = ()  # whose gradients it sums (``count`` of them)


@dataclass
class Pending:
    """Gradients of one optimizer received since its last update: summed as they arrive, or kept whole
    (``waiting``) until the update if another optimizer's update may still change their σ."""

    grads: Optional[list[Tensor]] = None
    has_grad: Optional[Tensor] = None
    buffers: Optional[list[Tensor]] = None
    waiting: list[Gradient] = field(default_factory=list)
    received: int = 0  # gradients towards the next update (not the rejected ones)
    staleness: list[int] = field(default_factory=list)  # of the gradients summed
    scales: list[float] = field(default_factory=list)
    learners: set[int] = field(default_factory=set)  # who pushed (hardsync: one gradient each)
    authors: list[int] = field(default_factory=list)  # whose gradients are summed (not refused, not dropped)
    # the learner whose own push closed this update of its gradients alone: no staleness to its other optimizers'
    # gradients pushed after (core/staleness.py); None for any other update
    author: Optional[int] = None
    hparams: Optional[list[dict[str, Any]]] = None
    clipping: tuple[Clipping, ...] = ()  # of the update, as the newest push asked, in turn (hardsync: the first)
    asked_by: Optional[int] = None  # hardsync: the learner whose push came first, whose clipping every push asks

    def add(
        self,
        grads: Sequence[Tensor],
        has_grad: Tensor,
        buffers: Sequence[Tensor],
        sigma: int,
        scale: float,
        count: int = 1,
        learners: Sequence[int] = (),
    ) -> None:
        """Sum an admitted gradient (scaled by ``scale``) and its buffers in place, and count its σ; ``count``: the
        learners whose gradients (and floating-point buffers) it already sums, each counted in the average;
        ``learners``: who they are."""
        if self.grads is None:
            self.grads = [_accumulator(g, scale) for g in grads]
            self.has_grad = has_grad
            self.buffers = [_accumulator(b, 1.0) for b in buffers]
        else:
            assert self.has_grad is not None and self.buffers is not None  # set with the first gradient summed
            for total, g in zip(self.grads, grads):
                total.add_(g, alpha=scale)
            self.has_grad |= has_grad
            for total, b in zip(self.buffers, buffers):
                total.add_(b) if total.is_floating_point() else total.copy_(b)
        self.staleness += [sigma] * count
        self.scales += [scale] * count
        self.authors += learners


def _accumulator(t: Tensor, scale: float) -> Tensor:
    """The running sum starts as the first tensor itself; half precision sums in float32."""
    if t.dtype in (torch.float16, torch.bfloat16):
        t = t.float()
    return t.mul_(scale) if scale != 1.0 else t
