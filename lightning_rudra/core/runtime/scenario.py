"""Everything the runtime model needs about one run: :class:`Scenario`."""

from dataclasses import dataclass, field
from typing import Sequence, Union

from lightning_rudra.core.errors import ConfigurationError
from lightning_rudra.core.runtime.checks import count
from lightning_rudra.core.runtime.cluster import Cluster
from lightning_rudra.core.runtime.payload import Payload
from lightning_rudra.core.runtime.protocol import Protocol
from lightning_rudra.core.runtime.server_cost import ServerCost
from lightning_rudra.core.runtime.step_time import StepTime


@dataclass(frozen=True)
class Scenario:
    """A run to predict: the ``protocol``, the ``cluster``, each learner's ``step_times`` (learner r takes
    ``step_times[r % len]``; one for all), the ``payload``, the ``server`` cost, μ (``batch_size``) and the
    ``batches`` of each of ``epochs`` epochs, all learners together: the epoch ends when that many gradients were applied (a wasted
    gradient's batch is dealt again). ``warmup``: batches each learner makes before the rates and staleness are
    counted, as the benchmarks count them. ``seed`` draws the random step times."""

    protocol: Protocol
    cluster: Cluster
    step_times: Union[StepTime, Sequence[StepTime]]
    payload: Payload
    server: ServerCost = field(default_factory=ServerCost)
    batch_size: int = 1
    batches: int = 1000
    epochs: int = 1
    warmup: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        for name, kind in (
            ("protocol", Protocol),
            ("cluster", Cluster),
            ("payload", Payload),
            ("server", ServerCost),
        ):
            if not isinstance(getattr(self, name), kind):
                raise ConfigurationError(f"{name}={getattr(self, name)!r} is not valid: expected a {kind.__name__}.")
        times = self.step_times if isinstance(self.step_times, Sequence) else [self.step_times]
        if not times or not all(isinstance(t, StepTime) for t in times):
            raise ConfigurationError(
                f"step_times={self.step_times!r:.200} is not valid: expected a StepTime or a non-empty list of them."
            )
        count("batch_size", self.batch_size)
        count("batches", self.batches)
        count("epochs", self.epochs)
        count("warmup", self.warmup, least=0)
        self.protocol.check(self.cluster.learners)

    def step_time(self, learner: int) -> StepTime:
        times = self.step_times if isinstance(self.step_times, Sequence) else [self.step_times]
        return times[learner % len(times)]
