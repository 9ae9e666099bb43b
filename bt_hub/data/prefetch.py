"""Prepare the next batches while the device trains on this one: decoding and views in a background thread
with a CUDA stream of its own, as NVIDIA's data prefetchers do, overlapping the training step.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

_END = object()


class Prefetcher:
    """``prepare(item)`` for each item, in order, with up to ``depth`` results made ahead in a thread (own CUDA stream).

    ``depth`` 0 runs in the calling thread; an error is raised by ``next`` at its item; :meth:`close` stops it.
    """

    def __init__(
        self, items: Iterable[Any], prepare: Callable[[Any], Any], device: torch.device, depth: int = 2
    ) -> None:
        self._items, self._prepare, self._device = items, prepare, torch.device(device)
        self._inline: Iterator[Any] | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        if depth <= 0:
            self._inline = map(prepare, items)
            return
        if self._device.type == "cuda" and self._device.index is None:
            self._device = torch.device("cuda", torch.cuda.current_device())  # the thread starts on device 0 otherwise
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stream = torch.cuda.Stream(self._device) if self._device.type == "cuda" else None
        self._thread = threading.Thread(target=self._work, name="bt_hub-prefetch", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        try:
            if self._stream is not None:
                torch.cuda.set_device(self._device)  # the current device is per thread
            with torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
                for item in self._items:
                    if self._stop.is_set():
                        return
                    out = self._prepare(item)
                    event = self._stream.record_event() if self._stream is not None else None  # a new Event, recorded
                    self._put((out, event, None))
            self._put(_END)
        except BaseException as err:  # handed to the consumer, raised there
            self._put((None, None, err))

    def _put(self, value: Any) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(queue.Full):
                self._queue.put(value, timeout=0.1)
                return

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> Any:
        if self._inline is not None:
            return next(self._inline)
        if self._stop.is_set():
            raise StopIteration
        value = self._queue.get()
        if value is _END:
            self._stop.set()
            raise StopIteration
        out, event, err = value
        if err is not None:
            self.close()
            raise err
        if event is not None:
            stream = torch.cuda.current_stream(self._device)
            stream.wait_event(event)
            for tensor in [out] if isinstance(out, torch.Tensor) else out:
                if isinstance(tensor, torch.Tensor):
                    tensor.record_stream(stream)
        return out

    def close(self) -> None:
        """Stop the thread: it finishes the item in hand and prepares no more."""
        self._stop.set()
        if self._thread is None:
            return
        with contextlib.suppress(queue.Empty):
            while True:
                self._queue.get_nowait()
        self._thread.join()

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
