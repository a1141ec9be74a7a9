"""benchmarks/gpu_check.sh (``make gpu``): every GPU check in one command for a short lease. On CPU: the script
parses, the make targets exist, the carried wheels are pinned and allowed by pyproject, a failing stage does not stop
the next ones, and (slow) the whole dry run writes its outputs and summary."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
STAGES = ("env", "tests", "bench", "levers")


def run_check(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, Path]:
    """The script in dry mode with outputs under ``tmp_path``; ``env`` adds or replaces variables."""
    proc = subprocess.run(
        ["bash", str(SCRIPT)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OUT": str(tmp_path), "GPU_CHECK_DRY": "1", "PYTHON": sys.executable, **env},
    )
    return proc, tmp_path / "gpu"


def test_the_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_targets_run_the_script_and_download_pinned_wheels_pyproject_allows():
    gpu = subprocess.run(["make", "-n", "gpu"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "bash benchmarks/gpu_check.sh" in gpu and ".venv" not in gpu  # no network there: no venv build
    wheels = subprocess.run(["make", "-n", "gpu-wheels"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "pip download" in wheels and "--python-version 3.12" in wheels and "-d .whl" in wheels
    pins = dict(
        p.split("==") for p in re.search(r"^GPU_WHEELS := (.*)$", (ROOT / "Makefile").read_text(), re.M)[1].split()
    )
    assert {"datasets", "dill", "multiprocess"} <= set(pins)
    declared = re.findall(r'"(datasets[^"]*)"', (ROOT / "pyproject.toml").read_text())
    assert declared and Requirement(declared[0]).specifier.contains(pins["datasets"])


def test_a_failing_stage_does_not_stop_the_next_and_the_summary_is_printed_last(tmp_path):
    proc, out = run_check(tmp_path, PYTHON=str(tmp_path / "no-python"))
    assert proc.returncode == 1
    summary = (out / "summary.txt").read_text()
    assert proc.stdout.rstrip().endswith(summary.rstrip().splitlines()[-1])
    for stage in STAGES:
        assert re.search(rf"^{stage} +FAIL \(rc 127\)", summary, re.M), summary
    assert "tests: no junit xml" in summary


@pytest.mark.slow  # torch + transformers imported three times
def test_dry_run_writes_logs_junit_and_the_bench_table(tmp_path):
    proc, out = run_check(tmp_path, GPU_CHECK_TESTS="tests/test_gpu.py")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert {p.name for p in out.iterdir()} == {
        "env.txt",
        "pytest.log",
        "junit.xml",
        "bench.log",
        "levers.log",
        "summary.txt",
    }
    summary = (out / "summary.txt").read_text()
    assert re.search(r"^tests: 0 passed, 0 failed, 0 errors, \d+ skipped$", summary, re.M), summary
    assert "| 256 | frozen | rmpad+reference |" in summary and "host syncs per step" in summary
    assert "| 256 | trainable | no-ckpt+compile |" in summary  # the levers' table
    for stage in STAGES:
        assert re.search(rf"^{stage} +ok ", summary, re.M), summary
    assert "transformers supported:" in (out / "env.txt").read_text()


def test_bench_gpu_names_the_backward_node_and_forward_line_of_a_sync(monkeypatch):
    """bench_gpu's sync gate on CPU, with a stand-in: an op whose backward raises what
    ``set_sync_debug_mode("error")`` raises. Autograd reports it at its own frame; the diagnosis step
    (``detect_anomaly``) names the backward node and the forward line that created it, as the GPU report will."""
    import contextlib

    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_gpu

    monkeypatch.setattr(bench_gpu, "sync_debug_mode", lambda mode: contextlib.nullcontext())

    class SyncsInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            raise RuntimeError("called a synchronizing CUDA operation")

    x = torch.ones(3, requires_grad=True)

    def step() -> None:
        y = SyncsInBackward.apply(x)  # <- the report names this line
        y.sum().backward()

    with pytest.raises(RuntimeError) as info:
        step()
    assert bench_gpu.is_sync_error(info.value) and bench_gpu._in_backward(info.value)
    where = bench_gpu.backward_sync_origin(step)
    line = next(
        i for i, text in enumerate(Path(__file__).read_text().splitlines(), 1) if "# <- the report names" in text
    )
    assert where.startswith("backward node SyncsInBackward"), where
    assert f"test_gpu_check.py:{line} (step)" in where, where
    assert not bench_gpu.is_sync_error(RuntimeError("CUDA out of memory"))
