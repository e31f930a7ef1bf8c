"""The shared epoch's train DataLoaders: each one with Lightning's DistributedSampler is rebuilt around a
:class:`~lightning_rudra.learner.sampler.SharedEpochSampler`, its batch sampler, which draws its batches from the
server's pool (each dealt batch is one batch of the DataLoader), and
:class:`~lightning_rudra.strategy.fit_loop.shared_epoch_loop.SharedEpochLoop` fits Lightning's fit loop to it."""

from typing import Any, Optional

import pytorch_lightning as pl
from pytorch_lightning.trainer.states import RunningStage
from pytorch_lightning.utilities.data import _get_dataloader_init_args_and_kwargs, _reinstantiate_wrapped_cls
from torch.utils.data import DataLoader, DistributedSampler

from lightning_rudra.core.errors import ConfigurationError
from lightning_rudra.learner.client import LearnerClient
from lightning_rudra.core.epoch import EpochPlan
from lightning_rudra.core.stats import Stats
from lightning_rudra.learner.sampler import SharedEpochSampler
from lightning_rudra.strategy.fit_loop.shared_epoch_loop import SharedEpochLoop


def shared_dataloader(dataloader: Any, client: LearnerClient, pool: int, num_learners: int) -> Optional[DataLoader]:
    """``dataloader`` drawing from the server's pool number ``pool``; None if it cannot be pooled: an
    IterableDataset, a sampler or batch sampler of the user's own (Lightning wraps those per learner)."""
    sampler = getattr(dataloader, "sampler", None)
    if not isinstance(dataloader, DataLoader) or type(sampler) is not DistributedSampler or not dataloader.batch_size:
        return None
    # a DistributedSampler's dataset is sized: torch declares any Dataset
    size = len(sampler.dataset)  # type: ignore[arg-type]
    plan = EpochPlan(size, dataloader.batch_size, sampler.shuffle, sampler.seed, dataloader.drop_last)
    batches = SharedEpochSampler(client, pool, plan, num_learners)
    args, kwargs = _get_dataloader_init_args_and_kwargs(dataloader, sampler, RunningStage.TRAINING)
    # a batch sampler excludes these (DataLoader's rule); the plan holds the batch size and drop_last
    kwargs.update(batch_sampler=batches, sampler=None, batch_size=1, shuffle=False, drop_last=False)
    return _reinstantiate_wrapped_cls(dataloader, *args, **kwargs)


def start_shared_epoch(
    trainer: "pl.Trainer",
    loaders: list[Any],
    num_learners: int,
    resumed: Optional[Stats] = None,
    static: bool = True,
) -> Optional["SharedEpochLoop"]:
    """The shared epoch for this ``fit``, installed; None if no train dataloader draws from the server.
    ``resumed``: the statistics of the checkpoint this ``fit`` resumes from; ``static``: whether the refusals may
    offer ``sampling="static"`` (not under batchsync and backup learners, which need the shared epoch)."""
    instead = "RudraStrategy(sampling='static') (each learner its own part of every dataloader), or " if static else ""
    samplers = [
        dl.batch_sampler for dl in loaders if isinstance(getattr(dl, "batch_sampler", None), SharedEpochSampler)
    ]
    if samplers and len(samplers) < len(loaders):
        raise ConfigurationError(
            f"{len(loaders) - len(samplers)} of the {len(loaders)} train dataloaders cannot share their epoch "
            "(an IterableDataset, or a sampler of your own, keeps one stream per learner), and the others do: "
            f"their epochs would end at different batches on different learners. Use {instead}plain map-style "
            "datasets for every train dataloader."
        )
    if len(samplers) > 1:
        raise ConfigurationError(
            f"{len(samplers)} train dataloaders cannot share their epochs yet: Lightning cycles the shorter ones "
            "until the longest is done, and a drained shared pool does not cycle, so the epoch would end with the "
            f"shortest. Use {instead}one train dataloader."
        )
    if not samplers:
        return None
    loop = SharedEpochLoop(trainer, samplers, num_learners)
    loop.install(_trained(trainer, resumed) if resumed is not None else 0)
    return loop


def check_late_batches(trainer: "pl.Trainer", loop: Optional[SharedEpochLoop]) -> None:
    """batchsync, backup: a late gradient's batches are dealt again from the shared epoch (``loop``), and only
    automatic optimization says which batches a push holds (every learner checks alike, when training starts)."""
    if loop is None:
        raise ConfigurationError(
            "protocol='batchsync' and backup learners need the shared epoch: a gradient that comes after its round "
            "closed is not applied, and its batch is dealt again to whichever learner asks next. The train "
            "dataloader cannot be pooled (an IterableDataset, or a sampler of your own, keeps one stream per "
            "learner). Use a map-style dataset with Lightning's sampler, or protocol='hardsync' without backup, "
            "'softsync' or 'async'."
        )
    if not trainer.lightning_module.automatic_optimization:
        raise ConfigurationError(
            "protocol='batchsync' and backup learners need automatic optimization: a late push's batches are dealt "
            "again, and under manual optimization the module decides which batches a push holds. Use automatic "
            "optimization, or protocol='hardsync' without backup, 'softsync' or 'async'."
        )


def _trained(trainer: "pl.Trainer", resumed: Stats) -> int:
    """Batches the learners trained on before the checkpoint (all of them: learner 0's own counters restored in
    every learner say only what it took). Its gradients say it exactly for one push per batch; otherwise the
    batches dealt, which hold, mid-epoch, those then still waiting to be trained (a few per learner)."""
    if trainer.lightning_module.automatic_optimization and trainer.accumulate_grad_batches == 1:
        return resumed.gradients
    return sum(resumed.batches.values())
