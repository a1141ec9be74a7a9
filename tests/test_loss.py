"""Per-sequence label shift and the chunked linear cross-entropy against plain PyTorch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hf_packing.loss import linear_cross_entropy_sum, reduce_loss, shift_labels_per_sequence


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
    total, n = linear_cross_entropy_sum(hidden, head, targets, chunk_size=5)
    total.backward()
    got = (hidden.grad.clone(), head.weight.grad.clone())
    hidden.grad, head.weight.grad = None, None
    ref = F.cross_entropy(head(hidden), targets, reduction="sum", ignore_index=-100)
    ref.backward()
    assert n == int((targets != -100).sum())
    torch.testing.assert_close(total, ref)
    torch.testing.assert_close(got[0], hidden.grad)
    torch.testing.assert_close(got[1], head.weight.grad)


def test_no_supervised_tokens_keeps_graph():
    head = torch.nn.Linear(4, 7)
    hidden = torch.randn(3, 4, requires_grad=True)
    total, n = linear_cross_entropy_sum(hidden, head, torch.full((3,), -100))
    total.backward()
    assert n == 0 and total.item() == 0 and hidden.grad is not None


def test_reduction():
    assert reduce_loss(torch.tensor(12.0), 4, None).item() == 3.0
    assert reduce_loss(torch.tensor(12.0), 4, torch.tensor(6)).item() == 2.0
