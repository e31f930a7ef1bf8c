"""What simulating λ learners in one process costs, against one plain Lightning process on the same samples.

    python -m benchmarks.simulation [--learners 30] [--rounds 3] [--epochs 2] [--batch-size 8] [--out DIR]

Trains the MNIST-1D example module in this process: plain (``strategy="auto"``), then under
``RudraStrategy(simulate=λ)`` with 1-softsync and with hardsync, alternately, ``--rounds`` times. Both pass over
the same samples with the same per-step batch μ, so the simulated run makes the same number of steps; the ratio
is the price of the bookkeeping (a copy of the weights per step, the protocol). Prints each round and the median
of the per-round ratios, and writes them with the run's metadata to ``simulation.json`` and ``simulation.md`` in
``--out`` (``benchmarks/results``: only from a commit's code, as ``benchmarks.run``).
"""

import argparse
import os
import statistics
import time
import warnings
from typing import Any, Optional

import pytorch_lightning as pl
import torch

from benchmarks import provenance
from examples.mnist1d import MNIST1DClassifier, MNIST1DDataModule
from lightning_rudra import RudraStrategy


def train_seconds(strategy: Any, batch_size: int, epochs: int) -> float:
    pl.seed_everything(1, verbose=False)
    dm = MNIST1DDataModule(num_samples=4000, seed=42, batch_size=batch_size)
    model = MNIST1DClassifier(lr=0.05)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_epochs=epochs,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    start = time.perf_counter()
    trainer.fit(model, datamodule=dm)
    return time.perf_counter() - start


def main(argv: Optional[list[str]] = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--learners", type=int, default=30, help="λ, simulated (default 30)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8, help="μ, per step (default 8)")
    parser.add_argument("--out", default=os.path.join(provenance.ROOT, provenance.RESULTS))
    parser.add_argument("--allow-modified", action="store_true", help="as benchmarks.run's")
    args = parser.parse_args(argv)
    try:
        tree = provenance.check_tree(args.out, args.allow_modified)
    except provenance.ModifiedTree as error:
        parser.exit(2, f"benchmarks.simulation: refused: {error}\n")
    meta = provenance.meta("default", tree, "benchmarks.simulation", argv)
    start = time.monotonic()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", module="pytorch_lightning")
    variants = {"1-softsync": dict(protocol="softsync", n=1), "hardsync": dict(protocol="hardsync")}
    ratios: dict[str, list[float]] = {name: [] for name in variants}
    plain_s: list[float] = []
    for round_ in range(args.rounds):
        plain = train_seconds("auto", args.batch_size, args.epochs)
        plain_s.append(plain)
        line = [f"round {round_ + 1}: one plain process {plain:.2f} s"]
        for name, kwargs in variants.items():
            simulated = train_seconds(RudraStrategy(simulate=args.learners, **kwargs), args.batch_size, args.epochs)
            ratios[name].append(simulated / plain)
            line.append(f"{name}, λ = {args.learners} simulated {simulated:.2f} s ({simulated / plain:.2f}×)")
        print("; ".join(line), flush=True)
    medians = {name: statistics.median(r) for name, r in ratios.items()}
    text = "median time of a simulated run / one plain process: " + ", ".join(
        f"{name} {ratio:.2f}×" for name, ratio in medians.items()
    )
    print(text)
    meta.update(
        duration_s=time.monotonic() - start,
        loadavg_end=os.getloadavg(),
        config={k: v for k, v in vars(args).items() if k not in ("out", "allow_modified")},
    )
    summary = {"learners": args.learners, "vs_plain": medians, "vs_plain_reps": ratios, "plain_s": plain_s}
    markdown = (
        f"# What simulated learners cost\n\n{meta['date']} · lightning_rudra at {meta['commit'][:12]}"
        f"{' (modified)' if meta['modified'] else ''} · {meta['nproc']} CPUs ({meta['cpu_model']}) · torch "
        f"{meta['torch']} · {meta['duration_s']:.0f} s · load average {meta['loadavg_start'][0]:.1f} at the start, "
        f"{meta['loadavg_end'][0]:.1f} at the end\n\n`{meta['command']}` (MNIST-1D, μ = {args.batch_size}, "
        f"{args.epochs} epochs, {args.rounds} rounds, one process): {text}.\n"
    )
    try:
        provenance.write(args.out, "simulation", {"meta": meta, "summary": {"simulation": summary}}, markdown, tree)
    except provenance.ModifiedTree as error:
        parser.exit(2, f"benchmarks.simulation: refused: {error}\n")
    return medians


if __name__ == "__main__":
    main()
