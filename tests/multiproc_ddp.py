"""Helper for tests/test_precision.py: DDP (gloo, find_unused_parameters=False) with a micro-batch that has no
supervised tokens, as the Trainer runs it with gradient checkpointing.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/multiproc_ddp.py OUT.json

Rank 1's first batch supervises nothing; the second step supervises nothing on either rank (num_items_in_batch
= 0). Rank 0 writes the two steps' losses to OUT.json.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from hf_packing.training.distributed import end_distributed, end_process

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(out: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    import hf_packing
    from hf_packing.testing.tiny import build_tiny_model
    from tests.helpers import FIXTURES, conversations, load_processor, processed_batch

    hf_packing.apply_rmpad("qwen2_5_vl")
    torch.manual_seed(0)
    processor = load_processor("qwen2_5_vl")
    model = build_tiny_model("qwen2_5_vl", processor_dir=FIXTURES / "qwen2_5_vl")
    model.model.visual.requires_grad_(False)  # text-only batches: a frozen tower, as recipes freeze it
    ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=False)
    batch = processed_batch(
        processor, conversations(with_video=False)[:1] if rank == 0 else [conversations(with_video=False)[0]]
    )
    losses = []
    for step in range(2):
        labels = batch["labels"].clone()
        if rank == 1 or step == 1:
            labels[:] = -100
        count = torch.tensor(int((labels[:, 1:] != -100).sum()))
        dist.all_reduce(count)
        loss = ddp(**batch | {"labels": labels}, num_items_in_batch=count).loss
        (loss * dist.get_world_size()).backward()
        losses.append(loss.item())
    if rank == 0:
        Path(out).write_text(json.dumps({"losses": losses}))
    end_distributed()  # barrier, gc, destroy_process_group: no abort at interpreter exit


if __name__ == "__main__":
    main(sys.argv[1])
    end_process()  # skip interpreter finalization, as multiprocessing's children do (hf_packing.training.distributed)
