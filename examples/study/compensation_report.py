"""The compensation study's ``findings.md`` and ``compensation.png`` (:mod:`examples.study.compensation`), from its
rows: the choices made on validation, then every reported seed's test errors against hardsync's."""

import statistics
from pathlib import Path
from typing import Any, Optional

from examples.study import compensation as study
from examples.study import families


def _name(protocol: str, n: int) -> str:
    return "async" if protocol == "async" else f"{n}-softsync"


def _spread(values: list[float]) -> str:
    """Mean ± standard deviation, in points."""
    if not values:
        return "–"
    sd = f" ± {statistics.stdev(values):.1f}" if len(values) > 1 else ""
    return f"{statistics.mean(values):+.1f}{sd}"


def compare(stale: dict[str, Any], hardsync: dict[str, Any], epochs: int) -> dict[str, Any]:
    """A stale run against hardsync of its seed (``epochs`` epochs): its test error and the gap in points at equal
    epochs, at equal simulated time (hardsync's time at the stale run's λ) and at its end."""
    budget = study.simulated_times("hardsync", stale["learners"], epochs, stale["seed"], stale["train_samples"])[-1]
    cut = study.equal_time_epochs(stale["times"], budget)
    base = hardsync["errors"][-1]
    at_time: Optional[float] = stale["errors"][cut - 1] if cut else None
    return dict(
        hardsync=base,
        epochs_error=stale["errors"][epochs - 1],
        epochs_gap=100 * (stale["errors"][epochs - 1] - base),
        time_epochs=cut,
        time_error=at_time,
        time_gap=None if at_time is None else 100 * (at_time - base),
        end_error=stale["errors"][-1],
        end_gap=100 * (stale["errors"][-1] - base),
    )


