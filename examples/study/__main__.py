"""The Rudra paper's accuracy/runtime tradeoff study, on MNIST-1D, for real.

    python -m examples.study                                   # small grid (10 runs, ~5 min), into study_results/
    python -m examples.study --grid medium --out study_results --resume
    python -m examples.study --grid paper --jobs 2 --out docs/study/paper --resume   # λ up to 30, ~45 min

Every configuration (protocol × n × μ × λ × learning-rate modulation, plus single-learner baselines) trains
in its own subprocess (``python -m examples.study.runner ...``: λ learner processes and one server process
under ``RudraStrategy``, or one process of simulated learners), so one failure or hang cannot take the sweep
down. For every finished run one row
is appended to ``<out>/runs.csv``; ``--resume`` skips the configurations already there. At the end (and
with ``--report-only``, without training) it writes ``<out>/results.md`` and the plots:

- ``error_vs_batch.png``: test error against μ·λ, per protocol;
- ``staleness.png``: staleness histogram per protocol (and n);
- ``error_vs_time.png``: test error against training wall time.

The small grid is built to speak to the paper's three findings (see ``GRIDS``): keeping μ·λ constant keeps
the baseline's accuracy while a large μ·λ hurts; n-softsync has mean staleness about n; without learning-rate
modulation large-n softsync and async degrade, with it they recover. The ``paper`` grid asks the same at the
paper's scale (``examples/study/grid.py``): an α0 sweep on the single learner first, then every run at the α0
it chose, and ``findings.md`` answers the three findings with numbers (``examples/study/findings.py``).
"""

import argparse
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Optional

from examples.study.findings import write_findings
from examples.study.grid import (
    GRIDS,
    PAPER_SEEDS,
    RunConfig,
    choose_alpha0,
    paper_grid,
    paper_grid_without_momentum,
    paper_sweep,
)
from examples.study.report import plot, write_markdown
from examples.study.runs import RunFailed, append_row, read_rows, row_key, run_one


def _seed_list(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not seeds:
        raise argparse.ArgumentTypeError("expected at least one seed")
    return seeds


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m examples.study", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--grid",
        choices=sorted(GRIDS),
        default="small",
        help="small: 10 runs, ~5 min (default); medium: 42; large: 248; paper: 96 at λ up to 30 (simulated), "
        "~40 min with --jobs 2; tiny: 3 (tests)",
    )
    p.add_argument("--out", default="study_results", help="output folder (default: study_results)")
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep <out>/runs.csv and skip the configurations already in it (otherwise it starts over)",
    )
    p.add_argument(
        "--seeds",
        type=_seed_list,
        default=None,
        help="comma-separated seeds (data and initial weights) to run the grid with, e.g. 42,43; "
        "default: the grid's own (42)",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs at a time (default 1); the paper grid's simulated runs take one process each",
    )
    p.add_argument("--run-timeout", type=float, default=900.0, help="seconds one run may take (default 900)")
    p.add_argument("--report-only", action="store_true", help="only rewrite results.md and the plots from runs.csv")
    p.add_argument("--list", action="store_true", help="print the grid's configurations and exit")
    return p.parse_args(argv)


