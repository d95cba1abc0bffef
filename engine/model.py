"""The decoder every family runs, over a flattened variable-length batch and a paged KV cache.

Every step feeds T new tokens from S sequences as one flat batch: no padding, no per-sequence loop
outside attention. The layer is Llama's; a family's differences are named fields of `ModelArgs`
(engine/model_args.py) that switch small parts on: q/k/v and o biases, a per-head q/k RMSNorm, a
sliding window and its own rope base on some layers, Gemma's (1 + w) norms on the attention and MLP
outputs, scaled embeddings, a GELU-tanh gate, and mixture-of-experts MLPs. Projections are
bias-free `nn.Linear`s (so the CPU's packed GEMMs take them; biases are added after), q/k/v and
gate/up are fused into one GEMM each, and everything runs through `kernels.ops`, the one dispatch
(Triton on CUDA, the cpu-native kernels and packed GEMMs on the CPU, the torch references elsewhere).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

import torch
from torch import nn

from engine.families import layout
from engine.model_args import ModelArgs
from engine.rope import cos_sin_table
from kernels import cpu_gemm, ops
from kernels.decode_layers import DecodeLayers
from kernels.metadata import AttentionMetadata

__all__ = ["PRESETS", "ModelArgs", "Transformer"]

PRESETS = {
    "smollm2-135m": ModelArgs(),
    "tiny": ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, intermediate_size=256,
                      vocab_size=259, max_position_embeddings=2048),
}


def _norm_weight(n: int) -> nn.Parameter:
    return nn.Parameter(torch.ones(n))


def _optional(flag: bool, n: int) -> nn.Parameter | None:
    """A (n,) parameter where the family has it (a bias, a norm), else None."""
    return nn.Parameter(torch.zeros(n)) if flag else None


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.q_size = args.n_heads * args.head_dim
        self.kv_size = args.n_kv_heads * args.head_dim
        self.qkv_proj = nn.Linear(args.dim, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, args.dim, bias=False)
        self.qkv_bias = _optional(args.qkv_bias, self.q_size + 2 * self.kv_size)
        self.o_bias = _optional(args.o_bias, args.dim)
        self.q_norm = _optional(args.qk_norm, args.head_dim)  # over each head, before the rotary
        self.k_norm = _optional(args.qk_norm, args.head_dim)
        self.eps, self.unit_offset = args.norm_eps, args.norm_unit_offset
        self.scale = args.attn_scale or args.head_dim ** -0.5
        self.window = args.window(layer)  # None: every earlier key; else this many keys, itself included

    def forward(self, x, positions, cos_sin, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        qkv = ops.linear(x, self.qkv_proj)  # (T, (Hq + 2 Hkv) D)
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.n_heads, self.head_dim)  # (T, Hq, D)
        k = k.view(T, self.n_kv_heads, self.head_dim)  # (T, Hkv, D)
        v = v.view(T, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self._head_norm(q, self.q_norm), self._head_norm(k, self.k_norm)
        q, k = ops.rotary_embedding(positions, q, k, cos_sin)
        k_cache, v_cache = kv_cache
        ops.store_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        out = ops.paged_attention(q, k_cache, v_cache, meta, self.scale, self.window)  # (T, Hq, D)
        out = ops.linear(out.reshape(T, self.q_size), self.o_proj)  # (T, dim)
        return out if self.o_bias is None else out + self.o_bias

    def _head_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm over the head dim of (T, H, D)."""
        T, H, D = x.shape
        return ops.rms_norm(x.reshape(T * H, D), weight, self.eps, self.unit_offset).view(T, H, D)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(args.dim, 2 * args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.dim, bias=False)
        self.gate_up_bias = _optional(args.mlp_bias, 2 * args.intermediate_size)
        self.down_bias = _optional(args.mlp_bias, args.dim)
        self.activation = args.activation
        # packing may pair gate and up columns for the GEMM's SiLU epilogue: only where it applies
        self.fused_silu = args.activation == "silu" and not args.mlp_bias
        setattr(self.gate_up_proj, cpu_gemm.GATE_UP, self.fused_silu)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_silu:
            hidden = ops.linear_silu_and_mul(x, self.gate_up_proj)  # (T, dim) -> (T, 2I) -> (T, I)
        else:
            gate_up = ops.linear(x, self.gate_up_proj)  # (T, 2I)
            if self.gate_up_bias is not None:
                gate_up = gate_up + self.gate_up_bias
            act = ops.silu_and_mul if self.activation == "silu" else ops.gelu_tanh_and_mul
            hidden = act(gate_up)  # (T, I)
        out = ops.linear(hidden, self.down_proj)  # (T, dim)
        return out if self.down_bias is None else out + self.down_bias


