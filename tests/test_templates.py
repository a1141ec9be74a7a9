"""What trains is what the checkpoint renders: every row kind against the processor's own output, for every family.

The oracle is transformers alone: `processor.apply_chat_template(messages, tools, tokenize=True,
return_assistant_tokens_mask=True, ...)` on the row's messages as a user would pass them (media inline), with test
templates (tests/fixtures/templates) that reproduce the Qwen checkpoints' template behaviours: a default system turn,
`add_vision_id`, tools, tool calls and tool turns, reasoning dropped from earlier turns, Qwen3.5's empty thinking block
and its generation prompt. Their assistant bodies sit in `{% generation %}` blocks, which hf_packing never reads (it
locates turns by probing the template), so the label mask is computed independently.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import pytest
import torch
from PIL import Image

from hf_packing.ops.loss import IGNORE_INDEX
from hf_packing.preprocess import formats
from hf_packing.preprocess.errors import SampleError
from hf_packing.preprocess.preprocessor import Preprocessor
from hf_packing.preprocess.templates import TemplateError
from tests.helpers import image, load_processor, video

TEMPLATES = Path(__file__).parent / "fixtures" / "templates"
FAMILY_TEMPLATE = {
    "qwen2_vl": "qwen2_vl",
    "qwen2_5_vl": "qwen2_vl",
    "qwen3_vl": "qwen3",
    "qwen3_vl_moe": "qwen3",
    "qwen3_5": "qwen3_5",
    "qwen3_5_moe": "qwen3_5",
}
TOOLS = [{"type": "function", "function": {"name": "zoom", "parameters": {"type": "object"}}}]
CALL = {"type": "function", "function": {"name": "zoom", "arguments": {"x": 3, "y": 1}}}
FPS = 2.0


def template(kind: str) -> str:
    if kind == "qwen2_vl":
        return (TEMPLATES / "qwen2_vl_like.jinja").read_text()
    text = (TEMPLATES / "qwen3_like.jinja").read_text()
    return text.replace("{%- set qwen3_5 = false -%}", "{%- set qwen3_5 = true -%}") if kind == "qwen3_5" else text


def with_template(processor, text: str):
    processor = copy.deepcopy(processor)
    processor.chat_template = processor.tokenizer.chat_template = text
    return processor


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> dict[str, str | list[str]]:
    root = tmp_path_factory.mktemp("media")
    image(90, 60, 1).save(root / "a.png")
    image(40, 120, 2).save(root / "b.png")
    frames = []
    for k, frame in enumerate(video(4, 84, 56, seed=3)):
        Image.fromarray(frame).save(root / f"f{k}.png")
        frames.append(str(root / f"f{k}.png"))
    return {"a": str(root / "a.png"), "b": str(root / "b.png"), "clip": frames}


def user(*parts) -> dict:
    return {"role": "user", "content": [p if isinstance(p, dict) else {"type": "text", "text": p} for p in parts]}


def row_kinds(m: dict) -> dict[str, tuple[dict, list[dict], list | None]]:
    """{kind: (the row as a dataset holds it, the messages as a user passes them to the processor, tools)}."""
    img_a, img_b = {"type": "image", "image": m["a"]}, {"type": "image", "image": m["b"]}
    answer = {"role": "assistant", "content": "A red car."}
    rows = {
        "plain": [user(img_a, "What is this?"), answer],
        "system": [{"role": "system", "content": "Be brief."}, user(img_a, "What?"), answer],
        "empty_system": [{"role": "system", "content": ""}, user("Hi"), answer],
        "empty_assistant": [user("Say nothing."), {"role": "assistant", "content": ""}, user("Now?"), answer],
        "multi_turn": [user(img_a, "What?"), answer, user("Colour?"), {"role": "assistant", "content": "Red."}],
        "reasoning": [
            user(img_a, "What?"),
            {"role": "assistant", "content": "A car.", "reasoning_content": "Wheels, so a car."},
            user("Colour?"),
            {"role": "assistant", "content": "Red.", "reasoning_content": "The paint is red."},
        ],
        "tool_calls": [user(img_a, "Zoom in."), {"role": "assistant", "content": "Zooming.", "tool_calls": [CALL]}],
        "tool_turn": [
            user(img_a, "Zoom in."),
            {"role": "assistant", "content": "", "tool_calls": [CALL], "reasoning_content": "Need detail."},
            {"role": "tool", "content": "zoomed: a badge", "name": "zoom"},
            {"role": "assistant", "content": "A badge.", "reasoning_content": "The tool shows a badge."},
        ],
        "multi_image": [user(img_a, "and", img_b, "Compare."), answer],
        "video": [user({"type": "video", "video": m["clip"]}, "What happens?"), answer],
    }
    kinds = {k: ({"messages": v}, v, None) for k, v in rows.items()}
    kinds["tools"] = ({"messages": rows["tool_calls"], "tools": json.dumps(TOOLS)}, rows["tool_calls"], TOOLS)
    kinds["tools_list"] = ({"messages": rows["tool_turn"], "tools": TOOLS}, rows["tool_turn"], TOOLS)
    # the same conversation from an `images` column with bare placeholders, and in LLaVA form
    bare = [user({"type": "image"}, "and", {"type": "image"}, "Compare."), answer]
    kinds["images_column"] = ({"messages": bare, "images": [m["a"], m["b"]]}, rows["multi_image"], None)
    llava = [{"from": "human", "value": "<image>\nWhat is this?"}, {"from": "gpt", "value": "A red car."}]
    kinds["llava"] = ({"conversations": llava, "image": m["a"]}, rows["plain"], None)
    return kinds


def oracle(processor, messages: list[dict], tools, kwargs: dict) -> dict:
    metadata = {"total_num_frames": 4, "fps": FPS, "frames_indices": [0, 1, 2, 3]}
    videos_kwargs = {"do_sample_frames": False, "video_metadata": [metadata]}
    out = processor.apply_chat_template(
        messages,
        tools=tools,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
        return_tensors="pt",
        processor_kwargs={"videos_kwargs": videos_kwargs},
        **kwargs,
    )
    return {k: v[0] if k in ("input_ids", "assistant_masks", "mm_token_type_ids") else v for k, v in out.items()}


VISION_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")


def expected_labels(processor, ref: dict) -> torch.Tensor:
    vision = torch.isin(ref["input_ids"], torch.tensor(processor.tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))))
    keep = ref["assistant_masks"].bool() & ~vision
    return ref["input_ids"].masked_fill(~keep, IGNORE_INDEX)


def assert_equal_to_oracle(processor, row: dict, messages: list[dict]) -> None:
    ref, sample = oracle(processor, messages, None, {}), Preprocessor(processor).process(row)
    assert torch.equal(sample["input_ids"], ref["input_ids"])
    assert torch.equal(sample["labels"], expected_labels(processor, ref))


@pytest.fixture(scope="module")
def family_processors():
    return {family: with_template(load_processor(family), template(t)) for family, t in FAMILY_TEMPLATE.items()}


@pytest.mark.parametrize("family", list(FAMILY_TEMPLATE))
def test_every_row_kind_equals_the_processors_own_rendering(family, family_processors, media):
    processor = family_processors[family]
    kwargs = {"add_vision_id": True}
    pre = Preprocessor(processor, fps=FPS, chat_template_kwargs=kwargs)
    checked = 0
    for kind, (row, messages, tools) in row_kinds(media).items():
        ref = oracle(processor, messages, tools, kwargs)
        sample = pre.process(row, kind)
        assert torch.equal(sample["input_ids"], ref["input_ids"]), kind
        assert torch.equal(sample["labels"], expected_labels(processor, ref)), kind
        assert torch.equal(sample["mm_token_type_ids"], ref["mm_token_type_ids"]), kind
        for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
            assert (key in sample) == (key in ref), (kind, key)
            assert key not in ref or torch.equal(sample[key], ref[key]), (kind, key)
        assert pre.estimate(row, kind).num_tokens == sample["num_tokens"] == ref["input_ids"].numel(), kind
        checked += 1
    assert checked == 14


def test_thinking_of_earlier_turns_is_dropped_and_labels_follow_the_whole_conversation(family_processors, media):
    """Qwen3-style templates render a turn's reasoning only after the last user query: the first answer's thinking
    is not in the text, the last one's is, and the labels cover each turn as rendered in the full conversation."""
    processor = family_processors["qwen3_vl"]
    row, messages, _ = row_kinds(media)["reasoning"]
    sample = Preprocessor(processor).process(row)
    decode = processor.tokenizer.decode
    supervised = decode(sample["labels"][sample["labels"] != IGNORE_INDEX])
    assert "Wheels" not in decode(sample["input_ids"])  # dropped by the template from the earlier turn
    assert supervised == "A car.<|im_end|><think>\nThe paint is red.\n</think>\n\nRed.<|im_end|>"
    # rendering prefix by prefix would have kept the first turn's thinking: not what the model sees
    prefix = processor.apply_chat_template(messages[:2])
    assert "Wheels" in prefix


