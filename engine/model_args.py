"""The decoder's shapes and its named differences from a plain Llama, as plain data (no torch).

`ModelArgs` is what engine/model.py builds a model from; engine/families turns a config.json into
one. Every field past the shapes defaults to Llama's behaviour, so a plain Llama sets none of them
and a family says only where it differs (qkv biases, q/k norms, a sliding window, Gemma's norms,
experts...). `RopeScaling` is how a checkpoint rescales the rotary embedding's frequencies.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from functools import cached_property

FULL, SLIDING = "full_attention", "sliding_attention"  # layer types, as transformers names them
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
ACTIVATIONS = ("silu", "gelu_tanh")  # the MLP gate's activation


@dataclass(frozen=True)
class RopeScaling:
    """How the rotary embedding's inverse frequencies theta^(-2i/D) are rescaled (`type`), and a factor
    on cos and sin (yarn's attention factor). Fields past `type` belong to the types named beside them."""

    type: str = "default"  # one of ROPE_TYPES
    factor: float = 1.0  # linear, dynamic, yarn, llama3: how many times the pretraining context
    original_max_position_embeddings: int | None = None  # yarn, llama3: the pretraining context
    low_freq_factor: float = 1.0  # llama3: wavelengths past original / this are divided by factor
    high_freq_factor: float = 4.0  # llama3: wavelengths under original / this are kept
    beta_fast: float = 32.0  # yarn: rotations below which a dimension is extrapolated
    beta_slow: float = 1.0  # yarn: rotations above which a dimension is interpolated
    attention_factor: float | None = None  # yarn: the cos/sin factor; None: from factor and mscale
    mscale: float | None = None  # yarn: attention factor 0.1 * mscale * ln(factor) + 1 ...
    mscale_all_dim: float | None = None  # ... divided by the same with mscale_all_dim
    truncate: bool = True  # yarn: round the correction range to whole dimensions

    def __post_init__(self) -> None:
        if self.type not in ROPE_TYPES:
            raise ValueError(f"rope type must be one of {ROPE_TYPES}, got {self.type!r}")


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
    # ---- named differences from a plain Llama (the defaults are Llama's)
    rope_scaling: RopeScaling | None = None  # the rotary frequencies' rescaling (None: plain theta)
    qkv_bias: bool = False  # q/k/v projections have biases (Qwen2, Llama attention_bias)
    o_bias: bool = False  # the output projection has a bias (Llama attention_bias)
    mlp_bias: bool = False  # gate/up/down have biases (Llama mlp_bias)
    qk_norm: bool = False  # RMSNorm over each head of q and k before the rotary (Qwen3, Gemma 3)
    activation: str = "silu"  # the MLP gate's activation: silu (SwiGLU) or gelu_tanh (GeGLU)
    norm_unit_offset: bool = False  # every RMSNorm scales by (1 + w), in fp32 (Gemma)
    sandwich_norms: bool = False  # attention and MLP outputs are normed before the residual add (Gemma 3)
    embed_scale: float | None = None  # embeddings times this, in the model dtype (Gemma: sqrt(dim))
    attn_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    sliding_window: int | None = None  # a sliding layer's query sees this many keys (itself included)
    layer_types: tuple[str, ...] = ()  # FULL or SLIDING per layer; () = every layer FULL
    local_rope_theta: float | None = None  # sliding layers' rotary base, unscaled (Gemma 3); None: as full
    num_experts: int = 0  # MoE: experts per MoE layer (0: every MLP dense)
    num_experts_per_tok: int = 0  # MoE: experts each token is routed to (top-k)
    moe_intermediate_size: int = 0  # MoE: each expert's intermediate size
    norm_topk_prob: bool = True  # MoE: the top-k routing weights are renormalised to sum to 1
    dense_layers: tuple[int, ...] = ()  # MoE: layers whose MLP is dense (Qwen3-MoE mlp_only_layers)
    family: str = field(default="llama", compare=False)  # the family that read the config

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.layer_types and len(self.layer_types) != self.n_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.n_layers} layers")
        if SLIDING in self.layer_types and not self.sliding_window:
            raise ValueError("sliding layers need a sliding_window")

    def layer_type(self, layer: int) -> str:
        return self.layer_types[layer] if self.layer_types else FULL

    def window(self, layer: int) -> int | None:
        """Keys a query of this layer sees (None: all before it)."""
        return self.sliding_window if self.layer_type(layer) == SLIDING else None

    def local_rope(self, layer: int) -> bool:
        """Whether this layer's rotary embedding is the sliding layers' own (local_rope_theta, unscaled)."""
        return self.layer_type(layer) == SLIDING and self.local_rope_theta is not None

    def is_moe(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers

    @cached_property
    def plain_llama(self) -> bool:
        """Whether every layer is a plain Llama layer (rope scaling aside: it lives in the cos/sin
        table), which the CPU's one-call decode step (kernels/decode_layers.py) is written for."""
        plain = ModelArgs(dim=self.dim, n_layers=self.n_layers, n_heads=self.n_heads,
                          n_kv_heads=self.n_kv_heads)
        return all(getattr(self, name) == getattr(plain, name) for name in _DIFFERENCES
                   if name not in ("rope_scaling",))

    def flops_per_token(self, context_len: int = 0) -> float:
        """Forward FLOPs for one token: 2 x matmul parameters, plus attention over context_len keys."""
        qkv = self.dim * (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
        attn_out = self.n_heads * self.head_dim * self.dim
        mlp = 3 * self.dim * (self.moe_intermediate_size * self.num_experts_per_tok if self.num_experts
                              else self.intermediate_size)
        per_layer = 2 * (qkv + attn_out + mlp) + 4 * self.n_heads * self.head_dim * context_len
        return self.n_layers * per_layer + 2 * self.dim * self.vocab_size

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


_SHAPES = ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "intermediate_size", "vocab_size",
           "norm_eps", "rope_theta", "max_position_embeddings", "tie_word_embeddings")
_DIFFERENCES = tuple(f.name for f in fields(ModelArgs) if f.name not in _SHAPES and f.name != "family")
