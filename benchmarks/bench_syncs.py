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

MoE families return router logits in every arm (``output_router_logits=True``: the aux loss term). Qwen3.5(-MoE):
transformers' own flattening (the flat arm) needs flash-linear-attention's kernels for its linear-attention layers,
so on CPU that arm is marked n/a.

Run: ``PYTHONPATH=. python benchmarks/bench_syncs.py`` (~2 min). Writes its RESULTS.md section (``--no-write``:
prints it): the counts per family and arm, then every origin (``file:line function``) of each arm. ``--json PATH``
also saves the rows and origins; ``--before PATH`` puts an earlier run's (another commit's checkout with this script
and counter, same machine, run just before) next to these, as "before → after", origins included.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # _common, tests
import _common as C  # noqa: E402

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
KINDS = ("syncs", "host_reads", "creations")
KIND_NAMES = {"syncs": "syncing ops", "host_reads": "tolist reads", "creations": "host-data tensors"}
NO_FLAT = "n/a (transformers' flattening of Qwen3.5 needs flash-linear-attention's kernels: CUDA)"


#: this checkout's root: the counter names ops issued inside backward by the step's own line in this script, which
#: lies outside the measured checkout when a "before" run uses another commit's tree
_ROOT = str(Path(__file__).resolve().parents[1]) + "/"


def origins(counter) -> dict[str, dict[str, int]]:
    """``{kind: {"op at file:line function": count}}`` of one counted step."""
    return {
        kind: {
            f"{op} at {where.removeprefix(_ROOT)}": n
            for (op, where), n in sorted(getattr(counter, kind).items(), key=lambda kv: kv[0][1])
        }
        for kind in KINDS
    }


def measure(model_type: str) -> tuple[list[list[str]], dict[str, dict]]:
    import torch

    import hf_packing
    from hf_packing import VisionCollator, _compat
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

    arms = {"padded (unpatched)": step(VisionCollator(processor)(samples))}
    if model_type.startswith("qwen3_5") and _compat.fla_linear_ops() is None:
        arms["flat (unpatched)"] = None
    else:
        arms["flat (unpatched)"] = step(VisionCollator(processor, mode="flat", model_config=model.config)(samples))
    hf_packing.apply_rmpad(model_type)
    try:
        batch = VisionCollator(processor, model_config=model.config)(samples)
        arms["rows (patched)"] = step(batch, num_items_in_batch=torch.tensor(batch["num_supervised_tokens"]))
    finally:
        hf_packing.revert_rmpad(model_type)
    rows, where = [], {}
    for arm, c in arms.items():
        if c is None:
            rows.append([model_type, arm, NO_FLAT, "", ""])
            continue
        counts = [f"{c.by('', kind)} ({c.by('hf_packing/', kind)})" for kind in KINDS]
        rows.append([model_type, arm, *counts])
        where[f"{model_type} / {arm}"] = origins(c)
        print(f"--- {model_type} {arm}\n{c.report()}", flush=True)
    return rows, where


def origin_lines(after: dict[str, dict], before: dict[str, dict] | None) -> list[str]:
    """One bullet per family's patched arm, each kind's origins with counts (``before → after`` where they differ;
    the unpatched arms' origins are in the script's output)."""
    out = []
    for arm in sorted(a for a in after.keys() | (before or {}).keys() if a.endswith("/ rows (patched)")):
        parts = []
        for kind in KINDS:
            now = after.get(arm, {}).get(kind, {})
            then = (before or {}).get(arm, {}).get(kind, now)
            items = []
            for key in sorted(now.keys() | then.keys(), key=lambda k: k.split(" at ", 1)[1]):
                a, b = now.get(key, 0), then.get(key, 0)
                items.append(f"`{key}` {b} → {a}" if a != b else f"`{key}` {a}")
            parts.append(f"{KIND_NAMES[kind]}: " + ("; ".join(items) if items else "none"))
        out.append(f"- **{arm}**: " + ". ".join(parts))
    return sorted(out, key=lambda line: (FAMILIES.index(line.split("**")[1].split(" / ")[0]), line))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="also save the rows and origins here")
    parser.add_argument("--before", type=Path, help="an earlier run (--json) to show as before → after")
    parser.add_argument("--before-label", default="before", help="what the earlier run was (a commit)")
    parser.add_argument("--no-write", action="store_true", help="print the section instead of writing RESULTS.md")
    args = parser.parse_args()
    rows, where = [], {}
    for family in FAMILIES:
        family_rows, family_where = measure(family)
        rows += family_rows
        where.update(family_where)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "origins": where}))
    before_note, before_where = "", None
    if args.before:
        earlier = json.loads(args.before.read_text())
        before_where = earlier["origins"]
        before_rows = {(r[0], r[1]): r[2:] for r in earlier["rows"]}
        rows = [
            [
                *row[:2],
                *(f"{b} → {a}" if b != a else a for b, a in zip(before_rows.get(tuple(row[:2]), row[2:]), row[2:])),
            ]
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
            "router logits (the aux loss term). The patched arm's origins below, the unpatched arms' in the script's "
            "output. On the patched arm nothing remains "
            "(transformers 5.23: the collator's `vision_inputs` replace what the vision helpers computed on the "
            "device, the collator's batch is trusted, Qwen3-VL's DeepStack takes images and videos as one kind in "
            "row order). Ops issued inside backward have no frame of their own: they carry the step's line "
            "(`benchmarks/bench_syncs.py:... step`). `masked_scatter_backward` is counted as a syncing op: on a GPU "
            "it selects the features' gradient by the mask (transformers' `inputs_embeds.masked_scatter(image_mask, "
            "image_embeds)`, once per modality whenever the features need a gradient, frozen towers under gradient "
            "checkpointing included): the 1 sync per rmpad step the GPU run saw at `torch/autograd/graph.py`. The "
            "patched arm merges by index instead (`PlaceholderMask`); the unpatched arms keep it (+2 per step against "
            f"a counter without it).{before_note}",
            "",
            C.md_table(header, rows),
            "",
            "By origin, patched arm (`op at file:line function`: count in the step"
            + (", before → after where it changed" if before_where else "")
            + "; paths relative to the checkout or to site-packages):",
            "",
            *origin_lines(where, before_where),
        ]
    )
    if args.no_write:
        print(body)
    else:
        C.write_section("bench_syncs", body)


if __name__ == "__main__":
    main()
