"""lightning_rudra for the unified ``lightning`` package (``import lightning as L``)::

    import lightning as L
    from lightning_rudra.lightning import RudraStrategy

    trainer = L.Trainer(strategy=RudraStrategy(protocol="async"), devices=4)

Importing this module registers "rudra", "rudra_hardsync", "rudra_softsync" and "rudra_async" in
``lightning.pytorch``'s StrategyRegistry, as importing ``lightning_rudra`` does in ``pytorch_lightning``'s.

One implementation, two flavours: the package's modules that use Lightning (the strategy, its launcher, loops and
callbacks) are loaded a second time, as submodules of this one, from their own source files with
``pytorch_lightning`` read as ``lightning.pytorch`` and ``lightning_fabric`` as ``lightning.fabric`` in their import
statements: how Lightning itself makes ``lightning`` from its standalone packages. The modules without Lightning (protocol, server, client,
shared memory, simulation) are the same objects in both flavours.
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


def _uses_lightning(name: str) -> bool:
    with open(os.path.join(_SOURCE, name), encoding="utf-8") as file:
        return re.search(r"^(from|import) (pytorch_lightning|lightning_fabric)\b", file.read(), re.M) is not None


_MODULES = tuple(sorted(name[:-3] for name in os.listdir(_SOURCE)
                        if name.endswith(".py") and name != "__init__.py" and _uses_lightning(name)))


def _rewrite(source: str) -> str:
    """The import statements only: strings and comments keep their words."""
    def imports(statement: re.Match) -> str:
        text = re.sub(r"\b(pytorch_lightning|lightning_fabric)\b", lambda found: _FLAVOUR[found.group(1)],
                      statement.group(0))
        return re.sub(r"\blightning_rudra\.(%s)\b" % "|".join(_MODULES), __name__ + r".\1", text)

    return re.sub(r"^[ \t]*(from|import)[ \t][^\n]*", imports, source, flags=re.M)


class _FlavourLoader(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``lightning_rudra.lightning.<module>`` for each module that uses Lightning, and loads it rewritten."""

    def find_spec(self, fullname: str, path: object = None, target: object = None):
        package, _, name = fullname.rpartition(".")
        if package != __name__ or name not in _MODULES:
            return None
        return importlib.util.spec_from_file_location(fullname, os.path.join(_SOURCE, name + ".py"), loader=self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        with open(module.__file__, encoding="utf-8") as file:
            code = compile(_rewrite(file.read()), module.__file__, "exec")  # tracebacks show the real file
        exec(code, module.__dict__)


__path__: list = []  # a package, whose submodules only the loader below finds
if not any(isinstance(finder, _FlavourLoader) for finder in sys.meta_path):
    sys.meta_path.insert(0, _FlavourLoader())

from lightning.pytorch.strategies import StrategyRegistry  # noqa: E402

from lightning_rudra.lightning.step_times import StepTimes  # noqa: E402
from lightning_rudra.lightning.strategy import RudraStrategy  # noqa: E402
from lightning_rudra.protocol import ProtocolConfig, Server  # noqa: E402
from lightning_rudra.stats import Stats  # noqa: E402

RudraStrategy.register_strategies(StrategyRegistry)

__all__ = ["RudraStrategy", "StepTimes", "Stats", "ProtocolConfig", "Server"]
