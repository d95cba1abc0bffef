"""The projections' GEMM: the torch reference (`F.linear`) and the cpu-native ones over weights packed
once: batchgen's own kernel (kernels/csrc/gemm.c, AVX-512 or AVX2) over panels of 64 output
columns, or oneDNN over its blocked layout where that kernel has no code.

Stock `F.linear` on a CPU build of torch runs fp32 through MKL, which on non-Intel x86 (this
project's AMD EPYC machines) takes its AVX2 code: about 200 GFLOP/s on 2 cores, where oneDNN's
AVX-512 kernels reach about 470 with packed weights. At a decode step's row counts (8 to 128) the
panel kernel beats oneDNN in turn (bf16 64 x 576 x 960: ~360 against ~290 GF/s with the weights in
cache, ~330 against ~210 streaming them from DRAM as a model's layers do; 1.1-1.9x at 1-8 rows,
where oneDNN's ~15 us a call weighs most; level from 512 rows up; a bf16 decode step of 64
sequences 74.6 against 88.6 ms); `batchgen bench gemm` prints all three paths for the model's
shapes. The panel kernel takes fp32 with AVX-512 or AVX2 and FMA, bf16 with AVX512-BF16 or AVX2
(widened to fp32 in registers), N a multiple of 64 (bf16: K even); oneDNN the rest of fp32 and bf16
where it packs that dtype. On a CPU with AMX
(Xeon Sapphire Rapids and later) bf16 panels run on its tiles where K is a multiple of 32 (2
Xeon cores: 1.5 against oneDNN's 1.2 TF/s at 64 x 576 x 960, 2.1 against 2.0 at 128 x 576 x 3072,
where vdpbf16ps gave ~0.2; 30 layers' projections streamed from DRAM at 64 rows 20.6 against 22.0
ms); where this build cannot use them, bf16 stays with oneDNN, which can. KernelOptions(amx=False)
(kernels/options.py) keeps the vdpbf16ps kernel.

Panels have two layouts: rows of 64 columns a k (a pair of k in bf16) for the AVX-512 and AMX tiles,
and strips of 16 columns, each contiguous over K, for the AVX2 ones (a strip's pass reads its weights
in order; on a Zen 3 a decode step's fp32 projections took 0.70x the time of the rows). pack_panels
packs for the library loaded, and a product refuses panels of the other layout (`panels_fit`)
instead of reading them wrong.

At a prefill's row counts (4096 and more) a plain product goes through torch.mm on the panels
unpacked for the call where that is faster on the CPU (`unpack_rows`: bf16 on AMX, fp32 on Intel;
`prefill_unpack=False` keeps the panels). `argmax_panels` gives a greedy step its tokens
straight from the lm_head's panels, each thread folding the product of its own panels into its
picks a chunk at a time (in its L2), so the (rows, vocab) logits are never written
(`fused_argmax=False` turns it off).

Packing is in place: `pack_linears` swaps each `nn.Linear`'s weight for its packed tensor and frees
the plain one, so no second copy stays in memory; `unpack_linears` turns them back. `linear` reads
which form a weight is in. `panel_gemm=False` keeps oneDNN where the panels would apply (to
compare), `onednn=False` turns all packing off, and anything neither takes stays plain.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_features, cpu_native, options

PANEL = 64  # output columns a panel (GEMM_NR in csrc/kernels.h)
PACK_BATCH_HINT = 128  # oneDNN picks its blocking for this many rows; measured good from M=8 to 2048
PACKED_DTYPES = (torch.float32, torch.bfloat16)
EPI_SILU, EPI_F32_OUT = 1, 2  # the panel kernel's epilogues (GEMM_SILU, GEMM_F32_OUT in csrc/kernels.h)
# A prefill's plain products (no SiLU, residual or fp32 logits) from this many rows go through torch.mm
# on the panels unpacked for the call, where unpack_rows() says that is faster on this CPU.
# KernelOptions(prefill_unpack=False) keeps the panels at every row count.
UNPACK_ROWS = 4096


def enabled() -> bool:
    return options.current().onednn


def available() -> bool:
    """Whether this torch build has oneDNN's packed linear ops."""
    mkldnn = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight")
            and hasattr(mkldnn, "_linear_pointwise"))


