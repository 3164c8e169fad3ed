"""The package's shape (docs: DESIGN.md section 2): layered imports, no cycles, small functions.

The checks read the sources with ``ast`` (nothing is imported), so they are fast and see every
``import flaxlight...`` / ``from flaxlight... import ...``, including those inside functions.
Only flaxlight-internal imports count (the optional integrations import third-party packages lazily).
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

PACKAGE = "flaxlight"
SRC = Path(__file__).resolve().parents[1] / "src" / PACKAGE

# Packages that count as one unit: a module inside them is the package.
PACKAGE_UNITS = {"callbacks", "loggers", "zoo"}

# A module imports only from its own layer (without cycles) or the layers below.
LAYERS: dict[str, int] = {
    **dict.fromkeys(["state", "metrics", "metric_objects", "optim", "models", "data", "checkpoint", "distributed",
                     "lean", "loggers", "registry", "progress", "messages", "writer", "export", "configyaml"], 0),
    **dict.fromkeys(["options", "step", "engine", "loop", "runfiles", "resume", "callbacks",
                     "view", "verbs"], 1),  # view / verbs: the trainer's mixins (TrainerView; predict, test)
    "trainer": 2,
    **dict.fromkeys(["config", "zoo"], 3),
    **dict.fromkeys(["tune", "cli", "plot", "__main__"], 4),
}
ROOT = PACKAGE  # ``from flaxlight import __version__``: the package itself, which re-exports everything
ROOT_LAYER = max(LAYERS.values())

MAX_FUNCTION_LINES = 70
MAX_TRAINER_LINES = 500


@dataclasses.dataclass(frozen=True)
class Import:
    importer: str  # unit, e.g. "config" or "callbacks"
    imported: str
    where: str  # "src/flaxlight/config.py:37"
    line: str  # the import statement's text

    def __str__(self) -> str:
        return f"{self.where}: {self.line}"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _unit(module: str) -> str:
    """``flaxlight.callbacks.base`` -> ``callbacks``; ``flaxlight.config`` -> ``config``; ``flaxlight`` -> ``flaxlight``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ROOT


def _sources() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(SRC.rglob("*.py"))}


def _imported_modules(node: ast.AST, module: str, is_package: bool, known: set[str]) -> list[str]:
    """The flaxlight modules an import statement names (``from flaxlight import x``: ``flaxlight.x``
    when x is a module, else the package ``flaxlight``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name.split(".")[0] == PACKAGE]
    assert isinstance(node, ast.ImportFrom)
    base = node.module or ""
    if node.level:  # relative: from . import x / from .base import y
        anchor = module.split(".") if is_package else module.split(".")[:-1]
        anchor = anchor[:len(anchor) - (node.level - 1)]
        base = ".".join(anchor + ([base] if base else []))
    if base.split(".")[0] != PACKAGE:
        return []
    return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]


def _imports() -> list[Import]:
    sources = _sources()
    known = set(sources)
    found = []
    for module, path in sources.items():
        if module == ROOT:
            continue  # flaxlight/__init__.py re-exports the public API; it is not a layer
        text = path.read_text()
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text, filename=str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            statement = " ".join(line.strip() for line in lines[node.lineno - 1:node.end_lineno])
            where = f"{path.relative_to(SRC.parents[1])}:{node.lineno}"
            for target in _imported_modules(node, module, path.name == "__init__.py", known):
                if _unit(target) != _unit(module):
                    found.append(Import(_unit(module), _unit(target), where, statement))
    return found


def _cycles(imports: list[Import]) -> list[list[str]]:
    """Strongly connected groups of more than one unit (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        graph.setdefault(imp.importer, set()).add(imp.imported)
        graph.setdefault(imp.imported, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def _layer(unit: str) -> int | None:
    return ROOT_LAYER if unit == ROOT else LAYERS.get(unit)


def test_the_import_scan_sees_the_package():
    imports = _imports()
    assert Import("config", "trainer", "", "") in {dataclasses.replace(i, where="", line="") for i in imports}
    assert {"trainer", "callbacks", "config", "cli"} <= {i.importer for i in imports}


def test_no_import_cycles():
    imports = _imports()
    problems = []
    for group in _cycles(imports):
        members = set(group)
        lines = [f"    {imp}   ({imp.importer} -> {imp.imported})" for imp in imports
                 if imp.importer in members and imp.imported in members]
        problems.append(f"import cycle between {', '.join(group)}:\n" + "\n".join(lines))
    assert not problems, ("Rule: flaxlight modules must not import each other in a cycle (DESIGN.md section 2); "
                          "move the shared code down a layer.\n" + "\n".join(problems))


def test_no_lower_layer_imports_a_higher_one():
    imports = _imports()
    units = {_unit(m) for m in _sources() if m != ROOT}
    missing = sorted(u for u in units if u not in LAYERS)
    problems = [f"module flaxlight.{u} is not in the layer table: add it to LAYERS in tests/test_architecture.py "
                f"(and to DESIGN.md section 2)" for u in missing]
    for imp in imports:
        src, dst = _layer(imp.importer), _layer(imp.imported)
        if src is None or dst is None:
            continue  # reported above
        if dst > src:
            problems.append(f"{imp.importer} (layer {src}) imports {imp.imported} (layer {dst}): {imp}")
    assert not problems, ("Rule: a module imports only from its own layer or lower ones (DESIGN.md section 2).\n"
                          + "\n".join(problems))


def _functions(tree: ast.AST, prefix: str = ""):
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = f"{prefix}{node.name}"
            yield name, node
            yield from _functions(node, f"{name}.<locals>.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")
        else:
            yield from _functions(node, prefix)


def test_no_function_is_longer_than_the_limit():
    problems = []
    for module, path in _sources().items():
        for name, node in _functions(ast.parse(path.read_text(), filename=str(path))):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                problems.append(f"{path.relative_to(SRC.parents[1])}:{node.lineno} {module}.{name} is {length} lines")
    assert not problems, (f"Rule: no function or method over {MAX_FUNCTION_LINES} lines; split these:\n"
                          + "\n".join(problems))


def test_trainer_module_is_small():
    path = SRC / "trainer.py"
    length = len(path.read_text().splitlines())
    assert length <= MAX_TRAINER_LINES, (
        f"Rule: src/flaxlight/trainer.py stays at most {MAX_TRAINER_LINES} lines (DESIGN.md section 2); it has "
        f"{length}. Move machinery into engine.py / loop.py / resume.py / runfiles.py.")


@pytest.mark.parametrize("unit, expected", [("flaxlight.callbacks.base", "callbacks"), ("flaxlight.config", "config"),
                                            ("flaxlight", ROOT)])
def test_units(unit, expected):
    assert _unit(unit) == expected
