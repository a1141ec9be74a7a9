"""The levers of the padding-free GPU step, measured in one run on the same packs (issue #41).

Model, packs and MFU as `bench_gpu.py` (Qwen2.5-VL-3B-shaped, bf16 weights, LLaVA-like packs of 8k and 16k tokens,
vision frozen and trained), always the patched (rmpad) step with one attention backend for all arms: torch's varlen
attention when torch's FA3 can be activated (the FA3 arm switches it on), else flash-attn when installed, else
torch's varlen (reference on CPU). Arms, interleaved step by step (one model, one AdamW per kind, lr=0):

- ``ckpt``: activation checkpointing on every decoder layer and tower block (the run of RESULTS.md's first table)
- ``ckpt/2``: on every 2nd layer (transformers' ``every_n_layers=2``)
- ``no-ckpt``: off
- ``no-ckpt+fused``: off, ``torch.optim.AdamW(fused=True)`` (the Trainer's ``optim="adamw_torch_fused"``)
- ``no-ckpt+compile``: off, each decoder layer under ``torch.compile(fullgraph=True, dynamic=True)``
- ``no-ckpt+liger``: off, Liger's inner kernels (rope, RMSNorm, SwiGLU: `prepare_trainer`'s
  ``use_liger_kernel=True``); needs CUDA and liger-kernel
- ``no-ckpt+fa3``: off, ``torch.nn.attention.activate_flash_attention_impl("FA3")``; needs torch's FA3 kernels
- ``best``: off, compile, fused AdamW, FA3 where available

Per arm and setting: median step time, real tokens/s, MFU of text only and of text + vision (model FLOPs,
`hf_packing.training.flops.training_flops`; checkpointing's recompute is not counted), peak memory
(``max_memory_allocated``) against the memory model's prediction (`hf_packing.ops.memory`: weights, gradients,
the AdamW states that exist, activations), first-step loss relative to ``ckpt``, and a ``torch.profiler`` summary of
one more step (top kernels by device time, the device's idle share between kernels). An arm that cannot run (OOM,
missing kernel, unsupported option) is reported with its reason and the others go on.

``--dry``: every arm on CPU with a tiny model (bf16, 2 layers, a 256-token pack; compile with the ``eager``
backend, Liger's kernels wired but not run: Triton needs a GPU), no timing claims and nothing written: the default
suite runs it (tests/test_bench_levers.py) so the GPU run cannot fail on a typo. Run on one GPU:
``python benchmarks/bench_levers.py --time-budget 140`` (`gpu_check.sh`'s ``levers`` stage).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
import bench_gpu as G  # noqa: E402

ARMS: dict[str, dict[str, Any]] = {
    "ckpt": {"ckpt": 1},
    "ckpt/2": {"ckpt": 2},
    "no-ckpt": {},
    "no-ckpt+fused": {"fused": True},
    "no-ckpt+compile": {"compile": True},
    "no-ckpt+liger": {"liger": True},
    "no-ckpt+fa3": {"fa3": True},
    "best": {"compile": True, "fused": True, "fa3": "if available"},
}


class Levers:
    """Switches every lever of one model on and off between steps; each ``available`` reason is ``None`` when the
    lever can run here."""

    def __init__(self, model, *, dry: bool) -> None:
        import torch

        self.model, self.dry = model, dry
        self.layers = list(model.model.language_model.layers)
        self.params = [p for p in model.parameters()]
        cuda = next(model.parameters()).is_cuda
        self.optimizers = {
            fused: torch.optim.AdamW(self.params, lr=0.0, weight_decay=0.0, fused=fused) for fused in (False, True)
        }
        self.available: dict[str, str | None] = {"fa3": self._fa3_reason(), "liger": None, "compile": None}
        self.liger_on: dict[Any, Any] = {}
        self.liger_globals: dict[tuple[Any, str], tuple[Any, Any]] = {}
        self._setup_liger(cuda)
        self.compiled: dict[int, Any] = {}
        self.checkpointing: int | None = None

    @staticmethod
    def _fa3_reason() -> str | None:
        from torch.nn import attention

        if not hasattr(attention, "activate_flash_attention_impl"):
            return "this torch has no activate_flash_attention_impl"
        try:
            attention.activate_flash_attention_impl("FA3")
        except Exception as exc:  # the kernels are not built in / not installed / not this GPU
            return f"FA3 unavailable: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
        attention.restore_flash_attention_impl()
        return None

    def _setup_liger(self, cuda: bool) -> None:
        """Apply Liger's inner kernels once, remember what they changed, and switch them off again."""
        import importlib

        from hf_packing import _compat

        if importlib.util.find_spec("liger_kernel") is None:
            self.available["liger"] = "liger-kernel is not installed"
            return
        modeling = importlib.import_module("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl")
        before = dict(vars(modeling))
        try:
            _compat.apply_liger_inner_kernels(self.model, {"fused_linear_cross_entropy": False, "cross_entropy": False})
        except Exception as exc:
            self.available["liger"] = f"Liger failed to apply: {type(exc).__name__}: {str(exc)[:100]}"
            return
        for name, value in vars(modeling).items():
            if before.get(name) is not value:
                self.liger_globals[(modeling, name)] = (before.get(name), value)
        self.liger_on = {m: vars(m)["forward"] for m in self.model.modules() if "forward" in vars(m)}
        if not cuda:
            self.available["liger"] = "wired only: Liger's Triton kernels need a GPU"
        self.liger(False)

    def liger(self, on: bool) -> None:
        for module, forward in self.liger_on.items():
            if on:
                module.forward = forward
            else:
                vars(module).pop("forward", None)
        for (owner, name), (old, new) in self.liger_globals.items():
            setattr(owner, name, new if on else old)

    def fa3(self, on: bool) -> None:
        from torch.nn import attention

        if on:
            attention.activate_flash_attention_impl("FA3")
        elif self.available["fa3"] is None:
            attention.restore_flash_attention_impl()

    def compile(self, on: bool) -> None:
        for layer in self.layers:
            if on and id(layer) not in self.compiled:
                layer.compile(fullgraph=True, dynamic=True, **({"backend": "eager"} if self.dry else {}))
                self.compiled[id(layer)] = layer._compiled_call_impl
            layer._compiled_call_impl = self.compiled.get(id(layer)) if on else None

    def ckpt(self, every: int | None) -> None:
        if every == self.checkpointing:
            return
        self.model.gradient_checkpointing_disable()
        if every:
            kwargs = {"use_reentrant": False}
            if every == 1:
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
            else:  # transformers >= 5.23
                self.model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, every_n_layers=every)
        self.checkpointing = every

    def reason(self, arm: dict[str, Any]) -> str | None:
        """Why ``arm`` cannot run here (``None``: it can)."""
        for lever in ("fa3", "liger", "compile"):
            if arm.get(lever) is True and self.available[lever]:
                return self.available[lever]
        if arm.get("ckpt", 0) > 1 and not hasattr(self.model, "activation_checkpointing_enable"):
            return "every_n_layers needs transformers >= 5.23"
        return None

    @contextlib.contextmanager
    def use(self, arm: dict[str, Any]):
        """The model and optimizer of ``arm`` for one step."""
        fa3 = bool(arm.get("fa3")) and self.available["fa3"] is None
        self.ckpt(arm.get("ckpt"))
        self.compile(bool(arm.get("compile")))
        self.liger(bool(arm.get("liger")))
        self.fa3(fa3)
        try:
            yield self.optimizers[bool(arm.get("fused"))]
        finally:
            self.fa3(False)
            self.liger(False)


