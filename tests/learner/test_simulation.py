"""Simulated learners: λ virtual learners in one process under the real protocol code.

The push order and staleness are checked against hand-computed cases; exactness (hardsync = SGD with batch μλ,
async with one learner = plain SGD) and the data each learner reads through the Trainer, in-process.
"""

import warnings
from collections import Counter

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.cli import LightningCLI
from torch.utils.data import DataLoader, DistributedSampler

from lightning_rudra import RudraStrategy
from lightning_rudra.core.compression import ErrorFeedback
from lightning_rudra.step_times import StepTimes
from lightning_rudra.timing import Homogeneous, Jittered, Measured, ShiftedExponential, Stragglers, push_order
from tests.lightning_models import (
    IndexedData,
    OneBackwardTwoSteps,
    Regression,
    SharesABias,
    Stream,
    TwoOptimizers,
    flat,
    indexed_loader,
    loader,
    quiet_trainer,
    single_process_sgd,
)


# ---- the order of pushes, by hand --------------------------------------------------------------------------
@pytest.mark.parametrize("protocol", ["softsync", "async", "hardsync"])
def test_homogeneous_learners_push_in_rank_order(protocol):
    assert push_order(protocol, [2, 2, 2], Homogeneous(), [0, 0, 0]) == [0, 1, 2, 0, 1, 2]


def test_a_straggler_pushes_less_often_unless_hardsync_waits_for_it():
    # learner 0 pushes at 3, 6, 9; learner 1 at 1, 2, 3 (a tie at 3 goes to the lower rank)
    assert push_order("async", [3, 3], Stragglers({0: 3.0}), [0, 0]) == [1, 1, 0, 1, 0, 0]
    # hardsync: every round waits for the slowest; within a round the fast learner pushes first
    assert push_order("hardsync", [3, 3], Stragglers({0: 3.0}), [0, 0]) == [1, 0, 1, 0, 1, 0]


def test_measured_times_are_used_in_turn_and_cycle_over_learners():
    timing = Measured([[1.0, 3.0], [2.0]])
    assert [timing.duration(0, s) for s in range(3)] == [1.0, 3.0, 1.0]
    assert timing.duration(3, 0) == 2.0  # learner 3 takes learner 1's times
    # learner 0: pushes at 1, 4; learner 1: at 2, 4 (tie: rank 0 first)
    assert push_order("softsync", [2, 2], timing, [0, 0]) == [0, 1, 0, 1]
    # the timing goes on where the previous epoch left it: learner 0's steps 1 and 2 take 3 and 1
    assert push_order("softsync", [2, 2], timing, [1, 0]) == [1, 0, 0, 1]


def test_jitter_is_reproducible_from_its_seed():
    steps = [20] * 4
    assert push_order("async", steps, Jittered(0.5, seed=1), [0] * 4) == push_order(
        "async", steps, Jittered(0.5, seed=1), [0] * 4
    )
    assert push_order("async", steps, Jittered(0.5, seed=1), [0] * 4) != push_order(
        "async", steps, Jittered(0.5, seed=2), [0] * 4
    )


def test_shifted_exponential_times_are_reproducible_never_below_the_shift_and_average_shift_plus_scale():
    timing = ShiftedExponential(seed=3)
    times = [timing.duration(r, s) for r in range(8) for s in range(500)]
    assert times == [ShiftedExponential(seed=3).duration(r, s) for r in range(8) for s in range(500)]
    assert times != [ShiftedExponential(seed=4).duration(r, s) for r in range(8) for s in range(500)]
    assert min(times) >= 0.5 and max(times) > 2.5  # a long tail: now and then a step takes several means
    assert sum(times) / len(times) == pytest.approx(1.0, abs=0.05)  # shift 0.5 + scale 0.5
    assert ShiftedExponential(1.0, 0.0).duration(0, 0) == 1.0
    assert ShiftedExponential(seed=3, slowdown={0: 3.0}).duration(0, 7) == pytest.approx(3 * timing.duration(0, 7))


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: Jittered(spread=-1), "spread=-1"),
        (lambda: ShiftedExponential(shift=-0.5), "shift=-0.5"),
        (lambda: ShiftedExponential(scale=float("inf")), "scale=inf"),
        (lambda: ShiftedExponential(0, 0), "shift \\+ scale > 0"),
        (lambda: ShiftedExponential(slowdown={0: -1.0}), "slowdown of learner 0"),
        (lambda: Stragglers({0: 0.0}), "slowdown of learner 0 is 0.0"),
        (lambda: Stragglers({-1: 2.0}), "slowdown names learner -1"),
        (lambda: Measured([]), "Measured"),
        (lambda: Measured([[1.0, -2.0]]), "finite and > 0"),
    ],
)
def test_bad_timing_models_are_refused(make, message):
    with pytest.raises(ValueError, match=message):
        make()


