"""The shared epoch through the Trainer: real learner processes (forked), a real server process, real data."""

from datetime import timedelta

import pytest
import torch
from pytorch_lightning.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, IterableDataset, default_collate

from lightning_rudra import RudraStrategy
from lightning_rudra.step_times import StepTimes
from lightning_rudra.timing import Measured
from tests.lightning_models import (
    START,
    GathersInStep,
    IndexedData,
    Recording,
    Regression,
    indexed_loader,
    loader,
    quiet_trainer,
    regression_data,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def fit(tmp_path, model, learners=2, strategy_kwargs=None, batch_size=8, num_workers=0, **trainer_kwargs):
    strategy = RudraStrategy(start_method=START, rpc_timeout=30, **{"protocol": "async", **(strategy_kwargs or {})})
    trainer = quiet_trainer(strategy, learners, **trainer_kwargs)
    train = indexed_loader(batch_size)
    if num_workers:
        # forked: a spawned worker would import torch again, for seconds, at every epoch
        train = DataLoader(
            train.dataset, batch_size=batch_size, shuffle=True, num_workers=num_workers, multiprocessing_context="fork"
        )
    trainer.fit(model, train, indexed_loader(64, num_samples=64, shuffle=False))
    records = [torch.load(tmp_path / f"learner{rank}.pt") for rank in range(learners)]
    return trainer, records


def batches_of(records, epoch):
    return [[tuple(b) for e, b in record["batches"] if e == epoch] for record in records]


def test_every_sample_once_per_epoch_fast_learner_takes_more_in_the_seeded_order(tmp_path):
    trainer, records = fit(
        tmp_path,
        Recording(str(tmp_path), slow=0.03),
        max_epochs=2,
        callbacks=[StepTimes(str(tmp_path / "step_times.json"))],
    )
    for epoch in range(2):
        mine, theirs = batches_of(records, epoch)
        seen = [i for batch in mine + theirs for i in batch]
        assert sorted(seen) == list(range(256)), "each sample exactly once per epoch, across learners"
        assert len(mine) > len(theirs), (len(mine), len(theirs))  # learner 1 is the slow one
        # Lightning's sampler order over all learners (seed 0 + epoch), cut into batches of 8
        order = torch.randperm(256, generator=torch.Generator().manual_seed(epoch)).tolist()
        assert set(mine + theirs) == {tuple(order[i : i + 8]) for i in range(0, 256, 8)}
    stats = trainer.strategy.stats
    assert stats.batches == {rank: len(record["batches"]) for rank, record in enumerate(records)}
    assert sum(stats.batches.values()) == stats.gradients == 2 * 32
    for record in records:  # validation once per epoch, at its end, on every learner
        assert [epoch for epoch, _ in record["validations"]] == [0, 1]
    assert "val_loss" in trainer.callback_metrics and "train_loss" in trainer.callback_metrics
    # every learner's step times, for a simulation to replay: learner 1 sleeps 0.03 s in each of its steps
    timing = Measured.from_json(str(tmp_path / "step_times.json"))
    assert [len(t) for t in timing.times] == [len(record["batches"]) for record in records]
    assert min(timing.times[1]) >= 0.03 > sorted(timing.times[0])[len(timing.times[0]) // 2]


def test_limits_and_validation_points_count_the_batches_of_all_learners(tmp_path):
    # limit_train_batches=10 is 10 batches per learner under DDP: 20 for the two together, shared
    trainer, records = fit(
        tmp_path, Recording(str(tmp_path), slow=0.02), max_epochs=2, limit_train_batches=10, val_check_interval=0.5
    )
    for epoch in range(2):
        mine, theirs = batches_of(records, epoch)
        assert len(mine) + len(theirs) == 20 and len(set(mine + theirs)) == 20
    validations = [record["validations"] for record in records]
    assert [[e for e, _ in v] for v in validations] == [[0, 0, 1, 1]] * 2  # halfway and at the end, together
    for rank, v in enumerate(validations):
        assert v[0][1] < v[1][1], v  # the first validation came before the epoch's last batch
    assert trainer.strategy.stats.gradients == 40


@pytest.mark.parametrize("num_workers", [0, 2])
def test_max_steps_counts_the_steps_of_all_learners(tmp_path, num_workers):
    # with workers, batches drawn (and counted in the budget) wait in their queue when the budget is spent
    trainer, records = fit(
        tmp_path, Recording(str(tmp_path), slow=0.02), max_steps=45, accumulate_grad_batches=1, num_workers=num_workers
    )
    assert trainer.strategy.stats.gradients == 2 * 45  # what two learners take in 45 DDP steps
    assert sum(len(record["batches"]) for record in records) == 90
    # 32 batches per epoch: the run stopped in the third epoch, on both learners
    assert [max(e for e, _ in record["batches"]) for record in records] == [2, 2]


class MeetsAtBatchStart(Recording):
    """Logs with sync_dist in on_train_batch_start, and writes down the place in the epoch of every batch it
    trains on."""

    def __init__(self, out_dir: str, slow: float) -> None:
        super().__init__(out_dir, slow=slow)
        self.positions: list[int] = []

    def on_train_batch_start(self, batch, batch_idx):
        self.log("batch_start", 1.0 + self.global_rank, sync_dist=True, on_step=True, on_epoch=True)

    def training_step(self, batch, batch_idx):
        self.positions.append(self.trainer.strategy._training.loop.position)
        return super().training_step(batch, batch_idx)

    def on_train_end(self) -> None:
        super().on_train_end()
        torch.save(self.positions, f"{self.out_dir}/positions{self.global_rank}.pt")


class MeetsAtBatchStartCallback(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        trainer.strategy.barrier("batch start")
        assert trainer.strategy.broadcast(trainer.global_rank) == trainer.global_rank  # the learner's own


def none_for_sample_0(samples):
    """A batch that the collate makes None (Lightning skips it, with no on_train_batch_start)."""
    batch = default_collate(samples)
    return None if (batch[2] == 0).any() else batch


def test_collectives_in_batch_start_hooks_are_the_learners_own_and_a_none_batch_keeps_positions(tmp_path):
    # Lightning calls the callbacks' and the module's on_train_batch_start before the strategy's: a meeting there
    # made the learners lock-step, then hung at the epoch's end
    model = MeetsAtBatchStart(str(tmp_path), slow=0.05)
    trainer = quiet_trainer(
        RudraStrategy(protocol="async", start_method=START, rpc_timeout=30),
        2,
        max_epochs=2,
        callbacks=[MeetsAtBatchStartCallback()],
    )
    data = DataLoader(IndexedData(256), batch_size=8, shuffle=True, collate_fn=none_for_sample_0)
    trainer.fit(model, data, indexed_loader(64, num_samples=64, shuffle=False))
    records = [torch.load(tmp_path / f"learner{rank}.pt") for rank in range(2)]
    positions = [torch.load(tmp_path / f"positions{rank}.pt") for rank in range(2)]
    for record, places in zip(records, positions):
        assert len(record["batches"]) == len(places)
        for (epoch, indices), place in zip(record["batches"], places):  # in step past the None batch
            order = torch.randperm(256, generator=torch.Generator().manual_seed(epoch)).tolist()
            assert indices == order[8 * place : 8 * place + 8], (epoch, place)
        assert [epoch for epoch, _ in record["validations"]] == [0, 1]  # together, at each epoch's end
    for epoch in range(2):
        mine, theirs = batches_of(records, epoch)
        assert len(mine) >= 2 * len(theirs), (len(mine), len(theirs))  # not lock-step: learner 1 is slow
        seen = sorted(i for batch in mine + theirs for i in batch)
        assert len(mine) + len(theirs) == 31 and 0 not in seen and len(set(seen)) == 31 * 8  # all but the None one
    # logged on_epoch with sync_dist: the last epoch's mean over both learners' batches (learner k logs 1 + k)
    mine, theirs = batches_of(records, 1)
    mean = (len(mine) + 2 * len(theirs)) / (len(mine) + len(theirs))
    assert trainer.callback_metrics["batch_start_epoch"].item() == pytest.approx(mean)


class OneCycle(Recording):
    """A OneCycleLR over trainer.estimated_stepping_batches, stepped per step; writes down the rate of every batch
    it trains on, with the batch's place in the epoch."""

    def __init__(self, out_dir: str, slow: float) -> None:
        super().__init__(out_dir, slow=slow)
        self.rates: list[tuple[int, int, float]] = []

    def configure_optimizers(self):
        self.estimated = self.trainer.estimated_stepping_batches
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=self.estimated)
        return [opt], [{"scheduler": scheduler, "interval": "step"}]

    def training_step(self, batch, batch_idx):
        lr = self.trainer.optimizers[0].param_groups[0]["lr"]
        self.rates.append((self.current_epoch, self.trainer.strategy._training.loop.position, lr))
        return super().training_step(batch, batch_idx)

    def on_train_end(self) -> None:
        super().on_train_end()
        torch.save(
            {"estimated": self.estimated, "rates": self.rates, "steps": self.lr_schedulers().last_epoch},
            f"{self.out_dir}/rates{self.global_rank}.pt",
        )


def test_estimated_stepping_batches_and_step_schedulers_are_one_learners_as_under_ddp(tmp_path):
    # 256 samples in batches of 8, 2 learners, windows of 2: DDP's learners take 16 batches, 8 steps an epoch
    trainer, records = fit(tmp_path, OneCycle(str(tmp_path), slow=0.03), max_epochs=2, accumulate_grad_batches=2)
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    reference = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=16)
    schedule = [opt.param_groups[0]["lr"]]
    for _ in range(16):
        opt.step()
        reference.step()
        schedule.append(opt.param_groups[0]["lr"])
    seen = [torch.load(tmp_path / f"rates{rank}.pt") for rank in range(2)]
    for learner in seen:
        assert learner["estimated"] == 16
        assert learner["steps"] == 16  # the schedule's end, on the fast learner too, and never past it
        # each batch at the rate DDP trains the same samples at: place p of the epoch is DDP's batch p // 2
        for epoch, place, lr in learner["rates"]:
            assert lr == pytest.approx(schedule[8 * epoch + place // 2 // 2]), (epoch, place)
    assert len(seen[0]["rates"]) > len(seen[1]["rates"])  # learner 1 is the slow one


def test_max_time_stops_every_learner_without_a_meeting_per_batch(tmp_path):
    # Lightning's Timer broadcasts its decision after every batch: each learner decides for itself here
    trainer, records = fit(tmp_path, Recording(str(tmp_path), slow=0.02), max_time={"seconds": 4})
    assert trainer.strategy.stats.gradients == sum(len(record["batches"]) for record in records) > 0
    for record in records:  # both stopped, and validated together when they did
        assert len(record["validations"]) == len(records[0]["validations"])
    # in the same epoch: the first to stop tells the server, and the other gets no further batch
    assert len({max(epoch for epoch, _ in record["batches"]) for record in records}) == 1


def test_a_learner_slower_than_the_rpc_timeout_does_not_end_the_run(tmp_path):
    # hardsync rounds wait the same way: test_rpc.py::test_a_live_learner_slower_than_the_timeout_is_waited_for
    model = Recording(str(tmp_path), slow_once=7.0)
    strategy = RudraStrategy(protocol="async", start_method=START, rpc_timeout=3)
    trainer = quiet_trainer(
        strategy,
        2,
        max_epochs=1,
        enable_checkpointing=True,
        default_root_dir=tmp_path,
        callbacks=[ModelCheckpoint(dirpath=tmp_path, monitor="val_loss")],
    )
    trainer.fit(model, indexed_loader(8), indexed_loader(64, num_samples=64, shuffle=False))
    batches = trainer.strategy.stats.batches
    assert batches[0] >= 2 * batches[1], batches  # learner 0 took most of the epoch while learner 1 slept
    assert trainer.checkpoint_callback.best_model_path.endswith(".ckpt")


class Stream(IterableDataset):
    def __iter__(self):
        x, y = regression_data(64).tensors
        return iter(zip(x, y))


def test_an_iterable_dataset_keeps_one_stream_per_learner():
    trainer = quiet_trainer(RudraStrategy(protocol="async", start_method=START, rpc_timeout=30), 2, max_epochs=1)
    trainer.fit(Regression(), DataLoader(Stream(), batch_size=8))
    assert trainer.strategy.stats.gradients == 2 * 8 and trainer.strategy.stats.batches == {}


class SkipsTheRestOfTheEpoch(Regression):
    def on_train_batch_start(self, batch, batch_idx):
        return -1 if batch_idx == 3 else None


@pytest.mark.parametrize(
    "module, callbacks, message",
    [
        (
            Regression,
            [ModelCheckpoint(train_time_interval=timedelta(seconds=5))],
            r"ModelCheckpoint\(train_time_interval=0:00:05\) cannot be used with RudraStrategy's shared epoch.*"
            r"every_n_train_steps",
        ),
        (
            GathersInStep,
            [],
            r"all_gather was called during a training batch under RudraStrategy's shared epoch.*Move it "
            r"to an epoch hook",
        ),
        # no learner can skip where the others do; left in a batch, it would not have met them at the epoch's end
        (
            SkipsTheRestOfTheEpoch,
            [],
            r"on_train_batch_start returned -1 \(skip the rest of the epoch\) on learner 0, at "
            r"its batch 3 of epoch 0.*limit_train_batches",
        ),
    ],
)
def test_what_needs_learners_in_step_is_refused_with_a_remedy(tmp_path, module, callbacks, message):
    trainer = quiet_trainer(
        RudraStrategy(start_method=START, rpc_timeout=30),
        1,
        max_epochs=1,
        enable_checkpointing=bool(callbacks),
        default_root_dir=tmp_path,
        callbacks=callbacks,
    )
    with pytest.raises(Exception, match=message):
        trainer.fit(module(), loader(8))


def test_step_checkpoints_hold_the_servers_state_mid_epoch_and_a_resumed_run_trains_what_remains(tmp_path):
    """ModelCheckpoint(every_n_train_steps) counts learner 0's steps; learner 0 writes the server's snapshot."""

    def run(ckpt_path=None, **limits):
        checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1, filename="{step}")
        trainer = quiet_trainer(
            RudraStrategy(protocol="async", start_method=START, rpc_timeout=30),
            2,
            enable_checkpointing=True,
            default_root_dir=tmp_path,
            callbacks=[checkpoint],
            **limits,
        )
        trainer.fit(Recording(str(tmp_path), slow=0.02), indexed_loader(8), ckpt_path=ckpt_path)
        return trainer.strategy.stats

    first = run(max_epochs=1)
    paths = sorted(tmp_path.glob("step=*.ckpt"), key=lambda p: int(p.stem[5:]))
    saved = [torch.load(path, weights_only=False) for path in paths]
    assert len(saved) >= 2 and not list(tmp_path.glob("*.partial"))
    clocks = [checkpoint["rudra"]["stats"]["clock"] for checkpoint in saved]
    assert clocks == sorted(clocks) and 0 < clocks[0] < clocks[-1] < first.clock == 32
    for checkpoint in saved:  # one snapshot of one clock: async applies each gradient as it comes
        stats = checkpoint["rudra"]["stats"]
        assert stats["clock"] == stats["gradients"] == sum(stats["staleness"].values())
        assert checkpoint["optimizer_states"][0]["state"], "the server's momentum buffers"
    # from the last snapshot inside learner 0's share of epoch 0 (one at its last batch would resume in epoch 1:
    # Lightning's own rule), 40 steps in all: what the uninterrupted run trains, 80 batches
    inside = [
        i
        for i, checkpoint in enumerate(saved)
        if not checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]["is_last_batch"]
    ]
    resumed = run(ckpt_path=str(paths[inside[-1]]), max_steps=40)
    trained = clocks[inside[-1]]  # batches trained before the snapshot, all learners (learner 0 took most)
    assert resumed.gradients == 80
    records = [torch.load(tmp_path / f"learner{rank}.pt") for rank in range(2)]
    assert sum(len(record["batches"]) for record in records) == 80 - trained
    # epoch 0 goes on after its first `trained` batches: each of the others once (none lost to learner 0's count)
    order = torch.randperm(256, generator=torch.Generator().manual_seed(0)).tolist()
    mine, theirs = batches_of(records, 0)
    assert sorted(mine + theirs) == sorted(tuple(order[8 * p : 8 * p + 8]) for p in range(trained, 32))


def test_several_train_dataloaders_are_refused_with_a_remedy():
    trainer = quiet_trainer(RudraStrategy(start_method=START, rpc_timeout=30), 1, max_epochs=1)
    with pytest.raises(Exception, match=r"2 train dataloaders cannot share their epochs yet.*sampling='static'"):
        trainer.fit(Regression(), {"a": loader(8), "b": loader(8, num_samples=128)})
