"""Helper for tests/test_stream.py::test_two_processes_with_uneven_shards; run with torchrun --nproc_per_node 2.

Rank 0 writes a parquet dataset in three deliberately uneven shards (5 / 17 / 44 rows, images embedded as bytes, one
corrupt image and one overlong row); both ranks stream it with `datasets` (streaming=True), pack it, and iterate a
2-worker DataLoader doing one gloo all_reduce per batch, as DDP would. Unequal pack counts would hang the
all_reduce until the process-group timeout. Each rank writes `rank{r}.json` with its packs and stats.

Usage: `python -m torch.distributed.run --standalone --nproc_per_node 2 tests/multiproc_stream.py WORK_DIR OUT_DIR`
"""

from __future__ import annotations

import datetime
import io
import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: hf_packing, tests.helpers

from hf_packing.packing.dataset import pack_dataset  # noqa: E402
from hf_packing.training.distributed import end_distributed, end_process  # noqa: E402
from tests.helpers import image, load_processor  # noqa: E402

SHARDS = (5, 17, 44)


def write_dataset(work: Path) -> list[str]:
    from datasets import Dataset, Features, Image, List, Value

    rng = np.random.default_rng(0)
    features = Features(
        {"image": List(Image()), "conversations": List({"from": Value("string"), "value": Value("string")})}
    )
    files, n = [], 0
    for shard, size in enumerate(SHARDS):
        rows = []
        for _ in range(size):
            buf = io.BytesIO()
            image(int(rng.integers(20, 200)), int(rng.integers(20, 200)), n).save(buf, "JPEG")
            data = buf.getvalue()
            if n == 11:
                data = data[: len(data) // 2]  # truncated JPEG: skipped while planning
            answer = "long " * 900 if n == 30 else "word " * int(rng.integers(1, 80))
            rows.append(
                {
                    "image": [{"bytes": data, "path": None}],
                    "conversations": [
                        {"from": "human", "value": "<image>\nDescribe."},
                        {"from": "gpt", "value": answer},
                    ],
                }
            )
            n += 1
        path = work / f"shard-{shard}.parquet"
        Dataset.from_list(rows, features=features).to_parquet(str(path))
        files.append(str(path))
    return files


def main() -> None:
    work, out = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        write_dataset(work)
    dist.barrier()
    from datasets import load_dataset

    files = sorted(str(p) for p in work.glob("shard-*.parquet"))
    ds = load_dataset("parquet", data_files=files, split="train", streaming=True)
    train = pack_dataset(ds, load_processor("qwen2_vl"), max_length=512, buffer_size=16, disable_progress=True)
    loader = torch.utils.data.DataLoader(train, batch_size=1, num_workers=2, collate_fn=lambda packs: packs)
    packs, steps = [], 0
    for batch in loader:
        packs += [[s["index"] for s in pack] for pack in batch]
        dist.all_reduce(torch.ones(1))  # a DDP step: hangs if one rank has fewer batches
        steps += 1
    dist.barrier()
    import pyarrow.parquet as pq

    shards = [pq.ParquetFile(f).metadata.num_rows for f in files]
    result = {
        "rank": rank,
        "packs": packs,
        "stats": train.stats(log=False),
        "all_reduce_steps": steps,
        "shards": shards,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    end_distributed()  # barrier, gc, destroy_process_group: no abort at interpreter exit


if __name__ == "__main__":
    main()
    end_process()  # skip interpreter finalization, as multiprocessing's children do (hf_packing.training.distributed)
