"""A synthetic multimodal instruction dataset, generated locally, for the demo and benchmarks.

Rows are in the Hugging Face messages format with PIL images drawn here (shapes on a coloured canvas,
56–900 px, varied aspect ratios). About 10% of rows are text-only, ~15% hold two images and ~10% are
multi-turn; answers vary from a few words to a few hundred. Deterministic given ``seed``.
"""

from __future__ import annotations

import random
from pathlib import Path

WORDS = (
    "the a red blue green small large car house tree dog cat bird person beach city road window door sky "
    "cloud light shadow left right top bottom near far behind front picture image shows there is are two "
    "three several many colour shape circle square line bright dark wooden metal glass water sand grass"
).split()
QUESTIONS = (
    "Describe the image.",
    "What colour is the largest shape?",
    "How many objects are there?",
    "Write a short caption.",
    "What is in the top left corner?",
    "Compare the two pictures.",
)


def _sentence(rng: random.Random, n_words: int) -> str:
    words = [rng.choice(WORDS) for _ in range(max(1, n_words))]
    return " ".join(words).capitalize() + "."


def draw_image(rng: random.Random):
    """A PIL image of random size (56–900 px per side) with a few filled shapes."""
    from PIL import Image, ImageDraw

    width, height = rng.randint(56, 900), rng.randint(56, 900)
    canvas = Image.new("RGB", (width, height), tuple(rng.randint(0, 255) for _ in range(3)))
    draw = ImageDraw.Draw(canvas)
    for _ in range(rng.randint(1, 6)):
        x0, y0 = rng.randint(0, width - 1), rng.randint(0, height - 1)
        x1, y1 = min(width, x0 + rng.randint(5, width)), min(height, y0 + rng.randint(5, height))
        colour = tuple(rng.randint(0, 255) for _ in range(3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)([x0, y0, x1, y1], fill=colour)
    return canvas


def synthetic_rows(num_rows: int, *, seed: int = 0) -> list[dict]:
    """``num_rows`` rows ``{"messages": [...], "images": [PIL, ...]}``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_rows):
        kind = rng.random()
        n_images = 0 if kind < 0.10 else 2 if kind < 0.25 else 1
        images = [draw_image(rng) for _ in range(n_images)]
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": rng.choice(QUESTIONS)}]
        answer_words = int(rng.lognormvariate(3.2, 0.9))  # median ~25 words, long tail
        messages = [
            {"role": "user", "content": content},
            {"role": "assistant", "content": [{"type": "text", "text": _sentence(rng, answer_words)}]},
        ]
        if rng.random() < 0.10:  # a follow-up turn
            messages += [
                {"role": "user", "content": [{"type": "text", "text": "And what else?"}]},
                {"role": "assistant", "content": [{"type": "text", "text": _sentence(rng, rng.randint(3, 40))}]},
            ]
        rows.append({"messages": messages, "images": images})
    return rows


def save_synthetic_dataset(path: str | Path, num_rows: int, *, seed: int = 0) -> Path:
    """Write the rows as a real `datasets` dataset (``save_to_disk``) and return its directory."""
    from datasets import Dataset, Features, Image, List, Value

    features = Features(
        {
            "messages": List(
                {"role": Value("string"), "content": List({"type": Value("string"), "text": Value("string")})}
            ),
            "images": List(Image()),
        }
    )
    rows = synthetic_rows(num_rows, seed=seed)
    for row in rows:  # a uniform schema: every part has both keys
        for message in row["messages"]:
            message["content"] = [{"type": p["type"], "text": p.get("text")} for p in message["content"]]
    Dataset.from_list(rows, features=features).save_to_disk(str(path))
    return Path(path)
