"""One learner's compute alone, measured here: forward and backward of each benchmark model at its batch size, in
one process on one thread (the benchmark pool's ``OMP_NUM_THREADS=1``), the step time the validation gives a learner
(``benchmarks.predict --measure-compute``; the table is ``measured_compute.json`` beside this file)."""

import json
import os
import statistics
import time
from typing import Any, Sequence

COMPUTE = os.path.join(os.path.dirname(__file__), "measured_compute.json")
COMMAND = "python -m benchmarks.predict --measure-compute"
# (model, μ): the MNIST-1D CNN of results/epochs and accuracy, the MLPs of results/transport-models and network
MODELS = (("mnist1d", 64), ("mnist1d", 32), ("mnist1d", 16), ("mlp10M", 32), ("mlp50M", 32))


def _model(name: str) -> Any:
    if name == "mnist1d":
        from examples.mnist1d import MNIST1DClassifier

        return MNIST1DClassifier(), 40
    from benchmarks.synthetic import INPUTS, MLPClassifier

    return MLPClassifier({"mlp10M": 10_000_000, "mlp50M": 50_000_000}[name]), INPUTS


def measure_compute(steps: int = 30, warmup: int = 5, models: Sequence[tuple[str, int]] = MODELS) -> dict:
    """Median seconds of ``steps`` forward + backward passes (cross-entropy, gradients zeroed before each, as a
    learner's ``training_step``) after ``warmup`` ones, per model and μ; inputs drawn as the benchmarks' (standard
    normal, 10 classes)."""
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = []
    for name, mu in models:
        model, inputs = _model(name)
        x, y = torch.randn(mu, inputs), torch.randint(0, 10, (mu,))
        times = []
        for i in range(warmup + steps):
            t0 = time.perf_counter()
            model.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        rows.append(
            {
                "model": name,
                "batch_size": mu,
                "parameters": sum(p.numel() for p in model.parameters()),
                "median_s": statistics.median(times),
                "min_s": min(times),
                "steps": steps,
            }
        )
    return {"command": COMMAND, "rows": rows}


def load_compute(path: str = COMPUTE) -> dict:
    with open(path) as f:
        return json.load(f)


def measure_and_store(path: str = COMPUTE) -> dict:
    """Both measurements, written to ``path`` with the command that made them."""
    table = {**measure_compute(), "lightning": measure_lightning()}
    with open(path, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")
    return table


def compute_s(table: dict, model: str, batch_size: int) -> float:
    """One learner's compute per step in seconds of one core: the table's forward + backward of ``model`` at μ =
    ``batch_size`` plus Lightning's own time per step."""
    alone = next(r["median_s"] for r in table["rows"] if r["model"] == model and r["batch_size"] == batch_size)
    return alone + table["lightning"]["overhead_s"]


def measure_lightning(steps: int = 60, warmup: int = 10, batch_size: int = 32) -> dict:
    """Lightning's own time per step beside the model's: a ``Trainer`` (one CPU process, one thread, nothing
    logged or validated, as the benchmarks' ``QUIET``) fitting the MNIST-1D CNN at μ = ``batch_size``, the median
    interval between batch ends after ``warmup``, less the same model's forward + backward alone (the optimizer step
    of its 8,010 parameters is left in: microseconds)."""
    import pytorch_lightning as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from benchmarks.training import QUIET
    from examples.mnist1d import MNIST1DClassifier

    torch.set_num_threads(1)
    ends: list[float] = []

    class Ends(pl.Callback):
        def on_train_batch_end(self, *args: Any) -> None:
            ends.append(time.perf_counter())

    n = (warmup + steps + 1) * batch_size
    data = DataLoader(TensorDataset(torch.randn(n, 40), torch.randint(0, 10, (n,))), batch_size=batch_size)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, callbacks=[Ends()], **QUIET)
    trainer.fit(MNIST1DClassifier(), data)
    step = statistics.median(b - a for a, b in zip(ends[warmup:], ends[warmup + 1 :]))
    alone = next(r for r in measure_compute(steps, 5, (("mnist1d", batch_size),))["rows"])["median_s"]
    return {"step_s": step, "model_s": alone, "overhead_s": max(step - alone, 0.0), "batch_size": batch_size}
