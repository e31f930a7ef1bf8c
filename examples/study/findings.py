"""The paper-scale report (``--grid paper``): the Rudra paper's three findings, answered with numbers.

Writes ``findings.md`` and three plots from the rows of ``runs.csv`` that the paper grid made:

- ``findings_mu_lambda.png``: test error against λ with μλ constant and with μ constant (finding 1);
- ``findings_staleness.png``: ⟨σ⟩ and the fraction of σ > 2n against n at λ = 30 (finding 2);
- ``findings_modulation.png``: test error against n at λ = 30, per learning-rate modulation (finding 3).

Every number is a mean over the seeds of a configuration, ± their standard deviation.
"""

import itertools
import json
import math
import statistics
from pathlib import Path

from examples.study.grid import (
    PAPER_ALPHA0,
    PAPER_EPOCHS,
    PAPER_GROWING_MU,
    PAPER_LEARNERS,
    PAPER_MU_LAMBDA,
    PAPER_NS,
    PAPER_SAMPLES,
    PAPER_SPREAD,
    RunConfig,
    choose_alpha0,
)

_LR_MODS = ("none", "mean", "per_gradient")
_LR_MOD_NAMES = {"none": "α0 (none)", "mean": "α0/⟨σ⟩ (mean)", "per_gradient": "α0/σ (per gradient)"}


def _matching(rows: list[dict[str, str]], **match) -> list[dict[str, str]]:
    """The rows whose configuration has the given field values."""
    return [
        row
        for row in rows
        if all(getattr(config, k) == v for config in [RunConfig.from_row(row)] for k, v in match.items())
    ]


def _errors(rows: list[dict[str, str]], **match) -> list[float]:
    return [float(row["test_error"]) for row in _matching(rows, **match)]


def _mean_sd(values: list[float]) -> tuple[float, float]:
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def _cell(values: list[float]) -> str:
    mean, sd = _mean_sd(values)
    if math.isnan(mean):
        return "–"
    return f"{mean:.3f} ± {sd:.3f} ({len(values)})" if len(values) > 1 else f"{mean:.3f} (1)"


def _histogram(rows: list[dict[str, str]], **match) -> dict[int, int]:
    hist: dict[int, int] = {}
    for row in _matching(rows, **match):
        for s, c in json.loads(row["staleness"] or "{}").items():
            hist[int(s)] = hist.get(int(s), 0) + int(c)
    return hist


def _staleness_summary(hist: dict[int, int], n: int) -> tuple[float, float, int]:
    """⟨σ⟩, the fraction of applied gradients with σ > 2n, max σ."""
    total = sum(hist.values())
    if not total:
        return math.nan, math.nan, 0
    mean = sum(s * c for s, c in hist.items()) / total
    return mean, sum(c for s, c in hist.items() if s > 2 * n) / total, max(hist)


