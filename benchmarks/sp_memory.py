"""Activation memory per rank under Ulysses sequence parallelism: an analytic model against measured CPU peak RSS.

Model (fp32, bytes per rank for one pack of T tokens; L decoder layers, hidden H, intermediate I, Hq query heads
and Hkv KV heads of size D, KV heads replicated to Hkv' = Hkv · P / gcd(Hkv, P) under SP)::

    M(P) = fixed + L · (T/P) · 4 · (5·H + (2·Hq + 2·Hkv')·D + 4·I)

    per token and layer, what autograd keeps for backward:
      5·H          input of both RMSNorms, their outputs, o_proj's input
      (2·Hq + 2·Hkv')·D   the attention kernel's q, k, v (after the all-to-all: T tokens, Hq/P heads) and output
      4·I          MLP: gate, up, silu(gate), silu(gate)·up
    fixed: the whole pack's embeddings before the split (and their padded copy), 2·T·H·4, plus ids, positions
    and labels (~40·T); it does not shrink with P (nor do the vision features, absent here: text-only packs).

Measured: each rank's peak RSS (``VmHWM``, reset through ``/proc/self/clear_refs`` after a warm-up step) minus
its RSS before the step, for one forward + backward of the same pack at SP = 1, 2, 4 (torchrun, gloo, one
thread per rank; ``MALLOC_MMAP_THRESHOLD_`` makes glibc return large blocks to the OS so the RSS follows the
tensors). The weights, gradients and process (~0.5 GiB of torch + transformers) are in the baseline, not in the
delta; the delta also holds the backward's transient buffers, which the model leaves out.

    python benchmarks/sp_memory.py                 # SP = 1, 2, 4; writes its section of RESULTS.md
    python benchmarks/sp_memory.py --family qwen3_5   # Qwen3.5 (Gated DeltaNet layers): its own section
    python benchmarks/sp_memory.py --no-write --tokens 4096
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import _common as C  # noqa: E402

TEXT = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=2)
HEAD_DIM = TEXT["hidden_size"] // TEXT["num_attention_heads"]
#: Qwen3.5: three Gated DeltaNet layers then one full-attention layer (the real 3:1), linear heads 4 key / 8 value
#: of dim 32 (real 16 / 32 of 128), so P = 4 splits both without replication.
TEXT_QWEN3_5 = dict(
    TEXT,
    num_attention_heads=4,
    head_dim=64,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
)
FAMILIES = {"qwen2_5_vl": TEXT, "qwen3_5": TEXT_QWEN3_5}
SEQUENCES = 16  # the pack holds this many equal sequences


def predicted_bytes(tokens: int, size: int) -> dict[str, float]:
    """The analytic model of the module docstring: ``{"fixed", "layers", "total"}`` in bytes for one rank."""
    h, i, hq, hkv = (
        TEXT[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")
    )
    hkv_eff = hkv * size // math.gcd(hkv, size)
    per_token_layer = 4 * (5 * h + (2 * hq + 2 * hkv_eff) * HEAD_DIM + 4 * i)
    padded = -(-tokens // size) * size
    layers = TEXT["num_hidden_layers"] * padded / size * per_token_layer
    fixed = 2 * tokens * h * 4 + 40 * tokens
    return {"fixed": fixed, "layers": layers, "total": fixed + layers}


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def worker(tokens: int, out: str, family: str) -> None:
    """One rank: build the model, run a warm-up step, then measure one forward + backward."""
    import torch
    import torch.distributed as dist

    import hf_packing
    from hf_packing.testing.tiny import build_tiny_model

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    torch.set_num_threads(1)
    hf_packing.apply_rmpad(family, sequence_parallel_size=world, linear_backend="reference")
    text = FAMILIES[family]
    model = build_tiny_model(family, text_config=text, vision_config={"out_hidden_size": text["hidden_size"]})
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 400, (SEQUENCES, tokens // SEQUENCES), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}

    def step() -> float:
        loss = model(**batch).loss
        loss.backward()
        model.zero_grad(set_to_none=False)  # keep the gradient buffers: they are weights-sized, in the baseline
        return float(loss)

    step()
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    before = _status("VmRSS")
    t0 = time.perf_counter()
    loss = step()
    seconds = time.perf_counter() - t0
    peak = _status("VmHWM")
    rank = dist.get_rank() if world > 1 else 0
    result = {"rank": rank, "world": world, "delta": peak - before, "before": before, "loss": loss, "s": seconds}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    if world > 1:
        dist.destroy_process_group()


def measure(size: int, tokens: int, family: str) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536", "HF_HUB_OFFLINE": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, __file__, "--worker", "--tokens", str(tokens), "--out", tmp, "--family", family]
        if size > 1:
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node",
                str(size),
                *cmd[1:],
            ]
        subprocess.run(cmd, check=True, env=env, capture_output=True, text=True, timeout=900)
        return [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank*.json"))]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__)
    parser.add_argument("--tokens", type=int, default=8192, help="tokens in the pack")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--family", choices=sorted(FAMILIES), default="qwen2_5_vl")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.tokens, args.out, args.family)
    if args.family == "qwen3_5":
        return main_hybrid(args)
    t_start, rows, base = time.time(), [], None
    for size in args.sizes:
        ranks = measure(size, args.tokens, args.family)
        worst = max(r["delta"] for r in ranks)
        model = predicted_bytes(args.tokens, size)
        base = base or (worst, model["total"])
        rows.append(
            [
                str(size),
                f"{model['total'] / 2**20:,.0f} ({model['layers'] / 2**20:,.0f} + {model['fixed'] / 2**20:,.0f})",
                f"{worst / 2**20:,.0f}",
                f"{worst / model['total']:.2f}",
                f"{model['total'] / base[1]:.3f}",
                f"{worst / base[0]:.3f}",
                f"{1 / size:.3f}",
                f"{ranks[0]['loss']:.6f}",
                f"{max(r['s'] for r in ranks):.2f}",
            ]
        )
        print(rows[-1], flush=True)
    table = C.md_table(
        [
            "SP",
            "model MiB / rank (layers + fixed)",
            "measured peak RSS delta MiB (max rank)",
            "measured / model",
            "model vs SP=1",
            "measured vs SP=1",
            "1/SP",
            "loss",
            "step s",
        ],
        rows,
    )
    body = f"""## Sequence parallelism: activation memory per rank (`sp_memory.py`)

