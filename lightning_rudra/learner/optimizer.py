"""A learner's optimizer (:class:`LearnerOptimizer`): it stands in for a torch optimizer, and its steps push the
gradient through a :class:`~lightning_rudra.learner.learner.Learner` and take back the weights the server gives.
Lightning-free: a plain training loop can use it as well as the strategy."""

from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch.optim import Optimizer

from lightning_rudra.core.clipping import Clipping
from lightning_rudra.transport.elastic import incarnation_of

if TYPE_CHECKING:
    from lightning_rudra.learner.learner import Learner


class LearnerOptimizer(Optimizer):
    """``step(closure)`` runs the closure (forward and backward), pushes the gradient and takes back the
    weights the protocol gives. The wrapped optimizer never updates weights itself: its ``param_groups`` stay
    the handle of LR schedulers (their current values travel with every push), and its state lives on the
    server (``state_dict`` fetches it). ``clipping``, added to before a step (the strategy adds each clipping
    Lightning would apply, in turn), travels with that step's push: the server clips the gradient its update applies.

    Torch's ``Optimizer.__init__`` is not called: the groups and state are the wrapped optimizer's own.
    """

    def __init__(self, optimizer: Optimizer, index: int, learner: "Learner") -> None:
        self.local = optimizer
        self.index = index
        self.learner = learner
        self.clipping: tuple[Clipping, ...] = ()

    param_groups = property(lambda self: self.local.param_groups)
    state = property(lambda self: self.local.state)
    defaults = property(lambda self: self.local.defaults)

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            self.learner.backward_begins(self.index)
            try:
                with torch.enable_grad():
                    loss = closure()
            except BaseException as error:
                self.learner.backward_failed(error)
                raise
        clipping, self.clipping = self.clipping, ()
        self.learner.push(self.index, self.local, clipping)
        # what torch's LR schedulers check (a flag torch's Optimizer sets but does not declare): the server stepped
        self.local._opt_called = True  # type: ignore[attr-defined]
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The gradient ends, and the clippings asked of it with it (a step skipped by zero_grad: the next step asks
        anew). Lightning's automatic optimization zeroes in the step's closure, before the clipping it asks."""
        self.local.zero_grad(set_to_none=set_to_none)
        self.clipping = ()
        self.learner.forget_gradient(self.index)

    def state_dict(self) -> dict[str, Any]:
        """The server's state (momentum, moments...) with this learner's parameter groups: their learning rate
        is the one the learner's schedule set, not the server's modulated one."""
        return with_groups(self.learner.optimizer_state(self.index), self.local)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore this learner's parameter groups and the server's state (learner 0's first process sends it: a
        new one that takes its place, resuming from the same checkpoint, must not reset the running server's)."""
        self.load_groups(state_dict)
        rank = self.learner.client.rank
        if rank == 0 and not incarnation_of(rank):
            self.learner.load_optimizer_state(self.index, state_dict)

    def load_groups(self, state_dict: dict[str, Any]) -> None:
        """Only the hyper-parameters of the parameter groups (where LR schedulers step from)."""
        saved = state_dict["param_groups"]
        if len(saved) != len(self.local.param_groups):
            raise ValueError(
                f"the saved state of optimizer {self.index} has {len(saved)} parameter groups: its "
                f"optimizer {type(self.local).__name__} has {len(self.local.param_groups)}."
            )
        for group, values in zip(self.local.param_groups, saved):
            group.update({k: v for k, v in values.items() if k != "params"})

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise RuntimeError(
            "parameter groups cannot be added once training under RudraStrategy has started: the "
            "server built its copy of the optimizer from the groups that existed at setup."
        )

    def __repr__(self) -> str:
        return f"LearnerOptimizer({self.local!r})"


def with_groups(state: dict[str, Any], optimizer: Optimizer) -> dict[str, Any]:
    """An optimizer state dict from the server (``state``) with the parameter groups of the learner's
    ``optimizer``: what a checkpoint holds."""
    return {"state": state["state"], "param_groups": optimizer.state_dict()["param_groups"]}
