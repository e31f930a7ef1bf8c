"""What the server counts while training, for the user to read after it (``RudraStrategy.stats``) and for a
checkpoint to carry. Plain Python."""

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Stats:
    """What a user reads after training: updates applied (the clock), gradients taken, dropped (staler than
    ``max_staleness``), rejected (non-finite), late (batchsync, backup: they came after their round closed and were
    not applied, nor counted in ``gradients``), held (``on_stale="block"``: pushes held back, applied once released
    unless their learner was lost), clipped (compensation ``clip``: stale updates scaled down, counted by this
    server, of its part of the gradient), the
    staleness histogram σ -> count of applied gradients (of every optimizer, and per optimizer: optimizer -> σ ->
    count), and under the shared epoch, or with simulated learners, the batches each learner took (learner -> count,
    first train dataloader), the batches dealt again (their learner was lost before it trained on them, or their
    gradient was late), and the learners lost during training with why (only with ``min_learners``: otherwise a
    loss ends training): those lost now, and every loss and rejoin in ``events``."""

    clock: int = 0
    gradients: int = 0
    dropped: int = 0
    rejected: int = 0
    late: int = 0
    held: int = 0  # on_stale="block": pushes held back until another learner's gradient came
    clipped: int = 0  # compensation "clip": stale updates scaled down to a percentile of the recent norms
    staleness: dict[int, int] = field(default_factory=dict)
    optimizer_staleness: dict[int, dict[int, int]] = field(default_factory=dict)
    batches: dict[int, int] = field(default_factory=dict)
    redealt: int = 0
    lost: dict[int, str] = field(default_factory=dict)  # learner -> why it is lost now (``min_learners``)
    # every loss and rejoin, in order: {"learner", "event" ("lost" or "rejoined"), "time" (Unix seconds), "why"}
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def mean_staleness(self) -> float:
        count = sum(self.staleness.values())
        return sum(s * c for s, c in self.staleness.items()) / count if count else 0.0

    def mean_staleness_of(self, optimizer: int) -> float:
        """⟨σ⟩ of the gradients of ``optimizer`` applied so far."""
        counts = self.optimizer_staleness.get(optimizer, {})
        total = sum(counts.values())
        return sum(s * c for s, c in counts.items()) / total if total else 0.0

    def count_staleness(self, optimizer: int, sigma: int, count: int) -> None:
        """``count`` gradients of ``optimizer`` applied with staleness ``sigma``."""
        self.staleness[sigma] = self.staleness.get(sigma, 0) + count
        counts = self.optimizer_staleness.setdefault(optimizer, {})
        counts[sigma] = counts.get(sigma, 0) + count

    @property
    def max_staleness(self) -> int:
        return max(self.staleness, default=0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "clock": self.clock,
            "gradients": self.gradients,
            "dropped": self.dropped,
            "rejected": self.rejected,
            "late": self.late,
            "held": self.held,
            "clipped": self.clipped,
            "staleness": dict(sorted(self.staleness.items())),
            "optimizer_staleness": {k: dict(sorted(c.items())) for k, c in sorted(self.optimizer_staleness.items())},
            "batches": dict(sorted(self.batches.items())),
            "redealt": self.redealt,
            "lost": dict(sorted(self.lost.items())),
            "events": [dict(event) for event in self.events],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Stats":
        counts = {key: {int(k): int(c) for k, c in data.get(key, {}).items()} for key in ("staleness", "batches")}
        per_optimizer = {
            int(k): {int(s): int(c) for s, c in counts.items()}
            for k, counts in data.get("optimizer_staleness", {}).items()
        }
        if "optimizer_staleness" not in data and counts["staleness"]:  # saved before σ was counted per optimizer:
            per_optimizer = {0: dict(counts["staleness"])}  # the run's, exactly so with one optimizer
        lost = {int(k): str(why) for k, why in data.get("lost", {}).items()}
        events = [dict(event) for event in data.get("events", [])]
        return cls(**{**data, **counts, "optimizer_staleness": per_optimizer, "lost": lost, "events": events})

    def record(self, learner: int, event: str, why: str) -> None:
        self.events.append({"learner": int(learner), "event": event, "time": time.time(), "why": why})
