"""K-batch-sync and backup learners through the Trainer (lightning_rudra.core.rounds): real learner processes
(forked), a real server process, real data, one slow learner. What every run must show: only gradients of the
current weights are applied (σ = 0), the slow learner's late gradients are not, and their batches are trained again
by someone, so that every batch dealt is trained and every push is applied or late."""

import pytest
import torch

from lightning_rudra import RudraStrategy
from lightning_rudra.core.errors import ConfigurationError
from tests.lightning_models import (
    START,
    KilledAtEpochOne,
    Recording,
    Regression,
    indexed_loader,
    loader,
    quiet_trainer,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

BATCHES = 32  # indexed_loader(8): 256 samples


def fit(tmp_path, learners, epochs=2, slow=0.03, **strategy_kwargs):
    strategy = RudraStrategy(start_method=START, rpc_timeout=30, **strategy_kwargs)
    trainer = quiet_trainer(strategy, learners, max_epochs=epochs)
    trainer.fit(Recording(str(tmp_path), slow=slow), indexed_loader(8))
    records = [torch.load(tmp_path / f"learner{rank}.pt") for rank in range(learners)]
    return strategy.stats, records


def check_every_batch_trained(stats, records, epochs, learners):
    trained = sum(len(record["batches"]) for record in records)
    assert stats.late >= 1, "the slow learner's gradients come after their round closed"
    assert stats.staleness == {0: stats.gradients}, "only gradients of the current weights are applied"
    assert trained == stats.gradients + stats.late, "every push is applied or late, once"
    assert trained == epochs * BATCHES + stats.redealt, "every batch dealt is trained: the new ones, and again"
    # a late batch is dealt again once its learner says so in its next draw: all but those of the run's last batches
    assert 0 <= stats.late - stats.redealt <= 2 * learners, (stats.late, stats.redealt)
    assert epochs * BATCHES - 2 * learners <= stats.gradients <= epochs * BATCHES, "each batch applied once"
    for epoch in range(epochs):
        seen = {i for record in records for e, batch in record["batches"] if e == epoch for i in batch}
        assert seen == set(range(256)), "each sample is trained in each epoch"


def test_batchsync_applies_the_first_k_gradients_of_the_current_weights_and_deals_late_batches_again(tmp_path):
    stats, records = fit(tmp_path, 2, protocol="batchsync")
    check_every_batch_trained(stats, records, 2, 2)
    fast, slow = (len(record["batches"]) for record in records)
    assert fast > slow


def test_backup_rounds_take_the_first_learners_and_deal_the_straggler_batches_again(tmp_path):
    stats, records = fit(tmp_path, 3, protocol="hardsync", backup=1)
    check_every_batch_trained(stats, records, 2, 3)
    # a round of two gradients (fewer only where the others wait at the epoch's end)
    assert stats.clock >= stats.gradients // 2


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(protocol="batchsync", sampling="static"), "sampling='static' is not available with protocol='batchsync'"),
        (dict(protocol="hardsync", backup=1, sampling="static"), "sampling='static' is not available with backup=1"),
        (dict(protocol="batchsync", overlap=True), "overlap=True is not available with protocol='batchsync'"),
        (
            dict(protocol="hardsync", backup=1, node_aggregation=True),
            "node_aggregation=True cannot be used with backup",
        ),
        (dict(protocol="async", k=2), "k=2 is K-batch-sync's round size"),
        (dict(protocol="batchsync", on_stale="block", max_staleness=1), "nothing to bound with protocol='batchsync'"),
    ],
)
def test_options_that_cannot_go_with_late_gradients_are_refused_at_construction(kwargs, message):
    with pytest.raises(ConfigurationError, match=message):
        RudraStrategy(**kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(protocol="hardsync", backup=2), "backup=2 with λ=2 learners leaves no learner"),
        (dict(protocol="batchsync", num_servers=2), "protocol='batchsync' needs one parameter server, not 2"),
    ],
)
def test_options_that_depend_on_the_learners_are_refused_when_the_trainer_is_built(kwargs, message):
    with pytest.raises(ConfigurationError, match=message):
        quiet_trainer(RudraStrategy(start_method=START, **kwargs), 2)


class ManualStep(Regression):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(self.loss(batch))
        opt.step()


def test_manual_optimization_and_several_train_dataloaders_are_refused_when_training_starts():
    with pytest.raises(ConfigurationError, match="need automatic optimization"):
        quiet_trainer(RudraStrategy(protocol="batchsync", start_method=START, rpc_timeout=30), 2).fit(
            ManualStep(), loader(8)
        )
    # the shared epoch's refusal offers no sampling='static', which batchsync refuses too
    trainer = quiet_trainer(RudraStrategy(protocol="batchsync", start_method=START, rpc_timeout=30), 1)
    with pytest.raises(
        ConfigurationError, match=r"cannot share their epochs yet.*Use one train dataloader\."
    ) as refused:
        trainer.fit(Regression(), {"a": loader(8), "b": loader(8, num_samples=128)})
    assert "static" not in str(refused.value)


@pytest.mark.parametrize("kwargs", [dict(protocol="batchsync"), dict(protocol="hardsync", backup=1)])
def test_with_min_learners_a_lost_learners_batches_are_dealt_again_and_every_sample_is_trained(tmp_path, kwargs):
    epochs = 3
    strategy = RudraStrategy(start_method=START, rpc_timeout=30, min_learners=1, **kwargs)
    model = KilledAtEpochOne(str(tmp_path))
    with pytest.warns(UserWarning, match=r"learner 2's process ended with signal SIGKILL"):
        quiet_trainer(strategy, 3, max_epochs=epochs).fit(model, indexed_loader(8))
    trained = {epoch: [] for epoch in range(epochs)}
    for rank in range(3):
        for line in (tmp_path / f"ids{rank}").read_text().splitlines():
            epoch, *ids = map(int, line.split())
            trained[epoch].append(ids)
    stats = strategy.stats
    assert list(stats.lost) == [2] and stats.late >= 1 and stats.staleness == {0: stats.gradients}
    pushes = sum(len(batches) for batches in trained.values())
    assert pushes == stats.gradients + stats.late
    assert sum(stats.batches.values()) == epochs * BATCHES + stats.redealt
    # each batch applied once, but the run's last late ones (at most two a learner); a batch the lost learner
    # pushed and had not yet said it trained on is dealt again, and may be applied twice
    assert epochs * BATCHES - 2 * 3 <= stats.gradients <= epochs * BATCHES + stats.redealt
