"""Media by URL and data URI (hf_packing/preprocess/fetch.py), against a local HTTP server on 127.0.0.1 only.

URL, data-URI and OpenAI `image_url` rows equal the same rows given as local files (ids and pixels); a 404, a refused
connection, a slow server and a body over the size limit are counted skips naming the URL (never `media_root`);
retries, the timeout and the cache are bounded as configured.
"""

from __future__ import annotations

import base64
import http.server
import io
import socket
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from PIL import Image

from tests.helpers import image, load_processor

SIZES = [(56, 84), (84, 56), (112, 56)]


class Handler(http.server.BaseHTTPRequestHandler):
    """Serves `server.root`: `/plain/NAME` (ignores `Range`, as many servers do), `/ranged/NAME` (honours it),
    `/slow/NAME` (answers after `server.delay` s), `/trickle/NAME` (one byte per 0.1 s), `/flaky/NAME` (503 to its
    first request); anything else, or a missing file, is a 404. `server.hits` counts requests per path."""

    def log_message(self, *args) -> None:  # keep test output clean
        pass

    def do_GET(self) -> None:
        server = self.server
        server.hits[self.path] += 1
        kind, _, name = self.path.strip("/").partition("/")
        path = server.root / name
        if kind not in ("plain", "ranged", "slow", "trickle", "flaky") or not path.is_file():
            self.send_error(404, "Not Found")
            return
        if kind == "flaky" and server.hits[self.path] == 1:
            self.send_error(503, "Service Unavailable")
            return
        if kind == "slow":
            time.sleep(server.delay)
        body = path.read_bytes()
        ranged = self.headers.get("Range") if kind == "ranged" else None
        if ranged:
            start, end = (int(x) for x in ranged.removeprefix("bytes=").split("-"))
            part = body[start : end + 1]
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{start + len(part) - 1}/{len(body)}")
            self.send_header("Content-Length", str(len(part)))
            self.end_headers()
            self.wfile.write(part)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            if kind == "trickle":
                for k in range(len(body)):
                    self.wfile.write(body[k : k + 1])
                    self.wfile.flush()
                    time.sleep(0.1)
            else:
                self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up: as it should
            pass


@pytest.fixture
def server(tmp_path, monkeypatch):
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    root = tmp_path / "served"
    root.mkdir()
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    httpd.root, httpd.hits, httpd.delay = root, Counter(), 5.0
    httpd.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def write_images(root: Path) -> list[Path]:
    """A JPEG, a PNG, and a JPEG whose ICC block puts its size header past the first 64 KiB."""
    files = []
    for k, (w, h) in enumerate(SIZES):
        path = root / f"img{k}.{'png' if k == 1 else 'jpg'}"
        extra = {"icc_profile": bytes(range(256)) * 400} if k == 2 else {}  # 100 KiB before the frame header
        image(w, h, seed=k).save(path, quality=95, **extra)
        files.append(path)
    assert files[2].read_bytes().find(b"\xff\xc0") > 64 * 1024  # SOF0 after the prefix planning reads
    return files


