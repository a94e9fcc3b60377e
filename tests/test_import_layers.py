"""The package's import graph (read with `ast`, function-level imports included) against the layer order
written once in docs/architecture.md: no cycle, and no import from a lower layer to a higher one."""

from __future__ import annotations

import ast
import fnmatch
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "areal_jax"


def _layers() -> list[tuple[str, list[str]]]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"```layers\n(.*?)```", text, re.S)
    assert block, "docs/architecture.md has no ```layers block"
    layers = []
    for line in block.group(1).strip().splitlines():
        name, patterns = line.split(":", 1)
        layers.append((name.strip(), patterns.split()))
    return layers


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the package's modules it imports (a `from X import name` of a submodule counts as that module)."""
    edges: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative import
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    targets.append(full if full in modules else base)
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            edges[name] |= {t for t in targets if t in modules and t != name}
    return edges


def _layer_of(module: str, layers: list[tuple[str, list[str]]]) -> int:
    for index, (_, patterns) in enumerate(layers):
        if any(fnmatch.fnmatchcase(module, pattern) for pattern in patterns):
            return index
    raise AssertionError(f"{module} is in no layer of docs/architecture.md: add it to one")


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return _imports(_modules())


def test_every_import_runs_to_its_own_layer_or_below(graph):
    layers = _layers()
    upward = [
        f"{a} ({layers[_layer_of(a, layers)][0]}) -> {b} ({layers[_layer_of(b, layers)][0]})"
        for a, targets in sorted(graph.items())
        for b in sorted(targets)
        if _layer_of(b, layers) > _layer_of(a, layers)
    ]
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_the_module_graph_has_no_cycle(graph):
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                cycles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target, [*path, target])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_the_checker_sees_function_level_and_package_imports():
    """The graph reads imports inside functions (where cycles hide) and resolves `from pkg import module`."""
    graph = _imports(_modules())
    assert "areal_jax.weights.direct" in graph["areal_jax.weights"]  # the package's face imports it
    assert "areal_jax.jobs.sft" in graph["areal_jax.jobs.starting_policy"]
    assert "areal_jax.jobs.train" in graph["areal_jax.cli"]  # imported inside main()
