"""TEST-ONLY: lets `accelerate launch` engage FSDP and DeepSpeed on CPU processes (gloo), as it does on GPUs.

accelerate 1.15 turns FSDP on only for GPU-like distributed types and DeepSpeed only off ``cpu``; on a CPU-only host a
launch with ``use_cpu: false`` finds no device type (``DistributedType.NO``, one process) and ``use_cpu: true`` gives
``MULTI_CPU``, where both engines are silently skipped. Put this directory first on ``PYTHONPATH`` and Python imports
this file at start-up in every launched process: accelerate's backend choice then reports ``MULTI_GPU`` over
``gloo``, and ``ACCELERATE_TORCH_DEVICE=cpu`` keeps the tensors on CPU. Nothing else changes: the engines are the real
ones (torch ``fully_shard``, DeepSpeed's ZeRO with ``DS_ACCELERATOR=cpu``). Never on a real run's path.
"""

from __future__ import annotations

import os


def _patch() -> None:
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    prepare_backend = PartialState._prepare_backend

    def cpu_as_gpu(self, cpu=False, sagemaker_dp=False, backend=None):
        if not cpu and int(os.environ.get("LOCAL_RANK", -1)) != -1:
            return "gloo", DistributedType.MULTI_GPU
        return prepare_backend(self, cpu, sagemaker_dp, backend)

    PartialState._prepare_backend = cpu_as_gpu


if os.environ.get("HF_PACKING_TEST_CPU_AS_GPU") == "1":
    os.environ.setdefault("ACCELERATE_TORCH_DEVICE", "cpu")
    os.environ.setdefault("ACCELERATE_BYPASS_DEVICE_MAP", "true")  # DDP without CUDA device_ids
    _patch()
