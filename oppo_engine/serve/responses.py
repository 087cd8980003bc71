"""Response bodies in OpenAI's schemas, with vLLM's token-in/token-out fields (``return_token_ids: true``:
chat responses carry a top-level ``prompt_token_ids`` and ``choices[i].token_ids``; completions both in each
choice).

The log-probs are ``Rollout.logprobs``: the behaviour log-probs of the distribution the token was drawn from,
after temperature and top-p (vLLM returns the raw model's by default).
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

from oppo_engine.serve.chat import ToolParser

if TYPE_CHECKING:
    from oppo_engine.serve.episode import ServedEpisode


class Responses:
    """Builds the responses of one server: ``model`` is the name it answers with."""

    def __init__(self, tokenizer, model: str, tool_parser: ToolParser) -> None:
        self.tokenizer, self.model, self.tool_parser = tokenizer, model, tool_parser

    def build(
        self,
        episode: ServedEpisode,
        prompt_ids: list[int],
        turn_ids: list[int],
        logprobs: list[float],
        text: str,
        finish: str,
    ) -> dict:
        req = episode.pending_req
        usage = {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(turn_ids),
            "total_tokens": len(prompt_ids) + len(turn_ids),
        }
        if episode.kind == "completions":
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            if req.logprobs:
                tokens = [self.tokenizer.decode([t]) for t in turn_ids]
                offsets, at = [], 0
                for tok in tokens:
                    offsets.append(at)
                    at += len(tok)
                choice["logprobs"] = {
                    "tokens": tokens,
                    "token_logprobs": logprobs,
                    "top_logprobs": None,
                    "text_offset": offsets,
                }
            if req.return_token_ids:
                choice["prompt_token_ids"], choice["token_ids"] = prompt_ids, turn_ids
            return {
                "id": f"cmpl-{episode.id}-{episode.turn}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": self.model,
                "choices": [choice],
                "usage": usage,
            }
        message, finish = self.chat_message(text, bool(episode.tools), episode.turn, finish)
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
        if req.logprobs:
            choice["logprobs"] = {
                "content": [
                    {
                        "token": (tok := self.tokenizer.decode([t])),
                        "logprob": lp,
                        "bytes": list(tok.encode()),
                        "top_logprobs": [],
                    }
                    for t, lp in zip(turn_ids, logprobs, strict=True)
                ]
            }
        if req.return_token_ids:
            choice["token_ids"] = turn_ids
        body = {
            "id": f"chatcmpl-{episode.id}-{episode.turn}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [choice],
            "usage": usage,
        }
        if req.return_token_ids:
            body["prompt_token_ids"] = prompt_ids
        return body

    def chat_message(self, text: str, tools: bool, turn: int, finish: str) -> tuple[dict, str]:
        """A chat turn's message and finish reason: with ``tools``, its calls parsed (``"tool_calls"`` for a
        turn that stopped with some); a call that does not parse leaves the whole text as the content."""
        message: dict = {"role": "assistant", "content": text}
        parsed = self.tool_parser(text) if tools else None
        if parsed is not None and parsed[1]:
            content, calls = parsed
            message["content"] = content
            # NOTE: ids from (turn, index): deterministic, and unique within the conversation (their scope).
            message["tool_calls"] = [
                {
                    "id": f"call_{turn}_{i}",
                    "type": "function",
                    "function": {"name": name, "arguments": json.dumps(arguments)},
                }
                for i, (name, arguments) in enumerate(calls)
            ]
            if finish == "stop":
                finish = "tool_calls"
        return message, finish

    @staticmethod
    def assistant_message(response: dict) -> dict:
        """The answer as the episode's history holds it (normalised, as the agent will send it back)."""
        message = response["choices"][0]["message"]
        out = {"role": "assistant", "content": message["content"] or ""}
        if message.get("tool_calls"):
            out["tool_calls"] = [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {
                        "name": c["function"]["name"],
                        "arguments": json.loads(c["function"]["arguments"]),
                    },
                }
                for c in message["tool_calls"]
            ]
        return out
