"""Tiny, random-weight, fully-local Qwen-VL models and processors for tests.

Every family of the patches' table (``hf_packing.patches.FAMILIES``; tests/test_tiny.py holds the two lists to
it) has a tiny model, named by ``config.model_type``: the Qwen families ``MODEL_TYPES`` (``"qwen3_5"``,
``"qwen3_5_moe"`` and ``"qwen4_exp"`` hybrid: linear-attention layers and full-attention layers) and the GLM-V
families ``GLM_TYPES``. Nothing is downloaded: the tokenizer is a byte-level BPE trained in-process on a small built-in
text, the image/video processors are the families' real classes with small pixel budgets, and the models are the
real ``*ForConditionalGeneration`` classes with tiny random weights.

The token ids mirror Qwen's layout: ``BASE_VOCAB`` ordinary BPE tokens, then the Qwen special tokens in Qwen's order,
so ``<|image_pad|>`` sits 12 ids after ``<|endoftext|>`` exactly as in the real vocabularies.

The GLM-V families (``GLM_TYPES``: ``"glm4v"``, ``"glm4v_moe"``, ``"glm46v"``) get their own vocabulary (GLM-4's special
tokens after the same BPE), their real processors (``Glm4vProcessor``, ``Glm46VProcessor``) and a chat template of
GLM-4.1V's shape (the GLM block at the end of this module).

``transformers`` is imported inside functions only, so importing this module is cheap and side-effect free.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PretrainedConfig, PreTrainedModel

#: the Qwen families, in the order of the patches' family table (this part sits below the patches: a test ties them)
MODEL_TYPES: tuple[str, ...] = (
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_vl_moe",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen4_exp",
)
#: the GLM-V families (GLM-4.1V, GLM-4.5V, GLM-4.6V): their own vocabulary, processor and template (see the GLM block)
GLM_TYPES: tuple[str, ...] = ("glm4v", "glm4v_moe", "glm46v")

BASE_VOCAB: int = 498
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
TOKEN_IDS: dict[str, int] = {tok: BASE_VOCAB + i for i, tok in enumerate(SPECIAL_TOKENS)}
VOCAB_SIZE: int = BASE_VOCAB + len(SPECIAL_TOKENS)  # 512

_CORPUS = """\
The quick brown fox jumps over the lazy dog while the cat watches from the window.
A picture shows a red car parked near a small house with a green door and two windows.
Describe the image in detail. What colour is the sky? How many people are in the photo?
The video starts with a person walking along the beach, then the camera turns to the sea.
Padding-free training packs several conversations into one long sequence without pad tokens.
Each sample keeps its own position ids, so attention never crosses the boundary between samples.
The assistant answers the user politely and explains the reasoning step by step.
Numbers like 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 appear in dates, prices and counts.
Vision tokens are merged two by two before they reach the language model.
Questions: who, what, where, when, why and how? Answers: yes, no, maybe, sometimes, always.
The model reads text, looks at pictures, watches videos and writes a short summary of them.
Training loss should go down; evaluation accuracy should go up; gradients must stay finite.
There is a dog, a bird, a tree, a table, a chair, a book, a cup of coffee and a laptop.
Please provide a caption for this photo and list every object that you can see in it.
In the morning the city is quiet, but by the evening the streets are full of traffic and lights.
"""

_CHAT_TEMPLATE = """\
{%- for message in messages %}
{{- '<|im_start|>' ~ message['role'] ~ '\\n' }}
{%- if message['content'] is string %}
{{- message['content'] }}
{%- else %}
{%- for part in message['content'] or [] %}
{%- set kind = part.get('type', '') %}
{%- if kind in ('image', 'image_url') or 'image' in part or 'image_url' in part %}
{{- '<|vision_start|><|image_pad|><|vision_end|>' }}
{%- elif kind == 'video' or 'video' in part %}
{{- '<|vision_start|><|video_pad|><|vision_end|>' }}
{%- elif 'text' in part %}
{{- part['text'] }}
{%- endif %}
{%- endfor %}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# family -> class-name prefix: f"{prefix}Config", f"{prefix}ForConditionalGeneration"
_PREFIX = {
    "qwen2_vl": "Qwen2VL",
    "qwen2_5_vl": "Qwen2_5_VL",
    "qwen3_vl": "Qwen3VL",
    "qwen3_vl_moe": "Qwen3VLMoe",
    "qwen3_5": "Qwen3_5",
    "qwen3_5_moe": "Qwen3_5Moe",
    "qwen4_exp": "Qwen4Exp",
}


