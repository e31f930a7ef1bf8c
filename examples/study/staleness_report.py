"""``findings.md`` of the staleness-rule study (``python -m examples.study.staleness``), from its rows."""

import math
import statistics
from pathlib import Path
from typing import Any

import examples.study.compensation as compensation
import examples.study.staleness as study
from examples.study.families import FAMILIES
from lightning_rudra.core.compensation import DEFAULT_COMPENSATION


def _config(row: dict[str, Any]) -> str:
    return f"async λ={row['learners']}" if row["protocol"] == "async" else f"{row['n']}-softsync λ={row['learners']}"


def _mean(values: list[float]) -> str:
    return compensation._mean(values, "+.1f")


def _hardsync(rows: list[dict[str, Any]], split: str) -> dict[tuple, float]:
    """(family, optimizer, seed) -> hardsync's ``split`` measure after its epochs."""
    return {
        (r["family"], r["optimizer"], r["seed"]): r[split][study.EPOCHS - 1]
        for r in rows
        if r["protocol"] == "hardsync" and r["seed"] in study.SEEDS and len(r[split]) >= study.EPOCHS
    }


def gaps(rows: list[dict[str, Any]], split: str, epoch: int = 0) -> dict[tuple, list[float]]:
    """(family, optimizer, configuration, rule) -> the gap of each seed's stale run to that seed's hardsync, on the
    ``split`` measure (``errors``: test, ``val_errors``: validation), after ``epoch`` epochs (0: its last)."""
    sync = _hardsync(rows, split)
    out: dict[tuple, list[float]] = {}
    for r in rows:
        base = sync.get((r["family"], r["optimizer"], r["seed"]))
        if r["protocol"] == "hardsync" or base is None:
            continue
        value = study.gap(r["family"], r[split][epoch - 1], base)
        out.setdefault((r["family"], r["optimizer"], _config(r), r["rule"]), []).append(value)
    return out


def epochs_to_target(rows: list[dict[str, Any]]) -> dict[tuple, list[float]]:
    """(family, optimizer, configuration, rule) -> per seed, the epochs after which a stale run's test measure stays
    within the target of that seed's hardsync after its epochs (inf: it is not within it at the end)."""
    sync = _hardsync(rows, "errors")
    out: dict[tuple, list[float]] = {}
    for r in rows:
        base = sync.get((r["family"], r["optimizer"], r["seed"]))
        if r["protocol"] == "hardsync" or base is None:
            continue
        within = [study.gap(r["family"], e, base) <= study.TARGET for e in r["errors"]]
        outside = [epoch for epoch, ok in enumerate(within, 1) if not ok]
        epochs = math.inf if within and not within[-1] else float(max(outside, default=0) + 1)
        out.setdefault((r["family"], r["optimizer"], _config(r), r["rule"]), []).append(epochs)
    return out


def _cells(
    gap: dict[tuple, list[float]], rules: list[str], epochs: dict[tuple, list[float]]
) -> tuple[dict[tuple, list[str]], dict[str, list[int]]]:
    """Per (family, optimizer, configuration) of ``gap``, a table row's cells, one per rule: its mean gap ± sd, bold
    where within the target, with the median of ``epochs`` in brackets where it has them; and per rule, [cells
    within the target, cells]."""
    rows: dict[tuple, list[str]] = {}
    met = {rule: [0, 0] for rule in rules}
    for family, optimizer, config in dict.fromkeys(k[:3] for k in gap):
        cells = []
        for rule in rules:
            values = gap.get((family, optimizer, config, rule), [])
            good = bool(values) and statistics.mean(values) <= study.TARGET
            met[rule][0] += good
            met[rule][1] += bool(values)
            reached = epochs.get((family, optimizer, config, rule))
            median = statistics.median(reached) if reached else None
            text = _mean(values) + ("" if median is None else f" ({'∞' if math.isinf(median) else f'{median:g}'})")
            cells.append(f"**{text}**" if good else text)
        rows[family, optimizer, config] = cells
    return rows, met


