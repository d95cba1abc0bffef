"""The correctness reference: Hugging Face `transformers` on the same weights, in float32.

`hf_greedy` runs `generate` greedily one prompt at a time (no padding, so no padding effects)
and returns each step's top logprobs; `hf_greedy_along` returns the same as far as a comparison
reads it, from one forward over a prompt and another generator's tokens. `check_logprobs_close`
compares two such result lists the way vLLM's tests do: outputs must agree token for token until
they first differ, and at that step each side's token must be among the other side's top
candidates (a near tie that float noise may break either way). After the first difference the
sequences are no longer comparable, so the comparison stops there.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

# One generated sequence: its token ids and, per step, {token_id: logprob} of the top candidates
TokensAndLogprobs = tuple[list[int], list[dict[int, float]]]


@lru_cache(maxsize=2)
def load_hf_model(model_dir: str, dtype: torch.dtype = torch.float32):
    """A LlamaForCausalLM from a Hugging Face directory in `dtype`, in eval mode (cached)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    return model.eval()


def hf_greedy(
    model_dir: str | Path,
    prompt_token_ids: list[list[int]],
    max_new_tokens: int,
    top_logprobs: int = 5,
) -> list[TokensAndLogprobs]:
    """Greedy `generate` per prompt: (output token ids, per-step top-`top_logprobs` logprobs).

    Logprobs are the log-softmax of the raw logits (`output_logits`), before any logits
    processor. Generation stops at an eos id of the model's generation_config.json, as the
    engine does unless a request sets ignore_eos.
    """
    model = load_hf_model(str(model_dir))
    results = []
    for ids in prompt_token_ids:
        if not ids:
            raise ValueError("hf_greedy: empty prompt")
        input_ids = torch.tensor([ids], dtype=torch.long)
        with torch.inference_mode():
            out = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                num_beams=1,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=_pad_id(model),
            )
        tokens = out.sequences[0, len(ids):].tolist()
        steps = [_top_logprobs(logits[0], top_logprobs) for logits in out.logits]
        results.append((tokens, steps[:len(tokens)]))
    return results


def hf_greedy_along(
    model_dir: str | Path,
    prompt_token_ids: list[int],
    token_ids: list[int],
    max_new_tokens: int,
    top_logprobs: int = 5,
) -> TokensAndLogprobs:
    """hf_greedy's answer for one prompt as far as check_logprobs_close reads it, from one forward over
    the prompt and another generator's greedy `token_ids` (teacher-forced) instead of a generate step
    per token.

    Up to the first step where transformers' argmax is not the given token, transformers' greedy
    sequence is the given one, so the forward's rows are the logits its generate would see; at that
    step transformers' own token ends the list (what follows it is never compared). Generation ends
    as generate's does: at an eos id of generation_config.json or after `max_new_tokens`, so a given
    sequence that stops early (no eos) gets transformers' next token, and lengths differ.
    """
    model = load_hf_model(str(model_dir))
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    start = len(prompt_token_ids) - 1
    with torch.inference_mode():
        logits = model(torch.tensor([prompt_token_ids + token_ids], dtype=torch.long)).logits[0, start:]
    tokens, steps = [], []
    for step, row in enumerate(logits[:max_new_tokens]):
        token = int(row.argmax())
        tokens.append(token)
        steps.append(_top_logprobs(row, top_logprobs))
        if token in eos or step >= len(token_ids) or token != token_ids[step]:
            break
    return tokens, steps


def hf_prompt_logprobs(model_dir: str | Path, token_ids: list[int]) -> torch.Tensor:
    """(T, V) log-softmax of one full forward over `token_ids`: row t predicts token t + 1."""
    return torch.log_softmax(hf_logits(model_dir, token_ids), dim=-1)


def hf_logits(model_dir: str | Path, token_ids: list[int], dtype: torch.dtype = torch.float32
              ) -> torch.Tensor:
    """(T, V) float32 logits of one full forward over `token_ids` in `dtype`: row t predicts token t + 1."""
    model = load_hf_model(str(model_dir), dtype)
    with torch.inference_mode():
        return model(torch.tensor([token_ids], dtype=torch.long)).logits[0].float()


def check_logprobs_close(
    outputs_0: list[TokensAndLogprobs],
    outputs_1: list[TokensAndLogprobs],
    name_0: str = "reference",
    name_1: str = "engine",
) -> None:
    """Assert two lists of greedy outputs agree, allowing a divergence only at a near tie."""
    assert len(outputs_0) == len(outputs_1), f"{name_0}: {len(outputs_0)} outputs, {name_1}: {len(outputs_1)}"
    for index, (out_0, out_1) in enumerate(zip(outputs_0, outputs_1, strict=True)):
        (ids_0, logprobs_0), (ids_1, logprobs_1) = out_0, out_1
        for step, (token_0, token_1) in enumerate(zip(ids_0, ids_1, strict=False)):
            if token_0 == token_1:
                continue
            where = f"prompt {index} step {step}: {name_0} chose {token_0}, {name_1} chose {token_1}"
            assert token_0 in logprobs_1[step], f"{where}; {token_0} not in {name_1}'s top {logprobs_1[step]}"
            assert token_1 in logprobs_0[step], f"{where}; {token_1} not in {name_0}'s top {logprobs_0[step]}"
            break
        else:
            shorter = min(len(ids_0), len(ids_1))
            assert len(ids_0) == len(ids_1), (
                f"prompt {index}: same first {shorter} tokens but {name_0} made {len(ids_0)} and "
                f"{name_1} {len(ids_1)} (one stopped early)"
            )


def _top_logprobs(logits: torch.Tensor, k: int) -> dict[int, float]:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    values, indices = logprobs.topk(k)
    return dict(zip(indices.tolist(), values.tolist(), strict=True))


def _pad_id(model) -> int | None:
    config = model.generation_config
    if config.pad_token_id is not None:
        return config.pad_token_id
    eos = config.eos_token_id
    return eos[0] if isinstance(eos, list) else eos
