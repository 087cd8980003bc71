"""A served conversation is an engine episode: ``ServedEpisode`` holds its side on the serving loop, and
``AgentEnv`` is the environment the engine's step loop drives, like any other ``Env``.

The first request's rendered messages are the episode's prompt: queued as a prompt whose environment is an
``AgentEnv``. When the turn ends, the engine calls ``AgentEnv.step(turn_ids, logprobs)`` (a coroutine on the
serving loop): it answers the pending request with the turn, then waits for the agent's next request, whose
new messages' template suffix is the observation, or for ``finish``, which ends the episode
(``finish_reason="agent_done"``). Everything here but ``make_env`` and ``AgentEnv.end`` (the actor thread's)
runs on the serving loop, so the state needs no lock.

States: ``open`` (no request yet), ``generating`` (a request waits for its turn), ``waiting`` (answered; the
agent's next request or ``finish`` is awaited), ``done`` (finished by the agent), ``ended`` (ended by the
engine: EOS, a length limit), ``failed`` (rolled back, timed out, abandoned, closed: requests get 410).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from oppo_engine.config import SamplingParams
from oppo_engine.env.protocol import Observation
from oppo_engine.sched.prompts import sample_seed
from oppo_engine.serve.chat import first_difference
from oppo_engine.serve.errors import ApiError
from oppo_engine.serve.requests import TurnRequest
from oppo_engine.serve.stream import ROLLED_BACK

if TYPE_CHECKING:
    from oppo_engine.serve.server import ServeHandle

OPEN, GENERATING, WAITING, DONE, ENDED, FAILED = "open", "generating", "waiting", "done", "ended", "failed"
# After the engine ends an agent's episode (or any, with serve(end_grace_s=None)), finish(reward) is awaited
# this share of env_timeout_s (the rest is the margin before the pool expires the call, which would fail the
# episode); other episodes wait serve(end_grace_s=).
_END_WAIT = 0.9
_ENGINE_FINISH = {
    "eos": "stop",
    "stop": "stop",
    "length": "length",
    "max_model_len": "length",
    "max_turns": "length",
}


class AgentError(RuntimeError):
    """The agent of an episode raised, or the episode failed while its environment call ran."""


class ServedEpisode:
    """One conversation (see the module). ``seed``: the episode's RNG seed, fixed at its opening (a request
    with another gets 400, the first included); else the first request's; else ``default_seed`` (an agent's,
    derived from its task); else the engine's derivation from the prompt's index. A member ``j`` of a group
    of agents whose first request gives the seed samples with ``sample_seed(seed, j)`` (later requests repeat
    the seed as given)."""

    def __init__(
        self,
        server: ServeHandle,
        episode_id: str,
        *,
        metadata=None,
        seed: int | None = None,
        group=None,
        default_seed: int | None = None,
    ) -> None:
        self.server, self.id, self.metadata, self.seed = server, episode_id, metadata, seed
        self.default_seed = default_seed
        self.fixed_seed: int | None = None  # the seed its requests must repeat (set by the first)
        self.group: AgentGroup | None = group  # n agents on one task (add_agents(n=...)): one group
        if group is not None:
            group.members.append(self)
        self.state = OPEN
        self.touched_s = time.monotonic()
        self.kind: str | None = None
        self.history: list[dict] = []  # normalised messages, the assistant's answers included
        self.tools: list | None = None
        self.transcript: list[int] = []  # prompt, turns and suffixes: the sequence's tokens so far
        self.text = ""  # completions with text prompts: the text so far
        self.turn = 0
        self.turn_closed = True  # the last turn ended with the end-of-turn token
        self.sampling: SamplingParams | None = None
        self.pending: asyncio.Future | None = None  # the response of the request in flight
        self.pending_key: str | None = None
        # The pending request's token stream (``stream: true``): ``TokenStream``'s events (serve/stream.py).
        self.stream_queue: asyncio.Queue | None = None
        self.last_key: str | None = None
        self.last_response: dict | None = None
        self.next_obs: asyncio.Future | None = None  # what AgentEnv.step awaits
        self.end_waiter: asyncio.Future | None = None  # what AgentEnv.after_end awaits (finish)
        self.finish_asked: tuple[float | None] | None = None
        self.agent_error: str | None = None
        self.error: str | None = None
        self.env_made = False  # the actor thread's: the factory was called
        self.agent = False  # run by an agent of add_agents: its return is its finish
        self.reward_closed = False  # ended by the engine, and its finish is no longer awaited

    # -- requests (serving loop) -----------------------------------------------------------------------------

    async def request(self, req: TurnRequest) -> dict:
        """Answer ``req``: the next turn, or a repeat's cached answer; ``ApiError`` otherwise."""
        cached = self.start(req)
        return cached if cached is not None else await asyncio.shield(self.pending)

    def stream(self) -> asyncio.Queue | None:
        """The pending request's turn, token by token (after ``start``): a queue of ``TokenStream`` events;
        ``None`` if another request streams it already (a retry while it is generated)."""
        if self.stream_queue is not None or self.state != GENERATING:
            return None
        self.stream_queue = asyncio.Queue()
        return self.stream_queue

    def start(self, req: TurnRequest) -> dict | None:
        """The synchronous part of ``request``: a repeat's cached answer, or ``None`` with ``req`` pending
        (``pending``, the turn's response); ``ApiError`` otherwise."""
        self.touched_s = time.monotonic()
        if self.state == FAILED:
            raise ApiError(410, f"episode {self.id} failed: {self.error}", code="episode_failed")
        if req.key == self.last_key and self.last_response is not None:
            return self.last_response  # a client's retry of the last answered request
        if self.state == DONE:
            raise ApiError(
                409, f"episode {self.id} has ended (finished): open a new episode", code="episode_ended"
            )
        if self.state == ENDED:
            raise ApiError(
                409,
                f"episode {self.id} has ended: the engine ended it (EOS, or a length or turn limit); call "
                "its finish now (POST .../finish with its reward; an agent of add_agents returns it), within "
                "serve(end_grace_s=), else the reward model or function scores it; then open a new episode",
                code="episode_ended",
            )
        if self.state == GENERATING:
            if req.key != self.pending_key:
                raise ApiError(409, f"episode {self.id} has a request in flight", code="request_in_flight")
        elif self.kind is not None and req.kind != self.kind:
            raise ApiError(400, f"episode {self.id} is a {self.kind} conversation, not {req.kind}")
        elif self.state == OPEN:
            self._first(req)
        else:
            self._next(req)
        return None

    def _first(self, req: TurnRequest) -> None:
        server = self.server
        if req.kind == "chat":
            prompt = server.renderer.render(req.messages, req.tools, generation_prompt=True)
            self.history, self.tools = list(req.messages), req.tools
        elif isinstance(req.prompt, list):
            prompt = list(req.prompt)
        else:
            prompt = [int(t) for t in server.tokenizer(req.prompt)["input_ids"]]
            self.text = req.prompt
        server.check_length(len(prompt), "the prompt")
        base = server.base_sampling
        if self.seed is not None and req.seed is not None and req.seed != self.seed:
            raise ApiError(
                400,
                f"seed={req.seed} but episode {self.id} was opened with seed={self.seed}: an episode's seed "
                "is fixed at its opening when given there",
                param="seed",
            )
        # The seed the agent fixes (later requests must repeat it) and the one it samples with: member j of
        # a group (add_agents(n > 1)) whose request gives one samples with sample_seed(seed, j), as sample j
        # of a prompt does (member 0 with the seed as given): n agents that send one seed do not sample alike.
        self.fixed_seed = next((s for s in (self.seed, req.seed, self.default_seed) if s is not None), None)
        seed = self.fixed_seed
        if self.seed is None and req.seed is not None and self.group is not None:
            seed = sample_seed(req.seed, self.group.members.index(self))
        self.sampling = SamplingParams(
            temperature=base.temperature if req.temperature is None else req.temperature,
            top_p=base.top_p if req.top_p is None else req.top_p,
            top_k=base.top_k,
            max_new_tokens=base.max_new_tokens,
            seed=seed,
            turn_stop_token_ids=tuple(sorted({server.turn_end, *req.stop_token_ids})),
            max_turn_tokens=req.max_tokens,
        )
        try:
            if self.group is not None:
                self.group.first_request(self, prompt)  # queued with the others, once all have come
            else:
                server.queue_episode(self, prompt)
        except ValueError as e:  # the engine's own checks of a prompt (an id outside the vocabulary, ...)
            raise ApiError(400, str(e), param="messages" if req.kind == "chat" else "prompt") from None
        self.kind, self.transcript = req.kind, prompt
        self._await_turn(req)

    def _next(self, req: TurnRequest) -> None:
        self._check_sampling(req)
        server = self.server
        history, text = self.history, self.text
        if req.kind == "chat":
            differs = first_difference(self.history, req.messages)
            if differs is not None:
                raise ApiError(
                    409,
                    f"messages[{differs}] does not match the episode's history (an episode's requests must "
                    "extend it: the earlier messages, the assistant's answers included, unchanged)",
                    param=f"messages[{differs}]",
                    code="history_diverged",
                )
            new = req.messages[len(self.history) :]
            if not new:
                raise ApiError(
                    400, "the request adds no message after the assistant's last turn", param="messages"
                )
            if req.tools is not None and req.tools != self.tools:
                raise ApiError(400, "tools must not change within an episode", param="tools")
            suffix = server.renderer.suffix(self.history, new, self.tools, turn_closed=self.turn_closed)
            history = self.history + new
        elif isinstance(req.prompt, list):
            n = len(self.transcript)
            if req.prompt[:n] != self.transcript:
                at = next(
                    (i for i, (a, b) in enumerate(zip(req.prompt, self.transcript, strict=False)) if a != b),
                    min(n, len(req.prompt)),
                )
                raise ApiError(
                    409,
                    f"prompt differs from the episode's tokens at position {at}",
                    param="prompt",
                    code="history_diverged",
                )
            suffix = req.prompt[n:]
        else:
            if not req.prompt.startswith(self.text):
                raise ApiError(
                    409, "prompt does not extend the episode's text", param="prompt", code="history_diverged"
                )
            suffix = [
                int(t)
                for t in server.tokenizer.encode(req.prompt[len(self.text) :], add_special_tokens=False)
            ]
            text = req.prompt  # taken once the request is accepted, with its tokens
        if not suffix:
            raise ApiError(400, "the request adds no token to the episode", param="prompt")
        server.check_length(len(self.transcript) + len(suffix), "the conversation")
        self.history, self.text = history, text
        self.transcript = self.transcript + suffix
        self._await_turn(req)
        limit = req.max_tokens or self.sampling.max_new_tokens  # without max_tokens: the episode's budget
        self.next_obs.set_result(Observation(suffix, next_turn_tokens=limit))

    def _check_sampling(self, req: TurnRequest) -> None:
        s = self.sampling
        given = {"temperature": req.temperature, "top_p": req.top_p, "seed": req.seed}
        fixed = {"temperature": s.temperature, "top_p": s.top_p, "seed": self.fixed_seed}
        for name, value in given.items():
            if value is not None and value != fixed[name]:
                raise ApiError(
                    400,
                    f"{name}={value} but this episode samples with {name}={fixed[name]}: the first request "
                    "fixes the sampling of an episode",
                    param=name,
                )
        if req.stop_token_ids and {self.server.turn_end, *req.stop_token_ids} != set(s.turn_stop_token_ids):
            raise ApiError(400, "stop must not change within an episode", param="stop")

    def _await_turn(self, req: TurnRequest) -> None:
        self.pending = asyncio.get_running_loop().create_future()
        self.pending_key, self.pending_req, self.state = req.key, req, GENERATING

    # -- the engine's side (serving loop, but make_env and AgentEnv.end) -------------------------------------

    def make_env(self) -> AgentEnv:
        """The environment factory (called on the actor thread). A second call means the engine restarted
        the sequence (a rollback, or a quarantine probe, after the agent had an answer): an agent cannot be
        rewound, so the episode fails. An episode failed meanwhile (a client gone) is never decoded."""
        if self.env_made:
            message = "rolled back after its agent had an answer (an agent cannot be rewound)"
            self.server.call_soon(lambda: self.fail(message, lost=True))
            raise AgentError(f"agent episode {self.id} was {message}")
        if self.state == FAILED:
            raise AgentError(f"agent episode {self.id} failed: {self.error}")
        self.env_made = True
        return AgentEnv(self)

    # Its environments cannot be made afresh (an agent cannot be rewound): state_dict() refuses to save them.
    make_env.rewindable = False

    def on_tokens(self, ids: list[int], logprobs: list[float]) -> None:
        """Tokens of the turn decoded (``AgentEnv.decoded``): to the pending request's stream."""
        if self.stream_queue is not None and self.state == GENERATING:
            self.stream_queue.put_nowait(("tokens", ids, logprobs))

    async def on_turn(self, turn_ids: list[int], logprobs: list[float]) -> Observation:
        """A turn ended: answer the pending request with it; the agent's next move is the observation."""
        if self.state == FAILED:
            raise AgentError(f"agent episode {self.id} failed: {self.error}")
        self._answer(turn_ids, logprobs, None)
        if self.finish_asked is not None:
            self.state = DONE
            return Observation([], done=True, reward=self.finish_asked[0], finish_reason="agent_done")
        if self.agent_error is not None:
            self.fail(self.agent_error)
            raise AgentError(self.agent_error)
        self.state = WAITING
        self.touched_s = time.monotonic()
        self.next_obs = asyncio.get_running_loop().create_future()
        try:
            return await self.next_obs
        except asyncio.CancelledError:
            self.fail(
                "its environment call was cancelled (no request within env_timeout_s, or it was abandoned)"
            )
            raise

    async def after_end(self, reason: str) -> Observation:
        """The engine ended the episode (``on_end`` answered the turn it cut): ``finish(reward)`` is still
        awaited -- an agent's return up to the timeout, another episode's for ``serve(end_grace_s=)`` -- and
        its reward is the rollout's; without it (the wait over, an agent that raises or returns ``None``) the
        reward model or function scores the episode, and a later ``finish`` gets 409."""
        if self.finish_asked is None and self.agent_error is None and self.state == ENDED:
            self.end_waiter = asyncio.get_running_loop().create_future()
            wait = self.server.timeout_s * _END_WAIT
            if not self.agent and self.server.end_grace_s is not None:
                wait = min(wait, self.server.end_grace_s)
            try:
                await asyncio.wait_for(self.end_waiter, wait)
            except TimeoutError:
                pass
        self.reward_closed = True  # a later finish is refused (409), never silently dropped
        if self.state == FAILED:
            raise AgentError(f"agent episode {self.id} failed: {self.error}")
        reward = self.finish_asked[0] if self.finish_asked is not None else None
        return Observation([], done=True, reward=reward, finish_reason=reason)

    def _end_wait_over(self) -> None:
        if self.end_waiter is not None and not self.end_waiter.done():
            self.end_waiter.set_result(None)

    def on_end(self, turn_ids: list[int], logprobs: list[float], reason: str | None) -> None:
        """The engine ended the episode (``reason``: its finish reason; the turn it cut answers the pending
        request), or abandoned its sequence (``reason=None``: the episode fails)."""
        if reason is None:
            message = "its sequence was abandoned (rolled back, failed with its group, quarantined or closed)"
            self.fail(message, lost=True)
            return
        if self.state == GENERATING:
            self._answer(turn_ids, logprobs, reason)
        if self.state not in (DONE, FAILED):
            self.state = DONE if self.finish_asked is not None else ENDED

    def _answer(self, turn_ids: list[int], logprobs: list[float], reason: str | None) -> None:
        server = self.server
        prompt_ids = list(self.transcript)
        self.transcript = prompt_ids + list(turn_ids)
        stops = self.sampling.turn_stop_token_ids
        stopped = bool(turn_ids) and turn_ids[-1] in stops
        self.turn_closed = bool(turn_ids) and turn_ids[-1] == server.turn_end
        finish = (
            _ENGINE_FINISH.get(reason, "stop") if reason is not None else ("stop" if stopped else "length")
        )
        content_ids = turn_ids[:-1] if stopped else turn_ids
        text = server.tokenizer.decode(content_ids, skip_special_tokens=True)
        response = server.responses.build(self, prompt_ids, list(turn_ids), list(logprobs), text, finish)
        if self.kind == "chat":
            self.history = self.history + [server.responses.assistant_message(response)]
        else:
            self.text += text
        self.turn += 1
        self.last_key, self.last_response = self.pending_key, response
        if self.stream_queue is not None:
            self.stream_queue.put_nowait(("done", list(turn_ids), list(logprobs), content_ids, finish))
            self.stream_queue = None
        if self.pending is not None and not self.pending.done():
            self.pending.set_result(response)

    # -- the agent's side (serving loop) ---------------------------------------------------------------------

    def finish(self, reward: float | None) -> None:
        """End the episode with ``reward`` (``None``: the engine's reward model or function scores it)."""
        self.touched_s = time.monotonic()
        if self.state == DONE or self.finish_asked is not None:
            raise ApiError(409, f"episode {self.id} is already finished", code="already_finished")
        if self.state == FAILED:
            raise ApiError(410, f"episode {self.id} failed: {self.error}", code="episode_failed")
        if self.reward_closed:
            raise ApiError(
                409,
                f"episode {self.id} was ended by the engine and its finish was not awaited any longer "
                "(serve(end_grace_s=)): the reward model or function scored it; this reward is not used",
                code="reward_closed",
            )
        self.finish_asked = (reward,)
        if self.state == WAITING:
            self.state = DONE
            self.next_obs.set_result(Observation([], done=True, reward=reward, finish_reason="agent_done"))
        elif self.state == OPEN:
            self.state = DONE
            self.server.expect(-1)
            if self.group is not None:  # the group can never be complete
                self.group.member_failed(self, f"episode {self.id} finished before its first request")
        elif self.state == ENDED:
            self.state = DONE  # the engine ended it first: the reward is used (after_end)
            self._end_wait_over()
        # generating: the turn in flight is answered, then the episode ends (on_turn)

    def agent_failed(self, message: str) -> None:
        """The agent raised: its episode ends in ``StepResult.failed`` with ``message``."""
        if self.state == WAITING:
            self.error, self.state = message, FAILED
            self.next_obs.set_exception(AgentError(message))
        elif self.state == GENERATING:
            self.agent_error = message
        elif self.state == OPEN:
            self.fail(message)
        elif self.state == ENDED:  # the engine ended it first: the reward model scores it
            self.agent_error = message
            self._end_wait_over()

    def fail(self, message: str, *, lost: bool = False) -> None:
        """The episode fails: its pending request gets 410, later ones too. ``lost``: its rollout is lost
        even though its agent had finished (a rollback, a quarantine)."""
        if self.state == FAILED or (self.state == DONE and not lost):
            return
        group = self.group
        unqueued = self.state == OPEN or (self.state == GENERATING and group is not None and not group.queued)
        self.error, self.state = message, FAILED  # (the actor thread reads the state: the error first)
        if group is None and unqueued:  # no sequence: it comes back in StepResult.failed all the same
            self.server._prompts.add_failed([[]], [message])
        if unqueued:
            self.server.expect(-1)  # announced, never queued (after add_failed: a waiting step returns it)
        if group is not None:
            group.member_failed(self, message)
        failure = ApiError(410, f"episode {self.id} failed: {message}", code="episode_failed")
        if self.stream_queue is not None:
            self.stream_queue.put_nowait(("error", failure))
            self.stream_queue = None
        if self.pending is not None and not self.pending.done():
            self.pending.set_exception(failure)
            self.pending.exception()  # retrieved: a request gone meanwhile leaves no warning behind
        if self.next_obs is not None and not self.next_obs.done():
            self.next_obs.set_exception(AgentError(f"agent episode {self.id} failed: {message}"))
        self._end_wait_over()


