"""What the runtime model predicts for one scenario: :class:`Prediction`."""

from dataclasses import dataclass, field

from lightning_rudra.core.runtime.predicted_timing import PredictedTiming


@dataclass
class Prediction:
    """Rates are counted, as the benchmarks count them, from the moment every learner has ended ``warmup`` batches
    to the epoch's end; the staleness of the gradients applied meanwhile.

    ``samples_per_s``: batches the learners ended (every one computed, wasted or not) × μ per second.
    ``applied_per_s`` / ``computed_per_s``: gradients. ``staleness``: σ -> gradients applied with it.
    ``wasted``: the fraction of computed gradients not applied (late for their round, or computed on old weights).
    ``epoch_s``: from the start to the epoch's last applied gradient. ``server_utilisation``: per server, the share
    of the epoch it was busy. ``push_order``: (learner, timestamp of its weights) of every applied gradient, in the
    order applied; ``arrivals``: per learner, the times its gradients reached the server (applied or not), for
    :meth:`timing`. ``held_s``: SSP, the time pushes spent held. ``update_times``: when each update was applied (the
    wall-time axis of an accuracy curve). ``run_staleness``: σ -> every gradient applied in the run, warm-up
    and every epoch's start included, as ``RudraStrategy.stats`` counts them."""

    protocol: str
    learners: int
    samples_per_s: float
    applied_per_s: float
    computed_per_s: float
    staleness: dict[int, int]
    wasted: float
    epoch_s: float
    updates: int
    server_utilisation: list[float]
    push_order: list[tuple[int, int]] = field(repr=False)
    arrivals: list[list[float]] = field(repr=False)
    round_starts: list[list[float]] = field(repr=False)
    held_s: float = 0.0
    update_times: list[float] = field(default_factory=list, repr=False)
    run_staleness: dict[int, int] = field(default_factory=dict)

    @property
    def mean_staleness(self) -> float:
        return _mean(self.staleness)

    @property
    def mean_run_staleness(self) -> float:
        """Mean σ of every gradient the run applied (``RudraStrategy.stats.mean_staleness``)."""
        return _mean(self.run_staleness)

    @property
    def max_staleness(self) -> int:
        return max(self.staleness, default=0)

    def timing(self) -> PredictedTiming:
        """A timing model for ``RudraStrategy(simulate=λ, timing=...)``: each learner's durations such that
        :func:`~lightning_rudra.core.timing.push_order` orders the simulated learners' pushes as predicted here,
        in seconds, so the accuracy curve can be drawn against the predicted wall time."""
        return PredictedTiming.from_arrivals(self.arrivals, self.round_starts)

    def to_dict(self) -> dict:
        return {
            "protocol": self.protocol,
            "learners": self.learners,
            "samples_per_s": self.samples_per_s,
            "applied_per_s": self.applied_per_s,
            "computed_per_s": self.computed_per_s,
            "mean_staleness": self.mean_staleness,
            "max_staleness": self.max_staleness,
            "mean_run_staleness": self.mean_run_staleness,
            "staleness": dict(sorted(self.staleness.items())),
            "wasted": self.wasted,
            "epoch_s": self.epoch_s,
            "updates": self.updates,
            "server_utilisation": self.server_utilisation,
            "held_s": self.held_s,
        }


def _mean(histogram: dict[int, int]) -> float:
    total = sum(histogram.values())
    return sum(s * c for s, c in histogram.items()) / total if total else 0.0
