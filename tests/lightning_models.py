"""Small LightningModules and helpers for the strategy tests (importable by spawned learners)."""

import os
import signal
import time
from typing import Optional

import pytorch_lightning as pl
import torch
import torch.utils.checkpoint
import torchmetrics
from pytorch_lightning.callbacks import StochasticWeightAveraging, WeightAveraging
from torch.utils.data import DataLoader, TensorDataset

from lightning_rudra import RudraStrategy

# Learners forked from one fork server that imported Lightning once for the whole session, not spawned: an
# import of Lightning takes 9-12 s on the 2-core CI machine, paid by each spawned learner of each test.
START = "forkserver"


def regression_data(num_samples: int = 256, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, 6, generator=g)
    w = torch.randn(6, 1, generator=g)
    return TensorDataset(x, torch.tanh(x @ w) + 0.05 * torch.randn(num_samples, 1, generator=g))


def loader(batch_size: int, num_samples: int = 256, seed: int = 0) -> DataLoader:
    return DataLoader(regression_data(num_samples, seed), batch_size=batch_size, shuffle=False)


def flat(params) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params])


def single_process_sgd(
    epochs: int, batch_size: int, model: Optional[pl.LightningModule] = None, **kwargs
) -> torch.Tensor:
    """Plain SGD over the batches of μλ samples that the λ learners' shards make up together: Lightning's
    DistributedSampler shuffles training data with the permutation seeded by the epoch. A module may return
    ``[opt], [{"scheduler": ..., "interval": "step"}]``: its schedulers step after every step."""
    model = model if model is not None else Regression(**kwargs)
    opt = model.configure_optimizers()
    opt, schedulers = (
        (opt, []) if isinstance(opt, torch.optim.Optimizer) else (opt[0][0], [c["scheduler"] for c in opt[1]])
    )
    x, y = loader(batch_size).dataset.tensors
    for epoch in range(epochs):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
        for rows in order.split(batch_size):
            opt.zero_grad()
            model.loss((x[rows], y[rows])).backward()
            opt.step()
            for scheduler in schedulers:
                scheduler.step()
    return flat(model.parameters())


def sgd_after_a_loss(epochs: int, mu: int, learners: int, lost: int, lost_at: int) -> torch.Tensor:
    """Hardsync when learner ``lost`` is lost before its step ``lost_at`` (0-based, over the run): plain SGD over
    the union of every learner's batch (DistributedSampler's shards, ``mu`` samples each), then over the union of
    the learners left."""
    model = Regression()
    opt = model.configure_optimizers()
    x, y = loader(mu).dataset.tensors
    step = 0
    for epoch in range(epochs):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
        shards = [order[rank::learners] for rank in range(learners)]
        for k in range(len(shards[0]) // mu):
            left = [r for r in range(learners) if step < lost_at or r != lost]
            rows = torch.cat([shards[r][k * mu : (k + 1) * mu] for r in left])
            opt.zero_grad()
            model.loss((x[rows], y[rows])).backward()
            opt.step()
            step += 1
    return flat(model.parameters())


class RegressionSteps:
    """The regression module's steps, for a LightningModule of either flavour (``pytorch_lightning`` and the
    unified ``lightning``)."""

    def __init__(self, lr: float = 0.05, momentum: float = 0.9) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.lr, self.momentum = lr, momentum

    def loss(self, batch) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch), sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self.loss(batch), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


class Regression(RegressionSteps, pl.LightningModule):
    pass


class Scheduled(Regression):
    """SGD with momentum (state on the server) and a StepLR that divides the rate by 10 every epoch."""

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1)]


class ProbedRudra(RudraStrategy):
    """Saves what the server holds once training has ended (learner 0), for the test to compare."""

    probe_path: str = ""

    paths: list = []

    def _end_training(self) -> None:
        # how each of this learner's pushes travelled: (through shared memory, over the push stream) per server
        learner = self._training.learner
        if learner is not None:
            self.paths = [(link.shm is not None, link.client.stream is not None) for link in learner.links]
        super()._end_training()

    def on_train_end(self) -> None:
        paths = self.paths
        super().on_train_end()
        if self.is_global_zero and self.probe_path:
            parts = [client.pull() for client in self._servers.clients]
            # each server's contiguous part of the parameters, in the module's order (one dtype here)
            params, buffers = [torch.cat([flats[0] for flats, _ in parts])], parts[0][1]
            # the rate of each optimizer's last update on the (first) server; a checkpoint holds the learners' rate
            lrs = (
                [
                    [g["lr"] for g in self._servers.client.optimizer_state(i)["param_groups"]]
                    for i in range(len(self.optimizers))
                ]
                if len(self._servers.clients) == 1
                else None
            )
            torch.save(
                {"params": params, "buffers": buffers, "lrs": lrs, "pid": os.getpid(), "paths": paths}, self.probe_path
            )


