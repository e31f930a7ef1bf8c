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


def deadlock(at_collective: int, in_round: int) -> str:
    """Why hardsync cannot go on when a learner waits at a collective while another waits in a round."""
    return (
        f"learner {at_collective} waits for the others at a collective (validation, a value logged with "
        f"sync_dist, a checkpoint, the end of an epoch) while learner {in_round} waits in a hardsync round for "
        "its gradient, so neither can go on. Under hardsync every learner must train on the same number of "
        "batches per epoch, and theirs differ: an IterableDataset, or a sampler of your own, that yields a "
        "different number of batches on each learner? Make every learner's stream yield the same number of "
        "batches, or use protocol='softsync' or 'async', whose learners do not wait for each other."
    )
