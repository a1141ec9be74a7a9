"""Helper for tests/test_vision_calls.py: FSDP2 (gloo, CPU) with mixed image / video / text ranks.

    torchrun --standalone --nproc_per_node 2 tests/multiproc_fsdp_vision.py MODEL_TYPE[,MODEL_TYPE...] OUT [separate]

Every vision block, every decoder layer, the tower and the root are ``fully_shard`` units, as accelerate's
FSDP2 auto-wrap makes them. Step 0: rank 0's pack holds images and a video, rank 1's images only; step 1: rank 1
is text-only; then one evaluation step (``eval()``, ``no_grad``) with the step-1 packs. FSDP2 all-gathers a
unit's parameters on every call, so a rank that calls the tower twice while the other calls it once issues
collectives the other never matches: a hang or a size mismatch. The model types run one after the other in the
same processes; each rank writes ``{model_type: {"losses", "tower_calls"}}`` (per step) to OUT.<rank>. With
``separate`` (the negative control) the tower calls are left as transformers makes them.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(model_types: list[str], out: str, separate: bool) -> None:
    import hf_packing

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    results = {model_type: train(model_type, separate) for model_type in model_types}
    Path(f"{out}.{dist.get_rank()}").write_text(json.dumps(results))
    hf_packing.end_distributed()  # barrier, gc, destroy_process_group: no abort at interpreter exit


def train(model_type: str, separate: bool) -> dict:
    """Two FSDP2 training steps and one evaluation step of a fresh tiny ``model_type``; this rank's numbers."""
    rank = dist.get_rank()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import hf_packing
    from hf_packing.testing.tiny import build_tiny_model
    from tests.helpers import FIXTURES, conversations, load_processor, processed_batch

    hf_packing.revert_rmpad()
    hf_packing.apply_rmpad(model_type, dummy_vision=True)
    if separate:
        import contextlib

        from hf_packing.patches import _forward

        _forward.tower_calls = lambda *args, **kwargs: contextlib.nullcontext([])
    torch.manual_seed(0)
    processor = load_processor(model_type)
    model = build_tiny_model(model_type, processor_dir=FIXTURES / model_type)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.model.visual.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model.model.visual, mesh=mesh)
    for layer in model.model.language_model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    calls = []
    model.model.visual.register_forward_hook(lambda *_: calls.append(1))

    rows = conversations()
    steps = [
        [rows[1], rows[4]] if rank == 0 else [rows[1], rows[2]],  # images + video | images only
        [rows[2], rows[4]] if rank == 0 else [rows[0]],  # images + video | text only
    ]
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    losses, counts = [], []
    for step_rows in steps:
        calls.clear()
        batch = processed_batch(processor, step_rows)
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        counts.append(len(calls))
    model.eval()
    calls.clear()
    with torch.no_grad():
        losses.append(model(**processed_batch(processor, steps[1])).loss.item())
    counts.append(len(calls))
    return {"losses": losses, "tower_calls": counts}


if __name__ == "__main__":
    main(sys.argv[1].split(","), sys.argv[2], separate=sys.argv[3:] == ["separate"])
    from hf_packing.training.distributed import end_process

    end_process()  # skip interpreter finalization, as multiprocessing's children do (hf_packing.training.distributed)
