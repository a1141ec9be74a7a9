"""The package's import graph flows one way: no cycle between hf_packing's modules, no private name across modules,
no part importing another part's private module, and each part imports only the parts below it (`LAYERS`);
`hf_packing.ops` never imports transformers.

A part's private modules (``patches/_spec.py``) are its own: what another part needs is a public name of that part's
``__init__``. The rule binds the package and the code users copy (``recipes/``); ``hf_packing._compat`` is a part of
its own (layer 0), not a private module of one. Tests and benchmarks are white-box instruments: they may import the
private modules they test, time or toggle (``tests/test_call.py`` tests ``patches/_call.py``; ``bench_step_cpu.py``
flips ``patches._vision.frozen_tower`` for its arms).

Every import statement counts, wherever it stands (module level, inside a function, under ``TYPE_CHECKING``): a lazy
import is for an optional package, never for hiding a cycle. The package ``__init__`` only names its lazy exports.
"""

from __future__ import annotations

import ast
import subprocess
import sys
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
    assert "hf_packing.packing.dataset" in graph and "hf_packing.patches._forward" in graph
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_no_private_name_crosses_a_module_boundary():
    _, private = import_graph()
    assert not private, private


def private_modules(importer: str, targets: set[str]) -> list[str]:
    """The modules of ``targets`` that are private to a part other than ``importer``'s (a ``_x`` below the part)."""
    return sorted(
        target
        for target in targets
        if part(target) != part(importer) and any(s.startswith("_") for s in target.split(".")[2:])
    )


def private_module_imports(graph: dict[str, set[str]]) -> list[str]:
    """The imports of `graph` from one part into another part's private module."""
    return [
        f"{name} imports {target}"
        for name, targets in sorted(graph.items())
        for target in private_modules(name, targets)
    ]


def copied_private_imports(folder: Path, modules: set[str]) -> list[str]:
    """The imports of a part's private module by the scripts under ``folder`` (outside the package)."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        targets = {target for target, _ in imports(path, folder, modules)}
        found += [f"{path.name} imports {target}" for target in private_modules("recipes", targets)]
    return found


def test_no_part_imports_another_parts_private_module():
    graph, _ = import_graph()
    assert not private_module_imports(graph), private_module_imports(graph)
    recipes = copied_private_imports(PACKAGE.parent / "recipes", set(graph))
    assert not recipes, recipes


def package_module_lookups(root: Path = PACKAGE) -> list[str]:
    """Every statement under ``root`` that touches ``sys.modules`` with a key naming the package (a string or f-string
    that mentions ``hf_packing``, or ``__name__`` / ``__package__``): a way round the layer rule that the import graph
    cannot see. (``_compat`` parks a placeholder for a Liger module there, which names no module of ours.)"""
    found = []
    for path in sorted(root.rglob("*.py")):
        source = path.read_text()
        for node in sorted(ast.walk(ast.parse(source)), key=lambda n: getattr(n, "lineno", 0)):
            if not isinstance(node, ast.stmt) or isinstance(node, ast.FunctionDef | ast.ClassDef | ast.If | ast.With):
                continue
            if isinstance(node, ast.For | ast.While | ast.Try | ast.AsyncFunctionDef | ast.AsyncWith | ast.AsyncFor):
                continue
            touches = any(
                isinstance(n, ast.Attribute)
                and n.attr == "modules"
                and isinstance(n.value, ast.Name)
                and n.value.id == "sys"
                for n in ast.walk(node)
            )
            text = ast.get_source_segment(source, node) or ""
            if touches and any(key in text for key in ("hf_packing", "__name__", "__package__")):
                found.append(f"{path.relative_to(root.parent)}:{node.lineno}")
    return found


def test_no_module_of_the_package_is_looked_up_in_sys_modules():
    assert not package_module_lookups(), package_module_lookups()


def test_the_sys_modules_check_finds_a_planted_lookup(tmp_path):
    """Negative control: the lookup `patches/prepared.py` once made to reach the packer, and two variants, are found;
    a lookup of another package's module is not."""
    root = tmp_path / "hf_packing"
    root.mkdir()
    (root / "guard.py").write_text(
        "import sys\n\n\ndef packs(loader):\n"
        '    stream = sys.modules.get("hf_packing.packing.dataset")\n'
        "    if stream is not None:\n"
        '        return sys.modules[f"hf_packing.{loader}"]\n'
        "    return __name__ in sys.modules\n"
    )
    (root / "compat.py").write_text('import sys\n\nsys.modules.pop("liger_kernel.transformers.model.x", None)\n')
    assert package_module_lookups(root) == ["hf_packing/guard.py:5", "hf_packing/guard.py:7", "hf_packing/guard.py:8"]


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


def test_the_private_module_check_finds_one(tmp_path):
    """Negative control: the collator importing ``patches._spec`` (module or name) is found; the patches importing
    their own ``_spec``, and anyone importing ``_compat`` or the public ``patches``, are not."""
    root = tmp_path / "hf_packing"
    (root / "patches").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "_compat.py").write_text("")
    (root / "patches" / "__init__.py").write_text("from ._spec import FAMILIES\nfrom .. import _compat\n")
    (root / "patches" / "_spec.py").write_text("FAMILIES = {}\n")
    (root / "collator.py").write_text("from .patches._spec import FAMILIES\nfrom . import _compat, patches\n")
    (root / "config.py").write_text("def f():\n    from .patches import _spec\n")
    graph, _ = import_graph(root)
    assert private_module_imports(graph) == [
        "hf_packing.collator imports hf_packing.patches._spec",
        "hf_packing.config imports hf_packing.patches._spec",
    ]
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "train.py").write_text(
        "from hf_packing.patches import _vision\nfrom hf_packing import _compat\n"
    )
    assert copied_private_imports(tmp_path / "recipes", set(graph) | {"hf_packing.patches._vision"}) == [
        "train.py imports hf_packing.patches._vision"
    ]


