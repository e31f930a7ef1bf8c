"""The Rudra paper's accuracy/runtime tradeoff study, on MNIST-1D, for real.

    python -m examples.study                                   # small grid (10 runs, ~5 min), into study_results/
    python -m examples.study --grid medium --out study_results --resume

Every configuration (protocol × n × μ × λ × learning-rate modulation, plus single-learner baselines) trains
in its own subprocess (``python -m examples.study_runner ...``: λ learner processes and one server process
under ``RudraStrategy``), so one failure or hang cannot take the sweep down. For every finished run one row
is appended to ``<out>/runs.csv``; ``--resume`` skips the configurations already there. At the end (and
with ``--report-only``, without training) it writes ``<out>/results.md`` and the plots:

- ``error_vs_batch.png``: test error against μ·λ, per protocol;
- ``staleness.png``: staleness histogram per protocol (and n);
- ``error_vs_time.png``: test error against training wall time.

The small grid is built to speak to the paper's three findings (see ``GRIDS``): keeping μ·λ constant keeps
the baseline's accuracy while a large μ·λ hurts; n-softsync has mean staleness about n; without learning-rate
modulation large-n softsync and async degrade, with it they recover.
"""

import argparse
import csv
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, astuple, dataclass, fields, replace
from pathlib import Path
from typing import Any, Iterable, Optional

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class RunConfig:
    """One training run. Its fields, all together, are the run's key in ``runs.csv``."""

    protocol: str  # single (λ = 1, no parameter server) | hardsync | softsync | async
    n: int  # softsync's n; async is λ-softsync (n = λ); 0 for hardsync and single
    learners: int  # λ
    batch_size: int  # μ, per learner
    lr_modulation: str  # none | mean | per_gradient
    epochs: int
    num_samples: int
    lr: float
    seed: int

    @property
    def mu_lambda(self) -> int:
        return self.batch_size * self.learners

    def key(self) -> tuple[Any, ...]:
        return astuple(self)

    @classmethod
    def from_row(cls, row: dict[str, str]) -> "RunConfig":
        """The configuration of a ``runs.csv`` row (values converted back to their field types)."""
        return cls(**{f.name: f.type(row[f.name]) for f in fields(cls)})

    def label(self, seed: bool = False) -> str:
        name = {"softsync": f"softsync n={self.n}", "single": "single"}.get(self.protocol, self.protocol)
        return f"{name} λ={self.learners} μ={self.batch_size} lr_mod={self.lr_modulation}" + (
            f" seed={self.seed}" if seed else "")

    def runner_args(self) -> list[str]:
        return ["--protocol", self.protocol, "--n", str(max(1, self.n)), "--learners", str(self.learners),
                "--batch-size", str(self.batch_size), "--lr-modulation", self.lr_modulation,
                "--epochs", str(self.epochs), "--num-samples", str(self.num_samples), "--lr", repr(self.lr),
                "--seed", str(self.seed)]


KEY_FIELDS = [f.name for f in fields(RunConfig)]
RESULT_FIELDS = ["mu_lambda", "test_error", "test_loss", "train_loss", "wall_s", "train_s", "samples",
                 "samples_per_s", "mean_staleness", "max_staleness", "updates", "gradients", "dropped", "staleness"]
CSV_FIELDS = KEY_FIELDS + RESULT_FIELDS


# ---- the grids -----------------------------------------------------------------------------------------------
def _grid(rows: Iterable[tuple[str, int, int, int, str]], epochs: int, num_samples: int, lr: float,
          seeds: Iterable[int] = (42,)) -> list[RunConfig]:
    """Configurations from (protocol, n, λ, μ, lr_modulation); duplicates dropped, order kept."""
    out: dict[tuple, RunConfig] = {}
    for seed in seeds:
        for protocol, n, learners, mu, lr_mod in rows:
            if protocol == "async":
                n = learners
            elif protocol in ("hardsync", "single"):
                n = 0
            if protocol in ("hardsync", "single"):
                lr_mod = "none"  # never stale: modulation would change nothing
            config = RunConfig(protocol, n, learners, mu, lr_mod, epochs, num_samples, lr, seed)
            out.setdefault(config.key(), config)
    return list(out.values())


