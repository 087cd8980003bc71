"""Server-sent events of a streamed answer (``stream: true``), in OpenAI's chunk schemas with vLLM's
token-in/token-out fields.

A turn streams token by token (``TokenStream``): a plain ``/v1`` request's tokens come from its side-work
source (``EvalCall.events``), an episode's from its environment (``AgentEnv.decoded``). A chunk after every
forward that decoded some of its tokens, each with its ``delta`` text, its ``token_ids``
(``return_token_ids``) and its log-probs (``logprobs``); the last chunk has the finish reason;
``prompt_token_ids`` comes in the first chunk only. The concatenation of the chunks is the non-streamed
answer: text, token ids and log-probs. Text is detokenised incrementally and safely (``TextDeltas``): a
trailing partial UTF-8 character is held back until the tokens that complete it come.

A chat turn with tools (a plain request's ``tools``, or an episode's, which a later request may omit) streams
its content token by token until a call may begin (the parser's ``call_start``, ``<tool_call>`` for the
default Hermes parser); the rest of the content and the tool calls, in OpenAI's ``delta.tool_calls`` form
(one delta per call, whole: its arguments are the parsed JSON, so no call goes out before the turn has
parsed), come in the last chunk, from the whole turn, so the chunks concatenate to the non-streamed
``content`` and ``tool_calls``, and a call that does not parse comes as text. A parser without
``call_start``, and a retry of a turn another request streams already, come in one content chunk when the
turn ends (``whole_turn_events``).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from oppo_engine.serve.errors import ApiError

if TYPE_CHECKING:
    from oppo_engine.serve.requests import TurnRequest

STOPPED = ("eos", "stop")  # the last token is the end of turn, an EOS or a stop token: not content
# A chunk that went out cannot be taken back: a turn whose rolled-back step's retry decoded a token already
# streamed differently fails (its episode; a plain request's side work fails on any rollback).
ROLLED_BACK = "the streamed turn was rolled back and decoded differently; open a new episode"


def sse(chunk: dict | str) -> str:
    """One server-sent event."""
    return f"data: {chunk if isinstance(chunk, str) else json.dumps(chunk)}\n\n"


class TextDeltas:
    """Incremental detokenisation of one turn: ``push(ids)`` returns the text the new ids add (possibly
    ``""``); ``final(content_ids)`` the rest of the whole turn's text. The deltas concatenate to
    ``tokenizer.decode(content_ids, skip_special_tokens=True)`` wherever a decode never rewrites the text of
    fewer tokens (byte-level BPE, SentencePiece; not HF's ``clean_up_tokenization_spaces``).

    vLLM's window: the tokens since the last text that went out are decoded together with the tokens of that
    text (``ids[prefix:]`` against ``ids[prefix:read]``), so a tokenizer that drops a leading space at the
    start of a decode (SentencePiece) still gives the right delta, and each push costs the window, not the
    whole turn. A delta that ends in a partial UTF-8 character (``\ufffd``) is held back until the tokens
    that complete it come; ``final`` decodes the whole content once, so the concatenation is exact."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.ids, self.sent = tokenizer, [], ""
        self.prefix = self.read = 0  # ids[prefix:read]: the tokens of the last text sent

    def push(self, ids: list[int]) -> str:
        self.ids += ids
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix : self.read], skip_special_tokens=True)
        text = decode(self.ids[self.prefix :], skip_special_tokens=True)
        # A decode that rewrites text already sent (a tokenizer's clean-up of spaces) cannot be taken back:
        # the text beyond what the two share goes out, and the window moves on all the same (held, it would
        # grow with the turn: a quadratic cost).
        common = len(os.path.commonprefix([text, before]))
        if text.endswith("\ufffd") or len(text) == common:
            return ""
        delta = text[common:]
        self.prefix, self.read, self.sent = self.read, len(self.ids), self.sent + delta
        return delta

    def final(self, content_ids: list[int]) -> str:
        decode = self.tokenizer.decode
        text = decode(content_ids, skip_special_tokens=True)
        # NOTE: what went out is the start of the whole text wherever a decode of a window is the matching
        # slice of the whole (byte-level BPE, SentencePiece): the rest completes it exactly. Where a decode
        # rewrote text that went out, the client's text cannot be exact: the rest is the whole text beyond the
        # tokens whose text went out (or else beyond what the two share), never the whole text again.
        if text.startswith(self.sent):
            delta = text[len(self.sent) :]
        else:
            read = self.read if content_ids[: self.read] == self.ids[: self.read] else 0
            done = decode(content_ids[:read], skip_special_tokens=True)
            if not (read and text.startswith(done)):
                done = os.path.commonprefix([text, self.sent])
            delta = text[len(done) :]
        self.sent = text
        return delta