def profile_step(step, cuda: bool, top: int = 5) -> str:
    """A ``torch.profiler`` summary of one call of ``step``: the top kernels (ops on CPU) by self device time and,
    on CUDA, the share of the step's kernel span in which no kernel ran."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    averages = prof.key_averages()
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    ranked = sorted(averages, key=lambda e: -getattr(e, attr, 0.0))[:top]
    total = sum(getattr(e, attr, 0.0) for e in averages) or 1.0
    parts = [f"{e.key[:40]} {getattr(e, attr, 0.0) / total:.0%}" for e in ranked]
    idle = ""
    if cuda:
        kernels = sorted(
            (e.time_range.start, e.time_range.end)
            for e in prof.events()
            if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA
        )
        if kernels:
            busy, end = 0.0, kernels[0][0]
            for start, stop in kernels:
                busy += max(0.0, stop - max(start, end))
                end = max(end, stop)
            span = kernels[-1][1] - kernels[0][0]
            idle = f"; device idle {1 - busy / span:.0%} of {span / 1e3:.0f} ms"
    return ", ".join(parts) + idle


def predicted_peak(model, memory, optimizers, batch, arm, layers: int) -> float:
    """Weights + gradients + the AdamW states that exist + the activations the memory model predicts for ``arm``."""
    from hf_packing.ops.memory import training_state_bytes

    state = training_state_bytes(model)
    optimizer = sum(state["optimizer"] for opt in optimizers.values() if opt.state)
    counts = {
        "tokens": int(batch["attention_mask"].sum()),
        "patches": int(batch["pixel_values"].shape[0]) if "pixel_values" in batch else 0,
        "supervised": int(batch["num_supervised_tokens"]),
    }
    every = arm.get("ckpt")
    off, on = (memory.saved_bytes(**counts, checkpointing=c) for c in (False, True))
    activations = off if not every else on if every == 1 else on + (off - on) * (1 - 1 / every)
    return state["weights"] + state["grads"] + optimizer + activations


def run(args) -> str:
    import torch

    from hf_packing import apply_rmpad, revert_rmpad
    from hf_packing.ops.memory import ActivationMemory
    from hf_packing.training.flops import training_flops

    cuda = not args.dry
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    dtype = torch.bfloat16
    t_start = time.time()
    config = G.model_config(layers=args.layers, vision_layers=args.vision_layers, smoke=args.dry)
    model = G.build_model(config, device, dtype)
    levers = Levers(model, dry=args.dry)
    from hf_packing import _compat

    if not cuda:
        backend = "reference"
    elif levers.available["fa3"] is None or _compat.flash_attn_varlen_module() is None:
        backend = "torch_varlen"
    else:
        backend = "flash_attn"
    arms = {name: arm for name, arm in ARMS.items() if name in args.arms}
    reasons = {name: levers.reason(arm) for name, arm in arms.items()}
    ceiling = G.matmul_ceiling(device) if cuda else float("nan")
    peak_flops = args.peak_tflops * 1e12
    rows, profiles, last = [], [], None
    apply_rmpad("qwen2_5_vl", attn_backend=backend)
    try:
        data = {}  # per pack size: its packs, collated once (the frozen settings first: the targets)
        for length in args.lengths:
            packs = G.make_packs(config, length, args.warmup + args.steps)
            data[length] = [G.to_device(b, device, dtype) for b in G.collate(config, packs)["rmpad"]]
        for vision, length in ((v, n) for v in args.vision for n in args.lengths):
            batches = data[length]
            if G.skip_for_budget(args.time_budget, time.time() - t_start, last, length):
                rows.append([str(length), vision, f"skipped: --time-budget {args.time_budget:.0f} s"] + [""] * 8)
                continue
            t_setting = time.time()
            model.model.visual.requires_grad_(vision == "trainable")
            memory = ActivationMemory.from_model(model)
            results = {name: {"times": [], "peak": [], "loss": None, "error": reasons[name]} for name in arms}
            for i in range(args.warmup + args.steps):
                if i == args.warmup:  # compile and first-use costs stay out of the next setting's prediction
                    t_setting = time.time()
                for name, arm in arms.items():
                    res = results[name]
                    if res["error"]:
                        continue
                    try:
                        with levers.use(arm) as optimizer:
                            if cuda:
                                torch.cuda.synchronize()
                                torch.cuda.reset_peak_memory_stats()
                            t0 = time.perf_counter()
                            loss = model(**batches[i]).loss
                            loss.backward()
                            optimizer.step()
                            optimizer.zero_grad(set_to_none=True)
                            if cuda:
                                torch.cuda.synchronize()
                            dt = time.perf_counter() - t0
                    except Exception as exc:  # OOM, a kernel or option that fails: report, keep the others
                        res["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                        loss = None  # the failed step's graph goes now, not at the next arm's step
                        for opt in levers.optimizers.values():
                            opt.zero_grad(set_to_none=True)
                        if cuda:
                            torch.cuda.empty_cache()
                        continue
                    if res["loss"] is None:
                        res["loss"] = float(loss.detach().float())
                    if i >= args.warmup:
                        res["times"].append(dt)
                        if cuda:
                            res["peak"].append(torch.cuda.max_memory_allocated())
                    del loss
            last = (length, (time.time() - t_setting) * (args.steps + args.warmup) / max(args.steps, 1))
            measured = batches[args.warmup :]
            ref = results.get("ckpt", {}).get("loss")
            for name, arm in arms.items():
                res = results[name]
                if res["error"] or not res["times"]:
                    rows.append([str(length), vision, name, res["error"] or "no measurement"] + [""] * 7)
                    continue
                flops = [training_flops(model, b) for b in measured]
                times = res["times"]
                median = statistics.median(times)
                mfu_text = statistics.median(f["text"] / t for f, t in zip(flops, times)) / peak_flops
                mfu_all = statistics.median(f["total"] / t for f, t in zip(flops, times)) / peak_flops
                tokens = statistics.median(int(b["attention_mask"].sum()) / t for b, t in zip(measured, times))
                predicted = predicted_peak(model, memory, levers.optimizers, measured[-1], arm, args.layers)
                peak = max(res["peak"]) if res["peak"] else float("nan")
                rel = abs(res["loss"] - ref) / abs(ref) if ref else float("nan")

                def step(batch=measured[-1], arm=arm) -> None:
                    with levers.use(arm) as optimizer:
                        model(**batch).loss.backward()
                        optimizer.step()
                        optimizer.zero_grad(set_to_none=True)

                try:
                    summary = profile_step(step, cuda)
                except Exception as exc:  # e.g. OOM with the profiler's own buffers: the row stands
                    summary = f"not profiled: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
                    for opt in levers.optimizers.values():
                        opt.zero_grad(set_to_none=True)
                profiles.append(f"- {length}/{vision} {name}: {summary}")
                rows.append(
                    [
                        str(length),
                        vision,
                        name,
                        f"{median * 1e3:,.0f}" if cuda else "n/a (dry)",
                        f"{tokens:,.0f}" if cuda else "n/a (dry)",
                        f"{mfu_text:.1%}" if cuda else "n/a (dry)",
                        f"{mfu_all:.1%}" if cuda else "n/a (dry)",
                        f"{peak / 2**30:.1f}" if cuda else "n/a (dry)",
                        f"{predicted / 2**30:.1f} ({predicted / peak - 1:+.0%})"
                        if cuda
                        else f"{predicted / 2**20:.1f} MiB",
                        f"{res['loss']:.5f}",
                        f"{rel:.1e}",
                    ]
                )
    finally:
        revert_rmpad("qwen2_5_vl")
        levers.compile(False)
        levers.ckpt(None)
    table = C.md_table(
        [
            "pack tokens",
            "vision",
            "arm",
            "median step ms",
            "real tokens/s",
            f"MFU text (of {args.peak_tflops:.0f})",
            "MFU text + vision",
            "peak GiB",
            "predicted GiB (vs peak)",
            "first-step loss",
            "rel. diff vs ckpt",
        ],
        rows,
    )
    gpu_name = torch.cuda.get_device_name(device) if cuda else "CPU (dry run: no timing claims)"
    return f"""## GPU levers (`bench_levers.py`)