{C.footer(t_start, C.machine("1 thread per rank, SP ranks as processes (gloo)"), load_after=True)}
- Model: tiny Qwen2.5-VL text (hidden {TEXT["hidden_size"]}, {TEXT["num_hidden_layers"]} layers, {TEXT["num_attention_heads"]} heads, {TEXT["num_key_value_heads"]} KV heads, intermediate {TEXT["intermediate_size"]}), fp32; one text-only pack of {args.tokens:,} tokens in {SEQUENCES} sequences; reference varlen attention.
- Method and model: see the script's docstring (peak RSS delta over one forward + backward after a warm-up; weights, gradients and the process in the baseline).

{table}

Reading: the measured activation memory per rank is {", ".join(r[5] for r in rows)} of SP=1's at SP={", ".join(r[0] for r in rows)}
(1/SP: {", ".join(r[6] for r in rows)}); the model's per-layer count is ~{min(float(r[3]) for r in rows):.2f}-{max(float(r[3]) for r in rows):.2f}×
below the measurement at every SP (the backward's transient gradient buffers, which it leaves out), so the ratio,
not the absolute number, is what it predicts.
"""
    if args.no_write:
        print(body)
    else:
        C.write_section("sp_memory", body)
        print(body)


def main_hybrid(args: argparse.Namespace) -> None:
    """Qwen3.5 (Gated DeltaNet + full attention): measured only, against 1/SP (the analytic model above counts
    softmax layers; a linear layer's core runs on T tokens × H/P heads, the same T/P share)."""
    t_start, rows, base = time.time(), [], None
    for size in args.sizes:
        ranks = measure(size, args.tokens, args.family)
        worst = max(r["delta"] for r in ranks)
        base = base or worst
        rows.append(
            [
                str(size),
                f"{worst / 2**20:,.0f}",
                f"{worst / base:.3f}",
                f"{1 / size:.3f}",
                f"{worst / base * size:.2f}",
                f"{ranks[0]['loss']:.6f}",
                f"{max(r['s'] for r in ranks):.2f}",
            ]
        )
        print(rows[-1], flush=True)
    headers = ["SP", "measured peak RSS delta MiB (max rank)", "measured vs SP=1", "1/SP", "× 1/SP", "loss", "step s"]
    text = TEXT_QWEN3_5
    body = f"""## Sequence parallelism, Qwen3.5: activation memory per rank (`sp_memory.py --family qwen3_5`)

{C.footer(t_start, C.machine("1 thread per rank, SP ranks as processes (gloo)"), load_after=True)}
- Model: tiny Qwen3.5 text (hidden {text["hidden_size"]}, {text["num_hidden_layers"]} layers: 3 Gated DeltaNet with {text["linear_num_key_heads"]} key / {text["linear_num_value_heads"]} value heads of {text["linear_key_head_dim"]}, then 1 full attention with {text["num_attention_heads"]} heads of {text["head_dim"]}; intermediate {text["intermediate_size"]}), fp32; one text-only pack of {args.tokens:,} tokens in {SEQUENCES} sequences; reference backends (linear layers: transformers' torch fallbacks per sequence, on this rank's heads).
- Method: as above (peak RSS delta over one forward + backward after a warm-up; weights, gradients and the process in the baseline).

{C.md_table(headers, rows)}

Reading: the measured activation memory per rank is {", ".join(r[2] for r in rows)} of SP=1's at SP={", ".join(r[0] for r in rows)}
(1/SP: {", ".join(r[3] for r in rows)}): the linear-attention layers' conv and delta rule run on the whole pack but
only this rank's heads, so they shrink with 1/SP like the softmax layers; the pack's embeddings (before the split)
do not.
"""
    if not args.no_write:
        C.write_section("sp_memory_qwen3_5", body)
    print(body)


if __name__ == "__main__":
    main()
