"""A learner's view of the shared epoch: a torch batch sampler whose batches are the batches the server deals it.

No Lightning here: any DataLoader can take it as its ``batch_sampler``, so that every batch the DataLoader makes is
one batch drawn from the server (a partial last batch stays a batch of its own, also when a lost learner's batch is
dealt after it; the plan's ``drop_last`` decides whether there is one).
"""

from collections import deque
from typing import Any, Callable, Iterator, Optional

from torch.utils.data import Sampler

from lightning_rudra.learner.client import LearnerClient
from lightning_rudra.core.epoch import EpochPlan

# Batches a learner asks for at once while the epoch is far from its end: one RPC costs about as much to send as
# a small model's push, and the server hands out one batch at a time near the epoch's end anyway.
BATCHES_PER_DRAW = 4


class SharedEpochSampler(Sampler[list[int]]):
    """Yields, one list per batch, the indices of the batches that the server hands this learner from train
    dataloader ``pool`` in the current epoch (:meth:`set_epoch`), until the epoch is drained.

    ``positions`` holds, in order, the place in the epoch of every batch drawn and not yet taken by
    :meth:`next_position` (batches are drawn a little ahead of being trained on: DataLoader and Lightning
    prefetch). ``on_spent`` is called once the run's ``budget`` of batches is spent, ``on_again`` for each batch
    dealt again (a lost learner's), which makes the epoch one batch longer. Once ``sized`` is False
    the sampler has no length: a learner cannot know how many batches it will get, and whoever iterates must
    find the end by prefetching (Lightning's data fetcher does, and so knows which batch is the last).
    ``num_learners`` (λ) gives the length its meaning until then: one learner's share of the epoch.
    ``trained``, set by whoever trains, counts the batches this learner has trained on over the run (their
    gradients pushed), told to the server with every draw, which deals the others again if the learner is lost.
    ``late`` collects, for the next draw, the places (counted like ``trained``) of the batches whose gradient came
    after its round closed (batchsync, backup): the server deals them again.
    """

    def __init__(self, client: LearnerClient, pool: int, plan: EpochPlan, num_learners: int = 1) -> None:
        self.client = client
        self.sampler = self  # where Lightning sets the epoch of a batch sampler (``batch_sampler.sampler``)
        self.pool = pool
        self.plan = plan
        self.num_learners = num_learners
        self.epoch: Optional[int] = None
        self.positions: deque[int] = deque()
        self.on_spent: Optional[Callable[[], None]] = None
        self.on_again: Optional[Callable[[], None]] = None
        self.sized = True
        self.want = BATCHES_PER_DRAW  # batches to ask for at once
        self.ended: Optional[str] = None  # why the last iteration ended: "epoch" (drained) or "budget"
        self.trained: Optional[int] = None
        self.late: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch = epoch
            self.ended = None
            self.positions.clear()

    def __len__(self) -> int:
        """Batches in one learner's share of the epoch (1/λ of them, as DDP's part): what Lightning counts per
        learner before training starts (``limit_train_batches``, ``estimated_stepping_batches``)."""
        if not self.sized:
            raise TypeError("a learner's share of the shared epoch is not known in advance")
        return -(-self.plan.num_batches // self.num_learners)

    def __iter__(self) -> Iterator[list[int]]:
        if self.epoch is None:
            return  # Lightning makes and drops one iterator before the first epoch: it must take nothing
        epoch, size = self.epoch, self.plan.batch_size
        asked = self._draw(epoch)
        while True:
            indices, position, what = self.client.result(asked)
            if indices is None:
                self.ended = what
                if what == "budget" and self.on_spent is not None:
                    self.on_spent()
                return
            if what == "again" and self.on_again is not None:
                self.on_again()
            batches = indices.split(size)
            for i, batch in enumerate(batches):
                if i == len(batches) - 1:  # ask for more now, so that the answer comes while this one trains
                    asked = self._draw(epoch)
                self.positions.append(position + i)
                yield batch.tolist()

    def _draw(self, epoch: int) -> Any:
        late, self.late = tuple(self.late), []
        return self.client.draw(self.pool, epoch, self.plan, self.want, self.trained, late)

    def next_position(self) -> int:
        """The place in the epoch of the oldest batch drawn and not yet trained on."""
        return self.positions.popleft()
