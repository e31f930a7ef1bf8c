"""Stale Synchronous Parallel (``on_stale="block"``) through the Trainer: real learner processes (forked), a real
server process, the shared epoch, one slow learner. The server holds the fast learners' pushes back instead of
dropping the slow one's gradients: σ never passes the bound, nothing is dropped, and every batch is trained once."""

import pytest
import torch

from lightning_rudra import RudraStrategy
from tests.lightning_models import START, KilledAtEpochOne, Recording, indexed_loader, quiet_trainer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.mark.parametrize("protocol, bound", [("async", 2), ("softsync", 1)])
def test_block_keeps_staleness_within_the_bound_and_trains_every_batch_once(tmp_path, protocol, bound):
    # λ = 3: async keeps σ <= λ - 1 = 2 at best, 1-softsync (c = 3) σ <= 1 (min_blocking_staleness)
    strategy = RudraStrategy(
        protocol=protocol, max_staleness=bound, on_stale="block", start_method=START, rpc_timeout=30
    )
    quiet_trainer(strategy, 3, max_epochs=2).fit(Recording(str(tmp_path), slow=0.03), indexed_loader(8))
    stats = strategy.stats
    assert stats.held >= 1, "the fast learners were held back for the slow one"
    assert max(stats.staleness) <= bound and stats.dropped == 0
    assert stats.gradients == sum(stats.batches.values()) == 2 * 32, "every batch once, none dropped"
    records = [torch.load(tmp_path / f"learner{rank}.pt") for rank in range(3)]
    for epoch in range(2):
        seen = sorted(i for record in records for e, batch in record["batches"] if e == epoch for i in batch)
        assert seen == list(range(256))


def test_with_min_learners_a_lost_learner_holds_nobody_back(tmp_path):
    strategy = RudraStrategy(
        protocol="async", max_staleness=2, on_stale="block", start_method=START, rpc_timeout=30, min_learners=1
    )
    with pytest.warns(UserWarning, match=r"learner 2's process ended with signal SIGKILL"):
        quiet_trainer(strategy, 3, max_epochs=3).fit(KilledAtEpochOne(str(tmp_path)), indexed_loader(8))
    stats = strategy.stats
    assert list(stats.lost) == [2] and stats.held >= 1 and max(stats.staleness) <= 2
    # the lost learner's pushes held back, if any, are not applied: its batches are dealt again
    assert sum(stats.batches.values()) == 3 * 32 + stats.redealt
    assert 3 * 32 <= stats.gradients + stats.dropped <= 3 * 32 + stats.redealt
