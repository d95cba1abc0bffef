"""Tiny random checkpoints of every supported family, built and saved by transformers itself, and
transformers' own greedy generation on them: the reference the family tests compare with.

Each case is a transformers config class and its overrides: two layers (more where a family needs a
layer of each kind), head_dim 16 (the smallest the Triton kernels take), the 259 ids of the engine's
ByteTokenizer (bos 256, eos 257, pad 258). Weights are transformers' random init with the
projections scaled up (sharper logits: fewer near ties for float noise to break) and the norms
perturbed (a norm wired wrong shows).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.model_files import BYTE_TOKENIZER_CLASS

SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, intermediate_size=96, vocab_size=259, max_position_embeddings=512,
             rms_norm_eps=1e-5, bos_token_id=256, eos_token_id=257, pad_token_id=258,
             tie_word_embeddings=False)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32, "rope_theta": 10000.0}


@dataclass(frozen=True)
class Case:
    config_class: str  # transformers' config class
    model_class: str  # and its causal LM
    overrides: dict = field(default_factory=dict)
    legacy_rope: bool = False  # config.json in the spelling before transformers 5 (rope_scaling, rope_theta)
    embedding_scale: float = 20.0  # what the embedding is scaled by (the other projections: 20)


CASES = {
    "llama": Case("LlamaConfig", "LlamaForCausalLM"),
    "llama-llama3": Case("LlamaConfig", "LlamaForCausalLM", {"rope_parameters": LLAMA3}),
    "llama-llama3-legacy": Case("LlamaConfig", "LlamaForCausalLM", {"rope_parameters": LLAMA3},
                                legacy_rope=True),
    "llama-linear": Case("LlamaConfig", "LlamaForCausalLM", {
        "rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}}),
    "llama-dynamic": Case("LlamaConfig", "LlamaForCausalLM", {
        "rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}}),
    "llama-yarn": Case("LlamaConfig", "LlamaForCausalLM", {"rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "rope_theta": 10000.0}}),
    "llama-bias": Case("LlamaConfig", "LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True}),
    "qwen2": Case("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen2-window": Case("Qwen2Config", "Qwen2ForCausalLM",
                         {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}),
    "qwen3": Case("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
    "mistral-window": Case("MistralConfig", "MistralForCausalLM", {"sliding_window": 6}),
    "gemma3": Case("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"],
        "query_pre_attn_scalar": 24, "tie_word_embeddings": True,
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}},
        # the head is the embedding: scaled up, every token would predict itself again
        embedding_scale=1.0),
    "phi3": Case("Phi3Config", "Phi3ForCausalLM", {"sliding_window": 8}),
    "qwen3_moe": Case("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True,
        "mlp_only_layers": [1]}),
    "qwen3_moe-unnormed": Case("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": False}),
    "mixtral": Case("MixtralConfig", "MixtralForCausalLM",
                    {"num_local_experts": 4, "num_experts_per_tok": 2}),
}


def build_config(case: Case):
    import transformers

    return getattr(transformers, case.config_class)(**{**SMALL, **case.overrides})


def build_checkpoint(case: Case, directory: Path, dtype: torch.dtype = torch.float32, seed: int = 0) -> Path:
    """transformers builds the model with random weights, sharpened, and saves it (config.json +
    model.safetensors in `dtype`) with a ByteTokenizer marker; returns the directory."""
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, case.model_class)(build_config(case)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            else:  # sharper logits: fewer near ties in greedy comparisons
                p.mul_(case.embedding_scale if "embed_tokens" in name else 20.0)
    model.to(dtype).save_pretrained(directory)
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": BYTE_TOKENIZER_CLASS}))
    if case.legacy_rope:
        _legacy_rope_spelling(directory / "config.json")
    return directory


def _legacy_rope_spelling(path: Path) -> None:
    """rope_parameters -> rope_theta + rope_scaling (with "type"), as transformers < 5 wrote it."""
    config = json.loads(path.read_text())
    params = dict(config.pop("rope_parameters"))
    config["rope_theta"] = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    config["rope_scaling"] = params
    path.write_text(json.dumps(config, indent=2))


def hf_generate(directory: Path, prompts: list[list[int]], max_new_tokens: int, dtype: torch.dtype,
                top: int = 5) -> list[tuple[list[int], list[dict[int, float]]]]:
    """transformers' greedy generate per prompt (no padding) in `dtype`: the tokens and each step's
    top-`top` logprobs."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()
    results = []
    for ids in prompts:
        input_ids = torch.tensor([ids])
        with torch.inference_mode():
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                 max_new_tokens=max_new_tokens, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=258)
        tokens = out.sequences[0, len(ids):].tolist()
        steps = []
        for logits in out.logits[:len(tokens)]:
            values, indices = torch.log_softmax(logits[0].float(), -1).topk(top)
            steps.append(dict(zip(indices.tolist(), values.tolist(), strict=True)))
        results.append((tokens, steps))
    return results


