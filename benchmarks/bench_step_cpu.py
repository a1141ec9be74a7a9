"""CPU training-step benchmark on a small random-init Qwen2.5-VL: padded vs flat vs rmpad.

Model (random init, fp32, ~16M parameters; nothing downloaded): `Qwen2_5_VLForConditionalGeneration` from
`hf_packing.testing.tiny.tiny_config("qwen2_5_vl", ...)` with text 4 layers x 512 hidden, 8 heads (head_dim 64),
2 kv heads, intermediate 1376, M-RoPE sections [8, 12, 12], vocabulary 512 (the tiny tokenizer's); vision
tower depth 4, hidden 256, 4 heads, intermediate 684, window 112 px, full attention in block 3, output 512.

Data: batches of 8 samples with real images (RGB gradients + noise, 56-224 px a side, 85% of samples have
one) processed by the tiny Qwen2.5-VL processor (`tests/fixtures/qwen2_5_vl`); text lognormal median 150
tokens, clipped to 60-500; labels on the assistant answer only. Every arm gets the same batches in the same
order; collation happens before timing.

Arms (one process, interleaved step by step; each arm has its own copy of identical initial weights and
its own AdamW, so step 0 of every arm sees the same weights and the same batch):

- ``padded+sdpa``: unpatched model, `VisionCollator(mode="rows")` (B x longest row).
- ``flat+sdpa``: unpatched model, `VisionCollator(mode="flat", model_config=...)` (one row, transformers
  builds a block-causal mask from the text position row; ``use_cache=False`` comes with the batch).
- ``rmpad+reference``: `apply_rmpad("qwen2_5_vl", attn_backend="reference")` for the step, `revert_rmpad`
  after; `VisionCollator(mode="rows")` with ``cu_seqlens``.

A step is forward + backward + ``AdamW.step()`` + ``zero_grad``. Peak RSS is measured separately, one fresh
child process per arm (see RESULTS.md for the method). One extra step per arm runs under `torch.profiler`
for the top operators. Writes its section of RESULTS.md and ``benchmarks/step_cpu.png``.

``--trl``: instead, TRL's ``SFTTrainer`` step (its fused LM head on the backbone ``model.model``, TRL >= 1.16),
unpatched vs `apply_rmpad` (the patched backbone flattens the batch), on the same padded ``VisionCollator`` rows;
a step = ``SFTTrainer.training_step`` (forward + backward) + ``AdamW.step()`` + ``zero_grad``. Writes its own
RESULTS.md section (``bench_step_cpu_trl``).

``--compile``: instead, eager vs per-layer compiled in the same run, on the padded rows (unpatched) and on the same
rows with ``cu_seqlens`` (`apply_rmpad`, reference backend): every text decoder layer compiled with
``fullgraph=True, dynamic=True`` (backend ``--compile-backend``, inductor by default) as ``tests/test_compile.py``
does; the unpatched arms run first, then the patched ones under one `apply_rmpad` (a re-applied patch would fail
dynamo's guards and recompile). The first step of a compiled arm (compilation) is reported apart; one more forward +
backward per arm runs under `hf_packing.testing.syncs.SyncCounter` for the host syncs per step. Own section
(``bench_step_cpu_compile``).

``--qwen4-exp``: instead, Qwen4-Exp (the tiny test model of `hf_packing.testing.tiny`, every token mixer on: PLE,
QSA blocks of 4 with a budget of 8 tokens, MoE, 2 hyper-connection streams), unpatched vs `apply_rmpad` on the same
padded batch of ``--batch-size`` text samples (default 4) at several lengths per sample (``--lengths``): a step is
forward + backward (no optimizer: both arms share the weights), and the QSA indexer's own forward time is
measured inside the step (transformers' ``Qwen4ExpTextQSAIndexer.forward`` unpatched, the packed selection
patched); one more step per arm and length runs under `hf_packing.testing.syncs.SyncCounter` for the syncing ops a GPU
would wait on. Own section (``bench_step_cpu_qwen4_exp``).

Run: ``python benchmarks/bench_step_cpu.py`` (a few minutes; ``--quick`` for a smoke run; ``--trl``; ``--compile``).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "qwen2_5_vl"
PLOT = Path(__file__).resolve().parent / "step_cpu.png"
ARMS = ("padded+sdpa", "flat+sdpa", "rmpad+reference")
WORDS = (
    "the quick brown fox jumps over lazy dog while cat watches from window picture shows red car parked near "
    "small house with green door two windows describe image in detail what colour is sky how many people are "
    "photo video starts person walking along beach camera turns sea answer explains reasoning step by"
).split()


def step_config():
    from hf_packing.testing.tiny import tiny_config

    return tiny_config(
        "qwen2_5_vl",
        text_config={
            "hidden_size": 512,
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "intermediate_size": 1376,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [8, 12, 12]},
        },
        vision_config={
            "depth": 4,
            "hidden_size": 256,
            "num_heads": 4,
            "intermediate_size": 684,
            "out_hidden_size": 512,
            "window_size": 112,
            "fullatt_block_indexes": [3],
        },
    )


def build_model(seed: int = 0):
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(step_config())
    model.set_attn_implementation("sdpa")
    return model.float().train()


# ------------------------------------------------------------------------------------------------ data


def _image(rng: np.random.Generator, width: int, height: int):
    from PIL import Image

    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([(xx * rng.integers(1, 5)) % 256, (yy * rng.integers(1, 5)) % 256, ((xx + yy) * 2) % 256], -1)
    return Image.fromarray(np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8))


def _text(rng: np.random.Generator, tokenizer, tokens: int) -> str:
    words: list[str] = []
    while len(tokenizer(" ".join(words))["input_ids"]) < tokens:
        words.extend(rng.choice(WORDS, 8))
    while words and len(tokenizer(" ".join(words))["input_ids"]) > tokens:
        words.pop()
    return " ".join(words)


def make_samples(processor, count: int, seed: int = 0) -> list[dict[str, Any]]:
    """Processed samples (1-D tensors + pixels) of the LLaVA-like scaled-down mix in the module docstring."""
    rng = np.random.default_rng(seed)
    tok = processor.tokenizer
    samples = []
    for _ in range(count):
        total = int(np.clip(np.exp(rng.normal(math.log(150), 0.6)), 60, 500))
        question = _text(rng, tok, max(4, total // 4))
        answer = _text(rng, tok, max(4, total - total // 4 - 12))
        has_image = rng.random() < 0.85
        content = ([{"type": "image"}] if has_image else []) + [{"type": "text", "text": question}]
        user = {"role": "user", "content": content}
        bot = {"role": "assistant", "content": [{"type": "text", "text": answer}]}
        images = [_image(rng, *(int(x) for x in rng.integers(56, 225, 2)))] if has_image else None
        full = processor.apply_chat_template([user, bot], tokenize=False)
        prompt = processor.apply_chat_template([user], tokenize=False, add_generation_prompt=True)
        enc = processor(text=[full], images=images, return_tensors="pt")
        n_prompt = processor(text=[prompt], images=images, return_tensors="pt")["input_ids"].shape[1]
        sample = {k: (v[0] if k in ("input_ids", "attention_mask", "mm_token_type_ids") else v) for k, v in enc.items()}
        sample.pop("attention_mask", None)
        labels = sample["input_ids"].clone()
        labels[:n_prompt] = -100
        sample["labels"] = labels
        samples.append(sample)
    return samples


def make_batches(num_batches: int, batch_size: int, seed: int = 0) -> dict[str, list[dict[str, Any]]]:
    """The same packs collated three ways: rows (padded), rows with cu_seqlens (rmpad), flat."""
    from transformers import AutoProcessor

    from hf_packing.collator import VisionCollator

    processor = AutoProcessor.from_pretrained(str(FIXTURE))
    config = step_config()
    samples = make_samples(processor, num_batches * batch_size, seed)
    packs = [samples[i * batch_size : (i + 1) * batch_size] for i in range(num_batches)]
    rows = VisionCollator(processor, mode="rows", return_cu_seqlens=False)
    rows_cu = VisionCollator(processor, mode="rows", return_cu_seqlens=True)
    flat = VisionCollator(processor, mode="flat", model_config=config)
    # each sample is its own "pack" of one in rows mode (one row per sample); flat concatenates all of them
    return {
        "padded+sdpa": [rows([[s] for s in p]) for p in packs],
        "rmpad+reference": [rows_cu([[s] for s in p]) for p in packs],
        "flat+sdpa": [flat([p]) for p in packs],
    }


def batch_stats(batch: dict[str, Any]) -> dict[str, float]:
    mask = batch["attention_mask"]
    return {
        "real": int(mask.sum()),
        "slots": int(mask.numel()),
        "rows": int(mask.shape[0]),
        "width": int(mask.shape[1]),
        "images": int(batch["image_grid_thw"].shape[0]) if "image_grid_thw" in batch else 0,
        "patches": int(batch["pixel_values"].shape[0]) if "pixel_values" in batch else 0,
        "supervised": int((batch["labels"] != -100).sum()),
    }


# ------------------------------------------------------------------------------------------------ steps


class Arm:
    """One arm: its own model copy, optimizer, batches, and whether the rmpad patch wraps its step."""

    def __init__(self, name: str, model, batches: list[dict[str, Any]], lr: float = 1e-4) -> None:
        import torch

        self.name, self.model, self.batches = name, model, batches
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        self.rmpad = name.startswith("rmpad")
        self.losses: list[float] = []
        self.phases: list[tuple[float, float, float]] = []

    def step(self, index: int) -> float:
        """One optimizer step on batch ``index``; returns the wall time in seconds (phases kept in ``phases``)."""
        from hf_packing.patches import apply_rmpad, revert_rmpad

        if self.rmpad:
            apply_rmpad("qwen2_5_vl", attn_backend="reference")
        try:
            t0 = time.perf_counter()
            loss = self.model(**self.batches[index]).loss
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            t3 = time.perf_counter()
        finally:
            if self.rmpad:
                revert_rmpad("qwen2_5_vl")
        self.losses.append(float(loss.detach()))
        self.phases.append((t1 - t0, t2 - t1, t3 - t2))
        return t3 - t0


#: profiler categories: (label, predicate on the op name)
CATEGORIES = (
    ("matmul (mm/addmm/bmm)", lambda k: k in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")),
    ("attention kernels (SDPA fwd+bwd)", lambda k: "scaled_dot_product" in k or "flash_attention" in k),
    ("everything else", lambda k: True),
)


def profile_step(arm: Arm, index: int, top: int) -> tuple[list[list[str]], dict[str, float]]:
    """Top operators (by name and input shapes) by self CPU time for one step, and ms per `CATEGORIES`."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        arm.step(index)
    arm.losses.pop()
    arm.phases.pop()
    by_name = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in by_name)
    cats = {label: 0.0 for label, _ in CATEGORIES}
    for e in by_name:
        label = next(lbl for lbl, pred in CATEGORIES if pred(e.key))
        cats[label] += e.self_cpu_time_total / 1e3
    cats["total"] = total / 1e3
    rows = []
    for e in sorted(prof.key_averages(group_by_input_shape=True), key=lambda e: e.self_cpu_time_total, reverse=True)[
        :top
    ]:
        shapes = str([list(s) for s in e.input_shapes if s][:3]).replace(" ", "")
        shapes = shapes if len(shapes) <= 60 else shapes[:57] + "..."
        rows.append(
            [
                arm.name,
                f"`{e.key}`",
                f"`{shapes}`",
                f"{e.self_cpu_time_total / 1e3:.1f}",
                f"{100 * e.self_cpu_time_total / total:.1f}%",
                str(e.count),
            ]
        )
    return rows, cats