# ---- the strategy's arguments ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(simulate=0), "simulate=0 is not valid"),
        (dict(simulate=2.5), "simulate=2.5 is not valid"),
        (dict(timing=Homogeneous()), "set simulate=λ too"),
        (dict(simulate=4, timing="fast"), "is not a timing model"),
        (dict(simulate=4, sampling="shared"), "sampling='shared' cannot be simulated"),
        (dict(simulate=4, overlap=True), "overlap=True cannot be simulated"),
    ],
)
def test_bad_simulation_arguments_are_refused_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RudraStrategy(**kwargs)


def test_simulated_learners_run_in_one_process():
    with pytest.raises(ValueError, match="simulate=4 trains every learner in this one process: use Trainer"):
        quiet_trainer(RudraStrategy(simulate=4), devices=2)
    with pytest.raises(ValueError, match="n=5 is larger than the number of learners λ=4"):
        quiet_trainer(RudraStrategy(protocol="softsync", n=5, simulate=4), devices=1)
    strategy = quiet_trainer(RudraStrategy(protocol="softsync", n=4, simulate=4), devices=1).strategy
    assert strategy.num_learners == 4 and strategy._launcher is None and strategy.sampling == "static"
    assert isinstance(strategy.timing, Homogeneous)


# ---- through the Trainer, in this process --------------------------------------------------------------
def fit(strategy, model=None, data=None, **kwargs):
    model = model if model is not None else Regression()
    trainer = quiet_trainer(strategy, devices=1, **kwargs)
    trainer.fit(model, data if data is not None else loader(8))
    return model, trainer


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("learners", [1, 4])
def test_hardsync_with_simulated_learners_equals_sgd_with_batch_mu_lambda(learners):
    model, trainer = fit(RudraStrategy(protocol="hardsync", simulate=learners), max_epochs=2)
    assert torch.allclose(flat(model.parameters()), single_process_sgd(2, 8 * learners), atol=1e-6)
    stats = trainer.strategy.stats
    assert stats.clock == 2 * 256 // (8 * learners) and stats.staleness == {0: 2 * 256 // 8}
    assert stats.batches == {r: 2 * 256 // (8 * learners) for r in range(learners)}


class LastUpdate(pl.Callback):
    """The simulated server's newest update of optimizer 0, as of the last batch."""

    update = None

    def on_train_batch_end(self, trainer, *args):
        self.update = trainer.strategy._training.learner.client.server.last_updates[0]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_logged_rate_is_the_one_the_server_applied_after_compensation():
    # async, 2 learners, one 3× slower (its gradients σ ≈ 3), SGD with momentum 0.9, the default compensation: once
    # σ > 0 the server steps on the learner's own momentum (dana) at lr · min(c/λ, 1/(σ + 1)), σ the update's own,
    # not at the learners' lr
    last = LastUpdate()
    strategy = RudraStrategy(protocol="async", simulate=2, timing=Stragglers({1: 3.0}))
    _, trainer = fit(strategy, model=Regression(lr=0.1, momentum=0.9), max_epochs=1, callbacks=[last])
    stats = trainer.strategy.stats
    assert max(stats.staleness) >= 2, stats.staleness  # the cap binds: 1/(σ + 1) < c/λ
    [sigma] = last.update.staleness
    applied = trainer.callback_metrics["lr_applied"].item()
    assert applied == pytest.approx(0.1 * min(1 / 2, 1 / (sigma + 1))), (applied, sigma)


class OneCycle(Regression):
    """A OneCycleLR stepped per step over ``total_steps``, or else trainer.estimated_stepping_batches."""

    def __init__(self, total_steps=None) -> None:
        super().__init__()
        self.total_steps = total_steps

    def configure_optimizers(self):
        self.total_steps = self.total_steps or self.trainer.estimated_stepping_batches
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=self.total_steps)
        return [opt], [{"scheduler": scheduler, "interval": "step"}]


