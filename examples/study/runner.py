"""One run of the tradeoff study (``python -m examples.study``): train MNIST-1D once and write a JSON result.

    python -m examples.study.runner --protocol softsync --n 2 --learners 4 --batch-size 16 \\
        --lr-modulation mean --epochs 5 --result /tmp/run.json

``--protocol single`` trains one plain Lightning process (no parameter server): the λ = 1 baseline;
``--protocol ddp`` Lightning's own ``"ddp"`` strategy on λ processes (the reference of the protocols study).
``--straggler``: the last learner sleeps before every batch for an exponential time (seeded), of mean twice the
median of its own first batches' times; ``--curve``: learner 0 measures the test error after every epoch
(validation pulls the newest weights) and the result holds (seconds of training, error) per epoch.
``--family lm`` trains the LSTM language model of ``examples.language_model`` instead (plain SGD at ``--lr``, clipped
to ``--clip`` by norm as Lightning's ``gradient_clip_val``), measured by its held-out loss (nats per token) where
MNIST-1D is by its error. ``--simulate`` trains the λ learners in this one process (``RudraStrategy(simulate=λ)``),
their step times log-normal with ``--spread``.
Otherwise the λ learners train under ``RudraStrategy`` with the ``popen`` launcher, which re-runs this
module once per learner. After ``fit`` every learner holds the server's final weights; learner 0 then
evaluates them on the whole test split itself (no second Trainer stage) and writes the result file.
"""

import argparse
import json
import math
import os
import random
import statistics
import time
from typing import Any, Callable, Optional

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.callbacks import Callback

from examples.language_model import LanguageDataModule, LanguageModule, held_out_loss
from examples.mnist1d import MNIST1DClassifier, MNIST1DDataModule

PROTOCOLS = ("single", "hardsync", "softsync", "async", "batchsync", "ddp")
CALIBRATION = (3, 13)  # the straggler's batches timed before it sleeps (the median of their times: its mean sleep)


class Straggler(Callback):
    """The last learner sleeps before every batch for an exponential time of mean ``factor`` × the median time of
    batches ``CALIBRATION`` (timed from one batch's start to the next, push included; no sleep then, the first
    ones warming up), or of mean ``mean`` seconds from the start (the same straggler for every protocol)."""

    def __init__(self, seed: int, factor: float = 2.0, mean: Optional[float] = None) -> None:
        self.rng = random.Random(seed)
        self.factor = factor
        self.starts: list[float] = []
        self.mean = mean
        self.slept = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        if trainer.global_rank != trainer.world_size - 1:
            return
        if self.mean is None:
            self.starts.append(time.perf_counter())
            if len(self.starts) > CALIBRATION[1]:
                gaps = [b - a for a, b in zip(self.starts, self.starts[1:])][CALIBRATION[0] :]
                self.mean = self.factor * statistics.median(gaps)
            return
        pause = self.rng.expovariate(1.0 / self.mean)
        self.slept += pause
        time.sleep(pause)


