"""model_adapters' import rule: models <- quant <- caches <- store <- experiments, each layer
importing only those to its left; only store imports fkvstore; only public kernels names."""

from __future__ import annotations

import ast
from pathlib import Path

import model_adapters

PACKAGE = Path(model_adapters.__file__).parent
ORDER = ["models", "quant", "caches", "store", "experiments"]


def _layer(path: Path) -> str | None:
    rel = path.relative_to(PACKAGE).parts
    name = rel[0].removesuffix(".py")
    return name if name in ORDER else None


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module
            yield from (f"{node.module}.{a.name}" for a in node.names)


def test_layers_import_only_to_their_left():
    wrong = []
    for path in PACKAGE.rglob("*.py"):
        layer = _layer(path)
        if layer is None:
            continue
        allowed = ORDER[: ORDER.index(layer) + 1]
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] == "model_adapters" and len(parts) > 1 and parts[1] in ORDER \
                    and parts[1] not in allowed:
                wrong.append(f"{path.relative_to(PACKAGE)} imports {name}")
            if parts[0] == "fkvstore" and layer != "store":
                wrong.append(f"{path.relative_to(PACKAGE)} imports {name} outside store/")
            if parts[0] in ("kernels", "fkvstore") and any(p.startswith("_") for p in parts[1:]):
                wrong.append(f"{path.relative_to(PACKAGE)} imports the private {name}")
    assert not wrong, "\n".join(wrong)
