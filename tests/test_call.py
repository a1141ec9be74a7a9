"""`parse_call`: a patched forward's call sorted once into a read-only `ForwardCall`, on tiny literal calls."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from hf_packing.patches._call import ForwardSignature, parse_call


def _forward(self, input_ids=None, attention_mask=None, labels=None, logits_to_keep=0, **kwargs): ...


def _strict(self, input_ids=None, labels=None): ...


SIGNATURE = ForwardSignature(inspect.signature(_forward))


def test_fields_rope_and_rest_of_a_top_level_call():
    ids, cu, cu_q = torch.ones(1, 3), torch.tensor([0, 3]), torch.tensor([0, 1, 3])
    call = parse_call(
        SIGNATURE,
        (ids,),
        {
            "labels": ids,
            "num_items_in_batch": 7,
            "second_per_grid_ts": [1.0],
            "cu_seq_lens_q": cu_q,
            "max_length_q": 2,
            "seq_idx": ids,
            "max_seqlen": 3,
            "seqlens": [3],
            "output_attentions": True,
        },
        rope_kwargs=("second_per_grid_ts", "absent"),
    )
    assert call.input_ids is ids and call.labels is ids and call.attention_mask is None
    assert call.num_items_in_batch == 7 and call.logits_to_keep == 0 and call.supervised and call.collated
    assert dict(call.rope) == {"second_per_grid_ts": [1.0], "absent": None}
    assert call.cu_seqlens is cu_q  # transformers' boundaries when the packing keyword is not given
    assert dict(call.rest) == {"output_attentions": True}  # what the flat path's own boundaries replace is dropped
    assert parse_call(SIGNATURE, (), {"cu_seqlens": cu, "cu_seq_lens_q": cu_q}).cu_seqlens is cu


def test_the_backbone_passes_the_loss_keywords_on():
    ids = torch.ones(1, 3)
    call = parse_call(SIGNATURE, (), {"input_ids": ids, "labels": ids, "num_items_in_batch": 7}, head=False)
    assert call.labels is None and call.num_items_in_batch is None and not call.supervised
    assert dict(call.rest) == {"labels": ids, "num_items_in_batch": 7}


def test_the_record_is_read_only():
    call = parse_call(SIGNATURE, (), {"input_ids": torch.ones(1, 3), "output_attentions": True})
    with pytest.raises(dataclasses.FrozenInstanceError):
        call.input_ids = None
    with pytest.raises(TypeError):
        call.rest["output_attentions"] = False
    with pytest.raises(TypeError):
        call.rope["second_per_grid_ts"] = None


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        ((1, 2, 3, 4, 5), {}, "takes 4 positional arguments but 5 were given"),
        ((1,), {"input_ids": 1}, "multiple values for argument 'input_ids'"),
        ((), {"pixel_values": 1}, "unexpected keyword argument 'pixel_values'"),
    ],
)
def test_calls_the_signature_does_not_take_raise_as_python_does(args, kwargs, message):
    strict = ForwardSignature(inspect.signature(_strict))
    signature = strict if "pixel_values" in kwargs else SIGNATURE
    with pytest.raises(TypeError, match=message):
        parse_call(signature, args, kwargs)
