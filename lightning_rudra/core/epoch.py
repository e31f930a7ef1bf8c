"""The shared epoch: one pool of batches per epoch, dealt to whichever learner asks next. Plain torch.

With an equal, fixed shard per learner (Lightning's DistributedSampler) an epoch lasts as long as the slowest
learner needs for its shard, whatever the protocol. Here the server owns each epoch's order instead, and a
learner that is done with a batch takes the next one: a fast learner takes more batches, and all learners
run out within about one batch of each other. The order is the one DistributedSampler would shuffle over all
learners together (a permutation seeded by ``seed + epoch``), so it is reproducible from the seed.

Nothing is lost with a learner: the pool keeps, per learner, the batches dealt to it that it has not said it
trained on (a learner counts its trained batches in every draw: it trains them in the order dealt), and deals
those of a lost learner again, to whoever asks next, before any new one. Nor with a late gradient (batchsync,
backup: :mod:`lightning_rudra.core.rounds`): the learner names its batches in its next draw, by their place among
the batches dealt to it over the run, and they are dealt again the same way.
"""

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
from torch import Tensor


@dataclass(frozen=True)
class EpochPlan:
    """How one train dataloader's epoch is ordered and cut into batches. Every learner sends the same plan.

    ``max_batches`` caps the batches of an epoch (all learners together; ``limit_train_batches``);
    ``budget`` caps the batches drawn over the whole run (``max_steps``); ``resumed``: batches trained before
    the checkpoint this run resumes from, whose epoch goes on after them (epoch e opens at its batch
    ``resumed`` − e·P, P its batches, where that lies within it).
    """

    num_samples: int
    batch_size: int
    shuffle: bool = True
    seed: int = 0
    drop_last: bool = False
    max_batches: Optional[int] = None
    budget: Optional[int] = None
    resumed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_samples", "batch_size", "resumed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "batch_size" else 0):
                raise ValueError(
                    f"EpochPlan {name}={value!r} is not valid: expected an integer >= "
                    f"{1 if name == 'batch_size' else 0}."
                )
        for name in ("max_batches", "budget"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"EpochPlan {name}={value!r} is not valid: expected None or an integer >= 0.")

    @property
    def num_batches(self) -> int:
        """Batches in one epoch, all learners together."""
        full, rest = divmod(self.num_samples, self.batch_size)
        batches = full + (1 if rest and not self.drop_last else 0)
        return batches if self.max_batches is None else min(batches, self.max_batches)

    def resumed_at(self, epoch: int) -> int:
        """The batch ``epoch`` opens at: 0, or in the epoch a resumed run's checkpoint fell in, the first one after
        those trained before it."""
        return min(self.num_batches, max(0, self.resumed - epoch * self.num_batches))

    def order(self, epoch: int) -> Tensor:
        """The epoch's sample order: DistributedSampler's, before it splits it between learners."""
        if not self.shuffle:
            return torch.arange(self.num_samples)
        return torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed + epoch))


@dataclass
class _Epoch:
    order: Tensor
    cursor: int = 0  # batches handed out so far


@dataclass
class _Dealt:
    """One batch dealt: the epoch and place it was dealt at, and its sample indices."""

    epoch: int
    position: int
    indices: Tensor
    late_from: Optional[int] = None  # the learner whose gradient of it came late: dealt again to another first
    returned: bool = False  # dealt again to the learner it came late from once already


@dataclass
class _Learner:
    # dealt and not yet said trained on, in the order dealt; None: dealt again since (its gradient was late)
    dealt: deque[Optional[_Dealt]] = field(default_factory=deque)
    acknowledged: int = 0  # batches it said it trained on over the run