def test_qwen3_5_empty_thinking_is_masked_by_default_or_trained(family_processors):
    processor = family_processors["qwen3_5"]
    row = {"messages": [user("Hi"), {"role": "assistant", "content": "Hello."}]}
    decode = processor.tokenizer.decode

    def supervised(**kw):
        labels = Preprocessor(processor, **kw).process(row)["labels"]
        return decode(labels[labels != IGNORE_INDEX])

    assert supervised() == "Hello.<|im_end|>"
    assert supervised(empty_thinking="train") == "<think>\n\n</think>\n\nHello.<|im_end|>"


def test_generation_prompt_kwargs_reach_the_template(family_processors):
    processor = family_processors["qwen3_5"]
    row = {"messages": [user("Hi"), {"role": "assistant", "content": "Hello."}]}
    plain = Preprocessor(processor).process(row)["input_ids"]
    text = processor.apply_chat_template(row["messages"], add_vision_id=True)
    assert processor.tokenizer.decode(plain) == text
    with pytest.raises(ValueError, match="tools come from the row"):
        Preprocessor(processor, chat_template_kwargs={"tools": TOOLS})


def test_a_row_the_template_refuses_is_a_counted_skip_with_its_message(family_processors):
    pre = Preprocessor(family_processors["qwen3_5"])
    with pytest.raises(SampleError, match="No user query found") as err:
        pre.estimate({"messages": [{"role": "system", "content": "S"}, {"role": "assistant", "content": "A"}]})
    assert err.value.reason == "template_error"


