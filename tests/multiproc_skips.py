"""Helper for tests/test_skip_budget.py::test_two_processes_stop_at_the_same_row; run with torchrun --nproc_per_node 2.

Both ranks pack the same 1,000 rows, of which 9 in 10 name an image that is not there, with small planner windows so
packs close (and the ranks all_reduce once a batch, as DDP would) before the skip budget is checked at the 200th row.
Each rank writes `rank{r}.json` with the batches it reduced and the error, then re-raises it, as a training script
would: the run must end with an error on both ranks, never wait in a collective.

Usage: `python -m torch.distributed.run --standalone --nproc_per_node 2 tests/multiproc_skips.py OUT_DIR`
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: hf_packing, tests.helpers

from hf_packing.packing.dataset import pack_dataset  # noqa: E402
from hf_packing.packing.stats import TooManySkipsError  # noqa: E402
from tests.helpers import load_processor  # noqa: E402


def main(out: Path) -> None:
    from datasets import Dataset

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    rows = [
        {
            "image": [] if i % 10 == 0 else [f"coco/{i}.jpg"],
            "conversations": [
                {"from": "human", "value": ("" if i % 10 == 0 else "<image>\n") + f"Question {i}?"},
                {"from": "gpt", "value": "word " * (5 + i % 20)},  # 3 tokens a word: all fit max_length
            ],
        }
        for i in range(1000)
    ]
    train = pack_dataset(
        Dataset.from_list(rows),
        load_processor("qwen2_vl"),
        max_length=128,
        buffer_size=8,
        balance_window=1,
        disable_progress=True,
    )
    steps = 0
    try:
        for _ in torch.utils.data.DataLoader(train, batch_size=None, num_workers=2):
            dist.all_reduce(torch.ones(1))
            steps += 1
    except TooManySkipsError as err:
        out.mkdir(exist_ok=True)
        (out / f"rank{rank}.json").write_text(json.dumps({"steps": steps, "error": str(err)}))
        raise


if __name__ == "__main__":
    main(Path(sys.argv[1]))
