"""The names under which RudraStrategy is registered in a Lightning flavour's StrategyRegistry:
``Trainer(strategy="rudra")`` and one name per protocol (``"rudra_async"``...); what its repr says of the other
flavour."""

from typing import Any

from lightning_rudra.core.config import PROTOCOLS


def register_strategies(strategy_registry: Any, strategy: type) -> None:
    strategy_registry.register("rudra", strategy, description="Rudra parameter server (default: async)", override=True)
    for protocol in PROTOCOLS:
        strategy_registry.register(
            f"rudra_{protocol}",
            strategy,
            description=f"Rudra parameter server, {protocol}",
            override=True,
            protocol=protocol,
        )


def flavour_hint(flavour: str) -> str:
    """Which strategy the other flavour's Trainer takes: Lightning quotes the strategy's repr when it refuses it.
    ``flavour``: this one's package, ``pytorch_lightning`` or ``lightning.pytorch``."""
    ours, other = (("pytorch_lightning", "lightning_rudra"), ("lightning.pytorch", "lightning_rudra.lightning"))
    if flavour != ours[0]:
        ours, other = other, ours
    return f"[a `{ours[0]}` strategy: with `{other[0]}.Trainer`, use `{other[1]}.RudraStrategy`]"
