"""Llama-architecture decoder over a flattened variable-length batch and a paged KV cache.

Every step feeds T new tokens from S sequences as one flat batch: no padding, no per-sequence loop
outside attention. Projections are plain bias-free `nn.Linear`s; they, attention, norms, RoPE and
the MLP activation all run through `kernels.ops`, the one dispatch (Triton on CUDA, the cpu-native
kernels and packed GEMMs on the CPU, the torch references elsewhere). q/k/v and gate/up projections
are fused into one GEMM each.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import nn

from kernels import cpu_gemm, ops
from kernels.decode_layers import DecodeLayers
from kernels.metadata import AttentionMetadata


@dataclass
class ModelArgs:
    dim: int = 576  # hidden size
    n_layers: int = 30
    n_heads: int = 9  # query heads
    n_kv_heads: int = 3  # key/value heads (GQA: n_heads is a multiple)
    head_dim: int = 64
    intermediate_size: int = 1536
    vocab_size: int = 49152
    norm_eps: float = 1e-5
    rope_theta: float = 100000.0
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True

    @classmethod
    def from_hf_config(cls, cfg: dict) -> ModelArgs:
        """Args from a Hugging Face LlamaConfig dict (config.json)."""
        scaling = cfg.get("rope_scaling")
        if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
            raise ValueError(f"config.json: rope_scaling {scaling!r} is not supported")
        try:
            n_heads = cfg["num_attention_heads"]
            return cls(
                dim=cfg["hidden_size"],
                n_layers=cfg["num_hidden_layers"],
                n_heads=n_heads,
                n_kv_heads=cfg.get("num_key_value_heads", n_heads),
                head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
                intermediate_size=cfg["intermediate_size"],
                vocab_size=cfg["vocab_size"],
                norm_eps=cfg.get("rms_norm_eps", 1e-5),
                rope_theta=cfg.get("rope_theta", 10000.0),
                max_position_embeddings=cfg.get("max_position_embeddings", 2048),
                tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            )
        except KeyError as exc:
            raise ValueError(f"config.json: missing key {exc.args[0]!r}") from None

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")

    def flops_per_token(self, context_len: int = 0) -> float:
        """Forward FLOPs for one token: 2 x matmul parameters, plus attention over context_len keys."""
        qkv = self.dim * (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
        attn_out = self.n_heads * self.head_dim * self.dim
        mlp = 3 * self.dim * self.intermediate_size
        per_layer = 2 * (qkv + attn_out + mlp) + 4 * self.n_heads * self.head_dim * context_len
        return self.n_layers * per_layer + 2 * self.dim * self.vocab_size

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


PRESETS = {
    "smollm2-135m": ModelArgs(),
    "tiny": ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, intermediate_size=256,
                      vocab_size=259, max_position_embeddings=2048),
}


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.q_size = args.n_heads * args.head_dim
        self.kv_size = args.n_kv_heads * args.head_dim
        self.qkv_proj = nn.Linear(args.dim, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, args.dim, bias=False)
        self.scale = args.head_dim ** -0.5

    def forward(self, x, positions, cos_sin, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = ops.linear(x, self.qkv_proj).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.n_heads, self.head_dim)  # (T, Hq, D)
        k = k.view(T, self.n_kv_heads, self.head_dim)  # (T, Hkv, D)
        v = v.view(T, self.n_kv_heads, self.head_dim)
        q, k = ops.rotary_embedding(positions, q, k, cos_sin)
        k_cache, v_cache = kv_cache
        ops.store_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        out = ops.paged_attention(q, k_cache, v_cache, meta, self.scale)  # (T, Hq, D)
        return ops.linear(out.reshape(T, self.q_size), self.o_proj)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(args.dim, 2 * args.intermediate_size, bias=False)
        setattr(self.gate_up_proj, cpu_gemm.GATE_UP, True)  # packing may pair gate and up columns
        self.down_proj = nn.Linear(args.intermediate_size, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = ops.linear_silu_and_mul(x, self.gate_up_proj)  # (T, dim) -> (T, 2I) -> (T, I)
        return ops.linear(hidden, self.down_proj)  # (T, dim)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.eps = args.norm_eps
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = nn.Parameter(torch.ones(args.dim))
        self.post_attention_layernorm = nn.Parameter(torch.ones(args.dim))

    def forward(self, x, residual, positions, cos_sin, kv_cache, meta):
        if residual is None:
            residual, x = x, ops.rms_norm(x, self.input_layernorm, self.eps)
        else:
            x, residual = ops.fused_add_rms_norm(x, residual, self.input_layernorm, self.eps)
        x = self.self_attn(x, positions, cos_sin, kv_cache, meta)
        x, residual = ops.fused_add_rms_norm(x, residual, self.post_attention_layernorm, self.eps)
        return self.mlp(x), residual


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.n_layers))
        self.norm = nn.Parameter(torch.ones(args.dim))
        self.lm_head = None if args.tie_word_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer("cos_sin", torch.empty(0), persistent=False)
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
        w = self.embed_tokens.weight
        self.cos_sin = ops.make_cos_sin_cache(self.args.head_dim, max_len, self.args.rope_theta,
                                              w.dtype, w.device)

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions (T,) -> final hidden states (T, dim)."""
        x = self.embed_tokens(input_ids)  # (T, dim)
        fused = self.decode_layers.run(x, positions, kv_caches, meta)  # a CPU decode step: one native call
        if fused is not None:
            x, residual = fused
        else:
            residual = None
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                x, residual = layer(x, residual, positions, self.cos_sin, kv_cache, meta)
        x, _ = ops.fused_add_rms_norm(x, residual, self.norm, self.args.norm_eps)
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
    def load_hf_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy Hugging Face Llama tensors in, fusing q/k/v and gate/up; every parameter must be set."""
        packed = self.tied_head is not None or any(
            cpu_gemm.is_packed(m.weight) for m in self.modules() if isinstance(m, nn.Linear))
        ops.unpack_linears(self)  # plain weights to copy into; packed again below
        self.tied_head = None
        params = dict(self.named_parameters())
        done: set[str] = set()

        def put(name: str, tensor: torch.Tensor) -> None:
            if params[name].shape != tensor.shape:
                raise ValueError(f"weight {name}: expected shape {tuple(params[name].shape)}, "
                                 f"got {tuple(tensor.shape)}")
            params[name].copy_(tensor)
            done.add(name)

        for target, tensor in _fused_hf_tensors(weights, self.args):
            put(target, tensor)
        missing = sorted(set(params) - done)
        if missing:
            raise ValueError(f"checkpoint is missing weights for: {', '.join(missing[:6])}"
                             + (" ..." if len(missing) > 6 else ""))
        if packed:
            self.pack_weights()


def _fused_hf_tensors(weights: dict[str, torch.Tensor], args: ModelArgs):
    """Yield (parameter name, tensor) pairs from HF names, concatenating the fused projections."""
    def get(name: str) -> torch.Tensor:
        if name not in weights:
            raise ValueError(f"checkpoint has no tensor {name!r}")
        return weights[name]

    yield "embed_tokens.weight", get("model.embed_tokens.weight")
    yield "norm", get("model.norm.weight")
    if not args.tie_word_embeddings:
        yield "lm_head.weight", get("lm_head.weight")
    for i in range(args.n_layers):
        p = f"model.layers.{i}."
        yield f"layers.{i}.self_attn.qkv_proj.weight", torch.cat(
            [get(p + f"self_attn.{x}_proj.weight") for x in "qkv"])
        yield f"layers.{i}.self_attn.o_proj.weight", get(p + "self_attn.o_proj.weight")
        yield f"layers.{i}.mlp.gate_up_proj.weight", torch.cat(
            [get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")])
        yield f"layers.{i}.mlp.down_proj.weight", get(p + "mlp.down_proj.weight")
        yield f"layers.{i}.input_layernorm", get(p + "input_layernorm.weight")
        yield f"layers.{i}.post_attention_layernorm", get(p + "post_attention_layernorm.weight")
