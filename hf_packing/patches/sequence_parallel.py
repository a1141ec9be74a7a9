"""Ulysses sequence parallelism (SP) for Qwen-VL packs: one pack split along the sequence over ``P`` ranks.

Everything that needs the whole pack runs before the split, on every rank of the SP group, in transformers' own
code: the token embedding, the vision tower and the scatter of its features into the placeholders, and the M-RoPE
positions (per sample, from the family's ``get_rope_index``). A forward pre-hook on the text model then keeps this
rank's slice of the flat stream, padded to a multiple of ``P`` with one unsupervised tail sequence of its own::

    pack (T = 10, P = 4)       a a a a | b b b b b b            cu_seqlens [0, 4, 10]
    padded (T' = 12)           a a a a | b b b b b b | _ _      cu_seqlens [0, 4, 10, 12]   (_: own segment)
    rank 0 / 1 / 2 / 3         a a a   | a b b     | b b b    | b _ _
    M-RoPE positions           sliced with the tokens (computed on the whole pack first, never per shard)
    targets                    shifted per sequence on the whole pack, then sliced; the tail is -100

Each decoder layer's attention swaps sequence sharding for head sharding around the same varlen kernel::

    q/k/v (T'/P, H, D) ──all-to-all──► (T', H/P, D) ──varlen kernel, global cu_seqlens──► (T', H/P, D)
                                                                      ──all-to-all──► (T'/P, H, D)

q, k and v travel in one all-to-all. With fewer KV heads than ``P`` (GQA) each KV head is replicated
``P / gcd(H_kv, P)`` times first, so every rank holds the KV heads of its query heads. Per layer and rank the two
all-to-alls move ``(T'/P)·(H + 2·H_kv')·D + (T'/P)·H·D`` elements, ``(P-1)/P`` of them over the network; activations
per rank (everything but the tower and the embedding) fall to ``1/P`` (`benchmarks/sp_memory.py`).

Gradients. The collectives are autograd functions (the backward of an all-to-all is the inverse all-to-all; of the
tower's all-gather, a reduce-scatter), and slicing sends each rank's gradient only into the tokens it holds, so the
sum over the SP group of each parameter's gradient is the gradient of the whole pack: the tower and the embedding
are never counted twice. Data-parallel training sums (DDP, FSDP: averages, times the Trainer's ``num_processes``
factor) over every rank, so an SP group acts like one data-parallel rank holding the pack. The loss scaling that
makes this equal to SP = 1 is in `sp_loss`.

Vision tower. Its one call per forward (`hf_packing.patches._vision.tower_calls`) encodes only this rank's share of
the pack's temporal units (an image, or one frame group of a video: the towers attend within each), balanced by
patches, and the merged features (and DeepStack features) are all-gathered, so the tower's cost is divided too.
On the test packs (180 patches in 2 packs) the largest rank encodes 100 patches at P = 2 and 60 at P = 4 (ideal 90
and 45: units are indivisible); a rank without a unit encodes a 4-patch dummy image (FSDP needs the call). The
all-gather moves ``n_vision_tokens · H · (1 + deepstack layers)`` elements per step, its backward an all-reduce of
the same size (gloo has no reduce-scatter).

Qwen3.5's linear-attention layers (Gated DeltaNet) swap shardings the same way, around their whole core (the
causal conv and the gated delta rule, `hf_packing.parallel.linear`). The MoE load-balancing loss is
formed from router statistics summed over the SP group (`load_balancing_loss`), so its value and gradient are the
SP = 1 ones. Not covered: attention head counts not divisible by ``P`` (refused). ``logits`` / ``hidden_states``
outputs are gathered without gradient; the loss is computed on the shards.

Process groups come from a ``(dp, sp)`` `DeviceMesh` (`SequenceParallelState.mesh`); SP ranks are consecutive global
ranks (within a node first). accelerate 1.15's ``ParallelismConfig(sp_size=...)`` cannot carry this: its only
``sp_backend`` is ``"deepspeed"`` (DeepSpeed's own Ulysses, text-only), for which it skips building a mesh and the
Trainer hands the model to DeepSpeed's SP wrapper. So the SP size is `apply_rmpad`'s ``sequence_parallel_size``
and FSDP2 / DDP from accelerate shard or replicate over the whole world as usual.

Layout: this module holds the design notes and reads the applied state; the work lives in `hf_packing.parallel`:
`comm` (the group, all-to-alls and other collectives), `shard` (slicing the pack, the vision split, the SP loss),
`state` (the `SequenceParallelState` that `apply_rmpad` binds into its options) and `linear` (Gated DeltaNet on head
shards).
"""

from __future__ import annotations

from typing import Any

from ..parallel.comm import SPGroup
from ..parallel.state import SequenceParallelState
from . import sequence_parallel_state

__all__ = ["current_size", "current_state", "init_sequence_parallel", "sp_group"]


def current_state() -> SequenceParallelState | None:
    """The `SequenceParallelState` of the applied patches (`apply_rmpad`), ``None`` when none are applied."""
    return sequence_parallel_state()


def current_size() -> int:
    """The SP size set by `apply_rmpad(sequence_parallel_size=...)` (1 when SP is off or nothing is applied)."""
    state = current_state()
    return 1 if state is None else state.size


def _applied(size: int) -> SequenceParallelState:
    state = current_state()
    if state is None or state.size != size:
        raise ValueError(
            f"sequence parallelism of size {size} is not applied (now: {current_size()}); call "
            f"apply_rmpad(sequence_parallel_size={size}) first"
        )
    return state


def init_sequence_parallel(size: int, *, device_type: str | None = None) -> Any:
    """The applied state's ``(dp, sp)`` `DeviceMesh`, built on first use (`SequenceParallelState.mesh`); every
    rank must call it. Raises a `ValueError` unless `apply_rmpad(sequence_parallel_size=size)` is in effect."""
    return _applied(size).mesh(device_type=device_type)


def sp_group(size: int) -> SPGroup | None:
    """This rank's `SPGroup` under the applied SP size ``size`` (``None`` for 1; `SequenceParallelState.group`)."""
    return None if size == 1 else _applied(size).group()
