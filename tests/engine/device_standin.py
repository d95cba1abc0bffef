"""A stand-in for a GPU on the CPU that makes every device -> host read visible.

On CUDA a read of a device value on the host (`.item()`, `bool(t)`, `.tolist()`, `.cpu()`,
`.numpy()`, printing a tensor, a copy into a host tensor, an op whose output size depends on the
values, such as boolean indexing) waits for every kernel queued before it: a host sync. On the CPU
the same calls cost nothing and go unseen (`.tolist()` and `.numpy()` of a CPU tensor do not even
reach torch's dispatcher). Here the engine runs on a pretend device instead: every tensor it makes
"on the device" is a `DeviceTensor`, a CPU tensor wrapped to say it lives on `FAKE_DEVICE`; every
torch call on one runs on the unwrapped CPU tensors and wraps the results again, and every way a
value can leave for the host is recorded in `HostReads`, with the line of batchgen that did it.

    with on_fake_device() as reads:
        ...build an engine whose model lives on FAKE_DEVICE (fake_device_model), step it...
    reads.events  # [("copy_ to host", "engine/staging.py:97"), ...]

What else a GPU would refuse is recorded too: a host tensor mixed into a device op ("host tensor in
a device op"), and a device tensor made from host data without the staging buffers ("blocking
upload": torch.tensor(..., device=cuda) copies from pageable memory and waits for the stream).
A Triton kernel launch is device work: its arguments reach the kernel unwrapped (the interpreter's
own copies are not reads); the launcher's Python around it is checked like the rest.
"""

from __future__ import annotations

import contextlib
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

FAKE_DEVICE = torch.device("meta")  # what the tensors claim; their data is a CPU tensor inside
CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[2]
T = torch.Tensor
# torch calls that hand a device value to the host
READS = {T.item, T.tolist, T.numpy, T.cpu, T.__bool__, T.__int__, T.__float__, T.__index__,
         T.__complex__, T.__array__, T.__repr__, T.__str__, T.__format__}
# what a tensor says about where it lives: answered by the wrapper, not by the CPU tensor inside
WHERE = {T.device.__get__, T.is_cuda.__get__, T.is_cpu.__get__, T.is_meta.__get__, T.get_device}
# aten ops whose output size (or value) the host must learn from the device
SYNCING_ATEN = {"_local_scalar_dense", "nonzero", "nonzero_static", "masked_select", "is_nonzero", "equal",
                "unique", "_unique", "_unique2", "unique_consecutive", "unique_dim"}
_active: list[HostReads] = []


class HostReads:
    """What was read from the device on the host while `on_fake_device()` was active."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []  # (what, where in batchgen)

    def record(self, what: str) -> None:
        self.events.append((what, _where()))

    def since(self, start: int) -> list[tuple[str, str]]:
        return self.events[start:]


def _where() -> str:
    """The innermost frame of batchgen's own code (engine/, kernels/) that led here."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = Path(frame.filename)
        if ROOT in path.parents and path.parts[len(ROOT.parts)] in ("engine", "kernels"):
            return f"{path.relative_to(ROOT)}:{frame.lineno}"
    return "outside batchgen"


def _record(what: str) -> None:
    for reads in _active:
        reads.record(what)


def _wrap(x):
    return DeviceTensor(x) if type(x) is torch.Tensor else x


def _unwrap(x):
    return x.elem if isinstance(x, DeviceTensor) else x


class DeviceTensor(torch.Tensor):
    """A CPU tensor that says it lives on FAKE_DEVICE: to the host, what a CUDA tensor is."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, strides=elem.stride(),
                                                   storage_offset=elem.storage_offset(), dtype=elem.dtype,
                                                   device=FAKE_DEVICE, requires_grad=False)

    def __init__(self, elem: torch.Tensor) -> None:
        self.elem = elem

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        """Reached only by calls that bypass torch functions (C++ internals): same rules."""
        name = func._schema.name.removeprefix("aten::")
        if name in SYNCING_ATEN or name == "_to_copy":
            _record(name)
        return tree_map(_wrap, func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs or {})))

    # reads that never reach torch functions for a CPU tensor, or that a subclass refuses
    def tolist(self):
        _record("tolist")
        return self.elem.tolist()

    def numpy(self, *args, **kwargs):
        _record("numpy")
        return self.elem.numpy(*args, **kwargs)

    def __array__(self, *args, **kwargs):
        _record("__array__")
        return self.elem.__array__(*args, **kwargs)

    def __repr__(self, *args, **kwargs):
        _record("__repr__ (print)")
        return repr(self.elem)

    def __format__(self, spec):
        _record("__format__ (print)")
        return self.elem.__format__(spec)


class _SyncingOps(TorchDispatchMode):
    """Records the aten ops under one device call that make the host wait for a value."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.removeprefix("aten::")
        indices = args[1] if name in ("index", "index_put", "index_put_") and len(args) > 1 else []
        masks = any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)
        if name in SYNCING_ATEN or masks:
            _record(f"{name} (needs a device value on the host)")
        return func(*args, **(kwargs or {}))


