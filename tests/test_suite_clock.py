"""No test asserts a wall-clock limit: timings live in benchmarks/ (benchmarks/RESULTS.md), a hang guard is a
``@pytest.mark.timeout`` marker.

The check reads each module of tests/ as a syntax tree. A clock read is a call of ``time.perf_counter``,
``time.monotonic``, ``time.time`` or ``time.process_time`` (``_ns`` forms too), or of such a name imported from
``time``. An ``assert`` breaks the rule when its expression reads a clock or a local name bound, in the same
function (or module body), to an expression that reads one, or to an expression of such names (``elapsed = now -
start``). Printing a duration, or polling until a deadline before asserting something else, is not an assert on the
clock.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
CLOCKS = {"perf_counter", "monotonic", "time", "process_time"}
CLOCKS |= {f"{name}_ns" for name in CLOCKS}


def _clock_names(tree: ast.Module) -> set[str]:
    """Names bound by ``from time import perf_counter [as x]`` (a bare call of one of them reads the clock)."""
    return {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "time"
        for alias in node.names
        if alias.name in CLOCKS
    }


def _reads_clock(node: ast.AST, imported: set[str], timed: set[str]) -> bool:
    """Whether ``node`` calls a clock or reads a name in ``timed``."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            func = sub.func
            if isinstance(func, ast.Attribute) and func.attr in CLOCKS and getattr(func.value, "id", None) == "time":
                return True
            if isinstance(func, ast.Name) and func.id in imported:
                return True
        if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load) and sub.id in timed:
            return True
    return False


def _scopes(tree: ast.Module) -> list[ast.AST]:
    """The module body and every function: a name's binding is looked up in the scope that holds the assert."""
    return [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))]


def _own_nodes(scope: ast.AST) -> list[ast.AST]:
    """The nodes of ``scope`` outside its nested functions (those are scopes of their own)."""
    found, todo = [], list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        found.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return found


def clock_asserts(source: str, name: str = "<test>") -> list[str]:
    """``name:line`` of every assert of ``source`` that reads the wall clock (directly or through a local name)."""
    tree = ast.parse(source)
    imported = _clock_names(tree)
    found: set[int] = set()
    for scope in _scopes(tree):
        nodes = _own_nodes(scope)
        timed: set[str] = set()
        changed = True
        while changed:  # names bound to clock reads, then names bound to those, until nothing new
            changed = False
            for node in nodes:
                if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and node.value is not None:
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    if _reads_clock(node.value, imported, timed):
                        new = {t.id for tgt in targets for t in ast.walk(tgt) if isinstance(t, ast.Name)} - timed
                        changed |= bool(new)
                        timed |= new
        found |= {n.lineno for n in nodes if isinstance(n, ast.Assert) and _reads_clock(n, imported, timed)}
    return [f"{name}:{line}" for line in sorted(found)]


def test_no_test_asserts_a_wall_clock_limit():
    found = [hit for path in sorted(TESTS.rglob("*.py")) for hit in clock_asserts(path.read_text(), str(path))]
    assert not found, f"wall-clock asserts (timings: benchmarks/; a hang guard: pytest.mark.timeout): {found}"


def test_the_check_finds_each_kind_of_clock_assert():
    """Negative control: each form of a wall-clock assert is found; printing, polling and a fake clock are not."""
    bad = """
import time
from time import perf_counter as pc

def direct():
    start = time.monotonic()
    run()
    assert time.monotonic() - start < 30

def through_names():
    t0 = time.perf_counter()
    run()
    elapsed = time.perf_counter() - t0
    seconds = elapsed * 1000
    assert seconds < 5, "too slow"

def imported():
    begin = pc()
    assert pc() - begin < 1.0

start = time.time()
assert time.time() - start < 60
"""
    assert [hit.split(":")[1] for hit in clock_asserts(bad)] == ["8", "15", "19", "22"]
    good = """
import time

def printed():
    t0 = time.perf_counter()
    run()
    print(f"{time.perf_counter() - t0:.1f} s")
    assert result == 3

def polled():
    deadline = time.monotonic() + 30
    while busy() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not busy()

def fake_clock(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(module, "time", Namespace(perf_counter=lambda: clock[0]))
    assert logged["seconds"] == 2.5

def other_scope():
    start = time.monotonic()
    def inner(start=0):
        assert start == 0
"""
    assert clock_asserts(good) == []
