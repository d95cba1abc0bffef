"""engine.tokenizer: ByteTokenizer, chat templates, incremental detokenization, and SmolLM2's tokenizer
against transformers and against llama.cpp's pre-tokenizer rules."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import tokenizer as tokenizer_module
from engine.tokenizer import ByteTokenizer, IncrementalDetokenizer, Tokenizer

# Varied text: unicode (accents, CJK, emoji with modifiers and flags), digits, code, whitespace runs
STRINGS = [
    "Hello, world!",
    "  leading spaces and trailing   ",
    "multiple   internal    spaces\t\ttabs\n\n\nnewlines\r\n",
    "Numbers 12345 and 3.14159 and 1,000,000",
    "x=42; y = 7 * 6",
    "def foo(x):\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n",
    "Café naïve résumé — “quotes” ‘single’ …",
    "你好，世界！这是一个测试。",
    "日本語のテキストとカタカナ",
    "Emoji: 😀👍🏽🇺🇸 and ❤️",
    "Русский текст и Українa",
    "I'm sure they'll say it's fine, don't you think? We've seen it.",
    "<|im_start|>user\nhi<|im_end|>\n",
    "mixed<|endoftext|>special",
    "",
    " ",
    "\n",
    "٣ arabic-indic digit",
]
# Where SmolLM2's real pre-tokenizer (every numeric character isolated first, then the GPT-2
# regex) and transformers' GGUF tokenizer (GPT-2 regex only) split differently: a digit after a
# whitespace run ("a  1" -> "a", "  ", "1" versus "a", " ", " 1"), and a numeric character whose
# space-prefixed form is a token (" ½" -> " ", "½" versus "Ġ½"). llama.cpp and the Hub's
# tokenizer.json both isolate numerics first, so we do too.
NUMERIC_SPLIT_CASES = ["a  1", "year 2024  99 bottles", "x =\n\n  7", "tabs\t\t42", "and ½ fraction"]


# ---------------------------------------------------------------- ByteTokenizer


def test_byte_tokenizer_round_trip_and_specials():
    tok = ByteTokenizer()
    text = "héllo 世界 😀"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id == 256 and ids[1:] == list(text.encode("utf-8"))
    assert tok.encode(text, add_special_tokens=False) == ids[1:]
    assert tok.decode(ids) == text
    assert tok.decode([256, 104, 105, 257, 258]) == "hi"
    assert tok.decode([256, 104, 105, 257, 258], skip_special_tokens=False) == "<s>hi</s><pad>"
    assert tok.eos_token_ids == {257} and tok.vocab_size == 259


def test_byte_tokenizer_bad_input():
    tok = ByteTokenizer()
    with pytest.raises(ValueError, match="token id 300 is out of range"):
        tok.decode([104, 300])
    with pytest.raises(TypeError, match="encode expects a str"):
        tok.encode(b"bytes")


def test_byte_tokenizer_chat_template():
    tok = ByteTokenizer()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages) == "system: be brief\nuser: hi\nassistant: "
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == "system: be brief\nuser: hi\n"


@pytest.mark.parametrize("messages, message", [
    ([], "non-empty list"),
    ([{"role": "user"}], r"messages\[0\] must be a dict"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": 3}], r"messages\[1\]"),
    ("hello", "non-empty list"),
])
def test_chat_template_rejects_bad_messages(messages, message):
    with pytest.raises(ValueError, match=message):
        ByteTokenizer().apply_chat_template(messages)


def test_chat_template_sandbox_and_raise_exception():
    from jinja2.exceptions import SecurityError, TemplateError

    tok = ByteTokenizer()
    tok.chat_template = "{{ raise_exception('only user turns') }}"
    with pytest.raises(TemplateError, match="only user turns"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    tok.chat_template = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(SecurityError):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    tok.chat_template = "{% for m in messages %}{{ m | tojson }}{% endfor %}"
    rendered = tok.apply_chat_template([{"role": "user", "content": "<é>"}])
    assert rendered == '{"role": "user", "content": "<é>"}'
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


# ---------------------------------------------------------------- incremental detokenization


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.add(token_id) for token_id in ids]


def test_split_character_is_held_back_then_emitted_whole():
    tok = ByteTokenizer()
    ids = list("a€b😀".encode())  # € is 3 bytes, 😀 4
    pieces = _stream(tok.detokenizer(), ids)
    assert pieces == ["a", "", "", "€", "b", "", "", "", "😀"]
    assert all("\ufffd" not in piece for piece in pieces)


def test_invalid_bytes_are_emitted_not_held_forever():
    tok = ByteTokenizer()
    detok = tok.detokenizer()
    pieces = _stream(detok, [0xFF] + list(b"abcdefgh"))
    assert "".join(pieces) == tok.decode([0xFF] + list(b"abcdefgh")) == "\ufffdabcdefgh"
    assert pieces[1] == "\ufffda"  # the bad byte comes out with the next good character


def test_flush_emits_incomplete_tail():
    tok = ByteTokenizer()
    detok = tok.detokenizer([256, 104])
    ids = list(b"ok") + list("€".encode())[:2]
    assert "".join(_stream(detok, ids)) == "ok"
    assert detok.flush() == "\ufffd"
    assert detok.text == tok.decode(ids) == "ok\ufffd"
    assert detok.flush() == ""


def test_special_tokens_are_skipped_and_prompt_is_not_repeated():
    tok = ByteTokenizer()
    detok = tok.detokenizer(tok.encode("prompt text"))
    pieces = _stream(detok, [104, 105, 257])
    assert pieces == ["h", "i", ""]
    assert detok.text == "hi" and detok.output_ids == [104, 105, 257]


@settings(max_examples=60, deadline=None)
# Surrogates (U+D800-U+DFFF) are excluded on purpose: they are not characters and have no UTF-8
# encoding (`"\ud800".encode("utf-8")` raises), so no model output can contain one; U+FFFD is what
# the detokenizer shows for an incomplete character, so it is excluded from the inputs as well.
@given(text=st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\ufffd"), max_size=40),
       specials=st.lists(st.integers(0, 40), max_size=2))
def test_concatenation_equals_full_decode(text, specials):
    tok = ByteTokenizer()
    ids = list(text.encode("utf-8"))
    for position in sorted(specials, reverse=True):  # EOS/PAD between whole characters or mid-character
        ids.insert(min(position, len(ids)), 258)
    detok = tok.detokenizer(tok.encode("ctx é"))
    pieces = _stream(detok, ids) + [detok.flush()]
    assert "".join(pieces) == detok.text == tok.decode(ids) == text
    assert all("\ufffd" not in piece for piece in pieces)


def test_cost_per_token_is_bounded(monkeypatch):
    """Each add decodes a short window, however long the output already is."""
    tok = ByteTokenizer()
    lengths = []

    def recording_decode(ids, skip_special_tokens=True):
        lengths.append(len(ids))
        return ByteTokenizer.decode(tok, ids, skip_special_tokens)

    monkeypatch.setattr(tok, "decode", recording_decode)
    detok = tok.detokenizer(tok.encode("x" * 100))
    ids = list(("word € 😀 " * 300).encode())
    _stream(detok, ids)
    assert len(ids) > 4000 and detok.text == "word € 😀 " * 300
    bound = tokenizer_module._CONTEXT_TOKENS + tokenizer_module._MAX_PENDING_TOKENS
    assert max(lengths) <= bound
    assert len(lengths) <= 3 * len(ids) + 10


# ---------------------------------------------------------------- Tokenizer from a GGUF (synthetic)


def test_tokenizer_save_and_from_dir(tiny_gguf, tmp_path):
    from engine.loader import load_gguf

    tok = load_gguf(tiny_gguf[0]).tokenizer
    tok.save(tmp_path)
    again = Tokenizer.from_dir(tmp_path)
    for text in ("hello world 42", "<|im_start|>user\nhello<|im_end|>", "  \n\t x"):
        assert again.encode(text) == tok.encode(text)
    assert again.special_tokens == tok.special_tokens
    assert again.chat_template == tok.chat_template
    assert (again.bos_token_id, again.eos_token_ids, again.vocab_size) == (1, {2}, 265)
    assert again.adds_bos_token() is False


def test_tokenizer_from_dir_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match=r"tokenizer\.json: not a valid tokenizers file"):
        Tokenizer.from_dir(tmp_path)


def test_unknown_special_token_is_an_error(tiny_gguf):
    from engine.loader import load_gguf

    backend = load_gguf(tiny_gguf[0]).tokenizer.backend
    with pytest.raises(ValueError, match="special token '<eos>' from tokenizer_config.json is not in"):
        Tokenizer(backend, eos_token="<eos>")


def test_turn_end_token_of_the_template_counts_as_eos(tiny_gguf):
    from engine.loader import load_gguf

    tok = load_gguf(tiny_gguf[0]).tokenizer
    base = Tokenizer(tok.backend, eos_token="<|endoftext|>", chat_template=None)
    chat = Tokenizer(tok.backend, eos_token="<|endoftext|>", chat_template=tok.chat_template)
    assert base.eos_token_ids == {0}
    assert chat.eos_token_ids == {0, 2}  # <|im_end|> ends the template's turns


def test_tokenizer_directory_files_win(tmp_path, tiny_gguf):
    """chat_template.jinja (newer transformers) and the eos ids of generation_config/config.json are read."""
    import json

    from engine.loader import load_gguf

    load_gguf(tiny_gguf[0]).tokenizer.save(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "only this"}]) == "only this"
    assert tok.eos_token_ids == {0, 2}
    (tmp_path / "generation_config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 1}))
    assert Tokenizer.from_dir(tmp_path).eos_token_ids == {1, 2}


# ---------------------------------------------------------------- the real SmolLM2 tokenizer (slow)


@pytest.fixture(scope="module")
def smol(smollm2_dir) -> Tokenizer:
    return Tokenizer.from_dir(smollm2_dir)


def _llama_cpp_reference_ids(tok: Tokenizer, text: str) -> list[int]:
    """Token ids by llama.cpp's rules for pre-tokenizer 'smollm', written independently of `tokenizers`.

    Special tokens are cut out first; each \\p{N} character is isolated; the GPT-2 regex splits
    the rest; each piece is mapped to byte-level characters and BPE-merged by the vocabulary.
    """
    import regex
    from tokenizers import pre_tokenizers

    gpt2 = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=ord)
    byte_chars = _gpt2_byte_chars(alphabet)
    specials = sorted((t for t in tok.backend.get_added_tokens_decoder().values() if t.special),
                      key=lambda t: -len(t.content))
    ids: list[int] = []
    for chunk in regex.split("(" + "|".join(regex.escape(t.content) for t in specials) + ")", text):
        if tok.backend.token_to_id(chunk) is not None and any(chunk == t.content for t in specials):
            ids.append(tok.backend.token_to_id(chunk))
            continue
        for fragment in regex.split(r"(\p{N})", chunk):
            for piece in gpt2.findall(fragment):
                mapped = "".join(byte_chars[b] for b in piece.encode("utf-8"))
                ids.extend(t.id for t in tok.backend.model.tokenize(mapped))
    return ids


def _gpt2_byte_chars(alphabet: list[str]) -> dict[int, str]:
    """GPT-2's byte -> printable character table (printable Latin-1 bytes map to themselves)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    assert sorted(table.values(), key=ord) == alphabet
    return table


