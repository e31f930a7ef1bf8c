"""Which staleness rule, per optimizer family, on three model families: simulated learners, μλ constant.

    python -m examples.study.staleness --out docs/study/staleness --jobs 2           # add --resume to go on
    python -m examples.study.staleness --out docs/study/staleness --report-only      # findings.md from runs.jsonl

The runs are those of ``examples.study.compensation`` (λ virtual learners against the package's own ``Server`` in
one process, pushing in the order of ``Jittered(0.3)`` step times), on every family of ``examples.study.families``
(the MNIST-1D CNN and MLP, by test error; an LSTM language model on a synthetic language of known entropy, by
held-out loss) and every optimizer there (momentum SGD, SGD with clipping, Adam, AdamW).

Method. (1) The rate, per family and optimizer: swept on hardsync (λ = 4, ``EPOCHS`` epochs) on the validation split
of seed ``TUNE_SEED`` (never reported), the score being the mean validation measure over the last ``LAST`` epochs;
extended while the best sits at an edge (``next_rate``), so that it is interior. That is the rate a user would have
tuned for the synchronous run. (2) At that rate, on seeds ``SEEDS``: hardsync (``EPOCHS`` epochs) and every stale
configuration of ``STALE`` under every rule of ``RULES`` (``STALE_RULES``: fewer for some), for ``STALE_EPOCHS`` = 1.5 × ``EPOCHS`` epochs: the issue's
budget. The *gap* of a stale run: its test measure after ``STALE_EPOCHS`` epochs minus hardsync's after ``EPOCHS`` (same
seed), in points of error, or for the language model in % of hardsync's loss; the target is a gap ≤ ``TARGET``. (3) The
rule per optimizer: the lowest mean *validation* gap over every family and stale configuration (validation splits of
the reported seeds; test numbers are reported, never chosen on).
"""

import argparse
import statistics
from multiprocessing import get_context
from typing import Any, Optional

from examples.study.compensation import LAST, MAX_EXTENSIONS, TUNE_SEED, Runs, key, next_rate, parse, trained
from examples.study.families import FAMILIES, OPTIMIZERS

EPOCHS = 20
STALE_EPOCHS = 30
SEEDS = (0, 1, 2)
HARDSYNC_LEARNERS = 4
STALE = (("async", 4, 1), ("async", 16, 1), ("softsync", 16, 4), ("async", 30, 1))
RULES = ("momentum", "none", "momentum+dc", "momentum+clip", "momentum+clip+syncnorm", "momentum+clip+syncnorm+dana")
# (the old defaults first)
# configurations that train only some rules (time): λ = 30, μ = 4 (μλ = 120), the old defaults and the new one
STALE_RULES = {("async", 30, 1): ("momentum", "momentum+clip", "momentum+clip+syncnorm", "momentum+clip+syncnorm+dana")}
RATES = {
    "sgd": (0.05, 0.1, 0.2),
    "sgd-clip": (0.25, 1.0, 4.0),
    "adam": (0.001, 0.003, 0.01),
    "adamw": (0.001, 0.003, 0.01),
}
TARGET = 2.0
FAMILY_NAMES = tuple(FAMILIES)
OPTIMIZER_NAMES = OPTIMIZERS


def run(family: str, optimizer: str, protocol: str, learners: int, n: int, rule: str, seed: int, lr: float) -> dict:
    epochs = EPOCHS if protocol == "hardsync" else STALE_EPOCHS
    return dict(
        family=family, optimizer=optimizer, protocol=protocol, learners=learners, n=n, rule=rule, seed=seed,
        epochs=epochs, lr=lr,
    )  # fmt: skip


class ParallelRuns(Runs):
    """``Runs`` that trains the missing runs of a list ``jobs`` at a time (one process each, one thread)."""

    def get_all(self, runs: list[dict[str, Any]], jobs: int) -> list[dict[str, Any]]:
        missing = [r for r in {key(r): r for r in runs}.values() if key(r) not in self.rows]
        if missing:
            with get_context("fork").Pool(jobs) as pool:
                for row in pool.imap_unordered(trained, missing):
                    self.add(row)
        return [self.rows[key(r)] for r in runs]


def score(row: dict[str, Any]) -> float:
    return statistics.mean(row["val_errors"][-LAST:])


def rates(store: ParallelRuns, jobs: int) -> dict[tuple[str, str], dict[str, Any]]:
    """Per (family, optimizer): the rate swept on hardsync, extended until the best is interior."""
    chosen = {}
    for family in FAMILY_NAMES:
        for optimizer in OPTIMIZER_NAMES:
            scores: dict[float, float] = {}
            wanted = list(RATES[optimizer])
            for _ in range(MAX_EXTENSIONS + 1):
                runs = [
                    run(family, optimizer, "hardsync", HARDSYNC_LEARNERS, 1, "none", TUNE_SEED, lr) for lr in wanted
                ]
                scores.update({r["lr"]: score(r) for r in store.get_all(runs, jobs)})
                lr = next_rate(scores) if len(scores) > 1 else None
                if lr is None:
                    break
                wanted = [lr]
            if len(scores) < 2:  # --report-only on a grid stopped before this sweep
                continue
            best = min(scores, key=lambda lr: (scores[lr], lr))
            chosen[family, optimizer] = dict(rate=best, scores=scores, interior=next_rate(scores) is None)
    return chosen


def reported(chosen: dict[tuple[str, str], dict[str, Any]]) -> list[dict[str, Any]]:
    runs = []
    for rule in RULES:
        for (family, optimizer), c in chosen.items():
            for seed in SEEDS:
                runs.append(run(family, optimizer, "hardsync", HARDSYNC_LEARNERS, 1, "none", seed, c["rate"]))
                runs += [
                    run(family, optimizer, *config, rule, seed, c["rate"])
                    for config in STALE
                    if rule in STALE_RULES.get(config, RULES)
                ]
    return runs


def gap(family: str, stale: float, sync: float) -> float:
    """Points of error, or % of hardsync's loss for the language model."""
    return 100 * (stale / sync - 1) if family == "lm" else 100 * (stale - sync)


def main(argv: Optional[list[str]] = None) -> None:
    def options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--jobs", type=int, default=1, help="runs trained at once, one process each (default: 1)")

    args, out = parse("staleness", __doc__, argv, options)
    store = ParallelRuns(out, args.resume or args.report_only)
    if args.report_only:
        # the runs there are: an interrupted grid's report says which it has
        store.get_all = lambda runs, jobs: [store.rows[key(r)] for r in runs if key(r) in store.rows]  # type: ignore
    chosen = rates(store, args.jobs)
    rows = list({key(r): r for r in store.get_all(reported(chosen), args.jobs)}.values())  # hardsync: once
    from examples.study.staleness_report import write_report

    write_report(rows, chosen, sum(r["seed"] == TUNE_SEED for r in store.rows.values()), out)


if __name__ == "__main__":
    main()
