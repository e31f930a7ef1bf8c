"""The validation's inputs, read from the committed results files (docs/prediction.md says which number comes from
where)."""

import json
import math
import os
import statistics
from typing import Iterable, Sequence

from benchmarks.predict.compute import compute_s, load_compute
from benchmarks.predict.server import _line
from lightning_rudra.core.runtime import Link, ServerCost

RESULTS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "results")


def _load(name: str) -> dict:
    with open(os.path.join(RESULTS, f"{name}.json")) as f:
        return json.load(f)


class Inputs:
    """What the committed transport results say of this machine's paths, fitted as lines in the parameters N over
    the transport table's sizes (medians of its repetitions): the one-host path through shared memory (a learner
    alone: push+pull minus the server's work), RPC (an echo of 4N bytes each way: its intercept is two messages'
    fixed cost, its slope two copies of 4 bytes a parameter) and gloo's all-reduce (to take DDP's from a DDP step,
    leaving the compute); ``table``: one learner's compute measured alone (``measured_compute.json``). ``cores``: the machine's that measured (every results file's meta ``nproc``)."""

    def __init__(self, server: ServerCost) -> None:
        data = _load("transport-models")
        raw = data["raw"]["transport"]
        sizes = sorted(int(n) for n in raw)
        med = {n: {k: statistics.median(v) for k, v in raw[str(n)].items()} for n in sizes}
        self.server = server
        self.cores = float(data["meta"]["nproc"])
        # a push and its reply each move 4N bytes: time = 2 latency + 2 × 32 N / bandwidth
        self.shared = self._path(sizes, [med[n]["solo"] - server.push(n) - server.update(n) for n in sizes])
        slope, intercept = _line(sizes, [med[n]["echo"] for n in sizes])
        self.rpc = Link(per_message=intercept / 2, per_byte=slope / 8)
        self.gloo = _line(sizes, [med[n]["gloo"] for n in sizes])
        # the steps' coefficients of variation, as the log-normal's σ(log): a CV c is √(ln(1 + c²)) in log units
        self.jitter = _log_sigma(self._jitter())
        # RPC's own round trip and the copies that its path makes beside it, measured at each size (medians of the
        # transport table's rounds): the echo (a line through 10 k .. 50 M misses the 10 M point 2.2×: 139 ms for a
        # measured 65, as the echo's cost per byte doubles from 10 M to 50 M), and in-process the learner's packing
        # into a new tensor (layout.pack: torch.cat, fresh pages), the server's copy of the weights for a reply
        # (Server.pull: clone) and the learner's loading of them
        self.rpc_points = {n: {k: med[n][k] for k in ("echo", "pack", "clone", "load")} for n in sizes}
        self.mlp_jitter = _log_sigma(self._mlp_jitter(data))
        self.table = load_compute()

    @staticmethod
    def _jitter() -> float:
        """A step's coefficient of variation: the accuracy file's async runs, λ = 2 without straggler, record each
        learner's batches per epoch; for steps of mean m and CV c a learner ends N ≈ T / m of them with variance
        N c², so c = √(var / mean) of the counts over the epochs (median over runs and learners)."""
        row = next(r for r in _load("accuracy")["raw"]["accuracy"] if r["learners"] == 2)
        return _median_cv(
            counts for run in row["runs"]["1x"] if run["strategy"] == "async" for counts in run["epoch_batches"]
        )

    def rpc_cost(self, parameters: int, what: str) -> float:
        """The transport table's ``what`` (echo, pack, clone, load) at ``parameters``, linear between its sizes."""
        sizes = sorted(self.rpc_points)
        lo = max([n for n in sizes if n <= parameters] or sizes[:1])
        hi = min([n for n in sizes if n >= parameters] or sizes[-1:])
        a, b = self.rpc_points[lo][what], self.rpc_points[hi][what]
        return a if hi == lo else a + (b - a) * (parameters - lo) / (hi - lo)

    def rpc_at(self, parameters: int) -> Link:
        """RPC's transport for a model of ``parameters``: the echo measured at that size, half its time a message
        (4 B a parameter each way), as a cost per byte."""
        return Link(per_byte=self.rpc_cost(parameters, "echo") / 2 / (4 * parameters))

    def jitter_of(self, source: str) -> float:
        """The step jitter for a results file's rows: the MNIST-1D CNN's (epochs, accuracy) from the accuracy file,
        the MLPs' (transport-models, network: the same 10 M model) from the transport file's own async runs. The
        jitter that counts per epoch show is mostly the scheduler's (time slices of milliseconds, a stall of another
        job): absolute, not a fixed share of a step, so the CNN's 3–8 ms steps show a far larger relative jitter
        (σ ≈ 1.2 in accuracy.json at 45752fc, 0.27 at the run before) than the MLPs' 60–130 ms steps (0.19)."""
        return self.mlp_jitter if source in ("transport-models", "network") else self.jitter

    @staticmethod
    def _mlp_jitter(data: dict) -> float:
        """The same estimator as :meth:`_jitter` on the transport file's async runs without straggler (both λ)."""
        runs = (run for row in data["raw"]["models"] for run in row["runs"])
        return _median_cv(
            counts for run in runs if run["strategy"] == "async" for counts in run.get("epoch_batches", [])
        )

    @staticmethod
    def _path(sizes: Sequence[int], seconds: Sequence[float]) -> Link:
        slope, intercept = _line(sizes, seconds)
        return Link(64 / slope if slope > 0 else math.inf, intercept / 2)

    def allreduce(self, parameters: int, learners: int) -> tuple[float, float]:
        """gloo's all-reduce among λ processes, (per-parameter part, fixed part) of one process's time: the
        2-process fit (each process on a core of its own) × the ring's 2(λ − 1)/λ relative to λ = 2."""
        a, b = self.gloo
        ring = 2 * (learners - 1) / learners
        return a * parameters * ring, b * ring

    def compute(self, ddp_step_ms: float, parameters: int, learners: int, straggle_s: float = 0.0) -> float:
        """One learner's compute in seconds of one core, from a DDP step measured beside the runs.

        Taken out of the step, besides the straggler's added wait (DDP waits for it every step):
        - the all-reduce. Its fixed part (latency over loopback) is wall time; its per-parameter part (40 MB copied
          and summed through loopback TCP at 10 M) is CPU work in each of the λ processes, so with λ > cores it is
          shared like the compute: min(1, cores/λ) of a core each, as all λ processes do it at once;
        - the optimizer's step: every DDP process steps its own copy of the weights (momentum SGD, 13.5 ms at 10 M,
          MEASURED_SERVER.update), a Rudra learner does not (its server does, and the model charges the server).
        Without straggler all λ learners compute at once: the rest × min(1, cores/λ). With one (it waits before
        its batch), the others compute during its wait and the step's path after it is its own compute, on a core
        of its own, then the all-reduce and step with every process busy."""
        per_parameter, fixed = self.allreduce(parameters, learners)
        share = min(1.0, self.cores / learners)
        if straggle_s:
            # as before: (step − wait − all-reduce) × min(1, cores/λ). How DDP's step runs around a sleeping
            # straggler (do the waiting processes hold their cores in gloo's wait?) is not known here, and this
            # form matches 11 of the 13 straggler rows; the optimizer's step is left in
            return max((ddp_step_ms / 1000 - straggle_s - fixed - per_parameter) * share, 1e-4)
        return max((ddp_step_ms / 1000 - fixed) * share - per_parameter - self.server.update(parameters), 1e-4)

    def alone(self, model: str, batch_size: int) -> float:
        """One learner's compute in seconds of one core as ``--measure-compute`` measured it: the model's forward +
        backward alone (one process, one thread) plus Lightning's own time per step."""
        return compute_s(self.table, model, batch_size)


def _log_sigma(cv: float) -> float:
    """σ(log) of the log-normal whose coefficient of variation is ``cv``."""
    return math.sqrt(math.log1p(cv * cv))


def _median_cv(epoch_counts: Iterable[Sequence[int]]) -> float:
    """The median over learners' runs of √(var / mean) of their batches per epoch (0 without any)."""
    cvs = [math.sqrt(statistics.pvariance(counts) / statistics.fmean(counts)) for counts in epoch_counts]
    return statistics.median(cvs) if cvs else 0.0
