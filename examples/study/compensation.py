"""Which staleness compensation to use: simulated learners at λ = 4 to 30, μλ constant, every rule, seeds.

    python -m examples.study.compensation --out docs/study/compensation --resume       # the grid, then the report
    python -m examples.study.compensation --out docs/study/compensation --report-only

λ virtual learners in one process, driven against the package's own :class:`lightning_rudra.Server` (the rules
the parameter server runs) with no Lightning around it: each learner computes its gradient on the weights it
last received, and pushes in the order the timing model (``Jittered(0.3)``, as the paper grid) says, as a
simulated run (``RudraStrategy(simulate=λ)``) does, about ten times faster. MNIST-1D, the example CNN, 4000
samples, μλ = 128. The rate is chosen the paper's way: swept on the synchronous run (hardsync, the same as one
learner with batch μλ) for each optimizer, the best final error wins. Hardsync trains ``EPOCHS`` epochs, the
stale runs twice as many; the report gives each rule's final error and the epochs it needed to come within 2
points of hardsync's. One JSON line per run in ``<out>/runs.jsonl``; ``--resume`` skips runs already there.
"""

import argparse
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any, Iterable, Optional

import torch
import torch.nn.functional as F

from examples.mnist1d import MNIST1DClassifier, generate_mnist1d
from lightning_rudra import ProtocolConfig, Server
from lightning_rudra.core.compression import ErrorFeedback, WeightDeltas
from lightning_rudra.core.optimizers import OptimizerSpec, hyperparameters
from lightning_rudra.timing import Jittered, push_order

EPOCHS = 30
NUM_SAMPLES = 4000
MU_LAMBDA = 128
SEEDS = (0, 1, 2)
LEARNERS = (4, 8, 16, 30)
RULES = ("paper", "momentum", "momentum+gap", "momentum+dc")  # paper: lr_modulation="mean", no compensation
DEFAULT = "momentum"  # RudraStrategy's default compensation: its runs come first, so an interrupted grid has it
RATES = {"sgd": (0.05, 0.1, 0.2), "adam": (0.001, 0.003, 0.01)}
WITHIN = 0.02  # of hardsync's final error


def grid(rates: dict[str, float]) -> list[dict[str, Any]]:
    """Every run, once the rates are chosen: hardsync per optimizer and seed; async at every λ, 4-softsync at λ = 16 and
    1-softsync (the strategy's default protocol) at λ = 4, under every rule, the default rule's runs first."""
    runs = [
        dict(optimizer=o, protocol="hardsync", learners=16, n=1, rule="none", seed=s, epochs=EPOCHS)
        for o in rates
        for s in SEEDS
    ]
    stale = [("async", lam, 1) for lam in LEARNERS] + [("softsync", 16, 4), ("softsync", 4, 1)]
    rules = [DEFAULT] + [r for r in RULES if r != DEFAULT]
    runs += [
        dict(optimizer=o, protocol=p, learners=lam, n=n, rule=r, seed=s, epochs=2 * EPOCHS)
        for r in rules
        for s in SEEDS
        for o in rates
        for p, lam, n in stale
    ]
    return [{**run, "lr": rates[run["optimizer"]]} for run in runs]


