"""The OpenAI Batch format, both ways: request lines in, batch output lines out.

In: one line per request, `{"custom_id", "method": "POST", "url", "body"}`, the url
`/v1/chat/completions` (body `messages`) or `/v1/completions` (body `prompt`), as the OpenAI Batch
API and `vllm run-batch` take them. `request_values` checks the line's envelope and maps the body
onto the input column names of jobs.input_contract (`max_completion_tokens` -> `max_tokens`, a completions
`logprobs` count -> `top_logprobs`, text content parts -> one string); jobs.jsonl_input types them.

Body fields, as OpenAI treats them:
- used: the sampling fields below (`ACCEPTED`), `response_format` on chat requests (structured
  output: json_object, json_schema), plus vLLM's extra sampling fields (`guided_json` becomes a
  json_schema response_format; `guided_regex`, `guided_choice`);
- ignored, as they change nothing generated here: `IGNORED` (`stream` only when false);
- refused, naming the line and field: OpenAI fields batchgen cannot honour (`UNSUPPORTED`: tools,
  logit biases, ...) and any name OpenAI does not know either (it answers
  "Unrecognized request argument" for those).

Out: `output_line` turns one request's output rows (one per sample) into an OpenAI batch output
line: `response.body` is a `chat.completion` or `text_completion` object with `usage`, or, for a
request that failed, an error body (status 400 for the request's own fault, 500 when its shard
failed) or an `error` (`batch_cancelled`). Failed requests go to the errors file beside the output.
"""

from __future__ import annotations

import hashlib
import json

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
ENDPOINTS = (CHAT_URL, COMPLETIONS_URL)
LINE_KEYS = ("custom_id", "method", "url", "body")

_SAMPLING = ("model", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "logprobs",
             "presence_penalty", "frequency_penalty")
_VLLM_EXTRAS = ("top_k", "min_p", "repetition_penalty", "ignore_eos", "priority", "guided_regex",
                "guided_choice", "guided_json")
ACCEPTED = {
    CHAT_URL: frozenset((*_SAMPLING, *_VLLM_EXTRAS, "messages", "max_completion_tokens", "top_logprobs",
                         "response_format")),
    COMPLETIONS_URL: frozenset((*_SAMPLING, *_VLLM_EXTRAS, "prompt")),
}
IGNORED = frozenset(("user", "metadata", "store", "service_tier", "stream", "stream_options"))
UNSUPPORTED = frozenset((
    "tools", "tool_choice", "functions", "function_call", "parallel_tool_calls",
    "logit_bias", "audio", "modalities", "prediction", "reasoning_effort", "web_search_options", "suffix",
    "echo", "best_of",
))
LOGPROB_FLOOR = -9999.0  # OpenAI's stand-in for a log probability of -inf


class RequestLineError(ValueError):
    """A request line that is not a valid OpenAI batch request; the message names the field."""


def is_request_line(obj: dict) -> bool:
    """A line in the OpenAI Batch format (it has one of custom_id, method, url, body)."""
    return any(key in obj for key in LINE_KEYS)


# ---------------------------------------------------------------- request lines in


def request_values(obj: dict) -> tuple[dict, str | None]:
    """(input column values of the request, body.model or None); RequestLineError on a bad line."""
    unknown = sorted(set(obj) - set(LINE_KEYS))
    if unknown:
        raise RequestLineError(f"unknown key(s) {unknown}; a request line has {list(LINE_KEYS)}")
    custom_id = obj.get("custom_id")
    if custom_id is None:
        raise RequestLineError("missing 'custom_id' (every request needs a unique custom_id)")
    if not isinstance(custom_id, str) or not custom_id:
        raise RequestLineError(f"custom_id must be a non-empty string, got {custom_id!r}")
    if obj.get("method") != "POST":
        raise RequestLineError(f"method must be 'POST', got {obj.get('method')!r}")
    url = obj.get("url")
    if url not in ENDPOINTS:
        raise RequestLineError(f"url {url!r} is not supported; use {CHAT_URL} or {COMPLETIONS_URL}")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise RequestLineError(f"body must be a JSON object, got {type(body).__name__}")
    values = _body_values(body, url)
    values["id"] = custom_id
    return values, body.get("model")


def _body_values(body: dict, url: str) -> dict:
    values = {}
    for key, value in body.items():
        if key in ACCEPTED[url]:
            values[key] = value
        elif key in IGNORED:
            if key == "stream" and value:
                raise RequestLineError("body.stream: batch requests do not stream; drop it or set it false")
        elif key in UNSUPPORTED or key in ACCEPTED[CHAT_URL] | ACCEPTED[COMPLETIONS_URL]:
            where = "by batchgen" if key in UNSUPPORTED else f"on {url}"
            raise RequestLineError(f"body.{key} is not supported {where}")
        else:
            raise RequestLineError(f"body.{key}: unrecognized request argument (OpenAI refuses it too)")
    values.pop("model", None)
    _guided_json(values)
    if url == CHAT_URL:
        return _chat_values(values)
    return _completion_values(values)


def _guided_json(values: dict) -> None:
    """vLLM's `guided_json` (a schema) as the response_format it means."""
    schema = values.pop("guided_json", None)
    if schema is None:
        return
    if "response_format" in values:
        raise RequestLineError("body.guided_json and body.response_format are both set; give one")
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise RequestLineError(f"body.guided_json is not JSON ({exc.msg})") from None
    values["response_format"] = {"type": "json_schema", "json_schema": {"schema": schema}}


