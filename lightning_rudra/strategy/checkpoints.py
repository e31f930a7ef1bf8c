"""Checkpoints of a strategy whose optimizer state lives on the parameter server.

Learner 0 writes them; it takes the server's weights, optimizer states and statistics in one snapshot, all of
one clock, and writes it beside the previous checkpoint before renaming it over it (a crash while writing leaves
the previous one whole). On resume, learner 0 hands the server the saved states with the weights before any
learner pulls or pushes, and every learner takes back its parameter groups (the rate its LR scheduler steps from).
"""

import os
from typing import Any, Mapping, Optional

from torch.optim import Optimizer

from lightning_rudra.learner.learner import Learner, LearnerOptimizer, with_groups
from lightning_rudra.core.stats import Stats


class ServerCheckpoints:
    """Mixed into :class:`~lightning_rudra.RudraStrategy`: its checkpoint hooks."""

    _learner: Optional[Learner]
    _checkpoint: Optional[tuple[list[dict[str, Any]], Stats]]  # learner 0: the server's snapshot
    _resume_stats: Optional[Stats]
    _resume_optimizer_states: Optional[list[dict[str, Any]]]
    stats: Optional[Stats]
    is_global_zero: bool
    optimizers: list[Optimizer]

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Learner 0 (which writes checkpoints) takes the server's weights, optimizer states and statistics in
        one snapshot, all of one clock; the other learners' copies are not written and stay as they are."""
        self._checkpoint = None
        if self.is_global_zero and self._learner is not None:
            self._checkpoint = self._learner.snapshot()
        return super().lightning_module_state_dict()

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if not self.is_global_zero:
            return {}  # only learner 0's checkpoint is written: nothing to fetch from the server
        if isinstance(optimizer, LearnerOptimizer):
            if self._checkpoint is not None:
                return with_groups(self._checkpoint[0][optimizer.index], optimizer.local)
            return optimizer.state_dict()
        return super().optimizer_state(optimizer)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Optional[Any] = None) -> None:
        stats = self._checkpoint[1] if self._checkpoint is not None else self.stats
        if self.is_global_zero and stats is not None:
            checkpoint["rudra"] = {"stats": stats.to_dict()}
        self._checkpoint = None
        if not self.is_global_zero or "://" in str(filepath):
            super().save_checkpoint(checkpoint, filepath, storage_options)  # writes nothing / a remote store's way
            return
        # A crash while writing must leave the previous checkpoint whole: write beside it, then rename over it.
        partial = f"{filepath}.partial"
        try:
            super().save_checkpoint(checkpoint, partial, storage_options)
            os.replace(partial, filepath)
        finally:
            if os.path.exists(partial):
                os.remove(partial)

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """On resume, learner 0 hands the server the optimizer states and statistics with the weights, before
        any learner pulls or pushes (:meth:`setup`)."""
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        if "rudra" in checkpoint:
            self._resume_stats = Stats.from_dict(checkpoint["rudra"]["stats"])
        self._resume_optimizer_states = checkpoint.get("optimizer_states")
        return checkpoint

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """The server has the states since setup; the learners take back their parameter groups' values (the
        learning rate their schedulers step from)."""
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            if isinstance(optimizer, LearnerOptimizer):  # not Lightning's placeholder for no optimizer
                optimizer.load_groups(state)
