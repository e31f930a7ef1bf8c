"""What a GPU learner costs (issue 37): ``python -m benchmarks.gpu --out DIR`` on a machine with CUDA
(``benchmarks/gpu_check.sh`` runs it after the GPU tests); ``--device cpu --quick`` checks the script where no GPU is.

1. *Copies*: at 10 M and 100 M float32 parameters, a plain optimizer step on the device (SGD, momentum 0.9)
   against what a Rudra step adds around it: the gradient device→host and the weights host→device, each pageable
   (``tensor.to``) and pinned (``copy_(..., non_blocking=True)`` into page-locked memory, then a synchronize).
   Medians over timed repetitions, the device synchronised around each.
2. *One learner through the Trainer*: an MLP of that size (``benchmarks/synthetic.py``), plain Lightning on the
   device against ``RudraStrategy(protocol="async")`` with one learner process, with shared memory and without
   (the gradient and the weights then cross by RPC); the median step time after warm-up. The difference is the data
   path's cost per step: the copies, the push, the server's update on the CPU and the pull.
3. *Two learners on one GPU*: the MNIST-1D example CNN on synthetic inputs (speed only), μ = 32 per learner,
   Lightning on one device against two learner processes sharing it (``parallel_devices=[cuda:0, cuda:0]``:
   Lightning's ``devices=2`` needs two GPUs) under Rudra hardsync and async, and DDP (gloo) on the same two
   processes where it runs; samples/s over the window where both learners are past warm-up.

Every part writes ``gpu.json`` as it ends, so a run cut short keeps what it measured; ``gpu.md`` at the end.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from benchmarks import stats
from benchmarks.training import QUIET

WARMUP = 5  # batches left out of every step time and window


class Times(pl.Callback):
    """Each learner's batch ends (the device synchronised first), written to ``<folder>/times-<rank>.json``."""

    def __init__(self, folder: str) -> None:
        self.folder, self.times, self.batch_size = folder, [], 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        self.times.append(time.perf_counter())
        self.batch_size = len(batch[0])  # the loader's batch_size is None under the shared epoch's batch sampler

    def on_train_end(self, trainer, pl_module) -> None:
        path = Path(self.folder) / f"times-{trainer.global_rank}.json"
        path.write_text(json.dumps({"times": self.times, "batch_size": self.batch_size}))


def _timed(fn: Callable[[], Any], device: torch.device, reps: int) -> float:
    """Median milliseconds of ``fn`` over ``reps`` calls after one warm-up, the device synchronised around each."""
    fn()
    samples = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append(1e3 * (time.perf_counter() - start))
    return statistics.median(samples)


def copies(size: int, device: torch.device, reps: int) -> dict[str, float]:
    """Part 1: ms per call of an optimizer step and of each copy of ``size`` float32 elements."""
    param = torch.nn.Parameter(torch.randn(size, device=device))
    param.grad = torch.randn(size, device=device)
    optimizer = torch.optim.SGD([param], lr=0.01, momentum=0.9)
    host = torch.empty(size)
    pinned = host.pin_memory() if device.type == "cuda" else host

    def pinned_d2h() -> None:
        pinned.copy_(param.grad, non_blocking=True)

    def pinned_h2d() -> None:
        param.data.copy_(pinned, non_blocking=True)

    result = {
        "optimizer_step_ms": _timed(optimizer.step, device, reps),
        "d2h_pageable_ms": _timed(lambda: param.grad.to("cpu"), device, reps),
        "d2h_pinned_ms": _timed(pinned_d2h, device, reps),
        "h2d_pageable_ms": _timed(lambda: host.to(device), device, reps),
        "h2d_pinned_ms": _timed(pinned_h2d, device, reps),
    }
    return result


def _fit(model: pl.LightningModule, data: TensorDataset, batch: int, strategy: Any, accelerator: str, steps: int):
    """One fit; returns each rank's recorded batch ends (``stats.throughput``'s input)."""
    folder = tempfile.mkdtemp(prefix="rudra-gpu-")
    trainer = pl.Trainer(
        accelerator=accelerator,
        devices=1,
        strategy=strategy,
        max_steps=steps,
        callbacks=[Times(folder)],
        **QUIET,
    )
    trainer.fit(model, DataLoader(data, batch_size=batch, shuffle=True))
    return [json.loads(p.read_text()) for p in sorted(Path(folder).glob("times-*.json"))]


def _strategies(device: torch.device, learners: int) -> dict[str, Any]:
    from pytorch_lightning.strategies import DDPStrategy

    from lightning_rudra import RudraStrategy

    shared = [device] * learners
    if learners == 1:
        return {
            "lightning": "auto",
            "rudra async": RudraStrategy(protocol="async", start_method="forkserver"),
            "rudra async, no shared memory": RudraStrategy(
                protocol="async", shared_memory=False, start_method="forkserver"
            ),
        }
    return {
        "lightning, one learner": "auto",
        "rudra hardsync": RudraStrategy(protocol="hardsync", parallel_devices=shared, start_method="forkserver"),
        "rudra async": RudraStrategy(protocol="async", parallel_devices=shared, start_method="forkserver"),
        "ddp (gloo)": DDPStrategy(parallel_devices=shared, process_group_backend="gloo", start_method="spawn"),
    }


