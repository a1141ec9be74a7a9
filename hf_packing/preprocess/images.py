"""Image I/O for preprocessing: safe path resolution, header-only sizes, and decoding to 8-bit RGB.

Planning reads only headers (`PIL.Image.open` is lazy: a header costs a small fraction of a decode, measured:
docs/packer.md, 'What a row costs'), plus the last 2 KB of JPEG/PNG data, so a truncated download is refused while
planning, not after its pack was made. Sizes are EXIF-rotated from the header (a PNG's `getexif()` would decode the
file); decoding rotates with `PIL.ImageOps.exif_transpose`. The two disagree only on a PNG whose EXIF follows its
pixels, planned unrotated: the same tokens, since Qwen's resize rule treats height and width alike.

A URL or data URI (`fetch.py`) is read through the loader's [`~hf_packing.preprocess.fetch.MediaFetcher`]: its size
from the first 64 KiB (the whole image when its header does not fit), its pixels from the whole body; the end-marker
check then runs on the whole body, when the sample is processed.
"""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageOps

from ..config import MAX_IMAGE_PIXELS
from .errors import SampleError
from .fetch import MediaFetcher, describe, is_remote

_ORIENTATION = 0x0112  # the EXIF tag


class _Prefix(io.BytesIO):
    """The first bytes of a remote image, enough for most headers."""


class ImageLoader:
    """Opens image references: a PIL image, bytes, `{"bytes": ..., "path": ...}` (HF `Image(decode=False)`), a path,
    or an `http(s)://` URL or `data:` URI (fetched by `fetcher`).

    Args:
        image_root (`str` or `Path`, *optional*): relative paths resolve here; a path escaping it (`..`, absolute,
            symlink) raises [`SampleError`] `"path_outside_root"`. Without it, paths are used as given.
        max_image_pixels (`int`, defaults to 89,478,485): larger images (by header) raise `"image_too_large"`.
        fetcher ([`~hf_packing.preprocess.fetch.MediaFetcher`], *optional*): reads URLs and data URIs (default: one
            with the default bounds).
    """

    def __init__(
        self,
        *,
        image_root: str | os.PathLike | None = None,
        max_image_pixels: int = MAX_IMAGE_PIXELS,
        fetcher: MediaFetcher | None = None,
    ) -> None:
        self.image_root = Path(image_root).resolve() if image_root is not None else None
        self.max_image_pixels = max_image_pixels
        self.fetcher = fetcher if fetcher is not None else MediaFetcher()

    def resolve(self, ref: str | os.PathLike) -> Path:
        path = Path(os.fsdecode(ref)).expanduser()
        if self.image_root is None:
            return path
        resolved = (self.image_root / path).resolve()  # follows symlinks; an absolute `path` replaces the root
        if not resolved.is_relative_to(self.image_root):
            raise SampleError("path_outside_root", f"path {os.fsdecode(ref)!r} resolves outside {self.image_root}")
        return resolved

    def _source(self, ref: Any, header_only: bool = False) -> Image.Image | io.BytesIO | Path:
        if isinstance(ref, Image.Image):
            return ref
        if isinstance(ref, Mapping):
            ref = ref.get("bytes") or ref.get("path")
        if is_remote(ref):
            body, whole = self.fetcher.header(ref) if header_only else (self.fetcher.fetch(ref), True)
            if not body:
                raise SampleError("empty_image", f"image {describe(ref)} has 0 bytes")
            if not whole:
                return _Prefix(body)  # the end-marker check waits for the whole body (processing)
            ref = body
        if isinstance(ref, (bytes, bytearray, memoryview)):
            data = bytes(ref)
            if not data:
                raise SampleError("empty_image", "image has 0 bytes")
            _check_tail(data[:8], data[-2048:])
            return io.BytesIO(data)
        if not isinstance(ref, (str, os.PathLike)):
            raise SampleError("bad_row", f"unsupported image reference of type {type(ref).__name__}")
        path = self.resolve(ref)
        if not path.is_file():
            raise SampleError("missing_file", f"image file {str(path)!r} not found")
        size = path.stat().st_size
        if size == 0:
            raise SampleError("empty_image", f"image file {str(path)!r} has 0 bytes")
        with open(path, "rb") as f:
            head = f.read(8)
            f.seek(max(0, size - 2048))
            _check_tail(head, f.read())
        return path

    def open(self, ref: Any, *, header_only: bool = False) -> Image.Image:
        """The lazily opened image (pixels not decoded); size and pixel-budget checks done. `header_only`: a remote
        image may be opened from its first bytes (enough for its size, not its pixels)."""
        src = self._source(ref, header_only)
        if isinstance(src, Image.Image):
            return src
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                image = Image.open(src)
        except Image.DecompressionBombError as err:
            raise SampleError("image_too_large", str(err)) from None
        except (OSError, SyntaxError, ValueError) as err:
            if isinstance(src, _Prefix):  # its header goes on past the prefix: read the whole image
                return self.open(ref)
            where = f" {describe(ref)}" if is_remote(ref) else ""
            raise SampleError("corrupt_image", f"unreadable image{where} ({err})") from None
        width, height = image.size
        if width * height == 0:
            image.close()
            raise SampleError("empty_image", f"image is {width}x{height}")
        if width * height > self.max_image_pixels:
            image.close()
            raise SampleError(
                "image_too_large", f"image is {width}x{height} > max_image_pixels={self.max_image_pixels:,}"
            )
        return image

    def size(self, ref: Any) -> tuple[int, int]:
        """`(height, width)` after EXIF rotation, from the header only."""
        image = self.open(ref, header_only=True)
        try:
            width, height = image.size
            in_header = image.format != "PNG" or "exif" in image.info  # else PIL's getexif() decodes the pixels
            orientation = image.getexif().get(_ORIENTATION, 1) if in_header else 1
        except Exception as err:  # a broken EXIF block
            raise SampleError("corrupt_image", f"unreadable EXIF block ({err})") from None
        finally:
            if image is not ref:
                image.close()
        return (width, height) if orientation in (5, 6, 7, 8) else (height, width)

    def load_rgb(self, ref: Any) -> Image.Image:
        """The decoded image, EXIF-rotated, as 8-bit RGB; raises [`SampleError`] `"corrupt_image"` if undecodable."""
        image, rgb = self.open(ref), None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                # in place unless it is the caller's image (a copy then)
                rgb = to_rgb(_upright(image, in_place=image is not ref))
        except (OSError, SyntaxError, ValueError) as err:
            raise SampleError("corrupt_image", f"image cannot be decoded ({err})") from None
        finally:
            if image is not ref and rgb is not image:  # a new image, or an error: the opened one is done
                image.close()
        return rgb