def quiet_trainer(strategy, devices: int, trainer_class: type = pl.Trainer, **kwargs) -> pl.Trainer:
    """A Trainer on CPU that logs, checkpoints and prints nothing (``trainer_class``: the unified package's
    ``lightning.Trainer`` too)."""
    options = dict(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    options.update(kwargs)
    return trainer_class(**options)


class Features(Regression):
    """Automatic optimization with what real modules use: a frozen layer, a parameter no loss reaches, an LR
    scheduler, and (from the Trainer) clipping and accumulation. Checks the collectives at the start."""

    def __init__(self) -> None:
        super().__init__(lr=0.05, momentum=0.0)
        self.frozen = torch.nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.unused = torch.nn.Parameter(torch.ones(3))

    def loss(self, batch) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(self.frozen(x) + x), y)

    def on_train_start(self) -> None:
        strategy, rank, world = self.trainer.strategy, self.global_rank, self.trainer.world_size
        assert strategy.all_gather(torch.tensor([rank])).flatten().tolist() == list(range(world))
        assert strategy.reduce(torch.tensor(rank + 1.0), reduce_op="sum").item() == world * (world + 1) / 2
        assert strategy.reduce(torch.tensor(rank + 1.0)).item() == (world + 1) / 2
        assert strategy.broadcast(f"from {rank}", src=world - 1) == f"from {world - 1}"
        assert strategy.reduce_boolean_decision(rank == 0, all=False) is True
        assert strategy.reduce_boolean_decision(rank == 0, all=True) is False
        strategy.barrier("checked")

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, weight_decay=0.1)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]


class ClipsInItsHook(Regression):
    """Clips in its own ``configure_gradient_clipping`` (no Trainer setting): by norm, at 0.5."""

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_gradients(optimizer, gradient_clip_val=0.5, gradient_clip_algorithm="norm")


class ClipsTwiceInItsHook(Regression):
    """Clips twice in its own ``configure_gradient_clipping``: by norm at 0.3, then by value at 0.02."""

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_gradients(optimizer, gradient_clip_val=0.3, gradient_clip_algorithm="norm")
        self.clip_gradients(optimizer, gradient_clip_val=0.02, gradient_clip_algorithm="value")


class TwoOptimizers(pl.LightningModule):
    """Manual optimization with two optimizers, as in a GAN: each step pushes twice, clipped by
    ``clip_algorithm``."""

    def __init__(self, clip_algorithm: str = "norm") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.clip_algorithm = clip_algorithm
        self.first = torch.nn.Linear(6, 4)
        self.second = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt_first, opt_second = self.optimizers()
        for opt in (opt_second, opt_first):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(self.second(torch.tanh(self.first(x))), y)
            self.manual_backward(loss)
            self.clip_gradients(opt, gradient_clip_val=1.0, gradient_clip_algorithm=self.clip_algorithm)
            opt.step()
        self.log("train_loss", loss)

    def configure_optimizers(self):
        return torch.optim.Adam(self.first.parameters(), lr=0.01), torch.optim.SGD(self.second.parameters(), lr=0.05)


class OneBackwardTwoSteps(TwoOptimizers):
    """One backward, then both optimizers step (a GAN's step): the second gradient comes from the weights before
    the first step's update, which changed none of the second optimizer's parameters."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt_first, opt_second = self.optimizers()
        opt_first.zero_grad()
        opt_second.zero_grad()
        self.manual_backward(torch.nn.functional.mse_loss(self.second(torch.tanh(self.first(x))), y))
        opt_first.step()
        opt_second.step()


class SharesABias(OneBackwardTwoSteps):
    """OneBackwardTwoSteps whose second optimizer (with momentum) updates the first layer's bias too: the first
    step's update changes the weights of the second gradient, as in one process."""

    def configure_optimizers(self):
        second = torch.optim.SGD([*self.second.parameters(), self.first.bias], lr=0.05, momentum=0.9)
        return torch.optim.Adam(self.first.parameters(), lr=0.01), second


