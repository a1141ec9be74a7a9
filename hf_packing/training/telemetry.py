"""`PackingTelemetry`: packing throughput, padding and MFU, logged to whatever ``report_to`` is set.

The callback never looks at the data pipeline. On train begin it registers a forward pre-hook
(``with_kwargs=True``) on the model; every training forward hands it the batch the model really sees,
rows or flat, from any collator, and it adds counts to on-device tensors (no host sync). At log time it
syncs once (and, under torch.distributed, all-reduces one small vector, so numbers are totals over ranks)
and adds ``packing/*`` keys to the ``logs`` dict:

    tokens_per_s      real (non-pad) tokens per second of training wall time (eval / save time excluded)
    padding_ratio     slots holding no real token / all slots of ``input_ids`` (rows mode pads rows; with
                      apply_rmpad those slots are removed before any compute, so pack_fill is the FLOP metric)
    pack_fill         real tokens / (packs × max_length); packs = micro-batches × per_device_train_batch_size
    images_per_step, videos_per_step, vision_patches_per_step   per optimizer step
    dropped_samples   cumulative samples not trained on (stats() skipped, all reasons, + leftover_samples), rank 0's
    tflops_per_s_per_device   text + vision model FLOPs per second, when the model's parameter counts are known
    flops_per_step    text + vision model FLOPs of one optimizer step, summed over ranks (no clock in it)
    mfu, mfu_with_vision      (with a peak) the language model's FLOPs only, as lmms-engine reports MFU; and text +
                              vision, comparable with Megatron-Bridge's

FLOPs per optimizer step (forward + backward) are ``training_flops(model, batch)["total"]`` summed over the step's
micro-batches (`hf_packing.training.flops`, also public here), from the one cost model (`hf_packing.ops.flops`, where
the formula is): the model's weights are counted once when training begins, the hook counts real tokens T and
Σ len² per document (from cu_seqlens / cu_seq_lens_q, else a row's attention_mask sum, else the row) on the device,
and the grids (image_grid_thw, video_grid_thw) are read once at log time for the vision term, exact per frame and
window. ``mfu`` = text FLOPs, ``mfu_with_vision`` = text + vision FLOPs, each / (seconds × peak × world_size); the
test holds the logged MFU equal to that quotient. A module without a transformers config logs no FLOP keys. The
peak comes from ``peak_tflops`` or the CUDA device name (H100 / H200 SXM bf16 dense 989 TFLOP/s, A100 312), otherwise
MFU is omitted.

Under sequence parallelism (``apply_rmpad(sequence_parallel_size=P)``) the ``P`` ranks of a group see the same
pack, so every count of the pack is divided by ``P`` after the sum over ranks (its tokens and its vision FLOPs are
counted once; tests/test_telemetry.py holds SP = 2 to hand-worked values) and these keys join:

    tokens_per_s_per_gpu        tokens_per_s / world_size (also without SP)
    tokens_per_s_per_sp_group   tokens_per_s / (world_size / P): the rate at which one group trains its packs
    sp_padding_tokens           tokens added to pad each pack to a multiple of P (the only padding SP adds)
    sp_all_to_all_share         time in SP collectives (all-to-all, forward and backward) / training wall time,
                                averaged over ranks (each rank's time, summed, / world_size / seconds); on CUDA
                                from events around each collective (no sync in the step), on CPU wall time

Per source (a `pack_dataset` of a ``{name: dataset}`` mix, or with ``source_column``; under `apply_rmpad`): the
forward pre-hook opens `hf_packing.patches.recording.counting_sources` around each training forward, the patched loss
sums each
source's token cross-entropy, supervised tokens and argmax hits on the device (in the chunks it computes anyway), a
forward hook adds them up, and the log's one all-reduce carries them. Keys, without the ``packing/`` prefix:

    loss/<source>             Σ token CE / Σ supervised tokens of that source over the logging window, all ranks and
                              micro-batches (the token-weighted mean over sources is the window's token-level loss,
                              which is the Trainer's ``loss`` when logging_steps=1; over several steps the Trainer
                              averages each step's loss instead)
    token_accuracy/<source>   argmax hits / supervised tokens, likewise
    supervised_tokens/<source>  the supervised tokens those two are over

The Trainer calls user callbacks after its reporting callbacks, so a plain ``callbacks=[...]`` would add
the keys after WandB / TensorBoard have logged. Use `add_telemetry`, which puts the callback first.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle
from transformers import TrainerCallback

from ..ops.flops import ModelFlops
from ..packing.source_ids import per_source_metrics
from ..patches import sequence_parallel
from ..patches.recording import counting_sources, recording_token_counts
from .flops import cost_model, training_flops

__all__ = ["ModelFlops", "PackingTelemetry", "add_telemetry", "default_peak_tflops", "training_flops"]

PREFIX = "packing/"
#: (substring of torch.cuda.get_device_name(), dense bf16 TFLOP/s); first match wins.
PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("GH200", 989.0),
    ("H200", 989.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("A100", 312.0),
    ("A800", 312.0),
)
#: accumulated as on-device int64; qsa_keys / qsa_scored: Qwen4-Exp's QSA counts (`ModelFlops.qsa_counts`)
_DEVICE_KEYS = ("real", "sq", "patches", "sp_pad", "qsa_keys", "qsa_scored")
_HOST_KEYS = (
    "real_host",
    "sq_host",
    "slots",
    "images",
    "videos",
    "forwards",
    "sp_pad_host",
    "comm_s",
    "vision_flops",
    "qsa_keys_host",
    "qsa_scored_host",
)
#: positions in the all-reduced vector of the counts every SP rank of a group makes of the same pack
_PER_PACK = [i for i, key in enumerate(_DEVICE_KEYS + _HOST_KEYS) if key != "comm_s"]


def default_peak_tflops() -> float | None:
    """Dense bf16 peak of the current CUDA device, or ``None`` when unknown (or no CUDA)."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in PEAK_TFLOPS if key in name), None)