@pytest.mark.slow
def test_smollm2_matches_llama_cpp_pre_tokenizer_rules(smol):
    for text in STRINGS + NUMERIC_SPLIT_CASES:
        assert smol.encode(text) == _llama_cpp_reference_ids(smol, text), text


@pytest.fixture(scope="module")
def hf_gguf_tokenizer():
    """transformers' own tokenizer built from the GGUF file (its GGUF reader, not ours)."""
    from transformers import AutoTokenizer

    from engine.registry import KNOWN_MODELS, locate_gguf

    path = locate_gguf(KNOWN_MODELS["smollm2-135m"])
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.mark.slow
def test_smollm2_matches_transformers_gguf_tokenizer(smol, hf_gguf_tokenizer):
    reference = hf_gguf_tokenizer
    for text in STRINGS:
        ids = smol.encode(text)
        assert ids == reference(text)["input_ids"], text
        assert smol.decode(ids) == reference.decode(ids, skip_special_tokens=True), text
        assert smol.decode(ids, skip_special_tokens=False) == reference.decode(ids), text
    assert smol.bos_token_id == reference.bos_token_id and smol.eos_token_id == reference.eos_token_id
    assert smol.vocab_size == len(reference) == 49152


@pytest.mark.slow
def test_smollm2_converted_dir_loads_identically_in_transformers(smol, smollm2_dir):
    from transformers import AutoTokenizer, GenerationConfig

    reference = AutoTokenizer.from_pretrained(smollm2_dir)
    for text in STRINGS + NUMERIC_SPLIT_CASES:
        assert smol.encode(text) == reference(text)["input_ids"], text
    generation = GenerationConfig.from_pretrained(smollm2_dir)
    eos = generation.eos_token_id
    assert smol.eos_token_ids == set(eos if isinstance(eos, list) else [eos]) == {2}
    assert smol.backend.id_to_token(2) == "<|im_end|>"


CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi 👋"}],
    [{"role": "user", "content": "Tell me a joke."}, {"role": "assistant", "content": "Why did the...\n"},
     {"role": "user", "content": "  go on  "}],
]


@pytest.mark.slow
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_chat_template_equals_transformers(smol, smollm2_dir, hf_gguf_tokenizer,
                                                   add_generation_prompt):
    from transformers import AutoTokenizer

    references = [AutoTokenizer.from_pretrained(smollm2_dir), hf_gguf_tokenizer]
    for messages in CONVERSATIONS:
        ours = smol.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        for reference in references:
            theirs = reference.apply_chat_template(messages, tokenize=False,
                                                   add_generation_prompt=add_generation_prompt)
            assert ours == theirs
    assert smol.apply_chat_template(CONVERSATIONS[0]).startswith("<|im_start|>system\nYou are a helpful")


@pytest.mark.slow
def test_smollm2_incremental_detokenization(smol):
    text = "Emoji 😀👍🏽 and 中文 mixed with code:\n    x = 42  # ok\nÇa va? ½ — done."
    ids = smol.encode(text)
    detok = smol.detokenizer(smol.encode("<|im_start|>assistant\n"))
    pieces = [detok.add(i) for i in ids] + [detok.flush()]
    assert "".join(pieces) == smol.decode(ids) == text
    assert all("\ufffd" not in piece for piece in pieces)
    assert any(piece == "" for piece in pieces)  # a character split across tokens was held back
