"""Rounds that do not wait for every learner (Dutta et al., "Slow and Stale Gradients Can Win the Race", AISTATS
2018; Chen et al., "Revisiting Distributed Synchronous SGD", 2016). Plain Python; words as in
:mod:`lightning_rudra.core.protocol`.

- **K-batch-sync** (``protocol="batchsync", k=K``, K defaults to λ): an update averages the first K gradients of the
  current weights, from any learners. A push is answered at once with the newest weights, so a fast learner may give
  several gradients to one round. With K = λ, one gradient per learner and no straggler, it is hardsync.
- **Backup learners** (``protocol="hardsync", backup=b``): a round takes the first λ - b learners' gradients, one per
  learner; its pushes wait for it to close, as under hardsync.

Under both, every gradient applied comes from the weights of the current clock (σ = 0): one that comes after its
round closed (its timestamp is older than the clock) is *late*: it is not applied, its push is answered at once with
the newest weights, and its batch is dealt again to whoever asks next (the shared epoch,
:meth:`~lightning_rudra.core.epoch.EpochPool.draw`'s ``late``), so no sample is lost for it.

A backup round also closes once every learner still training has a gradient in it but those waiting at a collective
(``away``): under the shared epoch the learners run out of batches at different moments, and one that has has
nothing more to push until the others meet it.
"""

from typing import AbstractSet

from lightning_rudra.core.config import ProtocolConfig
from lightning_rudra.core.pending import Pending


def is_late(config: ProtocolConfig, timestamp: int, clock: int) -> bool:
    """Whether a gradient of the weights of ``timestamp`` comes after its round closed (the server is at ``clock``)."""
    return config.discards_late and timestamp < clock


def round_ready(
    config: ProtocolConfig, pending: Pending, active: AbstractSet[int], away: AbstractSet[int], c: int
) -> bool:
    """Whether the update ``pending`` collects is due: ``active``, the learners still training, ``away`` those of
    them waiting at a collective, ``c`` the gradients an update averages (softsync, async, batchsync)."""
    if config.protocol != "hardsync":
        return pending.received >= c
    if active <= pending.learners:
        return True
    if not config.backup or not pending.learners:
        return False
    taken = len(pending.learners & active)
    return taken >= max(1, len(active) - config.backup) or (active - away) <= pending.learners
