"""``RolloutEngine.serve()``: one daemon thread, one asyncio loop, uvicorn on it serving the app; the loop is
also the engine's environment loop (``EnvPool.use_loop``), where the agents' episodes answer their turns and
where ``add_agents`` runs the agents.

Handlers never touch the engine's state: a first request queues a prompt (``PromptQueue.add``, safe from any
thread), a later one resolves the future its episode's ``AgentEnv.step`` awaits; the actor thread drains the
finished calls between its forwards. So requests are decoded only while ``step()`` runs.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future

from oppo_engine.sched.prompts import derive_seed, sample_seed
from oppo_engine.serve.chat import Renderer, ToolParser, hermes_tool_parser
from oppo_engine.serve.episode import DONE, ENDED, FAILED, OPEN, WAITING, AgentGroup, ServedEpisode
from oppo_engine.serve.errors import ApiError
from oppo_engine.serve.evals import EvalRequests
from oppo_engine.serve.requests import parse_turn
from oppo_engine.serve.responses import Responses

SERVING_ENV_TIMEOUT_S = 300.0  # EngineConfig.env_timeout_s while serving, unless set
END_GRACE_S = 0.5  # serve(end_grace_s=): how long an engine-ended episode (not an agent's) awaits finish
_START_TIMEOUT_S = 30.0
_CLOSE_TIMEOUT_S = 30.0
_REAP_PERIOD_S = 0.5
_FORGET_S = 600.0  # an ended episode still answers (a repeat, 409, 410) this long after its last request


def turn_end_token(tokenizer) -> int:
    """The token that ends an assistant turn in ``tokenizer``'s chat template: the last special token of a
    rendered one-turn conversation (``<|im_end|>`` in ChatML, ``<|eot_id|>`` in Llama 3)."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
        tokenize=True,
        return_dict=False,
    )
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    special = set(tokenizer.all_special_ids)
    special |= {int(i) for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special}
    ends = [int(t) for t in ids if int(t) in special]
    if not ends:
        raise ValueError(
            "serve(): the chat template ends an assistant turn with no special token: pass turn_end_token_id="
        )
    return ends[-1]


