"""Gradient clipping moved from the learner to the server (:mod:`lightning_rudra.core.clipping`): Lightning clips
each learner's gradient before the step (``Trainer(gradient_clip_val=...)``, or the module's own
``self.clip_gradients(...)`` in ``configure_gradient_clipping`` or in manual optimization), and the server would then
average clipped gradients, where DDP clips the averaged one. Every such call reaches the precision plugin's
``clip_gradients``: while fitting, it adds the request to those of the wrapped optimizer instead, whose next push
carries them in turn, and the server clips what its update applies. What a module clips by its own hand (``torch.nn.utils`` in
``configure_gradient_clipping`` or ``on_before_optimizer_step``) stays on the learner, on its own gradient."""

from typing import Any, Callable, Union

from pytorch_lightning.plugins.precision import Precision
from pytorch_lightning.utilities import GradClipAlgorithmType
from torch.optim import Optimizer

from lightning_rudra.core.clipping import Clipping
from lightning_rudra.learner.optimizer import LearnerOptimizer


def clip_on_the_server(precision: Precision, check: Callable[[float, str, int], None]) -> None:
    """From now on, ``precision``'s clipping is asked of the server (an instance attribute over the class's method,
    which :func:`clip_on_the_learner` removes); ``check(value, algorithm, optimizer)`` refuses what the servers
    cannot do (:func:`~lightning_rudra.strategy.checks.check_clipping`), before the push."""

    def clip_gradients(
        optimizer: Optimizer,
        clip_val: Union[int, float] = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        wrapped = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer around it, in manual optimization
        if not isinstance(wrapped, LearnerOptimizer):  # no step to push (configure_optimizers returned None)
            return type(precision).clip_gradients(precision, optimizer, clip_val, gradient_clip_algorithm)
        if clip_val <= 0:  # Lightning's rule: no clipping
            return
        algorithm = GradClipAlgorithmType(gradient_clip_algorithm).value
        check(float(clip_val), algorithm, wrapped.index)
        # after any clipping asked before in this step: Lightning applies successive calls in turn
        wrapped.clipping += (Clipping(float(clip_val), algorithm),)

    precision.clip_gradients = clip_gradients  # type: ignore[method-assign]


def clip_on_the_learner(precision: Any) -> None:
    """The precision plugin clips as Lightning made it again."""
    precision.__dict__.pop("clip_gradients", None)
