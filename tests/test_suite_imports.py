"""The test suite's own imports: no module imports a test module or conftest.py, and the shared helpers are
imported one way, ``from tests.helpers import ...``.

A test module imported by another runs twice under two names (pytest imports it as ``test_x``, the importer as
``tests.test_x``), and so did conftest.py when it was imported both as ``conftest`` and ``tests.conftest``. Every
import line counts, in the scripts tests/ launches and in the scripts those write out (an import inside a string).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: `[from] [tests.]conftest|test_*|helpers|kernels` as the imported module, or imported from `tests`
IMPORT = re.compile(
    r"^\s*(?:from\s+(?P<from>[\w.]+)\s+import\s+(?P<names>[\w\s,()]+?)\s*(?:#.*)?$|import\s+(?P<modules>[\w\s,.]+?)\s*(?:#.*)?$)"
)


def _bad(module: str) -> str | None:
    """Why importing ``module`` breaks the rule, or None."""
    last = module.removeprefix("tests.")
    if last == "conftest":
        return "imports conftest (fixtures only; shared helpers are in tests/helpers.py)"
    if last.startswith("test_"):
        return f"imports the test module {last} (move what it shares to tests/helpers.py)"
    if module in ("helpers", "kernels"):
        return f"imports {module} bare (import it as tests.{module})"
    return None


def violations(files: list[Path]) -> list[str]:
    """``path:line: why`` for every import line of ``files`` that breaks the rule."""
    found = []
    for path in files:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not (m := IMPORT.match(line)):
                continue
            if m["from"] == "tests":
                modules = [f"tests.{name}" for name in re.findall(r"\w+", m["names"])]
            elif m["from"]:
                modules = [m["from"]]
            else:
                modules = [part.split()[0] for part in m["modules"].split(",") if part.strip()]
            found += [f"{path.relative_to(path.parents[1])}:{n}: {why}" for mod in modules if (why := _bad(mod))]
    return found


def test_no_module_imports_a_test_module_or_conftest():
    files = sorted((ROOT / "tests").glob("*.py")) + sorted((ROOT / "benchmarks").glob("*.py"))
    assert any(p.name == "multiproc_sp.py" for p in files) and any(p.name == "bench_syncs.py" for p in files)
    assert not violations(files), "\n".join(violations(files))


def not_fixtures(source: str) -> list[str]:
    """The top-level names ``source`` defines that are neither a fixture nor a ``pytest_`` hook (constants, helpers)."""
    tree = ast.parse(source)
    names = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            fixture = any("fixture" in ast.unparse(d) for d in getattr(node, "decorator_list", []))
            if not (fixture or node.name.startswith("pytest_")):
                names.append(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            names += [ast.unparse(t) for t in getattr(node, "targets", [getattr(node, "target", None)])]
    return names


def test_conftest_holds_only_fixtures_and_hooks():
    assert not not_fixtures((ROOT / "tests" / "conftest.py").read_text())
    control = "import pytest\nX = 1\n@pytest.fixture\ndef f():\n    pass\ndef helper():\n    pass\n"
    control += "def pytest_configure(config):\n    pass\n"
    assert not_fixtures(control) == ["X", "helper"]  # negative control


def test_the_check_finds_each_kind_of_import(tmp_path):
    """Negative control on a tiny tree: each way of importing conftest, a test module or a helper bare is found,
    in a script written out as a string too; the one allowed way, and look-alike names, are not."""
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_a.py").write_text(
        "import os, conftest\n"
        "from conftest import image\n"
        "from tests.conftest import FIXTURES  # noqa: E402\n"
        "from tests import conftest, test_b\n"
        "    from tests.test_b import shared\n"
        "from test_b import (\n    shared,\n)\n"
        "import tests.test_b\n"
        'SCRIPT = """\nfrom helpers import load_processor\n"""\n'
        "from kernels import install_kernel\n"
    )
    (tests / "test_b.py").write_text(
        "from tests.helpers import image, torchrun\n"
        "from tests.kernels import install_kernel\n"
        "from hf_packing.testing.tiny import MODEL_TYPES\n"
        "import contest_entries, testing\n"
        "# from conftest import image (a comment)\n"
    )
    found = violations(sorted(tests.glob("*.py")))
    assert [line.split(":")[1] for line in found] == ["1", "2", "3", "4", "4", "5", "6", "9", "11", "13"], found
    assert all(line.startswith("tests/test_a.py:") for line in found), found