class Posts:
    """Calls handed to an event loop from another thread, in order, with one ``call_soon_threadsafe`` (a lock
    and a write to the loop's self-pipe) for all those posted before the loop runs them: the actor thread
    posts a call per streaming agent after every forward (``AgentEnv.decoded``), a wake-up each would cost
    the actor more than the hook's own work.

    NOTE: a batch runs where the wake-up of its first post falls in the loop's queue, so a post may run before
    a ``call_soon`` made between that first post and itself. Harmless here: the actor posts an episode's new
    tokens, or its failure, only while its turn decodes; what else it sends the loop for that episode (its
    turn's end, its end) comes after the turn's last post, and its next turn's posts come after the loop has
    taken the turn's answer."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._calls: list[tuple[Callable, tuple]] = []
        self._lock = threading.Lock()

    def post(self, fn: Callable, *args) -> None:
        """``fn(*args)`` on the loop, after the calls posted before it; dropped once the loop is closed."""
        with self._lock:
            if self.loop.is_closed():  # (a wake-up may have come too late to run: what it left goes too)
                self._calls.clear()
                return
            self._calls.append((fn, args))
            if len(self._calls) > 1:
                return  # the loop is woken already: it runs this one with the others
        try:
            self.loop.call_soon_threadsafe(self._run)
        except RuntimeError:  # the loop is closed: nothing posted will run
            with self._lock:
                self._calls.clear()

    def _run(self) -> None:
        with self._lock:
            calls, self._calls = self._calls, []
        for fn, args in calls:
            try:
                fn(*args)
            except (SystemExit, KeyboardInterrupt):
                raise
            except BaseException as e:  # reported as the loop reports a callback's, and the others still run
                self.loop.call_exception_handler({"message": f"posted call {fn!r} failed", "exception": e})


class EpisodeHandle:
    """An agent episode opened with ``ServeHandle.open_episode``: send its requests to ``base_url``
    (``{url}/episodes/{id}/v1``), end it with ``finish(reward)``. Safe from any thread."""

    def __init__(self, server: ServeHandle, episode: ServedEpisode) -> None:
        self._server, self._episode = server, episode
        self.id = episode.id
        self.metadata = episode.metadata
        self.base_url = f"{server.url}/episodes/{episode.id}/v1"

    def finish(self, reward: float | None = None) -> None:
        """End the episode; ``reward`` is its rollout's (``None``: the engine's reward model or function
        scores it). A second call raises ``ValueError``."""
        try:
            self._server.run(lambda: self._server.episode(self.id).finish(reward))
        except ApiError as e:
            raise ValueError(e.message) from None


class ServeHandle:
    """The running endpoint that ``RolloutEngine.serve()`` returns: ``url`` (``http://127.0.0.1:PORT``),
    ``open_episode()``, ``add_agents()``, ``agents_in_flight()``, ``client()``, ``close()``; every method is
    safe from any thread.

    Options of ``serve()``: ``tokenizer`` (default: the engine's; one with a chat template is required),
    ``tool_parser`` (a turn's text -> ``(content, [(name, arguments)])``, or ``None`` when a call does not
    parse; default ``hermes_tool_parser``), ``turn_end_token_id`` (default: the template's end of turn, found
    by rendering one turn), ``model`` (the name ``/v1/models`` answers), ``max_episodes`` (open at once; more
    get 429), ``on_divergence`` (``"refuse"``: a request that does not extend its episode's history gets 409;
    ``"restart"``: the episode ends there and a new one, under the same id, starts from it), ``end_grace_s``
    (after the engine ends an episode of ``open_episode`` or ``POST /v1/episodes``, how long its ``finish``
    is awaited before the reward model or function scores it, default 0.5 s; ``None``: up to 0.9 x
    ``env_timeout_s``; an agent of ``add_agents`` is always awaited, as its return is its ``finish``).
    ``ValueError``: no tokenizer; a ``process_group``; a non-loopback ``host`` without ``api_key``;
    ``SamplingParams.n > 1``; an explicit ``eos_token_id`` that includes the template's end of turn (for a
    served episode it ends the turn, not the episode). ``EngineConfig.env_timeout_s`` (``None``: 300 s while
    serving) bounds each gap between an answer and the agent's next request or ``finish``."""

    def __init__(
        self,
        engine,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        tokenizer=None,
        tool_parser: ToolParser | None = None,
        turn_end_token_id: int | None = None,
        model: str | None = None,
        max_episodes: int = 4096,
        on_divergence: str = "refuse",
        end_grace_s: float | None = END_GRACE_S,
    ) -> None:
        engine._check_open()
        tokenizer = tokenizer if tokenizer is not None else engine.tokenizer
        if tokenizer is None:
            raise ValueError("serve() needs tokenizer= (or RolloutEngine(tokenizer=...)): requests are text")
        if engine._group is not None:
            raise ValueError(
                "serve() on an engine with process_group= is not supported (serve one engine per process)"
            )
        if not _loopback(host) and not api_key:
            raise ValueError(f"serve(host={host!r}) listens beyond this machine: give api_key=")
        if engine._server is not None:
            raise RuntimeError(f"serve(): this engine is already serving at {engine._server.url}")
        if on_divergence not in ("refuse", "restart"):
            raise ValueError(f"serve(on_divergence={on_divergence!r}): 'refuse' (409) or 'restart'")
        self.on_divergence = on_divergence
        if end_grace_s is not None and not end_grace_s >= 0:
            raise ValueError(f"serve(end_grace_s={end_grace_s!r}): seconds >= 0, or None (up to the timeout)")
        self.end_grace_s = end_grace_s
        if engine.sampling.n != 1:
            raise ValueError(
                f"serve() needs SamplingParams.n=1 (an episode is one conversation), got {engine.sampling.n}"
            )
        self.engine, self.tokenizer, self.api_key = engine, tokenizer, api_key
        self.turn_end = turn_end_token(tokenizer) if turn_end_token_id is None else int(turn_end_token_id)
        if engine._eos_explicit and self.turn_end in engine.eos_token_ids:
            raise ValueError(
                f"serve(): eos_token_id={sorted(engine.eos_token_ids)} includes the chat template's "
                f"end-of-turn token {self.turn_end}, which ends a served episode's turn, not the episode: "
                "give an EOS without it"
            )
        self.renderer = Renderer(tokenizer, self.turn_end)
        self.responses = Responses(
            tokenizer,
            model or getattr(tokenizer, "name_or_path", "") or "oppo-actor",
            tool_parser or hermes_tool_parser,
        )
        self.base_sampling = engine.sampling
        self.max_model_len, self.vocab_size = engine.max_model_len, engine.vocab_size
        self.max_episodes = max_episodes
        self.episodes: dict[str, ServedEpisode] = {}
        self._prompts = engine._prompts
        self._pool = engine._loop.envs.pool
        self.timeout_s = self._pool.timeout_s or SERVING_ENV_TIMEOUT_S
        self._saved_timeout = self._pool.timeout_s
        self._agents: deque = deque()
        self._agents_running = 0
        # Agents queued or whose episode their return has not ended yet (changed on the loop only): counted
        # from queueing to that end, so a read never misses one between the queue and its task.
        self._agents_live = 0
        self._agent_tasks: set[asyncio.Task] = set()
        self._next_task_index = 0
        self._index_lock = threading.Lock()
        self._agent_limit = engine.config.batch_size + engine._max_overcommit
        self._closed = False
        self.eval_calls: set = set()  # plain /v1 requests in flight (serve/evaluate.py)
        self.evals = EvalRequests()  # their sequences: side work of the step loop (serve/evals.py)
        # The size of the groups queued or in flight: one size at a time (claim_group_size); prompts and
        # single episodes are groups of 1.
        self.group_size = 1

        from oppo_engine.serve.app import build_app  # starlette is imported only when serving

        self.app = build_app(self)
        self.sock = socket.create_server((host, port))
        bound = self.sock.getsockname()
        shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
        self.url = f"http://{shown}:{bound[1]}"
        self.loop = asyncio.new_event_loop()
        self._posts = Posts(self.loop)
        self.thread = threading.Thread(target=self._run, name="oppo-serve", daemon=True)
        self._uvicorn = None
        self._started = threading.Event()
        self._failure: BaseException | None = None
        self.thread.start()
        if not self._started.wait(_START_TIMEOUT_S) or self._failure is not None:
            self.close()
            raise RuntimeError(f"serve(): the server did not start: {self._failure!r}")
        self._pool.timeout_s = self.timeout_s
        self._pool.use_loop(self.loop)
        self._prompts.size_check = self._check_prompt_size
        # Plain /v1 requests: side work of the step loop. A step waiting for a silent episode's first
        # request decodes them meanwhile.
        engine._loop.add_side_work(self.evals)
        self._prompts.side_work = engine._loop.side_in_flight
        self.evals.on_add = self._prompts.wake

    @staticmethod
    def of(engine) -> ServeHandle:
        """``engine``'s handle; ``RuntimeError`` if it is not serving."""
        if engine._server is None:
            raise RuntimeError("add_agents() runs agents against the endpoint: call serve() first")
        return engine._server

    def open_episode(self, metadata=None, seed: int | None = None) -> EpisodeHandle:
        """Open an agent episode (``metadata``: yours, kept on the handle; ``seed``: its RNG seed, else its
        first request's, else derived by the engine from its prompt's index). ``step()`` waits for the first
        request of an open episode, up to ``env_timeout_s``, after which the episode expires."""
        try:
            return EpisodeHandle(self, self.run(lambda: self.open(metadata, seed)))
        except ApiError as e:
            raise ValueError(e.message) from None

    # -- the serving thread ----------------------------------------------------------------------------------

    def _run(self) -> None:
        import uvicorn

        asyncio.set_event_loop(self.loop)

        async def main() -> None:
            config = uvicorn.Config(
                self.app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=2
            )
            self._uvicorn = uvicorn.Server(config)
            reaper = asyncio.ensure_future(self._reap())
            serve = asyncio.ensure_future(self._uvicorn.serve(sockets=[self.sock]))
            while not self._uvicorn.started and not serve.done():
                await asyncio.sleep(0.005)
            if serve.done():
                self._failure = serve.exception() or RuntimeError("uvicorn stopped while starting")
            self._started.set()
            try:
                await serve
            finally:
                reaper.cancel()

        try:
            self.loop.run_until_complete(main())
        except BaseException as e:  # surfaced by serve() while starting; after that, close() ends the loop
            self._failure = e
            self._started.set()
        finally:
            tasks = asyncio.all_tasks(self.loop)
            for task in tasks:
                task.cancel()
            self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            self.loop.close()

    async def _reap(self) -> None:
        """Expire open episodes that sent no request within the timeout; forget ended ones after
        ``_FORGET_S``."""
        while True:
            await asyncio.sleep(_REAP_PERIOD_S)
            now = time.monotonic()
            for episode in list(self.episodes.values()):
                idle = now - episode.touched_s
                if episode.state == OPEN and idle > self.timeout_s:
                    episode.fail(f"no request within env_timeout_s={self.timeout_s:g} s of its opening")
                elif episode.state in (DONE, ENDED, FAILED) and idle > max(self.timeout_s, _FORGET_S):
                    del self.episodes[episode.id]

    # -- called from the loop --------------------------------------------------------------------------------

    def call_soon(self, fn: Callable, *args) -> None:
        """Run ``fn(*args)`` on the serving loop (from any thread); dropped once the loop is closed."""
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass

    def post(self, fn: Callable, *args) -> None:
        """Run ``fn(*args)`` on the serving loop (from the actor thread's hooks), after what was posted before
        it; dropped once the loop is closed. Posts that come before the loop runs them share one wake-up of
        it (``Posts``): a streamed token costs no ``call_soon`` of its own."""
        self._posts.post(fn, *args)

    def run(self, fn: Callable):
        """``fn()`` on the serving loop, its result (or exception) here; from the loop itself, directly."""
        if threading.current_thread() is self.thread:
            return fn()
        if self._closed:
            raise RuntimeError("the server is closed")
        future: Future = Future()

        def call() -> None:
            try:
                future.set_result(fn())
            except BaseException as e:
                future.set_exception(e)

        self.loop.call_soon_threadsafe(call)
        return future.result(_CLOSE_TIMEOUT_S)

    def check_auth(self, header: str | None) -> None:
        """``ApiError`` 401 unless the ``Authorization`` header carries the key (``hmac.compare_digest``)."""
        if self.api_key is None:
            return
        given = (header or "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), self.api_key.encode()):
            raise ApiError(401, "invalid API key", code="invalid_api_key")

    def check_length(self, n: int, what: str) -> None:
        """``ApiError`` 400 with the numbers if ``n`` tokens leave no room under ``max_model_len``."""
        if n >= self.max_model_len:
            raise ApiError(
                400,
                f"{what} has {n} tokens; max_model_len={self.max_model_len} leaves room for at most "
                f"{self.max_model_len - 1} before the first sampled token",
                code="context_length_exceeded",
            )

    def parse(self, body, kind: str):
        """A request body as a ``TurnRequest`` (``serve/requests.py``); ``ApiError`` 400 naming the field."""
        return parse_turn(body, kind, self.tokenizer, self.vocab_size)

    def open(
        self,
        metadata=None,
        seed: int | None = None,
        group: AgentGroup | None = None,
        default_seed: int | None = None,
    ) -> ServedEpisode:
        """A new episode (on the serving loop; ``open_episode`` is the any-thread form): 429 over the cap.
        ``group``: it is a member of that group of agents (``add_agents(n=...)``)."""
        if self._closed:
            raise ApiError(503, "the server is closing")
        live = self._live()
        if live >= self.max_episodes:
            raise ApiError(429, f"{live} episodes are open: the cap is {self.max_episodes}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise ApiError(400, f"seed must be an integer >= 0, got {seed!r}", param="seed")
        if group is None:
            self.claim_group_size(1)
        episode = ServedEpisode(
            self,
            secrets.token_urlsafe(16),
            metadata=metadata,
            seed=seed,
            group=group,
            default_seed=default_seed,
        )
        self.episodes[episode.id] = episode
        self.expect(1)
        return episode

    def claim_group_size(self, n: int) -> None:
        """Groups of ``n`` episodes are about to be queued (serving loop): ``ApiError`` 400 if groups of
        another size are queued or in flight. A step's cut returns whole groups, exactly B episodes: with
        groups of two sizes it could be left with places that no finished group fits, and stall or return
        fewer than B; so the size changes only once the engine holds none of the old size."""
        if n == self.group_size:
            return
        if not self._drained():
            raise ApiError(
                400,
                f"a group of {n} episode(s) while groups of {self.group_size} are queued or in flight: one "
                "group size at a time (a step returns exactly B episodes in whole groups); let step() return "
                "them first",
                code="group_size_conflict",
            )
        self.group_size = n

    def _drained(self) -> bool:
        engine = self.engine
        stepping = engine._guard.holder is not None and engine._guard.holder[0] == "step()"
        return not (self._live() or self._agents or stepping or len(engine._buffer) or self._prompts.busy)

    def _check_prompt_size(self, n: int) -> None:
        """``PromptQueue.add``'s check (from any thread): ``ValueError`` as ``claim_group_size`` says."""
        try:
            self.run(lambda: self.claim_group_size(n))
        except ApiError as e:
            raise ValueError(e.message) from None

    def _live(self) -> int:
        return sum(e.state not in (DONE, ENDED, FAILED) for e in self.episodes.values())

    def restart(self, old: ServedEpisode) -> ServedEpisode:
        """``on_divergence="restart"``: ``old`` ends where it is (``finish`` without a reward: the reward
        model scores it) and a new episode takes its id, the diverging request as its first."""
        if old.state == WAITING:
            old.finish(None)
        episode = ServedEpisode(
            self, old.id, metadata=old.metadata, seed=old.seed, default_seed=old.default_seed
        )
        self.episodes[old.id] = episode
        self.expect(1)
        return episode

    def episode(self, episode_id: str) -> ServedEpisode:
        """The episode of ``episode_id`` (on the serving loop); ``ApiError`` 404 if unknown or forgotten."""
        episode = self.episodes.get(episode_id)
        if episode is None:
            raise ApiError(
                404,
                f"no episode {episode_id!r} (unknown, or forgotten after it ended)",
                code="episode_not_found",
            )
        return episode

    def expect(self, k: int) -> None:
        """Tell the engine's queue that ``k`` more (or fewer) first requests are on their way."""
        self._prompts.expect(k)

    def queue_episode(self, episode: ServedEpisode, prompt: list[int]) -> None:
        """The first request came: its prompt joins the engine's queue, the episode's ``AgentEnv`` with it."""
        self._prompts.add([prompt], [episode.sampling], [episode.make_env])
        self.expect(-1)

    # -- agents ----------------------------------------------------------------------------------------------

    def agents_in_flight(self) -> int:
        """Agents of ``add_agents`` queued, or running with their episode not yet ended by their return (a
        read, safe from any thread): an agent whose episode is finished or failed, closing its client, is
        not counted."""
        return self._agents_live

    def add_agents(self, agent_fn: Callable, tasks: Iterable, *, n: int = 1, in_process: bool = True) -> None:
        """Queue ``tasks`` and return: each runs ``async def agent_fn(task, client) -> float | None`` as a
        coroutine on the serving loop, in an episode of its own (seeded from the task's index, counted over
        every call) with an ``openai.AsyncOpenAI`` client bound to it (``max_retries=0``; in-process through
        the app, or over HTTP to the port with ``in_process=False``). The float returned is the episode's
        reward (``None``: the reward model's), so ``finish`` is implicit; an agent that raises ends its
        episode in ``StepResult.failed``. B + Δ_max agents run at once, the next starting as one ends.

        ``n > 1``: ``n`` agents run each task, and their episodes form one group, as ``n`` samples of a prompt
        do (``Rollout.group_id`` shared, ``sample_index`` 0..n-1; returned, carried and failed whole). Member
        ``j``'s seed is derived from the task's as sample ``j``'s from a prompt's (member 0's is the task's).
        ``ValueError`` unless ``n`` divides ``batch_size`` and at most B + Δ_max agents make a group."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"add_agents(n={n!r}): n must be an integer >= 1")
        if n > 1 and (self.engine.config.batch_size % n or n > self._agent_limit):
            raise ValueError(
                f"add_agents(n={n}): a group of n agents is returned whole, so n must divide "
                f"batch_size={self.engine.config.batch_size} and fit the B + Δ_max={self._agent_limit} "
                "agents in flight"
            )
        tasks = list(tasks)
        if not asyncio.iscoroutinefunction(agent_fn):
            raise TypeError(
                f"agent_fn must be an async function (async def agent_fn(task, client)), got {agent_fn!r}"
            )
        with self._index_lock:  # two threads' calls never share an index (a seed)
            first = self._next_task_index
            self._next_task_index += len(tasks)
        items = [(agent_fn, first + i, task, in_process, n) for i, task in enumerate(tasks)]

        def queue() -> None:
            if items:
                self.claim_group_size(n)
            self._agents.extend(items)
            self._agents_live += n * len(items)
            self._pump()

        try:
            self.run(queue)
        except ApiError as e:
            raise ValueError(f"add_agents(n={n}): {e.message}") from None

    def _pump(self) -> None:
        """Start queued agents (a task's ``n`` at once) while no more than B + Δ_max run."""
        while self._agents and not self._closed:
            fn, index, task, in_process, n = self._agents[0]
            if self._agents_running + n > self._agent_limit or self._live() + n > self.max_episodes:
                return  # the next starts when one ends
            self._agents.popleft()
            seed = derive_seed(self.base_sampling.seed or 0, index)
            group = AgentGroup(self, n) if n > 1 else None
            for j in range(n):
                metadata = {"task_index": index} if n == 1 else {"task_index": index, "sample_index": j}
                # the first request's seed, else the task's (sample j's of it)
                episode = self.open(metadata=metadata, group=group, default_seed=sample_seed(seed, j))
                episode.agent = True  # its agent's return is its finish: awaited after the engine ends it
                self._agents_running += 1
                t = self.loop.create_task(self._run_agent(fn, task, episode, in_process))
                self._agent_tasks.add(t)
                t.add_done_callback(self._agent_tasks.discard)

    def client(self, episode: ServedEpisode, in_process: bool = True):
        """An ``openai.AsyncOpenAI`` bound to ``episode`` (no retries): in-process through the app (no
        socket), or over HTTP to the port."""
        import httpx2
        import openai

        base_url = f"{self.url}/episodes/{episode.id}/v1"
        transport = httpx2.ASGITransport(app=self.app) if in_process else None
        timeout = 2 * self.timeout_s + 60  # a request may wait for the next step() while the trainer updates
        http = httpx2.AsyncClient(transport=transport, timeout=timeout)
        return openai.AsyncOpenAI(
            base_url=base_url,
            api_key=self.api_key or "unused",
            max_retries=0,
            timeout=timeout,
            http_client=http,
        )

    async def _run_agent(self, fn: Callable, task, episode: ServedEpisode, in_process: bool) -> None:
        client = self.client(episode, in_process)
        try:
            reward = await fn(task, client)
            if reward is not None:
                reward = float(reward)
        except asyncio.CancelledError:
            self.episodes.get(episode.id, episode).fail("the server closed while its agent ran")
            raise
        except Exception as e:
            episode = self.episodes.get(episode.id, episode)  # a restart put a new episode under its id
            episode.agent_failed(f"agent {getattr(fn, '__qualname__', fn)!s} raised {type(e).__name__}: {e}")
        else:
            episode = self.episodes.get(episode.id, episode)  # a restart put a new episode under its id
            if episode.state not in (DONE, FAILED) and episode.finish_asked is None:
                try:
                    episode.finish(reward)
                except ApiError:  # its reward window closed (past the timeout): the reward model scored it
                    pass
        finally:
            self._agents_live -= 1  # its episode has its end: only its client's close is left
            try:
                await client.close()
            finally:
                self._agents_running -= 1
                self._pump()

    # -- closing ---------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop serving: agents cancelled, episodes in flight failed (their requests 503 or 410, their
        sequences in a later ``StepResult.failed``), the thread ended, the socket closed. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:  # the rest is undone even if the loop does not answer in time
            if self.loop.is_running():
                done: Future = Future()

                async def shut() -> None:
                    for task in list(self._agent_tasks):
                        task.cancel()
                    self._agents_live -= sum(item[-1] for item in self._agents)
                    self._agents.clear()
                    for episode in list(self.episodes.values()):
                        episode.fail("the server closed")
                    for call in list(self.eval_calls):
                        call.cancel("the server closed")
                    await asyncio.sleep(0)
                    if self._uvicorn is not None:
                        self._uvicorn.should_exit = True
                    done.set_result(None)

                asyncio.run_coroutine_threadsafe(shut(), self.loop)
                done.result(_CLOSE_TIMEOUT_S)
            self.thread.join(_CLOSE_TIMEOUT_S)
        finally:
            self._pool.use_loop(None)
            self._prompts.size_check = self._prompts.side_work = self.evals.on_add = None
            # its evaluations fail or are dropped (their pages freed on the actor thread), then it leaves
            self.evals.close("the server closed")
            self.engine._loop.remove_side_work(self.evals)
            self._pool.timeout_s = self._saved_timeout
            self.sock.close()
            if self.engine._server is self:
                self.engine._server = None  # the engine may serve again


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
