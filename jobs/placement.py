"""Where each worker's engine runs: data parallel on one host, one engine per GPU.

`batchgen run --workers N --device cuda` spreads the workers over the GPUs this process sees
(CUDA_VISIBLE_DEVICES applies): worker i gets cuda:(i mod count), so N = count puts one engine on
each GPU, and N > count puts several on some. An explicit `--device cuda:K` puts every worker on
GPU K. On the CPU (the default) every worker stays on cpu. A device that does not exist here is
refused before any worker starts, with the flag named; `batchgen worker --device cuda:K` checks
the same. The device each worker got is in its record (the workers view), its metrics' info labels
and the dashboard's workers page.
"""

from __future__ import annotations

from collections.abc import Callable

DEVICE_FLAG = "--device"


class PlacementError(ValueError):
    """A device the workers cannot be placed on (the message names the flag)."""


def visible_gpus() -> int:
    """CUDA devices this process can use (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_device(device: str, count: Callable[[], int] | None = None) -> None:
    """Refuse a CUDA device this host does not have: none at all, or an index past the last.
    `count` gives the visible GPUs (default: visible_gpus, looked up when called)."""
    if not device.startswith("cuda"):
        return
    have = (count or visible_gpus)()
    if have == 0:
        raise PlacementError(f"{DEVICE_FLAG} {device}: no CUDA device is visible on this host "
                             "(CUDA_VISIBLE_DEVICES, drivers); use --device cpu")
    index = device.partition(":")[2]
    if index and int(index) >= have:
        raise PlacementError(f"{DEVICE_FLAG} {device}: this host has {have} CUDA device(s), "
                             f"cuda:0 to cuda:{have - 1}")


def place_workers(device: str, num_workers: int, count: Callable[[], int] | None = None) -> list[str]:
    """The device of each of `num_workers` workers for `--device device`."""
    if num_workers < 1:
        raise PlacementError(f"--workers {num_workers}: at least one worker is needed")
    check_device(device, count)
    if device != "cuda":  # cpu, or one named GPU for all
        return [device] * num_workers
    have = (count or visible_gpus)()
    return [f"cuda:{i % have}" for i in range(num_workers)]
