"""Token-level evaluation for a Trainer on packed batches: ``eval_loss = Σ token CE / Σ supervised tokens``.

The Trainer's own ``eval_loss`` is the mean of per-batch means, so a token in a small pack weighs more than one in
a big pack, and the number moves with ``max_length``, the eval batch size and the number of processes, while the
token-level mean does not (measured: docs/evaluation.md).
Training is token-level (``num_items_in_batch``); `token_level_evaluation` makes evaluation token-level too, by
wrapping two methods of the Trainer instance:

- ``compute_loss`` during evaluation: the model gets no ``num_items_in_batch``, so its loss is the batch's own mean;
  the batch adds ``(loss × n, n, n_correct)`` to on-device sums. ``n`` and ``n_correct`` (argmax == target, counted
  chunk by chunk inside the loss) are what the patched forward recorded
  (`~hf_packing.patches.recording.recording_token_counts`),
  else ``n = (labels[..., 1:] != -100).sum()`` (transformers' shift) and ``n_correct`` is read from ``logits``. They
  are recorded, not read from the output's ``num_supervised_tokens`` / ``num_correct_tokens`` attributes, because
  under ``bf16=True`` (accelerate's mixed precision) the output comes back rebuilt by ``convert_outputs_to_fp32``,
  fields only: the accuracy would vanish there.
- ``evaluation_loop`` (under both ``evaluate()`` and ``predict()``): sums the three numbers over processes once at the
  end (one all-reduce), sets ``{prefix}_loss`` to Σ CE / Σ n and adds ``{prefix}_token_accuracy`` = Σ n_correct / Σ n.

Per source. When the eval set is a `pack_dataset` of a ``{name: dataset}`` mix (or packed with ``source_column``), the
patched loss also sums the three numbers per source (`hf_packing.packing.source_ids`), in the same chunks, on the
device; they join the same all-reduce and give ``{prefix}_<name>_loss`` and ``{prefix}_<name>_token_accuracy`` per
source (token-level over the whole eval set and all processes). They are left out when a batch did not give them: an
unpatched model, Liger's fused loss, sequence parallelism.

Mixture-of-experts models (Qwen3-VL-MoE) add ``router_aux_loss_coef · aux_loss`` to the loss when
``output_router_logits`` is on; ``eval_loss`` is the cross-entropy alone (the aux term is subtracted), so it compares
with dense models and with a perplexity.

With a ``compute_loss_func`` or ``label_smoothing_factor`` the loss is the user's and cannot be split into tokens:
the Trainer's own ``eval_loss`` is left as it is. A map-style eval set (e.g. a list of packs) under several processes
is sharded by accelerate, which repeats its first samples to even out the last batch; those are counted again. A
`pack_dataset` eval set (``leftovers="spread"``) is evaluated exactly once.

Memory. Under `hf_packing.apply_rmpad`, when only the loss is needed (``evaluate()`` without ``compute_metrics``,
or ``prediction_loss_only=True``) the forward gets ``skip_logits=True``: no ``(tokens × vocab)`` logits exist at any
time beyond one loss chunk, and ``eval_token_accuracy`` comes for free (not under Liger's fused kernel, which never
exposes logits: then it is left out, with a warning). With ``compute_metrics`` the forward returns
``(B, L, vocab)`` logits like the unpatched model, and the Trainer pads them across processes, gathers them and
keeps every step's until ``eval_accumulation_steps`` moves them to the CPU: ``L × vocab × 4`` bytes per row in fp32
(an 8,192-token row of a 151,936-token vocabulary: 5.0 GB; in bf16 2.5 GB), times the rows of the whole eval set.
``preprocess_logits_for_metrics`` shrinks what is kept (``logits.argmax(-1)``: ``L × 8`` bytes per row), though each
step's logits still exist once.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import torch

from ..ops.loss import IGNORE_INDEX, CrossEntropySum
from ..packing.source_ids import per_source_metrics
from ..patches import is_patched, unwrap_model
from ..patches.recording import counting_sources, recording_token_counts
from .unwrap import packed_dataset

logger = logging.getLogger(__name__)


def _aux_term(model: Any, outputs: Any) -> torch.Tensor | float:
    """``router_aux_loss_coef · aux_loss`` when the loss includes it (MoE with ``output_router_logits``), else 0."""
    aux = getattr(outputs, "aux_loss", None)
    if aux is None:
        return 0.0
    config = unwrap_model(model).config
    coef = getattr(config.get_text_config(), "router_aux_loss_coef", None)
    coef = coef if coef is not None else getattr(config, "router_aux_loss_coef", 0.0)
    return coef * aux.detach()


def _targets(inputs: dict[str, Any]) -> torch.Tensor:
    """Each position's target, aligned with the logits: ``shift_labels`` if given, else labels shifted left."""
    if inputs.get("shift_labels") is not None:
        return inputs["shift_labels"]
    labels = inputs["labels"]
    return torch.nn.functional.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)