class TwoSchedules(Regression):
    """A rate × 0.9 after every step and × 0.5 after every epoch; writes down (learner, rate) of every batch."""

    def __init__(self) -> None:
        super().__init__(momentum=0.0)
        self.rates: list[tuple[int, float]] = []

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        steps = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
        return [opt], [{"scheduler": steps, "interval": "step"}, torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)]

    def training_step(self, batch, batch_idx):
        learner, lr = (
            self.trainer.strategy._training.learner.client.learner,
            self.trainer.optimizers[0].param_groups[0]["lr"],
        )
        self.rates.append((learner, lr))
        return super().training_step(batch, batch_idx)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_compressed_simulated_learners_each_keep_their_own_error_and_hardsync_stays_near_sgd(monkeypatch):
    """With ``compression``, every simulated learner's push is compressed as a real learner on another host's would
    be, its rounding errors kept apart from the other learners' (the key's last part: the learner)."""
    keys = set()
    compress = ErrorFeedback.compress

    def recorded(self, key, flats):
        keys.add(key)
        return compress(self, key, flats)

    monkeypatch.setattr(ErrorFeedback, "compress", recorded)
    model, _ = fit(RudraStrategy(protocol="hardsync", simulate=4, compression="bf16"), max_epochs=2)
    assert keys == {(0, 0, learner) for learner in range(4)}  # server 0, optimizer 0, each learner
    difference = (flat(model.parameters()) - single_process_sgd(2, 32)).abs().max().item()
    assert 0 < difference < 1e-3  # rounded, and nothing lost but the last roundings' errors


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_every_simulated_learner_steps_its_own_schedule_over_one_learners_estimated_steps():
    # hardsync = SGD with batch μλ, also with a per-step schedule over estimated_stepping_batches (one learner's
    # 2 epochs × 256 / (4 · 8) steps, as real learners would read it)
    model, trainer = fit(RudraStrategy(protocol="hardsync", simulate=4), model=OneCycle(), max_epochs=2)
    assert model.total_steps == 16 and trainer.lr_scheduler_configs[0].scheduler.last_epoch == 16
    assert torch.allclose(
        flat(model.parameters()), single_process_sgd(2, 32, model=OneCycle(total_steps=16)), atol=1e-6
    )
    # learners at their own pace: each rate is the learner's own, after its own steps and the epochs' ends
    model, _ = fit(
        RudraStrategy(protocol="async", simulate=3, timing=Stragglers({0: 3.0})),
        model=TwoSchedules(),
        data=loader(8, num_samples=96),
        max_epochs=2,
    )
    steps = Counter()
    for i, (learner, lr) in enumerate(model.rates):
        epoch = i // 12  # 96 samples: 4 batches per learner and epoch
        assert lr == pytest.approx(0.05 * 0.9 ** steps[learner] * 0.5**epoch), (i, learner)
        steps[learner] += 1
    assert steps == {r: 8 for r in range(3)}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_async_with_one_simulated_learner_equals_plain_sgd():
    model, trainer = fit(RudraStrategy(protocol="async", simulate=1), max_epochs=2)
    assert torch.allclose(flat(model.parameters()), single_process_sgd(2, 8), atol=1e-6)
    assert trainer.strategy.stats.staleness == {0: 64}


def predicted_staleness(n: int, learners: int, pushes: int) -> Counter:
    """n-softsync, homogeneous learners pushing in rank order, c = λ/n: push p (counted from 0) leaves the
    clock at ⌊(p+1)/c⌋; a learner's next push comes λ pushes later, at clock ⌊(p+λ)/c⌋, so its σ is n − 1 if
    push p closed an update and n otherwise; in the first round σ = ⌊p/c⌋ (everyone starts from clock 0)."""
    c = learners // n
    sigmas = [p // c if p < learners else n - ((p - learners + 1) % c == 0) for p in range(pushes)]
    return Counter(sigmas)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [1, 2, 3, 6])
