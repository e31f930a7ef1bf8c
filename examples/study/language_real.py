"""Real learners on a language model with its usual recipe: λ = 4 learner processes (``popen``), no straggler.

    python -m examples.study.language_real --out docs/study/language            # add --resume to go on

Each run is one ``python -m examples.study.runner --family lm``: the LSTM of ``examples.language_model``, plain SGD
at the rate the staleness study swept for it on hardsync (``LR``), gradients clipped to norm ``CLIP`` as Lightning's
``gradient_clip_val`` (the recipe of Lightning's LSTM demo), μ = 32, μλ = 128, the held-out loss measured after
every epoch. DDP and hardsync train ``EPOCHS`` epochs, the stale runs 1.5 × as many (the issue's budget). *Target*:
DDP's final held-out loss + 2 %, per seed; a run reaches it at the first epoch from which its loss stays at or
below it. Rows: ``<out>/real.jsonl``; the report: ``<out>/findings.md``.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from examples.study.compensation import read_rows, source
from lightning_rudra.core.compensation import DEFAULT_COMPENSATION

LEARNERS, EPOCHS, STALE_EPOCHS = 4, 10, 15
LR, CLIP, TOLERANCE = 4.0, 0.25, 0.02
SEEDS = (0, 1, 2)
RUNS: dict[str, tuple[list[str], int]] = {  # DDP first: the target is its final loss
    "ddp": (["--protocol", "ddp"], EPOCHS),
    "hardsync": (["--protocol", "hardsync"], EPOCHS),
    "async": (["--protocol", "async", "--compensation", DEFAULT_COMPENSATION], STALE_EPOCHS),
    "async, momentum+clip": (["--protocol", "async", "--compensation", "momentum+clip"], STALE_EPOCHS),
}


def run(name: str, seed: int) -> dict[str, Any]:
    arguments, epochs = RUNS[name]
    with tempfile.TemporaryDirectory() as folder:
        result = Path(folder) / "result.json"
        command = [sys.executable, "-m", "examples.study.runner", "--family", "lm", *arguments]
        command += ["--learners", str(LEARNERS), "--batch-size", str(128 // LEARNERS), "--epochs", str(epochs)]
        command += ["--lr", str(LR), "--clip", str(CLIP), "--seed", str(seed), "--curve", "--result", str(result)]
        began = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
        if done.returncode or not result.exists():
            raise SystemExit(f"{name} failed ({done.returncode}):\n{done.stderr[-3000:]}")
        return {"name": name, **json.loads(result.read_text()), "wall_seconds": round(time.perf_counter() - began)}


def reached(curve: list[list[float]], target: float) -> Optional[int]:
    """The first epoch (1-based) from which every loss of ``curve`` is at or below ``target`` (a NaN is not)."""
    first = None
    for epoch, (_, loss) in enumerate(curve, 1):
        if not loss <= target:
            first = None
        elif first is None:
            first = epoch
    return first


def report(rows: dict[tuple[str, int], dict[str, Any]], out: Path) -> None:
    seeds = sorted({seed for name, seed in rows if name == "ddp"})
    lines = [
        "# Real learners on a language model, its usual recipe (clipped SGD), no straggler",
        "",
        f"Made by `python -m examples.study.language_real --out {out}` ({__doc__.split(chr(10))[0].rstrip('.')}), "
        f"at commit {', '.join(sorted({r['commit'] for r in rows.values()}))}. {LEARNERS} learners, μλ = 128, "
        f"SGD at lr {LR}, gradients clipped to norm {CLIP}; DDP and hardsync {EPOCHS} epochs, the async runs "
        f"{STALE_EPOCHS}. *Target*: DDP's final held-out loss + {TOLERANCE:.0%} (same seed). *Epochs / DDP's*: the "
        "epoch a run reached it at (from then on at or below) against DDP's own; *time / DDP's*: its training "
        "seconds by then against DDP's (learner 0's clock, evaluation left out). Medians over seeds "
        f"{', '.join(map(str, seeds))}; in brackets each seed's.",
        "",
        "| run | final held-out loss | reached target (runs) | epochs to target | epochs / DDP's | time / DDP's |",
        "|---|---|---|---|---|---|",
    ]
    for name in RUNS:
        finals, epochs, ratios, times, hits = [], [], [], [], 0
        for seed in seeds:
            row, ddp = rows.get((name, seed)), rows[("ddp", seed)]
            if row is None:
                continue
            target = ddp["curve"][-1][1] * (1 + TOLERANCE)
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
    rows = {(r["name"], r["seed"]): r for r in read_rows(path)}
    commit = source()
    for seed in [] if args.report_only else [int(s) for s in args.seeds.split(",")]:
        for name in RUNS:
            if (name, seed) not in rows:
                row = rows[(name, seed)] = {**run(name, seed), **commit}
                print(json.dumps({k: v for k, v in row.items() if k not in ("curve", "staleness")}), flush=True)
                with open(path, "a") as f:
                    f.write(json.dumps(row) + "\n")
    report(rows, out)


if __name__ == "__main__":
    main()