def through_trainer(
    size: Optional[int], device: torch.device, learners: int, steps: int, batch: int
) -> dict[str, dict[str, Any]]:
    """Parts 2 (``size``: the MLP's parameters, one learner) and 3 (``size=None``: the CNN, two learners)."""
    from benchmarks.synthetic import MLPClassifier, teacher_data
    from examples.mnist1d import MNIST1DClassifier

    accelerator = "gpu" if device.type == "cuda" else "cpu"
    if size is None:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(4096, 40, generator=generator)
        data = TensorDataset(x, (x @ torch.randn(40, 10, generator=generator)).argmax(dim=1))
    else:
        raw = teacher_data(batch * (steps + 1), seed=0)
        data = TensorDataset(raw["x"], raw["y"])
    out: dict[str, dict[str, Any]] = {}
    for name, strategy in _strategies(device, learners).items():
        torch.manual_seed(0)
        model = MNIST1DClassifier(lr=0.05) if size is None else MLPClassifier(size, lr=0.01)
        try:
            ranks = _fit(model, data, batch, strategy, accelerator, steps)
            out[name] = stats.throughput(ranks, WARMUP) | {"learners": len(ranks)}
        except Exception as error:  # a strategy that cannot run here is a result too: say why, go on
            out[name] = {"error": f"{type(error).__name__}: {error}"[:500]}
            traceback.print_exc()
        print(f"  {name}: {out[name]}", file=sys.stderr, flush=True)
    return out


def _markdown(result: dict[str, Any]) -> str:
    lines = [f"# GPU learners\n\n{result['meta']}\n", "## 1. Copies (ms per call)\n"]
    lines += [
        "| parameters | optimizer step | d2h pageable | d2h pinned | h2d pageable | h2d pinned |",
        "|---" * 6 + "|",
    ]
    for size, c in result.get("copies", {}).items():
        cells = ["optimizer_step_ms", "d2h_pageable_ms", "d2h_pinned_ms", "h2d_pageable_ms", "h2d_pinned_ms"]
        lines.append(f"| {size} | " + " | ".join(f"{c[k]:.2f}" for k in cells) + " |")
    for part, title, column in (
        ("one_learner", "2. One learner through the Trainer", "step_ms"),
        ("two_learners", "3. Two learners on one device, MNIST-1D CNN", "samples_per_s"),
    ):
        lines += [f"\n## {title}\n", "| model | strategy | learners | step ms | samples/s |", "|---" * 5 + "|"]
        for model, runs in result.get(part, {}).items():
            for name, r in runs.items():
                if "error" in r:
                    lines.append(f"| {model} | {name} | – | failed: {r['error'][:120]} | – |")
                    continue
                sps = f"{r['samples_per_s']:.0f}" if r.get("samples_per_s") else "–"
                lines.append(f"| {model} | {name} | {r['learners']} | {r.get('step_ms', float('nan')):.2f} | {sps} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # not benchmarks/results: its files come from benchmarks.run's checked, clean trees; copy these there by hand
    parser.add_argument("--out", default="/tmp/rudra-gpu", help="where gpu.json and gpu.md go")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu to check the script where no GPU is")
    parser.add_argument("--quick", action="store_true", help="small sizes and few steps: a check, not a result")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available here; --device cpu checks the script on the CPU")
    sizes = [1_000_000] if args.quick else [10_000_000, 100_000_000]
    steps, reps = (20, 3) if args.quick else (60, 10)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    result: dict[str, Any] = {
        "meta": f"{time.strftime('%Y-%m-%dT%H:%M:%S')} · {name} · torch {torch.__version__} · "
        f"pytorch-lightning {pl.__version__} · {os.cpu_count()} CPUs{' · --quick' if args.quick else ''}",
        "copies": {},
        "one_learner": {},
        "two_learners": {},
    }

    def save() -> None:
        (out / "gpu.json").write_text(json.dumps(result, indent=1))

    for size in sizes:
        print(f"copies, {size:,} parameters", file=sys.stderr, flush=True)
        result["copies"][f"{size:,}"] = copies(size, device, reps)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the copies' tensors are gone: give their memory back before the next part
        save()
    for size in sizes:
        print(f"one learner, MLP of {size:,} parameters", file=sys.stderr, flush=True)
        result["one_learner"][f"MLP {size:,}"] = through_trainer(size, device, 1, steps, batch=32)
        save()
    print("two learners on one device, MNIST-1D CNN", file=sys.stderr, flush=True)
    result["two_learners"]["MNIST-1D CNN"] = through_trainer(None, device, 2, steps * 5, batch=32)
    save()
    (out / "gpu.md").write_text(_markdown(result))
    print(_markdown(result))
    return result


if __name__ == "__main__":
    main()
