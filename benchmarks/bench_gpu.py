"""GPU training-step benchmark on a Qwen2.5-VL-3B-shaped model (random init, bf16): padded vs flat vs rmpad.

Model: `Qwen2_5_VLForConditionalGeneration` with Qwen2.5-VL-3B-Instruct's real dimensions, written out here
(nothing is downloaded; weights are random):

- text: hidden 2048, 36 layers, 16 heads (head_dim 128), 2 kv heads, intermediate 11008, vocab 151936,
  rms_norm_eps 1e-6, rope_theta 1e6, M-RoPE sections [16, 24, 24], tied embeddings;
- vision: depth 32, hidden 1280, 16 heads, intermediate 3420, patch 14, temporal patch 2, spatial merge 2,
  window 112 px, full attention in blocks 7/15/23/31, output 2048;
- token ids: image 151655, video 151656, vision start/end 151652/151653, bos 151643, eos 151645.

About 3.75B parameters; bf16 weights, bf16 AdamW states, activation (gradient) checkpointing on the decoder
layers (``--no-grad-ckpt`` to turn it off). ``--layers N`` / ``--vision-layers N`` shrink the model for quick runs.

Data: LLaVA-like samples (the ``llava`` mix of `bench_packing.py`: Qwen2.5-VL token counts per image from
COCO/GQA/OCR-VQA/VG/TextVQA-like sizes), packed with `plan_packs(strategy="bfd")` into packs of at most
8,192 and 16,384 tokens. Random token ids and random pixels; every arm sees the same packs in the same order.
Positions (M-RoPE) come from `VisionCollator(model_config=...)` in every arm, i.e. computed in data workers.

Arms (one process, interleaved step by step; one model and one AdamW with ``lr=0`` shared by all arms, so
every arm runs a full optimizer step while the weights never change: first-step losses are comparable and
no arm needs its own copy of a 3.75B model):

- ``padded+sdpa``: unpatched, `VisionCollator(mode="rows")`: one padded row per sample.
- ``flat+fa2`` (``flash_attention_2`` when flash-attn is importable) or ``flat+sdpa``: unpatched,
  `VisionCollator(mode="flat")`; one row, no padding. transformers detects the packed sequences from the text
  position row only with ``use_cache=False`` (the collator adds it); sdpa then gets a dense block-diagonal
  mask and computes all T^2 scores, flash_attention_2 runs varlen.
- ``rmpad+torch_varlen``: `apply_rmpad(attn_backend="torch_varlen")` around the step,
  `VisionCollator(mode="rows")` + ``cu_seqlens``; ``rmpad+flash_attn`` too when flash-attn is importable.

Vision tower frozen and trainable, separately. Per arm: median step time over measured steps, real tokens/s,
samples/s, MFU, peak memory (`torch.cuda.max_memory_allocated`, reset before every step), first-step loss, and
host syncs per step: one more (untimed) step under ``torch.cuda.set_sync_debug_mode("warn")``, whose warnings
(one per synchronizing CUDA call, with the Python line that issued it) are counted and their top origins
printed; on CPU (``--smoke``) `hf_packing.testing.syncs.SyncCounter` counts the same ops instead.

Sync gate: on CUDA the patched (rmpad) arms run their measured steps (forward, loss, backward, optimizer) under
``torch.cuda.set_sync_debug_mode("error")`` (the previous mode restored after each step). A sync raises; the bench
then records where it came from and goes on with that arm without the debug mode, so timings still come out. A
sync raised inside backward has no Python frame of its own (autograd's engine reports it at
``torch/autograd/graph.py``), so one more step runs under ``torch.autograd.detect_anomaly(check_nan=False)``, whose
report names the backward node and the forward line that created it. Printed as ``[gpu] sync gate ...`` lines and
written to the table's notes.

MFU = model FLOPs / (step time x peak bf16 FLOP/s), with model FLOPs per step =
  6 · N_text · T  +  6 · L · d · Σ_docs len²           (text: N_text = non-embedding params + lm_head,
                                                        T real tokens, L layers, d = hidden; causal)
  + k · N_vision · P  +  2k · d_v · Σ_blocks Σ_seqs n²   (vision: P patches, k = 6 trainable / 2 frozen,
                                                        non-causal; seqs = the 112-px windows in windowed
                                                        blocks and whole images in full-attention blocks)
Recomputation by activation checkpointing is not counted (model FLOPs, not hardware FLOPs). Peak bf16 dense:
989 TFLOP/s (H100/H200 SXM; ``--peak-tflops`` to change); the same run also measures an 8k x 8k x 8k bf16
matmul, reported as a practical ceiling.

Run on one GPU: ``python benchmarks/bench_gpu.py`` (a few minutes); quick: ``--layers 4 --vision-layers 4``.
``--time-budget S`` skips a setting predicted to end after S seconds (marked in the table), so a short lease
still writes RESULTS.md; `benchmarks/gpu_check.sh` (``make gpu``) runs it with the GPU tests in one command.
Sequence parallelism: ``torchrun --nproc_per_node 4 benchmarks/bench_gpu.py --sp 4 --lengths 32768 65536`` compares
rmpad at SP = 1 (each GPU alone on the pack; OOM is reported, not fatal) with SP = 4 on the same packs (tokens/s
per pack and per GPU, peak memory per GPU, the all-to-all share of the step); written to its own section.
``--smoke`` runs a tiny model on CPU (rmpad with the reference backend) to check the script without a GPU;
it never writes RESULTS.md.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib.util
import os
import re
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

PLACEHOLDER_LINE = "2026-11-21: no GPU was at hand in this session; run `python benchmarks/bench_gpu.py` on one"

#: Qwen2.5-VL-3B-Instruct dimensions (config.json of the released checkpoint), written out so nothing is fetched.
TEXT_3B = {
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 11008,
    "num_hidden_layers": 36,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "max_position_embeddings": 128000,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "attention_dropout": 0.0,
    "use_sliding_window": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [16, 24, 24]},
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "pad_token_id": 151643,
}
VISION_3B = {
    "depth": 32,
    "hidden_size": 1280,
    "intermediate_size": 3420,
    "num_heads": 16,
    "in_channels": 3,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "window_size": 112,
    "fullatt_block_indexes": [7, 15, 23, 31],
    "out_hidden_size": 2048,
    "tokens_per_second": 2,
    "hidden_act": "silu",
}
IDS_3B = {
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
}
IM_START, IM_END = 151644, 151645


def model_config(*, layers: int, vision_layers: int, smoke: bool):
    """The 3B config (or, with ``smoke``, the tiny test config), with ``layers`` / ``vision_layers`` applied."""
    if smoke:
        from hf_packing.testing.tiny import tiny_config

        return tiny_config(
            "qwen2_5_vl",
            text_config={"num_hidden_layers": layers},
            vision_config={"depth": vision_layers, "fullatt_block_indexes": [vision_layers - 1]},
        )
    from transformers import Qwen2_5_VLConfig

    vision = dict(
        VISION_3B,
        depth=vision_layers,
        fullatt_block_indexes=[i for i in VISION_3B["fullatt_block_indexes"] if i < vision_layers]
        or [vision_layers - 1],
    )
    text = dict(TEXT_3B, num_hidden_layers=layers)
    return Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        tie_word_embeddings=True,
        bos_token_id=151643,
        eos_token_id=151645,
        pad_token_id=151643,
        **IDS_3B,
    )


def build_model(config, device, dtype, seed: int = 0):
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen2_5_VLForConditionalGeneration(config)
    finally:
        torch.set_default_dtype(previous)
    model.set_attn_implementation("sdpa")
    return model.train()


def count_params(model) -> dict[str, int]:
    """Text parameters without the embedding, plus lm_head (counted even when tied), and vision parameters."""
    text = model.model.language_model
    n_text = sum(p.numel() for n, p in text.named_parameters() if "embed_tokens" not in n)
    n_head = model.lm_head.weight.numel()
    n_vision = sum(p.numel() for p in model.model.visual.parameters())
    total = sum(p.numel() for p in model.parameters())
    return {"text": n_text + n_head, "vision": n_vision, "total": total}


# ------------------------------------------------------------------------------------------------ data


def make_packs(config, max_length: int, count: int, seed: int = 0) -> list[list[dict[str, Any]]]:
    """``count`` packs of LLaVA-like samples, BFD-planned to at most ``max_length`` tokens."""
    from bench_packing import _image_sample, llava_mix

    from hf_packing.packing.planner import plan_packs

    merge = config.vision_config.spatial_merge_size
    patch_dim = (
        config.vision_config.in_channels * config.vision_config.temporal_patch_size * config.vision_config.patch_size**2
    )
    vocab = min(config.get_text_config().vocab_size, config.vision_start_token_id)
    ids = {
        "im_start": IM_START if vocab > IM_END else 1,
        "im_end": IM_END if vocab > IM_END else 2,
        "vision_start": config.vision_start_token_id,
        "vision_end": config.vision_end_token_id,
        "image_pad": config.image_token_id,
    }
    mix = llava_mix(max(4000, count * max_length // 300), seed=seed)
    packs = plan_packs(mix["lengths"], max_length=max_length, strategy="bfd", buffer_size=1000)
    packs = sorted(packs, key=lambda p: -int(mix["lengths"][p].sum()))[:count]  # the fullest ones, as in training
    rng = np.random.default_rng(seed)
    out = []
    for pack in packs:
        samples = []
        for i in pack:
            grids = []
            for k, (gh, gw) in enumerate(
                ((mix["grid_h"][i], mix["grid_w"][i]), (mix["grid_h2"][i], mix["grid_w2"][i]))
            ):
                if mix["images"][i] > k:
                    grids.append((int(gh), int(gw)))
            sample = _image_sample(rng, int(mix["text"][i]), grids, patch_dim, ids, vocab=vocab)
            if merge != 2:
                raise ValueError("make_packs assumes spatial_merge_size 2")
            samples.append(sample)
        out.append(samples)
    return out


def collate(config, packs: list[list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    from hf_packing.collator import VisionCollator

    pad = config.get_text_config().pad_token_id
    rows = VisionCollator(None, mode="rows", model_config=config, pad_token_id=pad, return_cu_seqlens=False)
    rows_cu = VisionCollator(None, mode="rows", model_config=config, pad_token_id=pad, return_cu_seqlens=True)
    flat = VisionCollator(None, mode="flat", model_config=config, pad_token_id=pad)
    return {
        "padded": [rows([[s] for s in p]) for p in packs],
        "rmpad": [rows_cu([[s] for s in p]) for p in packs],
        "flat": [flat([p]) for p in packs],
    }


def to_device(batch: dict[str, Any], device, dtype) -> dict[str, Any]:
    import torch

    out = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor):
            v = v.to(device, non_blocking=True)
            if v.is_floating_point() and k.startswith("pixel_values"):
                v = v.to(dtype)
        out[k] = v
    return out


# ------------------------------------------------------------------------------------------------ FLOPs


def vision_seq_sq(grid_thw, config) -> tuple[int, int]:
    """(Σ n² over windows, Σ n² over whole images) in patches, for the windowed and full-attention blocks."""
    vc = config.vision_config
    win = vc.window_size // vc.patch_size  # patches per window side (a multiple of the merge size)
    windows, full = 0, 0
    for t, h, w in grid_thw.tolist():
        full += (t * h * w) ** 2
        for y in range(0, h, win):
            for x in range(0, w, win):
                windows += t * (min(win, h - y) * min(win, w - x)) ** 2
    return windows, full


def model_flops(config, params: dict[str, int], batch: dict[str, Any], *, vision_trainable: bool) -> float:
    text = config.get_text_config()
    mask = batch["attention_mask"]
    lens = mask.sum(1).tolist()
    tokens = sum(lens)
    flops = 6 * params["text"] * tokens + 6 * text.num_hidden_layers * text.hidden_size * sum(n * n for n in lens)
    if "pixel_values" in batch:
        vc = config.vision_config
        patches = int(batch["pixel_values"].shape[0])
        k = 6 if vision_trainable else 2
        windows, full = vision_seq_sq(batch["image_grid_thw"], config)
        n_full = len(vc.fullatt_block_indexes)
        attn = (vc.depth - n_full) * windows + n_full * full
        flops += k * params["vision"] * patches + 2 * k * vc.hidden_size * attn  # non-causal: 2x causal per score
    return float(flops)


# ------------------------------------------------------------------------------------------------ run


def matmul_ceiling(device, n: int = 8192, iters: int = 20) -> float:
    import torch

    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(5):
        a @ b
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        a @ b
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / iters
    return 2 * n**3 / seconds / 1e12


def available_arms(device_type: str, sp: int = 1) -> list[tuple[str, str, str, str | None, int]]:
    """(arm name, batch kind, attn_implementation, rmpad backend, sequence-parallel size).

    With ``sp > 1`` (under torchrun): the fastest rmpad backend at SP = 1 (each rank alone on the pack) and the
    same at SP = ``sp`` (the pack split over ``sp`` ranks)."""
    if sp > 1:
        from hf_packing import _compat

        backend = "reference"
        if device_type == "cuda":
            backend = "flash_attn" if _compat.flash_attn_varlen_module() is not None else "torch_varlen"
        return [
            (f"rmpad+{backend}", "rmpad", "sdpa", backend, 1),
            (f"rmpad+{backend}+sp{sp}", "rmpad", "sdpa", backend, sp),
        ]
    flash = importlib.util.find_spec("flash_attn") is not None
    arms = [("padded+sdpa", "padded", "sdpa", None, 1)]
    arms.append(
        ("flat+fa2", "flat", "flash_attention_2", None, 1)
        if flash and device_type == "cuda"
        else ("flat+sdpa", "flat", "sdpa", None, 1)
    )
    if device_type == "cuda":
        from hf_packing import _compat

        if _compat.torch_varlen_attn() is not None:
            arms.append(("rmpad+torch_varlen", "rmpad", "sdpa", "torch_varlen", 1))
        if _compat.flash_attn_varlen_module() is not None:
            arms.append(("rmpad+flash_attn", "rmpad", "sdpa", "flash_attn", 1))
    else:
        arms.append(("rmpad+reference", "rmpad", "sdpa", "reference", 1))
    return arms


@contextlib.contextmanager
def sync_debug_mode(mode: str | None):
    """``torch.cuda.set_sync_debug_mode(mode)`` for the block (``None``: unchanged), the previous mode restored."""
    import torch

    if mode is None:
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def is_sync_error(exc: BaseException) -> bool:
    """Whether ``exc`` is what ``set_sync_debug_mode("error")`` raises on a synchronizing CUDA call."""
    return isinstance(exc, RuntimeError) and "synchroniz" in str(exc)


def _frames(frames, last: int) -> str:
    """``file:line (function)`` of the last ``last`` frames outside torch.nn's module call wrappers."""
    keep = [f for f in frames if not f.filename.endswith(("torch/nn/modules/module.py", "contextlib.py"))]
    return " <- ".join(f"{Path(f.filename).name}:{f.lineno} ({f.name})" for f in reversed(keep[-last:]))


