"""Layer 3, Lightning: :class:`RudraStrategy`, its launchers, loops, collectives and checkpoints. The only part of
the package that imports Lightning; :mod:`lightning_rudra.lightning` loads it a second time for the unified
``lightning`` package. Importing it registers the strategy's names in its flavour's StrategyRegistry."""

from pytorch_lightning.strategies import StrategyRegistry

from lightning_rudra.strategy.rudra import RudraStrategy
from lightning_rudra.strategy.step_times import StepTimes

RudraStrategy.register_strategies(StrategyRegistry)

__all__ = ["RudraStrategy", "StepTimes"]