def write_report(
    rows: list[dict[str, Any]], chosen: dict[tuple[str, str], dict[str, Any]], swept: int, out: Path
) -> None:
    """``rows``: the reported runs, each once; ``swept``: how many runs the rate sweeps trained."""
    test, val = gaps(rows, "errors"), gaps(rows, "val_errors")
    commits = sorted({f"{r.get('commit', '?')}{' (modified)' if r.get('modified') else ''}" for r in rows})
    seconds = sum(r.get("seconds", 0) for r in rows)
    lines = [
        "# Which staleness rule, per optimizer family, on three model families (simulated learners)",
        "",
        f"Made by `python -m examples.study.staleness --out {out} --jobs 2` (the method: the module's docstring), "
        f"{len(rows)} reported runs (and {swept} of the rate sweeps) at commit {', '.join(commits) or '–'}, "
        f"{seconds / 60:.0f} min of training for the reported ones. "
        f"μλ = 128; hardsync trains {study.EPOCHS} epochs, the stale runs {study.STALE_EPOCHS}. *Gap*: a stale "
        f"run's test measure after {study.STALE_EPOCHS} epochs minus hardsync's after {study.EPOCHS} (same seed), "
        "in points of error (cnn, mlp) or in % of hardsync's held-out loss (lm); mean ± standard deviation over "
        f"seeds {', '.join(map(str, study.SEEDS))}. Target: a gap ≤ {study.TARGET:g} (**bold**: met).",
        "",
        "## Rates (hardsync, validation of the tuning seed)",
        "",
        "| family | optimizer | rates tried: score | rate | interior |",
        "|---|---|---|---|---|",
    ]
    for (family, optimizer), c in chosen.items():
        tried = ", ".join(f"{lr:g}: {score:.3f}" for lr, score in sorted(c["scores"].items()))
        lines.append(f"| {family} | {optimizer} | {tried} | {c['rate']:g} | {'yes' if c['interior'] else 'no'} |")
    hard = {}
    for r in rows:
        if r["protocol"] == "hardsync" and r["seed"] in study.SEEDS and len(r["errors"]) >= study.EPOCHS:
            hard.setdefault((r["family"], r["optimizer"]), []).append(r["errors"][study.EPOCHS - 1])
    rules = [rule for rule in study.RULES if any(k[3] == rule for k in test)]
    lines += [
        "",
        "## Gap to hardsync at 1.5× its epochs (test)",
        "",
        "| family | optimizer | hardsync | configuration | " + " | ".join(rules) + " |",
        "|---|---|---|---|" + "---|" * len(rules),
    ]
    table, met = _cells(test, rules, {})
    for (family, optimizer, config), cells in table.items():
        sync = hard.get((family, optimizer), [])
        sync_text = f"{statistics.mean(sync):.3f}" if sync else "–"
        lines.append(f"| {family} | {optimizer} | {sync_text} | {config} | " + " | ".join(cells) + " |")
    lines += ["", "Target met: " + ", ".join(f"{rule} {m}/{n}" for rule, (m, n) in met.items()) + "."]
    same, reach = gaps(rows, "errors", study.EPOCHS), epochs_to_target(rows)
    lines += [
        "",
        "## At hardsync's epochs (test)",
        "",
        f"The gap after {study.EPOCHS} epochs, as hardsync trained, and in brackets the epochs after which the run "
        f"stays within {study.TARGET:g} of hardsync's measure (median over seeds; ∞: not within it at the end): "
        "the issue's moonshot is a stale run that needs hardsync's epochs.",
        "",
        "| family | optimizer | configuration | " + " | ".join(rules) + " |",
        "|---|---|---|" + "---|" * len(rules),
    ]
    table, same_met = _cells(same, rules, reach)
    for (family, optimizer, config), cells in table.items():
        lines.append(f"| {family} | {optimizer} | {config} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Target met at {study.EPOCHS} epochs: "
        + ", ".join(f"{rule} {m}/{n}" for rule, (m, n) in same_met.items())
        + ".",
    ]
    floors = [FAMILIES["lm"].floor(s) for s in study.SEEDS] if FAMILIES["lm"].floor else []
    lm_sync = hard.get(("lm", "sgd-clip"))
    if floors and lm_sync:
        lines.append(
            f"The language's entropy (the lm floor) is {statistics.mean(floors):.3f} nats per token, mean of the "
            f"seeds; uniform guessing costs {FAMILIES['lm'].worst:.3f}; hardsync with clipped SGD reached "
            f"{statistics.mean(lm_sync):.3f}."
        )
    lines += [
        "",
        "## The rule per optimizer (validation of the reported seeds)",
        "",
        "Per family, the rules ranked by their mean validation gap over the configurations every rule has run (1: "
        "best); a rule's cell: its mean rank over the families (its mean gap, in the family's unit, per family). The "
        "lowest mean rank is chosen (ties: the lower mean gap).",
        "",
        "| optimizer | " + " | ".join(rules) + " | chosen |",
        "|---|" + "---|" * len(rules) + "---|",
    ]
    for optimizer, ranks, means in choices(val, rules):
        best = min(ranks, key=lambda rule: (statistics.mean(ranks[rule]), statistics.mean(means[rule])))
        cells = " | ".join(
            f"{statistics.mean(ranks[rule]):.2f} ({', '.join(f'{m:+.1f}' for m in means[rule])})" for rule in rules
        )
        lines.append(f"| {optimizer} | {cells} | {best} |")
    lines += ["", "## Curves", ""]
    lines += [f"![{family}](staleness-{family}.png)" for family in plot(rows, chosen, out)]
    (out / "findings.md").write_text("\n".join(lines) + "\n")


