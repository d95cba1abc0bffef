"""Tokenizers: text <-> token ids, chat templates, and incremental detokenization.

`Tokenizer` wraps a Hugging Face `tokenizers.Tokenizer` (tokenizer.json) plus what
tokenizer_config.json adds to it: the special tokens, whether a BOS is prepended and the chat
template. `ByteTokenizer` is the tokenizer of the tiny random test model: one id per byte.
Both hand out an `IncrementalDetokenizer`, which turns a stream of output token ids into text a
piece at a time, at a cost per token that does not grow with the output.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path

import jinja2
import tokenizers
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Tokens that chat templates use to end a turn. A model stops at the end of its turn, so when its
# template writes one of these they count as end-of-sequence too (the reason Llama-3 and Qwen
# list two eos ids in generation_config.json).
TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")

# A UTF-8 character is at most 4 bytes, so a decoded window that still ends in U+FFFD after this
# many more tokens holds invalid bytes, not an unfinished character: emit it rather than wait.
_MAX_PENDING_TOKENS = 6
# Tokens of already-emitted context decoded in front of each new token, so decoders that treat
# the start of a string specially (a leading-space marker) see the same context as a full decode.
_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class BaseTokenizer:
    """What the engine needs from a tokenizer; `Tokenizer` and `ByteTokenizer` implement it."""

    bos_token_id: int | None  # prepended when encoding with add_special_tokens, if add_bos_token
    eos_token_ids: set[int]  # any of these ends a sequence (eos plus the template's turn end)
    vocab_size: int  # number of ids, special tokens included
    chat_template: str | None  # jinja2 source, or None if the model has none
    special_tokens: dict[str, str]  # bos_token/eos_token/pad_token/unk_token -> text, for templates
    # no token stands for more characters of text than this (None: unknown), so a text of n characters
    # has at least n / max_token_chars tokens, known without tokenizing it
    max_token_chars: int | None = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        raise NotImplementedError

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text for a conversation, rendered by the model's own chat template.

        Renders the template the way `transformers` does (a sandboxed jinja2 environment with
        trim_blocks and lstrip_blocks, the same helper functions and variables), so the string
        is identical to `transformers`' `apply_chat_template(..., tokenize=False)`.
        """
        if not self.chat_template:
            raise ValueError("this model has no chat template: give the prompt as text, not messages")
        _check_messages(messages)
        template = _compile_chat_template(self.chat_template)
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               **self.special_tokens)

    def detokenizer(self, prompt_ids: Sequence[int] = ()) -> IncrementalDetokenizer:
        """A detokenizer for the output that follows `prompt_ids`."""
        return IncrementalDetokenizer(self.decode, prompt_ids)


class Tokenizer(BaseTokenizer):
    """A `tokenizers.Tokenizer` plus the special tokens and chat template of its model."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
        chat_template: str | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        model_max_length: int | None = None,
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.model_max_length = model_max_length
        named = dict(bos_token=bos_token, eos_token=eos_token, pad_token=pad_token, unk_token=unk_token)
        self.special_tokens = {name: text for name, text in named.items() if text is not None}
        self.bos_token_id = self._id_of(bos_token)
        self.eos_token_id = self._id_of(eos_token)
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.eos_token_ids = self._eos_ids(extra_eos_token_ids)

    @classmethod
    def from_dir(cls, directory: str | os.PathLike) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json (and chat_template.jinja, generation_config.json).

        Only tokenizer.json is required. The eos ids are the eos token, the eos ids of
        generation_config.json and config.json, and the turn-end token of the chat template.
        """
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{directory}: no tokenizer.json (a Hugging Face fast tokenizer file)")
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:
            raise ValueError(f"{path}: not a valid tokenizers file ({_first_line(exc)})") from None
        config = _read_json(directory / "tokenizer_config.json")
        generation = _read_json(directory / "generation_config.json")
        model_config = _read_json(directory / "config.json")
        eos_ids = _as_id_list(generation.get("eos_token_id")) + _as_id_list(model_config.get("eos_token_id"))
        return cls(
            backend,
            bos_token=_token_text(config.get("bos_token")),
            eos_token=_token_text(config.get("eos_token")),
            pad_token=_token_text(config.get("pad_token")),
            unk_token=_token_text(config.get("unk_token")),
            chat_template=_read_chat_template(directory, config),
            extra_eos_token_ids=eos_ids,
            model_max_length=config.get("model_max_length"),
        )

    def save(self, directory: str | os.PathLike) -> None:
        """Write tokenizer.json and tokenizer_config.json, loadable by `from_dir` and `transformers`."""
        directory = Path(directory)
        self.backend.save(str(directory / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": self.adds_bos_token(),
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            **self.special_tokens,
        }
        if self.model_max_length is not None:
            config["model_max_length"] = self.model_max_length
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        text = json.dumps(config, indent=2, ensure_ascii=False)
        (directory / "tokenizer_config.json").write_text(text + "\n", encoding="utf-8")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text map to their ids.

        add_special_tokens applies the tokenizer's post-processor (e.g. a BOS for models that
        want one); it adds nothing for SmolLM2, whose chat template writes its own markers.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        # encode_batch releases the GIL while it works, encode holds it (3 s for 3 MB of SmolLM2 text,
        # measured): a long prompt must not stop the worker's other threads (lease heartbeats)
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @cached_property
    def max_token_chars(self) -> int:
        """The longest vocabulary entry (a byte-level entry spells each byte as one character, so it
        bounds the characters a token decodes to); times 4 behind a normalizer, which may merge
        characters before the vocabulary sees them."""
        longest = max(len(text) for text in self.backend.get_vocab(with_added_tokens=True))
        return longest * (4 if self.backend.normalizer is not None else 1)

    def adds_bos_token(self) -> bool:
        """Whether `encode(..., add_special_tokens=True)` prepends the BOS token."""
        if self.bos_token_id is None:
            return False
        ids = self.backend.encode("a", add_special_tokens=True).ids
        return bool(ids) and ids[0] == self.bos_token_id

    def _id_of(self, token: str | None) -> int | None:
        if token is None:
            return None
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"special token {token!r} from tokenizer_config.json is not in the vocabulary")
        return token_id

    def _eos_ids(self, extra: Iterable[int]) -> set[int]:
        ids = set(extra)
        if self.eos_token_id is not None:
            ids.add(self.eos_token_id)
        for token in TURN_END_TOKENS:
            token_id = self.backend.token_to_id(token)
            if self.chat_template and token in self.chat_template and token_id is not None:
                ids.add(token_id)
        if not ids:
            raise ValueError("the tokenizer names no eos token (tokenizer_config.json eos_token)")
        return ids


