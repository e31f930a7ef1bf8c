"""The model families and optimizers the in-process studies train (``examples.study.compensation``'s ``train``).

A family is a model, its seeded data (train, validation and test splits) and its measure, lower is better:

- ``cnn``: the MNIST-1D example CNN (``examples.mnist1d``), test error.
- ``mlp``: a two-hidden-layer MLP (256 units) on the same MNIST-1D data, test error.
- ``lm``: the LSTM language model of ``examples.language_model`` (embedding 32, hidden 64, one layer) on its
  synthetic language whose entropy is known. The measure is the held-out loss in nats per predicted token; no model
  can go below the chain's entropy rate (the family's ``floor``), and predicting the uniform distribution costs
  ln ``VOCAB``.

An optimizer is one of ``OPTIMIZERS``: ``sgd`` (momentum 0.9), ``sgd-clip`` (plain SGD, gradients clipped to norm
``CLIP`` per update, the recipe of Lightning's LSTM demo and of the PyTorch word-language-model example it comes from),
``adam`` and ``adamw`` (weight decay ``WEIGHT_DECAY``).
"""

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from examples.language_model import VOCAB, LanguageModel, entropy_rate, held_out_loss, language_splits, token_loss
from examples.mnist1d import MNIST1DClassifier, generate_mnist1d
from lightning_rudra.core.clipping import Clipping

Splits = dict[str, tuple[Tensor, Tensor]]

NUM_SAMPLES = 4000  # MNIST-1D samples per seed
TEST_FRACTION = 0.2
VAL_FRACTION = 0.1  # of the training samples
OPTIMIZERS = ("sgd", "sgd-clip", "adam", "adamw")
CLIP = 0.25
WEIGHT_DECAY = 0.01


@dataclass(frozen=True)
class Family:
    """``data(seed)``: the seed's splits; ``model()``: a fresh model; ``loss(output, y)``: the training loss;
    ``measure(model, x, y)``: what the study reports (lower is better); ``worst``: the measure of weights that
    are no longer finite; ``floor(seed)``: the lowest possible measure, where it is known."""

    data: Callable[[int], Splits]
    model: Callable[[], nn.Module]
    loss: Callable[[Tensor, Tensor], Tensor]
    measure: Callable[[nn.Module, Tensor, Tensor], float]
    worst: float = 1.0
    floor: Optional[Callable[[int], float]] = None


def mnist1d_splits(seed: int, num_samples: Optional[int] = None) -> Splits:
    """Seed ``seed``'s own MNIST-1D sample of ``num_samples`` (default ``NUM_SAMPLES``): ``train``, ``val`` (the
    training samples' last ``VAL_FRACTION``) and ``test``, each (x, y)."""
    data = generate_mnist1d(num_samples or NUM_SAMPLES, seed, TEST_FRACTION)
    x, y = torch.tensor(data["x"], dtype=torch.float32), torch.tensor(data["y"])
    test = torch.tensor(data["x_test"], dtype=torch.float32), torch.tensor(data["y_test"])
    return _cut(x, y, test)


def _cut(x: Tensor, y: Tensor, test: tuple[Tensor, Tensor]) -> Splits:
    cut = len(y) - int(len(y) * VAL_FRACTION)
    return {"train": (x[:cut], y[:cut]), "val": (x[cut:], y[cut:]), "test": test}


def error(model: nn.Module, x: Tensor, y: Tensor) -> float:
    with torch.no_grad():
        return (model(x).argmax(1) != y).float().mean().item()


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(40, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


FAMILIES = {
    "cnn": Family(mnist1d_splits, MNIST1DClassifier, F.cross_entropy, error),
    "mlp": Family(mnist1d_splits, _mlp, F.cross_entropy, error),
    "lm": Family(language_splits, LanguageModel, token_loss, held_out_loss, math.log(VOCAB), entropy_rate),
}


def make_optimizer(name: str, params: Sequence[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name == "sgd-clip":
        return torch.optim.SGD(params, lr=lr)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=WEIGHT_DECAY)
    raise ValueError(f"optimizer={name!r} is not one of {OPTIMIZERS}")


def clipping(name: str) -> tuple[Clipping, ...]:
    """How the server clips each update of optimizer ``name`` (as the learner's ``gradient_clip_val`` asks)."""
    return (Clipping(CLIP),) if name == "sgd-clip" else ()
