"""A simulated run's train DataLoader (``RudraStrategy(simulate=λ)``): the one train DataLoader is rebuilt around
a :class:`~lightning_rudra.learner.simulation.SimulatedSampler`, which deals the batches of λ virtual learners in
the order of their pushes, and :class:`~lightning_rudra.strategy.fit_loop.simulated.SimulatedEpochLoop` fits
Lightning's fit loop to it. Before each batch the module takes the weights of the learner whose batch it is."""

from typing import Any, Optional

import pytorch_lightning as pl
from pytorch_lightning.trainer.states import RunningStage
from pytorch_lightning.utilities.data import _get_dataloader_init_args_and_kwargs, _reinstantiate_wrapped_cls
from torch.utils.data import DataLoader, DistributedSampler

from lightning_rudra.core.errors import ConfigurationError
from lightning_rudra.learner.simulation import SimulatedClient, SimulatedSampler
from lightning_rudra.strategy.fit_loop.simulated import SimulatedEpochLoop
from lightning_rudra.core.timing import TimingModel


def check_simulation(
    simulate: Optional[int], timing: Optional[TimingModel], sampling: Optional[str], overlap: bool
) -> None:
    """The arguments of RudraStrategy that concern simulated learners (at construction: nothing started)."""
    if simulate is None:
        if timing is not None:
            raise ConfigurationError(
                f"timing={timing!r} only orders the pushes of simulated learners: set simulate=λ too, "
                "or leave timing unset (real learners take the time they take)."
            )
        return
    if isinstance(simulate, bool) or not isinstance(simulate, int) or simulate < 1:
        raise ConfigurationError(
            f"simulate={simulate!r} is not valid: expected the number of learners to simulate, an "
            "integer >= 1, or None for real learner processes."
        )
    if timing is not None and not isinstance(timing, TimingModel):
        raise ConfigurationError(
            f"timing={timing!r} is not a timing model: expected one from lightning_rudra.core.timing, e.g. "
            "Homogeneous(), Jittered(spread=0.3), Stragglers({0: 3.0}) or Measured(times)."
        )
    if sampling == "shared":
        raise ConfigurationError(
            "sampling='shared' cannot be simulated: simulated learners read the fixed parts of "
            "sampling='static' (each its own DistributedSampler part). Leave sampling unset."
        )
    if overlap:
        raise ConfigurationError(
            "overlap=True cannot be simulated yet: a simulated learner computes on the weights of its "
            "last reply. Leave overlap unset with simulate."
        )


def simulated_dataloader(
    dataloader: Any, num_learners: int, protocol: str, timing: TimingModel, whole: bool
) -> DataLoader:
    """``dataloader`` (with the single-replica DistributedSampler Lightning gave it) dealing the batches of λ
    learners, each from the part of the data that Lightning's DistributedSampler gives a real learner of its rank. Its length
    is every learner's batches if ``whole``, else, until training starts, one learner's: Lightning's counts read
    in ``configure_optimizers`` (``estimated_stepping_batches``) mean one learner's steps, as for real ones."""
    sampler = getattr(dataloader, "sampler", None)
    if not isinstance(dataloader, DataLoader) or type(sampler) is not DistributedSampler or not dataloader.batch_size:
        raise ConfigurationError(
            "RudraStrategy(simulate=...) needs a train DataLoader over a map-style dataset with a batch_size and "
            "Lightning's own sampler, so that every simulated learner reads the part of the data a real learner of its rank "
            f"would; got {type(dataloader).__name__} with sampler {type(sampler).__name__}. An IterableDataset or a "
            "sampler of your own keeps one stream per process: run real learners (devices=λ) instead."
        )
    # Lightning's one-replica sampler holds the shuffle and seed (the global seed) that real learners' would
    parts: list[DistributedSampler] = [
        DistributedSampler(
            sampler.dataset,
            num_replicas=num_learners,
            rank=r,
            shuffle=sampler.shuffle,
            seed=sampler.seed,
            drop_last=sampler.drop_last,
        )
        for r in range(num_learners)
    ]
    batches = SimulatedSampler(parts, dataloader.batch_size, dataloader.drop_last, protocol, timing)
    batches.whole = whole
    args, kwargs = _get_dataloader_init_args_and_kwargs(dataloader, sampler, RunningStage.TRAINING)
    # a batch sampler excludes these (DataLoader's rule)
    kwargs.update(batch_sampler=batches, sampler=None, batch_size=1, shuffle=False, drop_last=False)
    return _reinstantiate_wrapped_cls(dataloader, *args, **kwargs)


def start_simulation(
    trainer: "pl.Trainer", loaders: list[Any], num_learners: int, client: SimulatedClient
) -> "SimulatedEpochLoop":
    """The simulated epoch for this ``fit``, installed; each learner goes on from the batches ``client``'s
    statistics say it took (restored with a checkpoint)."""
    samplers = [dl.batch_sampler for dl in loaders if isinstance(getattr(dl, "batch_sampler", None), SimulatedSampler)]
    if len(loaders) != 1 or len(samplers) != 1:
        raise ConfigurationError(
            f"RudraStrategy(simulate=...) trains on one train dataloader; got {len(loaders)}. Combine "
            "them into one dataset, or run real learners (devices=λ)."
        )
    samplers[0].taken = client.stats().batches
    loop = SimulatedEpochLoop(trainer, samplers[0], num_learners, client)
    loop.install()
    return loop
