"""Which staleness compensation to use: simulated learners, μλ constant, the rules compared, tuned on validation only.

    python -m examples.study.compensation --grid reduced --out docs/study/compensation      # add --resume to go on
    python -m examples.study.compensation --grid reduced --out docs/study/compensation --report-only  # findings.md

λ virtual learners in one process, driven against the package's own :class:`lightning_rudra.Server` (the rules
the parameter server runs) with no Lightning around it: each learner computes its gradient on the weights it
last received, and pushes in the order the timing model (``Jittered(0.3)``, as the paper grid) says, as a
simulated run (``RudraStrategy(simulate=λ)``) does, about ten times faster. MNIST-1D, the example CNN, μλ = 128.

Data (``examples.study.families``): each seed generates its own MNIST-1D sample (``NUM_SAMPLES``; 20 % test
split) and its own initial weights, data order and step times. The last ``VAL_FRACTION`` of the training samples are held out as a validation split
(as ``MNIST1DDataModule`` does), disjoint from the test split; the runs train on the rest.

Method: every choice is made on the validation split of seed ``TUNE_SEED``, which is never reported; the
reported seeds (``SEEDS``) give test errors only. A choice scores a run by its mean validation error over its last
``LAST`` epochs (less of one epoch's luck). (1) The rate, per optimizer: swept on hardsync; while the best rate
sits at an edge of the rates tried, one more step of the grid's ratio is added that way (at most
``MAX_EXTENSIONS``), so the winner is interior. (2) The rule, per optimizer: every rule of the grid on the grid's
tuning configurations (stale runs) at that rate; the lowest mean score wins. Then, on each reported seed,
hardsync and every stale configuration under the default rule, the chosen one and the grid's test rules.

Hardsync trains ``epochs`` epochs and the stale runs twice as many; each stale run is compared with hardsync of the
same seed (test error, in points) three ways: at equal epochs (its error after hardsync's epoch count), at equal
simulated time (its error after the last epoch it finished by the time hardsync finished) and at its end.
Hardsync with μλ constant computes the same update at every λ (the round's gradient is the mean over μλ samples,
only which samples share a round differs), so it trains once per seed at λ = ``HARDSYNC_LEARNERS``; its simulated
time at each λ comes from the timing model alone.

Simulated time: a step of learner r takes ``Jittered(0.3).duration(r, step)`` (log-normal around 1, 30 % spread);
the server answers at once and communication costs nothing. Every epoch starts with all learners together (as
``push_order`` does). Hardsync's epoch is a sum of rounds, each as long as the slowest of its λ steps; under async
and softsync no learner waits, so an epoch lasts as long as the learner whose steps add up longest.

Grids: ``full`` (the default: async at λ = 4, 8, 16, 30, 4-softsync at 16 and 1-softsync at 4; four rules; 30
epochs; every rule on test; about 210 runs, some 4 to 5 hours on one core, estimated from the per-epoch times of
these runs: not run) and ``reduced`` (async at λ = 4 and 16, 1-softsync at 4; three rules, chosen on the λ = 4
configurations; 20 epochs, to fit in well under an hour; the default and the chosen rule on test; 3 seeds: 54
runs, 25 minutes on one core of a busy 2-core machine). One JSON line per run in ``<out>/runs.jsonl``, with the
commit it trained at; ``--resume`` skips runs already there; ``--report-only`` rewrites ``findings.md`` from it.
"""

import argparse
import json
import math
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from examples.study.families import FAMILIES, clipping, make_optimizer
from lightning_rudra import ProtocolConfig, Server
from lightning_rudra.core.compression import ErrorFeedback, WeightDeltas
from lightning_rudra.core.optimizers import OptimizerSpec, hyperparameters
from lightning_rudra.timing import Jittered, TimingModel, push_order
from lightning_rudra.core.update import Push

EPOCHS = 30  # the full grid's (and the compression study's) hardsync epochs
MU_LAMBDA = 128
SPREAD = 0.3  # of the step times (Jittered)
TUNE_SEED = 100  # every choice is made on this seed's validation split; never reported
SEEDS = (0, 1, 2)
LAST = 5  # epochs a validation score averages over
MAX_EXTENSIONS = 4  # rate steps added beyond the first grid, at most
HARDSYNC_LEARNERS = 4
RULES = ("paper", "momentum", "momentum+gap", "momentum+dc")  # paper: lr_modulation="mean", no compensation
DEFAULT = "momentum"  # RudraStrategy's default when this study ran: its runs come first, so an interrupted grid has it
RATES = {"sgd": (0.05, 0.1, 0.2), "adam": (0.001, 0.003, 0.01)}


