"""What the runtime model's simulation (:mod:`lightning_rudra.core.runtime.simulation`) records as it runs, and the
:class:`~lightning_rudra.core.runtime.prediction.Prediction` they add up to, counted past the warm-up."""

from dataclasses import dataclass, field

from lightning_rudra.core.runtime.prediction import Prediction
from lightning_rudra.core.runtime.scenario import Scenario


@dataclass
class Records:
    """Per learner: its batches' ends, its gradients' arrivals at the servers and its rounds' starts; the gradients
    applied (time, learner, timestamp, σ) and those wasted (a late one's batch is dealt again), the updates, the
    epochs' ends, and the time SSP held pushes back."""

    learners: int
    updates: int = 0
    wasted: int = 0
    held_s: float = 0.0
    epoch_ends: list[float] = field(default_factory=list)
    takes: list[tuple[float, int, int, int]] = field(default_factory=list)
    wastes: list[float] = field(default_factory=list)
    update_times: list[float] = field(default_factory=list)
    batch_ends: list[list[float]] = field(init=False)
    arrivals: list[list[float]] = field(init=False)
    starts: list[list[float]] = field(init=False)

    def __post_init__(self) -> None:
        self.batch_ends = [[] for _ in range(self.learners)]
        self.arrivals = [[] for _ in range(self.learners)]
        self.starts = [[] for _ in range(self.learners)]

    def prediction(self, scenario: Scenario, server_busy: list[float], parts: int) -> Prediction:
        """The outcome of ``scenario``'s run: rates over the epochs past its warm-up (every learner past
        ``warmup`` batches), staleness, waste, and each server's share of busy time (``server_busy`` of the
        ``parts`` servers simulated)."""
        warm = scenario.warmup
        ends = self.batch_ends
        begin = max((e[warm - 1] if len(e) >= warm else 0.0) for e in ends) if warm else 0.0
        end = self.epoch_ends[-1] if self.epoch_ends else 0.0
        span = end - begin
        if span <= 0:  # too few batches to leave the warm-up: count the whole run
            begin, span = 0.0, end
        counted = sum(1 for e in ends for t in e if begin < t <= end)
        applied = [(r, ts, sigma) for t, r, ts, sigma in self.takes if begin < t <= end]
        wasted = sum(1 for t in self.wastes if begin < t <= end)
        staleness: dict[int, int] = {}
        for _, _, sigma in applied:
            staleness[sigma] = staleness.get(sigma, 0) + 1
        run_staleness: dict[int, int] = {}
        for _, _, _, sigma in self.takes:
            run_staleness[sigma] = run_staleness.get(sigma, 0) + 1
        rate = 1 / span if span > 0 else 0.0
        protocol = scenario.protocol
        return Prediction(
            protocol=str(protocol),
            learners=self.learners,
            samples_per_s=counted * scenario.batch_size * rate,
            applied_per_s=len(applied) * rate,
            computed_per_s=(len(applied) + wasted) * rate,
            staleness=dict(sorted(staleness.items())),
            wasted=self.wasted / (len(self.takes) + self.wasted) if self.takes or self.wasted else 0.0,
            epoch_s=end / len(self.epoch_ends) if self.epoch_ends else 0.0,
            updates=self.updates,
            server_utilisation=[b / end if end else 0.0 for b in server_busy] * (scenario.cluster.num_servers // parts),
            push_order=[(r, ts) for _, r, ts, _ in self.takes],
            arrivals=self.arrivals,
            round_starts=self.starts if protocol.name == "hardsync" else [[] for _ in self.starts],
            held_s=self.held_s,
            update_times=self.update_times,
            run_staleness=dict(sorted(run_staleness.items())),
        )
