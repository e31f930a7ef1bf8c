"""Layer 3, Lightning: :class:`RudraStrategy`, its launchers, loops, collectives and checkpoints. The only part of
the package that imports Lightning; :mod:`lightning_rudra.lightning` loads it a second time for the unified
``lightning`` package. Importing it registers the strategy's names in its flavour's StrategyRegistry."""

import warnings

from pytorch_lightning.strategies import StrategyRegistry

from lightning_rudra.strategy.registry import register_strategies
from lightning_rudra.strategy.rudra import RudraStrategy
from lightning_rudra.strategy.step_times import StepTimes

register_strategies(StrategyRegistry, RudraStrategy)

# pytorch_lightning 2.6 makes torch's LeafSpec, which torch 2.13 deprecates, for every batch it moves to a device:
# a warning in every learner and stage that no user can act on
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning)

__all__ = ["RudraStrategy", "StepTimes"]
