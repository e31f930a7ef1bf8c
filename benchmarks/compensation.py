"""What each staleness compensation rule costs per push, on the server, at 10 M parameters.

    python -m benchmarks.compensation            # writes benchmarks/results/compensation.{json,md}

One in-process :class:`lightning_rudra.Server` (async, λ = 4, SGD with momentum 0.9, one thread, as the server
process runs its optimizer), pushes from learners in turn, each from the weights of its previous reply (σ = 3):
the time of ``Server.push`` alone, gradient given, median of the pushes after a warm-up. Rules run side by side in
rounds, so drift on a shared machine hits them alike.
"""

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any, Optional

import torch

from lightning_rudra import ProtocolConfig, Server
from lightning_rudra.core.optimizers import OptimizerSpec, hyperparameters
from lightning_rudra.core.update import Push

RULES = ("none", "momentum", "dc", "gap", "momentum+dc", "momentum+gap")
LEARNERS = 4


def push_times(compensation: str, size: int, pushes: int, warmup: int = 4) -> list[float]:
    weights = torch.zeros(size)
    opt = torch.optim.SGD([weights], lr=1e-3, momentum=0.9)
    server = Server(
        ProtocolConfig(LEARNERS, "async", compensation=compensation),
        [weights],
        [],
        [OptimizerSpec.from_optimizer(opt, [weights])],
    )
    hparams = [hyperparameters(group) for group in opt.param_groups]
    held = [server.clock] * LEARNERS
    grads = [torch.randn(size) for _ in range(2)]
    times = []
    for k in range(warmup + pushes):
        learner = k % LEARNERS
        grad = grads[k % 2].clone()  # the server takes ownership of what is pushed
        start = time.perf_counter()
        server.push(Push(learner, 0, [grad], torch.tensor([True]), held[learner], hparams, []))
        times.append(time.perf_counter() - start)
        held[learner] = server.clock
    return times[warmup:]


def measure(size: int, pushes: int, rounds: int) -> dict[str, Any]:
    samples: dict[str, list[float]] = {rule: [] for rule in RULES}
    for _ in range(rounds):
        for rule in RULES:
            samples[rule] += push_times(rule, size, pushes)
    medians = {rule: 1e3 * statistics.median(times) for rule, times in samples.items()}
    return {
        "parameters": size,
        "load_average": os.getloadavg()[0],
        "learners": LEARNERS,
        "pushes_per_rule": pushes * rounds,
        "median_push_ms": medians,
        "extra_ms": {rule: medians[rule] - medians["none"] for rule in RULES},
    }


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "# Staleness compensation: the server's time per push",
        "",
        f"`python -m benchmarks.compensation`: async, λ = {result['learners']}, {result['parameters']:,} "
        f"float32 parameters, SGD with momentum 0.9, one thread; median over {result['pushes_per_rule']} pushes "
        f"per rule (σ = 3 each), rules interleaved in rounds; load average {result['load_average']:.1f} on this "
        "machine at the end (other jobs share its cores: the times are inflated alike).",
        "",
        "| compensation | ms per push | more than none |",
        "|---|---|---|",
    ]
    for rule, ms in result["median_push_ms"].items():
        lines.append(f"| {rule} | {ms:.1f} | {result['extra_ms'][rule]:+.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.compensation",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--size", type=int, default=10_000_000, help="parameters (default 10 M)")
    p.add_argument("--pushes", type=int, default=8, help="timed pushes per rule and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results", help="folder for compensation.json and .md")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    result = measure(args.size, args.pushes, args.rounds)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compensation.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "compensation.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