def test_softsync_staleness_of_homogeneous_learners_is_what_the_protocol_predicts(n):
    learners = 6
    _, trainer = fit(
        RudraStrategy(
            **(dict(protocol="softsync", n=n) if n < learners else dict(protocol="async")), simulate=learners
        ),
        data=loader(4, num_samples=240),
        max_epochs=1,
    )
    stats = trainer.strategy.stats
    pushes = 240 // 4
    assert stats.staleness == dict(predicted_staleness(n, learners, pushes))
    assert stats.clock == pushes // (learners // n)
    # ⟨σ⟩ → n(λ−1)/λ, not n: the learner whose push closes an update is one fresher (the first round, from
    # clock 0, is fresher still: a difference that fades as 1/pushes)
    assert abs(stats.mean_staleness - n * (learners - 1) / learners) <= n * learners / pushes


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("protocol", ["hardsync", "async"])
def test_each_simulated_learner_reads_the_shard_a_real_learner_of_its_rank_reads(protocol, monkeypatch):
    learners, epochs = 3, 2

    class Seen(Regression):
        def __init__(self):
            super().__init__()
            self.seen: dict[int, list[list[int]]] = {r: [] for r in range(learners)}

        def training_step(self, batch, batch_idx):
            x, y, index = batch
            # the simulated learner whose step this is (what a real learner knows as its global_rank)
            self.seen[self.trainer.strategy._training.learner.client.learner].append(index.tolist())
            return self.loss((x, y))

    # Lightning seeds its DistributedSampler with the global seed, which it keeps in the environment: set it for
    # this test only (learner processes that later tests start would inherit it)
    monkeypatch.setenv("PL_GLOBAL_SEED", "7")
    pl.seed_everything(7, verbose=False)
    model, trainer = fit(
        RudraStrategy(protocol=protocol, simulate=learners, timing=Jittered(0.5, seed=3)),
        model=Seen(),
        data=indexed_loader(5, num_samples=100),
        max_epochs=epochs,
    )
    for rank in range(learners):
        expected = []
        for epoch in range(epochs):
            shard = DistributedSampler(IndexedData(100), num_replicas=learners, rank=rank, shuffle=True, seed=7)
            shard.set_epoch(epoch)
            expected += [batch.tolist() for batch in DataLoader(list(shard), batch_size=5)]
        assert model.seen[rank] == expected
    assert trainer.strategy.stats.batches == {r: epochs * 7 for r in range(learners)}  # 34 samples: 7 batches


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_limit_train_batches_and_max_steps_count_per_simulated_learner():
    _, trainer = fit(RudraStrategy(protocol="async", simulate=4), limit_train_batches=3, max_epochs=2)
    assert trainer.strategy.stats.batches == {r: 6 for r in range(4)}
    _, trainer = fit(RudraStrategy(protocol="softsync", simulate=4, timing=Stragglers({0: 3.0})), max_steps=5)
    assert trainer.strategy.stats.batches == {r: 5 for r in range(4)}  # the straggler too: steps per learner
    assert trainer.global_step == 20  # the steps of all learners together


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_straggler_raises_the_others_staleness_only_without_hardsync():
    _, even = fit(RudraStrategy(protocol="async", simulate=4), max_epochs=1)
    _, slow = fit(RudraStrategy(protocol="async", simulate=4, timing=Stragglers({0: 3.0})), max_epochs=1)
    # with 4 homogeneous learners every push after the first round has σ = 3; the straggler's pushes see ~9
    assert even.strategy.stats.max_staleness == 3
    assert slow.strategy.stats.max_staleness >= 8
    _, hard = fit(RudraStrategy(protocol="hardsync", simulate=4, timing=Stragglers({0: 3.0})), max_epochs=1)
    assert hard.strategy.stats.staleness == {0: 32}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_resumed_simulated_hardsync_run_equals_an_uninterrupted_one(tmp_path):
    whole, _ = fit(RudraStrategy(protocol="hardsync", simulate=4), max_epochs=2)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    fit(RudraStrategy(protocol="hardsync", simulate=4), max_epochs=1, callbacks=[checkpoint], enable_checkpointing=True)
    resumed = Regression()
    trainer = quiet_trainer(RudraStrategy(protocol="hardsync", simulate=4), devices=1, max_epochs=2)
    trainer.fit(resumed, loader(8), ckpt_path=str(tmp_path / "last.ckpt"))
    assert torch.allclose(flat(resumed.parameters()), flat(whole.parameters()), atol=1e-6)
    assert trainer.strategy.stats.clock == 16 and trainer.strategy.stats.batches == {r: 16 for r in range(4)}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_checkpoint_keeps_its_protocol_and_resuming_under_another_warns_naming_both(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    fit(
        RudraStrategy(protocol="softsync", n=2, simulate=4),
        max_epochs=1,
        callbacks=[checkpoint],
        enable_checkpointing=True,
    )
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)["rudra"]["protocol"]
    assert saved == {"protocol": "softsync", "n": 2}
    trainer = quiet_trainer(RudraStrategy(protocol="softsync", n=2, simulate=4), devices=1, max_epochs=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Regression(), loader(8), ckpt_path=str(tmp_path / "last.ckpt"))
    assert trainer.strategy.stats.clock > 0
    assert not [w for w in caught if "This checkpoint was written under" in str(w.message)]
    # the default protocol changed (0.1.0's was 1-softsync): a run resumed with the default must hear of it
    trainer = quiet_trainer(RudraStrategy(simulate=4), devices=1, max_epochs=2)
    with pytest.warns(
        UserWarning,
        match="written under {'protocol': 'softsync', 'n': 2}, and the run resumes under {'protocol': 'async', 'n': 1}",
    ):
        trainer.fit(Regression(), loader(8), ckpt_path=str(tmp_path / "last.ckpt"))
    assert trainer.strategy.stats.clock > 0


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_what_cannot_be_simulated_is_refused_with_a_remedy():
    with pytest.raises(ValueError, match="accumulate_grad_batches=2 cannot be simulated yet"):
        fit(RudraStrategy(simulate=2), accumulate_grad_batches=2, max_epochs=1)
    with pytest.raises(ValueError, match="needs a train DataLoader over a map-style dataset"):
        fit(RudraStrategy(simulate=2), data=DataLoader(Stream(64), batch_size=8), max_epochs=1)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_lightning_cli_runs_a_simulation_from_yaml(tmp_path):
    config = tmp_path / "simulate.yaml"
    config.write_text(
        f"trainer:\n  default_root_dir: {tmp_path}\n  accelerator: cpu\n  devices: 1\n  max_epochs: 1\n  logger: false\n"
        "  enable_progress_bar: false\n"
        "  enable_checkpointing: false\n  enable_model_summary: false\n  strategy:\n"
        "    class_path: lightning_rudra.RudraStrategy\n    init_args:\n      protocol: softsync\n      n: 2\n"
        "      simulate: 8\n      timing:\n        class_path: lightning_rudra.timing.Jittered\n"
        "        init_args:\n          spread: 0.2\n          slowdown: {0: 2.0}\n"
    )
    cli = LightningCLI(Regression, run=False, args=["--config", str(config)])
    strategy = cli.trainer.strategy
    assert (strategy.simulate, strategy.timing.spread, strategy.timing.slowdown) == (8, 0.2, {0: 2.0})
    cli.trainer.fit(cli.model, loader(4))
    assert sum(strategy.stats.batches.values()) == 64 and set(strategy.stats.batches) == set(range(8))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_several_optimizers_and_manual_optimization_are_simulated():
    _, trainer = fit(
        RudraStrategy(protocol="softsync", n=2, lr_modulation="none", simulate=2),
        model=TwoOptimizers(),
        data=loader(16),
        max_epochs=1,
    )
    assert trainer.strategy.stats.gradients == trainer.strategy.stats.clock == 2 * 2 * 8  # two pushes a step
    # a real hardsync learner waits for the first round before its second step: one process cannot
    with pytest.raises(RuntimeError, match="cannot be simulated under hardsync"):
        fit(RudraStrategy(protocol="hardsync", simulate=2), model=TwoOptimizers(), data=loader(16), max_epochs=1)
    # one backward, two steps: the second optimizer's gradient comes from the weights before the first's update,
    # which changed its parameters only where they share one, and then by the learner's own step: no staleness
    for module in (OneBackwardTwoSteps(), SharesABias()):
        _, trainer = fit(RudraStrategy(protocol="async", simulate=1), model=module, data=loader(16), max_epochs=1)
        assert trainer.strategy.stats.staleness == {0: 32}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_step_times_measured_in_a_run_time_a_simulation(tmp_path):
    path = str(tmp_path / "times.json")
    fit("auto", max_epochs=1, callbacks=[StepTimes(path)])  # one plain process: one list of 32 steps
    timing = Measured.from_json(path)
    assert len(timing.times) == 1 and len(timing.times[0]) == 32 and min(timing.times[0]) > 0
    _, trainer = fit(RudraStrategy(protocol="async", simulate=4, timing=timing), max_epochs=1)
    assert trainer.strategy.stats.batches == {r: 8 for r in range(4)}


