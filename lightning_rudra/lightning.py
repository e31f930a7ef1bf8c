"""lightning_rudra for the unified ``lightning`` package (``import lightning as L``)::

    import lightning as L
    from lightning_rudra.lightning import RudraStrategy

    trainer = L.Trainer(strategy=RudraStrategy(protocol="async"), devices=4)

Importing this module registers "rudra", "rudra_hardsync", "rudra_softsync", "rudra_async" and "rudra_batchsync" in
``lightning.pytorch``'s StrategyRegistry, as importing ``lightning_rudra`` does in ``pytorch_lightning``'s.

One implementation, two flavours: the package's Lightning layer (``lightning_rudra/strategy/``: the strategy, its
launchers, loops and callbacks) is loaded a second time, as ``lightning_rudra.lightning.strategy``, from its own
source files with ``pytorch_lightning`` read as ``lightning.pytorch`` and ``lightning_fabric`` as
``lightning.fabric`` in their import statements: how Lightning itself makes ``lightning`` from its standalone
packages. The layers without Lightning (``core``, ``transport``, ``server``, ``learner``) are the same objects in
both flavours.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import os
import re
import sys
import types

_SOURCE = os.path.dirname(os.path.abspath(__file__))
_FLAVOUR = {"pytorch_lightning": "lightning.pytorch", "lightning_fabric": "lightning.fabric"}
# loaded again in this flavour: the Lightning layer, and the public path of its callback
_MODULES = ("strategy", "step_times")


def _rewrite(source: str) -> str:
    """The import statements only: strings and comments keep their words."""

    def imports(statement: re.Match) -> str:
        text = re.sub(
            r"\b(pytorch_lightning|lightning_fabric)\b", lambda found: _FLAVOUR[found.group(1)], statement.group(0)
        )
        return re.sub(r"\blightning_rudra\.(%s)\b" % "|".join(_MODULES), __name__ + r".\1", text)

    return re.sub(r"^[ \t]*(from|import)[ \t][^\n]*", imports, source, flags=re.M)


class _FlavourLoader(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``lightning_rudra.lightning.<name>`` for each module and package under ``_MODULES``, and loads it
    rewritten from the file of ``lightning_rudra.<name>``."""

    def find_spec(self, fullname: str, path: object = None, target: object = None):
        prefix = __name__ + "."
        if not fullname.startswith(prefix) or fullname[len(prefix) :].partition(".")[0] not in _MODULES:
            return None
        where = os.path.join(_SOURCE, *fullname[len(prefix) :].split("."))
        if os.path.isdir(where):
            return importlib.util.spec_from_file_location(
                fullname, os.path.join(where, "__init__.py"), loader=self, submodule_search_locations=[]
            )
        return importlib.util.spec_from_file_location(fullname, where + ".py", loader=self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        assert module.__file__ is not None  # find_spec gives every module a file
        with open(module.__file__, encoding="utf-8") as file:
            code = compile(_rewrite(file.read()), module.__file__, "exec")  # tracebacks show the real file
        exec(code, module.__dict__)


__path__: list = []  # a package, whose submodules only the loader below finds
if not any(isinstance(finder, _FlavourLoader) for finder in sys.meta_path):
    sys.meta_path.insert(0, _FlavourLoader())

from lightning_rudra.core.errors import ConfigurationError, LearnerLostError, RudraError, ServerLostError  # noqa: E402
from lightning_rudra.core.protocol import ProtocolConfig, Server  # noqa: E402
from lightning_rudra.core.stats import Stats  # noqa: E402
from lightning_rudra.lightning.strategy import RudraStrategy, StepTimes  # noqa: E402  (registers the names)

__all__ = ["RudraStrategy", "StepTimes", "Stats", "ProtocolConfig", "Server"]
__all__ += ["RudraError", "LearnerLostError", "ServerLostError", "ConfigurationError"]  # the errors a user can catch