def batch_sums(
    model: Any,
    inputs: dict[str, Any],
    loss: torch.Tensor,
    outputs: Any,
    counts: list[CrossEntropySum] | None = None,
    num_sources: int = 0,
) -> torch.Tensor:
    """``[Σ CE, n supervised, n correct, 1 if n correct is unknown, 1 if the per-source sums are unknown]`` and the
    ``(3, num_sources)`` per-source sums flattened (`CrossEntropySum.per_source`), of one eval batch, on ``loss``'s
    device: ``5 + 3 · num_sources`` numbers.

    ``loss`` is the batch's mean cross-entropy (no ``num_items_in_batch``), ``outputs`` the model's output,
    ``counts`` what the patched forward recorded for this batch
    (`~hf_packing.patches.recording.recording_token_counts`): with
    them, n and n correct are the patched loss's own; without, n is counted from the labels and n correct read from
    ``logits`` (if there are any).
    """
    device, dtype = loss.device, _sum_dtype(loss.device)
    targets: torch.Tensor | None = None
    correct: Any = None  # a count: int, or a tensor on any device
    n: Any
    if counts:
        n = sum(ce.num_supervised for ce in counts)
        hits = [ce.num_correct for ce in counts]
        if all(h is not None for h in hits):
            correct = sum(h.to(device) for h in hits if h is not None)
    else:
        targets = _targets(inputs)
        n = (targets != IGNORE_INDEX).sum()
    n = torch.as_tensor(n, dtype=dtype, device=device)
    ce_mean = (loss.detach() - _aux_term(model, outputs)).to(dtype)
    logits = getattr(outputs, "logits", None)
    if correct is None and isinstance(logits, torch.Tensor):
        targets = _targets(inputs) if targets is None else targets
        targets = targets.to(logits.device)
        correct = ((logits.argmax(-1) == targets) & (targets != IGNORE_INDEX)).sum()
    known = correct is not None
    correct = torch.as_tensor(correct if known else 0, dtype=dtype, device=device)
    ce_sum = torch.where(n > 0, ce_mean * n, torch.zeros_like(n))  # a batch without targets: mean is NaN
    per = [ce.per_source for ce in counts or ()]
    per_known = bool(per) and all(p is not None for p in per)
    per_source: Any = torch.zeros(3, num_sources, device=device)
    if per_known:
        per_source = sum(p.to(device, dtype) for p in per if p is not None)
    head = torch.stack([ce_sum, n, correct, torch.ones_like(n) * (not known), torch.ones_like(n) * (not per_known)])
    return torch.cat([head, per_source.to(dtype).flatten()])


class _Sums:
    """What the wrapped methods share during one ``evaluation_loop``."""

    def __init__(self) -> None:
        self.active, self.loss_only, self.warned = False, False, False
        self.total: torch.Tensor | None = None
        self.sources: list[str] = []  # the eval set's source names (`PackedDataset.source_names`)

    def start(self, loss_only: bool, sources: list[str]) -> None:
        self.active, self.loss_only, self.total, self.sources = True, loss_only, None, sources

    def add(self, sums: torch.Tensor) -> None:
        self.total = sums if self.total is None else self.total + sums


