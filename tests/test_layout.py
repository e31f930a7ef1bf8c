"""The package's layers, held by its imports: Lightning only under ``strategy/``, and every layer imports only the
layers below it (core ← transport ← server ← learner ← strategy)."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "lightning_rudra"
LIGHTNING = ("pytorch_lightning", "lightning", "lightning_fabric", "lightning_utilities", "torchmetrics")
LAYERS = ("core", "transport", "server", "learner", "strategy")


def imports(path: Path) -> set[str]:
    """Every module a file imports, at any depth (a function-level import counts too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def files(layer: str) -> list[Path]:
    return sorted((PACKAGE / layer).rglob("*.py"))


@pytest.mark.parametrize("layer", LAYERS[:-1])
def test_lightning_is_imported_only_under_strategy(layer):
    for path in files(layer):
        used = {name for name in imports(path) if name.split(".")[0] in LIGHTNING}
        assert not used, f"{path.relative_to(PACKAGE)} imports {sorted(used)}: Lightning belongs under strategy/"


@pytest.mark.parametrize("layer", LAYERS)
def test_a_layer_imports_only_the_layers_below_it(layer):
    above = LAYERS[LAYERS.index(layer) + 1 :]
    for path in files(layer):
        upward = {
            name
            for name in imports(path)
            if name.startswith("lightning_rudra.") and name.split(".")[1] in above or name == "lightning_rudra"
        }
        assert not upward, f"{path.relative_to(PACKAGE)} imports {sorted(upward)}, above its layer ({layer})"


def test_every_module_of_the_package_is_in_a_layer_or_the_public_face():
    top = {p.name for p in PACKAGE.glob("*.py")}
    assert top == {"__init__.py", "lightning.py", "timing.py", "step_times.py"}, top
    assert {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"} == set(LAYERS)
