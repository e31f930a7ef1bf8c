"""A model of a chosen size on data made in-process: an MLP classifier of about ``params`` float32 parameters,
trained on random inputs labelled by a random linear teacher.

The benchmark needs models of real sizes (10 M, 50 M parameters) without downloads, and a step whose time is
mostly the model's arithmetic and its synchronisation, as in real training; the task only has to be learnable.
Every rank builds the same data and the same initial weights from the same seed.
"""

import math

import torch
from torch import nn

from examples.common import ClassifierModule

INPUTS = 1000
CLASSES = 10
HIDDEN_LAYERS = 3


def hidden_width(params: int, inputs: int = INPUTS, classes: int = CLASSES, layers: int = HIDDEN_LAYERS) -> int:
    """The width h of ``layers`` hidden layers for about ``params`` parameters: inputs·h + (layers − 1)·h² +
    h·classes weights and h·layers + classes biases, solved for h."""
    a, b, c = layers - 1, inputs + classes + layers, classes - params
    return int((-b + math.sqrt(b * b - 4 * a * c)) / (2 * a))


class MLPClassifier(ClassifierModule):
    """``inputs`` -> ``layers`` × (Linear, ReLU) of one width -> ``classes`` logits; SGD with momentum."""

    def __init__(
        self,
        params: int,
        lr: float = 0.05,
        momentum: float = 0.9,
        inputs: int = INPUTS,
        classes: int = CLASSES,
        layers: int = HIDDEN_LAYERS,
    ) -> None:
        super().__init__(num_classes=classes)
        self.save_hyperparameters()
        width = hidden_width(params, inputs, classes, layers)
        dims = [inputs] + [width] * layers
        hidden = [m for i in range(layers) for m in (nn.Linear(dims[i], dims[i + 1]), nn.ReLU())]
        self.net = nn.Sequential(*hidden, nn.Linear(width, classes))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=self.hparams.momentum)


def teacher_data(num_samples: int, seed: int, inputs: int = INPUTS, classes: int = CLASSES) -> dict[str, torch.Tensor]:
    """``num_samples`` training and a fifth as many test samples: standard normal inputs, the label the argmax
    of a random linear map (the teacher), so that every class occurs and the task is learnable."""
    generator = torch.Generator().manual_seed(seed)
    teacher = torch.randn(inputs, classes, generator=generator)
    x = torch.randn(num_samples + num_samples // 5, inputs, generator=generator)
    y = (x @ teacher).argmax(dim=1)
    return {"x": x[:num_samples], "y": y[:num_samples], "x_test": x[num_samples:], "y_test": y[num_samples:]}
