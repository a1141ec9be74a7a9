"""The producer thread behind a [`~hf_packing.packing.dataset.PackedDataset`] iterator, and the registry that ends them
at exit.

Reading, planning and pixel work run in a background thread (one per iterator) feeding a queue of `prefetch` items,
so the consumer (the DataLoader worker or the training loop) only waits when the producer is behind. The thread's
exceptions re-raise in the consumer; it stops when the iterator is closed or garbage-collected, and at interpreter
exit ([`stop_producers`]).
"""

from __future__ import annotations

import atexit
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["produce", "stop_producers"]

#: live producer threads -> their stop events (every thread registers itself; `stop_producers` ends them at exit)
_PRODUCERS: dict[threading.Thread, threading.Event] = {}


@atexit.register
def stop_producers(timeout: float = 30.0) -> None:
    """Stops and joins every producer thread while the interpreter is still whole.

    Why at exit: an iterator kept alive to the end (a DataLoader iterator stored on an object, a generator in a
    reference cycle) leaves its daemon producer running, possibly inside torch or PIL C++ code with the GIL released.
    When the interpreter finalises, a daemon thread that reacquires the GIL is ended by `pthread_exit`, whose unwinding
    through a C++ ``noexcept`` frame aborts the whole process ("terminate called without an active exception",
    SIGABRT) after the work is done. atexit handlers run before that, while every thread can still return normally.
    """
    for stop in list(_PRODUCERS.values()):
        stop.set()
    for thread in list(_PRODUCERS):
        if thread.is_alive():
            thread.join(timeout)


def produce(
    work: Callable[[Callable[[Any], bool]], Any],
    stop: threading.Event,
    *,
    prefetch: int,
    name: str,
    in_worker: bool,
) -> Iterator[tuple[str, Any]]:
    """Runs `work(put)` in a daemon thread named `name` and yields `("item", x)` for each `put(x)`, then `("done",
    result)` with what `work` returned. `put` returns `False` once `stop` is set (the consumer went away); an exception
    in `work` re-raises here. Closing this generator sets `stop` and joins the thread."""
    items: queue.Queue = queue.Queue(maxsize=prefetch)

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                items.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def run() -> None:
        if not in_worker and "parallel backend: OpenMP" in torch.__config__.parallel_info():
            torch.set_num_threads(1)  # per thread under OpenMP: small image ops stay off training's cores
        try:
            put(("done", work(lambda item: put(("item", item)))))
        except BaseException as err:  # noqa: BLE001 - re-raised in the consumer
            put(("error", err))
        finally:
            _PRODUCERS.pop(threading.current_thread(), None)

    thread = threading.Thread(target=run, name=name, daemon=True)
    _PRODUCERS[thread] = stop
    thread.start()
    try:
        while True:
            try:
                kind, payload = items.get(timeout=1.0)
            except queue.Empty:
                if not thread.is_alive():
                    raise RuntimeError("the hf_packing producer thread ended without a result") from None
                continue
            if kind == "error":
                raise payload
            yield kind, payload
            if kind == "done":
                return
    finally:  # the iterator was exhausted, closed or garbage-collected: the thread ends with it
        stop.set()
        thread.join(timeout=30)