def token_level_evaluation(trainer: Any) -> Any:
    """Make ``evaluate()`` / ``predict()`` report token-level ``{prefix}_loss`` and ``{prefix}_token_accuracy``, and
    skip the logits under the patch when only the loss is needed (see the module docstring). Returns ``trainer``."""
    state = _Sums()
    original_loss, original_loop = trainer.compute_loss, trainer.evaluation_loop

    def own_loss() -> bool:
        return trainer.compute_loss_func is None and trainer.label_smoother is None

    def compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None):
        if not (state.active and own_loss()):
            return original_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        if state.loss_only and is_patched(model):
            inputs = {**inputs, "skip_logits": True}
        with recording_token_counts() as counts, counting_sources(len(state.sources)):
            loss, outputs = original_loss(model, inputs, return_outputs=True)  # the batch's own mean
        state.add(batch_sums(model, inputs, loss, outputs, counts, len(state.sources)))
        return (loss, outputs) if return_outputs else loss

    def evaluation_loop(dataloader, description, prediction_loss_only=None, ignore_keys=None, metric_key_prefix="eval"):
        loss_only = prediction_loss_only if prediction_loss_only is not None else trainer.args.prediction_loss_only
        packs = packed_dataset(dataloader)
        state.start(bool(loss_only), list(packs.source_names) if packs is not None else [])
        if packs is not None:
            trainer.gather_function = partial(_gather_rows, trainer.accelerator)
            if packs.cfg.leftovers == "drop" and trainer.accelerator.num_processes > 1 and not state.warned:
                state.warned = True
                logger.warning(
                    "the eval set was packed with leftovers='drop': its last packs (fewer than world_size) "
                    "are not evaluated; pass leftovers='spread' to pack_dataset for eval sets"
                )
        try:
            output = original_loop(
                dataloader,
                description,
                prediction_loss_only=prediction_loss_only,
                ignore_keys=ignore_keys,
                metric_key_prefix=metric_key_prefix,
            )
        finally:
            state.active = False
        if own_loss():
            _report(trainer, state.total, output.metrics, metric_key_prefix, state.sources)
        return output

    trainer.compute_loss, trainer.evaluation_loop = compute_loss, evaluation_loop
    return trainer


def _gather_rows(accelerator: Any, tensors: Any) -> Any:
    """The Trainer's per-step gather for packed eval sets. A rank's rows are its packs' samples, so ranks differ in
    rows: pad dim 0 with -100 (rows without labels) before gathering, as the Trainer pads dim 1. Each rank's packs are
    its own, none repeated, so everything is kept; ``gather_for_metrics`` would cut the last step to
    ``len(packs) % batch_size`` rows once the stream's length is known (from its second pass on)."""
    return accelerator.gather(accelerator.pad_across_processes(tensors, dim=0, pad_index=IGNORE_INDEX))


def _sum_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64


def _report(
    trainer: Any, total: torch.Tensor | None, metrics: dict[str, float], prefix: str, sources: list[str]
) -> None:
    """All-reduce the sums (every rank calls this) and write the token-level metrics into ``metrics``."""
    device = total.device if total is not None else torch.device(trainer.args.device)
    total = total if total is not None else torch.zeros(5 + 3 * len(sources), dtype=_sum_dtype(device), device=device)
    if trainer.accelerator.num_processes > 1:
        total = trainer.accelerator.reduce(total, reduction="sum")
    ce, n, correct, unknown, per_unknown, *per = total.tolist()
    if sources and per_unknown == 0:
        keys = {"loss_key": f"{prefix}_{{}}_loss", "accuracy_key": f"{prefix}_{{}}_token_accuracy"}
        metrics.update(per_source_metrics(sources, per, **keys))
    if n > 0:
        metrics[f"{prefix}_loss"] = ce / n
        if unknown == 0:
            metrics[f"{prefix}_token_accuracy"] = correct / n
        elif not getattr(trainer, "_hf_packing_warned_accuracy", False):
            trainer._hf_packing_warned_accuracy = True
            logger.warning(
                "%s_token_accuracy is left out: %d eval batch(es) gave neither the patched loss's token counts nor "
                "logits (Liger's fused loss never exposes logits; apply_rmpad(use_liger=False), or a "
                "compute_metrics, which makes the forward return logits, brings it back)",
                prefix,
                int(unknown),
            )
