"""Media by reference: `http(s)://` URLs fetched with the standard library, `data:` URIs decoded, both bounded.

A media reference (in `images` / `image` / `videos` columns, message parts, OpenAI-style `image_url` / `video_url`
parts, or the `path` of a `{"bytes", "path"}` dict) that starts with `http://` or `https://` is fetched with
`urllib`; one that starts with `data:` is decoded in place (base64 or percent-encoded). Everything else is a local path,
read as before. Fetches happen where the reference is read: in the DataLoader workers while planning and processing
(and in the length-index pass, `hf_packing.packing.length_index`, before training), never in the training step.

Bounds, per reference ([`~hf_packing.config.PackingConfig`] `media_timeout`, `media_tries`, `media_max_bytes`,
`media_cache_bytes`):
- `timeout`: the whole time one reference may take, every try and pause included; each try's socket waits at most
  the time left, and a body that trickles in is cut when the time is up;
- `tries`: attempts at most, for what may pass (a timeout, a refused or reset connection, HTTP 408 / 429 / 5xx), with
  a short pause between them; HTTP 4xx and a body over the size limit fail at once;
- `max_bytes`: a larger body (by `Content-Length`, or by what arrived) fails without reading the rest.
A failure is [`SampleError`] `"fetch_failed"` (a malformed data URI: `"bad_data_uri"`) whose message names the URL:
the row is skipped and counted like any bad row.

What planning costs: an image's token count needs only its size, so planning asks for the first 64 KiB (an HTTP
`Range` request; a server that ignores it is read that far and closed) and reads the header from them, as it reads
a local file's header; a header that does not fit (a JPEG with a large EXIF or ICC block) fetches the whole image.
The pixels are fetched when the sample's pack is processed. Each fetcher keeps the whole bodies it fetched in a
least-recently-used cache of `cache_bytes` (per DataLoader worker and source), so a video (planned from its whole
file) or an image planned shortly before its pack is processed is fetched once. The trade-off: every planner replica
(rank × worker) plans every row, so a streamed source of URLs costs each replica one small ranged request per image
URL (and one whole download per video URL); a `datasets.Dataset` with its length index (the default) plans from
columns, so its URLs are read once by the index pass and once by the worker whose pack holds them.
"""

from __future__ import annotations

import base64
import binascii
import http.client
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import OrderedDict
from typing import Any

from ..config import PackingConfig
from .errors import SampleError

__all__ = ["HEADER_BYTES", "MediaFetcher", "describe", "is_remote"]

HEADER_BYTES = 64 * 1024  # the prefix planning reads of an image URL
_SCHEMES = ("http://", "https://", "data:")
_CHUNK = 64 * 1024
_PAUSE = 0.25  # seconds before the second try, doubling after each


def is_remote(ref: Any) -> bool:
    """Whether `ref` is a URL or data URI (a `str`: a `Path` is always a local file)."""
    return isinstance(ref, str) and ref[:8].lower().startswith(_SCHEMES)


def describe(ref: str, limit: int = 120) -> str:
    """`ref` for a message: a URL as given (long ones cut), a data URI by its media type and length."""
    if ref[:5].lower() == "data:":
        return f"{ref[: min(40, ref.find(',') + 1 or 40)]}... ({len(ref):,} characters)"
    return ref if len(ref) <= limit else ref[: limit - 3] + "..."


class _Failed(Exception):
    """One try failed; `retry` says whether another may pass."""

    def __init__(self, message: str, *, retry: bool) -> None:
        super().__init__(message)
        self.retry = retry


