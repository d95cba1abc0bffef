"""A decode step's decoder layers in one native call (csrc/decode_layers.c).

engine/model.py's layers call kernels.ops once per op: nine calls a layer, each with its checks,
output allocations and ctypes' argument conversion. For a decode-only step on the CPU whose
projections are all panel GEMMs, this runs the same kernels with the same arguments in the same
order from C, into a reused workspace, so the results are bit-identical and the ~150 us of Python a
layer goes (at 64 sequences, 4.7 of a 45.6 ms bf16 step on a 2-core Xeon, while the second core only
waited). Anything else (prefill chunks, the torch or Triton backend, oneDNN or plain weights, a
kernel that declines or fails) takes the per-op path, which raises that op's own error.
KernelOptions(fused_decode=False) keeps every step on the per-op path (to compare, or to profile op by op).
"""

from __future__ import annotations

import ctypes
import logging
import weakref

import torch

from kernels import cpu_gemm, cpu_native, options

log = logging.getLogger(__name__)


class _Layer(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in
                ("qkv", "o", "gate_up", "down", "input_norm", "post_norm", "k_cache", "v_cache")]


_I64 = ("rows", "dim", "n_heads", "n_kv_heads", "head_dim", "qkv_n", "inter", "block_size", "num_slots",
        "max_len", "block_table_stride")
_PTRS = ("positions", "slots", "block_tables", "context_lens", "cos_sin", "x_in", "x", "res", "h", "qkv",
         "attn", "o", "g")


class _Step(ctypes.Structure):
    _fields_ = ([(name, ctypes.c_int64) for name in _I64]
                + [("eps", ctypes.c_float), ("scale", ctypes.c_float), ("num_threads", ctypes.c_int)]
                + [(name, ctypes.c_void_p) for name in _PTRS])


# csrc/decode_layers.c's DECODE_ERR_*
ERRORS = {1: "gemm", 2: "rotary", 3: "store_kv_cache", 4: "paged_attention"}


def enabled() -> bool:
    return options.current().fused_decode


def _fn(dtype: torch.dtype):
    lib = cpu_native.load()
    if lib is None or dtype not in cpu_native.SUFFIXES:
        return None
    fn = getattr(lib, f"decode_layers_{cpu_native.SUFFIXES[dtype]}")
    fn.restype, fn.argtypes = ctypes.c_int64, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    return fn


