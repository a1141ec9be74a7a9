"""The checkpoint's own chat template: rendering a conversation as written, and finding the turns it supervises.

A row reaches `processor.apply_chat_template` with every key of every message (`reasoning_content`, `tool_calls`,
`name`, `tool_call_id`, …), its `tools` and the source's `chat_template_kwargs` (`add_vision_id`, `enable_thinking`,
…), so the sample is what the checkpoint renders. What is supervised is each assistant turn *as rendered in the whole
conversation*: templates render a turn differently by its place (Qwen3-style templates drop an earlier turn's
thinking and give the last turn an empty `<think>` block), so rendering prefixes and diffing them does not work.
Instead the template's own turn markers are learned once, from four probe renders:

    render([u])                          = P
    render([u], add_generation_prompt)   = P + G            G: what inference appends before the model writes
    render([u, a])                       = P + A_last       the probe answer rendered as the last turn
    render([u, a, u2])                   = P + A_mid + …    … and rendered before a later user turn

    header = the longest common prefix of G, A_last and A_mid          "<|im_start|>assistant\\n"
    footer = what follows the probe answer in A_last and A_mid, stripped "<|im_end|>"

and each assistant turn of a rendered row is the text from after a header to the end of the next footer:

    <|im_start|>user\\nWhat?<|im_end|>\\n<|im_start|>assistant\\n<think>\\nr\\n</think>\\n\\nA dog.<|im_end|>\\n
                                                        └────────── supervised (labels) ──────────┘

A template that writes nothing after an assistant turn (GLM-V: the next role token ends it) has no footer; then the
turn ends at the first control token that can open what follows (the next user turn's, a tool turn's, the assistant
header's: learned from the same probes, each one special token), which is supervised, and a last answer that ends
the text gets the tokenizer's eos appended and supervised (`ChatRenderer.closed`)::

    [gMASK]<sop><|user|>\nWhat?<|assistant|>\nA dog.<|user|>\nColour?<|assistant|>\nBrown.<|endoftext|>
                                      └ supervised ┘                    └ supervised (eos appended) ┘

A template without such markers (no header common to the three renders, no footer after the answer) is refused with
a [`TemplateError`] naming it, when the source's preprocessor is built; a row whose rendering holds a different number
of headers than assistant turns (a header written inside a message) is skipped (`"unlocated_assistant_turn"`), never
guessed. An empty thinking block that the template inserts before an answer without reasoning
(`<think>\\n\\n</think>\\n\\n`) is masked by default (`empty_thinking="mask"`): the data says nothing about
thinking there.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import SampleError

__all__ = ["EMPTY_THINKING", "ChatRenderer", "TemplateError", "TurnMarkers"]

EMPTY_THINKING = ("mask", "train")
_EMPTY_THINK = re.compile(r"\s*(?:<think>)?\s*</think>\s*")  # a block with nothing but whitespace inside
_PROBES = ("hfp probe question one", "hfp probe answer", "hfp probe question two")


class TemplateError(ValueError):
    """The chat template's assistant turns cannot be located (or its probe conversation is refused)."""


@dataclass(frozen=True)
class TurnMarkers:
    """What the template writes before (`header`) and after (`footer`) an assistant turn's body.

    A template that writes no footer (GLM: the next role token ends a turn) has ``footer == ""``; then ``stops`` are
    the control tokens that open what may follow an answer (the next user turn's, a tool turn's, the assistant
    header's first token), the first of which ends the turn and is supervised, and ``close`` (the tokenizer's eos)
    is appended after a last answer that ends the text."""

    header: str
    footer: str
    stops: tuple[str, ...] = ()
    close: str = ""


def _common_prefix(*texts: str) -> str:
    end = 0
    for chars in zip(*texts):
        if len(set(chars)) > 1:
            break
        end += 1
    return texts[0][:end]