def _in_backward(exc: BaseException) -> bool:
    """Raised inside ``loss.backward()`` (autograd's engine): a C++ backward op that synced has no Python frame of
    its own, a Python ``backward`` one only its own lines; the forward that created the node says more."""
    return any(
        f.filename.replace(os.sep, "/").endswith(("torch/autograd/graph.py", "torch/autograd/__init__.py"))
        for f in traceback.extract_tb(exc.__traceback__)
    )


def backward_sync_origin(step: Callable[[], None]) -> str:
    """Run ``step`` (forward + backward) under ``set_sync_debug_mode("error")`` and ``detect_anomaly``: the backward
    node that synced and the forward lines that created it (anomaly mode's report), or what else happened."""
    import warnings

    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with torch.autograd.detect_anomaly(check_nan=False), sync_debug_mode("error"):
                step()
        except RuntimeError as exc:
            if not is_sync_error(exc):
                return f"anomaly step failed otherwise: {str(exc).splitlines()[0][:200]}"
            if not _in_backward(exc):
                return "forward: " + _frames(traceback.extract_tb(exc.__traceback__), 4)
        else:
            return "anomaly step did not sync (the sync depends on state the earlier step left)"
    for w in caught:
        text = str(w.message)
        node = re.search(r"Error detected in (\w+)", text)
        if node is None:
            continue
        files = re.findall(r'File "([^"]+)", line (\d+), in (\w+)', text)
        files = [(f, n, fn) for f, n, fn in files if not f.endswith("torch/nn/modules/module.py")]
        where = " <- ".join(f"{Path(f).name}:{n} ({fn})" for f, n, fn in reversed(files[-4:]))
        return f"backward node {node[1]}, created in forward at {where or '(no Python frame)'}"
    return "backward: no anomaly report (the node's forward trace was not recorded)"


