"""The package has no import circle: module A importing B while B imports A.

The graph is built from the modules' source, so a circle is caught before it happens to work by
luck of import order. At import time (top-level imports; one under `if TYPE_CHECKING:` never runs)
there is none, and counting imports inside functions too, none either: a lower layer never calls
up into a higher one, even lazily.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import splitlab

ROOT = Path(splitlab.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def top_level_imports(
    tree: ast.Module, name: str, is_package: bool, modules: set[str], in_functions: bool = False
) -> set[str]:
    """The splitlab modules `tree` imports when it is imported (`in_functions`: or when any of its
    functions runs)."""
    found: set[str] = set()
    pending: list[ast.AST] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            pending.extend(node.orelse)
        elif in_functions and not isinstance(node, ast.Import | ast.ImportFrom):
            pending.extend(ast.iter_child_nodes(node))
        elif isinstance(node, ast.If | ast.Try | ast.With):
            for field in ("body", "orelse", "finalbody", "handlers"):
                pending.extend(getattr(node, field, []))
        elif isinstance(node, ast.ExceptHandler):
            pending.extend(node.body)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            package = name if is_package else name.rpartition(".")[0]
            for _ in range(node.level - 1):
                package = package.rpartition(".")[0]
            base = f"{package}.{node.module}" if node.level and node.module else package if node.level else node.module
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in modules else str(base))
    return {module for module in found if module in modules}


def import_graph(in_functions: bool = False) -> dict[str, set[str]]:
    paths = {module_name(path): path for path in ROOT.rglob("*.py")}
    return {
        name: top_level_imports(ast.parse(path.read_text()), name, path.name == "__init__.py", set(paths), in_functions)
        - {name}
        for name, path in paths.items()
    }


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle through each strongly connected group of modules (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_circles_are_found():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_relative_and_submodule_imports():
    graph = import_graph()
    assert "splitlab.algorithms.base" in graph["splitlab.algorithms.fedavg"]
    assert "splitlab.data.datasets" in graph["splitlab.data"]


def test_the_package_has_no_import_circle():
    assert circles(import_graph()) == []


def test_imports_inside_functions_close_no_circle_either():
    assert circles(import_graph(in_functions=True)) == []


def test_neither_the_settings_schema_nor_the_algorithms_reach_the_other_way():
    """config (the schema) is below the algorithms (whose Params build on it); splitlab.resolve joins them."""
    graph = import_graph(in_functions=True)
    assert not any(module.startswith("splitlab.algorithms") for module in graph["splitlab.config"])


def test_no_import_runs_back_up_the_layers():
    """benchmarks/import_layers.py's layers (docs/architecture.md's map, bottom to top), every import
    counted (type-only and inside functions too): no module imports one of a higher layer. Issue 34
    allowed up to 5; there are none, so a new one fails here (move the code, not the limit)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "import_layers.py"
    spec = importlib.util.spec_from_file_location("import_layers", path)
    assert spec is not None and spec.loader is not None
    layers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(layers)
    assert layers.upward_imports(layers.import_graph()) == []


def test_following_the_config_from_engine_run_enters_no_file_more_than_three_times(monkeypatch):
    """benchmarks/config_walk.py on tiny one-round runs (sfl_v2 in process, vertical, serialized):
    each call of a splitlab function given the run's config is a step; no file is entered more than
    3 times (issue 34 allowed 4), and no lower layer calls up into a higher one with the config."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "config_walk.py"
    spec = importlib.util.spec_from_file_location("config_walk", path)
    assert spec is not None and spec.loader is not None
    config_walk = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "config_walk", config_walk)  # its dataclass looks its module up
    spec.loader.exec_module(config_walk)
    walks = {name: config_walk.follow(config) for name, config in config_walk.RUNS.items()}
    assert {name: walk.steps[0] for name, walk in walks.items()} == dict.fromkeys(walks, ("splitlab.engine", "run"))
    assert {name: max(walk.entered().values()) for name, walk in walks.items()} == dict.fromkeys(walks, 3)
    assert {name: walk.calls_up for name, walk in walks.items()} == dict.fromkeys(walks, [])
