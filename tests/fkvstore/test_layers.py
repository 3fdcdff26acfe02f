"""Imports inside fkvstore flow one way, as the layer table in ``fkvstore/__init__.py`` says."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import fkvstore

PACKAGE = Path(fkvstore.__file__).parent


def layer_table() -> dict[str, int]:
    """``{module: layer}`` from the table in the package docstring; ``codec/`` names a package
    (its modules, in parentheses, share its layer)."""
    lines = fkvstore.__doc__.splitlines()
    rule = next(line for line in lines if line.startswith("====="))
    (l0, l1), (m0, m1) = [m.span() for m in re.finditer(r"=+", rule)][:2]
    layers: dict[str, int] = {}
    layer = None
    body = lines[lines.index(rule) + 3 :]  # after the header and its rule
    for line in body[: body.index(rule)]:
        if line[l0:l1].strip():
            layer = int(line[l0:l1])
        cell = re.sub(r"\(.*?\)", "", line[m0:m1 + 1])
        for name in re.findall(r"``([\w/]+)``", cell):
            layers[name.rstrip("/")] = layer
    return layers


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(parts)


def layer_of(module: str, layers: dict[str, int]) -> int:
    if module in ("", "fkvstore"):
        return layers["archive"]  # the package itself re-exports the facade
    return layers[module.split(".")[0]]


def imported_modules(path: Path) -> set[str]:
    """fkvstore modules imported by the file, relative to the package (``""``: the package)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "fkvstore"}
        elif isinstance(node, ast.ImportFrom) and node.module and (
                node.module.split(".")[0] == "fkvstore"):
            if node.module == "fkvstore":
                found |= {f"fkvstore.{a.name}" if (PACKAGE / a.name).exists()
                          or (PACKAGE / f"{a.name}.py").exists() else "fkvstore"
                          for a in node.names}
            else:
                found.add(node.module)
    return {m.removeprefix("fkvstore").lstrip(".") for m in found}


def test_every_module_has_a_layer():
    layers = layer_table()
    modules = {module_name(p).split(".")[0] for p in PACKAGE.rglob("*.py")} - {""}
    assert modules <= set(layers), sorted(modules - set(layers))


def test_imports_flow_one_way():
    layers = layer_table()
    wrong = []
    for path in PACKAGE.rglob("*.py"):
        me = module_name(path)
        if me == "":
            continue  # the package's __init__ re-exports the public names
        mine = layer_of(me, layers)
        for other in imported_modules(path):
            if layer_of(other, layers) > mine:
                wrong.append(f"{me} (layer {mine}) imports {other or 'fkvstore'} "
                             f"(layer {layer_of(other, layers)})")
    assert not wrong, wrong
