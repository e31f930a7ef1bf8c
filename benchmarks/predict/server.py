"""The server's time per push and update, measured here (core/runtime/server_cost.py's coefficients)."""

import statistics
import time
from typing import Sequence


def measure_server(sizes: Sequence[int] = (100_000, 1_000_000, 4_000_000, 10_000_000), reps: int = 7) -> dict:
    """Medians of ``reps`` pushes into lightning_rudra.core.protocol.Server (2 learners, 1-softsync, momentum SGD,
    one thread): a push that does not close the update, and the extra time of one that does; a line through each."""
    import torch

    from lightning_rudra.core.optimizers import OptimizerSpec
    from lightning_rudra.core.protocol import ProtocolConfig, Server
    from lightning_rudra.core.update import Push

    torch.set_num_threads(1)
    points = []
    for n in sizes:
        w = torch.zeros(n)
        spec = OptimizerSpec.from_optimizer(torch.optim.SGD([w], lr=0.1, momentum=0.5), [w])
        server = Server(ProtocolConfig(2, "softsync", 1), [w], [], [spec])
        pushes, updates = [], []
        for _ in range(reps):
            first, second = (
                Push(r, 0, [torch.randn(n)], torch.tensor([True]), server.clock, [{"lr": 0.1, "momentum": 0.5}], [])
                for r in (0, 1)
            )
            t0 = time.perf_counter()
            server.push(first)
            t1 = time.perf_counter()
            server.push(second)
            t2 = time.perf_counter()
            pushes.append(t1 - t0)
            updates.append(max(0.0, (t2 - t1) - (t1 - t0)))
        points.append({"parameters": n, "push_s": statistics.median(pushes), "update_s": statistics.median(updates)})
    push = _line([p["parameters"] for p in points], [p["push_s"] for p in points])
    update = _line([p["parameters"] for p in points], [p["update_s"] for p in points])
    return {
        "points": points,
        "push": push,
        "update": update,
        "command": "python -m benchmarks.predict --measure-server",
    }


def _line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least squares y = a x + b, both kept >= 0."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    a = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return max(a, 0.0), max(my - a * mx, 0.0)