def _total(value: Any) -> float:
    """A stats() entry as a number: ints stay, dicts of reason → count are summed."""
    if isinstance(value, dict):
        return float(sum(_total(v) for v in value.values()))
    return float(value) if isinstance(value, (int, float)) else 0.0


class PackingTelemetry(TrainerCallback):
    """Log packing efficiency and MFU; see the module docstring for the keys and the FLOP formula.

    Args:
        max_length (`int`, *optional*): the packer's token budget; enables ``pack_fill`` (`add_telemetry` reads it
            from a `pack_dataset` training set).
        peak_tflops (`float`, *optional*): per-device peak; default from the CUDA device name.
        dataset (*optional*): an object with ``stats()`` (e.g. `pack_dataset`'s); enables ``dropped_samples``.
        model_flops (`ModelFlops`, *optional*): override the parameter counts read from the model.
        all_reduce (`bool`, *optional*): sum counts over ranks when torch.distributed is initialised (default).
            With ``False`` each rank logs its own numbers and the reporters (rank 0) show rank 0's.
        sources (`list[str]`, *optional*): source names for ``loss/<source>`` and ``token_accuracy/<source>``;
            default ``dataset.source_names`` (`PackedDataset`), none when empty.
    """

    def __init__(
        self,
        *,
        max_length: int | None = None,
        peak_tflops: float | None = None,
        dataset: Any = None,
        model_flops: ModelFlops | None = None,
        all_reduce: bool = True,
        sources: list[str] | None = None,
    ) -> None:
        self.max_length, self.dataset, self.all_reduce = max_length, dataset, all_reduce
        self.sources = list(sources if sources is not None else getattr(dataset, "source_names", None) or [])
        self._post_handle: RemovableHandle | None = None
        self._handle: RemovableHandle | None = None
        self._open = ExitStack()
        self.peak_tflops = peak_tflops if peak_tflops is not None else default_peak_tflops()
        self.model_flops, self._packs_per_batch = model_flops, 1
        self._reset()
        self._excluded = 0.0
        self._start_window(0)  # evaluate() / save before train() reach on_evaluate / on_save

    # ------------------------------------------------------------------------------------------ counting
    def _reset(self) -> None:
        self._acc: torch.Tensor | None = None  # created on the first batch's device
        self._host = dict.fromkeys(_HOST_KEYS, 0.0)
        self._grids: list[torch.Tensor] = []  # (t, h, w) rows of every item, read once at log time
        self._per_source: torch.Tensor | None = None  # (3, sources) Σ CE, tokens, hits on the device
        self._per_source_missing = 0  # training forwards that gave no per-source sums (Liger, SP, no source_ids)

    def _add(self, index: int, value: torch.Tensor) -> None:
        if self._acc is None:
            self._acc = torch.zeros(len(_DEVICE_KEYS), dtype=torch.int64, device=value.device)
        self._acc[index] += value.to(self._acc.device, non_blocking=True)

    def _pre_hook(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if module.training:
            self.observe(kwargs.get("input_ids", args[0] if args else None), kwargs)
            if self.sources:
                self._open.close()  # a forward that raised before its hook ran
                self._counts = self._open.enter_context(recording_token_counts())
                self._open.enter_context(counting_sources(len(self.sources)))

    def _post_hook(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        """Adds the per-source sums the training forward's loss recorded (on the device, no sync)."""
        if not module.training or not self.sources:
            return
        self._open.close()
        counts, self._counts = getattr(self, "_counts", []), []
        sums = [ce.per_source for ce in counts]
        if not sums or any(p is None for p in sums):
            self._per_source_missing += 1
            return
        total = sum(p.detach() for p in sums).to(torch.float64 if sums[0].device.type != "mps" else torch.float32)
        self._per_source = total if self._per_source is None else self._per_source + total

    def observe(self, input_ids: torch.Tensor | None, kwargs: dict[str, Any]) -> None:
        """Count one micro-batch given the model call's kwargs (what the hook does)."""
        source = input_ids if isinstance(input_ids, torch.Tensor) else kwargs.get("inputs_embeds")
        if not isinstance(source, torch.Tensor):
            return
        shape, host = source.shape[:2], self._host
        host["forwards"] += 1
        host["slots"] += shape.numel()
        mask = kwargs.get("attention_mask")
        mask = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
        size = sequence_parallel.current_size()
        if mask is not None:
            real = mask.sum()
            self._add(0, real)
            if size > 1:
                self._add(3, (-real) % size)
        else:
            host["real_host"] += shape.numel()
            host["sp_pad_host"] += -shape.numel() % size
        cu = kwargs.get("cu_seqlens", kwargs.get("cu_seq_lens_q"))
        lengths = None
        if isinstance(cu, torch.Tensor):
            lengths = (cu[1:] - cu[:-1]).long()
        elif mask is not None:
            lengths = mask.sum(-1).long()
        else:  # no boundaries given: each row is one document (an upper bound for packed rows)
            host["sq_host"] += shape[0] * shape[-1] ** 2
        if lengths is not None:
            self._add(1, lengths.pow(2).sum())
        flops = self.model_flops
        if flops is not None and flops.qsa_layers:  # Qwen4-Exp: what its QSA layers attend and score, exactly
            if lengths is not None:
                keys, scored = flops.qsa_counts(lengths)
                self._add(4, keys.sum())
                self._add(5, scored.sum())
            else:
                keys, scored = flops.qsa_counts(int(shape[-1]))
                host["qsa_keys_host"] += shape[0] * keys
                host["qsa_scored_host"] += shape[0] * scored
        for key, count_key in (("image_grid_thw", "images"), ("video_grid_thw", "videos")):
            grid = kwargs.get(key)
            if isinstance(grid, torch.Tensor) and grid.numel():
                host[count_key] += grid.shape[0]
                self._add(2, grid.long().prod(-1).sum())
                self._grids.append(grid.detach().reshape(-1, 3))

    def _dropped(self) -> float | None:
        """Samples the dataset will not train on: ``stats()["skipped"]`` (all reasons) + ``["leftover_samples"]``
        (samples of the last, incomplete group of packs that rank equality drops)."""
        if self.dataset is None or not hasattr(self.dataset, "stats"):
            return None
        try:
            stats = self.dataset.stats(log=False)
        except TypeError:
            stats = self.dataset.stats()
        return _total(stats.get("skipped", 0)) + _total(stats.get("leftover_samples", 0))

    def counts(self, device: torch.device | str | None = None) -> dict[str, Any]:
        """The counts since the last log, synced (and summed over ranks when all-reducing)."""
        dev = self._acc.device if self._acc is not None else torch.device(device or "cpu")
        dtype = torch.float32 if dev.type == "mps" else torch.float64
        acc = self._acc.to(dtype) if self._acc is not None else torch.zeros(len(_DEVICE_KEYS), dtype=dtype, device=dev)
        dropped = self._dropped()
        reduce = self.all_reduce and torch.distributed.is_available() and torch.distributed.is_initialized()
        # pack_dataset plans on every rank alike, so its counts are already global: only rank 0's go in the sum.
        extra = [float(dropped is not None), dropped or 0.0]
        if reduce and torch.distributed.get_rank() != 0:
            extra = [0.0, 0.0]
        sp_state = sequence_parallel.current_state()
        self._host["comm_s"] += 0.0 if sp_state is None else sp_state.timer.take()
        self._host["vision_flops"] = self._vision_flops()
        extra.append(float(self._per_source_missing))
        n_sources = len(self.sources)
        per = self._per_source if self._per_source is not None else torch.zeros(3, n_sources, dtype=dtype, device=dev)
        host = torch.tensor([self._host[k] for k in _HOST_KEYS] + extra, dtype=dtype, device=dev)
        vec = torch.cat([acc, host, per.to(device=dev, dtype=dtype).flatten()])  # one all-reduce for everything
        if reduce:
            torch.distributed.all_reduce(vec)
            # SP ranks count their group's pack each (its tokens and its grids): count it once. Not comm_s, which
            # each rank measures for itself (the share averages it over ranks), nor the dataset's numbers.
            vec[_PER_PACK] /= sequence_parallel.current_size()
        values = vec.tolist()
        v = dict(zip(_DEVICE_KEYS + _HOST_KEYS + ("has_stats", "dropped", "per_source_missing"), values))
        return {
            "real_tokens": v["real"] + v["real_host"],
            "sum_sq_lens": v["sq"] + v["sq_host"],
            "qsa_keys": v["qsa_keys"] + v["qsa_keys_host"],
            "qsa_scored": v["qsa_scored"] + v["qsa_scored_host"],
            "vision_patches": v["patches"],
            "sp_padding_tokens": v["sp_pad"] + v["sp_pad_host"],
            **{k: v[k] for k in _HOST_KEYS[2:6] + ("has_stats", "dropped")},
            "comm_seconds": v["comm_s"],  # Σ over ranks
            "vision_flops": v["vision_flops"],  # exact (`hf_packing.training.flops`); 0 without the model or grids
            # Σ CE of each source, then their supervised tokens, then their hits; [] if a forward gave none
            "per_source": values[len(values) - 3 * n_sources :] if n_sources and not v["per_source_missing"] else [],
        }

    def _vision_flops(self) -> float:
        """Exact vision-tower FLOPs of the grids seen since the last log (one host read for all of them)."""
        if self.model_flops is None or not self._grids:
            return 0.0
        return self.model_flops.vision_of(torch.cat([g.to(self._grids[0].device) for g in self._grids]).tolist())

    # ------------------------------------------------------------------------------------------ lifecycle
    def attach(self, model: torch.nn.Module) -> None:
        """Start counting the training forwards of ``model`` (the outermost module the Trainer calls)."""
        self.detach()
        self._handle = model.register_forward_pre_hook(self._pre_hook, with_kwargs=True)
        if self.sources:
            self._post_handle = model.register_forward_hook(self._post_hook, with_kwargs=True, always_call=True)
        if self.model_flops is None:
            try:
                self.model_flops = cost_model(model)
            except (AttributeError, TypeError, ZeroDivisionError):  # not a transformers (Qwen-VL) model: no FLOP keys
                self.model_flops = None
        self._reset()

    def detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if self._post_handle is not None:
            self._post_handle.remove()
            self._post_handle = None
        self._open.close()

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._packs_per_batch = args.per_device_train_batch_size
        self._device = args.device
        self._world = max(1, args.world_size if self.all_reduce else 1)
        if model is not None:
            self.attach(model)
        sp_state = sequence_parallel.current_state()
        if sp_state is not None:
            sp_state.timer.enable(sp_state.size > 1)
        self._start_window(state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        self.detach()
        sp_state = sequence_parallel.current_state()
        if sp_state is not None:
            sp_state.timer.enable(False)

    def on_step_end(self, args, state, control, **kwargs):
        self._mark = time.perf_counter()

    def _exclude(self, *args: Any, **kwargs: Any) -> None:  # eval / checkpointing after a step is not training
        now = time.perf_counter()
        self._excluded, self._mark = self._excluded + now - self._mark, now

    on_evaluate = on_save = _exclude

    def on_log(self, args, state, control, logs=None, **kwargs):
        # Only the Trainer's periodic training logs: every rank reaches them together (safe all_reduce).
        if logs is None or "loss" not in logs or self._handle is None:
            return
        now = time.perf_counter()
        seconds = max(now - self._window_start - self._excluded, 1e-9)
        steps = max(state.global_step - self._last_step, 1)
        c = self.counts(getattr(self, "_device", None))
        world, size = getattr(self, "_world", 1), sequence_parallel.current_size()
        new = {
            "tokens_per_s": c["real_tokens"] / seconds,
            "tokens_per_s_per_gpu": c["real_tokens"] / seconds / world,
            "padding_ratio": 1.0 - c["real_tokens"] / c["slots"] if c["slots"] else 0.0,
        }
        if size > 1:
            new["tokens_per_s_per_sp_group"] = c["real_tokens"] / seconds / max(world // size, 1)
            new["sp_padding_tokens"] = c["sp_padding_tokens"]
            new["sp_all_to_all_share"] = c["comm_seconds"] / world / seconds
        if self.max_length and c["forwards"]:
            new["pack_fill"] = c["real_tokens"] / (c["forwards"] * self._packs_per_batch * self.max_length)
        for key in ("images", "videos", "vision_patches"):
            new[f"{key}_per_step"] = c[key] / steps
        if c["has_stats"]:
            new["dropped_samples"] = c["dropped"]
        if self.model_flops is not None:  # the counts of `training_flops`, summed over the window's micro-batches
            text = self.model_flops.text_counts(
                tokens=c["real_tokens"],
                sum_sq_lens=c["sum_sq_lens"],
                qsa_keys=c["qsa_keys"],
                qsa_scored=c["qsa_scored"],
            )
            vision = c["vision_flops"]
            per_device = 1.0 / seconds / self._world / 1e12
            new["tflops_per_s_per_device"] = (text + vision) * per_device
            new["flops_per_step"] = (text + vision) / steps  # the count itself, all ranks: equal under every engine
            if self.peak_tflops:
                new["mfu"] = text * per_device / self.peak_tflops  # LLM only, as lmms-engine reports it
                new["mfu_with_vision"] = new["tflops_per_s_per_device"] / self.peak_tflops
        new = {PREFIX + k: v for k, v in new.items()}
        if c["per_source"]:
            keys = {"loss_key": "loss/{}", "accuracy_key": "token_accuracy/{}", "count_key": "supervised_tokens/{}"}
            new.update(per_source_metrics(self.sources, c["per_source"], **keys))
        logs.update(new)
        # Trainer.log appends a copy of `logs` to log_history before calling on_log; keep it in step.
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(new)
        self._reset()
        self._start_window(state.global_step, now)

    def _start_window(self, step: int, now: float | None = None) -> None:
        self._window_start = self._mark = time.perf_counter() if now is None else now
        self._excluded, self._last_step = 0.0, step


def add_telemetry(trainer: Any, **kwargs: Any) -> PackingTelemetry:
    """Create a `PackingTelemetry` and put it first in ``trainer.callback_handler.callbacks``.

    First, so that its keys are in ``logs`` before the reporting callbacks (WandB, TensorBoard, ...) run.
    ``dataset`` defaults to ``trainer.train_dataset`` when that has ``stats()``, and ``max_length`` to its packing
    config's (a `pack_dataset` set), so ``pack_fill`` is logged without it. Returns the callback.
    """
    if "dataset" not in kwargs and hasattr(trainer.train_dataset, "stats"):
        kwargs["dataset"] = trainer.train_dataset
    packed_length = getattr(getattr(trainer.train_dataset, "cfg", None), "max_length", None)
    if kwargs.get("max_length") is None and isinstance(packed_length, int):
        kwargs["max_length"] = packed_length
    callback = PackingTelemetry(**kwargs)
    trainer.callback_handler.callbacks.insert(0, callback)
    return callback
