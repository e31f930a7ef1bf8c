"""``findings.md`` of the staleness-rule study (``python -m examples.study.staleness``), from its rows."""

import statistics
from pathlib import Path
from typing import Any

import examples.study.compensation as compensation
import examples.study.staleness as study
from examples.study.families import FAMILIES


def _config(row: dict[str, Any]) -> str:
    return f"async λ={row['learners']}" if row["protocol"] == "async" else f"{row['n']}-softsync λ={row['learners']}"


def _mean(values: list[float]) -> str:
    return compensation._mean(values, "+.1f")


def gaps(rows: list[dict[str, Any]], split: str) -> dict[tuple, list[float]]:
    """(family, optimizer, configuration, rule) -> the gap of each seed's stale run to that seed's hardsync, on the
    ``split`` measure (``errors``: test, ``val_errors``: validation)."""
    sync = {
        (r["family"], r["optimizer"], r["seed"]): r[split][study.EPOCHS - 1]
        for r in rows
        if r["protocol"] == "hardsync" and r["seed"] in study.SEEDS and len(r[split]) >= study.EPOCHS
    }
    out: dict[tuple, list[float]] = {}
    for r in rows:
        base = sync.get((r["family"], r["optimizer"], r["seed"]))
        if r["protocol"] == "hardsync" or base is None:
            continue
        value = study.gap(r["family"], r[split][-1], base)
        out.setdefault((r["family"], r["optimizer"], _config(r), r["rule"]), []).append(value)
    return out


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
    met = {rule: [0, 0] for rule in rules}
    for family, optimizer, config in dict.fromkeys(k[:3] for k in test):
        sync = hard.get((family, optimizer), [])
        cells = []
        for rule in rules:
            values = test.get((family, optimizer, config, rule), [])
            good = bool(values) and statistics.mean(values) <= study.TARGET
            met[rule][0] += good
            met[rule][1] += bool(values)
            cells.append(f"**{_mean(values)}**" if good else _mean(values))
        sync_text = f"{statistics.mean(sync):.3f}" if sync else "–"
        lines.append(f"| {family} | {optimizer} | {sync_text} | {config} | " + " | ".join(cells) + " |")
    lines += ["", "Target met: " + ", ".join(f"{rule} {m}/{n}" for rule, (m, n) in met.items()) + "."]
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
    (out / "findings.md").write_text("\n".join(lines) + "\n")


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
            for place, rule in enumerate(sorted(rules, key=mean.__getitem__), 1):
                ranks[rule].append(place)
                means[rule].append(mean[rule])
        if all(ranks.values()):
            out.append((optimizer, ranks, means))
    return out
