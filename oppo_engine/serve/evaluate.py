"""Requests to the plain ``/v1`` routes (no episode): served for evaluation, never trained on.

Such a request is decoded while ``step()`` runs, as an episode's are, but as side work of the step loop
(``sched/side.py``; its source is ``serve/evals.py``): it never becomes a ``Rollout``, never takes a place of
the batch, and its pages are freed when it ends. It is one turn: the template's end of turn (or an EOS id, or
a ``stop`` token) ends it, ``max_tokens`` (else ``SamplingParams.max_new_tokens``) bounds it; with vLLM's
``ignore_eos`` only ``max_tokens`` and the request's ``stop`` ids end it.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import TYPE_CHECKING

from oppo_engine.config import SamplingParams
from oppo_engine.serve.errors import ApiError
from oppo_engine.serve.requests import TurnRequest
from oppo_engine.serve.stream import STOPPED

if TYPE_CHECKING:
    from oppo_engine.sched.sequence import Sequence
    from oppo_engine.serve.server import ServeHandle

_IDS = itertools.count(1)


class EvalCall:
    """One plain request in flight. It answers ``Responses.build`` as an episode of one turn would (``id``,
    ``kind``, ``turn``, ``tools``, ``pending_req``); ``answer`` is its response, a future of the serving
    loop. A streamed one (``stream=True``) has ``events`` instead, a queue of the serving loop for a
    ``TokenStream`` (``serve/stream.py``)."""

    def __init__(self, server: ServeHandle, req: TurnRequest, stream: bool = False) -> None:
        self.server, self.pending_req, self.kind, self.tools = server, req, req.kind, req.tools
        self.id, self.turn = f"eval{next(_IDS)}", 0
        self.answer: asyncio.Future = asyncio.get_running_loop().create_future()
        self.events: asyncio.Queue | None = asyncio.Queue() if stream else None
        self.prompt: list[int] = []
        self.eval_id: int | None = None

    def done(self, seq: Sequence | None, error: str | None) -> None:
        """The engine's answer (on the actor thread): handed to the serving loop."""
        if seq is None:
            self.server.call_soon(self._resolve, None, None, None, error)
        else:  # copied here: the sequence is the actor thread's
            self.server.call_soon(
                self._resolve, list(seq.response_ids), list(seq.logprobs), seq.finish_reason
            )

    def progress(self, ids: list[int], logprobs: list[float]) -> None:
        """Tokens decoded (on the actor thread; copies): handed to the serving loop (posted: the requests
        streaming share one wake-up of the loop per forward)."""
        self.server.post(self.events.put_nowait, ("tokens", ids, logprobs))

    def cancel(self, message: str) -> None:
        """The client went away or the server closes: the engine drops the sequence, its pages freed."""
        if self.eval_id is not None:
            self.server.evals.cancel(self.eval_id)
        self._resolve(None, None, None, message)

    def _resolve(self, ids, logprobs, reason, error: str | None = None) -> None:
        self.server.eval_calls.discard(self)
        if self.answer.done():
            return
        if error is not None:
            failure = ApiError(503, f"the request was not served: {error}")
            if self.events is not None:
                self.answer.set_result(None)  # answered (a later cancel is a no-op)
                self.events.put_nowait(("error", failure))
                return
            self.answer.set_exception(failure)
            self.answer.exception()  # retrieved: a request gone meanwhile leaves no warning behind
            return
        server = self.server
        content = ids[:-1] if ids and reason in STOPPED else ids
        finish = "stop" if reason in STOPPED else "length"
        if self.events is not None:
            self.answer.set_result(None)
            self.events.put_nowait(("done", ids, logprobs, content, finish))
            return
        text = server.tokenizer.decode(content, skip_special_tokens=True)
        self.answer.set_result(server.responses.build(self, self.prompt, ids, logprobs, text, finish))


def evaluate(server: ServeHandle, req: TurnRequest, stream: bool = False) -> EvalCall:
    """Queue ``req`` for the engine's next forwards (on the serving loop; ``stream``: its tokens as they are
    decoded, ``EvalCall.events``); ``ApiError`` 400 if its prompt does not fit ``max_model_len`` or holds an
    id outside the vocabulary (text and chat prompts too, as an episode's), 503 once the server is closing."""
    if server._closed:
        raise ApiError(503, "the server is closing")
    call = EvalCall(server, req, stream)
    if req.kind == "chat":
        call.prompt = server.renderer.render(req.messages, req.tools, generation_prompt=True)
    elif isinstance(req.prompt, list):
        call.prompt = list(req.prompt)
    else:
        call.prompt = [int(t) for t in server.tokenizer(req.prompt)["input_ids"]]
    server.check_length(len(call.prompt), "the prompt")
    try:  # checked as an episode's prompt is: an id outside the actor's vocabulary is never decoded
        server._prompts.validate("the prompt", call.prompt)
    except ValueError as e:
        raise ApiError(400, str(e), param="messages" if req.kind == "chat" else "prompt") from None
    base = server.base_sampling
    sampling = SamplingParams(
        temperature=base.temperature if req.temperature is None else req.temperature,
        top_p=base.top_p if req.top_p is None else req.top_p,
        top_k=base.top_k,
        max_new_tokens=req.max_tokens or base.max_new_tokens,
        seed=req.seed,
        ignore_eos=req.ignore_eos,  # then neither an EOS nor the end of turn ends it: only its stop ids
        stop_token_ids=tuple(sorted({*req.stop_token_ids, *(() if req.ignore_eos else (server.turn_end,))})),
    )
    call.eval_id = server.evals.add(call.prompt, sampling, call.done, call.progress if stream else None)
    server.eval_calls.add(call)
    return call
