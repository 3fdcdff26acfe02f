"""model_adapters' one rule beyond the floor plan of tests/test_layers.py (which checks the
layer order and private names): only the ``store`` layer imports fkvstore."""

from __future__ import annotations

import ast
from pathlib import Path

import model_adapters

PACKAGE = Path(model_adapters.__file__).parent


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module


def test_only_the_store_layer_imports_fkvstore():
    wrong = [
        f"{path.relative_to(PACKAGE)} imports {name}"
        for path in PACKAGE.rglob("*.py")
        if path.relative_to(PACKAGE).parts[0] != "store"
        for name in _imports(path)
        if name.split(".")[0] == "fkvstore"
    ]
    assert not wrong, "\n".join(wrong)
    assert any(name.split(".")[0] == "fkvstore"
               for path in (PACKAGE / "store").glob("*.py") for name in _imports(path))
