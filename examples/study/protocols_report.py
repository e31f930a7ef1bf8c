"""The protocols study's ``findings.md``, ``protocols.png`` and ``real.png`` (:mod:`examples.study.protocols`), from
``runs.jsonl`` (simulated λ = 16) and ``real.jsonl`` (real λ = 4, :mod:`examples.study.protocols_real`), with the
words of ``notes.md`` (written by hand from these numbers, kept as they are) under "In plain words"."""

import statistics
from pathlib import Path
from typing import Any, Optional, Sequence

from examples.study import protocols as study
from examples.study.compensation import equal_time_epochs, read_rows

LABELS = {
    "hardsync": "hardsync",
    "batchsync": "batchsync (K = λ)",
    "backup": "hardsync, backup = 2",
    "ssp": "SSP (4-softsync, s = 4, block)",
    "4-softsync": "4-softsync",
    "async": "async",
}


def _spread(values: Sequence[float], scale: float = 1.0, digits: int = 3, sign: str = "") -> str:
    """Mean ± standard deviation (× ``scale``)."""
    values = [scale * v for v in values]
    if not values:
        return "–"
    sd = f" ± {statistics.stdev(values):.{digits}f}" if len(values) > 1 else ""
    return f"{statistics.mean(values):{sign}.{digits}f}{sd}"


def reached(errors: Sequence[float], times: Sequence[float], target: float) -> Optional[float]:
    """The simulated time of the first epoch whose test error is at most ``target`` (None: never)."""
    return next((t for e, t in zip(errors, times) if e <= target), None)


def compare(run: dict[str, Any], hardsync: dict[str, Any]) -> dict[str, Any]:
    """``run`` against hardsync of its seed: test errors at hardsync's epochs and at its simulated time, the time
    each took for those epochs, and when ``run`` first reached hardsync's final error (fractions of hardsync's)."""
    e = hardsync["epochs"]
    budget, base = hardsync["times"][e - 1], hardsync["errors"][e - 1]
    cut = equal_time_epochs(run["times"], budget)
    first = reached(run["errors"], run["times"], base)
    pushes = run["gradients"] + run["late"][-1]
    return dict(
        epochs_error=run["errors"][e - 1],
        epochs_gap=run["errors"][e - 1] - base,
        time_ratio=run["times"][e - 1] / budget,
        time_epochs=cut,
        time_error=run["errors"][cut - 1] if cut else None,
        time_gap=run["errors"][cut - 1] - base if cut else None,
        to_target=None if first is None else first / budget,
        late=run["late"][-1] / pushes if pushes else 0.0,
        held=run["held"][-1] / len(run["held"]),
    )