class ByteTokenizer(BaseTokenizer):
    """One id per byte of UTF-8 (0..255), then BOS=256, EOS=257, PAD=258: the tiny model's tokenizer."""

    BOS, EOS, PAD = 256, 257, 258
    _NAMES = {BOS: "<s>", EOS: "</s>", PAD: "<pad>"}
    CHAT_TEMPLATE = (
        "{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )

    max_token_chars = 1  # a token is one byte, a character one or more

    def __init__(self) -> None:
        self.bos_token_id = self.BOS
        self.eos_token_id = self.EOS
        self.eos_token_ids = {self.EOS}
        self.vocab_size = 259
        self.chat_template = self.CHAT_TEMPLATE
        self.special_tokens = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        ids = list(text.encode("utf-8"))
        return [self.BOS, *ids] if add_special_tokens else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        pieces: list[str] = []
        run = bytearray()
        for token_id in ids:
            if 0 <= token_id < 256:
                run.append(token_id)
            elif token_id in self._NAMES:
                if not skip_special_tokens:
                    pieces.append(run.decode("utf-8", errors="replace") + self._NAMES[token_id])
                    run.clear()
            else:
                raise ValueError(f"token id {token_id} is out of range for ByteTokenizer (vocab_size 259)")
        pieces.append(run.decode("utf-8", errors="replace"))
        return "".join(pieces)


class IncrementalDetokenizer:
    """Turns output token ids into text one token at a time.

    Each `add` decodes only a short window: a few tokens already emitted (context) plus the
    tokens not yet emitted, and returns the text the new token completed. While the window's
    text ends in U+FFFD (a UTF-8 character split across tokens) nothing is emitted; the
    character comes out whole with the token that completes it. `text` is everything emitted
    so far; after `flush()` it equals `decode(output_ids)` for byte-level tokenizers.
    """

    def __init__(self, decode: Callable[[list[int]], str], prompt_ids: Sequence[int] = ()) -> None:
        self._decode = decode
        self._ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])  # context, then output ids
        self._read_offset = len(self._ids)  # ids before this index are emitted (or context)
        self._prefix_offset = self._context_start()  # window start: context for the next decode
        self._num_prompt_context = self._read_offset
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self._pieces)

    @property
    def output_ids(self) -> list[int]:
        return self._ids[self._num_prompt_context:]

    def add(self, token_id: int) -> str:
        """Append one output token; return the text it completes ('' while a character is split)."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        window_text = self._decode(self._ids[self._prefix_offset:])
        pending = len(self._ids) - self._read_offset
        if window_text.endswith(_REPLACEMENT) and pending < _MAX_PENDING_TOKENS:
            return ""
        return self._emit(window_text[len(prefix_text):])

    def flush(self) -> str:
        """Emit whatever is still held back (an incomplete character decodes to U+FFFD)."""
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        return self._emit(self._decode(self._ids[self._prefix_offset:])[len(prefix_text):])

    def _emit(self, new_text: str) -> str:
        self._read_offset = len(self._ids)
        self._prefix_offset = self._context_start()
        self._pieces.append(new_text)
        return new_text

    def _context_start(self) -> int:
        """Where the next window starts: up to _CONTEXT_TOKENS emitted ids, none if they end mid-character."""
        start = max(self._read_offset - _CONTEXT_TOKENS, 0)
        if self._decode(self._ids[start:self._read_offset]).endswith(_REPLACEMENT):
            return self._read_offset
        return start


@lru_cache(maxsize=16)
def _compile_chat_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"chat template does not parse: {exc.message} (line {exc.lineno})") from None


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # jinja's own tojson escapes HTML characters; chat templates want plain JSON
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _check_messages(messages: list[dict]) -> None:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise ValueError(f"messages[{index}] must be a dict with str 'role' and 'content': {message!r}")


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None


def _read_chat_template(directory: Path, config: dict) -> str | None:
    """The chat template: chat_template.jinja (newer transformers) or tokenizer_config.json's."""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}]
        named = {entry.get("name"): entry.get("template") for entry in template}
        template = named.get("default")
    return template


def _token_text(token) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(token, dict):
        return token.get("content")
    return token


def _as_id_list(value) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def _first_line(exc: Exception) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0]
