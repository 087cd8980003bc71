"""Conversations at the token level: messages normalised and rendered by the tokenizer's chat template, the
suffix that new messages add after the sampled turns, and the tool calls of a turn's text.

An episode's tokens are its first request's rendered prompt, then each turn as sampled, then the template's
suffix for the messages a later request adds: rendered with and without them, the difference taken after the
last end-of-turn token of the shorter render (``ToolEnv.tool_suffix_ids`` does the same). The sampled ids
are never re-encoded, so the text of a turn may re-tokenise to other ids and nothing changes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from oppo_engine.env.tools import _parse_call
from oppo_engine.serve.errors import ApiError

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

# A tool-call parser: a turn's text -> (content, [(name, arguments dict)]), or None when the text holds a
# call that does not parse (the text is then returned as it is, never dropped). One with a ``call_start``
# attribute (the text that opens a call) has its turns streamed token by token (serve/stream.py): the content
# it returns must start with the text before the first ``call_start`` and be ``None`` only when the text
# outside its calls is whitespace; without it, a turn with tools comes whole.
ToolParser = Callable[[str], "tuple[str | None, list[tuple[str, dict]]] | None"]


def hermes_tool_parser(text: str) -> tuple[str | None, list[tuple[str, dict]]] | None:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes, Qwen2.5, ``ToolEnv``):
    the text outside them, as it is (``None`` if only whitespace: vLLM's Hermes parser keeps the text before
    the first call as it is too), and the calls; ``None`` if a block does not parse. Streamable
    (``call_start``)."""
    blocks = _TOOL_CALL.findall(text)
    if not blocks:
        return (text or None), []
    calls = []
    for block in blocks:
        name, arguments, error = _parse_call(block)
        if error is not None:
            return None
        calls.append((name, arguments))
    content = _TOOL_CALL.sub("", text)
    return (content if content.strip() else None), calls


hermes_tool_parser.call_start = "<tool_call>"


def normalise(messages: Any) -> list[dict]:
    """Request messages as the history compares and the template renders them: ``content=None`` is ``""``,
    a list of text parts is their concatenation, tool-call arguments are parsed JSON where they parse.
    ``ApiError`` 400 naming the message that is malformed."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of message objects", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"{where} must be an object with a string role", param=where)
        msg: dict = {"role": m["role"], "content": _content(m.get("content"), where)}
        if m.get("name") is not None:
            msg["name"] = str(m["name"])
        if m.get("tool_call_id") is not None:
            msg["tool_call_id"] = str(m["tool_call_id"])
        calls = m.get("tool_calls")
        if calls:
            if not isinstance(calls, list):
                raise ApiError(400, f"{where}.tool_calls must be a list", param=f"{where}.tool_calls")
            msg["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
        out.append(msg)
    return out


def _content(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise ApiError(
                    400, f"{where}.content[{j}]: only text parts are supported", param=f"{where}.content"
                )
            parts.append(part["text"])
        return "".join(parts)
    raise ApiError(400, f"{where}.content must be a string, a list of text parts or null", param=where)


def _tool_call(call: Any, where: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ApiError(
            400, f"{where} must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}"
        )
    arguments = fn.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            pass  # compared and rendered as the text it is
    return {
        "id": str(call.get("id", "")),
        "type": "function",
        "function": {"name": fn["name"], "arguments": arguments},
    }


def same_message(a: dict, b: dict) -> bool:
    """Two normalised messages are the same turn of a conversation: role, content and tool calls (by id, name
    and arguments); names and tool-call ids of tool messages too."""
    return a == b


def first_difference(history: list[dict], messages: list[dict]) -> int | None:
    """The index of the first message of ``messages`` that differs from ``history`` (or ``len(messages)``
    when it is shorter than the history); ``None`` when it extends the history."""
    for i, h in enumerate(history):
        if i >= len(messages) or not same_message(h, messages[i]):
            return i
    return None


class Renderer:
    """The tokenizer's chat template over normalised messages (with the episode's ``tools``)."""

    def __init__(self, tokenizer, turn_end_token_id: int) -> None:
        self.tokenizer = tokenizer
        self.turn_end = turn_end_token_id

    def render(self, messages: list[dict], tools: list | None, *, generation_prompt: bool) -> list[int]:
        try:
            ids = self.tokenizer.apply_chat_template(
                messages,
                tools=tools or None,
                add_generation_prompt=generation_prompt,
                tokenize=True,
                return_dict=False,
            )
        except Exception as e:  # a template error is the request's (a role the template does not know, ...)
            raise ApiError(
                400, f"the chat template cannot render these messages: {type(e).__name__}: {e}"
            ) from None
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def suffix(
        self, history: list[dict], new: list[dict], tools: list | None, *, turn_closed: bool
    ) -> list[int]:
        """The tokens ``new`` messages add after ``history`` (whose last message is the assistant's turn as
        sampled), the next generation prompt included: the render with them, after the render without them
        cut at its last end-of-turn token. ``turn_closed=False`` (the turn was cut by its token limit, so it
        lacks the end-of-turn token): the suffix starts with that token."""
        before = self.render(history, tools, generation_prompt=False)
        ends = [i for i, t in enumerate(before) if t == self.turn_end]
        if not ends:
            raise ApiError(400, "the chat template renders an assistant turn without its end-of-turn token")
        before = before[: ends[-1] + 1]
        after = self.render(history + new, tools, generation_prompt=True)
        if after[: len(before)] != before:
            raise ApiError(
                400,
                "the chat template rewrites earlier turns when these messages are added: their tokens "
                "cannot be appended to what the model sampled",
            )
        suffix = after[len(before) :]
        return suffix if turn_closed else [self.turn_end, *suffix]