class TokenStream:
    """The chunks of one streamed turn, built from ``queue``'s events (of the serving loop):
    ``("tokens", ids, logprobs)`` as they are decoded, then ``("done", ids, logprobs, content_ids, finish)``
    (the whole turn, ``content_ids`` its text's tokens) or ``("error", ApiError)``. ``name``: the response
    id's tail; ``prompt``: the ids before the turn; ``gone(message)``: the client went away mid-turn."""

    def __init__(
        self, server, req: TurnRequest, name: str, prompt: list[int], queue, gone, *, tools: bool = False,
        turn: int = 0,
    ) -> None:  # fmt: skip
        self.req, self.tokenizer, self.prompt = req, server.tokenizer, prompt
        self.queue, self.gone = queue, gone
        self.chat = req.kind == "chat"
        self.responses, self.turn = server.responses, turn
        # A chat turn with tools (``turn``: its index, for the calls' ids): its content goes out as it comes
        # while no call can have begun; from the parser's first ``call_start`` on, the rest comes when the
        # turn ends, with the calls (``_content``).
        self.call_start = streamed_calls(server) if tools and self.chat else None
        self.turn_text = ""  # the turn's text so far (tools)
        self.content_sent = ""  # the content that went out (tools)
        self.in_call = False
        self.text = TextDeltas(server.tokenizer)
        self.head = {
            "id": f"{'chatcmpl' if self.chat else 'cmpl'}-{name}",
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": int(time.time()),
            "model": server.responses.model,
        }
        self.ids: list[int] = []
        self.offset = 0  # completions' text_offset of the next token
        self.prompt_sent = False

    async def events(self) -> AsyncIterator[str]:
        """The response body."""
        finished = False
        try:
            if self.chat:
                yield sse(self._chunk("", [], [], None))  # the role, and the prompt's ids
            while True:
                kind, *payload = await self.queue.get()
                if kind == "error":
                    finished = True
                    yield sse(payload[0].body())
                    return
                if kind == "tokens":
                    ids, lps = payload
                    self.ids += ids
                    text = self.text.push(ids)
                    if self.call_start is not None:
                        text = self._content(text)
                    yield sse(self._chunk(text, ids, lps, None))
                    continue
                ids, lps, content, finish = payload  # the whole turn, with its last token
                if ids[: len(self.ids)] != self.ids:
                    self.gone(ROLLED_BACK)  # (AgentEnv.decoded sees most; this, the turn's last forward)
                    finished = True
                    yield sse(ApiError(410, ROLLED_BACK, code="episode_failed").body())
                    return
                finished = True
                new, new_lps = ids[len(self.ids) :], lps[len(self.ids) :]
                if self.call_start is not None:
                    yield sse(self._last_with_calls(content, new, new_lps, finish))
                else:
                    yield sse(self._chunk(self.text.final(content), new, new_lps, finish))
                if self.req.include_usage:
                    n = len(self.prompt)
                    usage = {"prompt_tokens": n, "completion_tokens": len(ids), "total_tokens": n + len(ids)}
                    yield sse({**self.head, "choices": [], "usage": usage})
                yield sse("[DONE]")
                return
        finally:
            if not finished:
                self.gone("its client disconnected while its turn was streamed")

    def _content(self, delta: str) -> str:
        """Tools: what of the turn's new text ``delta`` surely is content, and goes out now. That is the text
        before the first ``call_start`` (a partial ``call_start`` at the end is held back), and only once it
        is not all whitespace (a turn whose text outside its calls is whitespace has no content): whatever
        the calls turn out to be, the content of the whole turn starts with it (see ``ToolParser``)."""
        if self.in_call:
            return ""
        self.turn_text += delta
        text, start = self.turn_text, self.call_start
        at = text.find(start, max(0, len(self.content_sent) - len(start)))
        if at >= 0:
            self.in_call = True
        else:
            at = len(text) - next((k for k in range(len(start) - 1, 0, -1) if text.endswith(start[:k])), 0)
        safe = text[:at]
        if not safe.strip():
            return ""
        new, self.content_sent = safe[len(self.content_sent) :], safe
        return new

    def _last_with_calls(self, content_ids: list[int], ids: list[int], lps: list[float], finish: str) -> dict:
        """Tools: the last chunk, from the whole turn as the non-streamed answer has it: the content not yet
        sent, and the tool calls (each whole, with its index: arguments are the parsed JSON, re-serialised, so
        no call goes out before it has parsed), with the same finish reason."""
        text = self.tokenizer.decode(content_ids, skip_special_tokens=True)
        message, finish = self.responses.chat_message(text, True, self.turn, finish)
        content, sent = message["content"] or "", self.content_sent
        done = len(sent) if content.startswith(sent) else len(os.path.commonprefix([content, sent]))
        chunk = self._chunk(content[done:], ids, lps, finish)
        if message.get("tool_calls"):
            calls = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
            chunk["choices"][0]["delta"]["tool_calls"] = calls
        return chunk

    def _chunk(self, text: str, ids: list[int], lps: list[float], finish: str | None) -> dict:
        req = self.req
        if self.chat:
            delta = {"content": text} if text or ids or finish else {"role": "assistant", "content": ""}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            if req.logprobs and ids:
                content = [self._chat_logprob(t, lp) for t, lp in zip(ids, lps, strict=True)]
                choice["logprobs"] = {"content": content}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            if req.logprobs:
                tokens = [self.tokenizer.decode([t]) for t in ids]
                offsets = []
                for tok in tokens:
                    offsets.append(self.offset)
                    self.offset += len(tok)
                choice["logprobs"] = {
                    "tokens": tokens,
                    "token_logprobs": list(lps),
                    "top_logprobs": None,
                    "text_offset": offsets,
                }
        chunk = {**self.head, "choices": [choice]}
        if req.return_token_ids:
            choice["token_ids"] = list(ids)
            if not self.prompt_sent:
                # vLLM's places: the chunk's top level (chat), the choice (completions)
                (choice if not self.chat else chunk)["prompt_token_ids"] = list(self.prompt)
        self.prompt_sent = True
        return chunk

    def _chat_logprob(self, token: int, logprob: float) -> dict:
        text = self.tokenizer.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": []}


