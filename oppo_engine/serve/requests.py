"""Request bodies of ``/v1/chat/completions`` and ``/v1/completions`` checked into a ``TurnRequest``.

What the engine cannot honour exactly is refused with 400 naming the field (multi-token ``stop`` strings,
``logit_bias``, penalties, ``response_format``, a forced ``tool_choice``, ``top_logprobs``, ``n > 1``,
``ignore_eos`` on an episode); a known field of the wrong type is 400 too; unknown fields are ignored, as vLLM
ignores them."""

from __future__ import annotations

import json
import numbers
from dataclasses import dataclass
from typing import Any

from oppo_engine.serve.chat import normalise
from oppo_engine.serve.errors import ApiError


@dataclass(slots=True)
class TurnRequest:
    """One request of an episode. ``messages`` (chat, normalised) or ``prompt`` (completions: text or token
    ids); the sampling fields as given (``None``: not given); ``key`` identifies a repeat of it."""

    kind: str  # "chat" | "completions"
    model: str | None
    messages: list[dict] | None
    prompt: str | list[int] | None
    tools: list | None
    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    seed: int | None
    stop_token_ids: tuple[int, ...]
    logprobs: bool
    return_token_ids: bool
    key: str
    stream: bool = False  # the answer as server-sent events, token by token (serve/stream.py)
    include_usage: bool = False
    ignore_eos: bool = False  # vLLM's: only max_tokens (and stop ids) end it; plain /v1 requests only


def _number(body: dict, name: str, low: float, high: float, *, low_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ApiError(400, f"{name} must be a number, got {value!r}", param=name)
    if not (low < value if low_open else low <= value) or value > high:
        raise ApiError(400, f"{name}={value} is outside {'(' if low_open else '['}{low}, {high}]", param=name)
    return float(value)


def _int(body: dict, name: str, low: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ApiError(400, f"{name} must be an integer >= {low}, got {value!r}", param=name)
    return value


def _refuse_unsupported(body: dict) -> None:
    if body.get("n") not in (None, 1):
        raise ApiError(
            400, f"n={body['n']!r}: an episode is one conversation; open n episodes instead", param="n"
        )
    if body.get("logit_bias"):
        raise ApiError(400, "logit_bias changes the sampled distribution: not supported", param="logit_bias")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise ApiError(400, f"{name} is not supported (the engine samples without penalties)", param=name)
    if body.get("repetition_penalty") not in (None, 1, 1.0):
        raise ApiError(400, "repetition_penalty is not supported", param="repetition_penalty")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise ApiError(
            400, "response_format is not supported (no constrained decoding)", param="response_format"
        )
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise ApiError(
            400, f"tool_choice={choice!r}: only 'auto' and 'none' (no forced calls)", param="tool_choice"
        )
    if body.get("top_logprobs") not in (None, 0):
        raise ApiError(
            400,
            "top_logprobs is not supported: the engine keeps the sampled token's only",
            param="top_logprobs",
        )
    if body.get("echo"):
        raise ApiError(400, "echo is not supported", param="echo")
    if body.get("best_of") not in (None, 1):
        raise ApiError(400, "best_of is not supported", param="best_of")


def _stop_ids(body: dict, tokenizer) -> tuple[int, ...]:
    ids: list[int] = []
    stop = body.get("stop")
    if stop is not None:
        texts = [stop] if isinstance(stop, str) else stop
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise ApiError(400, "stop must be a string or a list of strings", param="stop")
        for text in texts:
            encoded = tokenizer.encode(text, add_special_tokens=False)
            if len(encoded) != 1:
                raise ApiError(
                    400,
                    f"stop={text!r} is {len(encoded)} tokens: only single-token stop strings are supported "
                    "(or stop_token_ids)",
                    param="stop",
                )
            ids.append(int(encoded[0]))
    extra = body.get("stop_token_ids")
    if extra is not None:
        if not isinstance(extra, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in extra
        ):
            raise ApiError(400, "stop_token_ids must be a list of token ids", param="stop_token_ids")
        ids.extend(extra)
    return tuple(sorted(set(ids)))


def parse_turn(body: Any, kind: str, tokenizer, vocab_size: int) -> TurnRequest:
    """``body`` (parsed JSON) as a ``TurnRequest``, or ``ApiError`` 400 naming the field."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _refuse_unsupported(body)
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be a boolean", param="stream")
    ignore_eos = body.get("ignore_eos") or False
    if not isinstance(ignore_eos, bool):
        raise ApiError(400, "ignore_eos must be a boolean", param="ignore_eos")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object", param="stream_options")
    messages = prompt = None
    if kind == "chat":
        messages = normalise(body.get("messages"))
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list | str):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, list):
            if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise ApiError(
                    400, "prompt must be a string or a non-empty list of token ids", param="prompt"
                )
            bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise ApiError(
                    400,
                    f"prompt holds token id {bad}, outside the vocabulary [0, {vocab_size})",
                    param="prompt",
                )
        elif not isinstance(prompt, str) or not prompt:
            raise ApiError(400, "prompt must be a non-empty string or a list of token ids", param="prompt")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ApiError(400, "tools must be a list of tool definitions", param="tools")
    if body.get("tool_choice") == "none":
        tools = None
    max_tokens = _int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1)
    logprobs = body.get("logprobs")
    if kind == "completions":
        if logprobs is not None and (
            isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs > 1
        ):
            raise ApiError(400, "logprobs: only 0 or 1 (the sampled token's)", param="logprobs")
        logprobs = bool(logprobs is not None)
    elif logprobs is not None and not isinstance(logprobs, bool):
        raise ApiError(400, f"logprobs must be a boolean, got {logprobs!r}", param="logprobs")
    return_ids = body.get("return_token_ids", False)
    if not isinstance(return_ids, bool):
        raise ApiError(400, "return_token_ids must be a boolean", param="return_token_ids")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise ApiError(400, f"seed must be an integer >= 0, got {seed!r}", param="seed")
    model = body.get("model")
    request = TurnRequest(
        kind=kind,
        model=model if isinstance(model, str) else None,
        messages=messages,
        prompt=prompt,
        tools=tools,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 0.0, 2.0),
        top_p=_number(body, "top_p", 0.0, 1.0, low_open=True),
        seed=seed,
        stop_token_ids=_stop_ids(body, tokenizer),
        logprobs=bool(logprobs),
        return_token_ids=return_ids,
        key="",
        stream=stream,
        include_usage=bool(options.get("include_usage")),
        ignore_eos=ignore_eos,
    )
    request.key = json.dumps(
        [
            kind,
            messages,
            prompt,
            tools,
            max_tokens,
            request.temperature,
            request.top_p,
            seed,
            request.stop_token_ids,
            request.logprobs,
            return_ids,
        ],
        sort_keys=True,
        default=str,
    )
    return request