class DecodeLayers:
    """For one Transformer (engine/model.py): run(x, positions, kv_caches, meta) -> (x, residual) after
    its last layer, or None where the step is not one this path takes (the caller then runs the
    layers op by op). Rebuilt whenever a weight, a cache or the rotary table moved or changed shape."""

    def __init__(self, model) -> None:
        self._model = weakref.ref(model)  # the model holds this: no cycle
        self.key: list | None = None
        self.ok = False
        self.last_error = 0  # the C call's last status: 0, or (layer + 1) * 8 + DECODE_ERR_* (ERRORS)
        self.layers = None
        self.dtype: torch.dtype | None = None
        self.workspace: dict[str, torch.Tensor] = {}
        self.step = _Step()

    @property
    def model(self):
        return self._model()

    def _tensors(self, kv_caches) -> list[torch.Tensor]:
        out = []
        for layer, (k_cache, v_cache) in zip(self.model.layers, kv_caches, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            out += [attn.qkv_proj.weight, attn.o_proj.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight,
                    layer.input_layernorm, layer.post_attention_layernorm, k_cache, v_cache]
        out.append(self.model.cos_sin)
        return out

    def _build(self, tensors: list[torch.Tensor], pointers: list[int], dtype: torch.dtype) -> bool:
        """Whether every layer fits the fused path (the checks the per-op wrappers make once a call)."""
        args = self.model.args
        q_size, kv_size = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
        self.dtype, self.fn = dtype, _fn(dtype)
        if self.fn is None:
            return False
        layers = (_Layer * len(self.model.layers))()
        cache_shape = None
        for i, layer in enumerate(self.model.layers):
            qkv, o, gate_up, down, ln_in, ln_post, k_cache, v_cache = tensors[8 * i:8 * i + 8]
            mlp = layer.mlp
            if not all(cpu_gemm.is_panels(w) and w.dtype == dtype and cpu_gemm.panels_fit(w)
                       for w in (qkv, o, gate_up, down)):
                return False
            if not cpu_gemm.gate_up_panels(mlp.gate_up_proj):
                return False
            qkv_n = qkv.shape[0] * cpu_gemm.PANEL
            inter = gate_up.shape[0] * (cpu_gemm.PANEL // 2)
            ks = [cpu_gemm.panel_k(w) for w in (qkv, o, gate_up, down)]
            if (qkv_n != q_size + 2 * kv_size or o.shape[0] * cpu_gemm.PANEL != args.dim
                    or down.shape[0] * cpu_gemm.PANEL != args.dim
                    or ks != [args.dim, q_size, args.dim, inter]):
                return False
            for t in (ln_in, ln_post):
                if t.dtype != dtype or not t.is_contiguous() or t.numel() != args.dim:
                    return False
            shape = (args.n_kv_heads, args.head_dim)
            if (k_cache.dtype != dtype or v_cache.dtype != dtype or k_cache.shape != v_cache.shape
                    or tuple(k_cache.shape[2:]) != shape
                    or not (k_cache.is_contiguous() and v_cache.is_contiguous())
                    or (cache_shape is not None and k_cache.shape[:2] != cache_shape)):
                return False
            cache_shape = k_cache.shape[:2]
            layers[i] = _Layer(*pointers[8 * i:8 * i + 8])
        cos_sin = tensors[-1]
        if cos_sin.dtype != dtype or not cos_sin.is_contiguous() or cos_sin.shape[-1] != args.head_dim:
            return False
        s = self.step
        s.dim, s.n_heads, s.n_kv_heads, s.head_dim = args.dim, args.n_heads, args.n_kv_heads, args.head_dim
        s.qkv_n, s.inter = qkv_n, inter
        s.block_size, s.num_slots = cache_shape[1], cache_shape[0] * cache_shape[1]
        s.max_len, s.cos_sin = cos_sin.shape[0], pointers[-1]
        s.eps, s.scale = args.norm_eps, args.head_dim ** -0.5
        self.layers = layers
        self.workspace = {}
        return True

    def _buffers(self, rows: int) -> dict[str, torch.Tensor]:
        ws = self.workspace
        if not ws or ws["x"].shape[0] < rows:
            s, args = self.step, self.model.args
            widths = {"x": args.dim, "res": args.dim, "h": args.dim, "qkv": s.qkv_n,
                      "attn": args.n_heads * args.head_dim, "o": args.dim, "g": s.inter}
            ws = self.workspace = {name: torch.empty(rows, n, dtype=self.dtype) for name, n in widths.items()}
            for name, t in ws.items():
                setattr(s, name, t.data_ptr())
        return ws

    def run(self, x: torch.Tensor, positions: torch.Tensor, kv_caches, meta):
        rows = x.shape[0]
        if not self.model.args.plain_llama:  # written for Llama's layer: any other family runs op by op
            return None
        if (not enabled() or x.is_cuda or x.dim() != 2 or rows == 0 or meta.num_decodes != rows
                or len(meta.query_lens_cpu) != rows):
            return None
        tensors = self._tensors(kv_caches)
        try:  # where each tensor is and its shape (a weight's form shows in it: plain, panels)
            key = [(t.data_ptr(), t.shape) for t in tensors] + [cpu_native.variant()]  # use() switched it
        except RuntimeError:  # oneDNN's packed weights (panel_gemm off) have no data pointer
            return None
        if key != self.key or x.dtype != self.dtype:
            self.key = key
            self.ok = self._build(tensors, [p for p, _ in key[:-1]], x.dtype)
            if self.ok:
                log.info("CPU decode steps (%s): the %d layers in one native call (fused_decode=off: op "
                         "by op)", x.dtype, len(self.layers))
        if not self.ok or x.stride(1) != 1 or x.stride(0) != x.shape[1]:
            return None
        from kernels import ops  # the backend is read per call (KernelOptions.backend, ops.set_backend)

        if ops.get_backend(x) != "cpu-native" or not cpu_native.enabled():
            return None
        pos = positions.to(torch.int64).contiguous()
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        tables, lens = meta.block_tables[:rows], meta.context_lens[:rows]
        if (tables.dtype != torch.int32 or lens.dtype != torch.int32 or tables.stride(-1) != 1
                or not lens.is_contiguous() or pos.numel() != rows or slots.numel() != rows):
            return None
        ws = self._buffers(rows)
        s = self.step
        s.rows, s.num_threads = rows, torch.get_num_threads()
        s.positions, s.slots, s.x_in = pos.data_ptr(), slots.data_ptr(), x.data_ptr()
        s.block_tables, s.block_table_stride = tables.data_ptr(), tables.stride(0)
        s.context_lens = lens.data_ptr()
        self.last_error = self.fn(ctypes.addressof(s), ctypes.addressof(self.layers), len(self.layers))
        if self.last_error:
            log.debug("fused decode: layer %d's %s stopped; the step runs op by op", self.last_error // 8 - 1,
                      ERRORS.get(self.last_error % 8, self.last_error % 8))
            return None
        return ws["x"][:rows], ws["res"][:rows]
