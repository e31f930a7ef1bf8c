"""bf16 compression's CPU cost, measured here: a learner's error feedback and a server's weight differences, per
parameter (core/runtime/payload.py's coefficients)."""

import statistics
import time
from typing import Sequence


def measure_codec(sizes: Sequence[int] = (1_000_000, 10_000_000), reps: int = 7) -> dict:
    """Medians of ``reps`` rounds through lightning_rudra.core.compression (one thread): per push, the learner's
    side (ErrorFeedback.compress of a float32 gradient, the residual added, and WeightDeltas.decode of the reply) and
    the server's (decompress of the bf16 gradient and WeightDeltas.encode of the new weights); a line through each
    (seconds per parameter, fixed seconds)."""
    import torch

    from benchmarks.predict.server import _line
    from lightning_rudra.core.compression import ErrorFeedback, WeightDeltas, decompress

    torch.set_num_threads(1)
    points = []
    for n in sizes:
        feedback, sender, receiver = ErrorFeedback("bf16"), WeightDeltas("bf16"), WeightDeltas("bf16")
        weights = torch.randn(n)
        receiver.decode(sender.encode(0, 0, [weights]), 0)  # both hold a copy: later messages are differences
        learner, server = [], []
        for _ in range(reps + 1):
            grad = torch.randn(n)
            weights = weights + 1e-3 * torch.randn(n)
            t0 = time.perf_counter()
            wire = feedback.compress(0, [grad])
            t1 = time.perf_counter()
            decompress(wire, [torch.float32])
            message = sender.encode(0, sender.count(0), [weights])
            t2 = time.perf_counter()
            receiver.decode(message, 0)
            t3 = time.perf_counter()
            learner.append((t1 - t0) + (t3 - t2))
            server.append(t2 - t1)
        points.append(
            {"parameters": n, "learner_s": statistics.median(learner[1:]), "server_s": statistics.median(server[1:])}
        )
    return {
        "points": points,
        "learner": _line([p["parameters"] for p in points], [p["learner_s"] for p in points]),
        "server": _line([p["parameters"] for p in points], [p["server_s"] for p in points]),
        "command": "python -m benchmarks.predict --measure-codec",
    }
