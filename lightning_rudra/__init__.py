"""lightning_rudra: parameter-server training for PyTorch Lightning (Rudra, ICDM 2016).

Importing the package registers the strategy names "rudra" (async), "rudra_hardsync", "rudra_softsync",
"rudra_async" and "rudra_batchsync" in Lightning's StrategyRegistry.
"""

from lightning_rudra.core.errors import ConfigurationError, LearnerLostError, RudraError, ServerLostError
from lightning_rudra.core.protocol import ProtocolConfig, Server
from lightning_rudra.core.stats import Stats
from lightning_rudra.strategy import RudraStrategy

__all__ = ["RudraStrategy", "Stats", "ProtocolConfig", "Server"]
__all__ += ["RudraError", "LearnerLostError", "ServerLostError", "ConfigurationError"]  # the errors a user can catch
__version__ = "0.2.0.dev0"
