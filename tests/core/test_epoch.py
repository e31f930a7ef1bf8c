"""The shared epoch's pool, in-process: which batches go to whom, in which order, and when an epoch ends."""

import pytest
import torch
from torch.utils.data import DistributedSampler

from lightning_rudra.core.epoch import EpochPlan, EpochPool


def drain(pool: EpochPool, plan: EpochPlan, epoch: int, learners: list[int]) -> dict[int, list[list[int]]]:
    """Learners ask in the order given (cycled) until the epoch is drained; returns each one's batches."""
    taken: dict[int, list[list[int]]] = {learner: [] for learner in set(learners)}
    for turn in range(10_000):
        learner = learners[turn % len(learners)]
        indices, position, what = pool.draw(epoch, learner, plan)
        if indices is None:
            assert what == "epoch"
            return taken
        assert position == sum(len(batches) for batches in taken.values())
        taken[learner].append(indices.tolist())
    raise AssertionError("the epoch never ended")


@pytest.mark.parametrize("num_samples, batch_size, drop_last", [(100, 8, False), (100, 8, True), (96, 8, False)])
def test_every_sample_once_per_epoch_whoever_asks(num_samples, batch_size, drop_last):
    plan = EpochPlan(num_samples, batch_size, shuffle=True, seed=3, drop_last=drop_last)
    pool = EpochPool(plan)
    for epoch in range(3):
        asks = [0, 1, 0, 2, 0][epoch:] + [0, 1, 0, 2, 0][:epoch]  # learner 0 asks three times as often
        taken = drain(pool, plan, epoch, asks)
        seen = [i for batches in taken.values() for batch in batches for i in batch]
        expected = num_samples - (num_samples % batch_size if drop_last else 0)
        assert len(seen) == len(set(seen)) == expected
        assert sum(len(batches) for batches in taken.values()) == plan.num_batches
        assert len(taken[0]) > len(taken[1]) and len(taken[0]) > len(taken[2])
        assert all(len(batch) == batch_size for batches in taken.values() for batch in batches[:-1])


def test_the_order_is_distributed_samplers_over_all_learners_and_reproducible():
    dataset = list(range(50))
    plan = EpochPlan(len(dataset), 5, shuffle=True, seed=7)
    first, second = EpochPool(plan), EpochPool(plan)
    for epoch in range(2):
        sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=7)
        sampler.set_epoch(epoch)
        in_order = [i for learner in (0, 1) for i in first.draw(epoch, learner, plan)[0].tolist()]
        in_order += [i for _ in range(8) for i in first.draw(epoch, 0, plan)[0].tolist()]
        assert in_order == list(sampler)
        again = [i for _ in range(10) for i in second.draw(epoch, 1, plan)[0].tolist()]
        assert again == in_order
    assert EpochPlan(10, 5, shuffle=False).order(4).tolist() == list(range(10))


def test_limits_per_epoch_and_a_budget_over_the_run():
    plan = EpochPlan(100, 10, shuffle=False, max_batches=4, budget=6)
    pool = EpochPool(plan)
    assert [pool.draw(0, 0, plan)[1] for _ in range(4)] == [0, 1, 2, 3]
    assert pool.draw(0, 1, plan)[::2] == (None, "epoch")
    assert pool.draw(1, 1, plan)[1:] == (0, "batch") and pool.draw(1, 0, plan)[1:] == (1, "batch")
    assert pool.draw(1, 0, plan)[::2] == (None, "budget")
    assert pool.taken == {0: 5, 1: 1}


def test_a_resumed_run_goes_on_in_its_epoch_after_the_batches_trained_before():
    plan = EpochPlan(100, 10, shuffle=False, max_batches=4, resumed=6)  # 4 per epoch: 2 of epoch 1 were trained
    pool = EpochPool(plan)
    assert [plan.resumed_at(epoch) for epoch in range(3)] == [4, 2, 0]
    assert pool.draw(1, 0, plan)[1:] == (2, "batch") and pool.draw(1, 1, plan)[1:] == (3, "batch")
    assert pool.draw(1, 0, plan)[::2] == (None, "epoch")
    assert pool.draw(2, 1, plan)[1:] == (0, "batch")


def test_a_stopped_pool_gives_no_batch_to_anyone():
    plan = EpochPlan(100, 10)
    pool = EpochPool(plan, num_learners=2)
    assert pool.draw(0, 0, plan)[2] == "batch"
    pool.stop()  # learner 0's Timer stopped it: learner 1 stops at its next draw, in this epoch or the next
    assert pool.draw(0, 1, plan)[::2] == (None, "budget") and pool.draw(1, 1, plan)[::2] == (None, "budget")


def test_an_old_epoch_is_over_once_two_newer_ones_have_opened():
    plan = EpochPlan(40, 10)
    pool = EpochPool(plan)
    pool.draw(0, 0, plan)
    pool.draw(1, 0, plan)
    assert pool.draw(0, 1, plan)[2] == "batch"  # the previous epoch is still open for a slow learner
    pool.draw(2, 0, plan)
    assert pool.draw(0, 1, plan)[::2] == (None, "epoch")


