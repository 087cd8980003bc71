"""Deterministic token-level environments for the multi-turn tests: what an environment answers depends only
on its prompt, the turn's number and the turn's tokens (never on timing), and its latency is drawn from a
seed, so every mode, every schedule and every restart must produce the same transcripts."""

from __future__ import annotations

import asyncio
import random
import threading
import time
import zlib
from dataclasses import dataclass, field

from engine_models import VOCAB

from oppo_engine import Observation


def _key(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


@dataclass
class EnvLog:
    """What the environments of one run did, from any worker thread."""

    made: int = 0
    resets: list[tuple[int, ...]] = field(default_factory=list)
    steps: list[tuple[int, int, tuple[int, ...]]] = field(default_factory=list)  # (instance, turn, turn ids)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, kind: str, item) -> None:
        with self.lock:
            getattr(self, kind).append(item)


class ScriptedEnv:
    """Answers turn ``k`` with ``obs_len`` tokens derived from its prompt, ``k`` and the turn's ids; done
    after
    ``turns`` turns (with a reward when ``reward``); each call sleeps a seeded latency of at most
    ``max_latency_s``. ``fail_on``: ``(prompt index of the first token, turn)`` pairs whose call raises;
    ``hang_on`` the same for calls that sleep ``hang_s``."""

    def __init__(self, log: EnvLog, *, turns=3, obs_len=3, max_latency_s=0.01, reward=False, fail_on=(),
                 hang_on=(), hang_s=5.0, empty=False) -> None:  # fmt: skip
        self.log, self.turns_left, self.obs_len = log, turns, obs_len
        self.max_latency_s, self.reward, self.fail_on, self.hang_on = max_latency_s, reward, fail_on, hang_on
        self.hang_s, self.empty = hang_s, empty
        with log.lock:
            log.made += 1
            self.instance = log.made
        self.prompt: tuple[int, ...] | None = None
        self.turn = 0

    def reset(self, prompt_ids: list[int]) -> None:
        assert self.prompt is None, "reset twice"
        self.prompt = tuple(prompt_ids)
        self.log.record("resets", self.prompt)

    def _answer(self, turn_ids: list[int]) -> Observation:
        assert self.prompt is not None, "step before reset"
        self.turn += 1
        self.log.record("steps", (self.instance, self.turn, tuple(turn_ids)))
        rng = random.Random(_key(self.prompt, self.turn, tuple(turn_ids)))
        if (self.prompt[0], self.turn) in self.fail_on:
            raise RuntimeError(f"tool failed on turn {self.turn}")
        delay = (
            self.hang_s if (self.prompt[0], self.turn) in self.hang_on else rng.random() * self.max_latency_s
        )
        time.sleep(delay)
        done = self.turn >= self.turns_left
        tokens = [] if self.empty else [rng.randrange(4, VOCAB) for _ in range(self.obs_len)]
        reward = float(len(turn_ids) + self.turn) if (done and self.reward) else None
        return Observation(tokens, done=done, reward=reward)

    def step(self, turn_ids: list[int]) -> Observation:
        return self._answer(turn_ids)


class AsyncScriptedEnv(ScriptedEnv):
    """``ScriptedEnv`` whose ``step`` is a coroutine that awaits its latency."""

    async def step(self, turn_ids: list[int]) -> Observation:
        await asyncio.sleep(0.001)
        return self._answer(turn_ids)


def scripted(log: EnvLog, cls=ScriptedEnv, **kw):
    """A factory of ``cls`` instances recording into ``log``."""
    return lambda: cls(log, **kw)