def simulated_table(rows: list[dict[str, Any]]) -> list[str]:
    hardsync = {r["seed"]: r for r in rows if r["protocol"] == "hardsync"}
    e = study.EPOCHS
    lines = [
        f"| protocol | seeds | epochs trained | test error, {e} epochs | gap vs hardsync, {e} epochs (points) | "
        f"time of {e} epochs / hardsync's | equal time: epochs | test error, equal time | gap vs hardsync, equal "
        "time (points) | time to hardsync's final error / hardsync's time (seeds reaching it) | late gradients (% of "
        "pushes) | held pushes per epoch | mean σ | max σ | disagreements |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in study.PROTOCOLS:
        mine = [r for r in rows if r["protocol"] == name and r["seed"] in hardsync]
        if not mine:
            continue
        cells = [compare(r, hardsync[r["seed"]]) for r in mine]
        pick = lambda k: [c[k] for c in cells if c[k] is not None]  # noqa: E731
        lines.append(
            f"| {LABELS[name]} | {len(mine)} | {_spread([len(r['errors']) for r in mine], digits=0)} | "
            f"{_spread(pick('epochs_error'))} | {_spread(pick('epochs_gap'), 100, 1, '+')} | "
            f"{_spread(pick('time_ratio'), digits=2)} | {', '.join(str(c['time_epochs']) for c in cells)} | "
            f"{_spread(pick('time_error'))} | {_spread(pick('time_gap'), 100, 1, '+')} | "
            f"{_spread(pick('to_target'), digits=2)} ({len(pick('to_target'))}/{len(cells)}) | "
            f"{_spread(pick('late'), 100, 1)} | {_spread(pick('held'), digits=0)} | "
            f"{_spread([r['mean_staleness'] for r in mine], digits=2)} | {max(r['max_staleness'] for r in mine)} | "
            f"{sum(r['disagreements'][-1] for r in mine)} |"
        )
    return lines


def real_table(real: list[dict[str, Any]]) -> list[str]:
    ddp = {r["seed"]: r for r in real if r["name"] == "ddp"}
    lines = [
        "| protocol | seed | epochs | final test error | training s | time to DDP's final error (s) | "
        "to 0.35 (s) | samples/s | late | mean σ | max σ | straggler's mean sleep (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in real:
        target = ddp[r["seed"]]["curve"][-1][1] if r["seed"] in ddp else None  # as the curves round it
        times, errors = [t for t, _ in r["curve"]], [e for _, e in r["curve"]]
        first = None if target is None else reached(errors, times, target)
        loose = reached(errors, times, 0.35)
        mean = (r.get("straggler") or {}).get("mean_sleep")
        lines.append(
            f"| {r['name']} | {r['seed']} | {r['epochs']} | {r['test_error']:.3f} | {r['train_seconds']:.0f} | "
            f"{'–' if first is None else f'{first:.0f}'} | {'–' if loose is None else f'{loose:.0f}'} | "
            f"{r['samples_per_s']:.0f} | {r['late']} | {r['mean_staleness']:.2f} | {r['max_staleness']} | "
            f"{'–' if mean is None else f'{mean:.3f}'} |"
        )
    return lines


def write_report(rows: list[dict[str, Any]], out: Path) -> None:
    real = read_rows(out / "real.jsonl")
    e = study.EPOCHS
    commits = sorted({r.get("commit", "?") + (" (modified)" if r.get("modified") else "") for r in rows + real})
    notes = out / "notes.md"
    lines = [
        "# Which protocol when learners straggle (simulated λ = 16, real λ = 4)",
        "",
        f"Made by `python -m examples.study.protocols --out {out}` (simulated; the method: the module's docstring) "
        f"and `python -m examples.study.protocols_real --out {out}` (real learners) from `runs.jsonl` and "
        f"`real.jsonl`, at commit {', '.join(commits)}; {sum(r['seconds'] for r in rows) / 60:.0f} min of training "
        f"for the {len(rows)} simulated runs, {sum(r['wall_seconds'] for r in real) / 60:.0f} min of wall time for "
        f"the {len(real)} real ones.",
        "",
        f"## Simulated λ = {study.LEARNERS}: ShiftedExponential(0.5, 0.5) step times, μλ = {study.MU_LAMBDA}",
        "",
        f"Momentum SGD at {study.LR} (the compensation study's hardsync rate, chosen on its tuning seed's validation "
        f"split), compensation `{study.COMPENSATION}`, seeds {sorted({r['seed'] for r in rows})}. Hardsync trains "
        f"{e} epochs; every other protocol at least {e} and until its simulated time reaches hardsync's. Mean ± "
        "standard deviation over the seeds; gaps: the protocol's test error minus hardsync's after its "
        f"{e} epochs (same seed), in points. Equal time: the epochs the protocol had finished when hardsync "
        "finished (per seed). Late gradients: computed, not applied (their batches trained again). "
        "Disagreements: the order's assumptions against the server's statuses (0: none).",
        "",
        *simulated_table(rows),
        "",
        "![test error against epochs and simulated time](protocols.png)",
        "",
    ]
    if real:
        lines += [
            "## Real λ = 4: learner processes under RudraStrategy (popen), one straggler",
            "",
            "MNIST-1D, 6000 samples, μ = 32, momentum SGD at the same rate; the last learner sleeps before every "
            "batch for an exponential time of the mean in the table (twice the median step time of DDP's "
            "straggler on its first batches, measured in the DDP run). Training seconds: the training loop, the "
            "evaluation after every epoch excluded.",
            "",
            *real_table(real),
            "",
            "![test error against seconds, real learners](real.png)",
            "",
        ]
    lines += ["## In plain words", ""] + (notes.read_text().splitlines() if notes.exists() else ["(no notes.md)"])
    (out / "findings.md").write_text("\n".join(lines) + "\n")
    plot(rows, real, out)


def plot(rows: list[dict[str, Any]], real: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_epoch, by_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in study.PROTOCOLS:
        mine = [r for r in rows if r["protocol"] == name]
        if not mine:
            continue
        errors = [statistics.mean(x) for x in zip(*(r["errors"] for r in mine))]
        times = [statistics.mean(t) for t in zip(*(r["times"] for r in mine))]
        by_epoch.plot(range(1, len(errors) + 1), errors, label=LABELS[name])
        by_time.plot(times, errors, label=LABELS[name])
    by_epoch.set(xlabel="epoch", ylabel="test error (mean over seeds)", ylim=(0, 1), title="per epoch")
    by_time.set(xlabel="simulated time (mean step = 1)", ylim=(0, 1), title="per simulated time")
    by_time.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "protocols.png", dpi=100)
    plt.close(fig)
    if real:
        fig, ax = plt.subplots(figsize=(6, 4.5))
        for r in real:
            ax.plot([t for t, _ in r["curve"]], [e for _, e in r["curve"]], marker="o", label=f"{r['name']}")
        ax.set(xlabel="training seconds", ylabel="test error", ylim=(0, 1), title="real λ = 4, one straggler")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "real.png", dpi=100)
        plt.close(fig)
