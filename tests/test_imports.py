"""The package's import graph flows one way: no cycle between hf_packing's modules, no private name across modules.

Every import statement counts, wherever it stands (module level, inside a function, under ``TYPE_CHECKING``): a lazy
import is for an optional package, never for hiding a cycle. The package ``__init__`` only names its lazy exports.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hf_packing"


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, root: Path, modules: set[str]) -> list[tuple[str, str]]:
    """(imported hf_packing module, imported name or "") for every import statement of the file at `path`."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names if alias.name in modules]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                if submodule in modules:
                    found.append((submodule, ""))
                elif target in modules:
                    found.append((target, alias.name))
    return found


def import_graph(root: Path = PACKAGE) -> tuple[dict[str, set[str]], list[str]]:
    """{module: the hf_packing modules it imports} and the private names imported from another module."""
    files = {module_name(p, root): p for p in root.rglob("*.py")}
    graph, private = {}, []
    for name, path in files.items():
        if name == "hf_packing":  # lazy re-exports: `hf_packing.X` resolves X's module on first use
            graph[name] = set()
            continue
        edges = imports(path, root, set(files))
        graph[name] = {target for target, _ in edges if target != name}
        private += [f"{name} imports {target}.{n}" for target, n in edges if n.startswith("_") and n != "__version__"]
    return graph, private


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a closed path [a, b, ..., a], or None (depth-first search, colours)."""
    colour, stack = dict.fromkeys(graph, 0), []

    def visit(node: str) -> list[str] | None:
        colour[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if colour.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if colour.get(nxt) == 0 and (cycle := visit(nxt)):
                return cycle
        colour[node] = 2
        stack.pop()
        return None

    for node in sorted(graph):
        if colour[node] == 0 and (cycle := visit(node)):
            return cycle
    return None


def test_the_import_graph_has_no_cycle():
    graph, _ = import_graph()
    assert "hf_packing.stream" in graph and "hf_packing.patches._forward" in graph
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_no_private_name_crosses_a_module_boundary():
    _, private = import_graph()
    assert not private, private


def test_the_checks_find_a_cycle_and_a_private_import(tmp_path):
    """Negative control on a tiny package: a -> b -> a (the back edge lazy, in a function), `from .b import _x`."""
    root = tmp_path / "hf_packing"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "a.py").write_text("from .b import _helper\n")
    (root / "b.py").write_text("def _helper():\n    from . import a\n")
    (root / "c.py").write_text("from . import b\n")
    graph, private = import_graph(root)
    assert graph == {
        "hf_packing": set(),
        "hf_packing.a": {"hf_packing.b"},
        "hf_packing.b": {"hf_packing.a"},
        "hf_packing.c": {"hf_packing.b"},
    }
    assert find_cycle(graph) == ["hf_packing.a", "hf_packing.b", "hf_packing.a"]
    assert private == ["hf_packing.a imports hf_packing.b._helper"]
    assert find_cycle({"x": {"y"}, "y": set()}) is None