# ---- batchsync and backup learners, simulated --------------------------------------------------------------------
def test_the_order_of_batchsync_and_backup_pushes_by_hand():
    from lightning_rudra.core.rounds_order import RoundsStart, rounds_order

    # batchsync, K = 2, learner 1 three times slower: learner 0 gives both gradients of the first two rounds; learner
    # 1's first gradient (clock 0) comes at t = 3, after round 0 closed: late, and learner 0 trains its batch again
    start = RoundsStart(k=2, backup=0, held=[0, 0], clock=0)
    order = [(s.learner, s.batch) for s in rounds_order(start, 8, Stragglers({1: 3.0}), [0, 0])]
    assert order == [(0, 0), (0, 2), (0, 3), (1, 1), (0, 4), (0, 1), (0, 6), (1, 5), (0, 7), (1, 5)]
    # K = 3 of 3, learner 2 three times slower: learner 1's push at t = 1 would be followed by a gradient due at t =
    # 2, no earlier than learner 0's, which closes the round: its reply waits for the round (pacing), and its next
    # gradient is of the new weights
    start = RoundsStart(k=3, backup=0, held=[0, 0, 0], clock=0)
    steps = rounds_order(start, 12, Stragglers({2: 3.0}), [0, 0, 0])
    assert [(s.learner, s.batch, s.waits) for s in steps[:6]] == [
        (0, 0, False),
        (1, 1, True),
        (0, 3, False),
        (0, 4, False),
        (1, 5, True),
        (2, 2, False),
    ]
    # backup = 1 of 3, learner 2 three times slower: rounds of learners 0 and 1 until learner 1 is out of batches
    # (away, t = 2); learner 0's last push then waits for learner 2, whose gradient of clock 0 is late (t = 3) and
    # whose batch, with nothing new left, it trains again itself: that one closes the last round (t = 6)
    start = RoundsStart(k=0, backup=1, held=[0, 0, 0], clock=0)
    steps = rounds_order(start, 6, Stragglers({2: 3.0}), [0, 0, 0])
    assert [(s.learner, s.batch) for s in steps] == [(0, 0), (1, 1), (0, 3), (1, 4), (0, 5), (2, 2), (2, 2)]
    assert [sorted(s.away) for s in steps] == [[]] * 4 + [[1]] * 3


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_simulated_batchsync_with_k_lambda_and_equal_learners_is_hardsync():
    model, trainer = fit(RudraStrategy(protocol="batchsync", simulate=4), max_epochs=2)
    assert torch.allclose(flat(model.parameters()), single_process_sgd(2, 8 * 4), atol=1e-5)
    stats = trainer.strategy.stats
    assert (stats.clock, stats.late, stats.staleness) == (2 * 256 // 32, 0, {0: 2 * 256 // 8})


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kwargs", [dict(protocol="batchsync"), dict(protocol="hardsync", backup=1)])
def test_simulated_late_gradients_batches_are_trained_again_within_the_epoch(kwargs):
    model, trainer = fit(RudraStrategy(simulate=4, timing=Stragglers({3: 3.0}), **kwargs), max_epochs=2)
    stats = trainer.strategy.stats
    assert stats.late >= 4 and stats.staleness == {0: stats.gradients}
    # every batch applied once per epoch; the late ones trained again, by the fast learners first
    assert stats.gradients == 2 * 256 // 8 and sum(stats.batches.values()) == stats.gradients + stats.late
    assert stats.redealt == stats.late, "each late batch dealt again, and counted as the shared epoch counts it"
    assert stats.batches[3] < stats.batches[0]
