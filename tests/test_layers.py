"""The floor plan holds: no import cycle, no upward import, no private import across packages.

A package's facade (``__init__``) counts as the highest layer it imports from. Every module
of the three packages is parsed (imports inside functions included, ``if
TYPE_CHECKING:`` blocks left out) and checked against the layer table in the README's
"Architecture" section, so the table and the code cannot drift apart.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fkvstore", "kernels", "model_adapters")
# which packages each may import (public names only)
MAY_IMPORT = {"fkvstore": set(), "kernels": set(), "model_adapters": {"fkvstore", "kernels"}}


def layer_table() -> dict[str, list[set[str]]]:
    """``{package: [layer, ...]}`` lowest first, from the README's fenced layer table: one line
    per package, ``package:  a, b  <-  c  <-  d``."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```text\n(fkvstore:.*?)```", text, re.S)
    assert block, "README.md lacks the fenced layer table (```text, 'fkvstore: ...')"
    table = {}
    for line in block.group(1).strip().splitlines():
        package, layers = line.split(":", 1)
        table[package.strip()] = [{m.strip() for m in layer.split(",")}
                                  for layer in layers.split("<-")]
    return table


def modules() -> dict[str, Path]:
    """Dotted name -> file of every module of the three packages (``pkg`` for ``__init__``)."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(path: Path, name: str, known: set[str]) -> list[tuple[str, int]]:
    """``(imported module, line)`` for each import of a project module in ``path``."""
    is_package = path.name == "__init__.py"
    out = []

    def visit(node):
        if isinstance(node, ast.If) and _type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.extend((a.name, node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.append((sub if sub in known else base, node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return [(m, line) for m, line in out if m.split(".")[0] in PACKAGES]


def graph() -> dict[str, list[tuple[str, int]]]:
    found = modules()
    known = set(found)
    return {name: imports(path, name, known) for name, path in found.items()}


def layer_of(module: str, table, edges=None) -> int:
    """Index of ``module``'s layer in ``table`` (-1: not listed). A package's facade
    (``__init__``) sits in the highest layer it imports from, so a module above that may use
    the facade and one at or below it may not."""
    package, _, rest = module.partition(".")
    if not rest:
        return max((layer_of(t, table) for t, _ in (edges or graph())[module]
                    if t.startswith(package + ".")), default=0)
    first = rest.split(".")[0]
    for i, layer in enumerate(table[package]):
        if first in layer:
            return i
    return -1


def test_every_module_has_a_layer():
    table = layer_table()
    assert set(table) == set(PACKAGES)
    missing = [m for m in modules() if layer_of(m, table) == -1]
    assert not missing, f"modules missing from the README's layer table: {missing}"
    listed = {(p, m) for p, layers in table.items() for layer in layers for m in layer}
    present = {(m.split(".")[0], m.split(".")[1]) for m in modules() if "." in m}
    assert not listed - present, f"the layer table names modules that do not exist: " \
                                 f"{sorted(listed - present)}"


def test_no_upward_or_private_import_and_no_cycle():
    table = layer_table()
    problems = []
    edges = graph()
    for module, targets in edges.items():
        package = module.split(".")[0]
        mine = layer_of(module, table, edges)
        for target, line in targets:
            where = f"{module} (line {line}) imports {target}"
            other = target.split(".")[0]
            if other != package:
                if other not in MAY_IMPORT[package]:
                    problems.append(f"{where}: {package} may not import {other}")
                if any(part.startswith("_") for part in target.split(".")[1:]):
                    problems.append(f"{where}: a private module of another package")
                continue
            theirs = layer_of(target, table, edges)
            if target == package and module != package and theirs >= mine:
                problems.append(f"{where}: the package facade, which imports layer {theirs}, "
                                f"from layer {mine}")
            elif theirs > mine:
                problems.append(f"{where}: an upward import (layer {mine} -> {theirs})")
    assert not problems, "\n".join(problems)
    cycle = find_cycle({m: {t for t, _ in ts} for m, ts in edges.items()})
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``edges`` as a closed path, or None (depth-first search)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


@pytest.mark.parametrize("edges,cyclic", [
    ({"a": {"b"}, "b": {"c"}, "c": set()}, False),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, True),
    ({"a": {"a"}}, True),
    ({"a": {"b", "c"}, "b": {"d"}, "c": {"d"}, "d": set()}, False),
])
def test_the_cycle_finder_itself(edges, cyclic):
    assert (find_cycle(edges) is not None) == cyclic


def test_the_parser_sees_function_imports_and_skips_type_checking(tmp_path):
    source = tmp_path / "mod.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "import fkvstore.codec\n"
        "if TYPE_CHECKING:\n"
        "    from kernels import rvq_decode\n"
        "def f():\n"
        "    from fkvstore import layout\n"
        "    from kernels._plan import pow2\n")
    known = {"fkvstore.codec", "fkvstore.layout", "kernels.rvq_decode", "kernels._plan"}
    found = [m for m, _ in imports(source, "model_adapters.mod", known)]
    assert found == ["fkvstore.codec", "fkvstore.layout", "kernels._plan"]


def test_no_module_is_a_house():
    big = {m: n for m, p in modules().items()
           if (n := len(p.read_text().splitlines())) > 650}
    assert not big, f"modules over 650 lines: {big}"