class _FakeDevice(TorchFunctionMode):
    """Runs every torch call on DeviceTensors on their CPU tensors, and records the reads."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_fake(kwargs.get("device")):  # a factory (or .to, .new_*) onto the device
            kwargs["device"] = CPU
            if func in (torch.tensor, torch.as_tensor, T.new_tensor):
                _record("blocking upload")
            with torch._C.DisableTorchFunction():
                return tree_map(_wrap, func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs)))
        if func in (T.to, T.cuda) and len(args) > 1 and _is_fake(args[1]):
            return self._to_device(args[0], args[2:], kwargs)
        if func in WHERE:
            with torch._C.DisableTorchFunction():
                return func(*args, **kwargs)
        leaves = tree_leaves((args, kwargs))
        if not any(isinstance(x, DeviceTensor) for x in leaves):
            return func(*args, **kwargs)
        return self._device_call(func, args, kwargs, leaves)

    @staticmethod
    def _to_device(src, rest, kwargs):
        with torch._C.DisableTorchFunction():
            if not isinstance(src, DeviceTensor):
                _record("blocking upload") if not kwargs.get("non_blocking") else None
                return DeviceTensor(src.to(*rest, **kwargs).clone())
            return DeviceTensor(src.elem.to(*rest, **kwargs)) if rest or kwargs else src

    @staticmethod
    def _device_call(func, args, kwargs, leaves):
        to_host = func in READS or (func is T.to and any(map(_is_cpu, (*args[1:], kwargs.get("device")))))
        into_host = func in (T.copy_,) and not isinstance(args[0], DeviceTensor)
        if to_host or into_host:
            _record(f"{getattr(func, '__name__', func)}{' to host' if into_host else ''}")
        elif func not in (T.copy_, T.__setitem__) and any(
                type(x) is torch.Tensor and x.dim() > 0 for x in leaves):
            _record(f"host tensor in a device op ({getattr(func, '__name__', func)})")
        with torch._C.DisableTorchFunction(), _SyncingOps():
            out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
        if to_host:
            return out
        if into_host:
            return args[0]
        return tree_map(_wrap, out)


def _is_fake(device) -> bool:
    return isinstance(device, str | torch.device) and torch.device(device) == FAKE_DEVICE


def _is_cpu(device) -> bool:
    return isinstance(device, str | torch.device) and torch.device(device).type == "cpu"


@contextlib.contextmanager
def on_fake_device() -> Iterator[HostReads]:
    """device=FAKE_DEVICE makes DeviceTensors; every device -> host read is recorded; Triton kernels
    get their arguments unwrapped (a launch is device work). Runs under inference mode, as the
    engine's steps do (views of wrapped tensors must be made in one mode)."""
    reads = HostReads()
    _active.append(reads)
    try:
        with torch.inference_mode(), _FakeDevice(), _kernels_take_plain_tensors():
            yield reads
    finally:
        _active.remove(reads)


@contextlib.contextmanager
def _kernels_take_plain_tensors() -> Iterator[None]:
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        yield
        return
    modules = [m for name, m in list(sys.modules.items()) if name.startswith("kernels.") and m is not None]
    saved = [(m, name, k) for m in modules for name, k in vars(m).items() if isinstance(k, JITFunction)]
    try:
        for module, name, kernel in saved:
            setattr(module, name, _Launcher(kernel))
        yield
    finally:
        for module, name, kernel in saved:
            setattr(module, name, kernel)


class _Launcher:
    """A @triton.jit kernel whose launches take the CPU tensors inside DeviceTensors."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            with torch._C.DisableTorchFunction():
                return launch(*[_unwrap(a) for a in args], **{k: _unwrap(v) for k, v in kwargs.items()})
        return run


def fake_device_model(args, weights: dict[str, torch.Tensor], config):
    """engine.llm_engine._build_model's stand-in: the model on FAKE_DEVICE (call inside on_fake_device)."""
    from engine.model import Transformer
    from engine.model_runner import DTYPES

    default = torch.get_default_dtype()
    torch.set_default_dtype(DTYPES[config.dtype])
    try:
        with FAKE_DEVICE:
            model = Transformer(args)
    finally:
        torch.set_default_dtype(default)
    model.load_hf_weights(weights)
    return model.eval()


def on_device(*tensors: torch.Tensor) -> bool:
    """Whether every tensor given is a DeviceTensor (that the stand-in took hold)."""
    return all(isinstance(t, DeviceTensor) for t in tree_leaves(tensors))
