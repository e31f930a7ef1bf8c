"""The parameter server's shared memory on its host (:mod:`lightning_rudra.transport.shm`): the weights and every
learner's gradient buffers in ``/dev/shm``, which learners mapped them, where a push's gradient is, and what a reply
carries (nothing but the clock for learners that read the weights themselves). Its methods run under the
:class:`~lightning_rudra.server.parameter_server.ParameterServer`'s lock."""

import socket
from typing import Any, Optional

from lightning_rudra.core.protocol import Server
from lightning_rudra.core.registration import Registration
from lightning_rudra.core.weights import Weights
from lightning_rudra.transport.shm import SharedNames, SharedWeights


class SharedSide:
    def __init__(self, num_learners: int) -> None:
        self.num_learners = num_learners
        self.weights: Optional[SharedWeights] = None
        self.names: Optional[SharedNames] = None
        self.grads: dict[tuple[int, int], list[Any]] = {}  # (learner, optimizer) -> its gradient buffers
        self.error: Optional[str] = None  # why shared memory could not be set up
        self.mapped: set[int] = set()  # learners that read and write the shared memory
        self.answered: set[int] = set()  # learners that said whether they could map it

    def server(self, registration: Registration) -> Optional[Server]:
        """A :class:`Server` of the ``registration``'s model whose weights live in shared memory; None if it cannot
        be allocated (:attr:`error` says why, and the learners are told)."""
        try:
            shared = SharedWeights(socket.gethostname())  # allocation failures unlink what was made and raise
        except OSError as error:
            self.error = str(error)
            return None
        try:
            r = registration
            core = Server(r.config, r.params, r.buffers, r.specs, r.stats, shared)
            self.grads = shared.allocate_grads(self.num_learners, core.grad_layouts)
        except OSError as error:
            shared.unlink()
            self.error = str(error)
            return None
        except BaseException:  # bad input (the server raises it to learner 0): no file stays in /dev/shm
            shared.unlink()
            raise
        self.names = shared.names(core.flat_params, core.flat_buffers, self.grads)
        self.weights = shared
        return core

    def offer(self) -> tuple[Optional[SharedNames], Optional[str]]:
        """What a learner is told to map (None without shared memory), and why there is none, if it failed. Once
        every learner mapped it the files are gone: a learner that rejoins later uses RPC."""
        return (None if self.weights is not None and self.weights.unlinked else self.names), self.error

    def attached(self, learner: int, mapped: bool, members: set[int]) -> None:
        """Once every learner has answered, the files go: nothing is left in /dev/shm even if a process is killed
        later, and the mappings stay valid."""
        if mapped:
            self.mapped.add(learner)
        self.answered.add(learner)
        if self.answered >= members:
            self.release()

    def lose(self, learner: int, members: set[int]) -> None:
        """``learner`` is lost: a process that rejoins for it has not mapped the shared memory, and once every
        learner left has answered, nobody is awaited to map the files: they go."""
        self.mapped.discard(learner)
        if self.answered >= members:
            self.release()

    def gradient(self, learner: int, optimizer: int, core: Server) -> list[Any]:
        """The gradient ``learner`` pushed through its buffer."""
        if learner not in self.mapped or (learner, optimizer) not in self.grads:
            raise ValueError(
                f"learner {learner} pushed its gradient for optimizer {optimizer} through shared "
                "memory, but it has not mapped the server's shared memory."
            )
        grads = self.grads[(learner, optimizer)]
        if core.config.protocol in ("softsync", "batchsync") and core.gradients_per_update > 1:
            # it waits for the next update, and its learner may push again before (its reply comes at once)
            return [g.clone() for g in grads]
        return grads  # applied before the learner gets its reply, and so before it writes the buffer again

    def reply(self, learners: list[int], core: Server) -> Weights:
        """What to send back with a reply: nothing but the clock if every learner reads shared memory."""
        if set(learners) <= self.mapped:
            return Weights(None, None, core.clock)
        return Weights(*core.pull())

    def release(self) -> None:
        if self.weights is not None and not self.weights.unlinked:
            self.weights.unlink()
