"""The Trainer end to end under 2 CPU processes (torchrun, gloo): rank-equal steps, FSDP2 with text-only ranks, resume.

Each test launches tests/multiproc_train.py with torchrun as a subprocess with a timeout, so a hang fails the test
instead of hanging CI. The model is a tiny Qwen2.5-VL saved with `save_tiny_checkpoint` and reloaded with
`from_pretrained` after `apply_rmpad`; the data are parquet files written here, with PNG bytes for images.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import image

HELPER = Path(__file__).parent / "multiproc_train.py"
ROOT = Path(__file__).parents[1]
SHARDS = (5, 17, 44)  # deliberately uneven parquet files
MAX_LENGTH = 256


def write_parquet(path: Path, n: int, *, seed: int, start: int, images: str) -> None:
    """`n` LLaVA rows; `images`: "none" (text-only), "all" (1-2 PNGs each) or "mixed" (~half text-only)."""
    from datasets import Dataset, Features, Image, List, Value

    rng = np.random.default_rng(seed)
    features = Features({"image": List(Image()), "conversations": List({"from": Value("string"), "value": Value("string")})})
    rows = []
    for i in range(start, start + n):
        k = 0 if images == "none" else int(rng.integers(1, 3)) if images == "all" else int(rng.choice([0, 0, 1, 2]))
        pngs = []
        for j in range(k):
            buf = io.BytesIO()
            image(int(rng.integers(28, 120)), int(rng.integers(28, 120)), seed * 1000 + i * 10 + j).save(buf, "PNG")
            pngs.append({"bytes": buf.getvalue(), "path": None})
        question = "<image>\n" * k + f"Row {i}: describe " + "this " * int(rng.integers(0, 12))
        answer = "word " * int(rng.integers(2, 60))
        rows.append({"image": pngs, "conversations": [{"from": "human", "value": question},
                                                      {"from": "gpt", "value": answer}]})
    Dataset.from_list(rows, features=features).to_parquet(str(path))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from hf_packing.tiny import save_tiny_checkpoint

    return save_tiny_checkpoint("qwen2_5_vl", tmp_path_factory.mktemp("tiny") / "qwen2_5_vl")


@pytest.fixture(scope="module")
def uneven_data(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("uneven")
    files, start = [], 0
    for shard, n in enumerate(SHARDS):
        write_parquet(root / f"shard-{shard}.parquet", n, seed=shard, start=start, images="mixed")
        files.append(str(root / f"shard-{shard}.parquet"))
        start += n
    return files


def launch(work: Path, timeout: float, **config) -> tuple[subprocess.CompletedProcess | None, list[dict], float]:
    """torchrun --nproc_per_node 2 the helper; returns (process or None if it timed out, rank results, seconds)."""
    work.mkdir(parents=True, exist_ok=True)
    config = {"out": str(work / "out"), "output_dir": str(work / "trainer"), "max_length": MAX_LENGTH,
              "pg_timeout": 60, **config}
    (work / "config.json").write_text(json.dumps(config))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(HELPER),
           str(work / "config.json")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{Path(__file__).parent}",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)  # its own process group: a hang is killed with every rank
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return None, [], time.perf_counter() - t0
    seconds = time.perf_counter() - t0
    proc = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    results = [json.loads(p.read_text()) for p in sorted((work / "out").glob("rank*.json"))]
    return proc, results, seconds


def check_ok(proc, results, seconds, label: str) -> None:
    print(f"{label}: {seconds:.1f} s")
    assert proc is not None, f"{label}: torchrun hung past its timeout"
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    assert [r["rank"] for r in results] == [0, 1]