class AgentGroup:
    """``n`` agents on one task (``add_agents(n=...)``): their episodes form one group, as ``n`` samples of a
    prompt do (one group id, cut, carried and failed together; ``Rollout.sample_index`` is the member's
    index). Each member's first request is held until all ``n`` have come, then they are queued together
    (``PromptQueue.add_group``): a group never waits in a step for a member that is not in it. A member that
    fails (or finishes) before that fails the others; after it, the step loop fails the group whole."""

    def __init__(self, server: ServeHandle, n: int) -> None:
        self.server, self.n = server, n
        self.members: list[ServedEpisode] = []  # in sample order
        self.prompts: dict[str, list[int]] = {}  # member id -> its first request's prompt
        self.queued = False
        self.error: str | None = None

    def first_request(self, episode: ServedEpisode, prompt: list[int]) -> None:
        """``episode``'s first request came (``ValueError`` if its prompt is refused)."""
        self.prompts[episode.id] = self.server._prompts.validate("the prompt", prompt)
        if len(self.prompts) < self.n:
            return
        members = self.members
        prompts = [self.prompts[m.id] for m in members]
        self.server._prompts.add_group(prompts, [m.sampling for m in members], [m.make_env for m in members])
        self.queued = True
        self.server.expect(-self.n)

    def member_failed(self, episode: ServedEpisode, message: str) -> None:
        """``episode`` failed before the group was queued: so do the others (groups fail whole)."""
        if self.queued or self.error is not None:
            return
        self.error = message
        for member in self.members:
            if member is not episode:
                member.fail(f"sample {self.members.index(episode)} of its group failed: {message}")
        # No sequence: the group comes back in StepResult.failed all the same, each member with its error.
        prompts = [self.prompts.get(m.id, []) for m in self.members]
        self.server._prompts.add_failed(prompts, [m.error or message for m in self.members])


