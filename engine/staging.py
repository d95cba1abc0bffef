"""Host -> device uploads that never make the host wait, and the one device -> host fetch per step.

Each named buffer is a persistent host array (pinned on CUDA, so a copy from it is truly
asynchronous) and a persistent device tensor of the same size. A step writes its values into the
host arrays through numpy and uploads each with `non_blocking=True`; the device tensors double as
the static inputs that CUDA graphs replay. On the CPU the two are one tensor and an upload is free.

A host array must not be rewritten while a copy from it may still be in flight. Where host and
device differ, every buffer has two host arrays, used by alternate steps (a step is one
`fetch_start`): with asynchronous scheduling step N+1 writes its inputs while step N's uploads may
still be queued behind step N-1's work, and by then the fetch of step N-1 (which the stream ran
after everything step N-1 uploaded) has been waited for. A step that fails half-way (and is re-run,
engine.llm_engine) writes the same arrays again: `buffer()` then waits for the stream before
handing out an array whose upload it has not seen land (counted in `num_waits`, each a host sync).

The fetch is split in two so that the host can queue the next step between them: `fetch_start`
queues the copy of the step's tokens into a pinned host array (and records an event after it),
`fetch_wait` waits for that event only, not for work queued after it.
"""

from __future__ import annotations

import numpy as np
import torch


class _Fetch:
    """A device -> host copy queued by fetch_start: the host array it lands in, when it has landed."""

    __slots__ = ("host", "shape", "event", "epoch", "uploads")

    def __init__(self, host: np.ndarray, shape, event, epoch: int, uploads: int) -> None:
        self.host, self.shape, self.event, self.epoch, self.uploads = host, shape, event, epoch, uploads


class Staging:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self.separate = device.type != "cpu"  # host and device tensors differ: uploads copy
        self._host: dict[tuple[str, int], torch.Tensor] = {}  # (name, parity) -> host array
        self._device: dict[str, torch.Tensor] = {}
        self._uploaded_at: dict[tuple[str, int], int] = {}  # (name, parity) -> number of its last upload
        self._epoch = 0  # fetches started so far: the step whose inputs are being written
        self._landed = 0  # the uploads numbered up to this one have landed
        self.num_uploads = 0  # host -> device copies issued (asynchronous)
        self.num_fetches = 0  # device -> host copies, each waited for once (a host sync)
        self.num_waits = 0  # host syncs before rewriting a buffer whose upload may be in flight

    def _key(self, name: str) -> tuple[str, int]:
        return name, (self._epoch & 1 if self.separate else 0)

    def buffer(self, name: str, size: int, dtype: torch.dtype) -> np.ndarray:
        """The host array of buffer `name` for this step, (re)allocated to hold at least `size`
        elements; free to write (a copy from it still in flight is waited for first)."""
        key = self._key(name)
        if self._uploaded_at.get(key, 0) > self._landed:
            self.wait()
        host = self._host.get(key)
        if host is None or host.numel() < size or host.dtype != dtype:
            size = max(size, 2 * host.numel() if host is not None else 0)
            host = torch.zeros(size, dtype=dtype, pin_memory=self.pinned)
            self._host[key] = host
            dev = self._device.get(name)
            if not self.separate:
                self._device[name] = host
            elif dev is None or dev.numel() < size or dev.dtype != dtype:
                self._device[name] = torch.zeros(size, dtype=dtype, device=self.device)
        return host.numpy()

    def wait(self) -> None:
        """Wait until every copy issued so far has landed (a host sync)."""
        self.num_waits += 1
        self._synchronize()

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self._landed = self.num_uploads

    def device_buffer(self, name: str) -> torch.Tensor:
        """The persistent device tensor of buffer `name` (a static input for CUDA graphs)."""
        return self._device[name]

    def upload(self, name: str, n: int) -> torch.Tensor:
        """The first n elements of buffer `name` on the device, copied without waiting."""
        dev = self._device[name]
        if self.separate and n:
            key = self._key(name)
            dev[:n].copy_(self._host[key][:n], non_blocking=True)
            self.num_uploads += 1
            self._uploaded_at[key] = self.num_uploads
        return dev[:n]

    def put(self, name: str, values, dtype: torch.dtype) -> torch.Tensor:
        """Write `values` (a sequence or array) into buffer `name` and upload them."""
        values = np.asarray(values)
        self.buffer(name, max(values.size, 1), dtype)[: values.size] = values.reshape(-1)
        return self.upload(name, values.size)

    def fetch_start(self, x: torch.Tensor) -> _Fetch:
        """Queue the copy of x to the host, the step's one device -> host copy; this step's uploads
        are all issued. `fetch_wait` gives the array."""
        self.num_fetches += 1
        epoch, uploads = self._epoch, self.num_uploads  # the copy lands after every upload so far
        if x.device.type == "cpu":
            fetch = _Fetch(x.numpy().copy(), x.shape, None, epoch, uploads)  # x may be a static buffer
        else:
            name = f"__fetch_{x.dtype}__"  # one buffer per dtype: steps alternate int64 and float64
            host = self.buffer(name, x.numel(), x.dtype)
            self._host[self._key(name)][: x.numel()].copy_(x.reshape(-1), non_blocking=True)
            event = None
            if self.device.type == "cuda":
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(self.device))
            fetch = _Fetch(host[: x.numel()], x.shape, event, epoch, uploads)
        self._epoch += 1
        return fetch

    def fetch_wait(self, fetch: _Fetch) -> np.ndarray:
        """The fetched array, once its copy has landed (the wait is the step's host sync): it waits
        for the work queued before the copy only."""
        if fetch.event is not None:
            fetch.event.synchronize()
        self._landed = max(self._landed, fetch.uploads)
        return fetch.host.reshape(fetch.shape)

    def fetch(self, x: torch.Tensor) -> np.ndarray:
        """x on the host as a numpy array: fetch_start and fetch_wait at once."""
        return self.fetch_wait(self.fetch_start(x))