def _qwen3_style(model_type: str) -> bool:
    """Qwen3-VL's processor, patch 16 and M-RoPE layout: the qwen3 families and Qwen4-Exp."""
    return model_type.startswith("qwen3") or model_type == "qwen4_exp"


def _hybrid_style(model_type: str) -> bool:
    """Qwen3.5's hybrid text stack and tokenizer (`Qwen3_5Tokenizer`): Qwen3.5, Qwen3.5-MoE and Qwen4-Exp."""
    return model_type.startswith("qwen3_5") or model_type == "qwen4_exp"


def _class(model_type: str, kind: str) -> Any:
    """Resolve `kind` ("Config", "ForConditionalGeneration", "Processor", "VideoProcessor") for a family."""
    import transformers

    if model_type in _GLM_PREFIX:
        return getattr(transformers, _GLM_PREFIX[model_type] + kind)
    if model_type not in _PREFIX:
        raise ValueError(f"Unsupported model_type {model_type!r}; expected one of {MODEL_TYPES + GLM_TYPES}.")
    prefix = _PREFIX[model_type]
    if kind == "Processor":  # qwen3_vl_moe, qwen3_5 and qwen3_5_moe ship Qwen3VLProcessor
        prefix = "Qwen3VL" if _qwen3_style(model_type) else prefix
    elif kind == "VideoProcessor":
        prefix = "Qwen3VL" if _qwen3_style(model_type) else "Qwen2VL"
    return getattr(transformers, prefix + kind)