{C.footer(t_start, f"{gpu_name}; {C.cpu_model()}", extra=["flash-attn", "liger-kernel"])}
- Model: Qwen2.5-VL-3B-shaped ({args.layers} text layers, {args.vision_layers} vision blocks), bf16 weights, rmpad with \
`attn_backend={backend}`; AdamW lr=0 (fused and foreach: both states exist after their first steps, both in the \
peak); bf16 matmul ceiling {ceiling:.0f} TFLOP/s.
- Not run here: {"; ".join(f"{n}: {r}" for n, r in reasons.items() if r) or "none"}

{table}

One profiled step per arm (top kernels by device time; device idle share between kernels):

{chr(10).join(profiles)}
"""


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--vision-layers", type=int, default=32)
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--vision", nargs="+", choices=["frozen", "trainable"], default=["frozen", "trainable"])
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--time-budget", type=float, default=None, help="seconds; skip settings predicted past it")
    parser.add_argument("--dry", action="store_true", help="every arm on CPU with a tiny model; writes nothing")
    parser.add_argument("--no-write", action="store_true", help="print instead of writing RESULTS.md")
    args = parser.parse_args(argv)
    if args.dry:
        if args.layers == 36:
            args.layers, args.vision_layers = 2, 2
        if args.lengths == [8192, 16384]:
            args.lengths = [256]
        args.warmup, args.steps, args.no_write = 0, 1, True
    else:
        import torch

        if not torch.cuda.is_available():
            sys.exit("bench_levers.py needs a CUDA device (or --dry to check every arm on CPU)")
    body = run(args)
    print(body)
    if not args.no_write:
        C.write_section("bench_levers", body)
        print(f"wrote {C.RESULTS}")
    return body


if __name__ == "__main__":
    main()
