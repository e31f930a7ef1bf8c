"""The learners' rendezvous for the strategy's collectives (barrier, broadcast, reduce, all_gather, metric syncs):
the ``sequence``-th collective of every learner meets here as one gather. Its methods run under the
:class:`~lightning_rudra.server.parameter_server.ParameterServer`'s lock; the futures they return are settled
after it is released."""

from typing import Any

from torch.futures import Future


class Gatherings:
    def __init__(self) -> None:
        self.open: dict[int, tuple[Future, dict[int, Any]]] = {}  # sequence -> (reply, learner -> object)

    def add(self, sequence: int, learner: int, obj: Any) -> Future:
        future, objs = self.open.setdefault(sequence, (Future(), {}))
        objs[learner] = obj
        return future

    def complete(self, members: set[int]) -> list[tuple[Future, Any]]:
        """The gatherings every member has reached: each resolves with the members' objects (learner -> object, in
        rank order)."""
        done = [sequence for sequence, (_, objs) in self.open.items() if members <= set(objs)]
        outcomes = []
        for sequence in done:
            future, objs = self.open.pop(sequence)
            outcomes.append((future, {learner: objs[learner] for learner in sorted(objs) if learner in members}))
        return outcomes

    def waiting(self) -> set[int]:
        """The learners waiting at a collective."""
        return {learner for _, objs in self.open.values() for learner in objs}

    def close(self) -> list[Future]:
        """Training cannot go on: the replies still waiting, to fail."""
        futures = [future for future, _ in self.open.values()]
        self.open = {}
        return futures
