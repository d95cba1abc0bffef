"""Each family's real chat template (tests/engine/fixtures/chat_templates, sources in its SOURCES.md)
and end-of-turn tokens work through `--apply-chat-template auto`: the template renders exactly as
transformers renders it, a text prompt of a job becomes the family's user turn, and every token of
the family's generation_config.json eos list ends a generation.

Each family gets a small byte-level tokenizer holding its special tokens (ids are this test's, the
tokens are the family's) and, for the engine, a one-layer model whose weights make it answer every
prompt with one chosen token, so that ending on each eos token is observed, not assumed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine import LLM, SamplingParams
from engine.loader import Checkpoint, random_weights, save_hf_dir
from engine.tokenizer import Tokenizer
from jobs.shard_runner import plan_requests

FIXTURES = Path(__file__).parent / "fixtures" / "chat_templates"


@dataclass(frozen=True)
class Family:
    template: str  # the fixture file
    specials: tuple[str, ...]  # the special tokens its template and generation_config name
    bos: str | None  # tokenizer_config.json bos_token / eos_token
    eos: str
    generation_eos: tuple[str, ...]  # generation_config.json eos_token_id, by token
    end_of_turn: str  # what ends the assistant's turn in its template


LLAMA_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                  "<|eot_id|>", "<|eom_id|>", "<|python_tag|>")
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN_EOS = ("<|im_end|>", "<|endoftext|>")
PHI_SPECIALS = ("<s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
FAMILIES = {
    "llama-3.1": Family("llama-3.3-instruct.jinja", LLAMA_SPECIALS, "<|begin_of_text|>", "<|eot_id|>",
                        ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"), "<|eot_id|>"),
    "qwen2.5": Family("qwen2.5-instruct.jinja", QWEN_SPECIALS, None, "<|im_end|>", QWEN_EOS, "<|im_end|>"),
    "qwen3": Family("qwen3.jinja", QWEN_SPECIALS, None, "<|im_end|>", QWEN_EOS, "<|im_end|>"),
    "mistral": Family("mistral-nemo-instruct-2407.jinja", ("<s>", "</s>", "[INST]", "[/INST]"), "<s>", "</s>",
                      ("</s>",), "</s>"),
    "gemma-3": Family("gemma-3-it.jinja", ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"),
                      "<bos>", "<eos>", ("<eos>", "<end_of_turn>"), "<end_of_turn>"),
    "phi-3": Family("phi-3.5-mini-instruct.jinja", PHI_SPECIALS, "<s>", "<|endoftext|>",
                    ("<|end|>", "<|assistant|>", "<|endoftext|>"), "<|end|>"),
}
CONVERSATIONS = [
    [{"role": "user", "content": "Hello there!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?  "}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a joke."}],
]


def _tokenizer_dir(family: Family, directory: Path) -> Path:
    """tokenizer.json (byte-level BPE, the family's specials), tokenizer_config.json with the real
    template, generation_config.json with the family's eos list."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    directory.mkdir(parents=True, exist_ok=True)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Backend(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in family.specials])
    backend.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": family.bos, "eos_token": family.eos,
              "clean_up_tokenization_spaces": False,
              "chat_template": (FIXTURES / family.template).read_text()}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    eos = [backend.token_to_id(t) for t in family.generation_eos]
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return directory


def _transformers_render(directory: Path, conversation: list[dict], add_generation_prompt: bool) -> str:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory)
    return tokenizer.apply_chat_template(conversation, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_real_template_renders_as_transformers_renders_it(tmp_path, name, conversation):
    directory = _tokenizer_dir(FAMILIES[name], tmp_path)
    ours = Tokenizer.from_dir(directory)
    messages = CONVERSATIONS[conversation]
    for add_generation_prompt in (True, False):
        assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == \
            _transformers_render(directory, messages, add_generation_prompt)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_eos_token_of_the_family_is_an_end_of_sequence(tmp_path, name):
    family = FAMILIES[name]
    tokenizer = Tokenizer.from_dir(_tokenizer_dir(family, tmp_path))
    ids = {token: tokenizer.backend.token_to_id(token) for token in family.specials}
    assert tokenizer.eos_token_ids == {ids[t] for t in family.generation_eos} | {ids[family.end_of_turn]}


def _model_answering(family: Family, token: str, directory: Path) -> Path:
    """A one-layer Llama over the family's tokenizer whose greedy answer to anything is `token`: every
    embedding is zero but that token's (the tied head's row), and the MLP's down bias is that row, so
    the last hidden state points along it and its logit is the only positive one."""
    tokenizer = Tokenizer.from_dir(_tokenizer_dir(family, directory / "tokenizer"))
    config = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 32,
              "vocab_size": tokenizer.vocab_size, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
              "tie_word_embeddings": True, "mlp_bias": True}
    weights = random_weights(config, seed=1)
    target = tokenizer.backend.token_to_id(token)
    direction = torch.randn(64, generator=torch.Generator().manual_seed(2))
    weights["model.embed_tokens.weight"].zero_()[target] = direction
    weights["model.layers.0.mlp.down_proj.weight"].zero_()
    weights["model.layers.0.mlp.down_proj.bias"] = direction * 10
    generation = json.loads((directory / "tokenizer" / "generation_config.json").read_text())
    save_hf_dir(Checkpoint(config, weights, tokenizer, generation), directory / "model")
    return directory / "model"


@pytest.mark.parametrize("name", list(FAMILIES))
def test_apply_chat_template_auto_runs_a_prompt_as_the_familys_turn_and_every_eos_ends_it(tmp_path, name):
    family = FAMILIES[name]
    manifest = SimpleNamespace(sampling_defaults={}, apply_chat_template="auto", model=name)
    plan = plan_requests([{"prompt": "What is 2+2?"}], manifest, "k", has_chat_template=True)
    messages = plan.requests[0].messages
    assert messages == [{"role": "user", "content": "What is 2+2?"}]
    for i, token in enumerate(sorted(set(family.generation_eos) | {family.end_of_turn})):
        model = _model_answering(family, token, tmp_path / str(i))
        llm = LLM(str(model), num_kv_blocks=16)
        out = llm.chat(messages, SamplingParams(max_tokens=8, temperature=0.0))[0]
        rendered = _transformers_render(tmp_path / str(i) / "tokenizer", messages, True)
        assert out.prompt_token_ids == llm.tokenizer.encode(rendered, add_special_tokens=False)
        answer = llm.tokenizer.backend.token_to_id(token)
        assert (out.token_ids, out.finish_reason, out.text) == ([answer], "stop", "")
