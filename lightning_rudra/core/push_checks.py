"""What a push must be before the server takes it (:meth:`Server.push <lightning_rudra.core.protocol.Server.push>`):
its fields as the optimizer's layout and the clock expect, the clipping it asks, and its place in a hardsync round.
Each check raises with the value, why it is refused and what to expect; none changes anything. Words as in
:mod:`lightning_rudra.core.protocol`."""

from typing import Sequence

import torch
from torch import Tensor

from lightning_rudra.core.clipping import Clipping, check_all, check_same, check_servers, refuse_softsync
from lightning_rudra.core.config import ProtocolConfig
from lightning_rudra.core.flat import FlatLayout
from lightning_rudra.core.pending import Pending
from lightning_rudra.core.update import Push


def all_finite(tensors: Sequence[Tensor]) -> bool:
    """No NaN or Inf: a finite sum means every element is finite (NaN and Inf propagate); only check each element
    if not."""
    return all(bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all()) for t in tensors)


def is_index(value: object) -> bool:
    """An int, not a bool: Python counts True as 1, so ``True in range(2)`` holds."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_optimizer(optimizer: int, count: int) -> None:
    """``optimizer`` is the index of one of the server's ``count`` optimizers."""
    if not is_index(optimizer):
        raise ValueError(
            f"optimizer index {optimizer!r} is not valid: expected an int (not a bool), one of the server's {count} "
            f"optimizer(s), indices 0..{count - 1}."
        )
    if optimizer not in range(count):
        raise ValueError(
            f"optimizer index {optimizer!r} is unknown: the server holds {count} optimizer(s), indices 0..{count - 1}."
        )


def check_fields(push: Push, grad_layout: FlatLayout, num_groups: int, buffer_layout: FlatLayout, clock: int) -> None:
    """The gradient, its flags, timestamp, hyper-parameters and buffers of ``push``: laid out as the server holds its
    optimizer (``grad_layout``, ``num_groups`` parameter groups) and buffers, from weights the server made by
    ``clock``."""
    learner, optimizer = push.learner, push.optimizer
    grads = () if push.grads is None else push.grads  # None: the server process reads it in shared memory first
    grad_layout.check(grads, f"the gradient pushed by learner {learner} for optimizer {optimizer}")
    num_params, has_grad = len(grad_layout), push.has_grad
    if not (isinstance(has_grad, Tensor) and has_grad.dtype == torch.bool and has_grad.shape == (num_params,)):
        raise ValueError(
            f"has_grad from learner {learner} must be a bool tensor of shape ({num_params},), got {has_grad!r}."
        )
    timestamp = push.timestamp
    if isinstance(timestamp, bool) or not isinstance(timestamp, int) or not 0 <= timestamp <= clock:
        raise ValueError(
            f"timestamp {timestamp!r} from learner {learner} is not valid: expected an integer "
            f"between 0 and the server clock {clock}."
        )
    if not isinstance(push.hparams, (list, tuple)):
        raise ValueError(
            f"hparams={push.hparams!r} from learner {learner} is not valid: expected a list of {num_groups} dicts, "
            f"the hyper-parameters of each parameter group of optimizer {optimizer}."
        )
    if len(push.hparams) != num_groups:
        raise ValueError(
            f"learner {learner} sent hyper-parameters for {len(push.hparams)} parameter groups of "
            f"optimizer {optimizer}: expected {num_groups}."
        )
    for hp in push.hparams:
        lr = hp.get("lr") if isinstance(hp, dict) else None
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr >= 0:
            raise ValueError(
                f"learner {learner} sent the learning rate {lr!r} for optimizer {optimizer}: "
                "expected a number >= 0 in every parameter group."
            )
    buffer_layout.check(push.buffers, f"the buffers pushed by learner {learner}")
    if push.finite is not None and not isinstance(push.finite, bool):  # anything truthy would skip the NaN check
        raise ValueError(
            f"finite={push.finite!r} from learner {learner} is not valid: expected True or False (the learner checked "
            "the whole gradient for NaN and Inf) or None (the server checks its part)."
        )
    for name, learners in (("members", push.members), ("refused", push.refused)):
        if not isinstance(learners, (list, tuple)) or not all(is_index(who) for who in learners):
            raise ValueError(
                f"{name}={learners!r} from learner {learner} is not valid: expected a list of learners' indices "
                "(ints; empty but for a node's push)."
            )


def check_clipping(push: Push, config: ProtocolConfig, gradients_per_update: int) -> tuple[Clipping, ...]:
    """The clippings ``push`` asks, as the update can apply them (:mod:`lightning_rudra.core.clipping`): at most one
    by norm over several servers, and none under softsync with c = ``gradients_per_update`` > 1."""
    clipping = check_all(push.clipping)
    servers = max((len(request.servers) for request in clipping if request.global_norm), default=1)
    check_servers(clipping, servers, push.optimizer)
    if config.protocol == "softsync" and gradients_per_update > 1:
        for request in clipping:
            if request.global_norm:
                c, n, learners = gradients_per_update, config.n, config.num_learners
                refuse_softsync(request.value, push.optimizer, len(request.servers), c, n, learners)
    return clipping


def check_round(push: Push, group: Sequence[int], pending: Pending, clipping: Sequence[Clipping], clock: int) -> None:
    """Hardsync: the learners of ``group`` (the pusher and a node's members) have not pushed in the round
    ``pending`` holds, and ``push`` asks the ``clipping`` the round's first push asked."""
    for who in group:
        if who in pending.learners:
            raise RuntimeError(
                f"learner {who} pushed twice for optimizer {push.optimizer} in one hardsync round "
                f"(clock {clock}): hardsync takes one gradient from every learner per update."
            )
    if pending.asked_by is not None:
        check_same(clipping, push.learner, pending.clipping, pending.asked_by, push.optimizer)
