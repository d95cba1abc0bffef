"""GGUF files of the families llama.cpp converts (llama, qwen2, qwen3, qwen3moe, and Mixtral as llama
with experts), written with the gguf package from a transformers checkpoint as llama.cpp's converter
lays them out, load with LLM(model=FILE.gguf) and generate greedily what transformers does on the
checkpoint they came from (float32 tensors: no quantization in the way)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.families import ModelFileError
from tests.engine.families import CASES, GGUF_ARCHS, Case, build_checkpoint, hf_generate, write_gguf
from tests.engine.test_families import MAX_NEW, PROMPTS, REGIME

# llama.cpp's qwen3moe has no dense layers and always renormalises the top-k weights (norm_topk_prob)
GGUF_CASES = {name: CASES[name] for name in ("llama", "qwen2", "qwen3", "mixtral")} | {
    "qwen3_moe": Case("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True})}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root, built = tmp_path_factory.mktemp("gguf"), {}

    def get(case: str):
        if case not in built:
            hf = build_checkpoint(GGUF_CASES[case], root / case)
            built[case] = hf, write_gguf(hf, root / f"{case}.gguf")
        return built[case]

    return get


def _model_type(hf_dir) -> str:
    return json.loads((hf_dir / "config.json").read_text())["model_type"]


@pytest.mark.parametrize("case", list(GGUF_CASES))
def test_gguf_family_equals_transformers(files, case):
    hf_dir, gguf_path = files(case)
    llm = LLM(str(gguf_path), dtype="float32", **REGIME)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
    reference = hf_generate(hf_dir, PROMPTS, MAX_NEW, torch.float32)
    assert [o.token_ids for o in outs] == [tokens for tokens, _ in reference]
    assert llm.engine.model_args.family == _model_type(hf_dir)
    assert sum(s.num_preempted for s in llm.iteration_stats) > 0


@pytest.mark.parametrize("case", list(GGUF_CASES))
def test_the_writer_uses_llama_cpps_tensor_names(files, case):
    """The test's writer names tensors as gguf-py's per-architecture tables (llama.cpp's) list them."""
    import gguf

    hf_dir, path = files(case)
    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == GGUF_ARCHS[_model_type(hf_dir)])
    allowed = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[arch]}
    for tensor in gguf.GGUFReader(str(path)).tensors:
        assert re.sub(r"^blk\.\d+\.", "blk.{bid}.", tensor.name.rsplit(".", 1)[0]) in allowed, tensor.name


@pytest.mark.parametrize("case", ["llama", "qwen2"])
def test_transformers_reads_the_written_gguf_as_the_checkpoint(files, case):
    """transformers' own GGUF loader (where it supports the shapes: not qwen3's explicit head_dim, not
    qwen3moe's expert size, not Mixtral) reads the test's files back into the checkpoint they came
    from: the writer follows llama.cpp's layout as transformers knows it too."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    hf_dir, path = files(case)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    state = model.state_dict()
    for name, tensor in load_file(str(hf_dir / "model.safetensors")).items():
        assert torch.equal(state[name], tensor), name


def test_gguf_llama3_rope_frequencies_are_refused(files, tmp_path):
    """llama.cpp stores Llama 3.1's rope scaling as a rope_freqs tensor: refused, naming it."""
    hf_dir, _ = files("llama")
    path = write_gguf(hf_dir, tmp_path / "l3.gguf", extra={"rope_freqs.weight": np.ones(8, dtype=np.float32)})
    with pytest.raises(ModelFileError, match=r"l3\.gguf: tensor rope_freqs\.weight .* not supported in GGUF"):
        LLM(str(path), num_kv_blocks=8)


TEXTS = ["Hello world 12345 and 7", "it's   they'll\n\n  x=1+2;\r\n", "naïve café 3.14159 ÅÄÖ 東京 🙂",
         "  \t a"]


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe", "gpt-2"])
def test_gguf_pre_tokenizers_split_as_transformers_gguf_tokenizer_does(tmp_path, pre):
    """Qwen2's and Llama 3's split expressions (tokenizer.ggml.pre qwen2, llama-bpe) and GPT-2's,
    against transformers' own GGUF tokenizer on text with digits, contractions, newlines and Unicode
    (not smollm: transformers gives it GPT-2's split, where SmolLM's tokenizer.json splits digits)."""
    from transformers import AutoTokenizer

    from engine.loader import load_gguf
    from tests.engine.conftest import write_tiny_gguf

    write_tiny_gguf(tmp_path / "t.gguf", pre=pre)
    ours = load_gguf(tmp_path / "t.gguf").tokenizer
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file="t.gguf")
    for text in TEXTS:
        pieces = [p for p, _ in ours.backend.pre_tokenizer.pre_tokenize_str(text)]
        assert pieces == [p for p, _ in theirs.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)], text
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)