def _chat_values(values: dict) -> dict:
    if "messages" not in values:
        raise RequestLineError(f"body.messages is required on {CHAT_URL}")
    values["messages"] = _messages(values["messages"])
    new, old = values.pop("max_completion_tokens", None), values.get("max_tokens")
    if new is not None and old is not None and new != old:
        raise RequestLineError(f"body.max_completion_tokens {new!r} and body.max_tokens {old!r} disagree")
    if new is not None:
        values["max_tokens"] = new
    logprobs = values.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise RequestLineError(f"body.logprobs must be true or false on {CHAT_URL}, got {logprobs!r}")
    if values.get("top_logprobs") is not None and logprobs is not True:
        raise RequestLineError("body.top_logprobs needs body.logprobs true")
    return values


def _completion_values(values: dict) -> dict:
    prompt = values.get("prompt")
    if not isinstance(prompt, str):
        what = "a list (one prompt per line, please)" if isinstance(prompt, list) else repr(prompt)
        raise RequestLineError(f"body.prompt must be a string on {COMPLETIONS_URL}, got {what}")
    count = values.pop("logprobs", None)
    if count is not None:
        if isinstance(count, bool) or not isinstance(count, int):
            raise RequestLineError(f"body.logprobs must be an integer (alternatives per token) on "
                                   f"{COMPLETIONS_URL}, got {count!r}")
        values["logprobs"], values["top_logprobs"] = True, count
    return values


def _messages(messages) -> list[dict]:
    """Chat messages with text content (content parts of type "text" joined by newlines)."""
    if not isinstance(messages, list) or not messages:
        raise RequestLineError(f"body.messages must be a non-empty list, got {messages!r:.80}")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise RequestLineError(f"body.messages[{i}] must be an object with a string 'role'")
        extra = sorted(set(msg) - {"role", "content", "name"})
        if extra:
            raise RequestLineError(f"body.messages[{i}]: {extra} not supported (text messages only)")
        out.append({"role": msg["role"], "content": _content(msg.get("content"), i)})
    return out


def _content(content, i: int) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestLineError(f"body.messages[{i}].content must be a string or a list of text parts, "
                               f"got {content!r:.80}")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise RequestLineError(f"body.messages[{i}].content[{j}]: type {kind!r} is not supported "
                                   "(text parts only)")
        texts.append(part["text"])
    return "\n".join(texts)


# ---------------------------------------------------------------- output lines out


def output_line(job_id: str, custom_id: str, url: str, samples: list[dict], *, server_error: bool,
                created: int) -> tuple[dict, bool]:
    """One request's batch output line from its output rows (one per sample, `outputs` columns);
    True when it succeeded (it goes to the output file, else to the errors file)."""
    rid = hashlib.sha256(f"{job_id}\0{custom_id}".encode()).hexdigest()[:24]
    line = {"id": f"batch_req_{rid}", "custom_id": custom_id, "response": None, "error": None}
    failed = next((s for s in samples if s["finish_reason"] == "error"), None)
    if failed is not None:
        kind = "server_error" if server_error else "invalid_request_error"
        body = {"error": {"message": failed["error"], "type": kind, "param": None, "code": None}}
        line["response"] = {"status_code": 500 if server_error else 400, "request_id": f"req_{rid}",
                            "body": body}
        return line, False
    cancelled = next((s for s in samples if s["finish_reason"] == "cancelled"), None)
    if cancelled is not None:
        message = cancelled["error"] or "the batch was cancelled before this request finished"
        line["error"] = {"code": "batch_cancelled", "message": message}
        return line, False
    body = completion_body(rid, url, samples, created)
    line["response"] = {"status_code": 200, "request_id": f"req_{rid}", "body": body}
    return line, True


def completion_body(rid: str, url: str, samples: list[dict], created: int) -> dict:
    """A `chat.completion` or `text_completion` object: one choice per sample, usage summed."""
    samples = sorted(samples, key=lambda s: s.get("sample_index") or 0)
    chat = url == CHAT_URL
    choices = [_chat_choice(i, s) if chat else _text_choice(i, s) for i, s in enumerate(samples)]
    prompt_tokens = int(samples[0]["prompt_tokens"] or 0)
    completion_tokens = sum(int(s["output_tokens"] or 0) for s in samples)
    return {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}",
        "object": "chat.completion" if chat else "text_completion",
        "created": created, "model": samples[0].get("model"), "choices": choices,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }


def _chat_choice(index: int, sample: dict) -> dict:
    entries = sample.get("logprobs")
    logprobs = None if entries is None else {"content": [_chat_logprob(e) for e in entries], "refusal": None}
    message = {"role": "assistant", "content": sample["output_text"], "refusal": None}
    return {"index": index, "message": message, "logprobs": logprobs,
            "finish_reason": sample["finish_reason"]}


def _chat_logprob(entry: dict) -> dict:
    top = [{k: t[k] for k in ("token", "logprob", "bytes")} for t in entry["top_logprobs"] or []]
    return {"token": entry["token"], "logprob": entry["logprob"], "bytes": entry["bytes"],
            "top_logprobs": top}


def _text_choice(index: int, sample: dict) -> dict:
    entries = sample.get("logprobs")
    return {"index": index, "text": sample["output_text"],
            "logprobs": None if entries is None else _legacy_logprobs(entries),
            "finish_reason": sample["finish_reason"]}


def _legacy_logprobs(entries: list[dict]) -> dict:
    """The /v1/completions shape: parallel lists, offsets into the completion text."""
    offsets, at = [], 0
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"] or []} for e in entries],
            "text_offset": offsets}