def tiny_config(model_type: str, **overrides: Any) -> PretrainedConfig:
    """Build a tiny fp32 config for one Qwen-VL family.

    Text: hidden 64, 2 layers, 4 heads, 2 kv heads, intermediate 128 (MoE: 4 experts of width 32, top-2; Qwen3.5-MoE
    also a shared expert of width 32). Qwen3.5: layer 0 is Gated DeltaNet linear attention, layer 1 full attention.
    Vision: depth 2, width 32, 2 heads, spatial merge 2, temporal patch 2; patch 14 (qwen2/2.5) or 16 (qwen3*).
    M-RoPE sections are the family's real ones scaled to the tiny head dim (16 for qwen2/2.5, 32 for qwen3).
    Vocabulary size and special token ids match the tokenizer of [`build_tiny_processor`].

    Args:
        model_type (`str`):
            One of `MODEL_TYPES`.
        **overrides:
            Top-level config attributes to override. `text_config` / `vision_config` may be dicts; they are merged
            into the tiny defaults instead of replacing them.

    Returns:
        `PretrainedConfig`: the family's config class (e.g. `Qwen2VLConfig`).
    """
    if model_type in GLM_TYPES:
        return glm_tiny_config(model_type, **overrides)
    config_cls = _class(model_type, "Config")
    qwen3 = _qwen3_style(model_type)
    eot, eos = TOKEN_IDS["<|endoftext|>"], TOKEN_IDS["<|im_end|>"]
    ids = {"bos_token_id": eot, "eos_token_id": eos, "pad_token_id": eot}
    text: dict[str, Any] = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        **ids,
    }
    if qwen3:  # real: head_dim 128, mrope [24, 20, 20] interleaved -> head_dim 32, [6, 5, 5]
        text.update(
            head_dim=32,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 5_000_000.0,
                "mrope_section": [6, 5, 5],
                "mrope_interleaved": True,
            },
        )
        vision: dict[str, Any] = {
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "out_hidden_size": 64,
            "num_position_embeddings": 256,
            "deepstack_visual_indexes": [0],
        }
        if _hybrid_style(model_type):
            _hybrid(text, vision)
        if model_type == "qwen4_exp":
            _qwen4_exp(text)
        if model_type == "qwen3_vl_moe":
            text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1)
        elif model_type == "qwen3_5_moe":
            text.update(
                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32
            )
    else:  # real: head_dim 128, mrope [16, 24, 24] -> head_dim 16, [2, 3, 3]
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [2, 3, 3]}
        if model_type == "qwen2_vl":  # Qwen2-VL: `embed_dim` is the ViT width, `hidden_size` the merger output
            vision = {"depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "mlp_ratio": 2}
        else:  # window 56 px = 2x2 merged tokens, so small test images already span several windows
            vision = {
                "depth": 2,
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_heads": 2,
                "out_hidden_size": 64,
                "window_size": 56,
                "fullatt_block_indexes": [1],
                "tokens_per_second": 2,
            }
        vision.update(patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    text.update(overrides.pop("text_config", None) or {})
    vision.update(overrides.pop("vision_config", None) or {})
    kwargs: dict[str, Any] = {
        "text_config": text,
        "vision_config": vision,
        "image_token_id": TOKEN_IDS["<|image_pad|>"],
        "video_token_id": TOKEN_IDS["<|video_pad|>"],
        "vision_start_token_id": TOKEN_IDS["<|vision_start|>"],
        "vision_end_token_id": TOKEN_IDS["<|vision_end|>"],
        "tie_word_embeddings": False,
        "dtype": "float32",
        **ids,
    }
    kwargs.update(overrides)
    return config_cls(**kwargs)


def _hybrid(text: dict[str, Any], vision: dict[str, Any]) -> None:
    """Qwen3.5: one Gated DeltaNet layer then one full-attention layer (real: 3 then 1, ``full_attention_interval``
    4), linear heads 2 key / 4 value of dim 16 (real 16 / 32 of 128: grouped values kept), conv kernel 4 (real);
    full attention head_dim 64 with the real ``partial_rotary_factor`` 0.25 (real mrope [11, 11, 10] -> [3, 3, 2]).
    The vision tower has no DeepStack."""
    text.update(
        layer_types=["linear_attention", "full_attention"],
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "mrope_section": [3, 3, 2],
            "mrope_interleaved": True,
            "partial_rotary_factor": 0.25,
        },
    )
    del vision["deepstack_visual_indexes"]


def _qwen4_exp(text: dict[str, Any]) -> None:
    """Qwen4-Exp: Qwen3.5-MoE's hybrid stack with every part that mixes tokens switched on, tiny. Layers: Gated
    DeltaNet with PLE, QSA-indexed attention, Gated DeltaNet (real: 3 linear then 1 indexed). PLE: 2-grams and
    3-grams, 2 hashed heads each (real 8), tables of ~1k rows per head (real 20M), conv kernel 4 dilated by 3 (real).
    QSA: 8 indexer heads of dim 32 (real: more), blocks of 4 keys, budget 8 tokens (2 blocks): samples of a few
    dozen tokens already have more complete blocks than the budget. A block scores ``Σ_heads relu(q·k)``, exactly 0
    when every head's product is negative; with 2 heads a quarter of the blocks tie at 0 and transformers'
    ``topk`` breaks ties its own way (hf_packing: lower block first), with 8 heads a tie at the top-k edge is
    ~1/256 per block, none in the tests' samples. 2 hyper-connection streams (real 4), rank 8. MoE: 4
    experts of width 32, top-2, a shared expert of width 32."""
    text.update(
        layer_types=["linear_attention", "indexed_attention", "linear_attention"],
        num_hidden_layers=3,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        hc_count=2,
        hc_lowrank=8,
        ple_layer_ids=[1],
        ple_embed_dim=32,
        ple_conv_kernel_size=4,
        ngram_size=3,
        heads_per_ngram=2,
        ngram_vocab_size_base=1009,
        make_ngram_vocab_size_divisible_by=8,
        indexer_n_heads=8,
        indexer_kv_heads=1,
        indexer_head_dim=32,
        indexer_budget=8,
        indexer_compress_ratio=4,
    )


def _tokenizer_module(model_type: str) -> Any:
    """The module of the family's real tokenizer class: Qwen3.5 has its own (pre-tokenizer regex, NFC)."""
    import importlib

    name = "qwen3_5" if _hybrid_style(model_type) else "qwen2"
    return importlib.import_module(f"transformers.models.{name}.tokenization_{name}")


def _train_tokenizer(model_type: str) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Train a deterministic byte-level BPE (vocab `BASE_VOCAB`) and append the Qwen special tokens."""
    import json

    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    regex = _tokenizer_module(model_type).PRETOKENIZE_REGEX  # so the family's tokenizer class fits the merges
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=BASE_VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer)
    model = json.loads(tok.to_str())["model"]
    vocab: dict[str, int] = model["vocab"]
    if len(vocab) != BASE_VOCAB:
        raise RuntimeError(f"tiny BPE reached {len(vocab)} tokens instead of {BASE_VOCAB}; enlarge the corpus")
    merges = [(m.split(" ", 1)[0], m.split(" ", 1)[1]) if isinstance(m, str) else (m[0], m[1]) for m in model["merges"]]
    return {**vocab, **TOKEN_IDS}, merges


def _build_tokenizer(model_type: str) -> Any:
    """Wrap the trained BPE in the real checkpoints' class (`Qwen2Tokenizer`; `Qwen3_5Tokenizer` for Qwen3.5) with
    Qwen's special-token setup."""
    from tokenizers import AddedToken

    module = _tokenizer_module(model_type)
    tokenizer_cls = getattr(module, "Qwen3_5Tokenizer" if _hybrid_style(model_type) else "Qwen2Tokenizer")
    vocab, merges = _train_tokenizer(model_type)
    tok = tokenizer_cls(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=32768,
        extra_special_tokens=list(SPECIAL_TOKENS[1:]),
    )
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS], special_tokens=True)
    tok.chat_template = _CHAT_TEMPLATE
    bad = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS if tok.convert_tokens_to_ids(t) != TOKEN_IDS[t]}
    if bad or len(tok) != VOCAB_SIZE:
        raise RuntimeError(f"tiny tokenizer ids drifted: {bad}, len={len(tok)}")
    return tok