class ChatRenderer:
    """One source's chat template: `processor.apply_chat_template` with the source's `template_kwargs`, and the
    character spans of the assistant turns it supervises.

    Args:
        processor: the checkpoint's processor (its `chat_template` is used).
        template_kwargs (`Mapping`, *optional*): extra template variables (`add_vision_id`, `enable_thinking`, …).
        empty_thinking (`str`, defaults to `"mask"`): `"mask"` leaves template-inserted empty thinking blocks out of
            the labels, `"train"` supervises them.
    """

    def __init__(
        self, processor: Any, template_kwargs: Mapping[str, Any] | None = None, *, empty_thinking: str = "mask"
    ) -> None:
        if empty_thinking not in EMPTY_THINKING:
            raise ValueError(f"empty_thinking must be one of {EMPTY_THINKING}, got {empty_thinking!r}")
        self.processor, self.empty_thinking = processor, empty_thinking
        self.template_kwargs = dict(template_kwargs or {})
        reserved = {"tools", "add_generation_prompt", "tokenize", "messages", "conversation"}
        reserved &= set(self.template_kwargs)
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {sorted(reserved)}: tools come from the row's column")
        self._markers: TurnMarkers | None = None

    # ------------------------------------------------------------------------------------------------ rendering
    def render(self, messages: list[dict[str, Any]], tools: Any = None, *, add_generation_prompt: bool = False) -> str:
        """The conversation as the template renders it; a template that refuses the row (`raise_exception`) raises
        [`SampleError`] `"template_error"` with the template's message."""
        import jinja2

        try:
            return self.processor.apply_chat_template(
                messages,
                tools=tools,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **self.template_kwargs,
            )
        except jinja2.TemplateError as err:
            raise SampleError("template_error", f"the chat template refused the row: {err}") from None

    def describe(self) -> str:
        """The template's name in messages: the checkpoint and a short hash of the template text."""
        tokenizer = getattr(self.processor, "tokenizer", self.processor)
        template = getattr(self.processor, "chat_template", None) or getattr(tokenizer, "chat_template", None) or ""
        name = getattr(tokenizer, "name_or_path", "") or type(self.processor).__name__
        digest = hashlib.sha256(str(template).encode()).hexdigest()[:8]
        return f"the chat template of {name!r} (sha256 {digest}, kwargs {self.template_kwargs})"

    # ------------------------------------------------------------------------------------------------ markers
    @property
    def markers(self) -> TurnMarkers:
        """The template's assistant header and footer, learned from probe renders (see the module docstring)."""
        if self._markers is None:
            self._markers = self._probe()
        return self._markers

    def _probe(self) -> TurnMarkers:
        question, answer, question2 = _PROBES
        user, user2 = {"role": "user", "content": question}, {"role": "user", "content": question2}
        assistant = {"role": "assistant", "content": answer}
        try:
            prompt = self.render([user])
            generation = self.render([user], add_generation_prompt=True)
            last, middle = self.render([user, assistant]), self.render([user, assistant, user2])
        except SampleError as err:
            raise TemplateError(f"{self.describe()} refuses a plain user/assistant conversation: {err}") from None
        if not all(t.startswith(prompt) for t in (generation, last, middle)):
            raise TemplateError(
                f"{self.describe()} renders the first user turn differently once an assistant turn follows; its "
                "assistant turns cannot be located (set train_on='all' to supervise every token)"
            )
        generation, last, middle = (t[len(prompt) :] for t in (generation, last, middle))
        header = _common_prefix(generation, last, middle)
        if not header.strip() or answer not in last[len(header) :] or answer not in middle[len(header) :]:
            raise TemplateError(
                f"{self.describe()} writes no common header before an assistant turn (generation prompt "
                f"{generation!r}, turn {last!r}); its assistant turns cannot be located (set train_on='all')"
            )
        after_last = last[last.index(answer, len(header)) + len(answer) :]
        after_middle = middle[middle.index(answer, len(header)) + len(answer) :]
        footer = _common_prefix(after_last, after_middle).rstrip()
        if not footer.strip() and not after_last.strip():
            return self._footerless(header, after_middle, user)
        if not footer.strip() or header in footer:
            raise TemplateError(
                f"{self.describe()} writes no end-of-turn marker after an assistant turn ({after_last!r}); its "
                "assistant turns cannot be located (set train_on='all')"
            )
        return TurnMarkers(header, footer)

    def _footerless(self, header: str, after_middle: str, user: dict[str, Any]) -> TurnMarkers:
        """Markers of a template that writes nothing after an assistant turn (GLM-V): the turn ends at the control
        token that opens what follows it, learned from the probe renders: the next user turn's (``after_middle``),
        a tool turn's (when the template renders one) and the assistant header's. Each must be one special token of
        the tokenizer, or the template is refused (the end of a turn could not be told from its text)."""
        tokenizer = getattr(self.processor, "tokenizer", self.processor)
        special = set(getattr(tokenizer, "all_special_tokens", ())) | set(tokenizer.get_added_vocab())
        openers = [after_middle, header]
        try:
            tool = {"role": "tool", "content": _PROBES[0]}
            turn = self.render([user, {"role": "assistant", "content": _PROBES[1]}, tool])
            openers.append(turn[turn.index(_PROBES[1]) + len(_PROBES[1]) :])
        except (SampleError, ValueError):  # a template without tool turns: user and assistant openers only
            pass
        stops = []
        for opener in openers:
            first = (tokenizer.tokenize(opener) or [""])[0]
            if first not in special:
                raise TemplateError(
                    f"{self.describe()} writes no end-of-turn marker after an assistant turn and the next turn opens "
                    f"with {opener[:40]!r}, not a special token; its assistant turns cannot be located (set "
                    "train_on='all')"
                )
            stops.append(first)
        close = tokenizer.eos_token or ""
        if not close:
            raise TemplateError(
                f"{self.describe()} writes no end-of-turn marker after an assistant turn and the tokenizer has no eos "
                "token to end the last one; set train_on='all'"
            )
        return TurnMarkers(header, "", tuple(dict.fromkeys(stops)), close)

    # ------------------------------------------------------------------------------------------------ spans
    def assistant_spans(
        self, text: str, messages: Sequence[Mapping[str, Any]], *, supervised: Callable[[int], bool] | None = None
    ) -> list[tuple[int, int]]:
        """Character spans `[start, end)` of the supervised assistant turns of `text` (the rendering of `messages`).

        Args:
            text (`str`): `render(messages, tools)`.
            messages (`Sequence`): the rendered messages, to count and number the assistant turns.
            supervised (`Callable`, *optional*): which assistant turns (by message index) are supervised; default all.

        Raises:
            [`SampleError`]: `"unlocated_assistant_turn"` when `text` has a different number of assistant headers than
            `messages` has assistant turns, or a turn has no footer before the next header.
        """
        header, footer = self.markers.header, self.markers.footer
        turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        starts = [m.end() for m in re.finditer(re.escape(header), text)]
        if len(starts) != len(turns):
            raise SampleError(
                "unlocated_assistant_turn",
                f"the rendered text has {len(starts)} assistant headers {header!r} for {len(turns)} assistant turns "
                "(a message containing the template's control text?)",
            )
        spans = []
        for k, (message_index, start) in enumerate(zip(turns, starts, strict=True)):
            if footer:
                end = text.find(footer, start)
                limit = starts[k + 1] - len(header) if k + 1 < len(starts) else len(text)
                if end < 0 or end + len(footer) > limit:
                    raise SampleError(
                        "unlocated_assistant_turn", f"assistant turn {k} has no end-of-turn marker {footer!r}"
                    )
                stop = footer
            else:  # no footer: the first stop token after the answer ends it (supervised), else the end of the text
                found = [(at, s) for s in self.markers.stops if (at := text.find(s, start)) >= 0]
                end, stop = min(found) if found else (len(text), "")
            if supervised is not None and not supervised(message_index):
                continue
            if self.empty_thinking == "mask":
                empty = _EMPTY_THINK.match(text, start, end)
                start = empty.end() if empty else start
            spans.append((start, end + len(stop)))
        return spans

    def closed(self, text: str, spans: list[tuple[int, int]]) -> tuple[str, list[tuple[int, int]]]:
        """``text`` and ``spans`` with the markers' ``close`` (the eos) appended and supervised when the last span
        runs to the end of the text: a footer-less template leaves a last answer without any end, and a model
        trained so would never learn to stop after it. Other templates: unchanged."""
        close = self.markers.close
        if not close or not spans or spans[-1][1] != len(text):
            return text, spans
        return text + close, [*spans[:-1], (spans[-1][0], len(text) + len(close))]
