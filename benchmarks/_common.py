"""Shared helpers for the benchmark scripts: environment report, timing, and RESULTS.md sections.

Each script owns one section of ``benchmarks/RESULTS.md`` between ``<!-- name:start -->`` and
``<!-- name:end -->``; `write_section` replaces only that section (under a file lock, since several
scripts may finish at the same time) and keeps every other section as it is.
"""

from __future__ import annotations

import datetime as _dt
import fcntl
import importlib.metadata
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS.md"
#: order of the sections in a fresh RESULTS.md
SECTION_ORDER = (
    "bench_packing",
    "bench_index",
    "bench_balance",
    "bench_step_cpu",
    "bench_step_cpu_trl",
    "bench_step_cpu_frozen",
    "bench_syncs",
    "bench_gpu",
    "bench_levers",
)
_HEADER = (
    "# Benchmark results\n\n"
    "Each section is written by its script (`benchmarks/<name>.py`); re-running a script replaces only its own "
    "section. Numbers are medians over interleaved measured repeats after warm-up, unless a section says "
    "otherwise.\n"
)


def version_of(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def versions(extra: Iterable[str] = ()) -> str:
    names = ["torch", "transformers", "datasets", "trl", *extra]
    parts = [f"python {platform.python_version()}"] + [f"{n} {version_of(n)}" for n in names]
    return ", ".join(parts)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def ram_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float("nan")


def load_average() -> str:
    try:
        one, five, fifteen = os.getloadavg()
        return f"{one:.2f} / {five:.2f} / {fifteen:.2f}"
    except OSError:
        return "n/a"


def machine(cores_used: str) -> str:
    return f"{cpu_model()}, {os.cpu_count()} logical cores on the machine, {cores_used}, {ram_gib():.1f} GiB RAM"


def idlest_core(interval: float = 0.5) -> int:
    """The allowed core with the most idle time over ``interval`` seconds (from /proc/stat)."""
    allowed = sorted(os.sched_getaffinity(0))

    def idle() -> dict[int, int]:
        out = {}
        for line in Path("/proc/stat").read_text().splitlines():
            name, *fields = line.split()
            if name.startswith("cpu") and name != "cpu":
                out[int(name[3:])] = int(fields[3]) + int(fields[4])  # idle + iowait
        return out

    try:
        first = idle()
        time.sleep(interval)
        second = idle()
        return max(allowed, key=lambda c: second.get(c, 0) - first.get(c, 0))
    except (OSError, ValueError, IndexError):
        return allowed[-1]


def command_line() -> str:
    script = os.path.relpath(sys.argv[0], HERE.parent) if sys.argv and sys.argv[0] else "?"
    return " ".join(["python", shlex.quote(script), *map(shlex.quote, sys.argv[1:])])


def today() -> str:
    return _dt.date.today().isoformat()


def footer(
    started: float,
    machine_line: str,
    *,
    load_before: str | None = None,
    load_after: bool = False,
    extra: Iterable[str] = (),
) -> str:
    """The four lines that close every RESULTS.md section: date and duration (since ``started``, a
    ``time.time()``), versions (plus ``extra`` packages), machine, and the command that wrote it. ``load_before``
    (a `load_average` taken at the start) adds the load before and after; ``load_after`` adds the load at the end
    alone."""
    date = f"- Date: {today()}; took {time.time() - started:,.0f} s"
    if load_before is not None:
        date += f"; load average before (1/5/15 min): {load_before}, after: {load_average()}"
    elif load_after:
        machine_line += f"; load average {load_average()}"
    return "\n".join(
        [date, f"- Versions: {versions(extra)}", f"- Machine: {machine_line}", f"- Command: `{command_line()}`"]
    )


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


def interleaved(arms: dict[str, Callable[[], float]], *, warmup: int, repeats: int) -> dict[str, list[float]]:
    """Call every arm once per round, in the same order, ``warmup + repeats`` rounds; return the measured values.

    Each arm returns its own measurement (seconds, usually), so arms can time only the part that matters.
    """
    out: dict[str, list[float]] = {name: [] for name in arms}
    for round_ in range(warmup + repeats):
        for name, fn in arms.items():
            value = fn()
            if round_ >= warmup:
                out[name].append(value)
    return out


def write_section(name: str, body: str) -> Path:
    """Replace (or add) the ``name`` section of RESULTS.md, leaving the other sections untouched."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n{body.strip()}\n{end}"
    with open(RESULTS, "a+") as fh:  # the file itself is the lock: scripts may finish at the same time
        fcntl.flock(fh, fcntl.LOCK_EX)
        fh.seek(0)
        text = fh.read() or _HEADER
        if start in text and end in text:
            head, rest = text.split(start, 1)
            _, tail = rest.split(end, 1)
            text = head + block + tail
        else:
            text = _insert_in_order(text, name, block)
        fh.seek(0)
        fh.truncate()
        fh.write(text)
        fh.flush()
        fcntl.flock(fh, fcntl.LOCK_UN)
    return RESULTS


def _insert_in_order(text: str, name: str, block: str) -> str:
    """Put a new section before the first later section in `SECTION_ORDER`, else at the end."""
    later = SECTION_ORDER[SECTION_ORDER.index(name) + 1 :] if name in SECTION_ORDER else ()
    for other in later:
        marker = f"<!-- {other}:start -->"
        if marker in text:
            head, tail = text.split(marker, 1)
            return head + block + "\n\n" + marker + tail
    return text.rstrip("\n") + "\n\n" + block + "\n"


def md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
