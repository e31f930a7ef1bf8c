"""A learner's shared-epoch sampler in a real DataLoader, in-process: the server's pool (a real ``EpochPool``) behind a
scripted client. Each batch the DataLoader makes is one batch the pool dealt, also when a partial last batch is
followed by a lost learner's batch dealt again."""

from typing import Any, Optional, Sequence

import pytest
from torch.utils.data import DataLoader

from lightning_rudra.core.epoch import EpochPlan, EpochPool
from lightning_rudra.learner.sampler import SharedEpochSampler


class PoolClient:
    """Draws straight from ``pool`` as learner ``rank``; once the epoch's last batch is dealt, learner ``lost`` is
    lost (its untrained batches are dealt again)."""

    def __init__(self, pool: EpochPool, rank: int, lost: int) -> None:
        self.pool, self.rank, self.lost = pool, rank, lost
        self.dealt: list[list[int]] = []
        self.late: list[list[int]] = []  # what each draw said came late

    def draw(
        self, pool: int, epoch: int, plan: EpochPlan, want: int, trained: Optional[int] = None, late: Sequence[int] = ()
    ) -> Any:
        self.late.append(list(late))
        indices, position, what = self.pool.draw(epoch, self.rank, plan, want, trained, late)
        if indices is not None:
            self.dealt += [batch.tolist() for batch in indices.split(plan.batch_size)]
            if position + len(indices.split(plan.batch_size)) == plan.num_batches:
                self.pool.lose(self.lost)
        return indices, position, what

    def result(self, asked: Any) -> Any:
        return asked


@pytest.mark.parametrize("drop_last", [False, True])
def test_every_batch_is_a_dealt_batch_when_a_partial_last_batch_is_followed_by_one_dealt_again(drop_last):
    plan = EpochPlan(20, 8, shuffle=False, drop_last=drop_last)  # 8 + 8 + 4 samples, or 8 + 8
    pool = EpochPool(plan, num_learners=2)
    assert pool.draw(0, 1, plan, want=1)[1] == 0  # learner 1 holds batch 0 and is lost before it trains it
    client = PoolClient(pool, rank=0, lost=1)
    sampler = SharedEpochSampler(client, 0, plan, num_learners=2)  # type: ignore[arg-type]
    loader = DataLoader(list(range(20)), batch_sampler=sampler)
    sampler.set_epoch(0)
    batches = [batch.tolist() for batch in loader]
    assert client.dealt[-1] == list(range(8)), "learner 1's batch 0 was dealt again to learner 0"
    assert batches == client.dealt, "every batch the DataLoader makes is one batch the server dealt"
    expected = [list(range(8, 16))] + ([] if drop_last else [list(range(16, 20))]) + [list(range(8))]
    assert batches == expected
    seen = sorted(i for batch in batches for i in batch)
    assert seen == list(range(16 if drop_last else 20)), "every sample once in the epoch"
    assert list(sampler.positions) == [1] + ([] if drop_last else [2]) + [0]


def test_late_places_go_with_the_next_draw_once_and_their_batch_is_dealt_again():
    pool = EpochPool(EpochPlan(32, 4, shuffle=False), num_learners=2)
    client = PoolClient(pool, rank=0, lost=1)
    sampler = SharedEpochSampler(client, 0, pool.plan, num_learners=2)  # type: ignore[arg-type]
    sampler.want = 1
    sampler.set_epoch(0)
    batches = iter(sampler)
    assert next(batches) == [0, 1, 2, 3]  # its place 0; the next draw already went, with nothing late
    sampler.trained, sampler.late = 1, [0]  # place 0's gradient came late
    assert next(batches) == [4, 5, 6, 7]
    next(batches)
    assert client.late[:3] == [[], [], [0]] and sampler.late == []
    assert [b.indices.tolist() for b in pool.redeal] == [[0, 1, 2, 3]]  # for the next learner that asks
