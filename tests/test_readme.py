"""Every ```python block of README.md runs as written, in a fresh process and an empty directory (CPU, offline)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT

BLOCKS = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), flags=re.S | re.M)


def test_the_readme_has_python_blocks_and_the_first_trains():
    assert BLOCKS and ".train()" in BLOCKS[0]


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs_as_written(tmp_path, index):
    """The first block (the Trainer example) must train a step and evaluate: its log lines carry train_loss and
    eval_token_accuracy."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "CUDA_VISIBLE_DEVICES": "",
    }
    (tmp_path / "block.py").write_text(BLOCKS[index])
    proc = subprocess.run(
        [sys.executable, "block.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    if index == 0:
        print(re.findall(r"\{'(?:eval|train)_.*?\}", proc.stdout + proc.stderr))
        assert "'train_loss'" in proc.stdout + proc.stderr and "'eval_token_accuracy'" in proc.stdout + proc.stderr
