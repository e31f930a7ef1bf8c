"""Gradient clipping on the server: the gradient an update applies is clipped, as DDP clips the averaged gradient
(clipping each learner's gradient before the push, then averaging, is another update). Plain torch.

A learner asks for it with a push (:class:`Clipping`: Lightning's ``gradient_clip_val`` and
``gradient_clip_algorithm``, or the module's own ``clip_gradients`` call); the server clips the combined gradient of
that optimizer's update (:func:`clip`) before its optimizer steps: after averaging and compensation, as DDP clips
before its optimizer steps. Under async an update holds one gradient: clipping it there is what one learner alone
would do.

By norm, the norm is over all of an optimizer's parameters; a server that holds a cut of them cannot know it alone,
so clipping by norm is refused where several servers each hold a part of the optimizer (:func:`check_clipping`).
By value, every element is clipped on its own: exact at any cut.
"""

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

CLIP_ALGORITHMS = ("norm", "value")


@dataclass(frozen=True)
class Clipping:
    """Clip an update's gradient: its norm over the optimizer's parameters to at most ``value`` (``"norm"``, as
    ``torch.nn.utils.clip_grad_norm_``), or each element to ``[-value, value]`` (``"value"``)."""

    value: float
    algorithm: str = "norm"

    def __post_init__(self) -> None:
        check(self)


def check(clipping: Any) -> None:
    """A clipping request as it arrives (unpickling skips ``__post_init__``): refused by name if it is not one."""
    if not isinstance(clipping, Clipping):
        raise ValueError(f"clipping={clipping!r} is not valid: expected None or a Clipping(value, algorithm).")
    value = getattr(clipping, "value", None)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
        raise ValueError(f"gradient clipping value {value!r} is not valid: expected a finite number > 0.")
    algorithm = getattr(clipping, "algorithm", None)
    if not isinstance(algorithm, str) or algorithm not in CLIP_ALGORITHMS:
        raise ValueError(
            f"gradient clipping algorithm {algorithm!r} is not supported: expected one of "
            f"{', '.join(map(repr, CLIP_ALGORITHMS))}."
        )


def check_clipping(clipping: Optional[Clipping], servers: int, optimizer: int) -> None:
    """Clipping by norm needs the norm over all of the optimizer's parameters, which ``servers`` servers each
    holding a cut of them cannot compute alone."""
    if clipping is None or clipping.algorithm != "norm" or servers <= 1:
        return
    raise ValueError(
        f"gradient clipping by norm (gradient_clip_val={clipping.value}) is not supported when the parameters of "
        f"optimizer {optimizer} are cut between {servers} parameter servers: the norm is over all of them, and each "
        "server holds only its part. Use RudraStrategy(num_servers=1), or clip by value "
        "(Trainer(gradient_clip_algorithm='value'), or self.clip_gradients(..., gradient_clip_algorithm='value'))."
    )


def clip(params: Sequence[Tensor], clipping: Optional[Clipping], scale: float = 1.0) -> None:
    """Clip the gradients of ``params`` (one optimizer's, as the server holds them) in place. ``scale``: the mean
    factor the update's gradients were scaled by (``lr_modulation="per_gradient"``); the limit is scaled alike, so
    that a stale gradient is clipped as its learner would have clipped it and still modulated (exact for one
    gradient per update)."""
    if clipping is None:
        return
    grads = [p for p in params if p.grad is not None]
    if not grads:  # this server holds none of the optimizer's parameters, or none got a gradient
        return
    if clipping.algorithm == "norm":
        torch.nn.utils.clip_grad_norm_(grads, clipping.value * scale)
    else:
        torch.nn.utils.clip_grad_value_(grads, clipping.value * scale)