class Metered(Regression):
    """Validation's mean squared error as a torchmetrics Metric: its state syncs through the server."""

    def __init__(self) -> None:
        super().__init__()
        self.val_mse = torchmetrics.MeanSquaredError()

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_mse.update(self.net(x), y)
        self.log("val_mse", self.val_mse)


class ReadsItsStart(Regression):
    """Keeps in a buffer (returned with learner 0's weights) what its process saw at the start of fit: the
    environment variable RUDRA_TEST_MARK, the first number its random generator draws, and whether any of its
    parameters lives in memory shared with another process."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros(3))

    def on_fit_start(self) -> None:
        shared = any(t.is_shared() for t in list(self.parameters()) + list(self.buffers()))
        self.seen.copy_(
            torch.tensor([float(os.environ.get("RUDRA_TEST_MARK", "-1")), torch.rand(1).item(), float(shared)])
        )


class FailingLearner(Regression):
    """Learner 1 dies (``exit``), raises (``raise``) or stops itself (``stop``: SIGSTOP) at its third batch."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and batch_idx == 2 and self.trainer.current_epoch == 0:
            if self.how == "exit":
                os._exit(7)
            if self.how == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            raise ValueError("learner 1 broke on purpose")
        return super().training_step(batch, batch_idx)


class MeteredFailing(FailingLearner):
    """FailingLearner, validated with :class:`Metered`'s metric."""

    def __init__(self, how: str) -> None:
        super().__init__(how)
        self.val_mse = torchmetrics.MeanSquaredError()

    validation_step = Metered.validation_step


class IndexedData(torch.utils.data.Dataset):
    """The regression data, with each sample's index, so that a test can tell which learner trained on what."""

    def __init__(self, num_samples: int = 256, seed: int = 0) -> None:
        self.data = regression_data(num_samples, seed)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        x, y = self.data[i]
        return x, y, i


class Recording(Regression):
    """Writes down, per learner, every training batch as (epoch, indices) and every validation; learner 1 sleeps
    ``slow`` seconds per batch (``slow_once``: only in its first batch). Logs with sync_dist on every step."""

    def __init__(self, out_dir: str, slow: float = 0.0, slow_once: float = 0.0) -> None:
        super().__init__(lr=0.02, momentum=0.5)
        self.out_dir, self.slow, self.slow_once = out_dir, slow, slow_once
        self.batches: list[tuple[int, list[int]]] = []
        self.validations: list[tuple[int, int]] = []  # (epoch, batches trained on so far in the epoch)

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        if self.global_rank == 1:
            time.sleep(self.slow + (self.slow_once if not self.batches else 0.0))
        self.batches.append((self.current_epoch, index.tolist()))
        loss = self.loss((x, y))
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y, _ = batch
        self.log("val_loss", self.loss((x, y)), sync_dist=True)

    def on_validation_start(self) -> None:
        if not self.trainer.sanity_checking:
            self.validations.append((self.current_epoch, sum(e == self.current_epoch for e, _ in self.batches)))

    def on_train_end(self) -> None:
        torch.save(
            {"batches": self.batches, "validations": self.validations},
            os.path.join(self.out_dir, f"learner{self.global_rank}.pt"),
        )


def indexed_loader(batch_size: int, num_samples: int = 256, shuffle: bool = True) -> DataLoader:
    return DataLoader(IndexedData(num_samples), batch_size=batch_size, shuffle=shuffle)


class GathersInStep(Regression):
    """Calls all_gather inside training_step, which the shared epoch refuses."""

    def training_step(self, batch, batch_idx):
        self.all_gather(torch.tensor([1.0]))
        return super().training_step(batch, batch_idx)