def run_configs(configs: list[RunConfig], csv_path: Path, args: argparse.Namespace, show_seed: bool) -> list[RunConfig]:
    """Train the configurations not in ``csv_path`` yet, ``args.jobs`` at a time; returns those that failed."""
    done = {row_key(r) for r in read_rows(csv_path)}
    todo = [(i, c) for i, c in enumerate(configs, 1) if c.key() not in done]
    for i, config in enumerate(configs, 1):
        if config.key() in done:
            print(f"[{i}/{len(configs)}] {config.label(show_seed)} ... already in {csv_path}, skipped", flush=True)
    failed = []
    lock = threading.Lock()
    start = time.perf_counter()

    def train(item: tuple[int, RunConfig]) -> None:
        i, config = item
        prefix = f"[{i}/{len(configs)}] {config.label(show_seed)}"
        try:
            result = run_one(config, args.run_timeout, csv_path.parent / "logs")
        except RunFailed as error:
            with lock:
                print(f"{prefix} ... FAILED ({error})", flush=True)
                failed.append(config)
            return
        with lock:
            append_row(csv_path, config, result)
            staleness = (
                ""
                if config.protocol == "single"
                else f", ⟨σ⟩ {result['mean_staleness']:.2f} (max {result['max_staleness']})"
            )
            print(
                f"{prefix} ... test error {result['test_error']:.3f} in {result['wall_s']:.0f} s "
                f"({result['samples_per_s']:.0f} samples/s{staleness})",
                flush=True,
            )

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        list(pool.map(train, todo))
    print(
        f"{len(todo) - len(failed)} run(s) trained in {(time.perf_counter() - start) / 60:.1f} min, "
        f"{len(configs) - len(todo)} skipped (already done), {len(failed)} failed"
    )
    return failed


def run_paper_stages(csv_path: Path, args: argparse.Namespace) -> list[RunConfig]:
    """After the sweep at momentum 0.9: every run at the α0 it chose; then plain SGD's own sweep and runs."""
    seeds = args.seeds or PAPER_SEEDS
    alpha0 = choose_alpha0(read_rows(csv_path))
    print(f"α0 = {alpha0:g}: the lowest mean test error of the single learner in the sweep; every run uses it")
    failed = run_configs(paper_grid(alpha0, seeds), csv_path, args, True)
    failed += run_configs(paper_sweep(seeds, momentum=0.0), csv_path, args, True)
    if failed:
        return failed
    alpha0 = choose_alpha0(read_rows(csv_path), momentum=0.0)
    print(f"without momentum: α0 = {alpha0:g}, the lowest mean test error of its sweep")
    return run_configs(paper_grid_without_momentum(alpha0, seeds), csv_path, args, True)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    csv_path = out / "runs.csv"
    configs = GRIDS[args.grid](**({"seeds": args.seeds} if args.grid == "paper" and args.seeds else {}))
    if args.seeds and args.grid != "paper":
        configs = list({c.key(): c for c in (replace(c, seed=s) for s in args.seeds for c in configs)}.values())
    show_seed = len({c.seed for c in configs}) > 1 or args.seeds is not None
    if args.list:
        for i, config in enumerate(configs, 1):
            print(f"[{i}/{len(configs)}] {config.label(show_seed)}")
        if args.grid == "paper":
            seeds = args.seeds or PAPER_SEEDS
            print(
                f"then, at the α0 the sweep chooses: {len(paper_grid(0.1, seeds))} runs (paper_grid in "
                f"examples/study/grid.py); then without momentum: a sweep of {len(paper_sweep(seeds, momentum=0.0))} runs and "
                f"{len(paper_grid_without_momentum(1.0, seeds))} runs at the α0 it chooses"
            )
        return 0
    out.mkdir(parents=True, exist_ok=True)
    failed: list[RunConfig] = []
    if not args.report_only:
        if csv_path.exists() and not args.resume:
            backup = csv_path.with_suffix(".csv.bak")
            csv_path.replace(backup)
            print(f"starting over: the previous {csv_path} is now {backup} (use --resume to continue it)")
        failed = run_configs(configs, csv_path, args, show_seed)
        if args.grid == "paper" and not failed:
            failed = run_paper_stages(csv_path, args)
    rows = read_rows(csv_path)
    if not rows:
        print(f"no finished runs in {csv_path}: nothing to report")
        return 1
    write_markdown(rows, out / "results.md")
    written = plot(rows, out)
    if args.grid == "paper":
        written += write_findings(rows, out)
    print(f"wrote {csv_path}, {out / 'results.md'}, " + ", ".join(str(p) for p in written))
    if failed:
        print(
            f"{len(failed)} run(s) failed: " + "; ".join(c.label(show_seed) for c in failed) + " (rerun with --resume)"
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