def build_tiny_processor(model_type: str, save_dir: str | Path) -> Path:
    """Build the family's real processor around a locally trained tiny tokenizer and save it.

    Images: `Qwen2VLImageProcessor` (all families; qwen3 uses patch 16 and mean/std 0.5) limited to
    `size={"shortest_edge": 56*56, "longest_edge": 448*448}` pixels (64*64 / 512*512 for qwen3).
    Videos: `Qwen2VLVideoProcessor` (per-frame pixel budget 56*56 .. 224*224) or `Qwen3VLVideoProcessor` (budget
    over all frames, 64*64 .. 16*256*256), `cap_pixels_per_frame=False`. Videos can be given as numpy arrays
    `(T, H, W, 3)` or lists of PIL frames; no video decoding package is needed. Qwen3 keeps the real defaults
    (`do_sample_frames=True`, `fps=2`, at least 4 frames) and its processor writes `<t seconds>` timestamps per
    temporal patch; without `video_metadata` the source fps is assumed to be 24 (transformers warns).

    Args:
        model_type (`str`):
            One of `MODEL_TYPES` (the qwen3 families other than `"qwen3_vl"` use `Qwen3VLProcessor`).
        save_dir (`str` or `Path`):
            Directory to write to; created if missing.

    Returns:
        `Path`: `save_dir`, loadable offline with `AutoProcessor.from_pretrained`.
    """
    if model_type in GLM_TYPES:
        return build_glm_processor(model_type, save_dir)
    processor_cls, video_cls = _class(model_type, "Processor"), _class(model_type, "VideoProcessor")
    from transformers import Qwen2VLImageProcessor

    if _qwen3_style(model_type):
        norm = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
        patch, img_size = 16, {"shortest_edge": 64 * 64, "longest_edge": 512 * 512}
        vid_size = {"shortest_edge": 64 * 64, "longest_edge": 16 * 256 * 256}  # qwen3: summed over frames
    else:
        norm = {}  # the classes default to the OpenAI CLIP mean/std, as the real checkpoints do
        patch, img_size = 14, {"shortest_edge": 56 * 56, "longest_edge": 448 * 448}
        vid_size = {"shortest_edge": 56 * 56, "longest_edge": 224 * 224}
    common: dict[str, Any] = {"patch_size": patch, "temporal_patch_size": 2, "merge_size": 2, **norm}
    image_processor = Qwen2VLImageProcessor(size=img_size, **common)
    video_processor = video_cls(size=vid_size, cap_pixels_per_frame=False, **common)
    processor = processor_cls(
        image_processor=image_processor,
        tokenizer=_build_tokenizer(model_type),
        video_processor=video_processor,
        chat_template=_CHAT_TEMPLATE,
    )
    save_dir = Path(save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    processor.save_pretrained(str(save_dir))
    return save_dir


def build_tiny_model(
    model_type: str, processor_dir: str | Path | None = None, seed: int = 0, **overrides: Any
) -> PreTrainedModel:
    """Instantiate a random-init fp32 `XForConditionalGeneration` from [`tiny_config`] (Qwen3.5: with its linear
    layers' decay rates spread, see `_spread_decays`; Qwen4-Exp: with its PLE conv drawn, see `_ple_conv_weights`).

    Args:
        model_type (`str`):
            One of `MODEL_TYPES`.
        processor_dir (`str` or `Path`, *optional*):
            A saved tiny processor. When given, its tokenizer is checked against the config (vocab size and the
            image/video/vision-start/vision-end/eos/pad ids) and a `ValueError` is raised on mismatch.
        seed (`int`, *optional*, defaults to 0):
            Seed for weight init. The global torch RNG state is restored afterwards.
        **overrides:
            Forwarded to [`tiny_config`].

    Returns:
        `PreTrainedModel`: the family's model (e.g. `Qwen2VLForConditionalGeneration`), fp32, on CPU.
    """
    import torch

    config = tiny_config(model_type, **overrides)
    if processor_dir is not None:
        check_special_tokens(config, processor_dir)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _class(model_type, "ForConditionalGeneration")(config)
    _spread_decays(model)
    _ple_conv_weights(model, seed)
    return model.to(torch.float32)


def _ple_conv_weights(model: PreTrainedModel, seed: int) -> None:
    """Draw Qwen4-Exp's PLE conv weights (transformers initialises them to zero, so the conv starts as a no-op):
    with zeros, a conv window reaching into the previous sample would go unseen, and the conv would get no test."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if type(module).__name__ == "Qwen4ExpTextPLELayer":
            conv: Any = module.conv1d
            weight = conv.weight
            with torch.no_grad():
                weight.copy_(torch.randn(tuple(weight.shape), generator=generator) * 0.5)


def _spread_decays(model: PreTrainedModel) -> None:
    """Set each Gated DeltaNet layer's decay rates ``A`` log-spaced over transformers' init range [0.01, 16].

    transformers draws ``A`` uniformly from [0.01, 16]; a head keeps ``exp(-A·softplus(a + dt_bias))`` of its state
    per token, under 1% once ``A > 3.5``, so with 4 value heads most tiny heads would forget everything at once: a
    state leaking across a boundary would go unseen through them, and their ``A_log`` gradients are cancelling sums
    of order 1e-9 (round-off). Log-spaced ``A`` = 0.01, 0.12, 1.4, 16 keeps 99%, 86%, 17% and ~0 per token.
    """
    import math

    import torch

    for module in model.modules():
        a_log = getattr(module, "A_log", None)
        if isinstance(a_log, torch.nn.Parameter):
            with torch.no_grad():
                a_log.copy_(torch.logspace(math.log10(0.01), math.log10(16.0), a_log.numel()).log())


def check_special_tokens(config: PretrainedConfig, processor_dir: str | Path | Any) -> None:
    """Raise `ValueError` if `config` disagrees with the tokenizer saved in `processor_dir` (or a processor/tokenizer).

    Args:
        config (`PretrainedConfig`):
            A Qwen-VL config.
        processor_dir (`str`, `Path`, processor or tokenizer):
            Where to read the tokenizer from.
    """
    tok: Any = processor_dir
    if isinstance(processor_dir, (str, Path)):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(processor_dir))
    tok = getattr(tok, "tokenizer", tok)
    text = config.get_text_config()
    pairs = {"vocab_size": (text.vocab_size, len(tok))}
    if config.model_type in GLM_TYPES:
        names = {f"{k}_token_id": v for k, v in _GLM_CONFIG_TOKENS.items()}
        pairs.update({k: (getattr(config, k), tok.convert_tokens_to_ids(v)) for k, v in names.items()})
        pairs["pad_token_id"] = (text.pad_token_id, tok.pad_token_id)
    else:
        for name in ("eos_token_id", "pad_token_id"):
            pairs[name] = (getattr(text, name, None), getattr(tok, name))
        for name, token in [("image", "image_pad"), ("video", "video_pad"), ("vision_start",) * 2, ("vision_end",) * 2]:
            pairs[f"{name}_token_id"] = (getattr(config, f"{name}_token_id"), tok.convert_tokens_to_ids(f"<|{token}|>"))
    bad = {k: v for k, v in pairs.items() if v[0] != v[1]}
    if bad:
        raise ValueError(f"config/tokenizer mismatch (config, tokenizer): {bad}")


def save_tiny_checkpoint(model_type: str, out_dir: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Save a tiny model and its processor into one directory.

    `AutoModelForImageTextToText.from_pretrained(out_dir)` and `AutoProcessor.from_pretrained(out_dir)` load it offline.

    Args:
        model_type (`str`):
            One of `MODEL_TYPES`.
        out_dir (`str` or `Path`):
            Output directory; created if missing.
        seed (`int`, *optional*, defaults to 0):
            Weight-init seed.
        **overrides:
            Forwarded to [`tiny_config`].

    Returns:
        `Path`: `out_dir`.
    """
    out_dir = build_tiny_processor(model_type, out_dir)
    model = build_tiny_model(model_type, processor_dir=out_dir, seed=seed, **overrides)
    model.save_pretrained(str(out_dir))
    return out_dir


# ---------------------------------------------------------------------------------------------------------- GLM-V
# GLM-4.1V / GLM-4.5V / GLM-4.6V: their own special tokens (in GLM-4's order, after the ordinary BPE tokens), their
# real processor classes (`Glm4vProcessor`, `Glm46VProcessor`) and a chat template of GLM-4.1V's shape:
# ``[gMASK]<sop><|user|>\n...<|assistant|>\n...`` with no end-of-turn token after an assistant turn.

_GLM_PREFIX = {"glm4v": "Glm4v", "glm4v_moe": "Glm4vMoe", "glm46v": "Glm46V"}
GLM_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
    "<|image|>",
    "<|video|>",
    "<think>",
    "</think>",
)
GLM_TOKEN_IDS: dict[str, int] = {tok: BASE_VOCAB + i for i, tok in enumerate(GLM_SPECIAL_TOKENS)}
GLM_VOCAB_SIZE: int = BASE_VOCAB + len(GLM_SPECIAL_TOKENS)  # 516
#: the config's ``<name>_token_id`` attributes and the tokens they name
_GLM_CONFIG_TOKENS = {
    "image": "<|image|>",
    "video": "<|video|>",
    "image_start": "<|begin_of_image|>",
    "image_end": "<|end_of_image|>",
    "video_start": "<|begin_of_video|>",
    "video_end": "<|end_of_video|>",
}

