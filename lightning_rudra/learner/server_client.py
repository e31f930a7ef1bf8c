"""What a :class:`~lightning_rudra.learner.learner.Learner` needs of its parameter server: the client it drives.

Two classes are one: :class:`~lightning_rudra.learner.client.LearnerClient` (a server process, over RPC) and
:class:`~lightning_rudra.learner.simulation.SimulatedClient` (an in-process server for λ simulated learners).

Words follow the paper (Gupta, Zhang, Wang, ICDM 2016): a learner pulls the weights, computes a gradient on a
mini-batch from weights with timestamp ``j`` and pushes it; the server's clock ``i`` counts weight updates; a
gradient applied at clock ``i`` has staleness σ = i - j.
"""

from typing import Any, Optional, Protocol

from torch import Tensor
from torch.futures import Future

from lightning_rudra.core.registration import Registration
from lightning_rudra.core.update import Push, PushReply
from lightning_rudra.core.weights import Snapshot


class ServerClient(Protocol):
    """One learner's calls to one parameter server (with several servers, a client each, for its part of the
    weights). Weights travel flat, laid out as the server keeps them (a list of parameters and one of buffers)."""

    timestamp: int
    """The timestamp ``j`` of the weights the learner last received from this server: the server's clock when
    they were made, and what the learner's next gradient is stamped with."""

    @property
    def rank(self) -> int:
        """The learner this client speaks for (learner 0 registers the model and restores checkpoints)."""
        ...

    def register(self, registration: Registration) -> None:
        """Learner 0 only: the server's starting weights and the optimizers it rebuilds to apply the updates (on
        resume, with their saved states and the statistics), and what a learner that rejoins must match.

        Args:
            registration: this server's part of the model.
        """
        ...

    def attached(self, mapped: bool) -> None:
        """Tell the server whether this learner mapped its shared memory (weights and gradients then skip RPC)."""
        ...

    def pull(self) -> tuple[list[Tensor], list[Tensor]]:
        """Pull: the server's newest weights, whose timestamp ``j`` is its clock now."""
        ...

    def push(self, push: Push) -> Future:
        """Push a gradient (:class:`~lightning_rudra.core.update.Push`: of which optimizer, computed from the weights
        of which timestamp, with the learner's hyper-parameters and buffers, what the server checks and how it clips
        the update's gradient); ``push.grads=None``: it is in the server's shared memory. Hand the future to
        :meth:`receive`.

        Args:
            push: the learner's gradient for this server.

        Returns:
            the future of the server's :class:`PushReply`.
        """
        ...

    def weights_as_deltas(self, compression: str) -> None:
        """The weights that come back with a push travel as differences from those the learner holds, in the wire
        dtype of ``compression`` (:class:`~lightning_rudra.core.compression.WeightDeltas`)."""
        ...

    def receive(self, pushed: Future) -> PushReply:
        """The reply to a push: whether its gradient was applied, its staleness σ (clock at application minus the
        timestamp it was pushed with), and the weights to go on from with their timestamp, the new ``timestamp``."""
        ...

    def finish(self) -> Future:
        """This learner stops pushing; hand the future to :meth:`final_weights`."""
        ...

    def final_weights(self, finished: Future) -> tuple[Optional[list[Tensor]], Optional[list[Tensor]]]:
        """Once every learner has stopped (pending gradients applied): the final weights (None: in shared
        memory)."""
        ...

    def snapshot(self) -> Snapshot:
        """Weights, buffers, clock, optimizer states and statistics, all of one clock (a checkpoint's); the learner
        loads these weights: their clock is the new ``timestamp``."""
        ...

    def optimizer_state(self, optimizer: int) -> dict[str, Any]:
        """The server's state of ``optimizer`` (momentum, moments...), which the learners' optimizers do not hold."""
        ...

    def load_optimizer_state(self, optimizer: int, state: dict[str, Any]) -> None:
        """Restore the server's state of ``optimizer`` (from a checkpoint)."""
        ...
