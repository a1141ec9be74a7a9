"""hf_packing: padding-free, packed training of Qwen-VL models with the Hugging Face Trainer.

Importing the package does nothing: no transformers import, no device probe, no environment read.

Files:
    _compat.py   the only place that probes versions and optional packages (flash-attn, liger, fla, video)
    config.py    PackingConfig: every pack_dataset setting once (default, type, help), HfArgumentParser-ready
    collator.py  VisionCollator: rows (padded, cu_seqlens, M-RoPE positions) or flat (transformers' path)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "apply_rmpad",
    "revert_rmpad",
    "supported_model_types",
    "plan_packs",
    "pack_dataset",
    "PackingConfig",
    "VisionCollator",
    "prepare_trainer",
    "end_distributed",
    "end_process",
    "PackedDataset",
    "WorkCost",
    "NoSamplesError",
    "TooManySkipsError",
    "PackingTelemetry",
]

# Lazy re-exports keep `import hf_packing` free of transformers/torch work until a name is used.
_LAZY = {
    "apply_rmpad": "hf_packing.patches",
    "revert_rmpad": "hf_packing.patches",
    "supported_model_types": "hf_packing.patches",
    "plan_packs": "hf_packing.packing.planner",
    "pack_dataset": "hf_packing.packing.dataset",
    "PackingConfig": "hf_packing.config",
    "VisionCollator": "hf_packing.collator",
    "prepare_trainer": "hf_packing.training.trainer",
    "end_distributed": "hf_packing.training.distributed",
    "end_process": "hf_packing.training.distributed",
    "PackedDataset": "hf_packing.packing.dataset",
    "WorkCost": "hf_packing.packing.balance",
    "NoSamplesError": "hf_packing.packing.stats",
    "TooManySkipsError": "hf_packing.packing.stats",
    "PackingTelemetry": "hf_packing.training.telemetry",
}

if TYPE_CHECKING:
    from .collator import VisionCollator
    from .config import PackingConfig
    from .packing.balance import WorkCost
    from .packing.dataset import PackedDataset, pack_dataset
    from .packing.planner import plan_packs
    from .packing.stats import NoSamplesError, TooManySkipsError
    from .patches import apply_rmpad, revert_rmpad, supported_model_types
    from .training.distributed import end_distributed, end_process
    from .training.telemetry import PackingTelemetry
    from .training.trainer import prepare_trainer


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hf_packing' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