# GLM-4.1V's shape: a ``[gMASK]<sop>`` prefix, role tokens that open each turn, images as
# ``<|begin_of_image|><|image|><|end_of_image|>``, videos as ``<|begin_of_video|><|video|><|end_of_video|>``, an
# earlier assistant turn's thinking dropped, and nothing written after an assistant turn: the next role token (or
# the end of the text) ends it. Tool results are ``<|observation|>`` turns.
GLM_CHAT_TEMPLATE = """\
[gMASK]<sop>
{%- for message in messages %}
{%- if message['role'] == 'system' %}{{- '<|system|>\\n' }}
{%- elif message['role'] == 'user' %}{{- '<|user|>\\n' }}
{%- elif message['role'] == 'assistant' %}{{- '<|assistant|>\\n' }}
{%- else %}{{- '<|observation|>\\n' }}
{%- endif %}
{%- if message['content'] is string %}
{%- set text = message['content'] %}
{%- if message['role'] == 'assistant' and '</think>' in text and not loop.last %}
{%- set text = text.split('</think>')[-1].lstrip() %}
{%- endif %}
{{- text }}
{%- else %}
{%- for part in message['content'] or [] %}
{%- set kind = part.get('type', '') %}
{%- if kind in ('image', 'image_url') or 'image' in part or 'image_url' in part %}
{{- '<|begin_of_image|><|image|><|end_of_image|>' }}
{%- elif kind == 'video' or 'video' in part %}
{{- '<|begin_of_video|><|video|><|end_of_video|>' }}
{%- elif 'text' in part %}
{{- part['text'] }}
{%- endif %}
{%- endfor %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|assistant|>\\n' }}
{%- endif %}
"""


