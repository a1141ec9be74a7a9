"""Host memory of one large image in a DataLoader worker: decoding (`ImageLoader.load_rgb`) and the processor.

`PackingConfig.max_image_pixels` (default 89,478,485, PIL's own limit) is checked on the header, before anything is
decoded; what an image that passes it costs is measured here, one image per fresh process, at Qwen2.5-VL's default
processor resolution cap (``max_pixels`` 12,845,056; the local tiny processor with that size, so no download):

- decode: peak and held RSS over the baseline while `ImageLoader.load_rgb` turns the file into 8-bit RGB;
- process: peak RSS over the baseline while the image processor resizes to at most ``max_pixels``, rescales,
  normalises and patchifies it; and the bytes of the ``pixel_values`` it returns (a sample holds them until its
  pack is collated).

Images (written here): an RGB JPEG of a 12 Mpx photo, A4 and A3 at 600 dpi, and A4 at 600 dpi as a 16-bit grayscale
PNG (a common scan format). RSS is ``VmHWM`` / ``VmRSS`` from ``/proc/self/status``, the high-water mark reset through
``/proc/self/clear_refs`` before each stage, with ``MALLOC_MMAP_THRESHOLD_=65536`` so glibc returns large blocks and
the RSS follows the arrays. One thread (``torch.set_num_threads(1)``), as a DataLoader worker.

    python benchmarks/image_memory.py              # writes its section of RESULTS.md (~3 min, most of it writing images)
    python benchmarks/image_memory.py --no-write
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import _common as C  # noqa: E402

MAX_PIXELS = 12_845_056  # Qwen2.5-VL's processor default (16,384 patches of 28 x 28 px)
IMAGES = [  # name, width, height, kind
    ("photo 12 Mpx, RGB JPEG", 4000, 3000, "rgb"),
    ("A4 600 dpi, RGB JPEG", 4960, 7016, "rgb"),
    ("A3 600 dpi, RGB JPEG", 7016, 9921, "rgb"),
    ("A4 600 dpi, 16-bit gray PNG", 4960, 7016, "gray16"),
]


def write_image(path: Path, width: int, height: int, kind: str) -> None:
    """A smooth gradient with a little noise (compresses like a scan, decodes at full size)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    y = np.linspace(0, 1, height, dtype=np.float32)[:, None]
    x = np.linspace(0, 1, width, dtype=np.float32)[None, :]
    if kind == "rgb":
        base = y * 200 + x * 50
        rgb = np.stack([base, base[::-1], base[:, ::-1]], -1) + rng.integers(0, 8, (height, width, 3))
        Image.fromarray(rgb.clip(0, 255).astype(np.uint8)).save(path, quality=90)
    else:
        gray = (y * 60000 + x * 5000).astype(np.uint16) + rng.integers(0, 64, (height, width), dtype=np.uint16)
        Image.fromarray(gray).save(path, compress_level=1)  # mode I;16


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset() -> int:
    """Reset the RSS high-water mark; returns the RSS now."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    return _status("VmRSS")


def worker(path: str) -> None:
    """Measure one image (see the module docstring); prints one JSON line."""
    import torch
    from PIL import Image
    from transformers import AutoProcessor

    from hf_packing.preprocess.images import ImageLoader

    torch.set_num_threads(1)
    image_processor = AutoProcessor.from_pretrained(HERE.parent / "tests" / "fixtures" / "qwen2_5_vl").image_processor
    image_processor.size = {"shortest_edge": 3136, "longest_edge": MAX_PIXELS}
    image_processor(images=[Image.new("RGB", (64, 64))], return_tensors="pt")  # warm-up
    loader = ImageLoader()
    base = _reset()
    start = time.perf_counter()
    rgb = loader.load_rgb(path)
    decode_s = time.perf_counter() - start
    decode_peak, decode_held = _status("VmHWM") - base, _status("VmRSS") - base
    base = _reset()
    start = time.perf_counter()
    out = image_processor(images=[rgb], return_tensors="pt")
    process_s = time.perf_counter() - start
    pixels = out["pixel_values"]
    t, h, w = out["image_grid_thw"][0].tolist()
    print(
        json.dumps(
            {
                "pixels": rgb.size[0] * rgb.size[1],
                "decode_peak": decode_peak,
                "decode_held": decode_held,
                "decode_s": decode_s,
                "process_peak": _status("VmHWM") - base,
                "process_s": process_s,
                "pixel_values": pixels.numel() * pixels.element_size(),
                "resized": h * w * image_processor.patch_size**2,
                "tokens": t * h * w // image_processor.merge_size**2,
            }
        )
    )


def measure(path: Path) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(HERE.parent)}
    done = subprocess.run(
        [sys.executable, __file__, "--worker", str(path)], env=env, capture_output=True, text=True, timeout=600
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker)
    t_start, rows = time.time(), []
    mib = 2**20
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, width, height, kind) in enumerate(IMAGES):
            path = Path(tmp) / f"{i}.{'jpg' if kind == 'rgb' else 'png'}"
            write_image(path, width, height, kind)
            r = measure(path)
            rows.append(
                [
                    name,
                    f"{width} x {height} ({r['pixels'] / 1e6:.1f} Mpx)",
                    f"{r['decode_peak'] / mib:,.0f} ({r['decode_peak'] / r['pixels']:.1f})",
                    f"{r['decode_held'] / mib:,.0f} ({r['decode_held'] / r['pixels']:.1f})",
                    f"{r['resized'] / 1e6:.2f} Mpx, {r['tokens']:,} tokens",
                    f"{r['process_peak'] / mib:,.0f}",
                    f"{r['pixel_values'] / mib:,.0f} ({r['pixel_values'] / r['resized']:.1f})",
                    f"{r['decode_s']:.2f} / {r['process_s']:.2f}",
                ]
            )
            print(rows[-1], flush=True)
    table = C.md_table(
        [
            "image",
            "size",
            "decode peak MiB (B / px)",
            "decoded, held MiB (B / px)",
            "after resize",
            "processor peak MiB",
            "pixel_values MiB (B / resized px)",
            "decode / process s",
        ],
        rows,
    )
    body = f"""## Host memory of one large image: decode and processor (`image_memory.py`)

{C.footer(t_start, C.machine("1 thread, one image per fresh process"), load_after=True)}
- Method: see the script's docstring (peak / held RSS over the baseline per stage; Qwen2.5-VL's image processor at its
  default max_pixels {MAX_PIXELS:,}; `ImageLoader.load_rgb` as the packer's workers call it).

{table}

Reading: PIL holds 8-bit RGB as 4 bytes per pixel, so a decoded image costs 4 B per source pixel, up to 358 MB at the
default `max_image_pixels` (89,478,485); a 16-bit scan passes through float64 on its way to 8 bits (the peak column).
The processor's peak grows with the source (its uint8 copy) and with the resized image; its `pixel_values` are 24 B
per resized pixel (float32, 3 channels, the image repeated over Qwen's 2 temporal patch slots), capped by the
processor's max_pixels, not by max_image_pixels.
"""
    if args.no_write:
        print(body)
    else:
        C.write_section("image_memory", body)
        print(body)


if __name__ == "__main__":
    main()