def count_syncs(step: Callable[[], None], device) -> tuple[int, collections.Counter]:
    """Host syncs of one call of ``step``: (count, origins ``file:line`` -> count).

    CUDA: ``torch.cuda.set_sync_debug_mode("warn")`` makes every synchronizing CUDA call (``.item()``, ``nonzero``,
    a device-to-host copy, a blocking ``synchronize``) raise a warning at the Python line that issued it. CPU: the
    same ops counted by `SyncCounter` (a dispatch mode), for the smoke run.
    """
    import warnings

    import torch

    if device.type != "cuda":
        from hf_packing.testing.syncs import SyncCounter

        with SyncCounter() as counter:
            step()
        return counter.total, collections.Counter({where: n for (_, where), n in counter.syncs.items()})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    return len(syncs), collections.Counter(f"{Path(w.filename).name}:{w.lineno}" for w in syncs)


def run_setting(
    model, optimizer, config, params, batches, arms, *, warmup: int, steps: int, vision_trainable: bool, device
) -> dict[str, dict[str, Any]]:
    import torch

    from hf_packing.patches import apply_rmpad, revert_rmpad, sequence_parallel_state

    cuda = device.type == "cuda"
    model.model.visual.requires_grad_(vision_trainable)
    results = {
        name: {
            "times": [],
            "peak": [],
            "comm": [],
            "loss": None,
            "error": None,
            "syncs": None,
            "origins": [],
            "gate": None,  # patched arms on CUDA: None (no sync so far), else where the first sync came from
            "gated": 0,  # steps that ran under set_sync_debug_mode("error") without a sync
        }
        for name, *_ in arms
    }

    def train_step(batch):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    def sync_failure(exc: RuntimeError, batch) -> str:
        """Where the sync that the gate raised came from (file:line; in backward, the node and its forward line)."""
        optimizer.zero_grad(set_to_none=True)
        if not _in_backward(exc):
            return "forward or optimizer: " + _frames(traceback.extract_tb(exc.__traceback__), 4)

        def forward_backward() -> None:
            model(**batch).loss.backward()

        try:
            return backward_sync_origin(forward_backward)
        except torch.OutOfMemoryError:  # anomaly mode keeps a stack per node: report the sync, keep the arm
            return "backward (node not named: the detect_anomaly step ran out of memory)"
        finally:
            optimizer.zero_grad(set_to_none=True)

    states = {}  # per SP size, the state of its first apply: its mesh and timer outlive the per-step reverts
    for i in range(warmup + steps):
        for name, kind, impl, backend, sp in arms:
            res = results[name]
            if res["error"]:
                continue
            batch = batches[kind][i]
            model.set_attn_implementation(impl)
            if backend:
                apply_rmpad("qwen2_5_vl", attn_backend=backend, sequence_parallel_size=states.get(sp, sp))
                states[sp] = sequence_parallel_state()
                states[sp].timer.enable(sp > 1)
            # the sync gate: the patched arms' measured steps (warm-up steps may initialize lazily)
            gate = "error" if cuda and backend and i >= warmup and res["gate"] is None else None
            try:
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                try:
                    with sync_debug_mode(gate):
                        loss = train_step(batch)
                    res["gated"] += gate is not None
                except RuntimeError as exc:
                    if gate is None or not is_sync_error(exc):
                        raise
                    res["gate"] = sync_failure(exc, batch)
                    print(f"[gpu] sync gate FAILED: {name} step {i}: {res['gate']}", flush=True)
                    if cuda:  # this step again, without the debug mode: the arm's timings still come out
                        torch.cuda.synchronize()
                        torch.cuda.reset_peak_memory_stats()
                    t0 = time.perf_counter()
                    loss = train_step(batch)
                if cuda:
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
            except torch.OutOfMemoryError as exc:  # one arm's OOM must not sink the others
                res["error"] = f"OOM: {str(exc).splitlines()[0][:120]}"
                optimizer.zero_grad(set_to_none=True)
                if cuda:
                    torch.cuda.empty_cache()
                continue
            finally:
                if backend:
                    revert_rmpad("qwen2_5_vl")
            if res["loss"] is None:
                res["loss"] = float(loss.detach().float())
            if i >= warmup:
                res["times"].append(dt)
                res["comm"].append(states[sp].timer.take() / dt if sp in states else 0.0)
                if cuda:
                    res["peak"].append(torch.cuda.max_memory_allocated())
            del loss
        print(
            f"[gpu] step {i}: "
            + ", ".join(
                f"{n} {results[n]['times'][-1] * 1e3:.0f} ms" if results[n]["times"] and i >= warmup else n
                for n, *_ in arms
            ),
            flush=True,
        )
    for name, _, _, backend, _ in arms:
        res = results[name]
        if cuda and backend and res["gate"] is None and res["gated"]:
            res["gate"] = f"passed: {res['gated']} steps, 0 syncs"
            print(
                f"[gpu] sync gate passed: {name}, {res['gated']} steps under set_sync_debug_mode('error')", flush=True
            )
    for name, kind, impl, backend, sp in arms:  # one more step per arm, untimed: its host syncs
        res = results[name]
        if res["error"]:
            continue
        model.set_attn_implementation(impl)
        if backend:
            apply_rmpad("qwen2_5_vl", attn_backend=backend, sequence_parallel_size=sp)

        def step(batch=batches[kind][warmup]) -> None:
            model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        try:
            res["syncs"], origins = count_syncs(step, device)
        finally:
            if backend:
                revert_rmpad("qwen2_5_vl")
        res["origins"] = origins.most_common(6)
        print(f"[gpu] {name}: {res['syncs']} host syncs per step; top origins {res['origins']}", flush=True)
    model.set_attn_implementation("sdpa")
    measured = batches["padded"][warmup:]
    for name, *_ in arms:
        res = results[name]
        if not res["times"]:
            continue
        if torch.distributed.is_initialized():  # SP: a step lasts as long as its slowest rank
            times = torch.tensor(res["times"], dtype=torch.float64, device=device)
            torch.distributed.all_reduce(times, op=torch.distributed.ReduceOp.MAX)
            res["times"] = times.tolist()
        real = [int(b["attention_mask"].sum()) for b in measured]
        samples = [int(b["attention_mask"].shape[0]) for b in measured]
        flops = [model_flops(config, params, b, vision_trainable=vision_trainable) for b in measured]
        res["median_s"] = C.median(res["times"])
        res["tok_s"] = C.median(r / t for r, t in zip(real, res["times"]))
        res["samples_s"] = C.median(s / t for s, t in zip(samples, res["times"]))
        res["tflops"] = C.median(f / t for f, t in zip(flops, res["times"])) / 1e12
        res["peak_gib"] = max(res["peak"]) / 2**30 if res["peak"] else float("nan")
        res["comm_share"] = C.median(res["comm"])
        if torch.distributed.is_initialized():  # SP: the largest rank's memory
            worst = torch.tensor([res["peak_gib"]], dtype=torch.float64, device=device)
            torch.distributed.all_reduce(worst, op=torch.distributed.ReduceOp.MAX)
            res["peak_gib"] = float(worst[0])
    for state in states.values():
        state.timer.enable(False)
    return results


