"""How the server rebuilds a learner's optimizer: its class, its parameter groups and their hyper-parameters.
Plain torch."""

import numbers
from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch
from torch import Tensor

from lightning_rudra.core.errors import ConfigurationError

# Optimizer settings that pick a kernel for the learner's device; the server runs its own CPU copy.
_IMPLEMENTATION_KEYS = frozenset({"params", "foreach", "fused", "capturable", "differentiable"})


@dataclass(frozen=True)
class OptimizerSpec:
    """How to rebuild a learner's optimizer on the server: its class, and per parameter group the indices of
    its parameters (into the model's parameter list) and its hyper-parameters. ``shares_with``: the other
    optimizers (their indices) that update one of its parameters anywhere in the model, also on a server that
    holds none of them (see :func:`sharing_parameters`)."""

    cls: type
    groups: list[tuple[list[int], dict[str, Any]]]
    shares_with: tuple[int, ...] = ()

    @classmethod
    def from_optimizer(cls, optimizer: torch.optim.Optimizer, params: Sequence[Tensor]) -> "OptimizerSpec":
        index = {id(p): i for i, p in enumerate(params)}
        groups = []
        for group in optimizer.param_groups:
            missing = [tuple(p.shape) for p in group["params"] if id(p) not in index]
            if missing:
                raise ConfigurationError(
                    f"{type(optimizer).__name__} optimizes tensors of shapes {missing} that are not "
                    "parameters of the LightningModule: the server can only hold module parameters."
                )
            groups.append(([index[id(p)] for p in group["params"]], hyperparameters(group)))
        return cls(type(optimizer), groups)

    def build(self, params: Sequence[Tensor]) -> torch.optim.Optimizer:
        return self.cls([{"params": [params[i] for i in idx], **hp} for idx, hp in self.groups])


def sharing_parameters(specs: Sequence[OptimizerSpec]) -> list[OptimizerSpec]:
    """``specs`` with ``shares_with`` completed by the optimizers that share a parameter (index) with each: an
    update of one changes the weights of the others' gradients (:mod:`lightning_rudra.core.staleness`)."""
    params = [{i for idx, _ in spec.groups for i in idx} for spec in specs]
    return [
        replace(
            spec,
            shares_with=tuple(
                sorted(set(spec.shares_with) | {j for j, other in enumerate(params) if j != k and mine & other})
            ),
        )
        for k, (spec, mine) in enumerate(zip(specs, params))
    ]


def hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    """A parameter group's hyper-parameters (lr, momentum, ...), without its tensors or kernel choices. A
    one-element tensor (``lr=torch.tensor(0.1)``) or a numpy number (a config's, a schedule's) travels as the plain
    number it holds: the push stream carries plain values only."""
    return {k: _plain(v) for k, v in group.items() if k not in _IMPLEMENTATION_KEYS}


def _plain(value: Any) -> Any:
    if isinstance(value, Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, (tuple, list)):  # Adam's betas
        return type(value)(_plain(v) for v in value)
    if isinstance(value, numbers.Number) and type(value) not in (bool, int, float, complex):
        return value.item() if hasattr(value, "item") else float(value)  # type: ignore[arg-type]
    return value