def sweep() -> list[dict[str, Any]]:
    return [
        dict(optimizer=o, protocol="hardsync", learners=16, n=1, rule="none", seed=SEEDS[0], epochs=EPOCHS, lr=lr)
        for o, lrs in RATES.items()
        for lr in lrs
    ]


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
) -> dict[str, Any]:
    """One run; returns its test error after every epoch. ``compression``: every push compressed as a learner on
    another host sends it (``RudraStrategy(compression=...)``), each learner keeping its own rounding errors, and
    the weights it gets back as differences from those it holds."""
    torch.manual_seed(seed)
    data = generate_mnist1d(NUM_SAMPLES, 42, 0.2)
    x, y = torch.tensor(data["x"], dtype=torch.float32), torch.tensor(data["y"])
    x_test, y_test = torch.tensor(data["x_test"], dtype=torch.float32), torch.tensor(data["y_test"])
    model = MNIST1DClassifier()
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=lr, momentum=0.9) if optimizer == "sgd" else torch.optim.Adam(params, lr=lr)
    options = dict(lr_modulation="mean") if rule == "paper" else dict(compensation=rule)
    config = ProtocolConfig(learners, protocol, n, **options)
    server = Server(config, [p.detach() for p in params], [], [OptimizerSpec.from_optimizer(opt, params)])
    hparams = [hyperparameters(group) for group in opt.param_groups]
    timing = Jittered(0.3, seed=seed)
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

    errors = []
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
            F.cross_entropy(model(x[batch]), y[batch]).backward()
            grad = torch.cat([p.grad.reshape(-1) for p in params])
            if feedback is not None:
                [grad] = feedback.compress(r, [grad])
            result = server.push(r, 0, [grad], torch.ones(len(params), dtype=torch.bool), timestamp, hparams, [])
            if protocol != "hardsync":
                held[r] = receive(r, server.pull())
            elif result.closed:  # hardsync: every learner gets the round's weights
                pulled = server.pull()
                held = [receive(learner, pulled) for learner in range(learners)]
        done = [d + s for d, s in zip(done, steps)]
        weights = server.pull()[0][0]
        torch.nn.utils.vector_to_parameters(weights, params)
        with torch.no_grad():
            errors.append(
                round((model(x_test).argmax(1) != y_test).float().mean().item(), 4)
                if math.isfinite(weights.sum().item())
                else 1.0
            )
    return {"errors": errors, "mean_staleness": round(server.stats.mean_staleness, 3)}


def key(run: dict[str, Any]) -> tuple:
    """What tells runs apart (``compression``: only the compression study's runs have it)."""
    fields = ("optimizer", "protocol", "learners", "n", "rule", "seed", "epochs", "lr", "compression")
    return tuple(run.get(k) for k in fields)


def run_all(runs: Iterable[dict[str, Any]], out: Path, resume: bool) -> list[dict[str, Any]]:
    path = out / "runs.jsonl"
    rows = read_rows(path) if resume else []
    have = {key(row) for row in rows}
    for run in runs:
        if key(run) in have:
            continue
        start = time.perf_counter()
        row = {**run, **train(**run), "seconds": round(time.perf_counter() - start, 1)}
        print(json.dumps(row), flush=True)
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
        rows.append(row)
        have.add(key(run))
    return rows