def glm_tiny_config(model_type: str, **overrides: Any) -> PretrainedConfig:
    """A tiny fp32 config of a GLM-V family (`tiny_config` for ``GLM_TYPES``).

    Text: hidden 64, 2 layers, 2 heads of 32, 1 kv head, intermediate 128, the real ``partial_rotary_factor`` 0.5 and
    M-RoPE over the rotated half (real head 128, mrope [8, 12, 12] -> [2, 3, 3]). GLM-4.5V: 4 routed experts of width
    32, top-2, one shared expert, layer 0 dense (real ``first_k_dense_replace`` 1). Vision: depth 2, width 32, 2
    heads, patch 14, merge 2, ``image_size`` 56 (a 4x4 table of learned position embeddings, interpolated bicubically
    to each image's grid, as the real 336 px table is). Token ids match `build_glm_processor`'s tokenizer.
    """
    import transformers

    config_cls = getattr(transformers, _GLM_PREFIX[model_type] + "Config")
    eot = GLM_TOKEN_IDS["<|endoftext|>"]
    stops = [eot, GLM_TOKEN_IDS["<|user|>"], GLM_TOKEN_IDS["<|observation|>"]]  # GLM's generation stops
    text: dict[str, Any] = {
        "vocab_size": GLM_VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 4096,
        "pad_token_id": eot,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10_000.0,
            "mrope_section": [2, 3, 3],
            "partial_rotary_factor": 0.5,
        },
    }
    if model_type == "glm4v_moe":
        text.update(
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=1,
            first_k_dense_replace=1,
            router_aux_loss_coef=0.001,
        )
    vision: dict[str, Any] = {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": 64,
        "image_size": 56,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    text.update(overrides.pop("text_config", None) or {})
    vision.update(overrides.pop("vision_config", None) or {})
    ids = {f"{k}_token_id": GLM_TOKEN_IDS[v] for k, v in _GLM_CONFIG_TOKENS.items()}
    kwargs: dict[str, Any] = {
        "text_config": text,
        "vision_config": vision,
        "tie_word_embeddings": False,
        "dtype": "float32",
        **ids,
    }
    kwargs.update(overrides)
    config = config_cls(**kwargs)
    config.text_config.eos_token_id = stops
    return config


def _build_glm_tokenizer() -> Any:
    """The tiny BPE wrapped in `PreTrainedTokenizerFast` (GLM's checkpoints load as ``TokenizersBackend``) with GLM's
    special tokens and the GLM-4.1V-shaped template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab, merges = _train_tokenizer("qwen2_vl")
    vocab = {k: v for k, v in vocab.items() if v < BASE_VOCAB}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    from tokenizers import Regex

    regex = _tokenizer_module("qwen2_vl").PRETOKENIZE_REGEX
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in GLM_SPECIAL_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        model_max_length=32768,
        extra_special_tokens=list(GLM_SPECIAL_TOKENS[1:]),
    )
    fast.chat_template = GLM_CHAT_TEMPLATE
    bad = {
        t: fast.convert_tokens_to_ids(t)
        for t in GLM_SPECIAL_TOKENS
        if fast.convert_tokens_to_ids(t) != GLM_TOKEN_IDS[t]
    }
    if bad or len(fast) != GLM_VOCAB_SIZE:
        raise RuntimeError(f"tiny GLM tokenizer ids drifted: {bad}, len={len(fast)}")
    return fast


def build_glm_processor(model_type: str, save_dir: str | Path) -> Path:
    """`build_tiny_processor` for ``GLM_TYPES``: the family's real processor (`Glm4vProcessor`; `Glm46VProcessor`
    for GLM-4.6V, whose frame timestamps read ``"0.0 seconds"`` where GLM-4.1V/4.5V write ``"0"``) around the tiny
    GLM tokenizer, with `Glm4vImageProcessor` / `Glm4vVideoProcessor` (`Glm46V*` for GLM-4.6V) on small budgets:
    images 2·56² .. 2·224² px (GLM counts the two temporal copies of an image), videos 2·56² .. 8·112² px over all
    frames; the real frame sampling (``fps`` 2, which needs ``video_metadata``, or ``do_sample_frames=False``)."""
    import transformers

    prefix = "Glm46V" if model_type == "glm46v" else "Glm4v"
    common: dict[str, Any] = {"patch_size": 14, "temporal_patch_size": 2, "merge_size": 2}
    image_processor = getattr(transformers, prefix + "ImageProcessor")(
        size={"shortest_edge": 2 * 56 * 56, "longest_edge": 2 * 224 * 224}, **common
    )
    video_processor = getattr(transformers, prefix + "VideoProcessor")(
        size={"shortest_edge": 2 * 56 * 56, "longest_edge": 8 * 112 * 112}, **common
    )
    processor = getattr(transformers, prefix + "Processor")(
        image_processor=image_processor,
        tokenizer=_build_glm_tokenizer(),
        video_processor=video_processor,
        chat_template=GLM_CHAT_TEMPLATE,
    )
    save_dir = Path(save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    processor.save_pretrained(str(save_dir))
    return save_dir