def test_a_header_inside_a_message_is_refused_not_guessed(family_processors):
    pre = Preprocessor(family_processors["qwen2_vl"])
    row = {"messages": [user("say <|im_start|>assistant\nhi"), {"role": "assistant", "content": "no"}]}
    with pytest.raises(SampleError) as err:
        pre.estimate(row)
    assert err.value.reason == "unlocated_assistant_turn"


@pytest.mark.parametrize(
    "text",
    [
        "{% for m in messages %}{{ m.content }}\n{% endfor %}",  # no role header at all
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}",
    ],
)
def test_a_template_without_locatable_assistant_turns_is_refused_by_name(text):
    processor = with_template(load_processor("qwen2_vl"), text)
    with pytest.raises(TemplateError, match="the chat template of .* cannot be located"):
        Preprocessor(processor)
    Preprocessor(processor, train_on="all")  # nothing to locate: every token is supervised


def test_negative_control_a_normaliser_that_drops_a_key_fails_the_equality(family_processors, media, monkeypatch):
    processor = family_processors["qwen3_vl"]
    row, messages, tools = row_kinds(media)["tool_calls"]
    ref = oracle(processor, messages, tools, {})
    original = formats._message

    def dropping(*args, **kwargs):
        message = original(*args, **kwargs)
        message.pop("tool_calls", None)
        return message

    monkeypatch.setattr(formats, "_message", dropping)
    sample = Preprocessor(processor).process(row)
    assert not torch.equal(sample["input_ids"], ref["input_ids"])