class WarmingUp(torch.optim.SGD):
    """SGD whose rate warms up over its first steps, counted in an attribute (state outside ``optimizer.state``)."""

    def __init__(self, params, lr: float = 0.01, momentum: float = 0.0) -> None:
        super().__init__(params, lr=lr, momentum=momentum)
        self.steps = 0

    def step(self, closure=None):
        self.steps += 1
        for group in self.param_groups:
            group["lr"] = group.setdefault("target_lr", group["lr"]) * min(1.0, self.steps / 10)
        return super().step(closure)


class Unusual(Regression):
    """Beyond plain float32 leaves: an embedding with sparse gradients, a float64 parameter, a weight-normalized
    layer (the module's parameters are the parametrization's originals), a tied weight, activation
    checkpointing, and an optimizer with state in an attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(12, 6, sparse=True)
        self.scale = torch.nn.Parameter(torch.ones(1, dtype=torch.float64))
        self.net[2] = torch.nn.utils.parametrizations.weight_norm(self.net[2])
        self.first = torch.nn.Linear(6, 6, bias=False)
        self.second = torch.nn.Linear(6, 6, bias=False)
        self.second.weight = self.first.weight  # tied

    def loss(self, batch) -> torch.Tensor:
        x, y = batch
        rows = (x[:, 0].abs() * 4).long().clamp(max=11)
        h = x + self.embedding(rows) + 0.1 * self.second(torch.tanh(self.first(x)))
        out = torch.utils.checkpoint.checkpoint(self.net, h, use_reentrant=False) * self.scale.to(x.dtype)
        return torch.nn.functional.mse_loss(out, y)

    def configure_optimizers(self):
        return WarmingUp(self.parameters(), lr=self.lr, momentum=self.momentum)


class Compiled(Regression):
    """``torch.compile`` in ``configure_model``, where Lightning's docs put it (the aot_eager backend: Dynamo and
    AOTAutograd without a C++ compile, so the test stays short)."""

    def configure_model(self) -> None:
        self.net = torch.compile(self.net, backend="aot_eager")


class WithoutOptimizer(Regression):
    """``configure_optimizers`` returns None (Lightning trains without stepping), or an optimizer with no
    parameters."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def configure_optimizers(self):
        return None if self.how == "none" else torch.optim.SGD([{"params": []}], lr=0.1)


class SavesItsAverage:
    """Mixed into a weight-averaging callback: learner 0 saves the averaged weights once training has ended."""

    def __init__(self, path: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.path = path

    def on_train_end(self, trainer, pl_module) -> None:
        super().on_train_end(trainer, pl_module)
        if trainer.global_rank == 0:
            average = self._average_model
            average = average.module if isinstance(average, torch.optim.swa_utils.AveragedModel) else average
            torch.save(flat(average.parameters()), self.path)


class SWA(SavesItsAverage, StochasticWeightAveraging):
    pass


class Averaging(SavesItsAverage, WeightAveraging):
    pass


class UnevenStreams(Regression):
    """Learner k's training stream yields 5 + k batches: lengths differ, as with a sharded IterableDataset."""

    def train_dataloader(self):
        return DataLoader(Stream(8 * (5 + self.global_rank)), batch_size=8)

    def val_dataloader(self):
        return loader(8, num_samples=16)


class Stream(torch.utils.data.IterableDataset):
    def __init__(self, num_samples: int) -> None:
        self.num_samples = num_samples

    def __iter__(self):
        x, y = regression_data().tensors
        return iter(zip(x[: self.num_samples], y[: self.num_samples]))


class KilledAtEpochOne(Regression):
    """Each learner appends ``<epoch> <sample ids>`` of every batch it trains on to ``<dir>/ids<rank>`` (before its
    push: each line is one push); learner 1 is slow, learner 2 kills itself (SIGKILL) at its fifth batch of epoch 1,
    before training on it, holding the batches it drew ahead."""

    def __init__(self, directory: str) -> None:
        super().__init__(lr=0.01)
        self.directory = directory

    def training_step(self, batch, batch_idx):
        x, y, ids = batch
        if self.global_rank == 2 and self.trainer.current_epoch == 1 and batch_idx == 4:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.03 if self.global_rank == 1 else 0.005)
        with open(os.path.join(self.directory, f"ids{self.global_rank}"), "a") as file:
            file.write(f"{self.trainer.current_epoch} {' '.join(map(str, ids.tolist()))}\n")
        return super().training_step((x, y), batch_idx)