class MediaFetcher:
    """Fetches URLs and decodes data URIs, within a time budget, a number of tries and a size limit (module docstring).

    Args:
        timeout (`float`, defaults to 10.0): seconds one reference may take in all (every try and pause).
        tries (`int`, defaults to 3): attempts at most for a failure that may pass.
        max_bytes (`int`, defaults to 50,000,000): the largest body accepted.
        cache_bytes (`int`, defaults to 64 MiB): whole bodies kept, least recently used out first (0: none).

    Example: ``MediaFetcher(timeout=2.0).fetch("https://example.com/cat.jpg")`` gives the JPEG's bytes, or raises
    [`SampleError`] `"fetch_failed"` naming the URL.
    """

    def __init__(
        self,
        *,
        timeout: float = PackingConfig.media_timeout,  # the defaults are PackingConfig's, declared once there
        tries: int = PackingConfig.media_tries,
        max_bytes: int = PackingConfig.media_max_bytes,
        cache_bytes: int = PackingConfig.media_cache_bytes,
    ) -> None:
        if timeout <= 0 or tries < 1 or max_bytes < 1 or cache_bytes < 0:
            raise ValueError(
                f"media_timeout must be > 0, media_tries >= 1, media_max_bytes >= 1 and media_cache_bytes >= 0, got "
                f"{timeout}, {tries}, {max_bytes}, {cache_bytes}"
            )
        self.timeout, self.tries, self.max_bytes, self.cache_bytes = float(timeout), int(tries), max_bytes, cache_bytes
        self._cache: OrderedDict[str, bytes] = OrderedDict()
        self._cached = 0

    def fetch(self, ref: str) -> bytes:
        """The whole body of URL or data URI `ref`; raises [`SampleError`] `"fetch_failed"` / `"bad_data_uri"`."""
        if ref[:5].lower() == "data:":
            return self._data(ref)
        body = self._cache.get(ref)
        if body is not None:
            self._cache.move_to_end(ref)
            return body
        body, _ = self._get(ref, None)
        self._keep(ref, body)
        return body

    def header(self, ref: str, size: int = HEADER_BYTES) -> tuple[bytes, bool]:
        """The first `size` bytes of `ref` (all of it when cached, a data URI, or shorter) and whether that is all."""
        if ref[:5].lower() == "data:" or ref in self._cache:
            return self.fetch(ref), True
        body, complete = self._get(ref, size)
        if complete and len(body) > self.max_bytes:
            raise SampleError(
                "fetch_failed", f"{describe(ref)} has {len(body):,} bytes > media_max_bytes={self.max_bytes:,}"
            )
        if complete:
            self._keep(ref, body)
        return body, complete

    def __getstate__(self) -> dict[str, Any]:  # a copy sent to a worker or a `datasets.map` process starts empty
        return {**self.__dict__, "_cache": OrderedDict(), "_cached": 0}

    # ------------------------------------------------------------------------------------------------ internals
    def _keep(self, ref: str, body: bytes) -> None:
        if len(body) > self.cache_bytes:
            return
        self._cache[ref] = body
        self._cached += len(body)
        while self._cached > self.cache_bytes:
            _, old = self._cache.popitem(last=False)
            self._cached -= len(old)

    def _data(self, ref: str) -> bytes:
        head, comma, payload = ref.partition(",")
        if not comma:
            raise SampleError("bad_data_uri", f"data URI {describe(ref)} has no ',' before its data")
        if len(payload) * 3 // 4 > self.max_bytes:
            raise SampleError(
                "bad_data_uri", f"data URI {describe(ref)} is larger than media_max_bytes={self.max_bytes:,}"
            )
        try:
            if head.lower().endswith(";base64"):
                body = base64.b64decode("".join(payload.split()), validate=True)
            else:
                body = urllib.parse.unquote_to_bytes(payload)
        except (binascii.Error, ValueError) as err:
            raise SampleError("bad_data_uri", f"data URI {describe(ref)} is not valid base64 ({err})") from None
        if not body or len(body) > self.max_bytes:
            raise SampleError(
                "bad_data_uri",
                f"data URI {describe(ref)} holds {len(body):,} bytes (1 to media_max_bytes={self.max_bytes:,})",
            )
        return body

    def _get(self, url: str, size: int | None) -> tuple[bytes, bool]:
        """Up to `size` bytes of `url` (`None`: all, within `max_bytes`) and whether that is the whole body."""
        deadline = time.monotonic() + self.timeout
        why, tries = "", 0
        for attempt in range(self.tries):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            tries = attempt + 1
            try:
                return self._try(url, size, deadline)
            except _Failed as err:
                why = str(err)
                if not err.retry:
                    break
            pause = min(_PAUSE * 2**attempt, deadline - time.monotonic())
            if attempt + 1 < self.tries and pause > 0:
                time.sleep(pause)
        if time.monotonic() >= deadline and "timed out" not in why:
            why = f"{why}; " if why else ""
            why += f"timed out after media_timeout={self.timeout:g} s"
        plural = "try" if tries == 1 else "tries"
        raise SampleError("fetch_failed", f"fetching {describe(url)} failed after {tries} {plural}: {why}")

    def _try(self, url: str, size: int | None, deadline: float) -> tuple[bytes, bool]:
        headers = {"User-Agent": "hf_packing"}
        if size is not None:
            headers["Range"] = f"bytes=0-{size - 1}"
        request = urllib.request.Request(url, headers=headers)
        limit = self.max_bytes if size is None else size
        try:
            with urllib.request.urlopen(request, timeout=max(deadline - time.monotonic(), 0.001)) as response:
                length = response.headers.get("Content-Length")
                ranged = response.status == 206
                if size is None and length is not None and length.isdigit() and int(length) > self.max_bytes:
                    raise _Failed(f"{int(length):,} bytes > media_max_bytes={self.max_bytes:,}", retry=False)
                chunks, got = [], 0
                while got <= limit:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise _Failed(f"timed out after media_timeout={self.timeout:g} s", retry=False)
                    sock = getattr(getattr(response.fp, "raw", None), "_sock", None)
                    if sock is not None:
                        sock.settimeout(left)  # each read waits at most the time left
                    chunk = response.read1(min(_CHUNK, limit + 1 - got))  # one read: a trickle cannot stall it
                    if not chunk:
                        break
                    chunks.append(chunk)
                    got += len(chunk)
        except _Failed:
            raise
        except urllib.error.HTTPError as err:
            retry = err.code in (408, 429) or err.code >= 500
            raise _Failed(f"HTTP {err.code} {err.reason}", retry=retry) from None
        except urllib.error.URLError as err:
            reason = err.reason
            timed_out = isinstance(reason, TimeoutError)
            message = f"timed out after media_timeout={self.timeout:g} s" if timed_out else f"{reason}"
            raise _Failed(message, retry=True) from None
        except TimeoutError:
            raise _Failed(f"timed out after media_timeout={self.timeout:g} s", retry=True) from None
        except (OSError, http.client.HTTPException) as err:  # reset, refused mid-way, a short body
            raise _Failed(f"{type(err).__name__}: {err}", retry=True) from None
        body = b"".join(chunks)
        if size is None:
            if got > self.max_bytes:
                raise _Failed(f"more than media_max_bytes={self.max_bytes:,} bytes", retry=False)
            return body, True
        # a prefix: all of the body if the server sent less than asked (a 200 that ended, or a 206 of the whole file)
        whole = _range_total(response) == got if ranged else got <= size
        return body[:size], whole


def _range_total(response: Any) -> int | None:
    """The full length from a 206's `Content-Range: bytes 0-N/TOTAL` (`None`: unknown)."""
    total = (response.headers.get("Content-Range") or "").rpartition("/")[2]
    return int(total) if total.isdigit() else None