class MoE(nn.Module):
    """A mixture-of-experts MLP: a router picks each token's top-k experts (softmax over all experts
    in fp32, renormalised over the k where the family does), each expert a SwiGLU MLP."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        experts, inter = args.num_experts, args.moe_intermediate_size
        self.router = nn.Linear(args.dim, experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(experts, 2 * inter, args.dim))  # [gate rows | up rows] each
        self.w2 = nn.Parameter(torch.empty(experts, args.dim, inter))
        self.top_k, self.renormalize = args.num_experts_per_tok, args.norm_topk_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = ops.linear(x, self.router)  # (T, E)
        weights, ids = ops.select_experts(logits, self.top_k, self.renormalize)  # (T, k) fp32, (T, k)
        return ops.fused_moe(x, self.w13, self.w2, weights, ids)  # (T, dim): the grouped expert GEMMs


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.eps, self.unit_offset = args.norm_eps, args.norm_unit_offset
        self.self_attn = Attention(args, layer)
        self.mlp = MoE(args) if args.is_moe(layer) else MLP(args)
        self.input_layernorm = _norm_weight(args.dim)  # before attention
        self.post_attention_layernorm = _norm_weight(args.dim)  # before the MLP (Llama's name)
        self.attn_output_norm = _optional(args.sandwich_norms, args.dim)  # Gemma 3: outputs normed
        self.mlp_output_norm = _optional(args.sandwich_norms, args.dim)  # before each residual add
        self.local_rope = args.local_rope(layer)  # its cos/sin table: the sliding layers' own

    def forward(self, x, residual, positions, cos_sin, kv_cache, meta):
        if residual is None:
            residual, x = x, self._norm(x, self.input_layernorm)
        else:
            x, residual = self._add_norm(x, residual, self.input_layernorm)
        x = self.self_attn(x, positions, cos_sin, kv_cache, meta)
        if self.attn_output_norm is not None:
            x = self._norm(x, self.attn_output_norm)
        x, residual = self._add_norm(x, residual, self.post_attention_layernorm)
        x = self.mlp(x)
        if self.mlp_output_norm is not None:
            x = self._norm(x, self.mlp_output_norm)
        return x, residual

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, weight, self.eps, self.unit_offset)

    def _add_norm(self, x, residual, weight) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.fused_add_rms_norm(x, residual, weight, self.eps, self.unit_offset)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.n_layers))
        self.norm = nn.Parameter(torch.ones(args.dim))
        self.lm_head = None if args.tie_word_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
        # derived in init_rope (after the weights reach their device): the global and the sliding
        # layers' cos/sin tables, and the embedding scale in the model dtype
        self.register_buffer("cos_sin", torch.empty(0), persistent=False)
        self.register_buffer("cos_sin_local", torch.empty(0), persistent=False)
        self.register_buffer("embed_scale", torch.empty(0), persistent=False)
        # a tied lm_head as a Linear over the embedding's tensor: packing swaps in a packed one
        # (the head's only copy of its own; the embedding keeps the plain rows for lookups)
        self.tied_head: nn.Linear | None = None
        self.decode_layers = DecodeLayers(self)  # not a module: holds pointers into this one's weights

    def pack_weights(self) -> bool:
        """Pack every projection's weight (and the lm_head's) in place for the CPU's packed GEMMs
        (batchgen's panel kernel, else oneDNN: kernels.ops.pack_linears); returns whether packing applied."""
        if self.lm_head is None and self.tied_head is None:
            self.tied_head = nn.Linear(self.args.dim, self.args.vocab_size, bias=False, device="meta")
            self.tied_head.weight = self.embed_tokens.weight  # shared until packed
        packed = ops.pack_linears(self)
        if not packed and self.tied_head is not None and not cpu_gemm.is_packed(self.tied_head.weight):
            self.tied_head = None  # nothing packed: the embedding serves as the head, as before
        return packed

    def init_rope(self, max_len: int) -> None:
        """The tables derived from the args in the weights' dtype and device: cos/sin of the global
        (and, where they differ, the sliding) layers' rotary embeddings, and the embedding scale."""
        w, args = self.embed_tokens.weight, self.args
        self.cos_sin = cos_sin_table(args.head_dim, max_len, args.rope_theta, args.rope_scaling, w.dtype,
                                     w.device)
        if args.local_rope_theta is not None:
            self.cos_sin_local = cos_sin_table(args.head_dim, max_len, args.local_rope_theta, None, w.dtype,
                                               w.device)
        if args.embed_scale is not None:  # rounded to the model dtype first, as transformers does
            self.embed_scale = torch.tensor(args.embed_scale, dtype=torch.float32).to(w.dtype).to(w.device)

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions (T,) -> final hidden states (T, dim)."""
        x = self.embed_tokens(input_ids)  # (T, dim)
        if self.args.embed_scale is not None:
            x = x * self.embed_scale
        fused = self.decode_layers.run(x, positions, kv_caches, meta)  # a CPU decode step: one native call
        if fused is not None:
            x, residual = fused
        else:
            residual = None
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                cos_sin = self.cos_sin_local if layer.local_rope else self.cos_sin
                x, residual = layer(x, residual, positions, cos_sin, kv_cache, meta)
        x, _ = ops.fused_add_rms_norm(x, residual, self.norm, self.args.norm_eps, self.args.norm_unit_offset)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(S, dim) -> (S, vocab) in float32."""
        head = self.lm_head or self.tied_head
        if head is not None:
            return ops.linear_logits(hidden, head)
        return nn.functional.linear(hidden, self.embed_tokens.weight).float()

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """(S, dim) -> (S,) int64, each row's argmax of its logits, where the head's weight is in the
        panel kernel's layout: the logits are never written out (kernels/cpu_gemm.argmax_panels).
        None elsewhere (then compute_logits and an argmax give the same picks)."""
        head = self.lm_head or self.tied_head
        if head is None or not cpu_gemm.is_panels(head.weight):
            return None
        return cpu_gemm.argmax_panels(hidden, head.weight)

    @torch.no_grad()
    def load_hf_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copy a checkpoint's tensors (Hugging Face names, any dtype, on any device) into place, one at
        a time: each is converted to the model's dtype on the model's device, and fused projections
        are filled piece by piece (engine.families.layout), so no copy of the model is ever made."""
        packed = self.tied_head is not None or any(
            cpu_gemm.is_packed(m.weight) for m in self.modules() if isinstance(m, nn.Linear))
        ops.unpack_linears(self)  # plain weights to copy into; packed again below
        self.tied_head = None
        params = dict(self.named_parameters())
        filled: Counter[str] = Counter()
        for piece in layout(self.args):
            if piece.source not in weights:
                raise ValueError(f"checkpoint has no tensor {piece.source!r}")
            tensor = weights[piece.source]
            if tuple(tensor.shape) != piece.shape:
                raise ValueError(f"weight {piece.source}: expected shape {piece.shape}, "
                                 f"got {tuple(tensor.shape)}")
            target = params[piece.target] if piece.expert is None else params[piece.target][piece.expert]
            target.narrow(0, piece.row, piece.shape[0]).copy_(tensor.to(target.device))
            filled[piece.target] += tensor.numel()
        missing = sorted(name for name, p in params.items() if filled[name] != p.numel())
        if missing:
            raise ValueError(f"checkpoint is missing weights for: {', '.join(missing[:6])}"
                             + (" ..." if len(missing) > 6 else ""))
        if packed:
            self.pack_weights()
