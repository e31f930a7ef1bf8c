"""lightning_rudra benchmark suite: one command, a table on stdout, the numbers as JSON.

    python -m benchmarks.run [--quick] [--out benchmarks/results]

1. Transport: a push+pull round trip through the real server (async) for 10 k, 1 M, 10 M and 50 M float32, against
   a gloo all-reduce of the same buffer between the same 2 processes and a memcpy; TensorPipe settings for a
   bare RPC round trip; prototype fixes for the push path.
2. End to end, no straggler: samples/s of the MNIST-1D example module under every Rudra protocol and DDP.
3. One learner 3x slower: async and 2-softsync against DDP.
4. Time to a fixed test accuracy on MNIST-1D, from the same runs as 2.
5. Epochs with one straggler (3x, 8x slower), 2 and 4 learners: time per epoch and time to accuracy of async
   (the shared epoch) against DDP.
6. Real model sizes: MLPs of 10 M and 50 M parameters on synthetic data, 2 and 4 learners: samples/s over whole
   epochs of hardsync, async and async without shared memory against DDP, and of async with one 3x straggler.
7. Time to DDP's accuracy (``benchmarks.accuracy``): momentum SGD at DDP's rate, 2 and 4 learners, one 3x
   straggler and none: the time async with its default options takes to reach DDP's final test accuracy.
8. Across hosts (``benchmarks.network``, needs root): two hosts as network namespaces, the link shaped to 1 and
   10 Gbit/s, the 10 M MLP with 1 and 2 learners per host: samples/s and bytes on the link per step of DDP, Rudra
   hardsync and async, with and without compressed pushes.

Everything runs in long-lived worker processes (``benchmarks.pool``) so that process start-up is paid once;
each comparison is measured in the same run, repeated, and reported as the median of per-round ratios.
See ``benchmarks/README.md``.
"""

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import time
import traceback
from typing import Any, Optional

from benchmarks import network, report, targets
from benchmarks.config import DEFAULT, PHASES, QUICK, TRAINING
from benchmarks.suite import Suite


def _meta(quick: bool) -> dict[str, Any]:
    model = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass

    def version(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "?"

    def git(*args: str) -> str:
        try:
            import subprocess

            return subprocess.run(
                ["git", *args],
                capture_output=True,
                text=True,
                timeout=10,
                cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
            ).stdout.strip()
        except Exception:
            return "?"

    return {
        "mode": "quick" if quick else "default",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "commit": git("rev-parse", "--short", "HEAD"),
        "package_modified": bool(git("status", "--porcelain", "--", "lightning_rudra")),
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_model": model,
        "torch": version("torch"),
        "lightning": version("pytorch-lightning"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_start": os.getloadavg(),
    }


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer sizes, settings and repeats: about 2 minutes")
    parser.add_argument(
        "--out",
        default=os.path.join("benchmarks", "results"),
        help="folder for latest.json and latest.md (default: benchmarks/results)",
    )
    parser.add_argument(
        "--only",
        default=",".join(PHASES),
        help="comma-separated phases to run (straggler needs e2e for its calibration; epochs, "
        "models and accuracy calibrate themselves)",
    )
    parser.add_argument(
        "--network",
        help="the network phase's configurations instead of the mode's, comma-separated: "
        "RATE:LEARNERS_PER_HOST:REPS[:STRATEGY/STRATEGY...][:PARAMS], e.g. 1gbit:2:2:ddp/hardsync/hardsync+no_aggregation "
        "or 1gbit:1:1:ddp/hardsync:50M (PARAMS: the MLP's size, 10M without it); LEARNERS_PER_HOST 1+s: DDP with 1 "
        "learner per host and +server_node strategies with both on host 0 and a server node on host 1 "
        "(1gbit:1:2:ddp/hardsync,1gbit:1+s:2:ddp/hardsync+server_node)",
    )
    args = parser.parse_args(argv)
    cfg = dict(QUICK if args.quick else DEFAULT)
    if args.network:
        try:
            cfg["network"] = [network.parse_spec(spec) for spec in args.network.split(",")]
        except ValueError as error:
            parser.error(str(error))
    phases = [p for p in args.only.split(",") if p]
    meta = _meta(args.quick)
    suite = Suite(cfg, args.quick)
    suite.log(f"lightning_rudra benchmark, {meta['mode']} mode, phases: {', '.join(phases)}")
    try:
        suite.start_pools(phases)
        for phase in PHASES:
            if phase in phases:
                try:
                    suite.run(phase)
                except Exception as error:  # keep what the other phases measured
                    suite.failures.append(f"{phase}: {type(error).__name__}: {error}")
                    suite.log(f"phase {phase} failed:\n{traceback.format_exc()}")
    finally:
        suite.close()
    meta["duration_s"] = time.monotonic() - suite.t0
    meta["loadavg_end"] = os.getloadavg()
    meta["config"] = {**cfg, "training": TRAINING}
    suite.summary["targets"] = targets.check_targets(suite.summary)
    result = {"meta": meta, "summary": suite.summary, "raw": suite.raw, "failures": suite.failures}
    markdown = report.render_markdown(result)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "latest.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out, "latest.md"), "w") as f:
        f.write(markdown)
    print(markdown)
    suite.log(f"wrote {os.path.join(args.out, 'latest.json')} and latest.md")
    return result


if __name__ == "__main__":
    main()