# ---------------------------------------------------------------- the checkpoints as llama.cpp writes them

# GGUF architecture of each family llama.cpp converts (Mixtral is llama with experts)
GGUF_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe",
              "mixtral": "llama"}
# Hugging Face name within model.layers.N -> GGUF name within blk.N (llama.cpp's tensor names)
_GGUF_LAYER = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",
}
_GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
_GGUF_EXPERTS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
                 "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}


def write_gguf(hf_dir: Path, path: Path, extra: dict | None = None) -> Path:
    """A float32 GGUF file of a transformers checkpoint, written as llama.cpp's converter does (written
    here from llama.cpp's documented conventions, as the test oracle): `{arch}.*` metadata, blk.N
    tensor names, q/k rows interleaved for llama's rotary, each MoE layer's experts stacked (E, ...),
    and a byte-level BPE vocabulary of the ByteTokenizer's 259 ids; `extra` tensors are added as given."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    from tests.engine.conftest import llama_cpp_permute

    config = json.loads((hf_dir / "config.json").read_text())
    arch = GGUF_ARCHS[config["model_type"]]
    writer = gguf.GGUFWriter(str(path), arch)
    _gguf_metadata(writer, config)
    tensors = load_file(str(hf_dir / "model.safetensors"))
    experts: dict[str, dict[int, np.ndarray]] = {}
    for name, array in tensors.items():
        array = array.astype(np.float32)
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            writer.add_tensor(_GGUF_GLOBAL[name], array)
            continue
        layer, rest = name.removeprefix("model.layers.").split(".", 1)
        if ".experts." in rest:
            head, tail = rest.split(".experts.")
            expert, leaf = tail.split(".")[:2]
            experts.setdefault(f"blk.{layer}.{_GGUF_EXPERTS[leaf]}.weight", {})[int(expert)] = array
            continue
        module, kind = rest.rsplit(".", 1)
        if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = config["num_attention_heads"] if "q_proj" in module else config["num_key_value_heads"]
            array = llama_cpp_permute(array, heads)
        writer.add_tensor(f"blk.{layer}.{_GGUF_LAYER[module]}.{kind}", array)
    for name, per_expert in experts.items():
        writer.add_tensor(name, np.stack([per_expert[e] for e in sorted(per_expert)]))
    for name, array in (extra or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _gguf_metadata(writer, config: dict) -> None:
    from tokenizers import pre_tokenizers

    from tests.engine.conftest import write_shape_metadata

    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())  # 256 tokens: ids 0..255, then the specials
    write_shape_metadata(writer, config, config["rope_parameters"]["rope_theta"], config["vocab_size"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    experts = config.get("num_local_experts") or config.get("num_experts")
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        if config.get("moe_intermediate_size"):
            writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(byte_chars + ["<s>", "</s>", "<pad>"])
    writer.add_token_types([1] * 256 + [3, 3, 3])
    writer.add_token_merges([])
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(257)
    writer.add_pad_token_id(258)
