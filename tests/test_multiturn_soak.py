"""Soak of multi-turn episodes: random tool latencies, tool failures and hung calls (past env_timeout_s),
Ctrl-C inside steps, checkpoints into a fresh engine between steps, policy updates, and an arena small
enough to preempt parked sequences. After every step the arena's invariant holds; every prompt comes back
exactly once, rolled out or in ``failed`` (and failed only by its environment); after draining, every
page is free. The default run is bounded; the ``slow`` one runs 200+ steps."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter

import pytest
from engine_models import EOS, VOCAB, make_actor, make_reward
from test_retained import assert_arena_invariant
from test_soak import _deadline

from oppo_engine import EngineConfig, Observation, RolloutEngine, SamplingParams

B = 4


class SoakEnv:
    """1-3 turns; each call sleeps a random few milliseconds, fails with ``p_fail``, or hangs past the
    timeout with ``p_hang``; answers 0-5 tokens (a done answer may be empty)."""

    def __init__(self, rng: random.Random, lock: threading.Lock, p_fail: float, p_hang: float) -> None:
        with lock:
            self.seed = rng.random()
        self.p_fail, self.p_hang = p_fail, p_hang
        self.turn, self.turns = 0, None

    def reset(self, prompt_ids):
        self.rng = random.Random(self.seed)
        self.turns = self.rng.randint(1, 3)

    def step(self, turn_ids):
        self.turn += 1
        draw = self.rng.random()
        if draw < self.p_fail:
            raise ConnectionError("the tool server went away")
        time.sleep(1.0 if draw < self.p_fail + self.p_hang else self.rng.random() * 0.01)
        done = self.turn >= self.turns
        n = self.rng.randint(0 if done else 1, 5)
        return Observation([self.rng.randrange(4, VOCAB) for _ in range(n)], done=done)


class Interrupt:
    """Ctrl-C (``KeyboardInterrupt``) out of the actor's forward with probability ``p``."""

    def __init__(self, rng: random.Random, p: float) -> None:
        self.rng, self.p, self.fired = rng, p, 0

    def install(self, engine: RolloutEngine) -> None:
        actor = engine._loop.actor
        original = actor.forward

        def forward(*args, **kwargs):
            if self.rng.random() < self.p:
                self.fired += 1
                raise KeyboardInterrupt
            return original(*args, **kwargs)

        actor.forward = forward


def soak(num_prompts: int, seed: int) -> Counter:
    rng = random.Random(seed)
    models = dict(actor=make_actor(), reward=make_reward())
    probe = RolloutEngine(**models, config=EngineConfig(batch_size=B, max_model_len=64, page_size=8))
    page_bytes = probe.cache_stats().page_bytes
    probe.close()
    # Room for one sequence of 64 tokens in both models and a few pages more: parked sequences are preempted.
    engine_models = dict(models, _pages=20 * page_bytes)
    lock = threading.Lock()
    env_rng = random.Random(seed + 1)
    env = lambda: SoakEnv(env_rng, lock, p_fail=0.03, p_hang=0.02)  # noqa: E731

    def build(state=None):
        kw = {k: v for k, v in engine_models.items() if k != "_pages"}
        e = RolloutEngine(
            **kw, env=env, eos_token_id=EOS,
            config=EngineConfig(batch_size=B, mode="oppo", overcommit=2, chunk_size=3, max_model_len=64,
                                page_size=8, kv_cache_bytes=engine_models["_pages"], max_deferrals=3,
                                env_timeout_s=0.25),
            sampling=SamplingParams(temperature=1.0, seed=5, max_new_tokens=24, turn_stop_token_ids=(9,),
                                    max_turn_tokens=5),
        )  # fmt: skip
        if state is not None:
            e.load_state_dict(state)
        interrupt.install(e)
        return e

    interrupt = Interrupt(random.Random(seed + 2), p=0.01)
    engine = build()
    prompts = [[4 + i % 120, 4 + i // 120, 5, 6] for i in range(num_prompts)]
    engine.add_prompts(prompts)
    seen: Counter = Counter()
    counts = Counter()
    while True:
        try:
            with _deadline(int(__import__("os").environ.get("DEADLINE", 60))):
                result = engine.step()
        except KeyboardInterrupt:
            counts["interrupts"] += 1
            assert_arena_invariant(engine)
            continue
        counts["steps"] += 1
        assert_arena_invariant(engine)
        for r in result.failed:
            assert r.finish_reason == "error"
            assert "ConnectionError" in r.error or "env_timeout_s" in r.error, r.error
            counts["timeouts" if "env_timeout_s" in r.error else "env_errors"] += 1
            seen[tuple(r.prompt_ids)] += 1
        for r in result.rollouts:
            seen[tuple(r.prompt_ids)] += 1
            assert len(r.action_mask) == len(r.response_ids) == len(r.logprobs) == len(r.policy_versions)
            assert sum(r.action_mask) <= 24 and r.finish_reason != "error"
            counts[r.finish_reason] += 1
        counts["env_calls"] += result.metrics.env_calls
        if not result.rollouts and not result.failed:
            break
        draw = rng.random()
        if draw < 0.1 or counts["steps"] % 8 == 3:  # a checkpoint, into a fresh engine
            state = engine.state_dict()
            counts["preemptions"] += engine._loop.actor_sched.num_preemptions  # every engine's, summed
            engine.close()
            engine = build(state)
            counts["checkpoints"] += 1
        elif draw < 0.3:
            engine.update_policy()
            counts["updates"] += 1
    stats = engine.cache_stats()
    assert stats.free_pages == stats.total_pages and stats.retained_pages == 0
    assert seen == Counter({tuple(p): 1 for p in prompts}), "a prompt was lost or came back twice"
    counts["preemptions"] += engine._loop.actor_sched.num_preemptions
    engine.close()
    return counts


def test_soak_short_every_prompt_once_through_tool_failures_interrupts_and_checkpoints():
    counts = soak(80, seed=0)
    print(dict(counts))
    assert counts["steps"] >= 15 and counts["checkpoints"] >= 2 and counts["env_errors"] >= 1, counts
    assert counts["env_done"] > 0 and counts["interrupts"] >= 1, counts


@pytest.mark.slow
def test_soak_200_steps_every_prompt_once_through_tool_failures_interrupts_and_checkpoints():
    counts = soak(900, seed=1)
    print(dict(counts))
    assert counts["steps"] >= 200, counts
    assert counts["checkpoints"] >= 10 and counts["interrupts"] >= 1 and counts["timeouts"] >= 1, counts
    assert counts["env_errors"] >= 5 and counts["preemptions"] > 0, counts