def _mean_curve(runs: list[list[float]]) -> list[float]:
    return [statistics.mean(values) for values in zip(*runs)]


def plot(rows: list[dict[str, Any]], chosen: dict[tuple[str, str], dict[str, Any]], out: Path) -> list[str]:
    """One figure per family, ``staleness-<family>.png``: per optimizer, the test measure (mean over the seeds)
    against epochs (top) and against simulated time (bottom) of hardsync and of every stale configuration under the
    default rule; hardsync's time is drawn at each λ, dashed in that configuration's colour (it waits for the
    slowest of λ). Returns the families drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = []
    for family in dict.fromkeys(f for f, _ in chosen):
        optimizers = [o for f, o in chosen if f == family]
        fig, axes = plt.subplots(2, len(optimizers), figsize=(4.5 * len(optimizers), 7), squeeze=False)
        for column, optimizer in enumerate(optimizers):
            mine = [
                r for r in rows if (r["family"], r["optimizer"]) == (family, optimizer) and r["seed"] in study.SEEDS
            ]
            sync = [r for r in mine if r["protocol"] == "hardsync"]
            by_epoch, by_time = axes[0][column], axes[1][column]
            if sync:
                by_epoch.plot(
                    range(1, study.EPOCHS + 1), _mean_curve([r["errors"] for r in sync]), "k--", label="hardsync"
                )
            for protocol, lam, n in study.STALE:
                runs = [
                    r
                    for r in mine
                    if (r["protocol"], r["learners"], r["n"], r["rule"]) == (protocol, lam, n, DEFAULT_COMPENSATION)
                ]
                if not runs:
                    continue
                errors = _mean_curve([r["errors"] for r in runs])
                name = _config(runs[0])
                line = by_epoch.plot(range(1, len(errors) + 1), errors, label=name)[0]
                by_time.plot(_mean_curve([r["times"] for r in runs]), errors, color=line.get_color(), label=name)
                if sync:
                    times = [
                        compensation.simulated_times("hardsync", lam, r["epochs"], r["seed"], r["train_samples"])
                        for r in sync
                    ]
                    by_time.plot(
                        _mean_curve(times),
                        _mean_curve([r["errors"] for r in sync]),
                        "--",
                        color=line.get_color(),
                        label=f"hardsync at λ={lam}",
                    )
            measure = "held-out loss (nats)" if family == "lm" else "test error"
            rate = chosen[family, optimizer]["rate"]
            by_epoch.set(
                xlabel="epoch", ylabel=measure, title=f"{family}, {optimizer}, lr {rate:g}, {DEFAULT_COMPENSATION}"
            )
            by_time.set(xlabel="simulated time (mean step = 1)", ylabel=measure)
            for ax in (by_epoch, by_time):
                if family != "lm":
                    ax.set_ylim(0, 1)
                if ax.get_legend_handles_labels()[0]:  # a grid cut short may have nothing to draw here
                    ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / f"staleness-{family}.png", dpi=90)
        plt.close(fig)
        drawn.append(family)
    return drawn


def choices(val: dict[tuple, list[float]], rules: list[str]) -> list[tuple[str, dict, dict]]:
    """Per optimizer: each rule's rank and mean validation gap per family, over the (family, configuration) pairs
    that every rule has run (an interrupted grid compares like with like); optimizers with none left out."""
    out = []
    for optimizer in dict.fromkeys(k[1] for k in val):
        ranks: dict[str, list[float]] = {rule: [] for rule in rules}
        means: dict[str, list[float]] = {rule: [] for rule in rules}
        for family in dict.fromkeys(k[0] for k in val if k[1] == optimizer):
            configs = {k[2] for k in val if k[:2] == (family, optimizer)}
            common = [c for c in configs if all((family, optimizer, c, rule) in val for rule in rules)]
            if not common:
                continue
            mean = {rule: statistics.mean(v for c in common for v in val[family, optimizer, c, rule]) for rule in rules}
            # a NaN gap (a measure of finite weights that is not a number) ranks last, as an infinite one
            mean = {rule: m if m == m else math.inf for rule, m in mean.items()}
            order = sorted(mean.values())
            for rule in rules:  # rules of the same mean gap (one that changes nothing here) share their places
                places = [place for place, m in enumerate(order, 1) if m == mean[rule]]
                ranks[rule].append(statistics.mean(places))
                means[rule].append(mean[rule])
        if all(ranks.values()):
            out.append((optimizer, ranks, means))
    return out