def vision_share(model, batch: dict[str, Any], repeats: int = 5) -> float:
    """Seconds for the vision tower forward + backward on this batch's pixels (same in every arm)."""
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        out = model.model.get_image_features(batch["pixel_values"], batch["image_grid_thw"], return_dict=True)
        feats = out.pooler_output if getattr(out, "pooler_output", None) is not None else out[0]
        feats = feats if not isinstance(feats, (list, tuple)) else __import__("torch").cat(list(feats))
        feats.float().sum().backward()
        model.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return C.median(times[1:])


# ------------------------------------------------------------------------------------------------ peak RSS (child)


def _vm(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return -1


def rss_child(arm_name: str, state_path: str, steps: int, threads: int) -> dict[str, Any]:
    """Run ``steps`` steps of one arm in this fresh process; peak RSS from VmHWM after resetting it."""
    import resource

    import torch

    torch.set_num_threads(threads)
    state = torch.load(state_path, weights_only=False)
    model = build_model()
    model.load_state_dict(state["weights"])
    arm = Arm(arm_name, model, state["batches"][arm_name])
    del state
    import gc

    gc.collect()
    before = _vm("VmRSS")
    try:  # Linux: writing 5 resets the peak-RSS counter (VmHWM) of this process
        Path("/proc/self/clear_refs").write_text("5")
        method = "VmHWM after clear_refs"
    except OSError:
        method = "ru_maxrss (includes setup)"
    for i in range(steps):
        arm.step(i % len(arm.batches))
    peak = _vm("VmHWM") if method.startswith("VmHWM") else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "before": before,
        "peak": peak,
        "method": method,
        "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def measure_rss(state_path: str, steps: int, threads: int) -> dict[str, dict[str, Any]]:
    out = {}
    for name in ARMS:
        with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
            cmd = [
                sys.executable,
                __file__,
                "--rss-child",
                name,
                "--state",
                state_path,
                "--rss-steps",
                str(steps),
                "--threads",
                str(threads),
                "--rss-out",
                tmp.name,
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                out[name] = {"error": proc.stderr[-500:]}
            else:
                out[name] = json.loads(Path(tmp.name).read_text())
    return out


# ------------------------------------------------------------------------------------------------ plot


def plot(path: Path, arms: list[str], tok_s: list[float], step_ms: list[float], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = ["#8c8c8c", "#4c72b0", "#dd8452"]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, values, label, fmt in (
        (axes[0], tok_s, "real tokens / s", "{:,.0f}"),
        (axes[1], step_ms, "step time (ms)", "{:,.0f}"),
    ):
        bars = ax.bar(arms, values, color=colors[: len(arms)])
        ax.set_ylabel(label)
        ax.bar_label(bars, labels=[fmt.format(v) for v in values], padding=2, fontsize=9)
        ax.set_ylim(0, max(values) * 1.18)
        ax.tick_params(axis="x", labelsize=9)
        ax.spines[["top", "right"]].set_visible(False)
    axes[0].set_title("throughput (higher is better)", fontsize=10)
    axes[1].set_title("median step time (lower is better)", fontsize=10)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1: see RESULTS.md)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2, help="warm-up steps per arm (not measured)")
    parser.add_argument("--steps", type=int, default=8, help="measured steps per arm")
    parser.add_argument("--rss-steps", type=int, default=3, help="steps per arm in the peak-RSS child processes")
    parser.add_argument("--profile-top", type=int, default=8)
    parser.add_argument("--profile-steps", type=int, default=3, help="profiled steps per arm (medians per category)")
    parser.add_argument("--quick", action="store_true", help="2 measured steps, batch 4; does not write anything")
    parser.add_argument("--no-write", action="store_true", help="print instead of writing RESULTS.md / the plot")
    parser.add_argument("--trl", action="store_true", help="TRL SFTTrainer step, unpatched vs rmpad (own section)")
    parser.add_argument("--compile", action="store_true", help="eager vs per-layer compiled arms (own section)")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend of --compile")
    parser.add_argument(
        "--frozen-tower", action="store_true", help="rmpad with a frozen tower: no-autograd tower call vs autograd"
    )
    parser.add_argument(
        "--qwen4-exp", action="store_true", help="Qwen4-Exp unpatched vs rmpad per length (own section)"
    )
    parser.add_argument(
        "--lengths", default="125,250,400,700,1000,2000,4000", help="--qwen4-exp: tokens per sample, comma-separated"
    )
    parser.add_argument("--rss-child", help=argparse.SUPPRESS)
    parser.add_argument("--state", help=argparse.SUPPRESS)
    parser.add_argument("--rss-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    import torch

    if args.rss_child:
        Path(args.rss_out).write_text(json.dumps(rss_child(args.rss_child, args.state, args.rss_steps, args.threads)))
        return
    if args.quick:
        args.batch_size, args.warmup, args.steps, args.rss_steps, args.profile_steps, args.no_write = (
            4,
            1,
            2,
            1,
            1,
            True,
        )
    if args.trl:
        run_trl(args)
        return
    if args.compile:
        run_compile(args)
        return
    if args.frozen_tower:
        run_frozen_tower(args)
        return
    if args.qwen4_exp:
        run_qwen4_exp(args)
        return
    torch.set_num_threads(args.threads)
    load_before = C.load_average()
    t_start = time.time()

    num_batches = args.warmup + args.steps
    batches = make_batches(num_batches, args.batch_size)
    base = build_model()
    weights = copy.deepcopy(base.state_dict())
    arms = {name: Arm(name, copy.deepcopy(base), batches[name]) for name in ARMS}
    n_params = sum(p.numel() for p in base.parameters())

    times: dict[str, list[float]] = {name: [] for name in ARMS}
    for i in range(num_batches):
        for name, arm in arms.items():
            dt = arm.step(i)
            if i >= args.warmup:
                times[name].append(dt)
        print(
            f"[step] batch {i}: " + ", ".join(f"{n} {times[n][-1] * 1e3:.0f} ms" if times[n] else n for n in ARMS),
            flush=True,
        )

    stats = [batch_stats(b) for b in batches["padded+sdpa"]]
    measured = stats[args.warmup :]
    real = [s["real"] for s in measured]
    real_fraction = sum(real) / sum(s["slots"] for s in measured)
    med = {n: C.median(t) for n, t in times.items()}
    phase = {n: [C.median(p[k] for p in arms[n].phases[args.warmup :]) for k in range(3)] for n in ARMS}
    tok_s = {n: C.median(r / t for r, t in zip(real, times[n])) for n in ARMS}
    first = {n: arms[n].losses[0] for n in ARMS}
    ref = first["padded+sdpa"]
    loss_err = {n: abs(v - ref) / abs(ref) for n, v in first.items()}
    # profile one more step per arm (first measured batch), and the vision tower's own cost
    prof_rows, cats = [], {}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in ARMS}
    for k in range(args.profile_steps):  # the first measured batch, arms interleaved; median per category
        for name, arm in arms.items():
            rows, c = profile_step(arm, args.warmup, args.profile_top)
            runs[name].append(c)
            if k == args.profile_steps - 1:
                prof_rows += rows
    cats = {n: {key: C.median(r[key] for r in runs[n]) for key in runs[n][0]} for n in ARMS}
    prof_fraction = stats[args.warmup]["real"] / stats[args.warmup]["slots"]
    # attention score elements of that batch: padded B*L^2, rmpad sum(len^2), flat (dense block mask) T^2
    lens = batches["padded+sdpa"][args.warmup]["attention_mask"].sum(1).tolist()
    att = {
        "padded+sdpa": len(lens) * max(lens) ** 2,
        "rmpad+reference": sum(n * n for n in lens),
        "flat+sdpa": sum(lens) ** 2,
    }
    vision_s = vision_share(arms["padded+sdpa"].model, batches["padded+sdpa"][args.warmup])

    with tempfile.TemporaryDirectory() as tmp:
        state_path = str(Path(tmp) / "state.pt")
        torch.save({"weights": weights, "batches": batches}, state_path)
        rss = measure_rss(state_path, args.rss_steps, args.threads)

    # -------------------------------------------------------------------------------------------- report
    pad = "padded+sdpa"
    step_rows = []
    for n in ARMS:
        r = rss[n]
        rss_txt = (
            f"{r['peak'] / 2**20:,.0f} MiB ({(r['peak'] - r['before']) / 2**20:+,.0f})" if "peak" in r else "error"
        )
        fwd, bwd, opt = (x * 1e3 for x in phase[n])
        step_rows.append(
            [
                n,
                f"**{med[n] * 1e3:,.0f}**",
                f"{fwd:,.0f} / {bwd:,.0f} / {opt:,.0f}",
                f"{med[n] / med[pad]:.3f}",
                f"{tok_s[n]:,.0f}",
                rss_txt,
                f"{first[n]:.7f}",
                f"{loss_err[n]:.1e}",
            ]
        )
    step_table = C.md_table(
        [
            "arm",
            "median step ms",
            "fwd / bwd / AdamW ms",
            "time / padded",
            "real tokens/s",
            "peak RSS (increase over pre-step RSS)",
            "first-step loss",
            "rel. diff vs padded",
        ],
        step_rows,
    )
    batch_rows = [
        [
            str(i),
            str(s["rows"]),
            str(s["width"]),
            str(s["real"]),
            f"{s['real'] / s['slots']:.3f}",
            str(s["images"]),
            str(s["patches"]),
            str(s["supervised"]),
        ]
        for i, s in enumerate(stats)
    ]
    batch_table = C.md_table(
        ["batch", "rows", "padded width", "real tokens", "real fraction", "images", "patches", "supervised"], batch_rows
    )
    prof_table = C.md_table(["arm", "op", "input shapes (first 3)", "self CPU ms", "share", "calls"], prof_rows)
    labels = [label for label, _ in CATEGORIES]
    cat_rows = [
        [n]
        + [f"{cats[n][l]:,.0f} ({cats[n][l] / cats[pad][l]:.2f}x)" for l in labels]
        + [f"{cats[n]['total']:,.0f} ({cats[n]['total'] / cats[pad]['total']:.2f}x)"]
        for n in ARMS
    ]
    cat_table = C.md_table(["arm (ms; x padded)", *labels, "total"], cat_rows)
    fixed = vision_s + phase[pad][2]
    expected = fixed + real_fraction * (med[pad] - fixed)
    rmpad = med["rmpad+reference"]
    rss_method = next((r["method"] for r in rss.values() if "method" in r), "n/a")
    max_err = max(loss_err.values())
    mm = {n: cats[n][labels[0]] / cats[pad][labels[0]] for n in ARMS}
    at = {n: cats[n][labels[1]] / cats[pad][labels[1]] for n in ARMS}
    summary = {
        "median_ms": {n: med[n] * 1e3 for n in ARMS},
        "phases_ms": {n: [x * 1e3 for x in phase[n]] for n in ARMS},
        "tokens_per_s": tok_s,
        "real_fraction": real_fraction,
        "first_loss": first,
        "vision_ms": vision_s * 1e3,
        "expected_rmpad_ms": expected * 1e3,
        "rss": rss,
        "profile_categories_ms": cats,
        "attention_elements": att,
    }
    why = (
        "; a little faster than that, because attention falls with Σ len² / (B·L²), faster than the token fraction"
        if rmpad < 0.97 * expected
        else "; slower than that: look for per-sequence overheads in the profile below"
        if rmpad > 1.05 * expected
        else ""
    )
    analysis = f"""Naive expectation: rmpad step / padded step = real-token fraction = **{real_fraction:.3f}**; measured **{rmpad / med[pad]:.3f}** ({rmpad * 1e3:,.0f} vs {med[pad] * 1e3:,.0f} ms).

What scales with what (self CPU time per operator class, median of {args.profile_steps} profiled steps per arm on the first measured batch, whose real-token fraction is {prof_fraction:.3f}; ratio to padded):

{cat_table}

- Linear layers (matmul) scale with the tokens that go through them: rmpad/padded = {mm["rmpad+reference"]:.2f}x (real fraction of the profiled batch {prof_fraction:.3f}); flat {mm["flat+sdpa"]:.2f}x.
- Attention scales with score elements (profiled batch): padded computes B·L² = {att[pad]:,}, rmpad Σ len² = {att["rmpad+reference"]:,} ({att["rmpad+reference"] / att[pad]:.2f}x), flat+sdpa the dense T² = {att["flat+sdpa"]:,} ({att["flat+sdpa"] / att[pad]:.2f}x: sdpa gets a block-diagonal *mask* over the whole row and on CPU computes every masked score). Measured attention-kernel time: rmpad {at["rmpad+reference"]:.2f}x, flat {at["flat+sdpa"]:.2f}x of padded.
- Fixed costs that no padding scheme changes: the vision tower ({vision_s * 1e3:,.0f} ms forward + backward on this batch's {measured[0]["patches"]} patches) and AdamW over {n_params / 1e6:.1f}M parameters ({phase[pad][2] * 1e3:,.0f} ms). With them, the expected rmpad step is fixed + fraction x (padded - fixed) = {fixed * 1e3:,.0f} + {real_fraction:.3f} x {(med[pad] - fixed) * 1e3:,.0f} = **{expected * 1e3:,.0f} ms**; measured {rmpad * 1e3:,.0f} ms ({rmpad / expected:.2f}x the expectation){why}."""
    notes = "\n".join(f"- {n}" for n in NOTES)
    body = f"""## CPU training step: padded vs flat vs rmpad (`bench_step_cpu.py`)

{C.footer(t_start, C.machine(f"torch.set_num_threads({args.threads})"), load_before=load_before)}
- Model: random-init Qwen2.5-VL, {n_params / 1e6:.1f}M parameters, fp32, attn_implementation "sdpa": text 4 layers x 512 (8 heads, 2 kv heads, intermediate 1376, vocab 512), vision depth 4 x 256 (4 heads, intermediate 684, window 112 px, full attention in block 3). Loss = mean CE over supervised tokens.
- Data: {num_batches} batches of {args.batch_size} samples (text lognormal median 150 tokens clipped to 60-500, 85% with one real 56-224 px image through the tiny Qwen2.5-VL processor, labels on the answer). Real-token fraction of the padded batches over the measured steps: **{real_fraction:.3f}**.
- Method: the three arms run in one process, interleaved step by step on the same batches (collated before timing), each on its own deep copy of the same initial weights with its own AdamW (lr 1e-4); a step = forward + backward + `optimizer.step()` + `zero_grad`. {args.warmup} warm-up step(s) per arm, then the median of {args.steps} measured steps. real tokens/s = median over steps of (real tokens / step time).
- Peak RSS: one fresh child process per arm loads the same weights and batches, resets the kernel's peak-RSS counter (`echo 5 > /proc/self/clear_refs`) and runs {args.rss_steps} steps; the number is `VmHWM` after them ({rss_method}); in brackets the increase over the RSS just before the first step (activations, gradients, AdamW state).

{step_table}

First-step losses (same weights, same batch) agree to a relative **{max_err:.1e}** (fp32; tests/test_patches.py asserts 1e-5).

![CPU step](step_cpu.png)

### Is rmpad at the real-token fraction of padded?

{analysis}

{notes}

Top operators by self CPU time (the last profiled step per arm, first measured batch; torch.profiler adds overhead):

{prof_table}

Batches (padded view; the first {args.warmup} are warm-up):

{batch_table}
"""
    summary_path = Path(tempfile.gettempdir()) / "bench_step_cpu_summary.json"
    summary_path.write_text(json.dumps(summary, indent=1, default=str))
    if args.no_write:
        print(body)
    else:
        plot(
            PLOT,
            list(ARMS),
            [tok_s[n] for n in ARMS],
            [med[n] * 1e3 for n in ARMS],
            f"Qwen2.5-VL {n_params / 1e6:.1f}M, CPU ({args.threads} thread{'s' if args.threads > 1 else ''}), "
            f"batches of {args.batch_size}, real-token fraction {real_fraction:.2f}",
        )
        C.write_section("bench_step_cpu", body)
        print(body)
        print(f"wrote {C.RESULTS} and {PLOT}")
    print(f"summary: {summary_path}")


# ------------------------------------------------------------------------------------------------ TRL arm

TRL_ARMS = ("sft unpatched", "sft rmpad")


def _sft_trainer(model, processor, out: str):
    """An SFTTrainer used only for its ``training_step`` (TRL's fused LM head on ``model.model``)."""
    import trl
    from datasets import Dataset

    args = trl.SFTConfig(
        out,
        max_length=None,
        bf16=False,
        use_cpu=True,
        report_to=[],
        remove_unused_columns=False,
        dataset_kwargs={"skip_prepare_dataset": True},
        gradient_checkpointing=False,
    )
    dummy = Dataset.from_list([{"input_ids": [1, 2], "labels": [1, 2]}])
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=dummy, processing_class=processor)
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def run_frozen_tower(args) -> None:
    """The ``--frozen-tower`` arms: the rmpad step (collator packs, gradient checkpointing, vision tower frozen) with
    the tower's one call run without autograd (`hf_packing.patches._vision.frozen_tower`, the library's behaviour) and
    with it forced through autograd (what transformers' input-gradient hook on the patch embedding does): the same
    model and batches, interleaved in one run."""
    import torch

    from hf_packing.patches import _vision

    torch.set_num_threads(args.threads)
    load_before, t_start = C.load_average(), time.time()
    batches = make_batches(args.warmup + args.steps, args.batch_size)["rmpad+reference"]
    arms, real_check = {}, _vision.frozen_tower
    for name in ("no autograd in the tower", "autograd through the tower"):
        model = build_model()
        model.model.visual.requires_grad_(False)
        model.gradient_checkpointing_enable()
        arms[name] = Arm("rmpad " + name, model, batches)
    times: dict[str, list[float]] = {name: [] for name in arms}
    for i in range(args.warmup + args.steps):
        for name, arm in arms.items():
            _vision.frozen_tower = real_check if name.startswith("no") else (lambda backbone: False)
            try:
                dt = arm.step(i)
            finally:
                _vision.frozen_tower = real_check
            if i >= args.warmup:
                times[name].append(dt)
        print(f"[frozen] batch {i}: " + ", ".join(f"{n} {t[-1] * 1e3:.0f} ms" for n, t in times.items() if t))
    med = {n: C.median(t) for n, t in times.items()}
    losses = {n: arm.losses for n, arm in arms.items()}
    same = all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(*losses.values(), strict=True))
    rows = [[n, f"{med[n] * 1e3:,.0f}", f"{med[n] / med['autograd through the tower']:.2f}x"] for n in arms]
    body = f"""## CPU training step with a frozen vision tower (`bench_step_cpu.py --frozen-tower`)

The rmpad step on collator packs (`rmpad+reference` batches of the section above, {args.batch_size} samples each),
the vision tower frozen and gradient checkpointing on: transformers' `enable_input_require_grads` hooks the tower's
patch embedding too, so without the library's `frozen_tower` the backward runs through every tower block for no
parameter. Same model weights and batches, arms interleaved; {args.steps} measured steps after {args.warmup}
warm-up; losses of every step equal between the arms: {same}.

{C.md_table(["arm", "median step (ms)", "vs autograd"], rows)}

{C.footer(t_start, C.machine(f"torch.set_num_threads({args.threads})"), load_before=load_before)}
"""
    print(body)
    if not args.no_write:
        C.write_section("bench_step_cpu_frozen", body)


