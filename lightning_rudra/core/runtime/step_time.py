"""How long a learner's compute (forward and backward) takes: :class:`StepTime`."""

import json
import math
import random
from dataclasses import dataclass
from typing import Optional, Sequence

from lightning_rudra.core.errors import ConfigurationError
from lightning_rudra.core.runtime.checks import non_negative, positive

KINDS = ("fixed", "lognormal", "exponential", "measured")


@dataclass(frozen=True)
class StepTime:
    """One learner's compute time per step, in seconds (the push and the pull are the link's and the server's).

    ``kind``: ``fixed`` (every step ``mean``), ``lognormal`` (``mean`` × exp(N(0, ``spread``) − ``spread``²/2), the
    right-skewed shape of shared machines, as :class:`~lightning_rudra.core.timing.Jittered`'s, of mean ``mean``), ``exponential`` (a shifted
    exponential as in Dutta et al. 2018: ``mean`` × (1 − ``spread``) plus an exponential of mean ``mean`` ×
    ``spread``; ``spread=1``: purely exponential) or ``measured`` (``times`` in turn, from the start again once
    used up). ``slowdown`` multiplies every step: a 3× straggler is ``slowdown=3``. With a host's ``cores`` set
    (:class:`Cluster`), the compute is CPU time on one core, stretched when more processes than cores are busy.
    ``sleep`` / ``spin``: wall seconds each step waits after its compute, with its core free for the others (a
    sleeping straggler) or held (a busy-waiting one, as a slow device's compute)."""

    mean: float = 1.0
    kind: str = "fixed"
    spread: float = 0.0
    slowdown: float = 1.0
    times: tuple[float, ...] = ()
    sleep: float = 0.0
    spin: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigurationError(
                f"StepTime kind={self.kind!r} is not supported: expected one of {', '.join(map(repr, KINDS))}."
            )
        positive("StepTime mean", self.mean)
        positive("StepTime slowdown", self.slowdown)
        non_negative("StepTime spread", self.spread)
        non_negative("StepTime sleep", self.sleep)
        non_negative("StepTime spin", self.spin)
        if self.kind == "exponential" and self.spread > 1:
            raise ConfigurationError(
                f"StepTime spread={self.spread!r} is not valid for kind='exponential': expected the exponential "
                "part's share of the mean, between 0 and 1."
            )
        if self.kind == "measured":
            if not self.times:
                raise ConfigurationError("StepTime kind='measured' needs times: a non-empty list of seconds.")
            for t in self.times:
                positive("a measured step time", t)

    def with_slowdown(self, factor: float) -> "StepTime":
        return StepTime(self.mean, self.kind, self.spread, self.slowdown * factor, self.times, self.sleep, self.spin)

    def sample(self, rng: random.Random, step: int) -> float:
        """Step ``step``'s compute time, drawn from ``rng`` (the learner's own: deterministic given the seed)."""
        if self.kind == "measured":
            base = self.times[step % len(self.times)]
        elif self.kind == "lognormal":
            base = self.mean * math.exp(rng.gauss(0.0, self.spread) - self.spread**2 / 2)
        elif self.kind == "exponential":
            base = self.mean * (1 - self.spread) + (
                rng.expovariate(1 / (self.mean * self.spread)) if self.spread else 0
            )
        else:
            base = self.mean
        return base * self.slowdown

    @classmethod
    def measured(cls, times: Sequence[float], slowdown: float = 1.0) -> "StepTime":
        ts = tuple(float(t) for t in times)
        return cls(mean=sum(ts) / len(ts) if ts else 1.0, kind="measured", slowdown=slowdown, times=ts)

    @classmethod
    def from_step_times(cls, path: str, subtract: float = 0.0, learner: Optional[int] = None) -> list["StepTime"]:
        """Every learner's times from the JSON a :class:`~lightning_rudra.strategy.step_times.StepTimes` callback
        wrote (or one learner's). Those times span the whole batch, the push and pull included: ``subtract`` takes a
        known per-step cost out (e.g. the all-reduce of a DDP run), leaving the compute."""
        with open(path) as f:
            lists = json.load(f)["times"]
        chosen = lists if learner is None else [lists[learner]]
        return [cls.measured([max(t - subtract, 1e-9) for t in ts]) for ts in chosen]