def skip_for_budget(budget: float | None, elapsed: float, last: tuple[int, float] | None, length: int) -> bool:
    """Whether a setting at ``length`` tokens would end past ``budget`` seconds: its time is predicted from the last
    setting's, ``(length, seconds)``, scaled by (length ratio)^1.25 (attention grows faster than linear). The first
    setting always runs."""
    if budget is None or last is None:
        return False
    return elapsed + last[1] * (length / last[0]) ** 1.25 > budget


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    parser.add_argument("--layers", type=int, default=36, help="text decoder layers (3B: 36)")
    parser.add_argument("--vision-layers", type=int, default=32, help="vision blocks (3B: 32)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384], help="pack sizes in tokens")
    parser.add_argument("--vision", choices=["frozen", "trainable", "both"], default="both")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="measured steps per arm and setting")
    parser.add_argument("--no-grad-ckpt", action="store_true", help="turn off activation checkpointing")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="peak dense bf16 TFLOP/s for MFU")
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU; checks the script, writes nothing")
    parser.add_argument("--no-write", action="store_true", help="print instead of writing RESULTS.md")
    parser.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="seconds: a (pack size, vision) setting that would end past this (predicted from the previous one) is "
        "skipped and marked in the table, so a short GPU lease still writes RESULTS.md",
    )
    parser.add_argument(
        "--sp",
        type=int,
        default=1,
        help="sequence-parallel arm: launch with torchrun --nproc_per_node N (a multiple of --sp); compares rmpad "
        "at SP=1 (each GPU alone) with SP=N on the same packs; writes the bench_gpu_sp section",
    )
    parser.add_argument(
        "--write-placeholder",
        action="store_true",
        help="only write the 'no GPU' placeholder line into RESULTS.md and exit",
    )
    args = parser.parse_args(argv)

    if args.write_placeholder:
        C.write_section("bench_gpu", "## GPU training step (`bench_gpu.py`)\n\n" + PLACEHOLDER_LINE)
        return
    import torch

    if args.smoke:
        device, dtype = torch.device("cpu"), torch.float32
        if args.layers == 36:
            args.layers, args.vision_layers = 2, 2
        if args.lengths == [8192, 16384]:
            args.lengths = [512, 1024]
        args.warmup, args.steps, args.no_write = 1, 2, True
    else:
        if not torch.cuda.is_available():
            sys.exit("bench_gpu.py needs a CUDA device (or --smoke to check the script on CPU)")
        device, dtype = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))), torch.bfloat16
        torch.cuda.set_device(device)
    rank = 0
    if args.sp > 1:
        if int(os.environ.get("WORLD_SIZE", "1")) % args.sp:
            sys.exit(f"--sp {args.sp}: launch with torchrun --nproc_per_node a multiple of {args.sp}")
        torch.distributed.init_process_group("gloo" if device.type == "cpu" else "nccl")
        rank = torch.distributed.get_rank()
    t_start = time.time()
    config = model_config(layers=args.layers, vision_layers=args.vision_layers, smoke=args.smoke)
    model = build_model(config, device, dtype)
    if not args.no_grad_ckpt and not args.smoke:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    params = count_params(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=0.0)
    arms = available_arms(device.type, args.sp)
    ceiling = matmul_ceiling(device) if device.type == "cuda" else float("nan")
    gpu_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (smoke)"
    visions = ["frozen", "trainable"] if args.vision == "both" else [args.vision]

    rows, origins = [], {}  # origins: arm -> (setting, top sync origins) of the first setting that measured it
    gates = []  # (setting, arm, the sync gate's outcome) of the patched arms on CUDA
    last = None  # (pack size, seconds) of the last setting run, for --time-budget
    for length in args.lengths:
        if skip_for_budget(args.time_budget, time.time() - t_start, last, length):
            rows += [
                [str(length), vision, f"skipped: --time-budget {args.time_budget:.0f} s"] + [""] * 8
                for vision in visions
            ]
            continue
        packs = make_packs(config, length, args.warmup + args.steps)
        cpu_batches = collate(config, packs)
        batches = {k: [to_device(b, device, dtype) for b in v] for k, v in cpu_batches.items()}
        fill = C.median(int(b["attention_mask"].sum()) / length for b in cpu_batches["padded"])
        real_frac = C.median(
            int(b["attention_mask"].sum()) / b["attention_mask"].numel() for b in cpu_batches["padded"]
        )
        for vision in visions:
            if skip_for_budget(args.time_budget, time.time() - t_start, last, length):
                rows.append([str(length), vision, f"skipped: --time-budget {args.time_budget:.0f} s"] + [""] * 8)
                continue
            t_setting = time.time()
            res = run_setting(
                model,
                optimizer,
                config,
                params,
                batches,
                arms,
                warmup=args.warmup,
                steps=args.steps,
                vision_trainable=vision == "trainable",
                device=device,
            )
            last = (length, time.time() - t_setting)
            ref = res[arms[0][0]]["loss"]
            for name, *_, sp in arms:
                r = res[name]
                if r["error"] or "median_s" not in r:
                    rows.append([str(length), vision, name, r["error"] or "no measurement", "", "", "", "", "", "", ""])
                    continue
                origins.setdefault(name, (f"{length}/{vision}", r["origins"]))
                if r["gate"]:
                    gates.append((f"{length}/{vision}", name, r["gate"]))
                r["tflops"] /= sp  # per GPU: an SP group of `sp` GPUs trains one pack
                mfu = r["tflops"] / args.peak_tflops
                rel = abs(r["loss"] - ref) / abs(ref) if ref else float("nan")
                label = name
                if sp > 1:
                    label += f" (per GPU {r['tok_s'] / sp:,.0f} tokens/s; all-to-all {r['comm_share']:.0%} of the step)"
                rows.append(
                    [
                        str(length),
                        vision,
                        label,
                        f"{r['median_s'] * 1e3:,.0f}",
                        f"{r['tok_s']:,.0f}",
                        f"{r['samples_s']:.1f}",
                        f"{mfu:.1%} ({r['tflops'] / ceiling:.0%})"
                        if ceiling == ceiling
                        else f"{r['tflops']:.3f} TFLOP/s",
                        f"{r['peak_gib']:.1f}",
                        str(r["syncs"]),
                        f"{r['loss']:.5f}",
                        f"{rel:.1e}",
                    ]
                )
            rows.append(
                [
                    str(length),
                    vision,
                    f"(pack fill {fill:.3f}; padded real-token fraction {real_frac:.3f})",
                    "",
                    "",
                    "",
                    "",
                    "",
                    "",
                    "",
                    "",
                ]
            )
        del batches
        if device.type == "cuda":
            torch.cuda.empty_cache()

    table = C.md_table(
        [
            "pack tokens",
            "vision",
            "arm",
            "median step ms",
            "real tokens/s",
            "samples/s",
            f"MFU vs {args.peak_tflops:.0f} (vs matmul ceiling)",
            "peak GiB",
            "host syncs / step",
            "first-step loss",
            "rel. diff vs padded",
        ],
        rows,
    )
    sync_origins = "\n".join(
        f"- {name} ({where}): " + (", ".join(f"`{o}` {n}" for o, n in top) or "none")
        for name, (where, top) in origins.items()
    )
    gate_lines = "\n".join(f"- {name} ({where}): {outcome}" for where, name, outcome in gates) or (
        "- not run (no CUDA device: the gate needs one)"
    )
    body = f"""## GPU training step (`bench_gpu.py`)

{C.footer(t_start, f"{gpu_name}; {C.cpu_model()}", extra=["flash-attn"])}
- Model: Qwen2.5-VL-3B-shaped, random init, {params["total"] / 1e6:,.0f}M parameters ({args.layers} text layers, {args.vision_layers} vision blocks), {str(dtype).replace("torch.", "")}, activation checkpointing {"off" if args.no_grad_ckpt or args.smoke else "on"}; AdamW lr=0 shared by all arms (full optimizer work, weights unchanged).
- Method: arms interleaved step by step on the same packs; {args.warmup} warm-up + median of {args.steps} measured steps; `torch.cuda.synchronize()` around each step; peak memory = `torch.cuda.max_memory_allocated()` after `reset_peak_memory_stats()` before each step (includes weights, grads and AdamW state); host syncs = warnings of `torch.cuda.set_sync_debug_mode("warn")` in one more step per arm.
- bf16 8192³ matmul ceiling measured in this run: **{ceiling:.0f} TFLOP/s**. MFU formula in the script docstring (6·N·T + 6·L·d·Σlen² per document for text; vision likewise, 2·N instead of 6·N when frozen).

{table}

Host syncs by origin (`file:line`: count in one step; first setting of each arm):

{sync_origins}

Sync gate (the patched arms' timed steps under `torch.cuda.set_sync_debug_mode("error")`; the first sync's origin, \
in backward the node and the forward line that created it, from `detect_anomaly`):

{gate_lines}
"""
    if args.sp > 1:  # its own section: the single-GPU arms' results stay
        body = body.replace("rel. diff vs padded", "rel. diff vs SP=1")
        body = body.replace(
            "## GPU training step (`bench_gpu.py`)", f"## GPU training step, SP={args.sp} (`bench_gpu.py --sp`)"
        )
        body += (
            f"\nSP arm: {torch.distributed.get_world_size()} processes; the SP=1 arm runs each GPU alone on the pack, "
            f"the SP={args.sp} arm splits it over {args.sp} GPUs (tokens/s per pack; per GPU = / {args.sp}; MFU per "
            "GPU; step time of the slowest rank; peak memory of the largest rank; all-to-all share from CUDA "
            "events around the SP collectives).\n"
        )
    if rank != 0:
        pass
    elif args.no_write:
        print(body)
    else:
        C.write_section("bench_gpu_sp" if args.sp > 1 else "bench_gpu", body)
        print(body)
        print(f"wrote {C.RESULTS}")
    if args.sp > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