class EpochPool:
    """The server's side of one train dataloader: per epoch, the next batch for whoever asks.

    An epoch opens when the first learner asks for it. Only the newest two epochs are kept: a learner still
    asking for an older one is told it is over (the others have already drained it).
    """

    def __init__(self, plan: EpochPlan, num_learners: int = 1) -> None:
        self.plan = plan
        self.num_learners = num_learners
        self.epochs: dict[int, _Epoch] = {}
        self.newest = -1
        self.drawn = 0  # batches handed out over the run, for ``budget``
        self.stopped = False  # a learner stopped training (:meth:`stop`): the budget counts as spent
        self.taken: dict[int, int] = {}  # learner -> batches taken over the run
        self.learners: dict[int, _Learner] = {}
        self.redeal: deque[_Dealt] = deque()  # a lost learner's batches, to be dealt again first
        self.redealt = 0  # batches dealt again over the run

    def draw(  # 7 params: the learner's request, as it sends it, and whether the others are all away
        self,
        epoch: int,
        learner: int,
        plan: EpochPlan,
        want: int = 1,
        trained: Optional[int] = None,
        late: Sequence[int] = (),
        alone: bool = False,
    ) -> tuple[Optional[Tensor], int, str]:
        """The next batches of ``epoch`` for ``learner``: ``(indices, position, "batch")``, the indices of
        consecutive batches from ``position`` (the epoch's batches count from 0); or ``(None, batches in the
        epoch, why)`` when there is none left, ``why`` being ``"epoch"`` (the epoch is drained) or ``"budget"``
        (the run's ``budget`` is spent).

        Up to ``want`` batches, which saves requests, but only while the epoch holds many more than the learners
        can take at once: towards its end every learner gets one batch at a time, so all of them run out within
        about one batch of each other.

        ``trained``: the batches ``learner`` has trained on over the run (pushed their gradients), which it need not
        be given again if it is lost. A lost learner's other batches come first, one at a time, at their own place
        if they belong to ``epoch``; one from an earlier epoch (the others had drained it when the loss was seen)
        is trained in this one, at the place this epoch has reached. Such a batch comes as ``(indices, position,
        "again")``: the learner may get more batches in this epoch than the epoch has.

        ``late``: batches whose gradient was not applied (it came after its round closed), each by its place among
        the batches dealt to ``learner`` over the run (from 0); they are dealt again as a lost learner's are. Only
        batches it holds and has not said it trained on before this draw (``trained`` may now count them). Its own
        late batch comes back to it once its epoch is drained, once (the others may still train on: they take it);
        again if it is ``alone`` (every other learner waits at a collective or is done: nobody else's push can make
        its gradient late, and nobody else would take the batch in this epoch)."""
        if plan != self.plan:
            raise ValueError(
                f"learner {learner} describes this dataloader's epoch as {plan}, but the server holds "
                f"{self.plan}: every learner must build the same train dataloader (same dataset "
                "size, batch size, shuffle, seed, drop_last and limits)."
            )
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch {epoch!r} from learner {learner} is not valid: expected an integer >= 0.")
        if epoch > self.newest:
            self.epochs = {e: state for e, state in self.epochs.items() if e >= epoch - 1}
            self.epochs[epoch] = _Epoch(self.plan.order(epoch), self.plan.resumed_at(epoch))
            self.newest = epoch
        state = self.epochs.get(epoch)
        total = self.plan.num_batches
        own = self.learners.setdefault(learner, _Learner())
        self._give_back(own, learner, late)
        if trained is not None:
            while own.acknowledged < trained and own.dealt:
                own.dealt.popleft()
                own.acknowledged += 1
        if self.stopped:
            return None, total, "budget"
        spent = self.plan.budget is not None and self.drawn >= self.plan.budget
        drained = spent or state is None or state.cursor >= total
        batch = self._dealt_again(learner, epoch, drained, alone)
        if batch is not None:  # dealt again: they count once in the budget
            self.redealt += 1
            position = batch.position if batch.epoch == epoch else min(state.cursor, total - 1) if state else 0
            indices = batch.indices.clone()  # a view of the draw it came in: RPC would send that draw's storage
            again = _Dealt(epoch, position, indices, returned=batch.late_from == learner)
            return self._deal(own, learner, [again], indices, "again")
        if spent:
            return None, total, "budget"
        if state is None or state.cursor >= total:
            return None, total, "epoch"
        position = state.cursor
        count = max(1, min(want, (total - position) // (4 * self.num_learners)))
        if self.plan.budget is not None:
            count = min(count, self.plan.budget - self.drawn)
        size = self.plan.batch_size
        indices = state.order[position * size : (position + count) * size].clone()
        batches = [_Dealt(epoch, position + i, part) for i, part in enumerate(indices.split(size))]
        state.cursor += count
        self.drawn += count
        return self._deal(own, learner, batches, indices, "batch")

    def _deal(
        self, own: _Learner, learner: int, batches: list[_Dealt], indices: Tensor, what: str
    ) -> tuple[Tensor, int, str]:
        own.dealt.extend(batches)
        self.taken[learner] = self.taken.get(learner, 0) + len(batches)
        return indices, batches[0].position, what

    def _dealt_again(self, learner: int, epoch: int, drained: bool, alone: bool) -> Optional[_Dealt]:
        """The next batch to deal ``learner`` again, taken out of the queue: a lost learner's, or one whose gradient
        came late from another learner; its own late batch as :meth:`draw` says (a straggler whose gradient of it
        comes late again while the others train on leaves it to them, rather than train it again and again)."""
        for i, batch in enumerate(self.redeal):
            mine = drained and batch.epoch == epoch and (alone or not batch.returned)
            if batch.epoch <= epoch and (batch.late_from != learner or mine):
                del self.redeal[i]  # by place: a batch's tensor has no truth value to compare by
                return batch
        return None

    def _give_back(self, own: _Learner, learner: int, late: Sequence[int]) -> None:
        """``late`` (see :meth:`draw`): to be dealt again."""
        if isinstance(late, (str, bytes)) or not isinstance(late, Sequence):
            raise ValueError(f"late={late!r} from learner {learner} is not valid: expected a list of batch places.")
        for place in late:
            index = place - own.acknowledged if is_place(place) else -1
            if not 0 <= index < len(own.dealt) or own.dealt[index] is None:
                held = f"{own.acknowledged} to {own.acknowledged + len(own.dealt) - 1}" if own.dealt else "none"
                raise ValueError(
                    f"learner {learner} says the gradient of its batch {place!r} came late, but it holds no such "
                    f"batch not yet trained on (it holds its batches {held}): expected the place, counted from 0 over "
                    "the run, of a batch dealt to it whose gradient it pushed after its last draw."
                )
            batch = own.dealt[index]
            assert batch is not None
            batch.late_from = learner
            self.redeal.append(batch)
            own.dealt[index] = None

    def lose(self, learner: int) -> int:
        """``learner`` is lost: the batches dealt to it and not trained on are dealt again. Returns how many."""
        own = self.learners.pop(learner, None)
        if own is None:
            return 0
        batches = [batch for batch in own.dealt if batch is not None]
        self.redeal.extend(batches)
        return len(batches)

    def stop(self) -> None:
        """No more batches for anyone: a learner decided on its own to stop training (``max_time``'s Timer, a
        callback setting ``trainer.should_stop`` during a batch). Every other learner then stops at its next draw,
        as when ``max_steps`` is spent, so that all of them end training at the same place."""
        self.stopped = True


def is_place(value: Any) -> bool:
    """An int >= 0 that is no bool."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
