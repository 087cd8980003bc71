"""The ASGI app (Starlette): OpenAI's routes under an episode's base URL, the episode routes, vLLM's
``/tokenize`` and ``/detokenize``. Every route checks the API key; every error is OpenAI's JSON with
``x-should-retry: false``.

| route | what |
| --- | --- |
| ``GET /v1/models`` (also under an episode) | the one model served |
| ``POST /v1/episodes`` | open an episode: ``{"metadata"?, "seed"?}`` -> ``{"id", "base_url"}`` |
| ``POST /v1/episodes/{id}/finish`` | ``{"reward": float or null}`` ends it (409 the second time) |
| ``POST /episodes/{id}/v1/chat/completions`` | the episode's next turn |
| ``POST /episodes/{id}/v1/completions`` | the same, prompt as text or token ids |
| ``POST /v1/chat/completions``, ``/v1/completions`` | no episode: for evaluation, never trained on |
| ``POST /tokenize``, ``POST /detokenize`` | vLLM's shapes |
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from oppo_engine.serve.errors import ApiError
from oppo_engine.serve.evaluate import evaluate
from oppo_engine.serve.stream import TokenStream, streamed_calls, whole_turn_events

if TYPE_CHECKING:
    from oppo_engine.serve.server import ServeHandle

_NO_RETRY = {"x-should-retry": "false"}
MAX_BODY_BYTES = 8 << 20  # a larger body gets 413
_DISCONNECT_POLL_S = 0.25  # how often a waiting request looks whether its client is gone


def build_app(server: ServeHandle) -> Starlette:
    """The app of ``server`` (its handlers run on the serving loop)."""

    def route(fn):
        async def handle(request: Request):
            try:
                server.check_auth(request.headers.get("authorization"))
                answer = await fn(request)
                return answer if isinstance(answer, StreamingResponse) else JSONResponse(answer)
            except ApiError as e:
                return JSONResponse(e.body(), status_code=e.status, headers=_NO_RETRY)
            except Exception as e:  # a bug, answered in OpenAI's shape all the same
                error = ApiError(500, f"internal error: {type(e).__name__}: {e}")
                return JSONResponse(error.body(), status_code=500, headers=_NO_RETRY)

        return handle

    async def body(request: Request, *, optional: bool = False):
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > _max_body():
            raise ApiError(413, f"the body has {declared} bytes; the limit is {_max_body()}")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > _max_body():
                raise ApiError(413, f"the body is over the limit of {_max_body()} bytes")
            chunks.append(chunk)
        raw = b"".join(chunks)
        if optional and not raw.strip():
            return {}
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the body is not valid JSON: {e}") from None

    async def models(request: Request) -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": server.responses.model,
                    "object": "model",
                    "created": 0,
                    "owned_by": "oppo_engine",
                    "max_model_len": server.max_model_len,
                }
            ],
        }

    async def open_episode(request: Request) -> dict:
        data = await body(request, optional=True)
        if not isinstance(data, dict):
            raise ApiError(400, "the body must be a JSON object")
        episode = server.open(data.get("metadata"), data.get("seed"))
        return {"id": episode.id, "base_url": f"{server.url}/episodes/{episode.id}/v1"}

    async def finish(request: Request) -> dict:
        episode = server.episode(request.path_params["episode_id"])
        data = await body(request, optional=True)
        reward = data.get("reward") if isinstance(data, dict) else None
        if reward is not None and (isinstance(reward, bool) or not isinstance(reward, int | float)):
            raise ApiError(400, f"reward must be a number or null, got {reward!r}", param="reward")
        episode.finish(None if reward is None else float(reward))
        return {"id": episode.id, "finished": True}

    def turn(kind: str):
        async def handler(request: Request) -> dict:
            episode = server.episode(request.path_params["episode_id"])
            req = server.parse(await body(request), kind)
            if req.ignore_eos:
                why = "ignore_eos: an episode's turn ends at its template's end of turn"
                raise ApiError(400, why, param="ignore_eos")
            try:
                cached = episode.start(req)
            except ApiError as e:
                if e.code != "history_diverged" or server.on_divergence != "restart":
                    raise
                if episode.group is not None:  # a restart would leave its group and take no place in it
                    e.message += (
                        "; a member of a group of agents (add_agents(n > 1)) is never restarted: its agent "
                        "must extend the history, or finish"
                    )
                    raise
                episode = server.restart(episode)
                cached = episode.start(req)
            # Streamed token by token, but a chat turn with tools when the parser cannot stream its calls
            # (the episode's tools, which a later request may omit) and a retry of a turn another request
            # streams already: those come whole.
            tools = bool(episode.tools) and req.kind == "chat"
            whole = tools and streamed_calls(server) is None
            queue = episode.stream() if cached is None and req.stream and not whole else None
            if queue is not None:
                name, prompt = f"{episode.id}-{episode.turn}", list(episode.transcript)
                stream = TokenStream(
                    server, req, name, prompt, queue, episode.fail, tools=tools, turn=episode.turn
                )
                return StreamingResponse(stream.events(), media_type="text/event-stream")
            answer = cached
            if answer is None:
                answer = await _unless_gone(request, asyncio.shield(episode.pending), episode.fail)
            return _events(answer, req.include_usage) if req.stream else answer

        return handler

    def plain(kind: str):
        async def handler(request: Request) -> dict:
            req = server.parse(await body(request), kind)
            tools = bool(req.tools) and req.kind == "chat"
            if req.stream and not (tools and streamed_calls(server) is None):  # (else: a whole turn's calls)
                call = evaluate(server, req, stream=True)
                stream = TokenStream(
                    server, req, f"{call.id}-0", call.prompt, call.events, call.cancel, tools=tools
                )
                return StreamingResponse(stream.events(), media_type="text/event-stream")
            call = evaluate(server, req)
            answer = await _unless_gone(request, call.answer, call.cancel)
            return _events(answer, req.include_usage) if req.stream else answer

        return handler

    async def tokenize(request: Request) -> dict:
        data = await body(request)
        if not isinstance(data, dict):
            raise ApiError(400, "the body must be a JSON object")
        if "messages" in data:
            from oppo_engine.serve.chat import normalise

            tokens = server.renderer.render(
                normalise(data["messages"]),
                data.get("tools"),
                generation_prompt=bool(data.get("add_generation_prompt", True)),
            )
        elif isinstance(data.get("prompt"), str):
            special = data.get("add_special_tokens", True)
            tokens = [
                int(t)
                for t in server.tokenizer(data["prompt"], add_special_tokens=bool(special))["input_ids"]
            ]
        else:
            raise ApiError(400, "give prompt (a string) or messages", param="prompt")
        return {
            "count": len(tokens),
            "max_model_len": server.max_model_len,
            "tokens": tokens,
            "token_strs": None,
        }

    async def detokenize(request: Request) -> dict:
        data = await body(request)
        tokens = data.get("tokens") if isinstance(data, dict) else None
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in tokens
        ):
            raise ApiError(400, "tokens must be a list of token ids", param="tokens")
        bad = next((t for t in tokens if not 0 <= t < server.vocab_size), None)
        if bad is not None:
            raise ApiError(
                400, f"token id {bad} is outside the vocabulary [0, {server.vocab_size})", param="tokens"
            )
        return {"prompt": server.tokenizer.decode(tokens)}

    routes = [
        Route("/v1/models", route(models), methods=["GET"]),
        Route("/episodes/{episode_id}/v1/models", route(models), methods=["GET"]),
        Route("/v1/episodes", route(open_episode), methods=["POST"]),
        Route("/v1/episodes/{episode_id}/finish", route(finish), methods=["POST"]),
        Route("/episodes/{episode_id}/v1/chat/completions", route(turn("chat")), methods=["POST"]),
        Route("/episodes/{episode_id}/v1/completions", route(turn("completions")), methods=["POST"]),
        Route("/v1/chat/completions", route(plain("chat")), methods=["POST"]),
        Route("/v1/completions", route(plain("completions")), methods=["POST"]),
        Route("/tokenize", route(tokenize), methods=["POST"]),
        Route("/detokenize", route(detokenize), methods=["POST"]),
    ]

    async def not_found(request: Request, exc) -> JSONResponse:
        status = getattr(exc, "status_code", 404)
        return JSONResponse(
            ApiError(status, f"no route {request.method} {request.url.path}").body(),
            status_code=status,
            headers=_NO_RETRY,
        )

    return Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found})


def _events(answer: dict, include_usage: bool) -> StreamingResponse:
    """A whole answer (an episode's turn) as server-sent events (``serve/stream.py``)."""
    return StreamingResponse(iter(whole_turn_events(answer, include_usage)), media_type="text/event-stream")


async def _unless_gone(request: Request, answer, gone):
    """Await ``answer``; a client that disconnects meanwhile calls ``gone(message)``: it fails its episode
    (its turn is dropped when it ends: the sequence leaves the step then, its pages freed), or drops its
    evaluation (at the next forward)."""
    task = asyncio.ensure_future(answer)
    while True:
        done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            gone("its client disconnected while its turn was generated")
            raise ApiError(499, "the client disconnected")


def _max_body() -> int:
    return MAX_BODY_BYTES