# ------------------------------------------------------------------------------------------------ other formats
def test_llama_factory_rows_render_their_tags_in_place(family_processors, media):
    """LLaMA-Factory: string contents with <image> tags and an `images` column; a tag is replaced where it stands."""
    processor = family_processors["qwen2_5_vl"]
    row = {
        "messages": [
            {"role": "user", "content": "<image>\nWhat is this?"},
            {"role": "assistant", "content": "A red car."},
        ],
        "images": [media["a"]],
    }
    messages = [user({"type": "image", "image": media["a"]}, "\nWhat is this?"), row["messages"][1]]
    assert_equal_to_oracle(processor, row, messages)


def test_sharegpt_tool_roles_become_tool_calls_and_tool_turns(family_processors, media):
    processor = family_processors["qwen3_vl"]
    call = {"name": "zoom", "arguments": {"x": 3, "y": 1}}
    row = {
        "conversations": [
            {"from": "human", "value": "Zoom in."},
            {"from": "function_call", "value": json.dumps(call)},
            {"from": "observation", "value": "zoomed"},
            {"from": "gpt", "value": "A badge."},
        ]
    }
    messages = [
        {"role": "user", "content": "Zoom in."},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]},
        {"role": "tool", "content": "zoomed"},
        {"role": "assistant", "content": "A badge."},
    ]
    assert_equal_to_oracle(processor, row, messages)


def test_trl_conversational_prompt_completion_supervises_the_completion_only(family_processors, media):
    processor = family_processors["qwen2_5_vl"]
    prompt = [
        user({"type": "image"}, "What?"),
        {"role": "assistant", "content": "A car."},
        user("Colour?"),
    ]
    row = {"prompt": prompt, "completion": [{"role": "assistant", "content": "Red."}], "images": [media["a"]]}
    sample = Preprocessor(processor).process(row)
    decode = processor.tokenizer.decode
    assert decode(sample["labels"][sample["labels"] != IGNORE_INDEX]) == "Red.<|im_end|>"
    full = [user({"type": "image", "image": media["a"]}, "What?"), prompt[1], prompt[2], row["completion"][0]]
    assert torch.equal(sample["input_ids"], oracle(processor, full, None, {})["input_ids"])


def test_trl_standard_prompt_completion_is_text_plus_eos_with_the_completion_supervised(family_processors):
    processor = family_processors["qwen2_5_vl"]
    sample = Preprocessor(processor).process({"prompt": "The sky is", "completion": " blue."})
    tok = processor.tokenizer
    assert torch.equal(sample["input_ids"], torch.tensor(tok("The sky is blue.<|im_end|>")["input_ids"]))
    assert tok.decode(sample["labels"][sample["labels"] != IGNORE_INDEX]) == " blue.<|im_end|>"


def _rows(rows):  # a stream of rows whose contents mix strings and parts (Arrow tables cannot)
    yield from rows


def test_stats_report_rows_with_reasoning_and_tool_calls(family_processors, media, caplog):
    from hf_packing.cli.stats import collect_metadata

    kinds = row_kinds(media)
    rows = [kinds[k][0] for k in ("plain", "reasoning", "tool_calls", "tools", "tool_turn")]
    pre = Preprocessor(family_processors["qwen3_vl"])
    with caplog.at_level(logging.WARNING):
        *_, extra = collect_metadata(rows, pre, show_progress=False)
    assert {f: extra[f] for f in formats.FEATURES} == {"reasoning": 2, "tool_calls": 3, "tool_turns": 1, "tools": 1}
    # the packer's summary counts kept rows the same way (here without the tools column)
    from datasets import IterableDataset

    from hf_packing import pack_dataset

    stream = IterableDataset.from_generator(_rows, gen_kwargs={"rows": [{"messages": r["messages"]} for r in rows]})
    packs = pack_dataset(stream, pre.processor, max_length=4096)
    list(packs)
    assert packs.stats(log=False)["rows_with"] == {"reasoning": 2, "tool_calls": 3, "tool_turns": 1, "tools": 0}