def write_findings(rows: list[dict[str, str]], out: Path) -> list[Path]:
    rows = _matching(rows, epochs=PAPER_EPOCHS, num_samples=PAPER_SAMPLES)
    try:
        alpha0 = choose_alpha0(rows)
    except ValueError:
        return []
    at = _matching(rows, lr=alpha0, momentum=0.9)
    try:  # stage 3: plain SGD at the α0 of its own sweep
        plain_alpha0 = choose_alpha0(rows, momentum=0.0)
    except ValueError:
        plain_alpha0 = math.nan
    plain = _matching(rows, lr=plain_alpha0, momentum=0.0)
    lam = PAPER_LEARNERS[-1]
    mu = PAPER_MU_LAMBDA // lam
    baseline = _errors(at, protocol="single", batch_size=PAPER_MU_LAMBDA)
    lines = [
        "# The Rudra paper's findings at λ = 30, on MNIST-1D (simulated learners)",
        "",
        f"Made by `python -m examples.study --grid paper --jobs 2 --out docs/study/paper`: {len(rows)} runs, "
        f"{PAPER_EPOCHS} epochs of {PAPER_SAMPLES} samples' training split, SGD with momentum 0.9 (the paper's), "
        "and the finding rows again with plain SGD (momentum 0, 1 seed) at the α0 of its own sweep. Learners are "
        f"simulated in one process (`RudraStrategy(simulate=λ, timing=Jittered({PAPER_SPREAD}))`: step times "
        f"log-normal, spread {PAPER_SPREAD}) unless marked real. Cells: mean test error ± standard deviation over "
        "seeds (number of seeds).",
        "",
        "## α0, chosen the paper's way",
        "",
        f"The single learner with μ = {PAPER_MU_LAMBDA}, for each α0 of the sweep; the lowest mean error wins and "
        "every run at that momentum uses it.",
        "",
        "| momentum | α0 | test error |",
        "|---|---|---|",
    ]
    for momentum, chosen in ((0.9, alpha0), (0.0, plain_alpha0)):
        for lr in PAPER_ALPHA0[momentum]:
            values = _errors(rows, protocol="single", batch_size=PAPER_MU_LAMBDA, lr=lr, momentum=momentum)
            lines.append(f"| {momentum:g} | {lr:g}{' (chosen)' if lr == chosen else ''} | {_cell(values)} |")

    lines += [
        "",
        "## 1. μλ constant keeps the baseline's accuracy; μλ growing loses it",
        "",
        f"μλ = {PAPER_MU_LAMBDA} constant (μ = {PAPER_MU_LAMBDA}/λ), against μ = {PAPER_GROWING_MU} "
        f"constant (μλ = {PAPER_GROWING_MU}·λ). Same epochs, same α0 = {alpha0:g}; the last two columns "
        f"repeat μλ constant without momentum (α0 = {plain_alpha0:g}).",
        "",
        "| λ | μ | hardsync | 1-softsync, α0/⟨σ⟩ | μλ growing: μλ | hardsync | no momentum: hardsync | 1-softsync |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for learners in PAPER_LEARNERS:
        batch = PAPER_MU_LAMBDA // learners
        if learners == 1:
            constant = [
                _cell(baseline),
                "(single learner)",
                _cell(_errors(plain, protocol="single", batch_size=batch)),
                "(single learner)",
            ]
            growing = _cell(_errors(at, protocol="single", batch_size=PAPER_GROWING_MU))
        else:
            constant = [
                _cell(
                    _errors(
                        rows_at,
                        protocol=protocol,
                        n=n,
                        learners=learners,
                        batch_size=batch,
                        lr_modulation=lr_mod,
                        simulated=1,
                    )
                )
                for rows_at in (at, plain)
                for protocol, n, lr_mod in (("hardsync", 0, "none"), ("softsync", 1, "mean"))
            ]
            growing = _cell(
                _errors(at, protocol="hardsync", learners=learners, batch_size=PAPER_GROWING_MU, simulated=1)
            )
        lines.append(
            f"| {learners} | {batch} | {constant[0]} | {constant[1]} | {PAPER_GROWING_MU * learners} "
            f"| {growing} | {constant[2]} | {constant[3]} |"
        )

    lines += [
        "",
        f"## 2. n-softsync: ⟨σ⟩ ≈ n, and σ ≤ 2n almost always (λ = {lam}, μ = {mu})",
        "",
        "All runs of each n together (every modulation and seed).",
        "",
        "| n | ⟨σ⟩ | n(λ−1)/λ | fraction σ > 2n | max σ | gradients |",
        "|---|---|---|---|---|---|",
    ]
    for n in PAPER_NS:
        hist = _histogram(at, learners=lam, n=n, simulated=1)
        mean, beyond, top = _staleness_summary(hist, n)
        lines.append(
            f"| {n}{' (async)' if n == lam else ''} | {mean:.2f} | {n * (lam - 1) / lam:.2f} "
            f"| {beyond:.2e} | {top} | {sum(hist.values())} |"
        )

    lines += [
        "",
        f"## 3. Without LR modulation large n degrades; with it every n reaches the baseline (λ = {lam})",
        "",
        f"Single learner (μ = {PAPER_MU_LAMBDA}): {_cell(baseline)}; hardsync λ = {lam}: "
        f"{_cell(_errors(at, protocol='hardsync', learners=lam, batch_size=mu, simulated=1))}.",
        "",
        f"The last two columns: the same without momentum (α0 = {plain_alpha0:g}; single learner "
        f"{_cell(_errors(plain, protocol='single', batch_size=PAPER_MU_LAMBDA))}).",
        "",
        "| n | " + " | ".join(_LR_MOD_NAMES[m] for m in _LR_MODS) + " | no momentum: none | mean |",
        "|---|---|---|---|---|---|",
    ]
    for n in PAPER_NS:
        cells = [
            _cell(_errors(rows_at, learners=lam, n=n, batch_size=mu, lr_modulation=m, simulated=1))
            for rows_at, mods in ((at, _LR_MODS), (plain, ("none", "mean")))
            for m in mods
        ]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")

    lines += [
        "",
        "## The simulator against real learner processes (λ = 4)",
        "",
        "The same configurations with λ = 4 real learner processes and a server process on this 2-core "
        "machine, and simulated. Real step times are what the machine gave; simulated ones are jittered.",
        "",
        "| configuration | test error real / simulated | ⟨σ⟩ real / simulated | max σ real / simulated |",
        "|---|---|---|---|",
    ]
    for protocol, n, lr_mod in (("hardsync", 0, "none"), ("softsync", 1, "mean"), ("async", 4, "mean")):
        match = dict(protocol=protocol, n=n, learners=4, batch_size=PAPER_MU_LAMBDA // 4, lr_modulation=lr_mod)
        real, sim = _errors(at, simulated=0, **match), _errors(at, simulated=1, **match)
        real_s = _staleness_summary(_histogram(at, simulated=0, **match), max(n, 1))
        sim_s = _staleness_summary(_histogram(at, simulated=1, **match), max(n, 1))
        name = {"softsync": f"{n}-softsync", "async": "async"}.get(protocol, protocol)
        lines.append(
            f"| {name}, lr_mod={lr_mod} | {_cell(real)} / {_cell(sim)} | {real_s[0]:.2f} / {sim_s[0]:.2f} "
            f"| {real_s[2]} / {sim_s[2]} |"
        )
    lines += [
        "",
        "![error vs λ](findings_mu_lambda.png)",
        "",
        "![staleness vs n](findings_staleness.png)",
        "",
        "![error vs n](findings_modulation.png)",
        "",
    ]
    path = out / "findings.md"
    path.write_text("\n".join(lines))
    return [path] + _plots(at, plain, out, baseline)


def _plots(at: list[dict[str, str]], plain: list[dict[str, str]], out: Path, baseline: list[float]) -> list[Path]:
    """``at``: the runs at momentum 0.9 and its α0 (solid); ``plain``: without momentum (dotted)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lam, mu = PAPER_LEARNERS[-1], PAPER_MU_LAMBDA // PAPER_LEARNERS[-1]
    written = []

    def errorbars(ax, xs, samples, **style) -> None:
        points = [(x, *_mean_sd(s)) for x, s in zip(xs, samples) if s]
        if points:
            ax.errorbar(
                [p[0] for p in points],
                [p[1] for p in points],
                yerr=[p[2] for p in points],
                capsize=3,
                marker="o",
                **style,
            )

    def finish(fig, ax, name: str, title: str) -> None:
        ax.set_title(title, fontsize=10)
        ax.set_ylabel("test error")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(out / name)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    learners = PAPER_LEARNERS
    for (protocol, n, lr_mod, color), (rows, style) in itertools.product(
        (("hardsync", 0, "none", "tab:blue"), ("softsync", 1, "mean", "tab:green")), ((at, "-"), (plain, ":"))
    ):
        samples = [
            _errors(rows, protocol="single", batch_size=PAPER_MU_LAMBDA)
            if lam == 1
            else _errors(
                rows,
                protocol=protocol,
                n=n,
                learners=lam,
                batch_size=PAPER_MU_LAMBDA // lam,
                lr_modulation=lr_mod,
                simulated=1,
            )
            for lam in learners
        ]
        errorbars(
            ax,
            learners,
            samples,
            color=color,
            linestyle=style,
            label=f"{'hardsync' if n == 0 else '1-softsync, α0/⟨σ⟩'}, μλ = {PAPER_MU_LAMBDA}"
            + (", no momentum" if rows is plain else ""),
        )
    samples = [
        _errors(at, protocol="single", batch_size=PAPER_GROWING_MU)
        if lam == 1
        else _errors(at, protocol="hardsync", learners=lam, batch_size=PAPER_GROWING_MU, simulated=1)
        for lam in learners
    ]
    errorbars(
        ax, learners, samples, color="tab:red", linestyle="--", label=f"hardsync, μ = {PAPER_GROWING_MU}: μλ grows"
    )
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(learners), [str(lam) for lam in learners])
    ax.set_xlabel("λ (learners)")
    finish(fig, ax, "findings_mu_lambda.png", "Finding 1: test error vs λ, same epochs and α0")

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    ns = list(PAPER_NS)
    summaries = [_staleness_summary(_histogram(at, learners=lam, n=n, simulated=1), n) for n in ns]
    left.plot(ns, [s[0] for s in summaries], marker="o", color="tab:green", label="measured ⟨σ⟩")
    left.plot(ns, ns, color="k", linestyle=":", label="n")
    left.plot(ns, [n * (lam - 1) / lam for n in ns], color="gray", linestyle="--", label="n(λ−1)/λ")
    left.set_xlabel("n")
    left.set_ylabel("mean staleness ⟨σ⟩")
    left.grid(alpha=0.3)
    left.legend(fontsize=8)
    left.set_title(f"⟨σ⟩ vs n, λ = {lam}", fontsize=10)
    right.bar([str(n) for n in ns], [max(s[1], 0.0) for s in summaries], color="tab:orange")
    right.set_xlabel("n")
    right.set_ylabel("fraction of gradients with σ > 2n")
    right.set_title("σ > 2n", fontsize=10)
    right.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "findings_staleness.png", dpi=110)
    plt.close(fig)
    written.append(out / "findings_staleness.png")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for lr_mod, color in zip(_LR_MODS, ("tab:gray", "tab:green", "tab:purple")):
        errorbars(
            ax,
            ns,
            [_errors(at, learners=lam, n=n, batch_size=mu, lr_modulation=lr_mod, simulated=1) for n in ns],
            color=color,
            label=_LR_MOD_NAMES[lr_mod],
        )
        if lr_mod != "per_gradient":
            errorbars(
                ax,
                ns,
                [_errors(plain, learners=lam, n=n, batch_size=mu, lr_modulation=lr_mod, simulated=1) for n in ns],
                color=color,
                linestyle=":",
                label=_LR_MOD_NAMES[lr_mod] + ", no momentum",
            )
    if baseline:
        ax.axhline(statistics.fmean(baseline), color="k", linestyle="--", linewidth=1, label="single learner")
    plain_baseline = _errors(plain, protocol="single", batch_size=PAPER_MU_LAMBDA)
    if plain_baseline:
        ax.axhline(
            statistics.fmean(plain_baseline), color="k", linestyle=":", linewidth=1, label="single learner, no momentum"
        )
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_xlabel(f"n (λ = {lam}; n = {lam} is async)")
    finish(fig, ax, "findings_modulation.png", "Finding 3: test error vs n, per learning-rate modulation")
    return written