def read_rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def study_rows(
    name: str, doc: Optional[str], argv: Optional[list[str]], runs: Iterable[dict[str, Any]]
) -> tuple[list[dict[str, Any]], Path, argparse.Namespace]:
    """The command line of an in-process study, ``python -m examples.study.NAME`` (``doc``: its help): its output
    folder made, one thread, then its rows: ``runs`` trained (those already in ``<out>/runs.jsonl`` skipped with
    ``--resume``), or with ``--report-only`` the rows of that file. No rows: a line says so."""
    p = argparse.ArgumentParser(
        prog=f"python -m examples.study.{name}",
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", default=f"study_{name}", help=f"output folder (default: study_{name})")
    p.add_argument("--resume", action="store_true", help="skip the runs already in <out>/runs.jsonl")
    p.add_argument("--report-only", action="store_true", help="write the report from <out>/runs.jsonl, train nothing")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    rows = read_rows(out / "runs.jsonl") if args.report_only else run_all(runs, out, args.resume)
    if not rows:
        print(f"no runs in {out / 'runs.jsonl'}: nothing to report")
    return rows, out, args


def chosen_rates(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Per optimizer, the swept rate with the lowest final hardsync error."""
    best: dict[str, tuple[float, float]] = {}
    for row in rows:
        if row["protocol"] == "hardsync" and row["lr"] in RATES[row["optimizer"]] and row["seed"] == SEEDS[0]:
            error = row["errors"][-1]
            if row["optimizer"] not in best or error < best[row["optimizer"]][0]:
                best[row["optimizer"]] = (error, row["lr"])
    return {o: lr for o, (_, lr) in best.items()}


def _mean(values: list[float]) -> str:
    if not values:
        return "–"
    spread = f" ± {statistics.stdev(values):.3f}" if len(values) > 1 else ""
    return f"{statistics.mean(values):.3f}{spread}"


def epochs_to(errors: list[float], target: float) -> Optional[int]:
    return next((e + 1 for e, error in enumerate(errors) if error <= target), None)


def write_report(rows: list[dict[str, Any]], rates: dict[str, float], out: Path) -> None:
    lines = [
        "# Staleness compensation: which rule (simulated learners, MNIST-1D)",
        "",
        "Made by `python -m examples.study.compensation --out docs/study/compensation` "
        "(see the module's docstring for the method). Cells: mean test error ± standard deviation over the seeds "
        f"run (of {list(SEEDS)}) after the run's last epoch; in brackets, for each seed run, the epochs it needed to "
        f"come within {WITHIN:.2f} of hardsync's final error (– : never). Hardsync trains {EPOCHS} epochs, the stale runs "
        f"{2 * EPOCHS}.",
        "",
    ]
    lines += [
        "## Rates chosen on the synchronous run",
        "",
        "| optimizer | rate | hardsync final error |",
        "|---|---|---|",
    ]
    for row in sorted(
        (r for r in rows if r["protocol"] == "hardsync" and r["seed"] == SEEDS[0]),
        key=lambda r: (r["optimizer"], r["lr"]),
    ):
        mark = " (chosen)" if rates.get(row["optimizer"]) == row["lr"] else ""
        lines.append(f"| {row['optimizer']} | {row['lr']:g}{mark} | {row['errors'][-1]:.3f} |")
    for optimizer, lr in rates.items():
        at = [r for r in rows if r["optimizer"] == optimizer and r["lr"] == lr]
        sync = [r["errors"][-1] for r in at if r["protocol"] == "hardsync"]
        if not sync:
            continue
        target = statistics.mean(sync) + WITHIN
        title = "SGD, momentum 0.9" if optimizer == "sgd" else "Adam"
        lines += [
            "",
            f"## {title}, rate {lr:g}: hardsync {_mean(sync)}",
            "",
            "| protocol | λ | μ | " + " | ".join(RULES) + " |",
            "|---|---|---|" + "---|" * len(RULES),
        ]
        for protocol, lam, n in sorted(
            {(r["protocol"], r["learners"], r["n"]) for r in at if r["protocol"] != "hardsync"},
            key=lambda c: (c[0] != "async", c[1]),
        ):
            name = "async" if protocol == "async" else f"{n}-softsync"
            cells = []
            for rule in RULES:
                cell = [r for r in at if (r["protocol"], r["learners"], r["n"], r["rule"]) == (protocol, lam, n, rule)]
                needed = ", ".join(str(epochs_to(r["errors"], target) or "–") for r in cell)
                cells.append(f"{_mean([r['errors'][-1] for r in cell])} ({needed})" if cell else "–")
            lines.append(f"| {name} | {lam} | {MU_LAMBDA // lam} | " + " | ".join(cells) + " |")
    (out / "findings.md").write_text("\n".join(lines) + "\n")
    plot(rows, rates, out)


def plot(rows: list[dict[str, Any]], rates: dict[str, float], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rates), figsize=(5 * len(rates), 4), squeeze=False)
    for ax, (optimizer, lr) in zip(axes[0], rates.items()):
        at = [r for r in rows if r["optimizer"] == optimizer and r["lr"] == lr]
        for rule in RULES:
            cell = {
                lam: [r["errors"][-1] for r in at if (r["protocol"], r["rule"], r["learners"]) == ("async", rule, lam)]
                for lam in LEARNERS
            }
            xs = [lam for lam in LEARNERS if cell[lam]]
            ax.errorbar(
                xs,
                [statistics.mean(cell[lam]) for lam in xs],
                marker="o",
                capsize=3,
                label=rule,
                yerr=[statistics.stdev(cell[lam]) if len(cell[lam]) > 1 else 0 for lam in xs],
            )
        sync = [r["errors"][-1] for r in at if r["protocol"] == "hardsync"]
        if sync:
            ax.axhline(statistics.mean(sync), color="black", linestyle="--", label="hardsync")
        ax.set(xlabel="λ (async, μλ = 128)", ylabel="test error", title=f"{optimizer}, lr {lr:g}", ylim=(0, 1))
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "compensation.png", dpi=100)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> None:
    rows, out, args = study_rows("compensation", __doc__, argv, sweep())
    if not rows:
        return
    rates = chosen_rates(rows)
    if not args.report_only:
        rows = run_all(grid(rates), out, resume=True)
    write_report(rows, rates, out)


if __name__ == "__main__":
    main()
