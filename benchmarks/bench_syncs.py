"""Host syncs and host-data tensors per training step (forward + backward): patched vs unpatched vs transformers' own
flattening, by origin.

One pack of 5 processed samples (text, 1 image, 2 images, multi-turn, video) from the tiny processors
(`tests/fixtures`), random-init tiny models (`hf_packing.testing.tiny`), fp32, CPU. `hf_packing.testing.syncs.
SyncCounter` counts, by origin: syncing ops (the ops that make a GPU host wait: ``.item()``, ``nonzero``,
boolean-mask indexing, ``unique``, ``repeat_interleave`` without ``output_size``), ``tolist`` host reads (a
dispatch mode cannot see them), and tensors created from host data (``torch.tensor`` / ``as_tensor`` /
``from_numpy`` / ``new_tensor`` of Python or numpy data, ``.to(cuda)`` of a CPU tensor: on a GPU a host-to-device
copy that waits). Arms, same samples, one run:

- ``padded (unpatched)``: `VisionCollator()` rows, attention_mask, the model computes M-RoPE positions.
- ``flat (unpatched)``: `VisionCollator(mode="flat")`, transformers' packed path (4-row position ids, cu_seq_lens).
- ``rows (patched)``: `apply_rmpad`, `VisionCollator(model_config=...)` (positions, supervised count, vision
  boundaries precomputed), with ``num_items_in_batch`` as the Trainer passes it (a tensor made before the step).

MoE families return router logits in every arm (``output_router_logits=True``: the aux loss term).

Run: ``PYTHONPATH=. python benchmarks/bench_syncs.py`` (~1 min). Writes its RESULTS.md section. ``--json PATH``
also saves the rows; ``--before PATH`` puts an earlier run's rows (another commit's checkout, same machine, run
just before) next to these, as "before → after".
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # _common, tests
import _common as C  # noqa: E402

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")  # Qwen3.5's flat path needs FLA (unpatched)
KINDS = ("syncs", "host_reads", "creations")


def measure(model_type: str) -> list[list[str]]:
    import torch

    import hf_packing
    from hf_packing import VisionCollator
    from hf_packing.testing.syncs import SyncCounter
    from hf_packing.testing.tiny import build_tiny_model
    from tests.helpers import FIXTURES, load_processor, processed_samples

    processor = load_processor(model_type)
    samples = processed_samples(processor)
    model = build_tiny_model(model_type, processor_dir=FIXTURES / model_type).train()

    router = {"output_router_logits": True} if getattr(model.config.get_text_config(), "num_experts", None) else {}

    def step(batch, **extra) -> SyncCounter:
        model.zero_grad(set_to_none=True)
        extra = {**router, **extra}  # MoE: router logits and the aux loss term, every arm
        with SyncCounter() as counter:
            model(**batch, **extra).loss.backward()
        return counter

    arms = {
        "padded (unpatched)": step(VisionCollator(processor)(samples)),
        "flat (unpatched)": step(VisionCollator(processor, mode="flat", model_config=model.config)(samples)),
    }
    hf_packing.apply_rmpad(model_type)
    try:
        batch = VisionCollator(processor, model_config=model.config)(samples)
        arms["rows (patched)"] = step(batch, num_items_in_batch=torch.tensor(batch["num_supervised_tokens"]))
    finally:
        hf_packing.revert_rmpad(model_type)
    rows = []
    for arm, c in arms.items():
        counts = [f"{c.by('', kind)} ({c.by('hf_packing/', kind)})" for kind in KINDS]
        rows.append([model_type, arm, *counts])
        print(f"--- {model_type} {arm}\n{c.report()}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="also save the rows here")
    parser.add_argument("--before", type=Path, help="rows of an earlier run (--json) to show as before → after")
    parser.add_argument("--before-label", default="before", help="what the earlier run was (a commit)")
    args = parser.parse_args()
    rows = [row for family in FAMILIES for row in measure(family)]
    if args.json:
        args.json.write_text(json.dumps(rows))
    before_note = ""
    if args.before:
        earlier = {(r[0], r[1]): r[2:] for r in json.loads(args.before.read_text())}
        rows = [
            [*row[:2], *(f"{b} → {a}" if b != a else a for b, a in zip(earlier.get(tuple(row[:2]), row[2:]), row[2:]))]
            for row in rows
        ]
        before_note = (
            f" Each cell reads before → after (a single value: unchanged); before = {args.before_label}, run on this "
            "machine just before, with this script and counter."
        )
    header = [
        "family",
        "arm",
        "syncing ops (hf_packing)",
        "tolist reads (hf_packing)",
        "host-data tensors (hf_packing)",
    ]
    body = "\n".join(
        [
            "## bench_syncs: host syncs and host-data tensors per training step",
            "",
            f"Command: `{C.command_line()}`; date {C.today()}; {C.versions()}; {C.machine('1 core')}.",
            "",
            "One step (forward + backward) on one pack of 5 samples (text, 1 image, 2 images, multi-turn, video), tiny "
            "random-init models, fp32 CPU, counted by `SyncCounter`: syncing ops as a GPU would see them, `tolist` "
            "reads, and tensors created from host data (on a GPU, host-to-device copies that wait); every origin, "
            "hf_packing's in brackets. The patched arm gets `num_items_in_batch` as under the Trainer; MoE arms return "
            "router logits (the aux loss term). Per origin in the script's output. On the patched arm nothing remains "
            "(transformers 5.23: the collator's `vision_inputs` replace what the vision helpers computed on the "
            "device, the collator's batch is trusted, Qwen3-VL's DeepStack takes images and videos as one kind in "
            f"row order).{before_note}",
            "",
            C.md_table(header, rows),
        ]
    )
    C.write_section("bench_syncs", body)


if __name__ == "__main__":
    main()
