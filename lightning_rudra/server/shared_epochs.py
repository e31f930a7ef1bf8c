"""The server's side of the shared epoch: one :class:`~lightning_rudra.core.epoch.EpochPool` per train dataloader,
opened by the first draw, and what the statistics count of it. Its methods run under the
:class:`~lightning_rudra.server.parameter_server.ParameterServer`'s lock."""

from typing import Any, Optional, Sequence

from lightning_rudra.core.epoch import EpochPlan, EpochPool
from lightning_rudra.core.stats import Stats


class SharedEpochs:
    def __init__(self, num_learners: int) -> None:
        self.num_learners = num_learners
        self.pools: dict[int, EpochPool] = {}  # per train dataloader

    def draw(  # 9 params: EpochPool.draw's seven, which pool, and the statistics its batches count in
        self,
        stats: Stats,
        pool: int,
        epoch: int,
        learner: int,
        plan: EpochPlan,
        want: int,
        trained: Optional[int],
        late: Sequence[int] = (),
        alone: bool = False,
    ) -> tuple[Optional[Any], int, str]:
        """:meth:`EpochPool.draw` of train dataloader ``pool``; the first one's batches count in ``stats``."""
        if pool not in self.pools:
            self.pools[pool] = EpochPool(plan, self.num_learners)
        indices, position, what = self.pools[pool].draw(epoch, learner, plan, want, trained, late, alone)
        if indices is not None and pool == 0:
            stats.batches[learner] = stats.batches.get(learner, 0) + -(-len(indices) // plan.batch_size)
            stats.redealt = self.pools[pool].redealt
        return indices, position, what

    def stop(self) -> None:
        """A learner stops training: every pool is spent (:meth:`EpochPool.stop`)."""
        for pool in self.pools.values():
            pool.stop()

    def lose(self, learner: int) -> None:
        """The batches dealt to a lost learner and not trained on are dealt again (:meth:`EpochPool.lose`)."""
        for pool in self.pools.values():
            pool.lose(learner)