def row(k: int, **media) -> dict:
    """Row `k` (one image) with `media`: an `image` / `images` column, or `content` (the user turn's parts)."""
    parts = media.pop("content", [{"type": "image"}])
    return {
        "messages": [
            {"role": "user", "content": [*parts, {"type": "text", "text": f"Describe picture {k}."}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Noise " * (k + 2)}]},
        ],
        **media,
    }


def data_uri(path: Path) -> str:
    kind = "png" if path.suffix == ".png" else "jpeg"
    return f"data:image/{kind};base64,{base64.b64encode(path.read_bytes()).decode()}"


def pack(rows, processor, **kw) -> tuple[dict[int, dict], dict]:
    from datasets import Dataset

    from hf_packing import pack_dataset

    data = pack_dataset(
        Dataset.from_list(rows), processor, max_length=4096, length_index=False, disable_progress=True, **kw
    )
    samples = {s["index"]: s for p in data for s in p}
    return samples, data.stats(log=False)


def refused_url() -> str:
    """A URL on a port nobody listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/img0.jpg"


@pytest.mark.timeout(120)
def test_url_data_uri_and_image_url_rows_equal_the_same_rows_as_local_files(server):
    """Every spelling of a remote image gives the sample its local file gives: `image` / `images` URLs (a server that
    ignores `Range`, one that honours it, a header past the first 64 KiB), data URIs, OpenAI `image_url` parts (dict
    and string), `{"type": "image", "image": URL}` parts and `{"bytes": None, "path": URL}`; packed, also in a
    DataLoader worker."""
    from hf_packing.preprocess.preprocessor import Preprocessor

    processor = load_processor("qwen2_5_vl")
    files = write_images(server.root)
    pre = Preprocessor(processor, media_cache_bytes=0)  # no cache: each spelling is fetched for itself
    want = [pre.process(row(k, image=str(path)), k) for k, path in enumerate(files)]
    for k, path in enumerate(files):
        plain, ranged = f"{server.url}/plain/{path.name}", f"{server.url}/ranged/{path.name}"
        spellings = [
            {"image": plain},
            {"images": [ranged]},
            {"image": {"bytes": None, "path": ranged}},
            {"image": data_uri(path)},
            {"content": [{"type": "image_url", "image_url": {"url": plain}}]},
            {"content": [{"type": "image_url", "image_url": data_uri(path)}]},
            {"content": [{"type": "image", "image": ranged}]},
        ]
        for media in spellings:
            got = pre.process(row(k, **dict(media)), k)
            for key in ("input_ids", "labels", "pixel_values", "image_grid_thw"):
                assert torch.equal(got[key], want[k][key]), (key, media)
    # negative control: another picture of the same size differs
    image(*SIZES[0], seed=50).save(server.root / "other.jpg", quality=95)
    wrong = pre.process(row(0, image=f"{server.url}/plain/other.jpg"), 0)
    assert wrong["pixel_values"].shape == want[0]["pixel_values"].shape
    assert not torch.equal(wrong["pixel_values"], want[0]["pixel_values"])

    # packed: one column of URLs and data URIs against the same rows as local paths, in a DataLoader worker
    from datasets import Dataset

    from hf_packing import pack_dataset

    refs = [(k, ref) for k, p in enumerate(files) for ref in (f"{server.url}/plain/{p.name}", data_uri(p))]
    local = [row(k, image=str(files[k])) for k, _ in refs]
    remote = [row(k, image=ref) for k, ref in refs]
    expected, stats = pack(local, processor)
    before = sum(server.hits.values())
    data = pack_dataset(Dataset.from_list(remote), processor, max_length=4096, disable_progress=True)
    loader = torch.utils.data.DataLoader(data, batch_size=None, num_workers=1)
    got = {s["index"]: s for p in loader for s in p}
    assert sorted(got) == sorted(expected) == list(range(len(refs))) and stats["skipped"] == {}
    assert sum(server.hits.values()) > before
    for i in got:
        assert torch.equal(got[i]["input_ids"], expected[i]["input_ids"])
        assert torch.equal(got[i]["pixel_values"], expected[i]["pixel_values"])


def test_planning_reads_a_header_and_the_cache_saves_the_second_fetch(server):
    """A ranged server: planning asks for 64 KiB; an image smaller than that is then whole and cached, so processing
    fetches nothing more (1 request); without a cache, 2. A server that ignores `Range` sends all: cached the same."""
    from hf_packing.preprocess.preprocessor import Preprocessor

    processor = load_processor("qwen2_5_vl")
    files = write_images(server.root)
    for cache, kind, expected in [(64 << 20, "ranged", 1), (0, "ranged", 2), (64 << 20, "plain", 1)]:
        pre = Preprocessor(processor, media_cache_bytes=cache)
        url = f"{server.url}/{kind}/{files[0].name}"
        server.hits.clear()
        pre.process(row(0, image=url), 0)
        assert server.hits[f"/{kind}/{files[0].name}"] == expected, (cache, kind)
    # a header past the prefix: the prefix, then the whole image (cached for processing)
    pre = Preprocessor(processor)
    url = f"{server.url}/ranged/{files[2].name}"
    server.hits.clear()
    meta = pre.estimate(row(2, image=url), 2)
    assert server.hits[f"/ranged/{files[2].name}"] == 2 and meta.num_images == 1
    pre.process(row(2, image=url), 2)
    assert server.hits[f"/ranged/{files[2].name}"] == 2


@pytest.mark.timeout(120)
def test_failed_fetches_are_counted_skips_naming_the_url(server):
    """A 404 (not retried), a refused connection (retried up to media_tries), a body over media_max_bytes and a bad
    data URI are skips with their own reason and a message naming the URL, never media_root; the good rows train."""
    from hf_packing.preprocess.errors import SampleError
    from hf_packing.preprocess.preprocessor import Preprocessor

    processor = load_processor("qwen2_5_vl")
    files = write_images(server.root)
    missing, refused = f"{server.url}/plain/nothing.jpg", refused_url()
    big = f"{server.url}/plain/{files[2].name}"
    bad_uri = "data:image/png;base64,not*base64!"
    pre = Preprocessor(processor, media_tries=2, media_max_bytes=50_000, media_timeout=5.0)
    cases = [(missing, "fetch_failed", "HTTP 404"), (refused, "fetch_failed", "refused")]
    cases += [(big, "fetch_failed", "media_max_bytes=50,000"), (bad_uri, "bad_data_uri", "base64")]
    for url, reason, why in cases:
        with pytest.raises(SampleError) as err:
            pre.process(row(0, image=url), 0)
        message = str(err.value)
        assert err.value.reason == reason and why in message, message
        assert (url if reason == "fetch_failed" else "data:image/png;base64,") in message, message
        assert "media_root" not in message
    assert server.hits["/plain/nothing.jpg"] == 1  # a 404 is not retried
    assert server.hits[f"/plain/{files[2].name}"] == 2  # nor a body over the limit: its header, then one try

    good = f"{server.url}/plain/{files[0].name}"
    rows = [row(0, image=good), row(0, image=missing), row(0, image=refused), row(0, image=good)]
    samples, stats = pack(rows, processor, max_skipped_fraction=1.0, media_tries=2)
    assert stats["skipped"] == {"fetch_failed": 2} and sorted(samples) == [0, 3]


def test_a_failure_that_passes_is_retried_up_to_media_tries(server):
    """HTTP 503 then 200: two tries succeed where one fails (the control)."""
    from hf_packing.preprocess.errors import SampleError
    from hf_packing.preprocess.preprocessor import Preprocessor

    processor = load_processor("qwen2_5_vl")
    files = write_images(server.root)
    url = f"{server.url}/flaky/{files[0].name}"
    with pytest.raises(SampleError, match=r"after 1 try: HTTP 503"):
        Preprocessor(processor, media_tries=1).estimate(row(0, image=url), 0)
    server.hits.clear()
    assert Preprocessor(processor, media_tries=2).estimate(row(0, image=url), 0).num_images == 1
    assert server.hits[f"/flaky/{files[0].name}"] == 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["slow", "trickle"])
def test_a_slow_server_is_cut_at_the_timeout(server, kind):
    """A server that answers after 5 s, or sends one byte per 0.1 s, is a `fetch_failed` skip under media_timeout=0.5
    (all tries together): the call returns, the row is counted, the message names the URL and the setting."""
    from hf_packing.preprocess.errors import SampleError
    from hf_packing.preprocess.preprocessor import Preprocessor

    processor = load_processor("qwen2_5_vl")
    files = write_images(server.root)
    url = f"{server.url}/{kind}/{files[1].name}"
    pre = Preprocessor(processor, media_timeout=0.5, media_tries=3)
    with pytest.raises(SampleError, match="timed out after media_timeout=0.5 s") as err:
        pre.process(row(1, image=url), 1)
    assert err.value.reason == "fetch_failed" and url in str(err.value)
    rows = [row(1, image=url), row(0, image=str(files[0])), row(1, image=url)]
    samples, stats = pack(rows, processor, media_timeout=0.5, max_skipped_fraction=1.0)
    assert stats["skipped"] == {"fetch_failed": 2} and sorted(samples) == [1]


def test_a_video_url_part_equals_its_local_file(server):
    """OpenAI-style `video_url` parts and `videos` URLs read the same frames as the local file."""
    pytest.importorskip("av")
    from tests.helpers import write_clip

    processor = load_processor("qwen2_5_vl")
    clip = write_clip(server.root / "clip.mp4", frames=8)

    def video_row(**media) -> dict:
        parts = media.pop("content", [{"type": "video"}])
        return {
            "messages": [
                {"role": "user", "content": [*parts, {"type": "text", "text": "What happens?"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "Noise moves."}]},
            ],
            **media,
        }

    url = f"{server.url}/ranged/clip.mp4"
    rows = [
        video_row(videos=[str(clip)]),
        video_row(videos=[url]),
        video_row(content=[{"type": "video_url", "video_url": {"url": url}}]),
    ]
    from hf_packing.preprocess.preprocessor import Preprocessor

    pre = Preprocessor(processor, videos_kwargs={"fps": 2.0})
    want, *got = (pre.process(r, k) for k, r in enumerate(rows))
    for sample in got:
        assert torch.equal(sample["input_ids"], want["input_ids"])
        assert torch.equal(sample["pixel_values_videos"], want["pixel_values_videos"])


def test_local_paths_and_pil_images_read_nothing_remote(tmp_path, monkeypatch):
    """Local references never reach urllib (a path that looks like a URL after `Path()` is still a path)."""
    import urllib.request

    from hf_packing.preprocess.fetch import is_remote
    from hf_packing.preprocess.images import ImageLoader

    def no_network(*args, **kwargs):
        raise AssertionError("a local reference was fetched")

    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    path = tmp_path / "a.png"
    image(56, 56).save(path)
    loader = ImageLoader()
    assert loader.size(str(path)) == loader.size(path) == loader.size(Image.open(path)) == (56, 56)
    assert loader.size({"bytes": path.read_bytes(), "path": "http://example.invalid/a.png"}) == (56, 56)
    assert not is_remote(Path("https://example.invalid/a.png")) and is_remote("HTTPS://example.invalid/a.png")
    buf = io.BytesIO()
    image(28, 56).save(buf, "PNG")
    assert loader.size(f"data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}") == (56, 28)


def test_the_length_index_is_rebuilt_under_other_media_bounds():
    """A URL that failed while indexing is stored as a skip: the index key follows media_timeout / media_tries /
    media_max_bytes (so other bounds index again), not the cache size (which changes no outcome)."""
    from datasets import Dataset

    from hf_packing.packing.length_index import index_key
    from hf_packing.preprocess.preprocessor import Preprocessor

    processor = load_processor("qwen2_5_vl")
    ds = Dataset.from_list([row(0, image="http://127.0.0.1:9/a.png")])
    key = index_key(ds, Preprocessor(processor))
    assert index_key(ds, Preprocessor(processor, media_cache_bytes=0)) == key
    for bounds in ({"media_timeout": 30.0}, {"media_tries": 1}, {"media_max_bytes": 10}):
        assert index_key(ds, Preprocessor(processor, **bounds)) != key, bounds
