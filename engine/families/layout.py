"""Which checkpoint tensor fills which part of which model parameter, and the shape it must have.

engine/model.py fuses projections (q/k/v into one qkv_proj, gate/up into one gate_up_proj, each MoE
layer's experts into two (E, ...) tensors); checkpoints store them in pieces, under names that differ
by family. A family's `TensorNames` says its names; `checkpoint_layout` turns them and the model's
args into `Piece`s, the one description both the loader (copying each piece into place) and the
checks of a checkpoint (every tensor present, with the shape the config implies) read. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.model_args import ModelArgs


@dataclass(frozen=True)
class Piece:
    """One checkpoint tensor and where it goes: rows [row, row + shape[0]) of parameter `target`
    (of expert `expert` of it, for an MoE layer's stacked experts)."""

    source: str  # the tensor's name in the checkpoint (Hugging Face names)
    target: str  # the engine model's parameter name
    shape: tuple[int, ...]  # the tensor's shape, as the config implies it
    row: int = 0  # first row of the target it fills (fused projections: pieces stacked by rows)
    expert: int | None = None  # index into the target's leading experts dim


@dataclass(frozen=True)
class TensorNames:
    """A family's checkpoint names within `model.layers.{i}.` (without `.weight` / `.bias`). A fused
    entry of one name holds the pieces' rows back to back, as the engine's parameter does."""

    qkv: tuple[str, ...] = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    o: str = "self_attn.o_proj"
    gate_up: tuple[str, ...] = ("mlp.gate_proj", "mlp.up_proj")
    down: str = "mlp.down_proj"
    q_norm: str = "self_attn.q_norm"
    k_norm: str = "self_attn.k_norm"
    input_norm: str = "input_layernorm"  # before attention
    pre_mlp_norm: str = "post_attention_layernorm"  # before the MLP (Llama's name for it)
    attn_output_norm: str = ""  # on the attention's output, before the residual add (Gemma 3)
    mlp_output_norm: str = ""  # on the MLP's output, before the residual add (Gemma 3)
    router: str = "mlp.gate"  # MoE: (E, dim) router
    expert: str = "mlp.experts.{e}"  # MoE: one expert's prefix
    expert_gate_up: tuple[str, str] = ("gate_proj", "up_proj")
    expert_down: str = "down_proj"


def checkpoint_layout(args: ModelArgs, names: TensorNames) -> list[Piece]:
    """Every tensor a checkpoint with these args holds (a tied lm_head's copy aside), and its place."""
    pieces = [Piece("model.embed_tokens.weight", "embed_tokens.weight", (args.vocab_size, args.dim)),
              Piece("model.norm.weight", "norm", (args.dim,))]
    if not args.tie_word_embeddings:
        pieces.append(Piece("lm_head.weight", "lm_head.weight", (args.vocab_size, args.dim)))
    for layer in range(args.n_layers):
        pieces += _attention(args, names, layer) + _norms(args, names, layer)
        pieces += _experts(args, names, layer) if args.is_moe(layer) else _mlp(args, names, layer)
    return pieces


def _stacked(target: str, sources: list[tuple[str, tuple[int, ...]]], expert: int | None = None
             ) -> list[Piece]:
    """Pieces whose rows follow one another in `target`."""
    out, row = [], 0
    for source, shape in sources:
        out.append(Piece(source, target, shape, row, expert))
        row += shape[0]
    return out


def _fused(prefix: str, target: str, parts: tuple[str, ...], rows: list[int], cols: tuple[int, ...],
           suffix: str) -> list[Piece]:
    """A fused parameter from its parts' tensors, or from one tensor holding them all."""
    if len(parts) == 1:
        return [Piece(f"{prefix}{parts[0]}.{suffix}", target, (sum(rows), *cols))]
    parts_rows = zip(parts, rows, strict=True)
    return _stacked(target, [(f"{prefix}{part}.{suffix}", (n, *cols)) for part, n in parts_rows])


def _attention(args: ModelArgs, names: TensorNames, layer: int) -> list[Piece]:
    p, t = f"model.layers.{layer}.", f"layers.{layer}.self_attn."
    q, kv, dim = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim, args.dim
    pieces = _fused(p, t + "qkv_proj.weight", names.qkv, [q, kv, kv], (dim,), "weight")
    pieces.append(Piece(f"{p}{names.o}.weight", t + "o_proj.weight", (dim, q)))
    if args.qkv_bias:
        pieces += _fused(p, t + "qkv_bias", names.qkv, [q, kv, kv], (), "bias")
    if args.o_bias:
        pieces.append(Piece(f"{p}{names.o}.bias", t + "o_bias", (dim,)))
    if args.qk_norm:
        pieces += [Piece(f"{p}{names.q_norm}.weight", t + "q_norm", (args.head_dim,)),
                   Piece(f"{p}{names.k_norm}.weight", t + "k_norm", (args.head_dim,))]
    return pieces


def _norms(args: ModelArgs, names: TensorNames, layer: int) -> list[Piece]:
    p, t = f"model.layers.{layer}.", f"layers.{layer}."
    own = {"input_layernorm": names.input_norm, "post_attention_layernorm": names.pre_mlp_norm}
    if args.sandwich_norms:
        own.update(attn_output_norm=names.attn_output_norm, mlp_output_norm=names.mlp_output_norm)
    return [Piece(f"{p}{source}.weight", t + target, (args.dim,)) for target, source in own.items()]


def _mlp(args: ModelArgs, names: TensorNames, layer: int) -> list[Piece]:
    p, t = f"model.layers.{layer}.", f"layers.{layer}.mlp."
    inter, dim = args.intermediate_size, args.dim
    pieces = _fused(p, t + "gate_up_proj.weight", names.gate_up, [inter, inter], (dim,), "weight")
    pieces.append(Piece(f"{p}{names.down}.weight", t + "down_proj.weight", (dim, inter)))
    if args.mlp_bias:
        pieces += _fused(p, t + "gate_up_bias", names.gate_up, [inter, inter], (), "bias")
        pieces.append(Piece(f"{p}{names.down}.bias", t + "down_bias", (dim,)))
    return pieces


def _experts(args: ModelArgs, names: TensorNames, layer: int) -> list[Piece]:
    p, t = f"model.layers.{layer}.", f"layers.{layer}.mlp."
    inter, dim = args.moe_intermediate_size, args.dim
    pieces = [Piece(f"{p}{names.router}.weight", t + "router.weight", (args.num_experts, dim))]
    gate, up = names.expert_gate_up
    for e in range(args.num_experts):
        expert = p + names.expert.format(e=e) + "."
        pieces += _stacked(t + "w13", [(f"{expert}{gate}.weight", (inter, dim)),
                                       (f"{expert}{up}.weight", (inter, dim))], expert=e)
        pieces.append(Piece(f"{expert}{names.expert_down}.weight", t + "w2", (dim, inter), 0, e))
    return pieces
