"""benchmarks/bench_levers.py ``--dry``: every lever arm of the GPU run on CPU with a tiny model, so that run cannot
fail on a typo (no timing is read here). Each arm either trains a step, with the same first-step loss as the
checkpointed arm (lr=0, one model: a lever that changed the math would show), its memory prediction and a profiler
summary, or says why it cannot run on this machine (Liger's Triton kernels and torch's FA3 need a GPU)."""

from __future__ import annotations

import re
import sys

from tests.helpers import ROOT


def test_every_arm_runs_or_says_why():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_levers

    body = bench_levers.main(["--dry", "--vision", "trainable"])
    rows = {m[1]: m[2] for m in re.finditer(r"^\| 256 \| trainable \| ([^|]+?) \| (.*)$", body, re.M)}
    print(body)
    assert set(rows) == set(bench_levers.ARMS), rows
    losses = {}
    for arm, rest in rows.items():
        cells = [c.strip() for c in rest.rstrip(" |").split("|")]
        if arm in ("no-ckpt+liger", "no-ckpt+fa3"):
            assert re.search(r"need a GPU|unavailable|not installed", cells[0]), (arm, cells)
            continue
        assert cells[0] == "n/a (dry)" and cells[-3].endswith("MiB"), (arm, cells)
        losses[arm] = float(cells[-2])
        # its profiled step: some op ranked first with its share (which op leads is timing, not asserted)
        assert re.search(rf"^- 256/trainable {re.escape(arm)}: \S.* \d+%", body, re.M), arm
    assert len(set(losses.values())) == 1, losses
