"""``ToolEnv``: Python functions as the tools of a chat model, at the token level (TRL's ``tools=``).

A turn is the model's assistant message, ended by the template's end-of-turn token. Its text is parsed for
tool calls (``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, Qwen2/Hermes style, or a whole
message that is one ``{"name": ..., "parameters"|"arguments": ...}`` object, Llama 3.1 style); each call
runs, and its result goes back as a tool message rendered by the tokenizer's chat template. Only the
tokens that the tool messages add are appended: the conversation is rendered with and without them and
the difference taken (TRL's ``tool_suffix_ids``), so nothing already in the sequence is re-encoded. That
is exact only for a template that never rewrites earlier turns when a message is added: ``ToolEnv``
checks that when it is built and refuses a template that does. A turn without a tool call ends the
episode (``done=True``, nothing appended).

An unknown tool, arguments the function does not take, or a tool that raises: the error goes back to the
model as that tool's output, as TRL does, and the episode goes on.
"""

from __future__ import annotations

import inspect
import json
import re
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from oppo_engine.env.protocol import Observation

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
# Templates found append-only, per tokenizer: a check renders a few conversations, so each runs once.
_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class ToolEnv:
    """An environment whose observations are the results of ``tools`` called by the model.

    ``tokenizer`` is the actor's HF tokenizer, with a chat template that renders tool calls and tool
    messages (``chat_template`` overrides it). ``tools`` are Python functions with type hints and a
    Google-style docstring (their JSON schemas are what the template shows the model, as
    ``apply_chat_template(tools=...)`` makes them); ``async def`` ones run on the engine's event loop.
    ``turn_end_token_id`` is the token that ends the model's turn (default: the tokenizer's EOS, as TRL
    assumes): use ``turn_stop_token_ids`` in ``SamplingParams``, and give the engine another EOS (or
    ``eos_token_id=()``), since EOS ends an episode without a call. Build the prompts with
    ``prompt_ids(messages)``, which renders the tools into them. ``ValueError`` (naming the tool or the
    template's defect) for a tool without hints or docstring, or a template that rewrites earlier turns.
    """

    def __init__(
        self,
        tokenizer,
        tools: Sequence[Callable[..., Any]],
        *,
        chat_template: str | None = None,
        turn_end_token_id: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        tools = list(tools)
        if not tools:
            raise ValueError("ToolEnv: tools is empty; give at least one function")
        self.tools = {_tool_name(fn): fn for fn in tools}
        if len(self.tools) != len(tools):
            raise ValueError(f"ToolEnv: two tools share a name: {[_tool_name(fn) for fn in tools]}")
        self.schemas = [_schema(fn) for fn in tools]
        turn_end = tokenizer.eos_token_id if turn_end_token_id is None else turn_end_token_id
        if turn_end is None:
            raise ValueError("ToolEnv: the tokenizer has no EOS token: pass turn_end_token_id=")
        self.turn_end_token_id = int(turn_end)
        self._check_append_only()

    @property
    def turn_stop_token_ids(self) -> tuple[int, ...]:
        """For ``SamplingParams(turn_stop_token_ids=...)``: the token that ends the model's turn."""
        return (self.turn_end_token_id,)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """A conversation's token ids as the first turn's prompt: the tools rendered in, the assistant's
        generation prompt after it."""
        return self._render(messages, add_generation_prompt=True)

    # -- the Env protocol --------------------------------------------------------------------------------

    def reset(self, prompt_ids: list[int]) -> None:
        """Nothing to set up: the tools keep no state of their own here."""

    def step(self, turn_ids: list[int]):
        """Run the tool calls of the turn; their results as the observation (a coroutine when a called tool
        is async). A turn without a tool call ends the episode."""
        text = self.tokenizer.decode(turn_ids, skip_special_tokens=False)
        calls = parse_tool_calls(text)
        if not calls:
            return Observation([], done=True)
        if any(inspect.iscoroutinefunction(self.tools.get(name)) for name, _, _ in calls):
            return self._step_async(calls)
        return Observation(self.tool_suffix_ids([self._run(call) for call in calls]))

    async def _step_async(self, calls):
        results = []
        for name, arguments, error in calls:
            fn = self.tools.get(name)
            if error is None and inspect.iscoroutinefunction(fn):
                results.append(await _call_async(name, fn, arguments))
            else:
                results.append(self._run((name, arguments, error)))
        return Observation(self.tool_suffix_ids(results))

    # -- rendering ---------------------------------------------------------------------------------------

    def tool_suffix_ids(self, results: list[tuple[str, str]]) -> list[int]:
        """The tokens the tool messages ``(name, content)`` add after an assistant turn that called them,
        the next assistant turn's generation prompt included: rendered with and without them, the prefix
        cut after its last end-of-turn token (what the model sampled ends there)."""
        messages = _probe_turn(results[0][0])
        prefix = self._render(messages, add_generation_prompt=False)
        tool_messages = [{"role": "tool", "name": name, "content": content} for name, content in results]
        full = self._render(messages + tool_messages, add_generation_prompt=True)
        ends = [i for i, t in enumerate(prefix) if t == self.turn_end_token_id]
        if not ends:
            raise ValueError(
                f"ToolEnv: the chat template renders an assistant turn without turn_end_token_id="
                f"{self.turn_end_token_id}: pass the token that ends the model's turn"
            )
        prefix = prefix[: ends[-1] + 1]
        if full[: len(prefix)] != prefix:
            raise ValueError(
                "ToolEnv: the chat template rewrites the assistant turn when a tool message follows it: the "
                "tool message's tokens cannot be appended to what the model sampled"
            )
        return full[len(prefix) :]

    def _render(self, messages: list[dict], *, add_generation_prompt: bool) -> list[int]:
        ids = self.tokenizer.apply_chat_template(
            messages, tools=self.schemas, chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False,
        )  # fmt: skip
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def _check_append_only(self) -> None:
        """Refuse a template that rewrites earlier turns when one is added: a conversation of a user message,
        a tool call, its result and an answer must render as each shorter one followed by what it adds."""
        key = (self.chat_template or getattr(self.tokenizer, "chat_template", None), tuple(self.tools))
        checked = _CHECKED.get(self.tokenizer) if _weakrefable(self.tokenizer) else None
        if checked is not None and key in checked:
            return
        name = next(iter(self.tools))
        turn = _probe_turn(name)
        answer = {"role": "assistant", "content": "done"}
        tool = {"role": "tool", "name": name, "content": "1"}
        self.tool_suffix_ids([(name, "1")])  # the assistant turn is kept when a tool message follows
        before = self._render([*turn, tool], add_generation_prompt=True)
        after = self._render([*turn, tool, answer], add_generation_prompt=False)
        if after[: len(before)] != before:
            raise ValueError(
                "ToolEnv: the chat template rewrites the tool message or the generation prompt when the "
                "assistant answers after it: a turn's tokens cannot be appended to the observation's"
            )
        first = self._render(turn[:1], add_generation_prompt=True)
        if self._render(turn, add_generation_prompt=False)[: len(first)] != first:
            raise ValueError(
                "ToolEnv: the chat template rewrites the user's message when an assistant turn follows it"
            )
        if _weakrefable(self.tokenizer):
            _CHECKED.setdefault(self.tokenizer, set()).add(key)

    def _run(self, call: tuple[str, Any, str | None]) -> tuple[str, str]:
        """``(name, content)`` of one call: the tool's result as text, or the error, for the model."""
        name, arguments, error = call
        if error is not None:
            return name, error
        fn = self.tools.get(name)
        if fn is None:
            return name, f"error: unknown tool {name!r}; the tools are {', '.join(self.tools)}"
        bad = _bad_arguments(name, fn, arguments)
        if bad is not None:
            return name, bad
        try:
            return name, str(fn(**arguments))
        except Exception as e:  # the tool's own failure goes back to the model
            return name, f"error: tool {name!r} raised {type(e).__name__}: {e}"


def parse_tool_calls(text: str) -> list[tuple[str, Any, str | None]]:
    """The tool calls of a turn's text as ``(name, arguments, error)``: ``<tool_call>`` blocks, else the
    whole text as one JSON object with ``name`` and ``arguments`` (or ``parameters``); a block that is not
    such an object gives ``error`` instead (it goes back to the model). Empty: no tool call."""
    blocks = _TOOL_CALL.findall(text)
    if blocks:
        return [_parse_call(block) for block in blocks]
    stripped = re.sub(r"<\|[^|>]*\|>", "", text).strip()  # the template's special tokens
    if stripped.startswith("{"):
        name, arguments, error = _parse_call(stripped)
        if error is None:
            return [(name, arguments, None)]
    return []


def _parse_call(block: str) -> tuple[str, Any, str | None]:
    try:
        obj = json.loads(block)
    except json.JSONDecodeError as e:
        return "", None, f"error: the tool call is not valid JSON ({e.msg} at character {e.pos})"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return "", None, 'error: a tool call is a JSON object {"name": ..., "arguments": {...}}'
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # some templates render the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return obj["name"], None, f"error: the arguments of tool {obj['name']!r} must be a JSON object"
    return obj["name"], arguments, None


def _bad_arguments(name: str, fn: Callable, arguments: dict) -> str | None:
    """Why ``fn`` cannot be called with ``arguments`` (missing or unknown names), or None."""
    try:
        inspect.signature(fn).bind(**arguments)
    except TypeError as e:
        return f"error: bad arguments for tool {name!r}: {e}"
    return None


async def _call_async(name: str, fn: Callable, arguments: dict) -> tuple[str, str]:
    bad = _bad_arguments(name, fn, arguments)
    if bad is not None:
        return name, bad
    try:
        return name, str(await fn(**arguments))
    except Exception as e:
        return name, f"error: tool {name!r} raised {type(e).__name__}: {e}"


def _probe_turn(name: str) -> list[dict]:
    """A user message and an assistant turn that calls ``name``: what tool messages are rendered after."""
    call = {"type": "function", "function": {"name": name, "arguments": {}}}
    return [
        {"role": "user", "content": "dummy"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
    ]


def _tool_name(fn: Callable) -> str:
    if not callable(fn) or not hasattr(fn, "__name__"):
        raise ValueError(f"ToolEnv: a tool must be a function, got {fn!r}")
    return fn.__name__


def _schema(fn: Callable) -> dict:
    """``fn``'s JSON schema, as ``apply_chat_template(tools=[fn])`` would make it."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:  # transformers raises its own error types for missing hints or docstrings
        raise ValueError(
            f"ToolEnv: tool {fn.__name__!r} needs type hints on every argument and a docstring describing "
            f"them (Google style): {e}"
        ) from None


def _weakrefable(obj: object) -> bool:
    try:
        weakref.ref(obj)
    except TypeError:
        return False
    return True
