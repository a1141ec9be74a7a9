"""Host syncs per training step (forward + backward): patched vs unpatched vs transformers' own flattening.

One pack of 5 processed samples (text, 1 image, 2 images, multi-turn, video) from the tiny processors
(`tests/fixtures`), random-init tiny models (`hf_packing.testing.tiny`), fp32, CPU. Syncing ops are counted by
`hf_packing.testing.syncs.SyncCounter` (the ops that make a GPU host wait: ``.item()``, ``nonzero``,
boolean-mask indexing, ``unique``, ``repeat_interleave`` without ``output_size``), split by origin; ``tolist``
host reads are counted apart (a dispatch mode cannot see them). Arms, same samples, one run:

- ``padded (unpatched)``: `VisionCollator()` rows, attention_mask, the model computes M-RoPE positions.
- ``flat (unpatched)``: `VisionCollator(mode="flat")`, transformers' packed path (4-row position ids, cu_seq_lens).
- ``rows (patched)``: `apply_rmpad`, `VisionCollator(model_config=...)` (positions, supervised count precomputed).

Run: ``PYTHONPATH=. python benchmarks/bench_syncs.py`` (~1 min). Writes its RESULTS.md section.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")  # Qwen3.5's flat path needs FLA (unpatched)


def measure(model_type: str) -> list[list[str]]:
    import hf_packing
    from hf_packing import VisionCollator
    from hf_packing.testing.syncs import SyncCounter
    from hf_packing.testing.tiny import build_tiny_model
    from tests.conftest import FIXTURES, load_processor, processed_samples

    processor = load_processor(model_type)
    samples = processed_samples(processor)
    model = build_tiny_model(model_type, processor_dir=FIXTURES / model_type).train()

    def step(batch) -> SyncCounter:
        model.zero_grad(set_to_none=True)
        with SyncCounter() as counter:
            model(**batch).loss.backward()
        return counter

    arms = {
        "padded (unpatched)": step(VisionCollator(processor)(samples)),
        "flat (unpatched)": step(VisionCollator(processor, mode="flat", model_config=model.config)(samples)),
    }
    hf_packing.apply_rmpad(model_type)
    try:
        arms["rows (patched)"] = step(VisionCollator(processor, model_config=model.config)(samples))
    finally:
        hf_packing.revert_rmpad(model_type)
    rows = []
    for arm, c in arms.items():
        reads = sum(c.host_reads.values())
        ours = sum(n for (_, where), n in c.host_reads.items() if where.startswith("hf_packing/"))
        rows.append([model_type, arm, str(c.total), str(c.by("hf_packing/")), str(reads), str(ours)])
        print(f"--- {model_type} {arm}\n{c.report()}", flush=True)
    return rows


def main() -> None:
    rows = [row for family in FAMILIES for row in measure(family)]
    header = ["family", "arm", "syncing ops", "of them hf_packing", "tolist reads", "of them hf_packing"]
    body = "\n".join(
        [
            "## bench_syncs: host syncs per training step",
            "",
            f"Command: `{C.command_line()}`; date {C.today()}; {C.versions()}; {C.machine('1 core')}.",
            "",
            "One step (forward + backward) on one pack of 5 samples (text, 1 image, 2 images, multi-turn, video), tiny "
            "random-init models, fp32 CPU. Syncing ops as a GPU would see them (counted by `SyncCounter`); `tolist` "
            "reads separately. Per origin in the script's output; all remaining syncing ops are transformers' (vision "
            "tower window / cu_seqlens / position helpers, placeholder checks, DeepStack).",
            "",
            C.md_table(header, rows),
        ]
    )
    C.write_section("bench_syncs", body)


if __name__ == "__main__":
    main()