@dataclass(frozen=True)
class Grid:
    epochs: int  # hardsync's; the stale runs train twice as many
    stale: tuple  # (protocol, λ, n) of the stale runs
    rules: tuple  # compared on validation
    tune: tuple  # the stale configurations the rule is chosen on
    test_rules: tuple  # trained on the reported seeds, beside the default and the chosen rule


_FULL_STALE = tuple(("async", lam, 1) for lam in (4, 8, 16, 30)) + (("softsync", 16, 4), ("softsync", 4, 1))
_REDUCED_STALE = (("async", 4, 1), ("async", 16, 1), ("softsync", 4, 1))
GRIDS = {
    "full": Grid(EPOCHS, _FULL_STALE, RULES, _FULL_STALE, RULES),
    "reduced": Grid(20, _REDUCED_STALE, ("momentum", "paper", "momentum+dc"), _REDUCED_STALE[::2], ()),
}


def learner_steps(train_samples: int, learners: int) -> list[int]:
    """Each learner's steps in an epoch: its shard of the training samples in batches of μ = μλ/λ."""
    mu = MU_LAMBDA // learners
    return [len(shard) // mu for shard in torch.arange(train_samples).chunk(learners)]


def epoch_time(protocol: str, steps: Sequence[int], timing: TimingModel, done: Sequence[int]) -> float:
    """Simulated length of one epoch (the model of the module's docstring, the one ``push_order`` orders by)."""
    if protocol == "hardsync":
        rounds = range(max(steps, default=0))
        return sum(max(timing.duration(r, done[r] + k) for r in range(len(steps)) if steps[r] > k) for k in rounds)
    return max((sum(timing.duration(r, done[r] + k) for k in range(s)) for r, s in enumerate(steps)), default=0.0)


def simulated_times(protocol: str, learners: int, epochs: int, seed: int, train_samples: int) -> list[float]:
    """The simulated time at the end of every epoch of a run."""
    timing, steps, now, times = Jittered(SPREAD, seed=seed), learner_steps(train_samples, learners), 0.0, []
    for epoch in range(epochs):
        now += epoch_time(protocol, steps, timing, [s * epoch for s in steps])
        times.append(round(now, 3))
    return times


def equal_time_epochs(times: Sequence[float], budget: float) -> int:
    """How many epochs a run had finished by simulated time ``budget``."""
    return sum(1 for t in times if t <= budget)


def next_rate(scores: dict[float, float]) -> Optional[float]:
    """The rate to try next: one more step of the grid's ratio beyond the edge where the best score sits, or
    None when the best is interior. Ties go to the smaller rate."""
    rates = sorted(scores)
    best = min(rates, key=lambda lr: (scores[lr], lr))
    if best == rates[0]:
        return float(f"{rates[0] ** 2 / rates[1]:.3g}")
    if best == rates[-1]:
        return float(f"{rates[-1] ** 2 / rates[-2]:.3g}")
    return None


def train(
    optimizer: str,
    protocol: str,
    learners: int,
    n: int,
    rule: str,
    seed: int,
    epochs: int,
    lr: float,
    compression: Optional[str] = None,
    family: str = "cnn",
) -> dict[str, Any]:
    """One run; returns its test and validation measure (error, or the language model's loss: ``family``, see
    :mod:`examples.study.families`) and its simulated time after every epoch. ``compression``: every push compressed
    as a learner on another host sends it (``RudraStrategy(compression=...)``), each learner keeping its own rounding
    errors, and the weights it gets back as differences from those it holds."""
    torch.manual_seed(seed)
    fam = FAMILIES[family]
    data = fam.data(seed)
    (x, y), (x_val, y_val), (x_test, y_test) = data["train"], data["val"], data["test"]
    model = fam.model()
    params = list(model.parameters())
    opt = make_optimizer(optimizer, params, lr)
    options = dict(lr_modulation="mean") if rule == "paper" else dict(compensation=rule)
    config = ProtocolConfig(learners, protocol, n, **options)
    server = Server(config, [p.detach() for p in params], [], [OptimizerSpec.from_optimizer(opt, params)])
    hparams = [hyperparameters(group) for group in opt.param_groups]
    has_grad, clippings = torch.ones(len(params), dtype=torch.bool), clipping(optimizer)  # the same every push
    timing = Jittered(SPREAD, seed=seed)
    mu = MU_LAMBDA // learners
    held = [server.pull() for _ in range(learners)]  # per learner: (weights, buffers, timestamp)
    done = [0] * learners
    order_rng = torch.Generator().manual_seed(seed)
    feedback = ErrorFeedback(compression) if compression is not None else None
    # the weights back as differences from what each learner holds: (the server's record, the learners')
    deltas = (WeightDeltas(compression), WeightDeltas(compression)) if compression is not None else None

    def receive(learner: int, pulled: tuple) -> tuple:
        if deltas is None:
            return pulled
        weights, buffers, timestamp = pulled
        return (
            deltas[1].decode(deltas[0].encode(learner, deltas[1].count(learner), weights), learner),
            buffers,
            timestamp,
        )

    def error(x_eval: torch.Tensor, y_eval: torch.Tensor, finite: bool) -> float:
        return round(fam.measure(model, x_eval, y_eval), 4) if finite else fam.worst

    errors, val_errors = [], []
    for _ in range(epochs):
        shards = torch.randperm(len(y), generator=order_rng).chunk(learners)
        steps = [len(shard) // mu for shard in shards]
        position = [0] * learners
        for r in push_order(protocol, steps, timing, done):
            weights, _, timestamp = held[r]
            torch.nn.utils.vector_to_parameters(weights[0], params)
            batch = shards[r][position[r] * mu : (position[r] + 1) * mu]
            position[r] += 1
            model.zero_grad(set_to_none=False)
            fam.loss(model(x[batch]), y[batch]).backward()
            grad = torch.cat([p.grad.reshape(-1) for p in params])
            if feedback is not None:
                [grad] = feedback.compress(r, [grad])
            result = server.push(Push(r, 0, [grad], has_grad, timestamp, hparams, [], clipping=clippings))
            if protocol != "hardsync":
                held[r] = receive(r, server.pull())
            elif result.closed:  # hardsync: every learner gets the round's weights
                pulled = server.pull()
                held = [receive(learner, pulled) for learner in range(learners)]
        done = [d + s for d, s in zip(done, steps)]
        weights = server.pull()[0][0]
        torch.nn.utils.vector_to_parameters(weights, params)
        finite = math.isfinite(weights.sum().item())
        errors.append(error(x_test, y_test, finite))
        val_errors.append(error(x_val, y_val, finite))
    return {
        "errors": errors,
        "val_errors": val_errors,
        "times": simulated_times(protocol, learners, epochs, seed, len(y)),
        "train_samples": len(y),
        "mean_staleness": round(server.stats.mean_staleness, 3),
    }


def key(run: dict[str, Any]) -> tuple:
    """What tells runs apart (``compression``: only the compression study's runs have it)."""
    fields = ("optimizer", "protocol", "learners", "n", "rule", "seed", "epochs", "lr", "compression", "family")
    return tuple(run.get(k) for k in fields)


class Runs:
    """The rows of ``<out>/runs.jsonl``: ``get(run)`` trains a run not there yet and appends its row."""

    def __init__(self, out: Path, resume: bool) -> None:
        self.path = out / "runs.jsonl"
        if not resume and self.path.exists():
            self.path.rename(self.path.with_suffix(".jsonl.bak"))
        self.rows = {key(row): row for row in read_rows(self.path)}
        self.source = source()

    def have(self, run: dict[str, Any]) -> dict[str, Any]:
        if key(run) not in self.rows:
            raise SystemExit(f"{self.path} lacks the run {run}: train it first (--resume)")
        return self.rows[key(run)]

    def get(self, run: dict[str, Any]) -> dict[str, Any]:
        if key(run) not in self.rows:
            self.add(trained(run))
        return self.rows[key(run)]

    def add(self, row: dict[str, Any]) -> None:
        """A row just trained (:func:`trained`), with the commit it trained at, printed and appended."""
        row.update(self.source)
        print(json.dumps(row), flush=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        self.rows[key(row)] = row


def trained(run: dict[str, Any]) -> dict[str, Any]:
    """The row of ``run``: what it trained, and its seconds."""
    start = time.perf_counter()
    return {**run, **train(**run), "seconds": round(time.perf_counter() - start, 1)}


def source() -> dict[str, Any]:
    """The commit the runs train at, and whether the code they run (package, examples) differs from it."""

    def git(*args: str) -> str:
        folder = Path(__file__).resolve().parents[2]
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=folder, check=False).stdout.strip()

    return {
        "commit": git("rev-parse", "--short", "HEAD") or "?",
        "modified": bool(git("status", "--porcelain", "--", "lightning_rudra", "examples")),
    }


def read_rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def study_rows(
    name: str, doc: Optional[str], argv: Optional[list[str]], runs: Iterable[dict[str, Any]]
) -> tuple[list[dict[str, Any]], Path, argparse.Namespace]:
    """The command line of an in-process study, ``python -m examples.study.NAME`` (``doc``: its help): its output
    folder made, one thread, then its rows: ``runs`` trained (those already in ``<out>/runs.jsonl`` skipped with
    ``--resume``), or with ``--report-only`` the rows of that file. No rows: a line says so."""
    args, out = parse(name, doc, argv)
    if args.report_only:
        rows = read_rows(out / "runs.jsonl")
    else:
        store = Runs(out, args.resume)
        rows = [store.get(run) for run in runs]
    if not rows:
        print(f"no runs in {out / 'runs.jsonl'}: nothing to report")
    return rows, out, args


def parse(
    name: str,
    doc: Optional[str],
    argv: Optional[list[str]],
    extra: Optional[Callable[[argparse.ArgumentParser], None]] = None,
) -> tuple[argparse.Namespace, Path]:
    p = argparse.ArgumentParser(
        prog=f"python -m examples.study.{name}",
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", default=f"study_{name}", help=f"output folder (default: study_{name})")
    p.add_argument("--resume", action="store_true", help="skip the runs already in <out>/runs.jsonl")
    p.add_argument("--report-only", action="store_true", help="write the report from <out>/runs.jsonl, train nothing")
    if extra is not None:
        extra(p)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # one thread: the study's runs are timed and meant for one core each (torch's intra-op pool would take all)
    torch.set_num_threads(1)
    return args, out


def _mean(values: list[float], form: str = ".3f") -> str:
    """Mean ± standard deviation, each formatted by ``form``."""
    if not values:
        return "–"
    spread = f" ± {format(statistics.stdev(values), form.lstrip('+'))}" if len(values) > 1 else ""
    return f"{format(statistics.mean(values), form)}{spread}"


def score(row: dict[str, Any]) -> float:
    """What a choice minimises: the run's mean validation error over its last ``LAST`` epochs."""
    return statistics.mean(row["val_errors"][-LAST:])


def sweep_run(optimizer: str, lr: float, grid: Grid) -> dict[str, Any]:
    return dict(
        optimizer=optimizer,
        protocol="hardsync",
        learners=HARDSYNC_LEARNERS,
        n=1,
        rule="none",
        seed=TUNE_SEED,
        epochs=grid.epochs,
        lr=lr,
    )


def stale_run(optimizer: str, config: tuple, rule: str, seed: int, lr: float, grid: Grid) -> dict[str, Any]:
    protocol, learners, n = config
    return dict(
        optimizer=optimizer,
        protocol=protocol,
        learners=learners,
        n=n,
        rule=rule,
        seed=seed,
        epochs=2 * grid.epochs,
        lr=lr,
    )


def choose(get: Callable[[dict[str, Any]], dict[str, Any]], grid: Grid) -> dict[str, dict[str, Any]]:
    """Per optimizer, on seed ``TUNE_SEED``'s validation split: the rate (the sweep, extended until its best is
    interior) and then the rule. ``get(run)`` gives a run's row (trained, or one already there)."""
    chosen = {}
    for optimizer, rates in RATES.items():
        scores = {lr: score(get(sweep_run(optimizer, lr, grid))) for lr in rates}
        for _ in range(MAX_EXTENSIONS):
            lr = next_rate(scores)
            if lr is None:
                break
            scores[lr] = score(get(sweep_run(optimizer, lr, grid)))
        rate = min(scores, key=lambda lr: (scores[lr], lr))
        rules = {
            rule: statistics.mean(score(get(stale_run(optimizer, c, rule, TUNE_SEED, rate, grid))) for c in grid.tune)
            for rule in sorted(grid.rules, key=lambda r: r != DEFAULT)
        }
        chosen[optimizer] = dict(
            rate=rate, rates=scores, interior=next_rate(scores) is None, rule=min(rules, key=rules.get), rules=rules
        )
    return chosen


def reported_runs(chosen: dict[str, dict[str, Any]], grid: Grid) -> list[dict[str, Any]]:
    """The reported runs: hardsync on every seed, then the stale runs, the default rule's first."""
    runs = [{**sweep_run(o, c["rate"], grid), "seed": s} for s in SEEDS for o, c in chosen.items()]
    rules = [DEFAULT] + [r for r in grid.rules if r != DEFAULT]
    runs += [
        stale_run(o, config, rule, s, c["rate"], grid)
        for rule in rules
        for s in SEEDS
        for o, c in chosen.items()
        for config in grid.stale
        if rule in (DEFAULT, c["rule"], *grid.test_rules)
    ]
    return runs


def main(argv: Optional[list[str]] = None) -> None:
    def grid_option(p: argparse.ArgumentParser) -> None:
        p.add_argument("--grid", choices=sorted(GRIDS), default="full", help="which grid (default: full)")

    args, out = parse("compensation", __doc__, argv, grid_option)
    grid = GRIDS[args.grid]
    store = Runs(out, args.resume or args.report_only)
    get = store.have if args.report_only else store.get
    chosen = choose(get, grid)
    runs = reported_runs(chosen, grid)
    # --report-only: the reported runs there are (an interrupted grid's report says which it has)
    rows = [store.rows[key(r)] for r in runs if key(r) in store.rows] if args.report_only else [get(r) for r in runs]
    from examples.study.compensation_report import write_report

    write_report(rows, chosen, grid, args.grid, out)


if __name__ == "__main__":
    main()
