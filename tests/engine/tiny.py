"""A tiny randomly initialised Llama from transformers, as a checkpoint our engine loads directly."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

TINY_CONFIG = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=128, vocab_size=97, rms_norm_eps=1e-5, rope_theta=10000.0,
    max_position_embeddings=512, tie_word_embeddings=False, model_type="llama",
)


@dataclass
class TinyCheckpoint:
    config: dict
    weights: dict[str, torch.Tensor]
    tokenizer: object = None
    hf_model: object = field(default=None, repr=False)


def tiny_hf_checkpoint(seed: int = 0, **overrides) -> TinyCheckpoint:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(TINY_CONFIG, **overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).float().eval()
    # random init leaves norms at 1; perturb them so a wrong norm wiring shows up
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            else:
                p.mul_(20.0)  # sharper logits: fewer near-ties in greedy comparisons
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return TinyCheckpoint(cfg, weights, None, model)


def hf_greedy_ids(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        ids = torch.tensor([prompt])
        for _ in range(max_new_tokens):
            logits = model(ids).logits[0, -1]
            ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
    return ids[0, len(prompt):].tolist()
