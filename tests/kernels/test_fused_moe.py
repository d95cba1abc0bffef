"""The MoE MLP: routing and the expert combine against transformers' own Qwen3-MoE and Mixtral blocks,
the reference against a per-token loop, and the Triton kernel and the CPU path against the reference."""

import pytest
import torch
import torch.nn.functional as F

from kernels import ops
from kernels.fused_moe import (
    align_pairs_to_blocks,
    fused_moe_cpu,
    fused_moe_ref,
    fused_moe_triton,
    moe_config,
    select_experts,
)
from tests.kernels.cases import require_triton

# dtype -> (atol, rtol) against the fp32 reference: 16-bit paths round the GEMMs' inputs and h (T*k, I)
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}

# (T, D, I, E, k): one token; E not a power of two; k = 1 and k = E; D and I off the 16/32/64 tiles;
# experts that get no token (5 tokens, 8 experts, k = 1); enough pairs per expert for BLOCK_M 32 and 64
SHAPES = [(1, 40, 24, 5, 2), (19, 72, 40, 6, 3), (33, 64, 48, 7, 7), (5, 16, 16, 8, 1), (40, 100, 70, 3, 2),
          (70, 24, 20, 2, 2)]


def make_moe(num_tokens, hidden, inter, num_experts, top_k, dtype, seed=0):
    """Random x, w13, w2 (scaled so outputs stay near 1) and a softmax routing, renormalized."""
    gen = torch.Generator().manual_seed(seed + 1000 * num_tokens + hidden)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    topk_weights, topk_ids = select_experts(torch.randn(num_tokens, num_experts, generator=gen), top_k, True)
    return x, w13, w2, topk_weights, topk_ids