# oneDNN packs bf16 weights only on CPUs with these (its own check, `mkldnn_reorder_linear_weight`)
BF16_PACK_FLAGS = (frozenset({"avx512bw", "avx512vl", "avx512dq"}), frozenset({"avx_ne_convert"}))
# ... and only where the ISA cap a user may set for oneDNN (e.g. ONEDNN_MAX_CPU_ISA=AVX2 on an AVX-512
# CPU, to compare with the AVX2 kernels) leaves them: its values below AVX-512 and the flags they keep
ONEDNN_ISA_ENV = "ONEDNN_MAX_CPU_ISA"
_BELOW_AVX512 = {"SSE41": frozenset(), "AVX": frozenset(), "AVX2": frozenset(), "AVX2_VNNI": frozenset(),
                 "AVX2_VNNI_2": frozenset({"avx_ne_convert"})}


def packs_dtype(dtype: torch.dtype, flags: frozenset[str] | None = None) -> bool:
    """Whether oneDNN packs weights of dtype on this CPU (bf16 needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT,
    and no $ONEDNN_MAX_CPU_ISA below them)."""
    if dtype not in PACKED_DTYPES:
        return False
    if dtype == torch.bfloat16:
        flags = cpu_features.cpu_flags() if flags is None else flags
        cap = os.environ.get(ONEDNN_ISA_ENV, "").strip().upper()
        if cap in _BELOW_AVX512:
            flags = flags & _BELOW_AVX512[cap]
        return any(need <= flags for need in BF16_PACK_FLAGS)
    return True


def panels_apply(weight: torch.Tensor) -> bool:
    """Whether the panel kernel takes this (N, K) weight: a library variant whose GEMM has code for
    its dtype (fp32: AVX2 or AVX-512; bf16: AVX2, AVX512-BF16 or AMX), N a multiple of PANEL, an
    even K in bf16, and panel_gemm on (kernels/options.py)."""
    if not options.current().panel_gemm or not cpu_native.enabled():
        return False
    if weight.dim() != 2 or weight.device.type != "cpu" or weight.shape[0] % PANEL or weight.shape[0] == 0:
        return False
    need = {torch.float32: cpu_native.FEATURE_GEMM_F32,
            torch.bfloat16: cpu_native.FEATURE_GEMM_BF16}.get(weight.dtype)
    if need is None or (weight.dtype == torch.bfloat16 and weight.shape[1] % 2):
        return False
    if not cpu_native.features() & need:
        return False
    if weight.dtype == torch.bfloat16 and not amx_in_use() and "amx_bf16" in cpu_features.cpu_flags():
        # oneDNN runs AMX tiles (~2 TF/s on 2 cores) where this build's panels would not (~0.2)
        return not options.current().amx  # vdpbf16ps asked for, to compare
    return True


def amx_in_use() -> bool:
    """Whether the bf16 panel kernel runs on AMX tiles (cpu_native.amx)."""
    return cpu_native.amx()


STRIP = 16  # columns a strip of a panel in the AVX2 layout (a pair of ymm of fp32 accumulators)


def strips() -> bool:
    """Whether the loaded library reads panels as strips of 16 columns, each contiguous over K: its
    AVX2 tiles, which make a pass over K for each 16 columns (csrc/gemm.c). The AVX-512 and AMX
    tiles read rows of 64 columns a k (a pair of k in bf16)."""
    return bool(cpu_native.features() & cpu_native.FEATURE_AVX2)