def streamed_calls(server) -> str | None:
    """The text that opens a tool call if the server's parser streams (``call_start``); else ``None``: a turn
    with tools comes whole."""
    return getattr(server.responses.tool_parser, "call_start", None)


def whole_turn_events(answer: dict, include_usage: bool) -> list[str]:
    """A whole answer as server-sent events, as vLLM streams one: the turn in one content chunk with
    ``token_ids`` and, in the first chunk only, ``prompt_token_ids``; then the finish reason; the usage if
    asked; then ``[DONE]``."""
    choice = answer["choices"][0]
    chat = "message" in choice
    head = {k: answer[k] for k in ("id", "created", "model")}
    head["object"] = "chat.completion.chunk" if chat else "text_completion"
    if chat:
        delta = dict(choice["message"])
        if delta.get("tool_calls"):
            delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(delta["tool_calls"])]
        first = {"index": 0, "delta": delta, "logprobs": choice["logprobs"], "finish_reason": None}
        last = {"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}
    else:
        first = {k: v for k, v in choice.items() if k != "prompt_token_ids"} | {"finish_reason": None}
        last = {"index": 0, "text": "", "logprobs": None, "finish_reason": choice["finish_reason"]}
    if "token_ids" in choice:
        first["token_ids"] = choice["token_ids"]
    chunks = [{**head, "choices": [first]}]
    if "prompt_token_ids" in answer:
        chunks[0]["prompt_token_ids"] = answer["prompt_token_ids"]
    if "prompt_token_ids" in choice:
        first["prompt_token_ids"] = choice["prompt_token_ids"]
    chunks.append({**head, "choices": [last]})
    if include_usage:
        chunks.append({**head, "choices": [], "usage": answer["usage"]})
    return [sse(c) for c in chunks] + [sse("[DONE]")]