def naive_moe(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """One token and one routed expert at a time, in float64."""
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e, v = int(topk_ids[t, j]), x[t].double()
            gate, up = w13[e, :inter].double() @ v, w13[e, inter:].double() @ v
            out[t] += float(topk_weights[t, j]) * (w2[e].double() @ (gate / (1 + torch.exp(-gate)) * up))
    return out


def assert_close(actual, expected, dtype):
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_reference_matches_a_per_token_loop(shape):
    inputs = make_moe(*shape, torch.float32)
    out = fused_moe_ref(*inputs)
    assert out.dtype == torch.float32 and out.shape == inputs[0].shape
    assert_close(out, naive_moe(*inputs), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_cpu_path_matches_reference(shape, dtype):
    inputs = make_moe(*shape, dtype)
    out = fused_moe_cpu(*inputs)
    assert out.dtype == dtype
    assert_close(out, fused_moe_ref(*inputs), dtype)


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_triton_matches_reference(shape, dtype):
    require_triton()
    inputs = make_moe(*shape, dtype)
    out = fused_moe_triton(*inputs)
    assert out.dtype == dtype and out.shape == inputs[0].shape
    assert_close(out, fused_moe_ref(*inputs), dtype)


@pytest.mark.parametrize("block_m", [16, 32])
def test_triton_with_several_blocks_per_expert_and_idle_experts(block_m):
    """Two of five experts take every token (the rest get none), in several blocks each with a
    ragged last one; int64 ids as a caller may pass them."""
    require_triton()
    x, w13, w2, _, _ = make_moe(37, 48, 40, 5, 2, torch.float32)
    topk_ids = torch.tensor([[3, 0] if t % 3 else [0, 3] for t in range(37)])
    topk_weights = torch.rand(37, 2, generator=torch.Generator().manual_seed(1))
    config = {**moe_config(74, 5, torch.float32), "BLOCK_M": block_m, "BLOCK_N": 32, "BLOCK_K": 16}
    out = fused_moe_triton(x, w13, w2, topk_weights, topk_ids, config=config)
    assert_close(out, naive_moe(x, w13, w2, topk_weights, topk_ids), torch.float32)


def test_no_tokens_give_an_empty_output():
    x, w13, w2, topk_weights, topk_ids = make_moe(0, 24, 16, 4, 2, torch.float32)
    implementations = [fused_moe_ref, fused_moe_cpu, fused_moe_triton]
    for fused_moe in implementations:
        assert fused_moe(x, w13, w2, topk_weights, topk_ids).shape == (0, 24)


@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k", "block_m"),
                         [(1, 5, 2, 16), (9, 4, 4, 16), (50, 3, 1, 16), (30, 7, 3, 32)])
def test_blocks_hold_each_pair_once_and_one_expert_each(num_tokens, num_experts, top_k, block_m):
    gen = torch.Generator().manual_seed(num_tokens)
    topk_ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    blocks = align_pairs_to_blocks(topk_ids.to(torch.int32), num_experts, block_m)
    num_pairs, used = num_tokens * top_k, int(blocks.num_padded)
    counts = torch.bincount(topk_ids.flatten(), minlength=num_experts)
    assert used == int(((counts + block_m - 1) // block_m * block_m).sum())
    pairs = blocks.sorted_pairs[:used]
    assert sorted(pairs[pairs < num_pairs].tolist()) == list(range(num_pairs))
    assert (blocks.sorted_pairs[used:] == num_pairs).all()
    for b, expert in enumerate(blocks.block_experts[:used // block_m].tolist()):
        block = pairs[b * block_m:(b + 1) * block_m]
        real = block[block < num_pairs]
        assert real.numel() and (topk_ids.flatten()[real.long()] == expert).all()
        assert real.tolist() == sorted(real.tolist())  # pair order within an expert


def test_select_experts_weights():
    logits = torch.tensor([[2.0, 1.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    weights, ids = select_experts(logits, 2, renormalize=False)
    probs = torch.softmax(logits, dim=-1)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert ids.tolist() == torch.topk(probs, 2).indices.tolist()  # ties as torch.topk breaks them
    torch.testing.assert_close(weights, probs.gather(1, ids.long()))
    renormalized, same_ids = select_experts(logits.bfloat16(), 2, renormalize=True)
    assert torch.equal(same_ids, ids) and renormalized.dtype == torch.float32
    torch.testing.assert_close(renormalized.sum(-1), torch.ones(2))


def test_select_experts_refuses_bad_arguments():
    with pytest.raises(ValueError, match=r"top_k must be in 1..4"):
        select_experts(torch.randn(2, 4), 5, True)
    with pytest.raises(ValueError, match=r"top_k must be in 1..4"):
        select_experts(torch.randn(2, 4), 0, True)
    with pytest.raises(ValueError, match=r"router_logits must be \(T, E\)"):
        select_experts(torch.randn(4), 1, True)


def _qwen3_moe(norm_topk_prob):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(hidden_size=40, moe_intermediate_size=24, num_experts=6, num_experts_per_tok=3,
                            norm_topk_prob=norm_topk_prob)
    return Qwen3MoeSparseMoeBlock(config), config.num_experts_per_tok, norm_topk_prob


def _mixtral():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(hidden_size=40, intermediate_size=24, num_local_experts=5, num_experts_per_tok=2)
    return MixtralSparseMoeBlock(config), config.num_experts_per_tok, True


@pytest.mark.parametrize("make_block", [lambda: _qwen3_moe(True), lambda: _qwen3_moe(False), _mixtral],
                         ids=["qwen3_moe_norm_topk", "qwen3_moe", "mixtral"])
def test_routing_and_combine_equal_transformers(make_block):
    """In fp32 the routing and the CPU path give transformers' bits; the reference and the Triton
    kernel agree within fp32 rounding."""
    block, top_k, renormalize = make_block()
    block.experts.config._experts_implementation = "eager"
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) / param.shape[-1] ** 0.5)
        x = torch.randn(1, 23, 40, generator=gen)
        want = block(x)[0]
        _, want_weights, want_ids = block.gate(x[0])
    weights, ids = select_experts(F.linear(x[0], block.gate.weight), top_k, renormalize)
    assert torch.equal(ids.long(), want_ids) and torch.equal(weights, want_weights)
    experts = (x[0], block.experts.gate_up_proj.data, block.experts.down_proj.data, weights, ids)
    assert torch.equal(fused_moe_cpu(*experts), want)
    assert_close(fused_moe_ref(*experts), want, torch.float32)
    require_triton()
    assert_close(fused_moe_triton(*experts), want, torch.float32)


@pytest.mark.parametrize("fused_moe", [fused_moe_ref, fused_moe_cpu, fused_moe_triton],
                         ids=["torch", "cpu", "triton"])
def test_inputs_that_do_not_fit_are_refused(fused_moe):
    x, w13, w2, topk_weights, topk_ids = make_moe(3, 16, 8, 4, 2, torch.float32)
    with pytest.raises(ValueError, match=r"w13 must be a contiguous \(E, 2I, 16\)"):
        fused_moe(x, w13[:, :, :8], w2, topk_weights, topk_ids)
    with pytest.raises(ValueError, match=r"w2 must be a contiguous \(4, 16, 8\)"):
        fused_moe(x, w13, w2.transpose(1, 2), topk_weights, topk_ids)
    with pytest.raises(ValueError, match="must share a dtype"):
        fused_moe(x, w13.half(), w2, topk_weights, topk_ids)
    with pytest.raises(ValueError, match=r"must be \(3, k\) with k >= 1"):
        fused_moe(x, w13, w2, topk_weights[:2], topk_ids[:2])
    with pytest.raises(ValueError, match="int32 or int64"):
        fused_moe(x, w13, w2, topk_weights, topk_ids.float())
    too_big = torch.where(topk_ids == topk_ids[0, 0], 4, topk_ids)
    error = RuntimeError if fused_moe is fused_moe_triton else ValueError  # the GPU path reads no ids back
    with pytest.raises(error, match=r"out of bounds|must be in 0..3"):
        fused_moe(x, w13, w2, topk_weights, too_big)


@pytest.mark.parametrize("backend", ["torch", "cpu-native", "triton"])
def test_ops_dispatches_to_each_backend(backend, monkeypatch):
    if backend == "triton":
        require_triton()
    inputs = make_moe(4, 16, 8, 3, 2, torch.float32)
    calls = []
    monkeypatch.setitem(ops.KERNELS["fused_moe"], backend, lambda *args: calls.append(args) or args[0])
    ops.set_backend(backend)
    try:
        ops.fused_moe(*inputs)
    finally:
        ops.set_backend(None)
    assert len(calls) == 1 and calls[0][0] is inputs[0]
    assert ops.select_experts is select_experts
