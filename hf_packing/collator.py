"""`VisionCollator`: a drop-in ``data_collator`` turning packs of processed samples into model batches.

``mode="rows"`` (default) pads one sample per row, for the rmpad patch (or any unpatched model)::

    pack [a(3), b(5)], [c(1)]  ──►  input_ids      a a a 0 0     attention_mask 1 1 1 0 0     cu_seqlens [0,3,8,9]
                                                   b b b b b                    1 1 1 1 1     max_seqlen 5
                                                   c 0 0 0 0                    1 0 0 0 0

``mode="flat"`` concatenates everything into one row with no padding and no attention_mask, for
transformers' own packed path (flash_attention_2, or sdpa, which builds a block mask from the text row)::

    input_ids      a a a b b b b b c                cu_seq_lens_q/k [0,3,8,9], max_length_q/k 5
    position_ids   0 1 2 0 1 2 3 4 0   (text row)   + 3 M-RoPE rows, each computed per sample
    labels         - a a - b b b b -   (-: -100; a sample's first token is never a target)

The flat batch carries ``use_cache=False``: with the default cache, transformers 5.17-5.23 skips
packed-sequence detection and sdpa silently lets samples attend to each other.

In both modes every sample's first label is -100: a first token has no previous token in its sample,
so it can never be a target, and masking it keeps the Trainer's ``num_items_in_batch`` count exact.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .ops.loss import IGNORE_INDEX
from .ops.varlen import token_types, vision_item_tokens
from .packing.source_ids import SOURCE_ID
from .preprocess.checks import check_processor
from .preprocess.preprocessor import VISION_KEYS

logger = logging.getLogger(__name__)


def _as_long(x: Any) -> torch.Tensor:
    t = x if isinstance(x, torch.Tensor) else torch.as_tensor(x)
    return t.reshape(-1).long()


class RopeIndex:
    """The model's own ``get_rope_index``, callable without a model instance (only its config).

    Binds the class's methods to this light object, so DataLoader workers can compute M-RoPE positions
    per sample exactly as the model would, without pickling weights.
    """

    def __init__(self, config) -> None:
        from .patches import FAMILIES, supported_model_types

        if getattr(config, "model_type", None) not in FAMILIES:
            raise ValueError(
                f"VisionCollator(model_config=...) got a {getattr(config, 'model_type', type(config).__name__)!r} "
                f"config; it computes M-RoPE positions for {supported_model_types()}: pass the Qwen-VL model's "
                "config (model.config)"
            )
        spec = FAMILIES[config.model_type]
        self.config = config
        self._cls = getattr(spec.load(), spec.backbone_class)
        self._extra = spec.rope_kwargs

    def __getattr__(self, name: str):
        return getattr(self._cls, name).__get__(self)

    def __call__(self, sample: Mapping[str, Any], input_ids: torch.Tensor, mm_types: torch.Tensor) -> torch.Tensor:
        """``(3, n)`` positions of one sample."""
        image_grid, video_grid = sample.get("image_grid_thw"), sample.get("video_grid_thw")
        if image_grid is None and video_grid is None:
            return torch.arange(input_ids.numel()).expand(3, -1)
        extra = {k: sample[k] for k in self._extra if sample.get(k) is not None}
        positions, _ = self.get_rope_index(
            input_ids[None],
            mm_token_type_ids=mm_types[None],
            image_grid_thw=image_grid,
            video_grid_thw=video_grid,
            attention_mask=None,
            **extra,
        )
        return positions[:, 0]


class VisionCollator:
    """Collate packs (lists of processed samples) or single samples into a batch.

    Args:
        processor: the model's processor (gives ``pad_token_id``, padding side, image/video token ids, patch size).
        mode (`str`): ``"rows"`` (one sample per padded row) or ``"flat"`` (one unpadded row).
        model_config (`PretrainedConfig`, *optional*): the model's config. Enables M-RoPE position ids computed
            here, per sample, with the model's own rope-index rule (required for ``"flat"``; in ``"rows"`` it
            moves that Python loop off the training step into DataLoader workers).
        pad_to_multiple_of (`int`, *optional*): pad rows (``"rows"``) to a multiple of this length.
        return_cu_seqlens (`bool`, defaults to `False`): add ``cu_seqlens`` / ``max_seqlen`` in ``"rows"`` mode, for
            callers that read the boundaries themselves. The patched forward does not need them (one sample per row:
            the attention mask gives the same boundaries), and an unpatched model would hand a ``cu_seqlens``
            key to its vision tower, which reads it as its own.

    Both modes add ``num_supervised_tokens`` (int), the host count of supervised targets: with it the patched loss
    selects them without a host sync (an unpatched model ignores the key), and ``seqlens`` (list of int, one per
    sample in row / ``cu_seqlens`` order): the patched forward takes its boundaries from it without reading the
    mask or ``cu_seqlens`` back from the device. With images or videos both add ``vision_grids`` (list of
    ``[t, h, w]``, images then videos): the host copy of the grids, for the vision tower's boundaries; with
    ``model_config`` also ``vision_inputs`` (a dict of tensors and ints: what transformers' vision helpers would
    compute from the grids on the device, computed here with the same helpers; see
    `hf_packing.patches._vision.precomputed_vision_inputs`; transformers 5.23). When the
    samples carry ``source_id`` (`pack_dataset` of a ``{name: dataset}`` mix, or with ``source_column``), both
    modes add ``source_ids``, int64 ``(n_seqs,)``: each sequence's source, in ``cu_seqlens`` order, for the
    per-source loss (`hf_packing.packing.source_ids`).

    Returns (``__call__``), ``"rows"``: ``input_ids``/``labels``/``attention_mask``/``mm_token_type_ids`` ``(B, L)``,
    the concatenated vision tensors, optional ``position_ids (3, B, L)``, ``cu_seqlens`` int32 ``(B+1,)`` and
    ``max_seqlen`` int, ``num_supervised_tokens`` int, ``seqlens`` list. ``"flat"``: ``(1, T)`` tensors,
    ``position_ids (4, 1, T)``, ``cu_seq_lens_q/k``, ``max_length_q/k``, ``num_supervised_tokens``, ``seqlens``.
    """

    def __init__(
        self,
        processor=None,
        *,
        mode: str = "rows",
        model_config=None,
        pad_to_multiple_of: int | None = None,
        return_cu_seqlens: bool = False,
        pad_token_id: int | None = None,
        padding_side: str | None = None,
    ) -> None:
        if mode not in ("rows", "flat"):
            raise ValueError(f"mode must be 'rows' or 'flat', got {mode!r}")
        if mode == "flat" and model_config is None:
            raise ValueError("mode='flat' needs model_config=model.config to compute per-sample M-RoPE position ids")
        check_processor(processor, model_config)
        tokenizer = getattr(processor, "tokenizer", processor)
        self.processor = processor  # for prepare_trainer's check against the model (`check_processor`)
        self.mode = mode
        self.pad_token_id = pad_token_id if pad_token_id is not None else getattr(tokenizer, "pad_token_id", None) or 0
        self.padding_side = padding_side or getattr(tokenizer, "padding_side", "right")
        self.pad_to_multiple_of = pad_to_multiple_of
        self.return_cu_seqlens = return_cu_seqlens
        self.rope_index = RopeIndex(model_config) if model_config is not None else None
        self.vision_config = None if self.rope_index is None else getattr(model_config, "vision_config", None)
        self.frames_as_images = False
        if model_config is not None:
            from .patches import frames_as_images  # the family table: with a model config only

            self.frames_as_images = frames_as_images(model_config)
        self.image_token_id = getattr(processor, "image_token_id", None) or getattr(
            model_config, "image_token_id", None
        )
        self.video_token_id = getattr(processor, "video_token_id", None) or getattr(
            model_config, "video_token_id", None
        )
        image_processor = getattr(processor, "image_processor", None)
        merge: Any = getattr(image_processor, "merge_size", None)
        self.merge = int(merge or getattr(getattr(model_config, "vision_config", None), "spatial_merge_size", 2))
        self.patch_dim = None
        if image_processor is not None and hasattr(image_processor, "patch_size"):
            self.patch_dim = 3 * image_processor.temporal_patch_size * image_processor.patch_size**2

    # ------------------------------------------------------------------------------------------ input checks
    def _flatten(self, features: Sequence[Any]) -> list[Mapping[str, Any]]:
        if features is None or len(features) == 0:
            raise ValueError("VisionCollator got an empty batch; check the dataset yields packs or samples")
        samples: list[Mapping[str, Any]] = []
        for item in features:
            samples.extend(item if isinstance(item, (list, tuple)) else [item])
        if not samples:
            raise ValueError("VisionCollator got only empty packs")
        return samples

    def _check(self, index: int, sample: Mapping[str, Any], ids: torch.Tensor, types: torch.Tensor) -> None:
        """The sample's image / video placeholders (by token type: GLM-V writes video frames with the image token)
        against its grids, and its patches against this processor's patch size."""
        for code, kind, token, grid_key, pix_key in (
            (1, "image", self.image_token_id, "image_grid_thw", "pixel_values"),
            (2, "video", self.video_token_id, "video_grid_thw", "pixel_values_videos"),
        ):
            grid = sample.get(grid_key)
            placeholder = (ids == self.image_token_id) | (ids == self.video_token_id)  # of the type's kind below
            count = int(((types == code) & placeholder).sum()) if token is not None else 0
            expected = (
                0 if grid is None else sum(vision_item_tokens(torch.as_tensor(grid).reshape(-1, 3), merge=self.merge))
            )
            if token is not None and count != expected:
                raise ValueError(
                    f"sample {index}: {count} {kind} placeholder tokens but {grid_key} implies {expected}; "
                    "the sample was processed with a different processor or its text was truncated"
                )
            pixels = sample.get(pix_key)
            if (
                pixels is not None
                and self.patch_dim is not None
                and torch.as_tensor(pixels).shape[-1] != self.patch_dim
            ):
                raise ValueError(
                    f"sample {index}: {pix_key} has patch dim {torch.as_tensor(pixels).shape[-1]} but this processor "
                    f"makes {self.patch_dim}; samples from different processors cannot share a batch"
                )

    # ------------------------------------------------------------------------------------------ collation
    def __call__(self, features: Sequence[Any]) -> dict[str, Any]:
        samples = self._flatten(features)
        ids, labels, types, positions = [], [], [], []
        for index, sample in enumerate(samples):
            if "input_ids" not in sample:
                raise ValueError(f"sample {index} has no 'input_ids'; keys are {sorted(sample)}")
            sample_ids = _as_long(sample["input_ids"])
            if sample_ids.numel() == 0:
                raise ValueError(f"sample {index} has no tokens")
            sample_labels = (
                _as_long(sample["labels"]).clone() if sample.get("labels") is not None else sample_ids.clone()
            )
            if sample_labels.numel() != sample_ids.numel():
                raise ValueError(
                    f"sample {index}: labels has {sample_labels.numel()} tokens, input_ids {sample_ids.numel()}"
                )
            sample_labels[0] = IGNORE_INDEX
            if sample.get("mm_token_type_ids") is not None:
                sample_types = _as_long(sample["mm_token_type_ids"])
            else:
                sample_types = token_types(
                    sample_ids, image_token_id=self.image_token_id, video_token_id=self.video_token_id
                )
            self._check(index, sample, sample_ids, sample_types)
            sample_labels[sample_types != 0] = IGNORE_INDEX
            ids.append(sample_ids)
            labels.append(sample_labels)
            types.append(sample_types)
            if self.rope_index is not None:
                positions.append(self.rope_index(sample, sample_ids, sample_types))
        batch = (
            self._rows(ids, labels, types, positions)
            if self.mode == "rows"
            else self._flat(ids, labels, types, positions)
        )
        batch.update(self._vision(samples))
        if self.vision_config is not None and batch.get("vision_grids"):
            from .patches import precomputed_vision_inputs  # transformers' helpers: only with a model config

            n_images = len(batch["image_grid_thw"]) if "image_grid_thw" in batch else 0
            precomputed = precomputed_vision_inputs(
                self.vision_config,
                batch["vision_grids"],
                n_images=n_images,
                token_types=torch.cat(types),
                frames_as_images=self.frames_as_images,
            )
            if precomputed:
                batch["vision_inputs"] = precomputed
        batch.update(_source_ids(samples))
        return batch

    def _rows(self, ids, labels, types, positions) -> dict[str, Any]:
        lengths = [t.numel() for t in ids]
        width = max(lengths)
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        batch_size = len(ids)
        out: dict[str, Any] = {
            "input_ids": torch.full((batch_size, width), self.pad_token_id, dtype=torch.long),
            "labels": torch.full((batch_size, width), IGNORE_INDEX, dtype=torch.long),
            "attention_mask": torch.zeros((batch_size, width), dtype=torch.long),
            "mm_token_type_ids": torch.zeros((batch_size, width), dtype=torch.long),
        }
        if positions:
            out["position_ids"] = torch.zeros((3, batch_size, width), dtype=torch.long)
        for row, n in enumerate(lengths):
            cols = slice(0, n) if self.padding_side == "right" else slice(width - n, width)
            out["input_ids"][row, cols] = ids[row]
            out["labels"][row, cols] = labels[row]
            out["attention_mask"][row, cols] = 1
            out["mm_token_type_ids"][row, cols] = types[row]
            if positions:
                out["position_ids"][:, row, cols] = positions[row]
        if self.return_cu_seqlens:
            out["cu_seqlens"] = _cu_seqlens(lengths)
            out["max_seqlen"] = max(lengths)
        out["num_supervised_tokens"] = _num_supervised(labels)
        out["seqlens"] = lengths
        return out

    def _flat(self, ids, labels, types, positions) -> dict[str, Any]:
        lengths = [t.numel() for t in ids]
        text_positions = torch.cat([torch.arange(n) for n in lengths])
        cu = _cu_seqlens(lengths)
        return {
            "input_ids": torch.cat(ids)[None],
            "labels": torch.cat(labels)[None],
            "mm_token_type_ids": torch.cat(types)[None],
            "position_ids": torch.cat([text_positions[None], torch.cat(positions, dim=1)], dim=0)[:, None, :],
            "cu_seq_lens_q": cu,
            "cu_seq_lens_k": cu,
            "max_length_q": max(lengths),
            "max_length_k": max(lengths),
            "num_supervised_tokens": _num_supervised(labels),
            "seqlens": lengths,
            # With a cache, transformers skips packed-sequence detection and sdpa attends across samples.
            "use_cache": False,
        }

    @staticmethod
    def _vision(samples: list[Mapping[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key in VISION_KEYS:
            parts = [torch.as_tensor(s[key]) for s in samples if s.get(key) is not None]
            if parts:
                out[key] = torch.cat([p.reshape(-1) if key == "second_per_grid_ts" else p for p in parts])
        grids = [out[k] for k in ("image_grid_thw", "video_grid_thw") if k in out]
        if grids:  # the tower's order: images, then videos
            out["vision_grids"] = torch.cat(grids).tolist()
        return out


def _num_supervised(labels: list[torch.Tensor]) -> int:
    """Supervised next-token targets: every label but -100 (each sample's first label is -100, so shifting the
    labels inside each sample drops none of them). The patched loss selects them without a host sync."""
    return int(sum(int((t != IGNORE_INDEX).sum()) for t in labels))


def _source_ids(samples: list[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
    """``{"source_ids": (n_seqs,) int64}`` when the samples carry ``source_id``; all of them or none must."""
    tagged = [s.get(SOURCE_ID) is not None for s in samples]
    if not any(tagged):
        return {}
    if not all(tagged):
        raise ValueError(
            f"{tagged.count(False)} of {len(samples)} samples carry no {SOURCE_ID!r} while the others do; samples "
            "from pack_dataset of a {name: dataset} mix (or with source_column) cannot share a batch with untagged ones"
        )
    return {"source_ids": torch.tensor([int(s[SOURCE_ID]) for s in samples], dtype=torch.long)}


def _cu_seqlens(lengths: list[int]) -> torch.Tensor:
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    return cu


def batch_problem(batch: Any) -> str | None:
    """What in ``batch`` contradicts the host facts `VisionCollator` put in it, or None for a consistent batch.

    The patched forward trusts a `VisionCollator` batch's host values (``seqlens`` for the boundaries,
    ``num_supervised_tokens`` for the loss, ``vision_grids`` for the vision tower) without reading the device, so a
    function that wraps the collator must hand them on consistent with the tensors. Checked here, on the host, in the
    DataLoader worker (O(tokens) integer work on CPU tensors): the keys are there; ``labels``, ``attention_mask``,
    ``mm_token_type_ids`` and ``position_ids`` have the shape of ``input_ids``; ``seqlens`` equals the mask's row
    lengths (``"rows"``: one sample per row) or covers the one flat row and equals ``cu_seq_lens_q`` (``"flat"``);
    ``cu_seqlens`` matches ``seqlens``; ``num_supervised_tokens`` counts the labels other than -100; ``vision_grids``
    lists ``image_grid_thw`` then ``video_grid_thw``; ``source_ids`` has one entry per sequence. Extra keys are fine.

    Args:
        batch (`Mapping[str, Any]`): what the data collator returned (CPU tensors).

    Returns:
        `str | None`: the first inconsistency found, worded for an error message.
    """
    if not isinstance(batch, Mapping):
        return f"it is a {type(batch).__name__}, not a dict of tensors"
    missing = [k for k in ("input_ids", "labels", "seqlens", "num_supervised_tokens") if k not in batch]
    if missing:
        return f"it has no {missing} (VisionCollator's batches always carry them)"
    ids, labels, seqlens = batch["input_ids"], batch["labels"], batch["seqlens"]
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return f"input_ids is not a (B, L) tensor but {type(ids).__name__} {tuple(getattr(ids, 'shape', ()))}"
    for key in ("labels", "attention_mask", "mm_token_type_ids"):
        value = batch.get(key)
        if value is not None and tuple(value.shape) != tuple(ids.shape):
            return f"{key} has shape {tuple(value.shape)}, input_ids {tuple(ids.shape)}"
    positions = batch.get("position_ids")
    if positions is not None and tuple(positions.shape[-2:]) != tuple(ids.shape):
        return f"position_ids has shape {tuple(positions.shape)}, input_ids {tuple(ids.shape)}"
    lengths = [int(n) for n in seqlens]
    if "cu_seq_lens_q" in batch:  # mode="flat": one row, no padding
        if ids.shape[0] != 1 or sum(lengths) != ids.shape[1]:
            return f"seqlens sums to {sum(lengths)} tokens, but input_ids is {tuple(ids.shape)} (one flat row)"
        for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
            if batch.get(key) is not None and batch[key].tolist() != _cu_seqlens(lengths).tolist():
                return f"{key} {batch[key].tolist()} does not match seqlens {lengths}"
    else:  # mode="rows": one sample per padded row
        mask = batch.get("attention_mask")
        if mask is None:
            return "it has seqlens but neither an attention_mask (mode='rows') nor cu_seq_lens_q (mode='flat')"
        if mask.sum(-1).tolist() != lengths:
            return f"seqlens {lengths} differs from the attention_mask's row lengths {mask.sum(-1).tolist()}"
        if batch.get("cu_seqlens") is not None and batch["cu_seqlens"].tolist() != _cu_seqlens(lengths).tolist():
            return f"cu_seqlens {batch['cu_seqlens'].tolist()} does not match seqlens {lengths}"
    supervised = int((labels != IGNORE_INDEX).sum())
    if int(batch["num_supervised_tokens"]) != supervised:
        return f"num_supervised_tokens is {int(batch['num_supervised_tokens'])}, but {supervised} labels are not -100"
    grids = [batch[k] for k in ("image_grid_thw", "video_grid_thw") if batch.get(k) is not None]
    expected = torch.cat([torch.as_tensor(g) for g in grids]).tolist() if grids else None
    if batch.get("vision_grids") != expected:
        return f"vision_grids {batch.get('vision_grids')} differs from image_grid_thw then video_grid_thw {expected}"
    sources = batch.get("source_ids")
    if sources is not None and len(sources) != len(lengths):
        return f"source_ids has {len(sources)} entries for {len(lengths)} sequences"
    return None