def small_grid() -> list[RunConfig]:
    """10 runs, about five minutes on two busy CPU cores: λ = 4 learners against the single learner with
    μ = 64, at the example configs' α0 = 0.05 (tuned for μλ = 64), 12 epochs of 2880 training samples.

    (1) μλ = 64 kept constant (single μ=64; hardsync and 1-softsync with λ=4, μ=16) against μλ = 512
        (single μ=512, hardsync λ=4 μ=128), at the same number of epochs;
    (2) the staleness of 1-, 2- and 4-softsync (async is 4-softsync for λ = 4), all at λ=4, μ=16;
    (3) 2-softsync and async without LR modulation, with α0/⟨σ⟩ (``mean``) and, for async, with α0/σ per
        gradient (``per_gradient``).
    """
    rows = [
        ("single", 0, 1, 64, "none"),
        ("hardsync", 0, 4, 16, "none"),
        ("softsync", 1, 4, 16, "mean"),
        ("softsync", 2, 4, 16, "mean"),
        ("softsync", 2, 4, 16, "none"),
        ("async", 4, 4, 16, "mean"),
        ("async", 4, 4, 16, "per_gradient"),
        ("async", 4, 4, 16, "none"),
        ("single", 0, 1, 512, "none"),
        ("hardsync", 0, 4, 128, "none"),
    ]
    return _grid(rows, epochs=12, num_samples=4000, lr=0.05)


def medium_grid() -> list[RunConfig]:
    """42 runs (about half an hour here): λ ∈ {2, 4}, μλ ∈ {64, 256}, every n, all three modulations."""
    rows: list[tuple[str, int, int, int, str]] = []
    for mu_lambda in (64, 256):
        rows.append(("single", 0, 1, mu_lambda, "none"))
        for learners in (2, 4):
            mu = mu_lambda // learners
            rows.append(("hardsync", 0, learners, mu, "none"))
            for n in range(1, learners + 1):
                for lr_mod in ("mean", "per_gradient", "none"):
                    rows.append(("softsync" if n < learners else "async", n, learners, mu, lr_mod))
    return _grid(rows, epochs=15, num_samples=4000, lr=0.05)


