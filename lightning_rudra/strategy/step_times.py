"""A callback that measures each learner's step times in a real run, for a simulation to replay them."""

import json
import math
import os
import time
from typing import Any, Optional

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback


class StepTimes(Callback):
    """Records how long each of this learner's training batches takes, from the batch's start to its end (the
    forward, the backward and the optimizer step, which is the push and the pull), and at the end of training
    writes every learner's times to ``path`` (JSON, learner 0). ``Measured.from_json(path)``
    (:mod:`lightning_rudra.core.timing`) reads them, so that ``RudraStrategy(simulate=λ, timing=...)`` orders its pushes
    as this run's learners took their steps. Works with any strategy (one process: one list)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.times: list[float] = []
        self._start: Optional[float] = None

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.times = []

    def on_train_batch_start(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int
    ) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._start is not None:
            self.times.append(time.perf_counter() - self._start)
            self._start = None

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # learners take different numbers of batches (the shared epoch): gather the counts, then padded times
        counts = trainer.strategy.all_gather(torch.tensor([len(self.times)])).reshape(-1).tolist()
        padded = torch.full((max(counts),), math.nan, dtype=torch.float64)
        padded[: len(self.times)] = torch.tensor(self.times, dtype=torch.float64)
        gathered = trainer.strategy.all_gather(padded).reshape(len(counts), -1)
        if trainer.is_global_zero:
            times = [row[:count].tolist() for row, count in zip(gathered, counts)]
            tmp = f"{self.path}.tmp"
            with open(tmp, "w") as f:
                json.dump({"times": times}, f)
            os.replace(tmp, self.path)
