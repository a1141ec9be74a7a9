"""Per-sequence label shift and the chunked linear cross-entropy against plain PyTorch."""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from hf_packing.ops.loss import (
    liger_can_read_weight,
    linear_cross_entropy_sum,
    reduce_loss,
    shift_labels_per_sequence,
)


def test_shift_never_crosses_a_boundary():
    labels = torch.tensor([-100, 11, 12, -100, -100, 22, 23, 31])
    cu = torch.tensor([0, 3, 7, 8], dtype=torch.int32)
    assert shift_labels_per_sequence(labels, cu).tolist() == [11, 12, -100, -100, 22, 23, -100, -100]


def test_chunked_equals_full_cross_entropy_values_and_grads():
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(37, 16, requires_grad=True)
    targets = torch.randint(0, 50, (37,))
    targets[::3] = -100
    result = linear_cross_entropy_sum(hidden, head, targets, chunk_size=5, count_correct=True)
    total, n = result.loss_sum, result.num_supervised
    total.backward()
    got = (hidden.grad.clone(), head.weight.grad.clone())
    hidden.grad, head.weight.grad = None, None
    ref = F.cross_entropy(head(hidden), targets, reduction="sum", ignore_index=-100)
    ref.backward()
    assert n == int((targets != -100).sum())
    keep = targets != -100
    assert result.num_correct.item() == int((head(hidden).argmax(-1) == targets)[keep].sum())  # counted once per chunk
    torch.testing.assert_close(total, ref)
    torch.testing.assert_close(got[0], hidden.grad)
    torch.testing.assert_close(got[1], head.weight.grad)


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops (by name) run inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func._schema.name] += 1
        return func(*args, **(kwargs or {}))


def test_argmax_only_when_something_reads_the_hits():
    """Argmax hits are computed only when asked (``count_correct``, which the patched forward sets inside
    `hf_packing.patches.recording.recording_token_counts`): a training loss alone runs no argmax (counted), and the
    hits, when read, are exact."""
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(37, 16, requires_grad=True)
    targets = torch.randint(0, 50, (37,))
    targets[::3] = -100
    exact = int((head(hidden).argmax(-1) == targets)[targets != -100].sum())
    with _OpCounter() as counter:
        training = linear_cross_entropy_sum(hidden, head, targets, chunk_size=5)
        training.loss_sum.backward()
    assert counter.ops["aten::argmax"] == 0 and training.num_correct is None
    with _OpCounter() as counter:
        recorded = linear_cross_entropy_sum(hidden, head, targets, chunk_size=5, count_correct=True)
        recorded.loss_sum.backward()
    assert counter.ops["aten::argmax"] == 5  # once per chunk of 5 of the 24 supervised rows, not again in backward
    assert recorded.num_correct.item() == exact
    assert linear_cross_entropy_sum(hidden, head, targets, count_correct=True).num_correct.item() == exact
    assert torch.equal(training.loss_sum, recorded.loss_sum)


def test_host_count_selects_the_same_rows_without_a_sync():
    """With the collator's count the rows come from a fixed-size nonzero: same sum and grads, no syncing op; a
    wrong count is caught on the device (negative control)."""
    from hf_packing.testing.syncs import SyncCounter

    torch.manual_seed(0)
    head = torch.nn.Linear(8, 20, bias=False)
    hidden = torch.randn(11, 8, requires_grad=True)
    targets = torch.tensor([3, -100, 4, 5, -100, -100, 7, 1, -100, 2, 9])
    ref = linear_cross_entropy_sum(hidden, head, targets, chunk_size=3)
    ref_grad = torch.autograd.grad(ref.loss_sum, hidden)[0]
    with SyncCounter() as counter:
        got = linear_cross_entropy_sum(hidden, head, targets, chunk_size=3, num_supervised=7)
        grad = torch.autograd.grad(got.loss_sum, hidden)[0]
    assert counter.total == 0 and got.num_supervised == ref.num_supervised == 7
    assert torch.equal(got.loss_sum, ref.loss_sum) and torch.equal(grad, ref_grad)
    with pytest.raises(RuntimeError, match="num_supervised_tokens does not match"):
        linear_cross_entropy_sum(hidden, head, targets, num_supervised=6)


def test_no_supervised_tokens_keeps_every_parameter_in_the_graph():
    """DDP with find_unused_parameters=False needs a gradient (zero) for the head too, not only for the backbone."""
    head = torch.nn.Linear(4, 7)
    hidden = torch.randn(3, 4, requires_grad=True)
    result = linear_cross_entropy_sum(hidden, head, torch.full((3,), -100))
    result.loss_sum.backward()
    assert result.num_supervised == 0 and result.loss_sum.item() == 0 and hidden.grad is not None
    assert head.weight.grad is not None and head.bias.grad is not None and not head.weight.grad.any()


def test_reduction():
    assert reduce_loss(torch.tensor(12.0), 4, None).item() == 3.0
    assert reduce_loss(torch.tensor(12.0), 4, torch.tensor(6)).item() == 2.0
    # a whole step without supervised tokens: 0, not 0/0 = NaN
    assert reduce_loss(torch.tensor(0.0), 0, torch.tensor(0)).item() == 0.0
    assert reduce_loss(torch.tensor(0.0), 0, 0).item() == 0.0


def test_liger_never_reads_a_partitioned_weight(monkeypatch):
    """Under DeepSpeed ZeRO-3 lm_head.weight is a 0-element shard with a ds_id outside the head's forward."""
    from hf_packing import _compat

    monkeypatch.setattr(_compat, "liger_fused_linear_cross_entropy", lambda: lambda *a, **k: pytest.fail("read"))
    plain = torch.nn.Linear(8, 20, bias=False)
    zero3 = torch.nn.Linear(8, 20, bias=False)
    zero3.weight = torch.nn.Parameter(torch.empty(0))
    zero3.weight.ds_id = 7
    assert liger_can_read_weight(plain) and not liger_can_read_weight(zero3)
    with pytest.raises(ValueError, match="partitioned"):
        linear_cross_entropy_sum(torch.randn(3, 8), zero3, torch.tensor([1, 2, 3]), use_liger=True)


def test_liger_wiring_with_stand_in(monkeypatch):
    """With liger-kernel installed the fused kernel gets (hidden, weight, targets) of supervised rows, sum reduction."""
    from hf_packing import _compat

    calls = []

    def liger(hidden, weight, target, bias=None, ignore_index=-100, reduction="mean"):
        calls.append((hidden.shape, reduction, ignore_index, bool((target != -100).all())))
        return F.cross_entropy(hidden @ weight.T, target, reduction=reduction, ignore_index=ignore_index)

    monkeypatch.setattr(_compat, "liger_fused_linear_cross_entropy", lambda: liger)
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 20, bias=False)
    hidden = torch.randn(9, 8)
    targets = torch.tensor([3, -100, 5, 7, -100, 1, 2, -100, 4])
    fused = linear_cross_entropy_sum(hidden, head, targets, use_liger=True)
    ref = linear_cross_entropy_sum(hidden, head, targets, use_liger=False)
    assert calls == [(torch.Size([6, 8]), "sum", -100, True)] and fused.num_supervised == 6
    torch.testing.assert_close(fused.loss_sum, ref.loss_sum)