# dims of panels in rows of 64 and in strips, by dtype (a bf16 pair of k is the last dim)
_ROWS_DIMS = {torch.float32: 3, torch.bfloat16: 4}


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """weight (N, K) -> the panel kernel's layout: rows of 64, fp32 (N/64, K, 64) and bf16 (N/64,
    K/2, 64, 2), or where the loaded library reads strips (strips()), fp32 (N/64, 4, K, 16) and bf16
    (N/64, 4, K/2, 16, 2)."""
    n, k = weight.shape
    w = weight.detach()
    if weight.dtype == torch.bfloat16:
        if strips():
            return w.reshape(n // PANEL, PANEL // STRIP, STRIP, k // 2, 2).permute(0, 1, 3, 2, 4).contiguous()
        return w.reshape(n // PANEL, PANEL, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    if strips():
        return w.reshape(n // PANEL, PANEL // STRIP, STRIP, k).transpose(2, 3).contiguous()
    return w.reshape(n // PANEL, PANEL, k).permute(0, 2, 1).contiguous()


def in_strips(panels: torch.Tensor) -> bool:
    """Whether panels (pack_panels') are in strips rather than rows of 64."""
    return panels.dim() > _ROWS_DIMS.get(panels.dtype, panels.dim())


def unpack_panels(panels: torch.Tensor) -> torch.Tensor:
    """pack_panels' inverse: (N, K)."""
    p, k = panels.shape[0], panel_k(panels)
    if panels.dtype == torch.bfloat16:
        order = (0, 1, 3, 2, 4) if in_strips(panels) else (0, 2, 1, 3)
    else:
        order = (0, 1, 3, 2) if in_strips(panels) else (0, 2, 1)
    return panels.permute(*order).reshape(p * PANEL, k)


def panel_k(panels: torch.Tensor) -> int:
    """K of a weight packed by pack_panels / pack_gate_up (bf16 panels hold pairs of k)."""
    k = panels.shape[2] if in_strips(panels) else panels.shape[1]
    return 2 * k if panels.dtype == torch.bfloat16 else k


def panels_fit(panels: torch.Tensor) -> bool:
    """Whether the loaded library reads panels of this layout: ones packed in strips where it reads
    rows of 64 (or the other way round: cpu_native.use() changed the variant after packing) do not,
    and would give wrong products."""
    return in_strips(panels) == strips()


def _check_fit(panels: torch.Tensor, who: str) -> None:
    if not panels_fit(panels):
        have = "strips" if in_strips(panels) else "rows of 64"
        want = "strips" if strips() else "rows of 64"
        raise ValueError(f"{who}: {panels.dtype} panels packed as {have} {tuple(panels.shape)}, while the "
                         f"loaded {cpu_native.variant()} kernels read {want}: pack the weight again under "
                         "this variant")


GATE_UP = "batchgen_gate_up"  # an nn.Linear with this attribute true holds [gate | up] rows (2I, K)
# set by pack_linears on such a layer whose weight it packed as gate/up pairs (pack_gate_up); a [gate | up]
# weight the pairs do not fit (2I not a multiple of 2 * PANEL) is packed as plain panels and lacks it
PAIRED = "batchgen_gate_up_paired"


def pack_gate_up(weight: torch.Tensor) -> torch.Tensor:
    """[gate | up] (2I, K) -> panels whose 64 columns are 32 of gate and the same 32 of up, so that
    the kernel's epilogue computes silu(gate) * up from its accumulators (linear_panels(silu=True))."""
    n, k = weight.shape
    half = n // 2
    pairs = weight.detach().reshape(2, half // (PANEL // 2), PANEL // 2, k).transpose(0, 1)
    return pack_panels(pairs.reshape(n, k))


def unpack_gate_up(panels: torch.Tensor) -> torch.Tensor:
    """pack_gate_up's inverse: [gate | up] (2I, K)."""
    w = unpack_panels(panels)
    n, k = w.shape
    return w.reshape(n // PANEL, 2, PANEL // 2, k).transpose(0, 1).reshape(n, k)


def is_panels(weight: torch.Tensor) -> bool:
    return not weight.is_mkldnn and weight.dim() > 2


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """weight (N, K) fp32/bf16 on the CPU -> panels where the panel kernel applies, else oneDNN's
    packed tensor; None where packing does not apply."""
    if not enabled():
        return None
    return pack_panels(weight) if panels_apply(weight) else pack_onednn(weight)


def pack_onednn(weight: torch.Tensor) -> torch.Tensor | None:
    """weight (N, K) -> oneDNN's packed tensor, or None where oneDNN packs no such weight."""
    if not (weight.device.type == "cpu" and packs_dtype(weight.dtype) and available()):
        return None
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_BATCH_HINT)


def is_packed(weight: torch.Tensor) -> bool:
    return weight.is_mkldnn or weight.dim() > 2


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """A packed weight (either form) back to its plain (N, K) tensor."""
    return packed.to_dense() if packed.is_mkldnn else unpack_panels(packed)


def linear_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (T, K) @ weight.T -> (T, N): the reference, any device."""
    return F.linear(x, weight)


def linear_native(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x (T, K) @ weight.T -> (T, N) with the weight packed by pack(): the panel kernel or oneDNN."""
    if packed.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    return linear_panels(x, packed)


def unpack_rows(dtype: torch.dtype) -> int | None:
    """Rows from which a plain product over panels of dtype runs as torch.mm on the unpacked weight,
    or None where it never does. Measured on a 2-core AMX Xeon at 8192 rows (ms, panels against
    unpack + mm): bf16 576 -> 960 7.9 against 4.0, 1536 -> 576 7.6 / 6.9; fp32 35.4 / 30.7 and
    52.5 / 46.0; with the SiLU epilogue the panels won (bf16 16.2 / 18.9), so gate/up stays. oneDNN's
    AMX tiles run bf16's mm; MKL's AVX-512 code fp32's on Intel (on AMD it takes AVX2, slower than
    the panels). Unpacking costs 0.1-0.7 ms a weight, about what mm saves at 2048 rows."""
    if not options.current().prefill_unpack:
        return None
    if dtype == torch.bfloat16:
        return UNPACK_ROWS if amx_in_use() else None
    if dtype == torch.float32:
        return UNPACK_ROWS if cpu_features.cpu_vendor() == "GenuineIntel" else None
    return None


def linear_panels(x: torch.Tensor, panels: torch.Tensor, residual: torch.Tensor | None = None,
                  n: int | None = None, silu: bool = False,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x (T, K) @ W.T (+ residual (T, N)) -> (T, N) in x's dtype, W packed by pack_panels; `n` fewer
    columns than the panels hold (the kernel masks the last panel). x's rows may be strided. With
    silu, W packed by pack_gate_up: silu(x @ gate.T) * (x @ up.T), (T, I), in one pass. out_dtype
    float32 for bf16 x: the fp32 accumulators written as they are (the logits)."""
    t, k = x.shape
    n = panels.shape[0] * (PANEL // 2 if silu else PANEL) if n is None else n
    ksize = panel_k(panels)
    _check_fit(panels, "linear_panels")
    if k != ksize or x.dtype != panels.dtype or x.stride(-1) != 1:
        raise ValueError(f"linear_panels: x {tuple(x.shape)} {x.dtype} does not fit panels of K={ksize} "
                         f"{panels.dtype} (rows of x must be contiguous)")
    f32_out = out_dtype is not None and out_dtype != x.dtype
    if f32_out and (out_dtype != torch.float32 or silu or residual is not None):
        raise ValueError(f"linear_panels: out_dtype {out_dtype} for {x.dtype} x: only float32 from bf16, "
                         "without silu or a residual")
    out = torch.empty(t, n, dtype=out_dtype if f32_out else x.dtype)
    if residual is not None and (silu or residual.shape != out.shape or residual.dtype != x.dtype
                                 or residual.stride(-1) != 1):
        raise ValueError(f"linear_panels: residual {tuple(residual.shape)} {residual.dtype} is not "
                         f"({t}, {n}) {x.dtype} with contiguous rows")
    rows = None if silu or f32_out or residual is not None else unpack_rows(x.dtype)
    if rows is not None and t >= rows:
        torch.mm(x, unpack_panels(panels)[:n].t(), out=out)
        return out
    fn = cpu_native.kernel("gemm", x.dtype)
    epilogue = EPI_F32_OUT if f32_out else EPI_SILU if silu else 0
    rc = fn(x.data_ptr(), x.stride(0), t, k, panels.data_ptr(), n, out.data_ptr(), n,
            None if residual is None else residual.data_ptr(), 0 if residual is None else residual.stride(0),
            epilogue, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"the panel GEMM has no code for {x.dtype} on this CPU (declined, code {rc})")
    return out


_argmax_scratch = torch.empty(0)  # argmax_panels' chunks of products, kept (a fresh one faults its pages in)


def argmax_chunk_cols(rows: int) -> int:
    """Columns of the product a thread of argmax_panels makes and folds at a time for `rows` rows
    (csrc/gemm.c: about 256 KiB of fp32 products, at least one panel)."""
    return cpu_native.library().argmax_scratch_floats(rows) // rows


def argmax_panels(x: torch.Tensor, panels: torch.Tensor) -> torch.Tensor | None:
    """Each row's argmax of x (T, K) @ W.T, (T,) int64, W in panels (pack_panels), without the (T, N)
    product: each thread folds its chunks of argmax_chunk_cols columns into its picks while they are
    in its cache. The same picks as argmax(linear_f32(x, W)) (first maximum, first NaN). None where it
    does not apply: not panels, a panel GEMM this CPU has no code for, or fused_argmax off."""
    global _argmax_scratch
    if not options.current().fused_argmax or not is_panels(panels):
        return None
    t, k = x.shape
    ksize = panel_k(panels)
    _check_fit(panels, "argmax_panels")
    if k != ksize or x.dtype != panels.dtype or x.stride(-1) != 1 or t == 0:
        raise ValueError(f"argmax_panels: x {tuple(x.shape)} {x.dtype} does not fit panels of K={ksize} "
                         f"{panels.dtype} (rows of x must be contiguous)")
    need = torch.get_num_threads() * cpu_native.library().argmax_scratch_floats(t)
    if _argmax_scratch.numel() < need:
        _argmax_scratch = torch.empty(need, dtype=torch.float32)
    top, out = torch.empty(t, dtype=torch.float32), torch.empty(t, dtype=torch.int64)
    rc = cpu_native.kernel("gemm_argmax", x.dtype)(
        x.data_ptr(), x.stride(0), t, k, panels.data_ptr(), panels.shape[0] * PANEL,
        _argmax_scratch.data_ptr(), top.data_ptr(), out.data_ptr(), torch.get_num_threads())
    return None if rc else out


def linear_f32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T as float32 (the logits): a bf16 panel GEMM writes its fp32 accumulators directly
    (no bf16 rounding, no second pass over the output); any other form computes, then converts."""
    if x.dtype == torch.bfloat16 and is_panels(weight) and weight.dtype == torch.bfloat16:
        return linear_panels(x, weight, out_dtype=torch.float32)
    return linear(x, weight).float()


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T through whichever form the weight is in."""
    return linear_native(x, weight) if is_packed(weight) else linear_ref(x, weight)


def _bias_free_linears(module: nn.Module) -> list[nn.Linear]:
    return [m for m in module.modules() if isinstance(m, nn.Linear) and m.bias is None]


def pack_linears(module: nn.Module) -> bool:
    """Pack every bias-free nn.Linear weight under module in place; returns whether all are packed.
    A [gate | up] one (GATE_UP) gets gate/up panels where the panel kernel takes it."""
    done = True
    for m in _bias_free_linears(module):
        if is_packed(m.weight):
            continue
        pairs = getattr(m, GATE_UP, False) and m.weight.shape[0] % (2 * PANEL) == 0
        paired = enabled() and pairs and panels_apply(m.weight)
        packed = pack_gate_up(m.weight) if paired else pack(m.weight)
        if packed is None:
            done = False
            continue
        m.weight = nn.Parameter(packed, requires_grad=False)  # the plain tensor is freed here
        setattr(m, PAIRED, paired)
    return done


def unpack_linears(module: nn.Module) -> None:
    """Back to plain weights (to load new ones, or read them)."""
    for m in _bias_free_linears(module):
        if is_packed(m.weight):
            plain = unpack_gate_up(m.weight) if gate_up_panels(m) else unpack(m.weight)
            m.weight = nn.Parameter(plain.contiguous(), requires_grad=False)
            setattr(m, PAIRED, False)


def gate_up_panels(layer: nn.Linear) -> bool:
    """Whether layer's weight is packed as gate/up panels (linear_panels(silu=True) applies): not
    merely a [gate | up] layer in panels, which may hold them as plain panels."""
    return getattr(layer, GATE_UP, False) and getattr(layer, PAIRED, False) and is_panels(layer.weight)


def packing_summary(module: nn.Module) -> str:
    """Which GEMM each bias-free nn.Linear under module runs, counted: e.g. "panel GEMM 90 (SiLU
    fused into 30), oneDNN 1, plain 0", "(AMX tiles, SiLU ...)" where bf16 panels run on AMX (for
    the engine's log)."""
    layers = _bias_free_linears(module)
    panels = sum(is_panels(m.weight) for m in layers)
    fused = sum(gate_up_panels(m) for m in layers)
    onednn = sum(m.weight.is_mkldnn for m in layers)
    plain = len(layers) - panels - onednn
    bf16 = any(is_panels(m.weight) and m.weight.dtype == torch.bfloat16 for m in layers)
    tiles = "AMX tiles, " if bf16 and amx_in_use() else ""
    return f"panel GEMM {panels} ({tiles}SiLU fused into {fused}), oneDNN {onednn}, plain {plain}"