def large_grid() -> list[RunConfig]:
    """Hundreds of runs for a bigger machine: λ up to 8, μλ from 32 to 512, all three modulations, 2 seeds."""
    rows: list[tuple[str, int, int, int, str]] = []
    for mu_lambda in (32, 64, 128, 512):
        rows.append(("single", 0, 1, mu_lambda, "none"))
        for learners in (2, 4, 8):
            mu = mu_lambda // learners
            if mu < 2:
                continue
            rows.append(("hardsync", 0, learners, mu, "none"))
            for n in sorted({1, 2, learners // 2, learners} - {0}):
                for lr_mod in ("mean", "per_gradient", "none"):
                    rows.append(("softsync" if n < learners else "async", n, learners, mu, lr_mod))
    return _grid(rows, epochs=20, num_samples=8000, lr=0.05, seeds=(42, 43))


def tiny_grid() -> list[RunConfig]:
    """Two very short runs, for the test suite: a single learner and 1-softsync on λ = 2."""
    rows = [("single", 0, 1, 32, "none"), ("softsync", 1, 2, 16, "mean")]
    return _grid(rows, epochs=1, num_samples=1000, lr=0.05)


GRIDS = {"tiny": tiny_grid, "small": small_grid, "medium": medium_grid, "large": large_grid}


# ---- running -------------------------------------------------------------------------------------------------
class RunFailed(RuntimeError):
    pass


def run_one(config: RunConfig, timeout: float, log_dir: Path) -> dict[str, Any]:
    """Train ``config`` in a subprocess (its own process group, so a timeout stops learners and server too)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("OMP_NUM_THREADS", "1")  # λ learners + a server share the cores: one thread each
    env.pop("MASTER_PORT", None)  # let Lightning pick a free port for every run
    with tempfile.TemporaryDirectory(prefix="rudra_study_") as tmp:
        result_path = Path(tmp) / "result.json"
        log_path = Path(tmp) / "output.log"
        command = [sys.executable, "-m", "examples.study_runner", *config.runner_args(), "--result", str(result_path)]
        start = time.perf_counter()
        with open(log_path, "w") as log:
            process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True)
            try:
                returncode: Optional[int] = process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                returncode = None
            finally:  # also on Ctrl-C: stop the whole run (learners, server), not just learner 0
                _kill_group(process)
        wall = time.perf_counter() - start
        if returncode != 0 or not result_path.exists():
            log_dir.mkdir(parents=True, exist_ok=True)
            saved = log_dir / f"failed_{_slug(config)}.log"
            saved.write_text(log_path.read_text(errors="replace"))
            why = "timed out" if returncode is None else f"exit code {returncode}"
            raise RunFailed(f"{why} after {wall:.0f} s; output in {saved}")
        result = json.loads(result_path.read_text())
    result["wall_s"] = wall
    result["train_s"] = result.pop("train_seconds")
    return result


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()


def _slug(config: RunConfig) -> str:
    return "_".join(str(v).replace(".", "p") for v in config.key())


def read_rows(path: Path) -> list[dict[str, str]]:
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return [row for row in csv.DictReader(f) if row.get("protocol")]


def append_row(path: Path, config: RunConfig, result: dict[str, Any]) -> None:
    new = not path.exists() or path.stat().st_size == 0
    row: dict[str, Any] = {**asdict(config), "mu_lambda": config.mu_lambda}
    for name in RESULT_FIELDS[1:]:
        value = result.get(name)
        if name == "staleness":
            value = json.dumps(value or {}, separators=(",", ":"))
        elif isinstance(value, float):
            value = f"{value:.6g}"
        row[name] = "" if value is None else value
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        if new:
            writer.writeheader()
        writer.writerow(row)
        f.flush()
        os.fsync(f.fileno())


def row_key(row: dict[str, str]) -> tuple[Any, ...]:
    return RunConfig.from_row(row).key()


# ---- reporting -----------------------------------------------------------------------------------------------
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
    rows = sorted(rows, key=lambda r: (order.get(r["protocol"], 9), int(r["learners"]), int(r["n"]),
                                       int(r["batch_size"]), r["lr_modulation"], int(r["seed"])))
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
    lines += ["", "![test error vs μλ](error_vs_batch.png)", "", "![staleness](staleness.png)", "",
              "![test error vs wall time](error_vs_time.png)", ""]
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
        key = (_PROTOCOL_ORDER.get(r["protocol"], 9), r["protocol"], int(r["n"]), int(r["learners"]), r["lr_modulation"])
        series.setdefault(key, {}).setdefault(int(r["mu_lambda"]), []).append(_f(r, "test_error"))
    fig, ax = plt.subplots(figsize=(8, 5))
    for index, ((_, protocol, n, learners, lr_mod), points) in enumerate(sorted(series.items())):
        xs = sorted(points)
        dodge = 1.0 + 0.025 * (index - len(series) / 2)  # keep points of equal μλ apart
        ys = [sum(points[x]) / len(points[x]) for x in xs]
        stale = protocol in ("softsync", "async")
        ax.plot([x * dodge for x in xs], ys, marker=_MARKERS.get(lr_mod, "o"), color=_color(protocol, n),
                linestyle="--" if stale and lr_mod == "none" else "-", markersize=7,
                markerfacecolor="white" if stale and lr_mod == "none" else _color(protocol, n),
                label=_series_name(protocol, n, learners, lr_mod))
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
            ax.set_xticks(list(range(0, cut + 1, max(1, (cut + 1) // 6))) + [cut + 1.5],
                          [str(x) for x in range(0, cut + 1, max(1, (cut + 1) // 6))] + [f">{cut}"])
            ax.axvline(mean, color="k", linestyle="--", linewidth=1, label=f"mean {mean:.2f}")
            if protocol != "hardsync":
                ax.axvline(n * (learners - 1) / learners, color="k", linestyle=":", linewidth=1,
                           label=f"n(λ−1)/λ = {n * (learners - 1) / learners:.2f}")
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
        for ax in list(axes.flat)[len(keys):]:
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
        ax.scatter(x, y, color=_color(protocol, n), marker=_MARKERS.get(lr_mod, "o"), s=50,
                   facecolors="white" if stale and lr_mod == "none" else _color(protocol, n),
                   label=None if label in labelled else label)
        labelled.add(label)
        ax.annotate(f"μ={r['batch_size']}", (x, y), fontsize=6, xytext=(4, -3), textcoords="offset points")
    ax.set_xlabel("training wall time (s): the training loop, without process start-up")
    written.append(_save_error_plot(fig, ax, "Test error vs training wall time", out / "error_vs_time.png"))
    return written


# ---- main ----------------------------------------------------------------------------------------------------
def _seed_list(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not seeds:
        raise argparse.ArgumentTypeError("expected at least one seed")
    return seeds


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m examples.study", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grid", choices=sorted(GRIDS), default="small",
                   help="small: 10 runs, ~5 min (default); medium: 42; large: 248; tiny: 2 (tests)")
    p.add_argument("--out", default="study_results", help="output folder (default: study_results)")
    p.add_argument("--resume", action="store_true",
                   help="keep <out>/runs.csv and skip the configurations already in it (otherwise it starts over)")
    p.add_argument("--seeds", type=_seed_list, default=None,
                   help="comma-separated seeds (data and initial weights) to run the grid with, e.g. 42,43; "
                        "default: the grid's own (42)")
    p.add_argument("--run-timeout", type=float, default=900.0, help="seconds one run may take (default 900)")
    p.add_argument("--report-only", action="store_true", help="only rewrite results.md and the plots from runs.csv")
    p.add_argument("--list", action="store_true", help="print the grid's configurations and exit")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    csv_path = out / "runs.csv"
    configs = GRIDS[args.grid]()
    if args.seeds:
        configs = list({c.key(): c for c in (replace(c, seed=s) for s in args.seeds for c in configs)}.values())
    show_seed = len({c.seed for c in configs}) > 1 or args.seeds is not None
    if args.list:
        for i, config in enumerate(configs, 1):
            print(f"[{i}/{len(configs)}] {config.label(show_seed)}")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    failed = []
    total = None
    if not args.report_only:
        if csv_path.exists() and not args.resume:
            backup = csv_path.with_suffix(".csv.bak")
            csv_path.replace(backup)
            print(f"starting over: the previous {csv_path} is now {backup} (use --resume to continue it)")
        done = {row_key(r) for r in read_rows(csv_path)}
        skipped = 0
        start = time.perf_counter()
        for i, config in enumerate(configs, 1):
            prefix = f"[{i}/{len(configs)}] {config.label(show_seed)}"
            if config.key() in done:
                print(f"{prefix} ... already in {csv_path}, skipped", flush=True)
                skipped += 1
                continue
            print(f"{prefix} ...", end=" ", flush=True)
            try:
                result = run_one(config, args.run_timeout, out / "logs")
            except RunFailed as error:
                print(f"FAILED ({error})", flush=True)
                failed.append(config)
                continue
            append_row(csv_path, config, result)
            staleness = "" if config.protocol == "single" else \
                f", ⟨σ⟩ {result['mean_staleness']:.2f} (max {result['max_staleness']})"
            print(f"test error {result['test_error']:.3f} in {result['wall_s']:.0f} s "
                  f"({result['samples_per_s']:.0f} samples/s{staleness})", flush=True)
        total = time.perf_counter() - start
        trained = len(configs) - skipped - len(failed)
        print(f"{trained} run(s) trained in {total / 60:.1f} min, {skipped} skipped (already done), "
              f"{len(failed)} failed")
    rows = read_rows(csv_path)
    if not rows:
        print(f"no finished runs in {csv_path}: nothing to report")
        return 1
    write_markdown(rows, out / "results.md")
    written = plot(rows, out)
    print(f"wrote {csv_path}, {out / 'results.md'}, " + ", ".join(str(p) for p in written))
    if failed:
        print(f"{len(failed)} run(s) failed: " + "; ".join(c.label(show_seed) for c in failed) + " (rerun with --resume)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
