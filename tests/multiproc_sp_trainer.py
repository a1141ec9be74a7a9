"""Helper for tests/test_sequence_parallel.py: recipes/train.py (the HF Trainer) with ``--sequence_parallel_size``.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/multiproc_sp_trainer.py OUT MODEL DATA SP

Rank 0 writes the Trainer's ``log_history`` to OUT/hist.json. Run with 1 process and SP=1 for the reference.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "recipes")]


def main(out: str, model: str, data: str, sp: str) -> None:
    import train

    trainer = train.main(
        [
            str(ROOT / "recipes/configs/tiny_cpu.yaml"),
            *("--model_name_or_path", model, "--dataset_path", f"{data}/train.jsonl"),
            *("--image_root", f"{data}/images", "--output_dir", out),
            *("--sequence_parallel_size", sp, "--max_steps", "3"),
        ]
    )
    if trainer.args.process_index == 0:
        Path(out, "hist.json").write_text(json.dumps(trainer.state.log_history))


if __name__ == "__main__":
    main(*sys.argv[1:])
    from hf_packing.training.distributed import end_process

    end_process()  # skip interpreter finalization, as multiprocessing's children do (hf_packing.training.distributed)