def _check_tail(head: bytes, tail: bytes) -> None:
    """Refuse JPEG/PNG data whose end marker is missing (a truncated download)."""
    jpeg, png = head.startswith(b"\xff\xd8"), head.startswith(b"\x89PNG")
    if (jpeg and b"\xff\xd9" not in tail) or (png and b"IEND" not in tail):
        raise SampleError("corrupt_image", "image data is truncated (no end-of-image marker)")


def _upright(image: Image.Image, in_place: bool) -> Image.Image:
    """``image`` turned as its EXIF orientation says (PIL returns None when it turned it in place)."""
    if in_place:
        ImageOps.exif_transpose(image, in_place=True)
        return image
    return ImageOps.exif_transpose(image)


def to_rgb(image: Image.Image) -> Image.Image:
    """8-bit RGB: alpha composited on white; 16-bit, 32-bit int and float scaled (not clipped); CMYK/P/L/1 converted.

    Example: an `I;16` pixel of 65535 becomes 255 and 32768 becomes 128 (a plain `convert("RGB")` clips both to 255).
    """
    mode = image.mode
    if mode.startswith("I;16") or mode in ("I", "F"):
        arr = np.asarray(image, dtype=np.float64)
        top = 65535.0 if mode.startswith("I;16") or (mode == "I" and arr.max(initial=0) > 255) else 255.0
        if mode == "F" and arr.max(initial=0) <= 1.0:
            top = 1.0
        image = Image.fromarray(np.clip(np.rint(arr * (255.0 / top)), 0, 255).astype(np.uint8), "L")
    elif mode in ("LA", "PA", "La", "RGBa") or (mode == "P" and "transparency" in image.info):
        image = image.convert("RGBA")
    if image.mode == "RGBA":
        background = Image.new("RGB", image.size, (255, 255, 255))
        background.paste(image, mask=image.getchannel("A"))
        return background
    return image if image.mode == "RGB" else image.convert("RGB")
