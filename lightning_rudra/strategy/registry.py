"""The names under which RudraStrategy is registered in a Lightning flavour's StrategyRegistry:
``Trainer(strategy="rudra")`` and one name per protocol (``"rudra_async"``...)."""

from typing import Any

from lightning_rudra.core.config import PROTOCOLS


def register_strategies(strategy_registry: Any, strategy: type) -> None:
    strategy_registry.register(
        "rudra", strategy, description="Rudra parameter server (default: 1-softsync)", override=True
    )
    for protocol in PROTOCOLS:
        strategy_registry.register(
            f"rudra_{protocol}",
            strategy,
            description=f"Rudra parameter server, {protocol}",
            override=True,
            protocol=protocol,
        )
