"""The protocols study's real learners: λ = 4 learner processes under ``RudraStrategy`` (``popen``), one straggler.

    python -m examples.study.protocols_real --out docs/study/protocols [--seed 0] [--resume]

Each run is one ``python -m examples.study.runner`` (MNIST-1D, 6000 samples, μ = 32, μλ = 128, momentum SGD at
the simulated study's rate, the default compensation), the test error measured after every epoch. The straggler:
the last learner sleeps before every batch for an exponential time (seeded). Its mean is twice the median step
time of DDP's straggler, measured in the DDP run (which comes first) on its first batches, and every protocol
then gets that same mean. Rows: ``<out>/real.jsonl``; the report is the simulated study's
(:mod:`examples.study.protocols_report`).
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from examples.study.compensation import read_rows, source
from examples.study.protocols import LR
from lightning_rudra.core.compensation import DEFAULT_COMPENSATION

LEARNERS, EPOCHS, NUM_SAMPLES = 4, 6, 6000
REAL: dict[str, list[str]] = {  # DDP first: its straggler's mean sleep is every other run's
    "ddp": ["--protocol", "ddp"],
    "hardsync": ["--protocol", "hardsync"],
    "batchsync": ["--protocol", "batchsync"],  # K = λ
    "backup": ["--protocol", "hardsync", "--backup", "1"],  # λ - 1 of 4
    "ssp": ["--protocol", "async", "--max-staleness", "3", "--on-stale", "block"],  # 3: the least async allows
}


def run(name: str, seed: int, mean: Optional[float]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        result = str(Path(folder) / "result.json")
        command = [sys.executable, "-m", "examples.study.runner", *REAL[name], "--learners", str(LEARNERS)]
        command += ["--batch-size", str(128 // LEARNERS), "--num-samples", str(NUM_SAMPLES), "--epochs", str(EPOCHS)]
        command += [
            "--lr",
            str(LR),
            "--compensation",
            DEFAULT_COMPENSATION,
            "--seed",
            str(seed),
            "--straggler",
            "--curve",
        ]
        command += ["--result", result] + (["--straggler-mean", str(mean)] if mean is not None else [])
        began = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
        if done.returncode or not Path(result).exists():
            raise SystemExit(f"{name} failed ({done.returncode}):\n{done.stderr[-3000:]}")
        row = {"name": name, **json.loads(Path(result).read_text()), "wall_seconds": round(time.perf_counter() - began)}
        straggler = Path(result + ".straggler")
        row["straggler"] = json.loads(straggler.read_text()) if straggler.exists() else None
    return row


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m examples.study.protocols_real", description=__doc__)
    p.add_argument("--out", default="study_protocols")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    args = p.parse_args(argv)
    path = Path(args.out) / "real.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not args.resume and path.exists():
        path.rename(path.with_suffix(".jsonl.bak"))
    rows = {(r["name"], r["seed"]): r for r in read_rows(path)}
    commit = source()
    for name in REAL:
        if (name, args.seed) not in rows:
            ddp = rows.get(("ddp", args.seed))
            mean = ddp["straggler"]["mean_sleep"] if ddp and ddp.get("straggler") else None
            row = rows[(name, args.seed)] = {**run(name, args.seed, mean), **commit}
            print(json.dumps({k: v for k, v in row.items() if k not in ("curve", "staleness")}), flush=True)
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
