"""Real learners with clipped SGD, the recipe of Lightning's LSTM demo: λ = 4 learner processes (``popen``), no
straggler; the language model, or the MNIST-1D CNN (``--family cnn``).

    python -m examples.study.language_real --out docs/study/language            # add --resume to go on
    python -m examples.study.language_real --family cnn --out docs/study/clipped-cnn

Each run is one ``python -m examples.study.runner``: the LSTM of ``examples.language_model`` (or the MNIST-1D CNN,
4000 samples), plain SGD at the rate the staleness study swept for it on hardsync (``LR``), gradients clipped to
norm ``CLIP`` as Lightning's ``gradient_clip_val``, μ = 32, μλ = 128, the test measure (held-out loss, or error)
after every epoch. DDP and hardsync train the family's epochs, the stale runs 1.5 × as many (the issue's budget).
*Target*: DDP's final measure + 2 % (the loss) or + 1 point (the error), per seed; a run reaches it at the first
epoch from which its measure stays at or below it. Rows: ``<out>/real.jsonl``; the report: ``<out>/findings.md``.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from examples.study.compensation import read_rows, source
from lightning_rudra.core.compensation import DEFAULT_COMPENSATION

LEARNERS, LR, CLIP = 4, 4.0, 0.25
SEEDS = (0, 1, 2)


@dataclass(frozen=True)
class Setup:
    """A family's runs: the runner's arguments, DDP's epochs, the measure's name and the target's tolerance over
    DDP's final measure (``relative``: a share of it, else an absolute margin)."""

    arguments: tuple[str, ...]
    epochs: int
    measure: str
    tolerance: float
    relative: bool

    def target(self, final: float) -> float:
        return final * (1 + self.tolerance) if self.relative else final + self.tolerance


SETUPS = {
    "lm": Setup(("--family", "lm"), 10, "held-out loss", 0.02, True),
    "cnn": Setup(("--family", "mnist1d", "--momentum", "0", "--num-samples", "4000"), 20, "test error", 0.01, False),
}
RUNS: dict[str, tuple[list[str], float]] = {  # DDP first: the target is its final measure; epochs as DDP's × this
    "ddp": (["--protocol", "ddp"], 1.0),
    "hardsync": (["--protocol", "hardsync"], 1.0),
    "async": (["--protocol", "async", "--compensation", DEFAULT_COMPENSATION], 1.5),
    "async, momentum+clip": (["--protocol", "async", "--compensation", "momentum+clip"], 1.5),
}