# ------------------------------------------------------------------------------------------------ docs
def marked(processor, sample: dict) -> str:
    """The sample's text with each run of supervised tokens in ⟦ ⟧ and each run of image pads as one pad."""
    out, inside, previous = [], False, None
    for token, label in zip(sample["input_ids"].tolist(), sample["labels"].tolist()):
        supervised = label != IGNORE_INDEX
        if supervised != inside:
            out.append("⟦" if supervised else "⟧")
            inside = supervised
        text = processor.tokenizer.decode([token])
        if not (text in VISION_TOKENS[:2] and text == previous):
            out.append(text)
        previous = text
    return "".join(out) + ("⟧" if inside else "")


def doc_examples(processors: dict, media: dict) -> dict[str, str]:
    kinds = row_kinds(media)
    rows = {"qwen2_vl": kinds["plain"][0], "qwen3_vl": kinds["tool_turn"][0], "qwen3_5": kinds["multi_turn"][0]}
    kwargs = {"qwen3_vl": {"add_vision_id": True}}
    return {
        family: marked(
            processors[family], Preprocessor(processors[family], chat_template_kwargs=kwargs.get(family)).process(row)
        )
        for family, row in rows.items()
    }


def test_docs_show_each_familys_rendered_sample_with_its_labels(family_processors, media):
    doc = (Path(__file__).parents[1] / "docs" / "chat_templates.md").read_text()
    for family, text in doc_examples(family_processors, media).items():
        assert text in doc, f"docs/chat_templates.md: the {family} example is stale; it renders as\n{text}"


def test_llama_factory_and_trl_rows_pack_and_train(family_processors, media, tmp_path):
    """Both formats through `datasets`, `pack_dataset`, `VisionCollator` and a Trainer step; every packed sample
    equals the preprocessor's (whose labels the tests above hold to the formats' conventions)."""
    from datasets import Dataset
    from transformers import Trainer

    import hf_packing
    from hf_packing.testing.tiny import build_tiny_model
    from tests.helpers import sgd_training_args

    processor = family_processors["qwen2_5_vl"]
    factory = [
        {
            "messages": [
                {"role": "user", "content": f"<image>\nWhat is {k}?"},
                {"role": "assistant", "content": "A car."},
            ],
            "images": [media["a"]],
        }
        for k in range(3)
    ]
    text = lambda t: [{"type": "text", "text": t}]  # noqa: E731
    trl = [
        {
            "prompt": [{"role": "user", "content": [{"type": "image", "text": None}, *text(f"Colour {k}?")]}],
            "completion": [{"role": "assistant", "content": text("Red.")}],
            "images": [media["b"]],
        }
        for k in range(3)
    ]
    hf_packing.apply_rmpad()
    model = build_tiny_model("qwen2_5_vl", processor_dir=Path(__file__).parent / "fixtures" / "qwen2_5_vl")
    for rows in (factory, trl):
        packs = hf_packing.pack_dataset(Dataset.from_list(rows), processor, max_length=512, length_index=False)
        samples = [s for pack in packs for s in pack]
        pre = Preprocessor(processor)
        assert len(samples) == 3
        for sample in samples:
            assert torch.equal(sample["labels"], pre.process(rows[sample["index"]])["labels"])
        args = sgd_training_args(tmp_path, max_steps=1, per_device_train_batch_size=1, learning_rate=1e-3)
        collator = hf_packing.VisionCollator(processor, model_config=model.config)
        trainer = hf_packing.prepare_trainer(
            Trainer(model=model, args=args, train_dataset=packs, data_collator=collator)
        )
        losses = [h["loss"] for h in trainer.train() and trainer.state.log_history if "loss" in h]
        assert len(losses) == 1 and 0 < losses[0] < 20