def write_report(
    rows: list[dict[str, Any]], chosen: dict[str, dict[str, Any]], grid: Any, grid_name: str, out: Path
) -> None:
    e = grid.epochs
    tune = ", ".join(f"{_name(p, n)} λ = {lam}" for p, lam, n in grid.tune)
    lines = [
        "# Staleness compensation: which rule (simulated learners, MNIST-1D)",
        "",
        f"Made by `python -m examples.study.compensation --grid {grid_name} --out {out}` from `runs.jsonl` (the "
        "method: the module's docstring). Every choice below is made on the validation split of seed "
        f"{study.TUNE_SEED}, which is not reported; the test errors are of seeds {list(study.SEEDS)}, each with its "
        f"own MNIST-1D sample ({families.NUM_SAMPLES} samples), initial weights and step times. μλ = {study.MU_LAMBDA}; "
        f"hardsync trains {e} epochs, the stale runs {2 * e}. The runs trained at commit "
        + ", ".join(sorted({r.get("commit", "?") + (" (modified)" if r.get("modified") else "") for r in rows}))
        + f", in {sum(r['seconds'] for r in rows) / 60:.0f} min of training for the reported seeds' "
        f"{len(rows)} runs.",
        "",
        f"## Choices on validation (seed {study.TUNE_SEED})",
        "",
        f"Score: the run's mean validation error over its last {study.LAST} epochs. The rate: hardsync (λ = "
        f"{study.HARDSYNC_LEARNERS}), every rate tried (the first grid, extended while its best was at an edge). "
        f"The rule: mean score over {tune}, {2 * e} epochs, at the chosen rate.",
        "",
        "| optimizer | rates tried: score | chosen rate | interior | rules: mean score | chosen rule |",
        "|---|---|---|---|---|---|",
    ]
    for optimizer, c in chosen.items():
        rates = ", ".join(f"{lr:g}: {s:.3f}" for lr, s in sorted(c["rates"].items()))
        rules = ", ".join(f"{rule}: {s:.3f}" for rule, s in c["rules"].items())
        interior = "yes" if c["interior"] else f"no (after {study.MAX_EXTENSIONS} steps)"
        lines.append(f"| {optimizer} | {rates} | {c['rate']:g} | {interior} | {rules} | {c['rule']} |")

    hardsync = {(r["optimizer"], r["seed"]): r for r in rows if r["protocol"] == "hardsync"}
    cells = [
        (r, compare(r, hardsync[(r["optimizer"], r["seed"])], e))
        for r in rows
        if r["protocol"] != "hardsync" and (r["optimizer"], r["seed"]) in hardsync
    ]
    lines += [
        "",
        "## Test error against hardsync: summary",
        "",
        f"Gap: the stale run's test error minus hardsync's after {e} epochs (same seed), in points, mean ± standard "
        f"deviation over the seeds; at equal epochs ({e}), at equal simulated time (the epochs the stale run had "
        "finished when hardsync at its λ finished: in brackets, per seed) and at the stale run's end "
        f"({2 * e} epochs). Hardsync's test error after {e} epochs: "
        + "; ".join(
            f"{o} {study._mean([r['errors'][-1] for (ro, _), r in hardsync.items() if ro == o])}" for o in chosen
        )
        + ".",
        "",
        "| optimizer | rule | protocol | λ | seeds | gap, equal epochs | gap, equal time (epochs) | gap, at the end |",
        "|---|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r, cmp in cells:
        groups.setdefault((r["optimizer"], r["rule"], r["protocol"], r["learners"], r["n"]), []).append(cmp)
    order = sorted(groups, key=lambda g: (list(chosen).index(g[0]), g[1] != study.DEFAULT, g[1], g[2] != "async", g[3]))
    for optimizer, rule, protocol, lam, n in order:
        group = groups[(optimizer, rule, protocol, lam, n)]
        timed = [c["time_gap"] for c in group if c["time_gap"] is not None]
        cuts = ", ".join(str(c["time_epochs"]) for c in group)
        mark = " (default)" if rule == study.DEFAULT else ""
        lines.append(
            f"| {optimizer} | {rule}{mark} | {_name(protocol, n)} | {lam} | {len(group)} | "
            f"{_spread([c['epochs_gap'] for c in group])} | {_spread(timed)} ({cuts}) | "
            f"{_spread([c['end_gap'] for c in group])} |"
        )
    lines += [
        "",
        "## Test error per seed",
        "",
        f"| optimizer | rule | protocol | λ | seed | hardsync, {e} epochs | {e} epochs: error (gap) | "
        f"equal time: epochs, error (gap) | {2 * e} epochs: error (gap) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r, c in sorted(
        cells,
        key=lambda rc: (
            list(chosen).index(rc[0]["optimizer"]),
            rc[0]["rule"] != study.DEFAULT,
            rc[0]["rule"],
            rc[0]["protocol"] != "async",
            rc[0]["learners"],
            rc[0]["seed"],
        ),
    ):
        timed = "–" if c["time_error"] is None else f"{c['time_epochs']}, {c['time_error']:.3f} ({c['time_gap']:+.1f})"
        lines.append(
            f"| {r['optimizer']} | {r['rule']} | {_name(r['protocol'], r['n'])} | {r['learners']} | {r['seed']} | "
            f"{c['hardsync']:.3f} | {c['epochs_error']:.3f} ({c['epochs_gap']:+.1f}) | {timed} | "
            f"{c['end_error']:.3f} ({c['end_gap']:+.1f}) |"
        )
    (out / "findings.md").write_text("\n".join(lines) + "\n")
    plot(rows, chosen, out)


def plot(rows: list[dict[str, Any]], chosen: dict[str, dict[str, Any]], out: Path) -> None:
    """Test error against simulated time, mean over the seeds: the default rule's stale runs, hardsync at each λ."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(chosen), figsize=(6 * len(chosen), 4), squeeze=False)
    for ax, optimizer in zip(axes[0], chosen):
        mine = [r for r in rows if r["optimizer"] == optimizer]
        configs = sorted({(r["protocol"], r["learners"], r["n"]) for r in mine if r["rule"] == study.DEFAULT})
        timed: set[int] = set()  # the λ hardsync's curve is drawn for
        for protocol, lam, n in configs:
            runs = [
                r
                for r in mine
                if (r["protocol"], r["learners"], r["n"], r["rule"]) == (protocol, lam, n, study.DEFAULT)
            ]
            line = ax.plot(
                [statistics.mean(t) for t in zip(*(r["times"] for r in runs))],
                [statistics.mean(x) for x in zip(*(r["errors"] for r in runs))],
                label=f"{_name(protocol, n)} λ = {lam}",
            )[0]
            sync = [r for r in mine if r["protocol"] == "hardsync"]
            if sync and lam not in timed:
                timed.add(lam)
                times = [
                    study.simulated_times("hardsync", lam, r["epochs"], r["seed"], r["train_samples"]) for r in sync
                ]
                ax.plot(
                    [statistics.mean(t) for t in zip(*times)],
                    [statistics.mean(x) for x in zip(*(r["errors"] for r in sync))],
                    linestyle="--",
                    color=line.get_color(),
                    label=f"hardsync, timed at λ = {lam}",
                )
        ax.set(
            xlabel="simulated time (mean step = 1)",
            ylabel="test error",
            title=f"{optimizer}, lr {chosen[optimizer]['rate']:g}, {study.DEFAULT}",
            ylim=(0, 1),
        )
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "compensation.png", dpi=100)
    plt.close(fig)
