"""The study's report: ``results.md`` (every run) and its plots."""

import json
import math
from pathlib import Path


def _f(row: dict[str, str], name: str) -> float:
    value = row.get(name, "")
    return float(value) if value not in ("", None) else math.nan


def _fmt(value: float, digits: int = 3) -> str:
    return "–" if math.isnan(value) else f"{value:.{digits}f}"


def _expected_staleness(row: dict[str, str]) -> str:
    if row["protocol"] not in ("softsync", "async"):
        return "0" if row["protocol"] == "hardsync" else "–"
    n, learners = int(row["n"]), int(row["learners"])
    return f"{n * (learners - 1) / learners:.2f}"


def write_markdown(rows: list[dict[str, str]], path: Path) -> None:
    order = {"single": 0, "hardsync": 1, "softsync": 2, "async": 3}
    rows = sorted(
        rows,
        key=lambda r: (
            order.get(r["protocol"], 9),
            int(r["learners"]),
            int(r["n"]),
            int(r["batch_size"]),
            r["lr_modulation"],
            int(r["seed"]),
        ),
    )
    settings = sorted({(r["epochs"], r["num_samples"], r["lr"]) for r in rows})
    lines = [
        "# Rudra tradeoff study on MNIST-1D",
        "",
        f"{len(rows)} runs, {sum(_f(r, 'wall_s') for r in rows) / 60:.1f} min of run wall time in all. "
        + "; ".join(f"{e} epochs, {s} samples, α0 = {lr}" for e, s, lr in settings)
        + ", SGD with momentum 0.9. Test error on the whole test split with the server's final weights. "
        "Wall time: the whole subprocess (start, rendezvous, training, teardown); samples/s: training samples "
        "(epochs × training set) over the training loop's wall time. σ: staleness in server updates; "
        "n(λ−1)/λ is the mean staleness expected when λ equally fast learners take turns (n-softsync applies "
        "an update every λ/n gradients, and the λ−1 other learners push once while one computes): the "
        "paper's ⟨σ⟩ ≈ n for large λ.",
        "",
        "| protocol | n | λ | μ | μλ | LR mod. | seed | test error | wall time (s) | train time (s) | samples/s "
        "| mean σ | n(λ−1)/λ | max σ | updates | dropped |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        n = r["n"] if r["protocol"] in ("softsync", "async") else "–"
        lines.append(
            f"| {r['protocol']} | {n} | {r['learners']} | {r['batch_size']} | {r['mu_lambda']} | {r['lr_modulation']} "
            f"| {r['seed']} | {_fmt(_f(r, 'test_error'))} | {_fmt(_f(r, 'wall_s'), 0)} | {_fmt(_f(r, 'train_s'), 1)} "
            f"| {_fmt(_f(r, 'samples_per_s'), 0)} | {_fmt(_f(r, 'mean_staleness'), 2)} | {_expected_staleness(r)} "
            f"| {r['max_staleness']} "
            f"| {r['updates']} | {r['dropped']} |"
        )
    lines += [
        "",
        "![test error vs μλ](error_vs_batch.png)",
        "",
        "![staleness](staleness.png)",
        "",
        "![test error vs wall time](error_vs_time.png)",
        "",
    ]
    path.write_text("\n".join(lines))


_SOFTSYNC_COLORS = ["tab:green", "tab:orange", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan"]
_MARKERS = {"none": "o", "mean": "s", "per_gradient": "^"}
_PROTOCOL_ORDER = {"single": 0, "hardsync": 1, "softsync": 2, "async": 3}


def _color(protocol: str, n: int) -> str:
    if protocol == "softsync":
        return _SOFTSYNC_COLORS[(n - 1) % len(_SOFTSYNC_COLORS)]
    return {"single": "black", "hardsync": "tab:blue", "async": "tab:red"}.get(protocol, "gray")


def _series_name(protocol: str, n: int, learners: int, lr_mod: str) -> str:
    name = {"softsync": f"{n}-softsync", "single": "single learner"}.get(protocol, protocol)
    return f"{name}, λ={learners}" + ("" if protocol in ("single", "hardsync") else f", lr_mod={lr_mod}")


def _save_error_plot(fig, ax, title: str, path: Path) -> Path:
    import matplotlib.pyplot as plt

    ax.set_ylabel("test error")
    ax.set_title(f"{title} (hollow: no LR modulation)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot(rows: list[dict[str, str]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    # 1. test error vs μλ: one line per (protocol, n, λ, lr_mod), mean over seeds
    series: dict[tuple, dict[int, list[float]]] = {}
    for r in rows:
        key = (
            _PROTOCOL_ORDER.get(r["protocol"], 9),
            r["protocol"],
            int(r["n"]),
            int(r["learners"]),
            r["lr_modulation"],
        )
        series.setdefault(key, {}).setdefault(int(r["mu_lambda"]), []).append(_f(r, "test_error"))
    fig, ax = plt.subplots(figsize=(8, 5))
    for index, ((_, protocol, n, learners, lr_mod), points) in enumerate(sorted(series.items())):
        xs = sorted(points)
        dodge = 1.0 + 0.025 * (index - len(series) / 2)  # keep points of equal μλ apart
        ys = [sum(points[x]) / len(points[x]) for x in xs]
        stale = protocol in ("softsync", "async")
        ax.plot(
            [x * dodge for x in xs],
            ys,
            marker=_MARKERS.get(lr_mod, "o"),
            color=_color(protocol, n),
            linestyle="--" if stale and lr_mod == "none" else "-",
            markersize=7,
            markerfacecolor="white" if stale and lr_mod == "none" else _color(protocol, n),
            label=_series_name(protocol, n, learners, lr_mod),
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("μ·λ (per-learner mini-batch × learners)")
    written.append(_save_error_plot(fig, ax, "Test error vs μ·λ, same number of epochs", out / "error_vs_batch.png"))

    # 2. staleness histogram per protocol (and n, λ), summed over μ, lr_mod and seeds
    hists: dict[tuple, dict[int, int]] = {}
    for r in rows:
        if r["protocol"] == "single":
            continue
        key = (int(r["learners"]), _PROTOCOL_ORDER[r["protocol"]], int(r["n"]), r["protocol"])
        hist = hists.setdefault(key, {})
        for s, c in json.loads(r["staleness"] or "{}").items():
            hist[int(s)] = hist.get(int(s), 0) + int(c)
    hists = {k: h for k, h in hists.items() if sum(h.values())}
    if hists:
        keys = sorted(hists)
        cols = min(4, len(keys))
        nrows = math.ceil(len(keys) / cols)
        fig, axes = plt.subplots(nrows, cols, figsize=(3.4 * cols, 3.0 * nrows), squeeze=False)
        for ax, key in zip(axes.flat, keys):
            learners, _, n, protocol = key
            hist = hists[key]
            total = sum(hist.values())
            mean = sum(s * c for s, c in hist.items()) / total
            cut = 2 * max(n, 1) + 3  # σ above this goes into one "tail" bar
            xs = list(range(cut + 1))
            heights = [hist.get(s, 0) / total for s in xs]
            tail = sum(c for s, c in hist.items() if s > cut) / total
            ax.bar(xs, heights, color=_color(protocol, n))
            ax.bar([cut + 1.5], [tail], color="gray")
            ax.set_xticks(
                list(range(0, cut + 1, max(1, (cut + 1) // 6))) + [cut + 1.5],
                [str(x) for x in range(0, cut + 1, max(1, (cut + 1) // 6))] + [f">{cut}"],
            )
            ax.axvline(mean, color="k", linestyle="--", linewidth=1, label=f"mean {mean:.2f}")
            if protocol != "hardsync":
                ax.axvline(
                    n * (learners - 1) / learners,
                    color="k",
                    linestyle=":",
                    linewidth=1,
                    label=f"n(λ−1)/λ = {n * (learners - 1) / learners:.2f}",
                )
                beyond = sum(c for s, c in hist.items() if s > 2 * n) / total
                extra = f", P(σ>2n) = {beyond:.1e}" if beyond else ", σ ≤ 2n always"
            else:
                extra = ""
            name = {"softsync": f"{n}-softsync", "async": f"async (= {n}-softsync)"}.get(protocol, protocol)
            ax.set_title(f"{name}, λ={learners}\nmax σ = {max(hist)}{extra}", fontsize=8)
            ax.set_xlabel("staleness σ (updates)", fontsize=8)
            ax.set_ylabel("fraction of applied gradients", fontsize=8)
            ax.set_yscale("log")
            ax.set_ylim(0.5 / total, 2.0)
            ax.legend(fontsize=6, loc="upper right")
        for ax in list(axes.flat)[len(keys) :]:
            ax.axis("off")
        fig.suptitle("Staleness of applied gradients, all runs of each protocol together", fontsize=10)
        fig.tight_layout()
        written.append(out / "staleness.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)

    # 3. test error vs training wall time
    fig, ax = plt.subplots(figsize=(8, 5))
    labelled = set()
    for r in sorted(rows, key=lambda r: (_PROTOCOL_ORDER.get(r["protocol"], 9), int(r["n"]))):
        protocol, n, lr_mod = r["protocol"], int(r["n"]), r["lr_modulation"]
        stale = protocol in ("softsync", "async")
        label = _series_name(protocol, n, int(r["learners"]), lr_mod)
        x, y = _f(r, "train_s"), _f(r, "test_error")
        ax.scatter(
            x,
            y,
            color=_color(protocol, n),
            marker=_MARKERS.get(lr_mod, "o"),
            s=50,
            facecolors="white" if stale and lr_mod == "none" else _color(protocol, n),
            label=None if label in labelled else label,
        )
        labelled.add(label)
        ax.annotate(f"μ={r['batch_size']}", (x, y), fontsize=6, xytext=(4, -3), textcoords="offset points")
    ax.set_xlabel("training wall time (s): the training loop, without process start-up")
    written.append(_save_error_plot(fig, ax, "Test error vs training wall time", out / "error_vs_time.png"))
    return written
