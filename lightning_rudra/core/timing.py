"""When simulated learners push: timing models and the order of pushes they lead to. Plain Python.

A simulated run (``RudraStrategy(simulate=λ)``) computes every virtual learner's steps in one process, so the
order in which the learners reach the server must come from a model of their speed rather than from a clock.
Each learner computes from the weights of its last reply and pushes when its step's duration has passed; under
softsync and async the reply comes at once, under hardsync when the round's last gradient arrives. Staleness
then arises as it would on a cluster: from who pushes between a learner's pull and its push.

Durations are in arbitrary units (a step of a homogeneous learner takes 1). Pushes at the same moment are
ordered by rank. Every learner starts each epoch at the same moment, as they do where Lightning's end-of-epoch
collectives (validation, logging with ``sync_dist``, checkpoints) make them meet.
"""

import heapq
import json
import math
import random
from typing import Mapping, Optional, Sequence

from lightning_rudra.core.errors import ConfigurationError


class TimingModel:
    """How long step ``step`` (counted over the run) of learner ``learner`` takes. Subclasses override
    :meth:`duration`; this base class is the homogeneous model: every step takes 1."""

    def duration(self, learner: int, step: int) -> float:
        return 1.0

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({args})"


class Homogeneous(TimingModel):
    """Every learner takes the same time for every step (the default)."""


class Jittered(TimingModel):
    """Every step takes a random time around 1: log-normal with standard deviation ``spread`` of its log, the
    right-skewed shape of step times on shared machines. Deterministic given ``seed``, learner and step.
    ``slowdown`` multiplies the times of the learners it names (rank -> factor): a 3× straggler is ``{0: 3.0}``."""

    def __init__(self, spread: float = 0.3, seed: int = 0, slowdown: Optional[dict[int, float]] = None) -> None:
        if not (isinstance(spread, (int, float)) and 0 <= spread <= 3):
            raise ConfigurationError(
                f"spread={spread!r} is not valid: expected the standard deviation of a step time's log, "
                "a number between 0 and 3."
            )
        self.spread = float(spread)
        self.seed = int(seed)
        self.slowdown = _checked_slowdown(slowdown or {})

    def duration(self, learner: int, step: int) -> float:
        noise = random.Random(hash((self.seed, learner, step))).gauss(0.0, self.spread) if self.spread else 0.0
        return self.slowdown.get(learner, 1.0) * math.exp(noise)


class ShiftedExponential(TimingModel):
    """Every step takes ``shift`` plus an exponential time of mean ``scale``: the straggler distribution of Dutta et
    al. ("Slow and Stale Gradients Can Win the Race", 2018), a fixed compute time plus a memoryless delay, so that
    once in a while any learner is several times slower than its mean. The defaults give a mean of 1. Deterministic
    given ``seed``, learner and step. ``slowdown`` multiplies the times of the learners it names (rank -> factor)."""

    def __init__(
        self, shift: float = 0.5, scale: float = 0.5, seed: int = 0, slowdown: Optional[dict[int, float]] = None
    ) -> None:
        for name, value in (("shift", shift), ("scale", scale)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 <= value < math.inf):
                raise ConfigurationError(
                    f"{name}={value!r} is not valid: expected a finite number >= 0 (a step takes shift plus an "
                    "exponential time of mean scale)."
                )
        if shift + scale <= 0:
            raise ConfigurationError(
                f"shift={shift!r} and scale={scale!r} make every step take no time: expected shift + scale > 0."
            )
        self.shift = float(shift)
        self.scale = float(scale)
        self.seed = int(seed)
        self.slowdown = _checked_slowdown(slowdown or {})

    def duration(self, learner: int, step: int) -> float:
        delay = random.Random(hash((self.seed, learner, step))).expovariate(1.0 / self.scale) if self.scale else 0.0
        return self.slowdown.get(learner, 1.0) * (self.shift + delay)


class Stragglers(Jittered):
    """Homogeneous learners, except those in ``slowdown`` (rank -> factor, e.g. ``{0: 3.0}``), which are that
    many times slower at every step."""

    def __init__(self, slowdown: dict[int, float]) -> None:
        super().__init__(spread=0.0, slowdown=slowdown)


class Measured(TimingModel):
    """Per-step times measured in a real run: ``times[r]`` lists learner r's step durations in seconds, used in
    turn (and from the start again once used up). A learner with no list of its own takes learner
    ``r % len(times)``'s, so a run measured on 4 learners can time a simulation of 30."""

    def __init__(self, times: Sequence[Sequence[float]]) -> None:
        lists = [list(map(float, t)) for t in times]
        if not lists or any(not t or min(t) <= 0 or not all(map(math.isfinite, t)) for t in lists):
            raise ConfigurationError(
                "Measured(times) needs, for at least one learner, a non-empty list of step durations in "
                f"seconds, every one finite and > 0; got {times!r:.200}."
            )
        self.times = lists

    def duration(self, learner: int, step: int) -> float:
        own = self.times[learner % len(self.times)]
        return own[step % len(own)]

    @classmethod
    def from_json(cls, path: str) -> "Measured":
        """The times that :class:`lightning_rudra.step_times.StepTimes` wrote in a real run."""
        with open(path) as f:
            return cls(json.load(f)["times"])


def _checked_slowdown(slowdown: Mapping[int, float]) -> dict[int, float]:
    checked = {}
    for learner, factor in dict(slowdown).items():
        if isinstance(learner, bool) or not isinstance(learner, int) or learner < 0:
            raise ConfigurationError(f"slowdown names learner {learner!r}: expected ranks, integers >= 0.")
        if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 0):
            raise ConfigurationError(
                f"slowdown of learner {learner} is {factor!r}: expected a factor > 0 (3.0: 3× slower)."
            )
        checked[learner] = float(factor)
    return checked


def push_order(protocol: str, steps: Sequence[int], timing: TimingModel, done: Sequence[int]) -> list[int]:
    """The learners, in the order of their pushes in one epoch: learner r makes ``steps[r]`` steps, and has made
    ``done[r]`` steps before the epoch (where its timing continues).

    Under softsync and async a learner starts its next step as soon as it has pushed (the server replies at once);
    under hardsync the learners start together after every round, which ends with its slowest push."""
    if protocol == "hardsync":
        order: list[int] = []
        for k in range(max(steps, default=0)):
            round_ = [r for r in range(len(steps)) if steps[r] > k]
            order += sorted(round_, key=lambda r: (timing.duration(r, done[r] + k), r))
        return order
    heap = [(timing.duration(r, done[r]), r) for r in range(len(steps)) if steps[r] > 0]
    heapq.heapify(heap)
    taken = [0] * len(steps)
    order = []
    while heap:
        moment, r = heapq.heappop(heap)
        order.append(r)
        taken[r] += 1
        if taken[r] < steps[r]:
            heapq.heappush(heap, (moment + timing.duration(r, done[r] + taken[r]), r))
    return order
