"""Where the time goes: py-spy on learner 0 and on the parameter-server process during a benchmark job.

    python -m benchmarks.profile push  [--numel 10000000] [--seconds 6] [--both]
    python -m benchmarks.profile train [--strategy async|hardsync|softsync|ddp] [--seconds 6]

``push``: learner 0 pushes (``Learner.push``: pack, RPC, async update on the server, weights back, load) in a
loop, learner 1 too with ``--both``. ``train``: the end-to-end job of ``benchmarks.run``. py-spy samples each
process (``--nonblocking``: the processes are not paused) and the script prints, per process, the share of
samples in which each function is on the stack (inclusive), most frequent first. Needs ``py-spy`` on PATH.
"""

import argparse
import collections
import os
import re
import socket
import subprocess
import tempfile
import threading
import time
from typing import Any

from benchmarks.pool import Pool


def _port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def summarize(path: str, top: int) -> list[tuple[float, str]]:
    """Inclusive share of samples per function (``name (file)``) in a py-spy ``raw`` (collapsed) profile."""
    total, inclusive = 0, collections.Counter()
    with open(path) as f:
        for line in f:
            line = line.rstrip()
            if not line:
                continue
            stack, count = line.rsplit(" ", 1)
            total += int(count)
            seen = set()
            for frame in stack.split(";"):
                name = re.sub(r":\d+\)$", ")", frame)
                name = re.sub(r"\(.*/", "(", name)
                if name not in seen:
                    seen.add(name)
                    inclusive[name] += int(count)
    return [(100.0 * c / total, name) for name, c in inclusive.most_common(top)] if total else []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("push", "train"))
    parser.add_argument("--numel", type=int, default=10_000_000)
    parser.add_argument("--both", action="store_true", help="push: both learners push at once")
    parser.add_argument("--strategy", default="async")
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--rate", type=int, default=200)
    args = parser.parse_args()

    pool = Pool(
        "profile", preload=("pytorch_lightning", "lightning_rudra", "benchmarks.training", "benchmarks.transport")
    )
    pool.wait_ready()
    if args.what == "push":
        fn, kwargs, delay = (
            "benchmarks.transport:push_loop",
            {"numel": args.numel, "port": _port(), "seconds": args.seconds + 8, "both": args.both},
            6.0,
        )
    else:
        fn = "benchmarks.training:train"
        kwargs = {
            "strategy": args.strategy,
            "port": _port(),
            "max_steps": [1_000_000] * 2,
            "sleep_s": [0.0, 0.0],
            "stop_after_s": [args.seconds + 8] * 2,
            "lr": 0.1,
            "momentum": 0.5,
        }
        delay = 10.0
    outcome: dict[str, Any] = {}
    job = threading.Thread(target=lambda: outcome.setdefault("result", pool.run(fn, 300, **kwargs)))
    job.start()
    out_dir = tempfile.mkdtemp(prefix="rudra-profile-")
    try:
        time.sleep(delay)  # past start-up and warm-up
        learner = pool.procs[0].pid
        children = subprocess.run(["pgrep", "-P", str(learner)], capture_output=True, text=True).stdout.split()
        targets = {"learner 0": learner, **{f"server (pid {c})": int(c) for c in children}}
        spies = {
            name: (
                os.path.join(out_dir, f"{pid}.txt"),
                subprocess.Popen(
                    [
                        "py-spy",
                        "record",
                        "--pid",
                        str(pid),
                        "--duration",
                        str(int(args.seconds)),
                        "--rate",
                        str(args.rate),
                        "--format",
                        "raw",
                        "--output",
                        os.path.join(out_dir, f"{pid}.txt"),
                        "--nonblocking",
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                ),
            )
            for name, pid in targets.items()
        }
        for name, (path, spy) in spies.items():
            spy.wait()
            print(f"\n== {name}: share of samples with the function on the stack (process busy time only)")
            for share, frame in summarize(path, args.top) if os.path.exists(path) else []:
                print(f"{share:5.1f}%  {frame}")
    finally:
        job.join()
        pool.close()
        print(f"\nraw py-spy profiles (collapsed stacks): {out_dir}")


if __name__ == "__main__":
    main()