class EpochErrors(Callback):
    """Learner 0: the test measure after every epoch (seconds of training by then, validation and this excluded):
    the error, or the held-out loss of a language model (``measure``)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, timer: "TrainTimer", measure: Callable) -> None:
        self.x, self.y, self.timer, self.measure = x, y, timer, measure
        self.paused = 0.0
        self.began: Optional[float] = None
        self.curve: list[tuple[float, float]] = []

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.began = time.perf_counter()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.began is None or self.timer.start is None or trainer.sanity_checking:
            return
        if trainer.is_global_zero:
            error = self.measure(pl_module, self.x, self.y)
            pl_module.train()
            self.curve.append((round(self.began - self.timer.start - self.paused, 3), round(error, 4)))
        self.paused += time.perf_counter() - self.began


class TrainTimer(Callback):
    """Wall time of the training loop alone (process start, imports and rendezvous excluded)."""

    def __init__(self) -> None:
        self.start: Optional[float] = None
        self.seconds: Optional[float] = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start = time.perf_counter()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning calls the strategy's on_train_end (every learner stops, the last softsync gradients are
        # applied, the final weights come back) before the callbacks': the time covers the whole training.
        self.seconds = time.perf_counter() - self.start


@torch.no_grad()
def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(error, mean cross-entropy) of ``model`` on all of ``x``, ``y``."""
    model.eval()
    logits = torch.cat([model(chunk) for chunk in x.split(1024)])
    error = (logits.argmax(dim=1) != y).float().mean().item()
    return error, F.cross_entropy(logits, y).item()


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--protocol", choices=PROTOCOLS, required=True)
    p.add_argument("--family", choices=("mnist1d", "lm"), default="mnist1d", help="the model and its data")
    p.add_argument("--clip", type=float, default=None, help="gradient_clip_val (by norm)")
    p.add_argument("--n", type=int, default=1, help="softsync splitting parameter (ignored otherwise)")
    p.add_argument("--learners", type=int, default=1, help="λ")
    p.add_argument("--batch-size", type=int, required=True, help="μ, per learner")
    p.add_argument("--lr-modulation", choices=("none", "mean", "per_gradient"), default="none")
    p.add_argument(
        "--compensation",
        default="none",
        help="RudraStrategy's compensation (default: none, as the paper study ran; the strategy's is momentum)",
    )
    p.add_argument("--k", type=int, default=None, help="batchsync: gradients per update (default: λ)")
    p.add_argument("--backup", type=int, default=0, help="hardsync: learners a round does not wait for")
    p.add_argument("--max-staleness", type=int, default=None)
    p.add_argument("--on-stale", choices=("drop", "block"), default="drop")
    p.add_argument("--straggler", action="store_true", help="the last learner sleeps before every batch")
    p.add_argument("--straggler-mean", type=float, default=None, help="its mean sleep in seconds (default: measured)")
    p.add_argument("--curve", action="store_true", help="the test error after every epoch (learner 0)")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--num-samples", type=int, default=4000)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=42, help="data and initial weights")
    p.add_argument("--rpc-timeout", type=float, default=120.0)
    p.add_argument("--simulate", action="store_true", help="simulate the λ learners in this one process")
    p.add_argument("--spread", type=float, default=0.0, help="simulated learners' step-time spread (0: homogeneous)")
    p.add_argument("--result", required=True, help="JSON file that learner 0 writes")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    if args.protocol == "single" and args.learners != 1:
        raise SystemExit("--protocol single is the single-learner baseline: it needs --learners 1")
    pl.seed_everything(args.seed, verbose=False)
    # The data split is the datamodule's; validation is skipped (the study reports test error only).
    dm: Any
    model: Any
    if args.family == "lm":
        dm, model = LanguageDataModule(seed=args.seed, batch_size=args.batch_size), LanguageModule(lr=args.lr)
        measure: Callable = held_out_loss
    else:
        dm = MNIST1DDataModule(num_samples=args.num_samples, seed=args.seed, batch_size=args.batch_size)
        model = MNIST1DClassifier(lr=args.lr, momentum=args.momentum)
        measure = lambda m, x, y: evaluate(m, x, y)[0]  # noqa: E731
    if args.protocol in ("single", "ddp"):
        strategy: Any = "auto" if args.protocol == "single" else "ddp"
    else:
        from lightning_rudra import RudraStrategy
        from lightning_rudra.timing import Jittered

        simulation: dict[str, Any] = {}
        if args.simulate:
            simulation = dict(simulate=args.learners, timing=Jittered(args.spread, seed=args.seed))
        strategy = RudraStrategy(
            protocol=args.protocol,
            n=args.n if args.protocol == "softsync" else 1,
            lr_modulation=args.lr_modulation,
            compensation=args.compensation,
            max_staleness=args.max_staleness,
            on_stale=args.on_stale,
            k=args.k,
            backup=args.backup,
            rpc_timeout=args.rpc_timeout,
            start_method="popen",
            **simulation,
        )
    timer = TrainTimer()
    dm.setup("fit")
    assert dm.test_set is not None
    straggler = Straggler(args.seed, mean=args.straggler_mean) if args.straggler else None
    x_test, y_test = dm.test_set.tensors
    errors = EpochErrors(x_test, y_test, timer, measure) if args.curve else None
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1 if args.simulate else args.learners,
        strategy=strategy,
        max_epochs=args.epochs,
        gradient_clip_val=args.clip,
        limit_val_batches=1 if args.curve else 0,  # validation pulls the newest weights: EpochErrors measures them
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[c for c in (timer, straggler, errors) if c is not None],
    )
    trainer.fit(model, datamodule=dm)
    if straggler is not None and straggler.mean is not None:  # the straggler's own process: its mean sleep
        with open(args.result + ".straggler", "w") as f:
            json.dump({"rank": trainer.global_rank, "mean_sleep": straggler.mean, "slept": straggler.slept}, f)
    if not trainer.is_global_zero:
        return

    test_x, test_y = dm.test_set.tensors
    train_x, train_y = dm.train_set.tensors
    if args.family == "lm":
        test_error, test_loss, train_loss = None, held_out_loss(model, test_x, test_y), None
    else:
        test_error, test_loss = evaluate(model, test_x, test_y)
        _, train_loss = evaluate(model, train_x, train_y)
    samples = args.epochs * len(dm.train_set)  # what the learners processed together (one pass per epoch)
    stats = getattr(trainer.strategy, "stats", None)
    result = {
        "protocol": args.protocol,
        # async is λ-softsync; hardsync and the single learner have no n
        "n": args.n if args.protocol == "softsync" else (args.learners if args.protocol == "async" else None),
        "learners": args.learners,
        "batch_size": args.batch_size,
        "mu_lambda": args.batch_size * args.learners,
        "lr_modulation": args.lr_modulation if args.protocol != "single" else "none",
        "epochs": args.epochs,
        "lr": args.lr,
        "test_error": test_error,
        "test_loss": test_loss if math.isfinite(test_loss) else None,
        "train_loss": train_loss if train_loss is not None and math.isfinite(train_loss) else None,
        "family": args.family,
        "clip": args.clip,
        "train_seconds": timer.seconds,
        "samples": samples,
        "samples_per_s": samples / timer.seconds if timer.seconds else None,
        "mean_staleness": stats.mean_staleness if stats is not None else 0.0,
        "max_staleness": stats.max_staleness if stats is not None else 0,
        # the single learner has no server: one plain optimizer step per batch
        "updates": stats.clock if stats is not None else trainer.global_step,
        "gradients": stats.gradients if stats is not None else trainer.global_step,
        "dropped": stats.dropped if stats is not None else 0,
        "late": stats.late if stats is not None else 0,
        "k": args.k,
        "backup": args.backup,
        "max_staleness_bound": args.max_staleness,
        "on_stale": args.on_stale,
        "compensation": args.compensation if args.protocol not in ("single", "ddp") else None,
        "curve": errors.curve if errors is not None else None,
        "seed": args.seed,
        "staleness": {str(s): c for s, c in sorted(stats.staleness.items())} if stats is not None else {},
    }
    tmp = args.result + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, args.result)


if __name__ == "__main__":
    main()
