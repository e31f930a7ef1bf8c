"""An LSTM language model on a synthetic language whose entropy is known, trained through ``LightningCLI``.

Run from the repository root (``fit`` trains, then tests and prints ``final test loss: ...`` in nats per token)::

    python -m examples.language_model fit --config examples/configs/language_model_async.yaml

The recipe is that of Lightning's LSTM demo (``pytorch_lightning.demos``) and of the PyTorch word-language-model
example it comes from: plain SGD, gradients clipped to norm 0.25 (``gradient_clip_val``). The language: sequences of
a first-order Markov chain over ``VOCAB`` tokens, each row of its transition matrix drawn from a
Dirichlet(``CONCENTRATION``) (seeded), the first token from the chain's stationary distribution. No model can go
below the chain's entropy rate (:func:`entropy_rate`); predicting the uniform distribution costs ln ``VOCAB``.
"""

from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from examples.common import TensorDataModule, run_cli

VOCAB = 24
CONCENTRATION = 0.2  # of the language's transition rows: low, so that the next token is fairly predictable
SEQUENCES = 3000  # of the language per seed: train, validation and test alike cut from them
LENGTH = 33  # tokens per sequence: 32 predictions
TEST_FRACTION = 0.2
VAL_FRACTION = 0.1  # of the training sequences


def transitions(seed: int) -> Tensor:
    """The language of ``seed``: its transition matrix, row i the distribution of the token after token i."""
    generator = torch.Generator().manual_seed(10_000 + seed)
    gamma = torch._standard_gamma(torch.full((VOCAB, VOCAB), CONCENTRATION), generator=generator)
    return (gamma + 1e-12) / (gamma + 1e-12).sum(1, keepdim=True)


def _stationary(matrix: Tensor) -> Tensor:
    pi = torch.full((VOCAB,), 1.0 / VOCAB, dtype=torch.float64)
    for _ in range(2000):
        pi = pi @ matrix.double()
    return pi / pi.sum()


def entropy_rate(seed: int) -> float:
    """The language's entropy per token in nats: the lowest loss any model can reach on it."""
    matrix = transitions(seed).double()
    rows = -(matrix * matrix.clamp_min(1e-300).log()).sum(1)
    return float(_stationary(matrix) @ rows)


def language_splits(seed: int) -> dict[str, tuple[Tensor, Tensor]]:
    """``SEQUENCES`` sequences of the seed's language: the last ``TEST_FRACTION`` the test split, the last
    ``VAL_FRACTION`` of the rest the validation split (``train``, ``val``, ``test``). x: the tokens but the last,
    y: the tokens but the first."""
    matrix = transitions(seed)
    generator = torch.Generator().manual_seed(20_000 + seed)
    tokens = torch.empty(SEQUENCES, LENGTH, dtype=torch.long)
    tokens[:, 0] = torch.multinomial(_stationary(matrix).float(), SEQUENCES, replacement=True, generator=generator)
    for t in range(1, LENGTH):
        tokens[:, t] = torch.multinomial(matrix[tokens[:, t - 1]], 1, generator=generator).squeeze(1)
    x, y = tokens[:, :-1], tokens[:, 1:]
    test = len(y) - int(len(y) * TEST_FRACTION)
    val = test - int(test * VAL_FRACTION)
    return {"train": (x[:val], y[:val]), "val": (x[val:test], y[val:test]), "test": (x[test:], y[test:])}


class LanguageModel(nn.Module):
    """Embedding 32, one LSTM layer of 64, a linear head: [B, T] tokens -> [B, T, VOCAB] logits."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, 32)
        self.lstm = nn.LSTM(32, 64, batch_first=True)
        self.head = nn.Linear(64, VOCAB)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.lstm(self.embedding(x))[0])


def token_loss(output: Tensor, y: Tensor) -> Tensor:
    """Cross-entropy per predicted token, in nats."""
    return F.cross_entropy(output.reshape(-1, VOCAB), y.reshape(-1))


def held_out_loss(model: nn.Module, x: Tensor, y: Tensor) -> float:
    with torch.no_grad():
        return token_loss(model(x), y).item()


class LanguageModule(pl.LightningModule):
    """:class:`LanguageModel` trained by plain SGD at ``lr``; logs ``train_loss``, ``val_loss`` and ``test_loss``."""

    def __init__(self, lr: float = 4.0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = LanguageModel()

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = token_loss(self(batch[0]), batch[1])
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", token_loss(self(batch[0]), batch[1]), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", token_loss(self(batch[0]), batch[1]), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class LanguageDataModule(TensorDataModule):
    """The language of ``seed``, generated deterministically in every process."""

    def __init__(self, seed: int = 0, batch_size: int = 32, num_workers: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        if hasattr(self, "train_set"):
            return
        splits = language_splits(self.hparams.seed)
        self.train_set, self.val_set, self.test_set = (TensorDataset(*splits[s]) for s in ("train", "val", "test"))


if __name__ == "__main__":
    run_cli(LanguageModule, LanguageDataModule)
