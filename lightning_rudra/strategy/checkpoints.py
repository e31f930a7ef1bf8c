"""Checkpoints of a strategy whose optimizer state lives on the parameter server.

Learner 0 writes them; it takes the server's weights, optimizer states and statistics in one snapshot, all of
one clock, and writes it beside the previous checkpoint before renaming it over it (a crash while writing leaves
the previous one whole). On resume, learner 0 hands the server the saved states with the weights before any
learner pulls or pushes, and every learner takes back its parameter groups (the rate its LR scheduler steps from).
"""

import os
from typing import Any, Callable, Mapping, NamedTuple, Optional

from pytorch_lightning.utilities import rank_zero_warn
from torch.optim import Optimizer

from lightning_rudra.learner.learner import Learner
from lightning_rudra.learner.optimizer import LearnerOptimizer, with_groups
from lightning_rudra.core.stats import Stats


class Resumed(NamedTuple):
    """What a stage resumes from a checkpoint (None: not resuming, or the checkpoint does not have it)."""

    stats: Optional[Stats]
    optimizer_states: Optional[list[dict[str, Any]]]


class Snapshot(NamedTuple):
    """Learner 0's snapshot of the server while a checkpoint is written: all of one clock."""

    optimizer_states: list[dict[str, Any]]
    stats: Stats


class Checkpoints:
    """What :class:`~lightning_rudra.RudraStrategy`'s checkpoint hooks hold between Lightning's calls: learner 0's
    snapshot of the server while a checkpoint is written, and the states of the checkpoint a stage resumes from
    until the server has them."""

    def __init__(self, protocol: str, n: int) -> None:
        self.protocol = {"protocol": protocol, "n": n}  # the run's, written beside the statistics it explains
        self.snapshot: Optional[Snapshot] = None
        self.resume_stats: Optional[Stats] = None
        self.resume_optimizer_states: Optional[list[dict[str, Any]]] = None

    def take_snapshot(self, learner: Optional[Learner]) -> None:
        """Learner 0 (which writes checkpoints, ``learner`` elsewhere None) takes the server's weights, optimizer
        states and statistics in one snapshot, all of one clock; the other learners' copies are not written."""
        self.snapshot = Snapshot(*learner.snapshot()) if learner is not None else None

    def optimizer_state(self, optimizer: LearnerOptimizer) -> dict[str, Any]:
        if self.snapshot is not None:
            return with_groups(self.snapshot.optimizer_states[optimizer.index], optimizer.local)
        return optimizer.state_dict()

    def save(
        self,
        checkpoint: dict[str, Any],
        filepath: Any,
        storage_options: Optional[Any],
        is_global_zero: bool,
        stats: Optional[Stats],
        write: Callable[[dict[str, Any], Any, Optional[Any]], None],
    ) -> None:
        """Adds the statistics to learner 0's checkpoint and writes it with ``write`` (the checkpoint IO's)."""
        stats = self.snapshot.stats if self.snapshot is not None else stats
        if is_global_zero and stats is not None:
            checkpoint["rudra"] = {"stats": stats.to_dict(), "protocol": self.protocol}
        self.snapshot = None
        if not is_global_zero or "://" in str(filepath):
            write(checkpoint, filepath, storage_options)  # writes nothing / a remote store's way
            return
        # A crash while writing must leave the previous checkpoint whole: write beside it, then rename over it.
        partial = f"{filepath}.partial"
        try:
            write(checkpoint, partial, storage_options)
            os.replace(partial, filepath)
        finally:
            if os.path.exists(partial):
                os.remove(partial)

    def loaded(self, checkpoint: Mapping[str, Any]) -> None:
        """On resume, learner 0 hands the server these optimizer states and statistics with the weights, before
        any learner pulls or pushes. A checkpoint of another protocol is warned of: a deliberate change goes on, but a
        run resumed with the default may not know that the default changed (it was 1-softsync in 0.1.0)."""
        saved = checkpoint.get("rudra", {}).get("protocol")
        if saved is not None and saved != self.protocol:
            rank_zero_warn(
                f"This checkpoint was written under {saved}, and the run resumes under {self.protocol}: the "
                "statistics (clock, staleness) go on from the saved ones. Pass the saved protocol and n to "
                "RudraStrategy to resume as it trained."
            )
        if "rudra" in checkpoint:
            self.resume_stats = Stats.from_dict(checkpoint["rudra"]["stats"])
        self.resume_optimizer_states = checkpoint.get("optimizer_states")

    def take_resumed(self) -> Resumed:
        """The resumed checkpoint's statistics and optimizer states, for this stage only."""
        resumed = Resumed(self.resume_stats, self.resume_optimizer_states)
        self.resume_stats = self.resume_optimizer_states = None
        return resumed


def load_groups(optimizers: list[Optimizer], checkpoint: Mapping[str, Any]) -> None:
    """The server has the states since setup; the learners take back their parameter groups' values (the learning
    rate their schedulers step from)."""
    for optimizer, state in zip(optimizers, checkpoint["optimizer_states"]):
        if isinstance(optimizer, LearnerOptimizer):  # not Lightning's placeholder for no optimizer
            optimizer.load_groups(state)


def keep_final_states(learner: Learner, optimizers: list[Any]) -> Stats:
    """Learner 0, once training has ended: the server's final optimizer states go into the learners' local
    optimizers, for ``trainer.save_checkpoint`` after ``fit`` (the server is gone by then). Returns the
    server's statistics."""
    states, stats = learner.snapshot()
    for optimizer, state in zip(optimizers, states):
        optimizer.local.load_state_dict(with_groups(state, optimizer.local))
    return stats