#: each part of the package and its layer: a module may import its own part and the parts of lower layers only
#: (what each part owns and may import is in its package docstring)
LAYERS = {
    "hf_packing": 8,  # the public names (lazy), used by the CLI only
    "hf_packing._compat": 0,
    "hf_packing.config": 0,
    "hf_packing.testing": 0,
    "hf_packing.ops": 1,
    "hf_packing.preprocess": 2,
    "hf_packing.parallel": 2,
    "hf_packing.patches": 3,
    "hf_packing.packing": 4,
    "hf_packing.collator": 5,
    "hf_packing.training": 6,
    "hf_packing.cli": 7,
}


def part(module: str) -> str:
    """The part of ``module`` (``hf_packing.ops.varlen`` -> ``hf_packing.ops``)."""
    return ".".join(module.split(".")[:2])


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """The imports of `graph` from a part into a part of the same or a higher layer (the package root excepted)."""
    return sorted(
        f"{name} imports {target}"
        for name, targets in graph.items()
        if name != "hf_packing"
        for target in targets
        if part(target) != part(name)
        and LAYERS[part(target)] >= LAYERS[part(name)]
        and (part(name), part(target)) != ("hf_packing.cli", "hf_packing")  # the CLI uses the public names
    )


def test_imports_flow_down_the_layers():
    graph, _ = import_graph()
    modules = {part(name) for name in graph}
    assert modules == set(LAYERS), f"parts without a layer, or layers without a part: {modules ^ set(LAYERS)}"
    assert sum(1 for p in PACKAGE.glob("*.py")) <= 8, "at most 8 modules directly in hf_packing/"
    assert not upward_imports(graph), upward_imports(graph)


def test_every_part_says_what_it_owns_and_may_import():
    for package in sorted(p for p in PACKAGE.iterdir() if (p / "__init__.py").exists()):
        doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
        assert len(doc) > 80, f"{package.name}/__init__.py has no docstring"
    for name in ("ops", "preprocess", "packing", "parallel", "patches", "training", "testing", "cli"):
        doc = ast.get_docstring(ast.parse((PACKAGE / name / "__init__.py").read_text()))
        assert "Owns:" in doc and "May import:" in doc, name


def test_ops_import_no_transformers():
    """Statically (no import statement names transformers) and at run time (importing the ops loads none)."""
    static = [
        f"{path.name}: {node.module or node.names[0].name}"
        for path in sorted((PACKAGE / "ops").glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Import | ast.ImportFrom)
        and any(
            (n or "").split(".")[0] == "transformers"
            for n in [getattr(node, "module", None), *(a.name for a in node.names)]
        )
    ]
    assert not static, static
    code = "import sys, hf_packing.ops.varlen, hf_packing.ops.loss, hf_packing.ops.linear_attention; "
    code += "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=PACKAGE.parent)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_layer_check_finds_an_upward_import():
    """Negative control: the patches importing the packer, and ops importing the patches, are both found."""
    graph = {
        "hf_packing.patches._forward": {"hf_packing.packing.dataset", "hf_packing.ops.loss"},
        "hf_packing.ops.loss": {"hf_packing.patches"},
        "hf_packing.packing.dataset": {"hf_packing.preprocess.images", "hf_packing.config"},
    }
    assert upward_imports(graph) == [
        "hf_packing.ops.loss imports hf_packing.patches",
        "hf_packing.patches._forward imports hf_packing.packing.dataset",
    ]


def test_the_public_names_are_unchanged_and_each_imports():
    """The package's public surface stayed what it was before the parts moved into subpackages."""
    import hf_packing

    assert sorted(hf_packing.__all__) == sorted(
        [
            *("apply_rmpad", "revert_rmpad", "supported_model_types", "plan_packs", "pack_dataset"),
            *("PackingConfig", "VisionCollator", "prepare_trainer", "end_distributed", "end_process"),
            *("PackedDataset", "WorkCost", "NoSamplesError", "TooManySkipsError", "PackingTelemetry"),
        ]
    )
    for name in hf_packing.__all__:
        assert callable(getattr(hf_packing, name)), name


def test_the_names_users_are_told_to_use_import_from_the_package():
    """The classes docs and recipes name (a pack stream, the cost model, the two errors, the callback) import from
    ``hf_packing`` and are the classes their modules define."""
    from hf_packing import NoSamplesError, PackedDataset, PackingTelemetry, TooManySkipsError, WorkCost
    from hf_packing.packing import balance, dataset, stats
    from hf_packing.training import telemetry

    assert PackedDataset is dataset.PackedDataset and WorkCost is balance.WorkCost
    assert NoSamplesError is stats.NoSamplesError and TooManySkipsError is stats.TooManySkipsError
    assert issubclass(TooManySkipsError, NoSamplesError) and PackingTelemetry is telemetry.PackingTelemetry


def test_the_tensor_layer_holds_no_evaluation_channel():
    """``hf_packing.ops`` is functions of tensors: no ContextVar and no attribute set on a model output (evaluation's
    and the telemetry's channel from the patched forward is `hf_packing.patches.recording`)."""
    found = [
        f"{path.name}:{node.lineno}"
        for path in sorted((PACKAGE / "ops").glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if (isinstance(node, ast.ImportFrom) and node.module == "contextvars")
        or (isinstance(node, ast.Import) and any(a.name == "contextvars" for a in node.names))
        or (isinstance(node, ast.Attribute) and node.attr in ("num_supervised_tokens", "num_correct_tokens"))
    ]
    assert not found, found
