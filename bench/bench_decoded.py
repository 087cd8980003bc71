"""The streaming hook's cost on the actor thread: ``EnvDriver.decoded`` after every forward, with every served
episode's ``AgentEnv.decoded`` handing its new tokens to the serving loop, for ``--agents`` agents streaming a
turn of ``--turn-tokens`` tokens each.

    python -m bench.bench_decoded --agents 256 --turn-tokens 300 --repeats 5

No model: each forward appends one token to every agent's sequence (real ``Sequence``s, ``Episode``s and
``ServedEpisode``s, the real ``ServeHandle.call_soon``/``post`` onto a real asyncio loop on its own thread,
whose consumers drain each turn's stream queue as ``TokenStream`` does), then the actor sleeps
``--forward-ms`` (the GIL released, as in a model forward, so the serving loop drains meanwhile). Timed: the
actor thread's time in ``EnvDriver.decoded`` per forward, averaged over the turn. Arms, interleaved, one
run each per repeat:

- ``head``: ``AgentEnv.decoded`` as it was (each call compares the whole turn so far with what went out and
  copies it: quadratic in the turn's length over a turn; a ``call_soon_threadsafe`` per agent per forward);
- ``linear``: the module's ``AgentEnv`` (each call costs its new tokens), but a ``call_soon_threadsafe`` per
  agent per forward still (``post`` bound to ``call_soon``);
- ``new``: the module's ``AgentEnv`` with ``ServeHandle.post`` (one wake-up of the loop per forward).

Every arm checks that each agent's stream concatenates to its turn. The machine's load average is printed
beside the figures: on a shared machine they move with it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import threading
import time
import types

from oppo_engine.config import SamplingParams
from oppo_engine.sched.envs import EnvDriver
from oppo_engine.sched.episode import Episode
from oppo_engine.sched.sequence import SeqStatus, Sequence
from oppo_engine.serve.episode import FAILED, GENERATING, AgentEnv, ServedEpisode
from oppo_engine.serve.server import Posts, ServeHandle
from oppo_engine.serve.stream import ROLLED_BACK


class HeadAgentEnv(AgentEnv):
    """``AgentEnv.decoded`` as it was before it cost only its new tokens (kept here to compare against)."""

    def __init__(self, episode: ServedEpisode) -> None:
        super().__init__(episode)
        self._head_sent: tuple[int, list[int]] = (0, [])

    def decoded(self, response_ids: list[int], logprobs: list[float], turn_start: int) -> None:
        episode = self.episode
        if episode.state == FAILED:
            raise RuntimeError(f"agent episode {episode.id} failed: {episode.error}")
        if episode.stream_queue is None:
            return
        start, sent = self._head_sent if self._head_sent[0] == turn_start else (turn_start, [])
        turn = response_ids[start:]
        if turn[: len(sent)] != sent[: len(turn)]:
            episode.server.call_soon(episode.fail, ROLLED_BACK)
            return
        if len(turn) > len(sent):
            self._head_sent = (start, turn)
            new_lps = logprobs[start + len(sent) : len(response_ids)]
            episode.server.call_soon(episode.on_tokens, turn[len(sent) :], new_lps)


class LoopServer:
    """The serving side the episodes need: a loop on its own thread, ``ServeHandle``'s own ``call_soon`` and
    ``post`` (``Posts``) bound to it; ``batched=False``: ``post`` is ``call_soon`` (a wake-up per call)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, batched: bool = True) -> None:
        self.loop = loop
        self._posts = Posts(loop)
        self.call_soon = types.MethodType(ServeHandle.call_soon, self)
        self.post = types.MethodType(ServeHandle.post, self) if batched else self.call_soon


def run_arm(env_class, args, server: LoopServer, prompt_len: int = 40) -> tuple[float, float]:
    """One turn of ``args.turn_tokens`` for ``args.agents`` streaming agents: the actor's milliseconds per
    forward in ``EnvDriver.decoded`` (mean over the turn, and over its last tenth)."""
    driver = EnvDriver(pool=None, vocab_size=1000, max_model_len=prompt_len + args.turn_tokens + 8)
    rng = random.Random(args.seed)
    received: list[list[int]] = [[] for _ in range(args.agents)]
    seqs, consumers = [], []

    async def consume(i: int, queue: asyncio.Queue) -> None:
        while len(received[i]) < args.turn_tokens:
            kind, ids, _ = await queue.get()
            received[i] += ids

    def open_streams() -> None:
        for i, seq in enumerate(seqs):
            served = seq.episode.env.episode
            served.state, served.stream_queue = GENERATING, asyncio.Queue()
            consumers.append(asyncio.ensure_future(consume(i, served.stream_queue)))

    for i in range(args.agents):
        sampling = SamplingParams(max_new_tokens=args.turn_tokens + 8, seed=i)
        seq = Sequence(i, i, [1] * prompt_len, sampling, seed=i, status=SeqStatus.RUNNING)
        seq.episode = Episode(factory=lambda: None)
        seq.episode.env = env_class(ServedEpisode(server, f"e{i}"))
        driver.listening[i] = seq
        seqs.append(seq)
    ready = threading.Event()
    server.loop.call_soon_threadsafe(lambda: (open_streams(), ready.set()))
    ready.wait(10)
    live = {s.seq_id for s in seqs}
    times = []
    for _ in range(args.turn_tokens):
        for seq in seqs:
            seq.response_ids.append(rng.randrange(1000))
            seq.logprobs.append(-1.0)
        t = time.perf_counter()
        driver.decoded(live)
        times.append(time.perf_counter() - t)
        time.sleep(args.forward_ms / 1000)
    done = asyncio.run_coroutine_threadsafe(asyncio.wait_for(asyncio.gather(*consumers), 30), server.loop)
    done.result(60)
    assert all(r == s.response_ids for r, s in zip(received, seqs, strict=True)), "a stream != its turn"
    tail = times[-max(1, len(times) // 10) :]
    return 1000 * statistics.mean(times), 1000 * statistics.mean(tail)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=256)
    parser.add_argument("--turn-tokens", type=int, default=300)
    parser.add_argument("--forward-ms", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    arms = {
        "head": (HeadAgentEnv, LoopServer(loop)),
        "linear": (AgentEnv, LoopServer(loop, batched=False)),
        "new": (AgentEnv, LoopServer(loop)),
    }
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in arms}
    try:
        for _ in range(args.repeats):
            for name, (env_class, server) in arms.items():  # interleaved
                runs[name].append(run_arm(env_class, args, server))
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
    load = os.getloadavg()
    print(f"{args.agents} agents, a turn of {args.turn_tokens} tokens, {args.repeats} repeats, load {load}")
    print(f"{'arm':<6} {'ms/forward min':>15} {'median':>8} {'last 10% min':>13} {'median':>8}")
    summary = {}
    for name, values in runs.items():
        means, tails = [m for m, _ in values], [t for _, t in values]
        summary[name] = {
            "ms_per_forward_min": min(means),
            "ms_per_forward_median": statistics.median(means),
            "last_tenth_min": min(tails),
            "last_tenth_median": statistics.median(tails),
        }
        s = summary[name]
        print(
            f"{name:<6} {s['ms_per_forward_min']:>15.3f} {s['ms_per_forward_median']:>8.3f} "
            f"{s['last_tenth_min']:>13.3f} {s['last_tenth_median']:>8.3f}"
        )
    return summary


if __name__ == "__main__":
    main()
