"""RudraStrategy through the Trainer: real learner processes (spawn) and a real server process."""

import math

import pytest
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

from lightning_rudra import RudraStrategy
from tests.lightning_models import ProbedRudra, Regression, flat, loader, quiet_trainer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def probed(tmp_path, **kwargs) -> ProbedRudra:
    strategy = ProbedRudra(start_method="spawn", rpc_timeout=60, **kwargs)
    strategy.probe_path = str(tmp_path / "probe.pt")
    return strategy


def single_process_sgd(epochs: int, batch_size: int, **kwargs) -> torch.Tensor:
    """Plain SGD over the batches of μλ samples that the λ learners' shards make up together: Lightning's
    DistributedSampler shuffles training data with the permutation seeded by the epoch."""
    model = Regression(**kwargs)
    opt = model.configure_optimizers()
    x, y = loader(batch_size).dataset.tensors
    for epoch in range(epochs):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
        for rows in order.split(batch_size):
            opt.zero_grad()
            model.loss((x[rows], y[rows])).backward()
            opt.step()
    return flat(model.parameters())


def test_hardsync_through_the_trainer_equals_sgd_with_batch_mu_lambda(tmp_path):
    learners, mu, epochs = 2, 8, 2
    model = Regression()
    trainer = quiet_trainer(probed(tmp_path, protocol="hardsync"), learners, max_epochs=epochs)
    trainer.fit(model, loader(mu))
    expected = single_process_sgd(epochs, mu * learners)
    torch.testing.assert_close(flat(model.parameters()), expected, rtol=0, atol=1e-5)
    steps = epochs * 256 // (mu * learners)
    stats = trainer.strategy.stats
    assert stats.clock == steps and stats.gradients == steps * learners and stats.staleness == {0: steps * learners}
    probe = torch.load(tmp_path / "probe.pt")
    assert torch.equal(probe["params"][0], flat(model.parameters()))  # the caller's model is the server's


@pytest.mark.parametrize("protocol, n, learners", [("softsync", 1, 3), ("softsync", 3, 3), ("async", 1, 2)])
def test_protocols_train_and_return_the_server_weights(tmp_path, protocol, n, learners):
    model = Regression(lr=0.02, momentum=0.5)
    before = Regression(lr=0.02).loss(next(iter(loader(256)))).item()
    trainer = quiet_trainer(probed(tmp_path, protocol=protocol, n=n), learners, max_epochs=3)
    trainer.fit(model, loader(8))
    after = model.loss(next(iter(loader(256)))).item()
    assert after < 0.5 * before, (before, after)
    stats = trainer.strategy.stats
    c = {"softsync": learners // n, "async": 1}[protocol]
    batches_per_epoch = math.ceil(math.ceil(256 / learners) / 8)  # DistributedSampler pads the shards evenly
    assert stats.gradients == learners * 3 * batches_per_epoch == sum(stats.staleness.values())
    assert stats.clock == -(-stats.gradients // c)  # one update per c gradients, the rest flushed at the end
    # ⟨σ⟩ ≈ n, and σ <= 2n for nearly all gradients (the paper; async is λ-softsync). Loose: 2 busy cores.
    effective_n = learners if protocol == "async" else n
    assert 0.3 * effective_n <= stats.mean_staleness <= 2 * effective_n, stats
    within = sum(count for sigma, count in stats.staleness.items() if sigma <= 2 * effective_n)
    assert within >= 0.95 * stats.gradients, stats
    probe = torch.load(tmp_path / "probe.pt")
    assert torch.equal(probe["params"][0], flat(model.parameters()))


def test_resume_from_checkpoint_continues_exactly(tmp_path):
    def run(max_epochs, ckpt_path=None, callbacks=()):
        model = Regression()
        strategy = RudraStrategy(protocol="hardsync", start_method="spawn", rpc_timeout=60)
        trainer = quiet_trainer(strategy, 2, max_epochs=max_epochs, callbacks=list(callbacks),
                                enable_checkpointing=bool(callbacks), default_root_dir=tmp_path)
        trainer.fit(model, loader(8), ckpt_path=ckpt_path)
        return flat(model.parameters()), trainer.strategy.stats

    straight, straight_stats = run(2)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    _, first_stats = run(1, callbacks=[checkpoint])
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert saved["rudra"]["stats"]["clock"] == first_stats.clock == 16
    assert saved["optimizer_states"][0]["state"], "the server's momentum buffers are in the checkpoint"
    resumed, resumed_stats = run(2, ckpt_path=str(tmp_path / "last.ckpt"))
    torch.testing.assert_close(resumed, straight, rtol=0, atol=1e-6)
    assert resumed_stats == straight_stats
