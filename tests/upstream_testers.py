"""Stand-ins for transformers' ``tests/causal_lm_tester.py`` and ``tests/vlm_tester.py``, for `tests/test_upstream.py`.

transformers' newer per-model test files (Qwen4-Exp's among them) build their testers on these two modules, which the
5.23.0 sdist does not ship and whose stored copies predate those test files. What a model's test class asks of them is
small: the tester's default sizes, a config built from the tester's attributes (by the config classes' signatures), a
random padded batch (right padding, ``tril`` of ones, as upstream's testers make it; token ids above the special ones)
with the model tester's image tokens and extra inputs, and a test class that is ``ModelTesterMixin``. Like the GLM-V
harness, no generation or pipeline mixin is mixed in. Where a transformers source checkout has the real modules,
`tests/test_upstream.py` uses those instead.
"""

from __future__ import annotations

from inspect import signature
from types import ModuleType
from typing import Any

import torch


def _kwargs(tester: Any, config_class: type, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """The tester's attributes named like ``config_class``'s ``__init__`` parameters (plus ``extra``)."""
    names = [*signature(config_class.__init__).parameters, *extra]
    return {name: getattr(tester, name) for name in names if name != "self" and hasattr(tester, name)}


def _set_defaults(tester: Any, parent: Any, defaults: dict[str, Any], overrides: dict[str, Any]) -> None:
    tester.parent = parent
    for name, value in {**defaults, **overrides}.items():
        setattr(tester, name, value)
    tester.head_dim = tester.hidden_size // tester.num_attention_heads
    tester.tie_word_embeddings = False


#: upstream's tester defaults (the stored copies' values)
_DEFAULTS = {
    "seq_length": 7,
    "is_training": True,
    "use_input_mask": True,
    "vocab_size": 99,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "intermediate_size": 37,
    "hidden_act": "gelu",
    "max_position_embeddings": 512,
    "initializer_range": 0.02,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "moe_intermediate_size": 12,
    "shared_expert_intermediate_size": 36,
    "num_experts_per_tok": 2,
    "num_experts": 8,
}


def testers(common: ModuleType, configuration_common: ModuleType) -> dict[str, ModuleType]:
    """The two stand-in modules (``causal_lm_tester``, ``vlm_tester``), built on upstream's ``test_modeling_common``
    (``ModelTesterMixin``, ``ids_tensor``, ``floats_tensor``) and ``test_configuration_common`` (``ConfigTester``)."""

    class CausalLMModelTester:
        config_class: type | None = None
        base_model_class: type | None = None
        causal_lm_class: type | None = None

        def __init__(self, parent: Any, **overrides: Any) -> None:
            if self.config_class is None:
                self.config_class = self.base_model_class.config_class  # type: ignore[union-attr]
            _set_defaults(self, parent, {**_DEFAULTS, "batch_size": 13}, overrides)

        @property
        def all_model_classes(self) -> list[type]:
            return [c for c in (self.base_model_class, self.causal_lm_class) if c is not None]

        def get_config(self):
            return self.config_class(**_kwargs(self, self.config_class, ("pad_token_id",)))  # type: ignore[misc]

        def prepare_config_and_inputs_for_common(self):
            input_ids = common.ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
            return self.get_config(), {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids).tril()}

    class CausalLMModelTest(common.ModelTesterMixin):
        model_tester_class: type | None = None
        all_model_classes = None
        all_generative_model_classes = ()  # no GenerationTesterMixin here

        def setUp(self) -> None:
            self.model_tester = self.model_tester_class(self)
            self.config_tester = configuration_common.ConfigTester(self, config_class=self.model_tester.config_class)
            if self.all_model_classes is None:
                self.all_model_classes = self.model_tester.all_model_classes

        def test_config(self) -> None:
            self.config_tester.run_common_tests()

    class VLMModelTester:
        base_model_class: type | None = None
        config_class: type | None = None
        text_config_class: type | None = None
        vision_config_class: type | None = None
        conditional_generation_class: type | None = None

        def __init__(self, parent: Any, **overrides: Any) -> None:
            vlm = {"batch_size": 3, "image_token_id": 3, "num_channels": 3, "image_size": 8, "patch_size": 4}
            _set_defaults(self, parent, {**_DEFAULTS, **vlm, "num_image_tokens": 1}, overrides)

        @property
        def all_model_classes(self) -> list[type]:
            return [c for c in (self.base_model_class, self.conditional_generation_class) if c is not None]

        @property
        def _special_token_ids(self) -> set[int]:
            return {self.pad_token_id, self.bos_token_id, self.eos_token_id, self.image_token_id}

        def create_pixel_values(self) -> torch.Tensor:
            return common.floats_tensor([self.batch_size, self.num_channels, self.image_size, self.image_size])

        def place_image_tokens(self, input_ids: torch.Tensor, config) -> torch.Tensor:
            input_ids = input_ids.clone()
            input_ids[:, : self.num_image_tokens] = self.image_token_id
            return input_ids

        def get_additional_inputs(self, config, input_ids: torch.Tensor, modality_inputs: dict) -> dict:
            return {}

        def get_text_config(self):
            extra = ("pad_token_id", "bos_token_id", "eos_token_id")
            return self.text_config_class(**_kwargs(self, self.text_config_class, extra))  # type: ignore[misc]

        def get_vision_config(self):
            kwargs = _kwargs(self, self.vision_config_class)  # type: ignore[arg-type]
            kwargs.pop("rope_parameters", None)  # the tester's are the text model's (M-RoPE)
            for name in ("hidden_size", "intermediate_size", "hidden_act"):
                if hasattr(self, f"vision_{name}"):
                    kwargs[name] = getattr(self, f"vision_{name}")
            return self.vision_config_class(**kwargs)  # type: ignore[misc]

        def get_config(self):
            kwargs = _kwargs(self, self.config_class, ("pad_token_id",))  # type: ignore[arg-type]
            kwargs.update(text_config=self.get_text_config(), vision_config=self.get_vision_config())
            return self.config_class(**kwargs)  # type: ignore[misc]

        def prepare_config_and_inputs_for_common(self):
            config, low = self.get_config(), max(self._special_token_ids) + 1
            input_ids = common.ids_tensor([self.batch_size, self.seq_length], self.vocab_size - low) + low
            input_ids = self.place_image_tokens(input_ids, config)
            inputs = {
                "input_ids": input_ids,
                "attention_mask": torch.ones_like(input_ids).tril(),
                "pixel_values": self.create_pixel_values(),
            }
            inputs.update(self.get_additional_inputs(config, input_ids, inputs))
            return config, inputs

    class VLMModelTest(common.ModelTesterMixin):
        model_tester_class: type | None = None
        all_model_classes = None
        all_generative_model_classes = ()  # no GenerationTesterMixin here
        _is_composite = True

        def setUp(self) -> None:
            self.model_tester = self.model_tester_class(self)
            self.config_tester = configuration_common.ConfigTester(
                self, config_class=self.model_tester.config_class, has_text_modality=False
            )
            if self.all_model_classes is None:
                self.all_model_classes = self.model_tester.all_model_classes

        def test_config(self) -> None:
            self.config_tester.run_common_tests()

    causal, vlm = ModuleType("causal_lm_tester"), ModuleType("vlm_tester")
    causal.__dict__.update(CausalLMModelTester=CausalLMModelTester, CausalLMModelTest=CausalLMModelTest)
    vlm.__dict__.update(VLMModelTester=VLMModelTester, VLMModelTest=VLMModelTest)
    return {"causal_lm_tester": causal, "vlm_tester": vlm}
