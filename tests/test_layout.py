"""The source's shape: the folder tells the layers, imports only go down, no cycle, small files and functions.

Read from the source itself (`ast`), every import counted: those at a module's top and those inside functions.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "remat"

# Bottom to top. A module may import its own layer and those below it; the top modules (the command line, the
# package's public API) may import every layer.
LAYERS = ("base", "core", "models", "fastplan", "training", "serve", "bench")
TOP = ("cli", "__init__", "__main__")
MAX_FILE_LINES, MAX_FUNCTION_LINES = 500, 60


def _module(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> int:
    """The layer of `remat.<layer>...` (its index in LAYERS), the top for `remat.cli` and `remat` itself."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in TOP:
        return len(LAYERS)
    return LAYERS.index(parts[1])


def _imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(module imported, names taken from it, line) for every remat import in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "remat":
            found.append((node.module, [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            found += [(a.name, [], node.lineno) for a in node.names if a.name.split(".")[0] == "remat"]
    return found


FILES = sorted(SRC.rglob("*.py"))
MODULES = {_module(p) for p in FILES}


def _target(module: str, name: str) -> str:
    """`from module import name`: the module `name` is, where it is one, else `module`."""
    return f"{module}.{name}" if f"{module}.{name}" in MODULES else module


def _edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for p in FILES:
        me = _module(p)
        for module, names, _ in _imports(p):
            edges.setdefault(me, set()).update(_target(module, n) for n in names or [""])
    return {k: {m.rstrip(".") for m in v} - {k} for k, v in edges.items()}


def test_every_module_lives_in_a_declared_layer():
    stray = [m for m in MODULES if m != "remat" and m.split(".")[1] not in (*LAYERS, *TOP)]
    assert not stray, f"modules outside the declared layers: {stray}"


def test_imports_only_go_down():
    upward = [f"{a} imports {b}" for a, targets in _edges().items() for b in targets if _layer(b) > _layer(a)]
    assert not upward, "\n".join(upward)


def test_the_import_graph_has_no_cycle():
    edges, state, cycles = _edges(), {}, []

    def visit(m: str, path: list[str]) -> None:
        state[m] = "open"
        for n in sorted(edges.get(m, ())):
            if state.get(n) == "open":
                cycles.append(" -> ".join(path[path.index(n):] + [n]) if n in path else f"{m} -> {n}")
            elif n not in state:
                visit(n, [*path, n])
        state[m] = "done"

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    assert not cycles, "\n".join(cycles)


def test_no_module_takes_another_modules_private_names():
    taken = [f"{_module(p)}:{line} takes {module}.{n}" for p in FILES for module, names, line in _imports(p)
             for n in names if n.startswith("_") and not n.startswith("__")]
    assert not taken, "\n".join(taken)


def test_no_main_block_imports_the_command_line():
    found = []
    for p in FILES:
        for node in ast.parse(p.read_text()).body:
            if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
                found += [f"{_module(p)}" for sub in ast.walk(node) if isinstance(sub, ast.ImportFrom)
                          and sub.module == "remat.cli"]
    assert not found, found


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(SRC)))
def test_files_and_functions_fit_in_the_head(path: Path):
    text = path.read_text()
    assert len(text.splitlines()) <= MAX_FILE_LINES, f"{len(text.splitlines())} lines"
    functions = [n for n in ast.walk(ast.parse(text)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    long = [f"{n.name}: {n.end_lineno - n.lineno + 1} lines" for n in functions
            if n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, long


def test_no_context_variable_carries_a_setting():
    """State passes as arguments: the one context variable is the memory tracker's stack of watchers (an op's
    workspace reported to whoever measures around it), not a setting such as the world size."""
    made = [f"{_module(p)}: {ast.unparse(n)}" for p in FILES for n in ast.walk(ast.parse(p.read_text()))
            if isinstance(n, ast.Call) and ast.unparse(n.func).endswith("ContextVar")]
    assert len(made) == 1 and "remat_held_inside" in made[0], made


def test_the_layer_rule_catches_an_upward_import(tmp_path):
    """The rule itself: a core module importing the trainer is upward."""
    assert _layer("remat.core.plan") < _layer("remat.training.train") < _layer("remat.cli")
    assert _target("remat.training", "gate") == "remat.training.gate"