def test_a_learner_with_another_plan_is_refused_and_changes_nothing():
    plan = EpochPlan(40, 10)
    pool = EpochPool(plan)
    pool.draw(0, 0, plan)
    with pytest.raises(
        ValueError,
        match=r"learner 1 describes this dataloader's epoch as .*batch_size=8.*"
        r"every learner must build the same train dataloader",
    ):
        pool.draw(0, 1, EpochPlan(40, 8))
    with pytest.raises(ValueError, match="epoch -1 from learner 1 is not valid"):
        pool.draw(-1, 1, plan)
    assert pool.draw(0, 1, plan)[1] == 1


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_samples=-1, batch_size=4), "num_samples=-1 is not valid: expected an integer >= 0"),
        (dict(num_samples=10, batch_size=0), "batch_size=0 is not valid: expected an integer >= 1"),
        (dict(num_samples=10, batch_size=2, max_batches=-2), "max_batches=-2 is not valid"),
        (dict(num_samples=10, batch_size=2, budget=1.5), "budget=1.5 is not valid"),
        (dict(num_samples=10, batch_size=2, resumed=-3), "resumed=-3 is not valid: expected an integer >= 0"),
    ],
)
def test_bad_plans_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EpochPlan(**kwargs)


def test_number_of_batches():
    assert EpochPlan(100, 8).num_batches == 13
    assert EpochPlan(100, 8, drop_last=True).num_batches == 12
    assert EpochPlan(100, 8, max_batches=5).num_batches == 5
    assert EpochPlan(0, 8).num_batches == 0
    assert torch.equal(EpochPlan(6, 2, seed=1).order(0), EpochPlan(6, 3, seed=1).order(0))


def test_several_batches_at_once_while_the_epoch_is_far_from_its_end():
    plan = EpochPlan(400, 4, shuffle=False)  # 100 batches
    pool = EpochPool(plan, num_learners=2)
    sizes = []
    while True:
        indices, position, what = pool.draw(0, len(sizes) % 2, plan, want=4)
        if indices is None:
            break
        assert indices.tolist() == list(range(position * 4, position * 4 + len(indices)))
        sizes.append(len(indices) // 4)
    assert sum(sizes) == 100 and sizes[0] == 4 and sizes[-8:] == [1] * 8  # one at a time at the end
    budget = EpochPlan(400, 4, budget=6)
    pool = EpochPool(budget, num_learners=1)
    assert len(pool.draw(0, 0, budget, want=4)[0]) == 16 and len(pool.draw(0, 0, budget, want=4)[0]) == 8
    assert pool.draw(0, 0, budget, want=4)[2] == "budget"


def test_a_lost_learners_untrained_batches_are_dealt_again_first_at_their_place():
    plan = EpochPlan(80, 8, shuffle=False)  # 10 batches: positions are indices // 8
    pool = EpochPool(plan, num_learners=2)
    assert pool.draw(0, 1, plan, want=1)[1] == 0 and pool.draw(0, 1, plan, want=1)[1] == 1
    assert pool.draw(0, 1, plan, want=1)[1] == 2
    assert pool.draw(0, 0, plan, want=1)[1] == 3
    assert pool.draw(0, 1, plan, want=1, trained=1)[1] == 4  # learner 1 trained batch 0: 1, 2 and 4 it holds
    assert pool.lose(1) == 3
    again = [pool.draw(0, 0, plan, want=1, trained=1) for _ in range(3)]
    assert [(position, what) for _, position, what in again] == [(1, "again"), (2, "again"), (4, "again")]
    assert [indices.tolist() for indices, _, _ in again] == [list(range(8 * p, 8 * p + 8)) for p in (1, 2, 4)]
    assert pool.draw(0, 0, plan, want=1)[1] == 5 and pool.redealt == 3
    rest = [pool.draw(0, 0, plan, want=1) for _ in range(5)]
    assert [position for _, position, _ in rest] == [6, 7, 8, 9, 10] and rest[-1][::2] == (None, "epoch")
    assert pool.taken == {0: 9, 1: 4}  # 10 batches and the 3 dealt again, none a third time


def test_batches_of_a_drained_epoch_are_dealt_again_in_the_next_and_count_once_in_the_budget():
    plan = EpochPlan(32, 8, shuffle=False, budget=8)  # 4 batches an epoch, 2 epochs
    pool = EpochPool(plan, num_learners=2)
    assert pool.draw(0, 1, plan, want=1)[1] == 0
    assert [pool.draw(0, 0, plan, want=1)[1] for _ in range(4)] == [1, 2, 3, 4]  # drained: 4 says "epoch"
    assert pool.draw(1, 0, plan, want=1, trained=3)[1:] == (0, "batch")
    pool.lose(1)
    indices, position, what = pool.draw(1, 0, plan, want=1, trained=4)
    assert (indices.tolist(), position, what) == (list(range(8)), 1, "again")  # at the place epoch 1 reached
    positions = [pool.draw(1, 0, plan, want=1)[1] for _ in range(3)]
    assert positions == [1, 2, 3] and pool.draw(1, 0, plan)[::2] == (None, "budget")
    assert pool.taken == {0: 8, 1: 1} and pool.drawn == 8


def test_without_a_loss_nothing_is_dealt_twice_and_acknowledged_batches_are_not_kept():
    plan = EpochPlan(64, 8, shuffle=False)
    pool = EpochPool(plan, num_learners=2)
    for turn in range(8):
        pool.draw(0, turn % 2, plan, want=1, trained=turn // 2)
    assert pool.draw(0, 0, plan, trained=4)[::2] == (None, "epoch")
    assert [len(pool.learners[learner].dealt) for learner in (0, 1)] == [0, 1]
    assert pool.lose(0) == 0 and pool.redealt == 0 and pool.draw(1, 1, plan)[1:] == (0, "batch")
