"""Helper for tests/test_telemetry.py: `PackingTelemetry` under SP = 2 on 2 gloo processes, with a controlled clock.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/multiproc_sp_telemetry.py OUT.json

Both ranks form one SP group and see the same pack (as `pack_dataset` gives them): 9 tokens in two documents
(4 + 5) and one 1×4×4 image. The telemetry's clock and the SP comm timer's clock are one fake clock: the logging
window lasts 10 s on every rank, rank r spends ``COMM_SECONDS[r]`` of it in SP collectives (through
`CommTimer.timing`, its CPU path). The FLOP counts are a hand-made `ModelFlops` whose FLOPs tests/test_telemetry.py
works out by hand. Rank 0 writes the logged ``packing/*`` keys to OUT.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

import hf_packing
from hf_packing.ops.flops import ModelFlops
from hf_packing.parallel import comm
from hf_packing.patches import sequence_parallel
from hf_packing.training import telemetry as telemetry_module
from hf_packing.training.distributed import end_distributed
from hf_packing.training.telemetry import PackingTelemetry

#: seconds each rank spends in SP collectives in its 10 s window (distinct, so a mean differs from rank 0's own)
COMM_SECONDS = (2.0, 4.0)
WINDOW_SECONDS = 10.0
#: N = 1000 text weights, L = 2 attention layers of d = 8; tower N_pe = 10, N_blk = 100, N_mrg = 20, m = 2, D = 4
COUNTS = ModelFlops(
    text_params=1000.0,
    attention_layers=2,
    attention_dim=8,
    vision_embed=10.0,
    vision_blocks=100.0,
    vision_mergers=20.0,
    merge=2,
    vision_width=4,
    full_blocks=1,
)
PEAK_TFLOPS = 100.0


class Clock:
    """A `time` stand-in whose ``perf_counter`` reads ``now``, moved by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


class Model(torch.nn.Module):
    """The outermost module the telemetry hooks: takes the collator's kwargs, computes nothing."""

    def forward(self, **kwargs: Any) -> None:
        return None


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    hf_packing.apply_rmpad(sequence_parallel_size=world)  # one SP group of 2: the state the telemetry reads
    clock = Clock()
    telemetry_module.time = clock  # type: ignore[assignment]
    comm.time = clock  # type: ignore[assignment]
    try:
        state = sequence_parallel.current_state()
        assert state is not None and state.size == 2
        callback = PackingTelemetry(model_flops=COUNTS, peak_tflops=PEAK_TFLOPS, max_length=16)
        args = SimpleNamespace(per_device_train_batch_size=1, device=torch.device("cpu"), world_size=world)
        trainer_state = SimpleNamespace(global_step=0, log_history=[])
        model = Model().train()
        callback.on_train_begin(args, trainer_state, None, model=model)
        batch = {
            "input_ids": torch.arange(9).view(1, 9),
            "cu_seqlens": torch.tensor([0, 4, 9], dtype=torch.int32),
            "image_grid_thw": torch.tensor([[1, 4, 4]]),
        }
        model(**batch)
        with state.timer.timing(torch.device("cpu")):  # an all-to-all of COMM_SECONDS[rank]
            clock.now += COMM_SECONDS[rank]
        clock.now = 100.0 + WINDOW_SECONDS
        callback.on_step_end(args, trainer_state, None)
        trainer_state.global_step = 1
        logs = {"loss": 1.0}
        callback.on_log(args, trainer_state, None, logs=logs)
        if rank == 0:
            out.write_text(json.dumps({k: v for k, v in logs.items() if k.startswith("packing/")}))
    finally:
        hf_packing.revert_rmpad()
        end_distributed()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
