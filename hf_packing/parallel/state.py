"""The sequence-parallel state of one `apply_rmpad` call: the SP size, its ``(dp, sp)`` mesh and its comm timer.

`apply_rmpad(sequence_parallel_size=P)` creates one `SequenceParallelState` and binds it into the patch options
(`RmpadOptions.sequence_parallel`), so the patched forwards, `pack_dataset` and the telemetry all read the same
object, and `revert_rmpad` drops it with the patches: no module keeps SP state of its own. The mesh is built on the
first SP step (every rank reaches it together), not at apply time (the process group may not exist yet).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .comm import CommTimer, SPGroup


def data_parallel_rank_world(size: int) -> tuple[int, int]:
    """``(dp rank, dp world)`` of this process under SP size ``size``: the global rank and world divided by it.

    SP ranks of one group get the same answer, so `pack_dataset` gives them the same packs. ``(0, 1)`` without
    torch.distributed.

    Raises:
        ValueError: when the world size is not a multiple of ``size``.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % size:
        raise ValueError(f"world size {world} is not a multiple of sequence_parallel_size={size}")
    return rank // size, world // size


@dataclass(eq=False)
class SequenceParallelState:
    """What sequence parallelism needs beyond one step: the size ``P``, the mesh (built once) and the comm timer.

    Two states are equal when their sizes are (the mesh and the timer are runtime objects), so applying the same
    options twice keeps the patches, and `apply_rmpad` carries the built mesh over when only other options change.

    Attributes:
        size (`int`): ``P``, ranks per SP group (1: SP off).
        timer (`CommTimer`): time of the SP collectives, read by the telemetry (`PackingTelemetry`).
    """

    size: int = 1
    timer: CommTimer = field(default_factory=CommTimer, repr=False)
    device_mesh: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"sequence_parallel_size must be an int >= 1, got {self.size!r}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SequenceParallelState) and other.size == self.size

    def __hash__(self) -> int:
        return hash(self.size)

    def mesh(self, *, device_type: str | None = None) -> Any:
        """Build (once) the ``(dp, sp)`` `DeviceMesh` over the initialised default process group and return it.

        Every rank must call it (it creates sub-groups); the patched forward calls it on its first SP step. Ranks
        ``[d·P, (d+1)·P)`` form SP group ``d``. ``mesh["dp"]`` is the data-parallel dimension (`pack_dataset`'s
        rank and world), ``mesh["sp"]`` the sequence-parallel one.

        Raises:
            ValueError: without a process group, or when the world size is not a multiple of ``size``.
        """
        from torch.distributed.device_mesh import init_device_mesh

        if self.device_mesh is not None:
            return self.device_mesh
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                f"sequence_parallel_size={self.size} needs torch.distributed: launch with torchrun / accelerate "
                "launch (recipes/accelerate/sp.yaml), or set sequence_parallel_size=1"
            )
        world = dist.get_world_size()
        if world % self.size:
            raise ValueError(f"world size {world} is not a multiple of sequence_parallel_size={self.size}")
        if device_type is None:
            accelerator = torch.accelerator.current_accelerator()
            device_type = "cpu" if dist.get_backend() == "gloo" or accelerator is None else accelerator.type
        self.device_mesh = init_device_mesh(device_type, (world // self.size, self.size), mesh_dim_names=("dp", "sp"))
        return self.device_mesh

    def group(self) -> SPGroup | None:
        """This rank's `SPGroup` (building the mesh on first use), or ``None`` when ``size == 1``."""
        if self.size == 1:
            return None
        mesh = self.mesh()["sp"]
        return SPGroup(mesh.get_group(), mesh.get_local_rank(), self.size, timer=self.timer)
