"""The module import graph of src/splitlab: circles, and imports that run from a lower layer up.

Every import counts, type-only ones (under `if TYPE_CHECKING:`) and those inside functions
included, as a reader following the code meets them. The layers are docs/architecture.md's map,
bottom to top; a module takes the layer of the longest prefix listed in `LAYERS`. An import
"runs back up" when a module imports one of a higher layer.

    python benchmarks/import_layers.py [--list]
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

#: bottom to top: each layer may import the ones below it
LAYERS: list[tuple[str, ...]] = [
    (  # foundations: no knowledge of a run
        "splitlab.errors",
        "splitlab.targets",
        "splitlab.io",
        "splitlab.units",
        "splitlab.lazy",
        "splitlab.logs",
        "splitlab.random_streams",
        "splitlab.named_options",
        "splitlab.process_settings",
        "splitlab.metrics",
        "splitlab.json_text",
        "splitlab.codec",
        "splitlab.ledger",
    ),
    ("splitlab.losses", "splitlab.augment", "splitlab.schedules", "splitlab.optimizers"),  # the named options
    ("splitlab.config", "splitlab.plugins"),  # the settings
    ("splitlab.data", "splitlab.models", "splitlab.generation"),  # generation: decoding logits, below the runs
    ("splitlab.privacy",),  # what the roles use: defenses, keys, record, accounting
    (
        "splitlab.transport",
        "splitlab.roles",
        "splitlab.u_shaped",
        "splitlab.psi",
        "splitlab.loss_scale",
        "splitlab.strategies",
        "splitlab.secure_aggregation",
        "splitlab.vectorized",
    ),
    ("splitlab.algorithms",),
    ("splitlab.resolve",),
    ("splitlab.assembly",),
    (  # planning and placing a run
        "splitlab.run_weights",
        "splitlab.settings",
        "splitlab.build",
        "splitlab.ray_backend",
        "splitlab.cluster",
        "splitlab.checkpoints",
        "splitlab.rundir",
        "splitlab.callbacks",
        "splitlab.loggers",
        "splitlab.loop",
        "splitlab.net",
    ),
    ("splitlab.engine", "splitlab.finished_run", "splitlab.runmodel"),  # the way in; a finished run
    ("splitlab.splitgp_evaluation", "splitlab.splitgp_latency", "splitlab.audit", "splitlab.experiments"),
    ("splitlab.catalog", "splitlab.command_help", "splitlab.cli", "splitlab.__main__", "splitlab"),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer(module: str) -> int:
    best, found = -1, -1
    for number, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, found = len(prefix), number
    if found < 0:
        raise SystemExit(f"{module} is in no layer: add it to LAYERS")
    return found


def imports(path: Path, module: str, modules: set[str]) -> set[str]:
    """The splitlab modules `path` imports anywhere in its source."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:  # `import a.b.c` of a package's attribute: its module
                name = name.rpartition(".")[0]
            if name.startswith("splitlab") and name != module:
                found.add(name)
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in sorted((SRC / "splitlab").rglob("*.py"))}
    return {m: imports(p, m, set(files)) for m, p in files.items()}


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(module, what it imports) for every import of a module of a higher layer."""
    return sorted((m, d) for m, deps in graph.items() for d in deps if layer(d) > layer(m))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="list every circle and upward import")
    args = parser.parse_args()
    graph = import_graph()
    upward = upward_imports(graph)
    found = circles(graph)
    print(f"modules: {len(graph)}, imports: {sum(map(len, graph.values()))}")
    print(f"circles: {len(found)}")
    print(f"imports that run back up: {len(upward)}")
    if args.list:
        for component in found:
            print("circle:", " <-> ".join(component))
        for m, d in upward:
            print(f"up: {m} (layer {layer(m)}) -> {d} (layer {layer(d)})")


if __name__ == "__main__":
    main()