def run(setup: Setup, name: str, seed: int) -> dict[str, Any]:
    arguments, budget = RUNS[name]
    epochs = round(setup.epochs * budget)
    with tempfile.TemporaryDirectory() as folder:
        result = Path(folder) / "result.json"
        command = [sys.executable, "-m", "examples.study.runner", *setup.arguments, *arguments]
        command += ["--learners", str(LEARNERS), "--batch-size", str(128 // LEARNERS), "--epochs", str(epochs)]
        command += ["--lr", str(LR), "--clip", str(CLIP), "--seed", str(seed), "--curve", "--result", str(result)]
        began = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
        if done.returncode or not result.exists():
            raise SystemExit(f"{name} failed ({done.returncode}):\n{done.stderr[-3000:]}")
        return {"name": name, **json.loads(result.read_text()), "wall_seconds": round(time.perf_counter() - began)}


def reached(curve: list[list[float]], target: float) -> Optional[int]:
    """The first epoch (1-based) from which every measure of ``curve`` is at or below ``target`` (a NaN is not)."""
    first = None
    for epoch, (_, measure) in enumerate(curve, 1):
        if not measure <= target:
            first = None
        elif first is None:
            first = epoch
    return first


def report(family: str, rows: dict[tuple[str, int], dict[str, Any]], out: Path) -> None:
    setup = SETUPS[family]
    seeds = sorted({seed for name, seed in rows if name == "ddp"})
    model = "a language model" if family == "lm" else "the MNIST-1D CNN"
    margin = f"{setup.tolerance:.0%}" if setup.relative else f"{100 * setup.tolerance:g} point"
    lines = [
        f"# Real learners on {model} with clipped SGD (the recipe of Lightning's LSTM demo), no straggler",
        "",
        f"Made by `python -m examples.study.language_real --family {family} --out {out}` (the method: the module's "
        f"docstring), at commit {', '.join(sorted({r['commit'] for r in rows.values()}))}. {LEARNERS} learners, "
        f"μλ = 128, SGD at lr {LR}, gradients clipped to norm {CLIP}; DDP and hardsync {setup.epochs} epochs, the "
        f"async runs {round(setup.epochs * 1.5)}. *Target*: DDP's final {setup.measure} + {margin} (same seed). "
        "*Epochs / DDP's*: the epoch a run reached it at (from then on at or below) against DDP's own; *time / "
        "DDP's*: its training seconds by then against DDP's (learner 0's clock, evaluation left out). Medians over "
        f"seeds {', '.join(map(str, seeds))}; in brackets each seed's.",
        "",
        f"| run | final {setup.measure} | reached target (runs) | epochs to target | epochs / DDP's | time / DDP's |",
        "|---|---|---|---|---|---|",
    ]
    for name in RUNS:
        finals, epochs, ratios, times, hits = [], [], [], [], 0
        for seed in seeds:
            row, ddp = rows.get((name, seed)), rows[("ddp", seed)]
            if row is None:
                continue
            target = setup.target(ddp["curve"][-1][1])
            finals.append(row["curve"][-1][1])
            mine, theirs = reached(row["curve"], target), reached(ddp["curve"], target)
            if mine is not None and theirs is not None:
                hits += 1
                epochs.append(mine)
                ratios.append(mine / theirs)
                times.append(row["curve"][mine - 1][0] / ddp["curve"][theirs - 1][0])
        cells = [
            _median(finals, ".3f"),
            f"{hits}/{len(finals)}",
            _median(epochs, ".0f"),
            _median(ratios, ".2f"),
            _median(times, ".2f"),
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    (out / "findings.md").write_text("\n".join(lines) + "\n")


def _median(values: list[float], form: str) -> str:
    if not values:
        return "–"
    return f"{statistics.median(values):{form}} ({', '.join(f'{v:{form}}' for v in values)})"


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m examples.study.language_real", description=__doc__)
    p.add_argument("--family", choices=tuple(SETUPS), default="lm", help="the model (default: lm)")
    p.add_argument("--out", default="study_language")
    p.add_argument("--seeds", default=",".join(map(str, SEEDS)), help="comma-separated (default: 0,1,2)")
    p.add_argument("--resume", action="store_true", help="skip the runs already in <out>/real.jsonl")
    p.add_argument("--report-only", action="store_true", help="write findings.md from <out>/real.jsonl")
    args = p.parse_args(argv)
    out = Path(args.out)
    path = out / "real.jsonl"
    out.mkdir(parents=True, exist_ok=True)
    if not (args.resume or args.report_only) and path.exists():
        path.rename(path.with_suffix(".jsonl.bak"))
    # rows of another family (an --out shared by mistake) are not this family's
    family = {"lm": "lm", "cnn": "mnist1d"}[args.family]
    rows = {(r["name"], r["seed"]): r for r in read_rows(path) if r.get("family", "lm") == family}
    commit = source()
    for seed in [] if args.report_only else [int(s) for s in args.seeds.split(",")]:
        for name in RUNS:
            if (name, seed) not in rows:
                row = rows[(name, seed)] = {**run(SETUPS[args.family], name, seed), **commit}
                print(json.dumps({k: v for k, v in row.items() if k not in ("curve", "staleness")}), flush=True)
                with open(path, "a") as f:
                    f.write(json.dumps(row) + "\n")
    report(args.family, rows, out)


if __name__ == "__main__":
    main()
