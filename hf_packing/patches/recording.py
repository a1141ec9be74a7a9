"""The channel from the patched forward to what reads its token counts (evaluation, the per-source telemetry).

The patched forward computes ``Σ CE`` and the supervised count in `hf_packing.ops.loss`; whether it also counts argmax
hits and sums per source, and where the counts go, is decided here, by context managers the Trainer side opens:

- `recording_token_counts`: collect each forward's `CrossEntropySum` (and ask for argmax hits, `counting_correct`);
- `counting_sources`: sum the loss per source over ``num_sources`` sources (`counted_sources`).

It sits in the patches because the forward that writes to it is here and its readers (`hf_packing.training`) sit
above; the tensor layer below stays tensors only.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from ..ops.loss import CrossEntropySum

__all__ = ["attach_token_counts", "counted_sources", "counting_correct", "counting_sources", "recording_token_counts"]


#: The token counts of every patched forward inside `recording_token_counts` (None outside: nothing is kept).
_RECORDED: ContextVar[list[CrossEntropySum] | None] = ContextVar("hf_packing_token_counts", default=None)


@contextmanager
def recording_token_counts() -> Iterator[list[CrossEntropySum]]:
    """Collect the `CrossEntropySum` of each patched forward run inside the block (this thread / context only).

    Evaluation reads the counts here, not from the output object: wrappers rebuild the output and drop attributes
    that are not fields (accelerate's ``convert_outputs_to_fp32`` under ``bf16=True`` / ``mixed_precision: bf16``).
    """
    recorded: list[CrossEntropySum] = []
    token = _RECORDED.set(recorded)
    try:
        yield recorded
    finally:
        _RECORDED.reset(token)


#: The number of sources patched forwards sum their loss over (`counting_sources`); 0: none.
_NUM_SOURCES: ContextVar[int] = ContextVar("hf_packing_num_sources", default=0)


@contextmanager
def counting_sources(num_sources: int) -> Iterator[None]:
    """Inside the block, a patched forward given ``source_ids`` also sums its loss per source into
    `CrossEntropySum.per_source` (``(3, num_sources)``). Outside it no per-source work is done."""
    token = _NUM_SOURCES.set(int(num_sources))
    try:
        yield
    finally:
        _NUM_SOURCES.reset(token)


def counted_sources() -> int:
    """The ``num_sources`` of the innermost active `counting_sources` (0 outside any)."""
    return _NUM_SOURCES.get()


def counting_correct() -> bool:
    """Whether something reads argmax hits now: an active `recording_token_counts` (evaluation, per-source telemetry);
    the patched forward passes it as the loss's ``count_correct``. Training outside it computes no argmax."""
    return _RECORDED.get() is not None


def attach_token_counts(output: Any, ce: CrossEntropySum | None) -> None:
    """Give ``output`` the attributes ``num_supervised_tokens`` / ``num_correct_tokens`` (plain attributes, not
    fields: ``to_tuple()`` stays the unpatched one) and record ``ce`` for an active `recording_token_counts`."""
    if ce is None:
        return
    output.num_supervised_tokens, output.num_correct_tokens = ce.num_supervised, ce.num_correct
    recorded = _RECORDED.get()
    if recorded is not None:
        recorded.append(ce)
