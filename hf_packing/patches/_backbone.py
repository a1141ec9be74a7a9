"""The padding-free backbone ``XModel.forward`` (``model.model``), for callers that run their own head on it.

TRL's fused LM head (SFT, DPO, GRPO, KTO log-probs), reward / value heads and embedding models call the
backbone, never ``ForConditionalGeneration.forward``. The patched backbone flattens their batch once, like the
top-level forward, and gives ``last_hidden_state`` back in the unpatched shape::

    caller's (B, L) batch ──parse_call, flatten_call──► ids (1, T), M-RoPE (3, 1, T), cu_seqlens   [_call, _forward]
        └─► original XModel.forward(..., hf_packing_seqs=seqs)  decoder layers see T real tokens
              └─► last_hidden_state (1, T, H) ──repad──► (B, L, H), zeros at pads; hidden_states likewise

One flattening per step: the patched top-level forward calls the backbone with the `PackedSequences` already in
``hf_packing_seqs``, and a call that carries them goes straight to the original function. Generation-style calls
(a cache, ``use_cache`` resolving to True, ``inputs_embeds`` instead of ``input_ids``) run the original code too.
Every other output field is the original's own (same class); MoE ``router_logits`` are re-padded to the unpatched
``(B · L, E)`` rows with zeros at pads, so a load-balancing loss given the caller's ``attention_mask`` (TRL's aux
loss) is the unpatched one.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from ._attention import PACKED_KWARG
from ._call import ForwardSignature, parse_call
from ._forward import (
    OriginalForward,
    RmpadOptions,
    as_patched_forward,
    backbone_kwargs,
    flatten_call,
    is_generation_call,
    packed_attention_mask,
    repad_hidden_states,
    repad_router_logits,
    resolve_use_cache,
    run_backbone,
    warn_supervised_generation_call,
    without_packing,
)
from ._spec import FamilySpec
from .prepared import check_active_loader


def make_backbone_forward(original: Callable, spec: FamilySpec, options: RmpadOptions) -> Callable:
    """Build the patched ``XModel.forward`` for one family, with ``options`` bound (apply again to change them)."""
    signature = ForwardSignature(inspect.signature(original))

    def forward(self, *args, **kwargs):
        if kwargs.get(PACKED_KWARG) is not None:  # flattened already (the patched top-level forward)
            return original(self, *args, **kwargs, return_dict=True)
        # head=False: loss keywords given to the backbone are passed on (in `ForwardCall.rest`), as without the patch
        call = parse_call(signature, args, kwargs, rope_kwargs=spec.rope_kwargs, head=False)
        if is_generation_call(call, resolve_use_cache(self, call.use_cache)):
            if self.training and torch.is_grad_enabled() and not OriginalForward.depth:  # a custom head's training call
                warn_supervised_generation_call(self, call)
            return original(self, *args, **without_packing(kwargs), return_dict=True)
        check_active_loader(collated=call.collated)  # forgetting prepare_trainer is loud
        if options.sequence_parallel_size > 1:
            raise ValueError(
                f"sequence_parallel_size={options.sequence_parallel_size}: the backbone ({type(self).__name__}) "
                "called on its own cannot gather the sequence slices back for your head; call the top-level "
                "model (XForConditionalGeneration) or apply_rmpad(sequence_parallel_size=1)"
            )
        flat = flatten_call(self, spec, call)

        def unflattened(**inputs):
            return original(self, **inputs)

        outputs, dummy = run_backbone(
            self,
            flat,
            call,
            backbone_kwargs(call),
            options.dummy_vision,
            forward=unflattened,
            attention_mask=packed_attention_mask(spec),
        )
        hidden = outputs.last_hidden_state[0]
        if dummy is not None:  # dummy_vision on a text-only batch: keep the tower in the graph, adding 0
            hidden = hidden + dummy.to(hidden.dtype)
        outputs["last_hidden_state"] = flat.repad(hidden)
        if outputs.get("hidden_states") is not None:
            outputs["hidden_states"] = repad_hidden_states(outputs.hidden_states, flat)
        if outputs.get("router_logits"):  # MoE
            outputs["router_logits"] = repad_router_logits(outputs.router_logits, flat)
        return outputs

    return as_patched_forward(forward, original)
