"""Host -> device uploads that never make the host wait, and the one device -> host fetch per step.

Each named buffer is a persistent host array (pinned on CUDA, so a copy from it is truly
asynchronous) and a persistent device tensor of the same size. A step writes its values into the
host arrays through numpy and uploads each with `non_blocking=True`; the device tensors double as
the static inputs that CUDA graphs replay. On the CPU the two are one tensor and an upload is free.

A host array must not be rewritten while a copy from it may still be in flight. A step that ends
normally ends with `fetch()`, which waits for the stream, so by the next step every upload has
landed. A step that fails half-way (and is re-run, engine.llm_engine) never reaches its fetch:
`buffer()` then waits for the stream before handing out an array whose upload it has not seen
land (counted in `num_waits`, each a host sync like a fetch).
"""

from __future__ import annotations

import numpy as np
import torch


class Staging:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self.separate = device.type != "cpu"  # host and device tensors differ: uploads copy
        self._host: dict[str, torch.Tensor] = {}
        self._device: dict[str, torch.Tensor] = {}
        self._in_flight: set[str] = set()  # buffers uploaded since the stream was last waited for
        self.num_uploads = 0  # host -> device copies issued (asynchronous)
        self.num_fetches = 0  # device -> host copies, each a host sync
        self.num_waits = 0  # host syncs before rewriting a buffer whose upload may be in flight

    def buffer(self, name: str, size: int, dtype: torch.dtype) -> np.ndarray:
        """The host array of buffer `name`, (re)allocated to hold at least `size` elements; free to
        write (a copy from it still in flight is waited for first)."""
        if name in self._in_flight:
            self.wait()
        host = self._host.get(name)
        if host is None or host.numel() < size or host.dtype != dtype:
            size = max(size, 2 * host.numel() if host is not None else 0)
            host = torch.zeros(size, dtype=dtype, pin_memory=self.pinned)
            self._host[name] = host
            self._device[name] = (torch.zeros(size, dtype=dtype, device=self.device) if self.separate
                                  else host)
        return host.numpy()

    def wait(self) -> None:
        """Wait until every copy issued so far has landed (a host sync)."""
        self.num_waits += 1
        self._synchronize()

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self._in_flight.clear()

    def device_buffer(self, name: str) -> torch.Tensor:
        """The persistent device tensor of buffer `name` (a static input for CUDA graphs)."""
        return self._device[name]

    def upload(self, name: str, n: int) -> torch.Tensor:
        """The first n elements of buffer `name` on the device, copied without waiting."""
        dev = self._device[name]
        if self.separate and n:
            dev[:n].copy_(self._host[name][:n], non_blocking=True)
            self.num_uploads += 1
            self._in_flight.add(name)
        return dev[:n]

    def put(self, name: str, values, dtype: torch.dtype) -> torch.Tensor:
        """Write `values` (a sequence or array) into buffer `name` and upload them."""
        values = np.asarray(values)
        self.buffer(name, max(values.size, 1), dtype)[: values.size] = values.reshape(-1)
        return self.upload(name, values.size)

    def fetch(self, x: torch.Tensor) -> np.ndarray:
        """x on the host as a numpy array: the step's one device -> host copy, and its one sync."""
        self.num_fetches += 1
        if x.device.type == "cpu":
            return x.numpy()
        name = f"__fetch_{x.dtype}__"  # one buffer per dtype: steps alternate int64 and float64
        host = self.buffer(name, x.numel(), x.dtype)
        out = self._host[name][: x.numel()]
        out.copy_(x.reshape(-1), non_blocking=True)
        self._synchronize()
        return host[: x.numel()].reshape(x.shape)
