"""The runtime model's prediction as a timing model for the simulated learners: :class:`PredictedTiming`."""

from typing import Sequence

from lightning_rudra.core.errors import ConfigurationError
from lightning_rudra.core.timing import Measured


class PredictedTiming(Measured):
    """``times[r]``: learner r's step durations in seconds, as :class:`~lightning_rudra.core.timing.Measured` takes
    measured ones (used in turn, from the start again once used up), but predicted: the time from one of its
    gradients reaching the server to the next (softsync, async), or from its round's start (hardsync), so that
    :func:`~lightning_rudra.core.timing.push_order` gives the predicted order. A duration may be 0 (two pushes
    at once: then ordered by rank, as push_order does)."""

    def __init__(self, times: Sequence[Sequence[float]]) -> None:
        lists = [[float(t) for t in ts] for ts in times]
        if not lists or any(not ts or min(ts) < 0 for ts in lists):
            raise ConfigurationError(
                f"PredictedTiming(times) needs, per learner, a non-empty list of durations >= 0; got {times!r:.200}."
            )
        self.times = lists  # Measured's own check refuses 0: not called

    # duration: Measured's (each learner's list in turn); only the check differs (0 allowed)

    @classmethod
    def from_arrivals(
        cls, arrivals: Sequence[Sequence[float]], round_starts: Sequence[Sequence[float]]
    ) -> "PredictedTiming":
        """From each learner's arrival times at the server and the start of the step of each (the reply that began
        it): under hardsync push_order sorts a round by duration, so a duration is the time since the step's start;
        otherwise it adds them up, so a duration is the time since the learner's previous arrival."""
        times = []
        for arrived, started in zip(arrivals, round_starts):
            if started:
                times.append([a - s for a, s in zip(arrived, started)] or [1.0])
            else:
                times.append([a - b for a, b in zip(arrived, [0.0, *arrived[:-1]])] or [1.0])
        return cls(times)