class AgentEnv:
    """The environment of a served episode: the agent behind ``episode`` answers each turn (see the module).
    ``state_dict()`` cannot save it: a saved episode restarts from its prompt, and a restarted agent episode
    fails (its agent cannot be rewound)."""

    step_logprobs = True  # the engine passes each turn's behaviour log-probs (the response's logprobs)
    # An agent cannot be rewound: a quarantine probe (always rolled back) never answers it nor streams to it;
    # the episode stops there in the probe and goes on in the step's next attempt.
    rewindable = False

    def __init__(self, episode: ServedEpisode) -> None:
        self.episode = episode
        self._start = 0  # where the turn that streams began in the response
        self._sent: list[int] = []  # the turn's tokens handed to the episode
        # NOTE: _sent[:_checked] are the turn's tokens now. The response only grows between forwards, but for
        # a rolled-back step (``rewound``): the tokens sent beyond what it kept are checked again as the retry
        # decodes them, each once, so a call costs its new tokens, not the turn so far.
        self._checked = 0

    def decoded(self, response_ids: list[int], logprobs: list[float], turn_start: int) -> None:
        """The turn so far (``response_ids[turn_start:]``; on the actor thread, after every forward): its new
        tokens go to the episode's stream, if its pending request streams. A rolled-back step is retried from
        its snapshot (``rewound``): the tokens already sent come again, and only those beyond go out; if the
        retry decoded any of them differently the stream cannot be taken back, and the episode fails
        (``ROLLED_BACK``; nothing more goes out). An episode failed meanwhile (its client went away mid-turn)
        raises ``AgentError``: the engine fails its sequence at this forward and frees its pages, rather than
        decoding the rest of the turn. A call costs the tokens decoded since the last (amortized: those
        checked again after a rollback too), not the turn so far."""
        episode = self.episode
        if episode.state == FAILED:  # (its client went away mid-turn): the sequence leaves now, pages freed
            raise AgentError(f"agent episode {episode.id} failed: {episode.error}")
        if episode.stream_queue is None:
            return
        if turn_start != self._start:  # a new turn: nothing of it sent yet
            self._start, self._sent, self._checked = turn_start, [], 0
        sent, checked, end = self._sent, self._checked, len(response_ids)
        if checked < len(sent):  # a retry decodes again what went out: it must be the same
            upto = min(len(sent), end - turn_start)
            if response_ids[turn_start + checked : turn_start + upto] != sent[checked:upto]:
                episode.server.post(episode.fail, ROLLED_BACK)
                return
            self._checked = checked = upto
        if end - turn_start > len(sent):
            first = turn_start + len(sent)
            new = response_ids[first:end]
            sent += new
            self._checked = len(sent)
            episode.server.post(episode.on_tokens, new, logprobs[first:end])

    def rewound(self, num_response: int) -> None:
        """A rolled-back step cut the response back to ``num_response`` tokens (on the actor thread, before
        the retry): the tokens sent beyond them are checked again as the retry decodes them (``decoded``)."""
        self._checked = min(self._checked, max(0, num_response - self._start))

    def reset(self, prompt_ids: list[int]) -> None:
        """The prompt is the first request's: nothing to set up."""

    def step(self, turn_ids: list[int], logprobs: list[float]):
        """A coroutine, run on the serving loop: answer the turn, then await the agent's next move."""
        return self.episode.on_turn(turn_ids, logprobs)

    def end(self, turn_ids: list[int], logprobs: list[float], reason: str | None) -> None:
        """The engine ended (or abandoned) the episode; called on the actor thread."""
        self.episode.server.call_soon(self.episode.on_end, list(turn_ids), list(logprobs), reason)

    def after_end(self, reason: str):
        """A coroutine, run on the serving loop after ``end``: the agent's last word (``finish``'s reward)."""
        return self.episode.after_end(reason)