def _qwen4_batch(processor, length: int, batch_size: int, seed: int) -> dict[str, Any]:
    """A padded batch of ``batch_size`` text samples of about ``length`` tokens each (±20%), labels on all but the
    first token; EOS (``<|im_end|>``) every ~40 tokens, as turns end."""
    import torch

    from hf_packing.testing.tiny import BASE_VOCAB, TOKEN_IDS

    rng = np.random.default_rng(seed)
    lengths = [int(length * f) for f in rng.uniform(0.8, 1.2, batch_size)]
    ids = torch.full((batch_size, max(lengths)), TOKEN_IDS["<|endoftext|>"])
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        tokens = torch.from_numpy(rng.integers(0, BASE_VOCAB, n))
        tokens[rng.random(n) < 1 / 40] = TOKEN_IDS["<|im_end|>"]
        ids[row, :n], mask[row, :n] = tokens, 1
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, 0] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "mm_token_type_ids": torch.zeros_like(ids)}


def run_qwen4_exp(args) -> None:
    """The ``--qwen4-exp`` arms (module docstring): step time per length, unpatched vs rmpad, and the indexer's
    share of each step."""
    import torch

    from hf_packing.patches import _qwen4_exp, apply_rmpad, revert_rmpad
    from hf_packing.testing.syncs import SyncCounter
    from hf_packing.testing.tiny import build_tiny_model

    torch.set_num_threads(args.threads)
    load_before, t_start = C.load_average(), time.time()
    model = build_tiny_model("qwen4_exp").train()
    indexer_cls = type(model.model.language_model.layers[1].self_attn.indexer)
    spent = [0.0]

    def timed(fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[0] += time.perf_counter() - t0

        return wrapper

    originals = (indexer_cls.forward, _qwen4_exp.packed_qsa)
    indexer_cls.forward, _qwen4_exp.packed_qsa = timed(originals[0]), timed(originals[1])

    def step(batch: dict[str, Any], patched: bool) -> tuple[float, float, float]:
        if patched:
            apply_rmpad("qwen4_exp")
        try:
            model.zero_grad(set_to_none=True)
            spent[0] = 0.0
            t0 = time.perf_counter()
            loss = model(**batch, use_cache=False).loss
            loss.backward()
            return time.perf_counter() - t0, spent[0], float(loss.detach())
        finally:
            if patched:
                revert_rmpad("qwen4_exp")

    rows, same = [], True
    try:
        for length in [int(n) for n in args.lengths.split(",")]:
            batch = _qwen4_batch(None, length, args.batch_size, seed=length)
            step(batch, True)  # warm-up (the patched arm's first call applies the patch, loads liger, ...)
            results: dict[bool, list[tuple[float, float, float]]] = {False: [], True: []}
            for _ in range(args.steps):
                for patched in (False, True):
                    results[patched].append(step(batch, patched))
            med = {p: (C.median(r[0] for r in results[p]), C.median(r[1] for r in results[p])) for p in results}
            same &= all(abs(a[2] - b[2]) <= 1e-4 * abs(a[2]) for a, b in zip(results[False], results[True]))
            syncs = {}
            for patched in (False, True):  # untimed: the counting modes slow every op
                with SyncCounter() as counter:
                    step(batch, patched)
                syncs[patched] = counter.total
            real = int(batch["attention_mask"].sum())
            rows.append(
                [
                    f"~{length}",
                    f"{real:,} of {batch['attention_mask'].numel():,} ({real / batch['attention_mask'].numel():.0%})",
                    f"{med[False][0] * 1e3:,.0f}",
                    f"{med[False][1] * 1e3:,.0f} ({med[False][1] / med[False][0]:.0%})",
                    f"{med[True][0] * 1e3:,.0f}",
                    f"{med[True][1] * 1e3:,.1f} ({med[True][1] / med[True][0]:.1%})",
                    f"{med[False][0] / med[True][0]:.1f}x",
                    f"{syncs[False]:,} / {syncs[True]:,}",
                ]
            )
            print(f"[qwen4_exp] {rows[-1]}")
    finally:
        indexer_cls.forward, _qwen4_exp.packed_qsa = originals
    header = [
        "tokens per sample",
        "real of padded tokens",
        "unpatched step (ms)",
        "its indexer (ms, share)",
        "rmpad step (ms)",
        "its indexer (ms, share)",
        "speed-up",
        "syncing ops per step (unpatched / rmpad)",
    ]
    body = f"""## Qwen4-Exp CPU training step, unpatched vs rmpad (`bench_step_cpu.py --qwen4-exp`)

The tiny Qwen4-Exp of the tests (`hf_packing.testing.tiny`: hidden 64, Gated DeltaNet with PLE, one QSA layer with
8 indexer heads, blocks of 4, budget 8 tokens, MoE 4 experts top-2, 2 hyper-connection streams), fp32. The same
padded batch of {args.batch_size} text samples per length (±20% around it), forward + backward; unpatched
(transformers' sdpa path, its per-query indexer loop) and `apply_rmpad("qwen4_exp")` (auto backends: the packed
QSA selection and the `gather` attention over selected keys), interleaved, {args.steps} measured steps each after
one patched warm-up step. "its indexer": the time inside transformers' `Qwen4ExpTextQSAIndexer.forward`
(unpatched) or the packed selection (`_qwen4_exp.packed_qsa`, rmpad) during the step's forward. Losses equal
between the arms at every step (rel 1e-4): {same}.

{C.md_table(header, rows)}

"syncing ops": one more step per arm under `hf_packing.testing.syncs.SyncCounter` (ops a GPU host would wait on:
`nonzero`, `.item()`, ...). Unpatched, one per query (padding included) per QSA layer, transformers' per-query
`nonzero`, plus this batch's own; the rmpad arm's few come from this padded batch itself (unpadding it and counting its
supervised tokens): a collator batch carries them precomputed and its step makes 0 (`tests/test_syncs.py`, Qwen4-Exp
included).

Reading: outside the indexer both arms run the same Gated DeltaNet, MoE and projections on a hidden size of 64
(a profile of the patched step: matmuls and the GDN chunk products lead), and transformers' indexer at this size is
mostly Python per query, so its cost grows about linearly up to ~1,000 tokens; the speed-up grows from the short
samples (fixed costs) to ~400 and holds to ~1,000 (it moves with the batch's padding too: the ~1,000 batch is 94%
real tokens, the ~700 one 84%), then grows again where transformers' quadratic terms (its dense `(L, L)` masks and
sdpa, each query's scores against all its blocks) take over. Ours stays a small share up to
~1,000 and grows at 4,000: the packed indexer is quadratic too (every query scores its sample's blocks, as
transformers' does), without the Python loop. On a GPU the gap is wider than on this CPU: every unpatched syncing op
stalls the host.

{C.footer(t_start, C.machine(f"torch.set_num_threads({args.threads})"), load_before=load_before)}
"""
    print(body)
    if not args.no_write:
        C.write_section("bench_step_cpu_qwen4_exp", body)


def run_trl(args) -> None:
    """The ``--trl`` arms (module docstring): step time, real tokens/s, first-layer tokens, loss agreement."""
    import torch
    from transformers import AutoProcessor

    from hf_packing.patches import apply_rmpad, revert_rmpad

    torch.set_num_threads(args.threads)
    load_before, t_start = C.load_average(), time.time()
    num_batches = args.warmup + args.steps
    batches = make_batches(num_batches, args.batch_size)["padded+sdpa"]
    processor = AutoProcessor.from_pretrained(str(FIXTURE))
    base = build_model()
    times: dict[str, list[float]] = {n: [] for n in TRL_ARMS}
    losses: dict[str, list[float]] = {n: [] for n in TRL_ARMS}
    layer_tokens: dict[str, list[int]] = {n: [] for n in TRL_ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        arms = {}
        for name in TRL_ARMS:
            model = copy.deepcopy(base).train()
            model.model.language_model.layers[0].register_forward_hook(
                lambda m, a, out, name=name: layer_tokens[name].append(a[0].shape[:-1].numel())
            )
            arms[name] = (_sft_trainer(model, processor, tmp), model, torch.optim.AdamW(model.parameters(), lr=1e-4))
        for i in range(num_batches):
            for name, (trainer, model, optimizer) in arms.items():
                if name == "sft rmpad":
                    apply_rmpad("qwen2_5_vl", attn_backend="reference")
                try:
                    t0 = time.perf_counter()
                    loss = trainer.training_step(model, dict(batches[i]))
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    dt = time.perf_counter() - t0
                finally:
                    revert_rmpad("qwen2_5_vl")
                losses[name].append(float(loss))
                if i >= args.warmup:
                    times[name].append(dt)
            print(f"[trl] batch {i}: " + ", ".join(f"{n} {times[n][-1] * 1e3:.0f} ms" for n in times if times[n]))
    real = [int(b["attention_mask"].sum()) for b in batches]
    if layer_tokens["sft rmpad"] != real:
        raise RuntimeError(
            f"the rmpad arm's first decoder layer got {layer_tokens['sft rmpad']} tokens for {real} real ones: the "
            "hf_packing imported here has no patched backbone (run from the checkout: PYTHONPATH=. python ...)"
        )
    med = {n: C.median(t) for n, t in times.items()}
    tok_s = {n: C.median(r / t for r, t in zip(real[args.warmup :], times[n])) for n in TRL_ARMS}
    ref = losses[TRL_ARMS[0]][0]
    rows = [
        [
            n,
            f"**{med[n] * 1e3:,.0f}**",
            f"{med[n] / med[TRL_ARMS[0]]:.3f}",
            f"{tok_s[n]:,.0f}",
            f"{sum(layer_tokens[n][: len(real)]):,} / {sum(b['attention_mask'].numel() for b in batches):,}",
            f"{losses[n][0]:.7f}",
            f"{abs(losses[n][0] - ref) / abs(ref):.1e}",
        ]
        for n in TRL_ARMS
    ]
    table = C.md_table(
        [
            "arm",
            "median step ms",
            "time / unpatched",
            "real tokens/s",
            "tokens into layer 0 / padded slots (all steps)",
            "first-step loss",
            "rel. diff",
        ],
        rows,
    )
    fraction = sum(real[args.warmup :]) / sum(b["attention_mask"].numel() for b in batches[args.warmup :])
    body = f"""## CPU training step under TRL's SFTTrainer: unpatched vs rmpad (`bench_step_cpu.py --trl`)

{C.footer(t_start, C.machine(f"torch.set_num_threads({args.threads})"), load_before=load_before)}
- Model and data: as in the section above (random-init Qwen2.5-VL, batches of {args.batch_size}); the padded `VisionCollator` rows (what TRL's own VLM collator gives: right-padded rows + attention mask). Real-token fraction over the measured steps: **{fraction:.3f}**.
- Method: two arms in one process, interleaved step by step on the same batches, each on its own copy of the same initial weights with its own AdamW (lr 1e-4). A step = `SFTTrainer.training_step` (TRL {C.version_of("trl")}: `compute_loss` → `model(..., fused_lm_head=True)` → `model.model(...)` + TRL's chunked log-prob head; forward + backward) + `optimizer.step()` + `zero_grad`; `rmpad` wraps the step in `apply_rmpad("qwen2_5_vl", attn_backend="reference")` / `revert_rmpad`. fp32, no gradient checkpointing. {args.warmup} warm-up step(s), median of {args.steps} measured steps.

{table}

Both arms run TRL's own head (on CPU it scores every position of the `(B, L)` rows: it compacts to the supervised ones only on Triton devices); only the backbone differs: unpatched it runs every padded slot, patched the real tokens only (the layer-0 column). Timings are medians on a shared 2-core machine: compare the load average above before reading small differences. First-step losses agree to the relative difference shown (fp32; `tests/test_trl.py` asserts 1e-5 over 3 steps).
"""
    if args.no_write:
        print(body)
    else:
        C.write_section("bench_step_cpu_trl", body)
        print(body)
        print(f"wrote {C.RESULTS}")


#: Observations from the runs that the numbers above do not explain by themselves.
# ------------------------------------------------------------------------------------------------ --compile


class _CountingBackend:
    """``torch.compile`` backend that counts the graphs it is handed (recompilations included)."""

    def __init__(self, backend: str) -> None:
        self.backend, self.graphs = backend, 0

    def __call__(self, gm, example_inputs):
        import torch

        self.graphs += 1
        return torch._dynamo.lookup_backend(self.backend)(gm, example_inputs)


def _syncs_per_step(arm: Arm, index: int) -> str:
    """Host syncs of one more forward + backward (not timed, no optimizer step: AdamW reads its step counters on
    the host, the same in every arm): ``total (hf_packing's)``, as ``tests/test_syncs.py`` counts them.

    Counted with the compiled layers run eagerly: dynamo will not run compiled code under `SyncCounter`'s
    dispatch mode (it falls back to eager by itself), and a ``fullgraph=True`` layer cannot hold a syncing op (it
    would be a graph break, which fullgraph refuses), so the compiled step issues what the eager step issues
    outside the layers."""
    import torch

    from hf_packing.testing.syncs import SyncCounter

    with torch.compiler.set_stance("force_eager"), SyncCounter() as counter:
        arm.model(**arm.batches[index]).loss.backward()
    arm.model.zero_grad(set_to_none=True)
    return f"{counter.total} ({counter.by('hf_packing/')})"


def run_compile(args) -> None:
    """Eager vs per-layer compiled, padded rows (unpatched) vs rmpad, same batches, one process."""
    import torch

    from hf_packing.patches import apply_rmpad, revert_rmpad

    torch.set_num_threads(args.threads)
    load_before, t_start = C.load_average(), time.time()
    num_batches = 1 + args.warmup + args.steps  # step 0 of a compiled arm compiles
    batches = make_batches(num_batches, args.batch_size)
    base = build_model()
    results: dict[str, dict[str, Any]] = {}
    for kind, data in (("padded+sdpa", "padded+sdpa"), ("rmpad+reference", "rmpad+reference")):
        torch._dynamo.reset()
        backend = _CountingBackend(args.compile_backend)
        arms = {kind: Arm(kind, copy.deepcopy(base), batches[data])}
        arms[f"{kind} compiled"] = Arm(f"{kind} compiled", copy.deepcopy(base), batches[data])
        for layer in arms[f"{kind} compiled"].model.model.language_model.layers:
            layer.compile(fullgraph=True, dynamic=True, backend=backend)
        for arm in arms.values():
            arm.rmpad = False  # patched once for the group below, not per step
        if kind.startswith("rmpad"):
            apply_rmpad("qwen2_5_vl", attn_backend="reference")
        try:
            times: dict[str, list[float]] = {name: [] for name in arms}
            for i in range(num_batches):  # interleaved step by step
                for name, arm in arms.items():
                    times[name].append(arm.step(i))
            syncs = {name: _syncs_per_step(arm, 1) for name, arm in arms.items()}
        finally:
            revert_rmpad("qwen2_5_vl")
        for name, arm in arms.items():
            results[name] = {
                "first_s": times[name][0],
                "median_ms": C.median(times[name][1 + args.warmup :]) * 1e3,
                "graphs": backend.graphs if name.endswith("compiled") else 0,
                "syncs": syncs[name],
                "first_loss": arm.losses[0],
                "last_loss": arm.losses[-1],
            }
            print(f"[compile] {name}: {results[name]}", flush=True)
    real = [batch_stats(b)["real"] for b in batches["padded+sdpa"][1 + args.warmup :]]
    pad = results["padded+sdpa"]["median_ms"]
    rows = [
        [
            name,
            f"**{r['median_ms']:,.0f}**",
            f"{r['median_ms'] / pad:.3f}",
            f"{C.median(n / (r['median_ms'] / 1e3) for n in real):,.0f}",
            f"{r['first_s']:,.1f}",
            str(r["graphs"]),
            r["syncs"],
            f"{r['first_loss']:.7f}",
            f"{r['last_loss']:.7f}",
        ]
        for name, r in results.items()
    ]
    table = C.md_table(
        [
            "arm",
            "median step ms",
            "time / padded eager",
            "real tokens/s",
            "first step s (compiles)",
            "graphs compiled",
            "host syncs fwd+bwd (hf_packing's)",
            "first-step loss",
            "last-step loss",
        ],
        rows,
    )
    body = f"""## CPU training step: eager vs per-layer compiled, padded vs rmpad (`bench_step_cpu.py --compile`)

{C.footer(t_start, C.machine(f"torch.set_num_threads({args.threads})"), load_before=load_before)}
- Model and data: as in the section above (`step_config`, batches of {args.batch_size} samples, one row each); {args.steps} measured steps per arm after {args.warmup} warm-up step(s) and the compiling step; compile backend `{args.compile_backend}`, every text decoder layer `fullgraph=True, dynamic=True`; the vision tower, the loss and the optimizer stay eager. Host syncs: one more forward + backward under `SyncCounter` (syncing ops: all, and hf_packing's in brackets; counted with the layers eager, see `_syncs_per_step`: a fullgraph layer cannot hold one).

{table}

The padded arms run first, then the rmpad arms (each group interleaves its eager and compiled copies). The losses of an arm's eager and compiled copies agree (same weights, same batches); a difference in the last digit is the compiled kernels' summation order. Compiled rmpad is not faster here: under compile the CPU reference attention runs one SDPA with a dense (T, T) block mask (`masked_reference_varlen`, one graph for any number of sequences) instead of one SDPA per sequence, so it computes every cross-sequence score; the GPU backends were not measured compiled. Compilations: 5 graphs over the padded arm's 5 batches (of different widths; recompiles not bounded on padded rows), 2 over the rmpad arm's. Timings on a shared 2-core machine under load from other jobs: read small differences with the load average above."""
    if args.no_write:
        print(body)
    else:
        C.write_section("bench_step_cpu_compile", body)


NOTES: list[str] = [
    "One thread by default: on this 2-core machine, shared with other jobs, `--threads 2` made every step 2-3x "
    "slower and erratic (each parallel op waits for the thread that lost its core); one thread gives stable "
    "ratios between arms, which is what this benchmark is for.",
    "flat+sdpa is the transformers-native packed path: no padding, so its linear layers cost what rmpad's do, but "
    "sdpa receives a dense block-diagonal mask over the whole packed row and the CPU kernel computes all T^2 "
    "scores, masked or not. Its attention therefore grows with the square of the *pack*, not of each sample; "
    "at these short samples it is already the costliest attention of the three arms. (On GPU, flash_attention_2 "
    "removes that; see bench_gpu.py.)",
    "flat+sdpa gets its M-RoPE position ids from the collator (outside the timed step), while padded and rmpad "
    "compute them inside the model's forward (`get_rope_index`, a Python loop over rows: about 1-3 ms per batch "
    "here, see the collator table of bench_packing), a negligible advantage for flat.",
    "Peak RSS follows the activations: padded keeps B x L activations for backward, rmpad and flat only T.",
    "The profiler's 'everything else' column is the noisy one: on this VM the memory-bound element-wise ops on "
    "padded's larger activations (SwiGLU `mul`, `silu_backward` on (8, L, 1376)) took anywhere from 45 to 330 ms "
    "in identical repeated steps, with or without the malloc settings of bench_packing; the timed medians above "
    "are stable across runs (padded 2,821-2,914 ms, rmpad 1,343-1,392 ms in three quiet runs) and the fwd / bwd "
    "split scales with the "
    "real-token fraction.",
]


if __name__ == "__main__":
    main()
