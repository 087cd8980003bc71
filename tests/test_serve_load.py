"""Load: B + Δ = 256 agent episodes in flight at once over real HTTP connections. Every episode comes back
exactly once, and pages, file descriptors and threads return to their baseline after ``close()``. The p99
latency the server adds to a response (from the turn's last token reaching the serving loop to the client
holding the answer) is printed, never asserted: the machine is shared."""

from __future__ import annotations

import os
import threading
import time

import pytest
from serve_models import chat_actor, chat_tokenizer

from oppo_engine import EngineConfig, RolloutEngine, SamplingParams
from oppo_engine.serve import episode as episode_module

DEADLINE_S = 600.0


@pytest.mark.slow
def test_256_concurrent_episodes_over_http_each_come_back_once_and_nothing_leaks(monkeypatch):
    tokenizer = chat_tokenizer()
    engine = RolloutEngine(
        chat_actor(tokenizer), reward=lambda p, r: 0.0, tokenizer=tokenizer,
        config=EngineConfig(batch_size=192, mode="oppo", overcommit=64, chunk_size=8, max_model_len=160),
        sampling=SamplingParams(max_new_tokens=16, seed=4),
    )  # fmt: skip
    threads = {t.name for t in threading.enumerate()}
    fds = len(os.listdir("/proc/self/fd"))
    turn_done: dict[tuple[str, int], float] = {}
    added: list[float] = []
    real_on_turn = episode_module.ServedEpisode.on_turn

    async def timed_on_turn(self, turn_ids, logprobs):
        turn_done[(self.id, self.turn)] = time.monotonic()
        return await real_on_turn(self, turn_ids, logprobs)

    monkeypatch.setattr(episode_module.ServedEpisode, "on_turn", timed_on_turn)
    handle = engine.serve()

    async def agent(task, client):
        messages = [{"role": "user", "content": f"task {task}"}]
        episode_id = client.base_url.path.split("/")[2]
        for turn in range(2):
            answer = await client.chat.completions.create(model="m", messages=messages, max_tokens=4)
            added.append(time.monotonic() - turn_done[(episode_id, turn)])
            messages += [{"role": "assistant", "content": answer.choices[0].message.content}]
            messages += [{"role": "user", "content": "next"}]
        return float(task)

    engine.add_agents(agent, range(256), in_process=False)
    rollouts, failed = [], []
    deadline = time.monotonic() + DEADLINE_S
    while len(rollouts) + len(failed) < 256:
        assert time.monotonic() < deadline, f"{len(rollouts) + len(failed)} of 256 came back"
        result = engine.step()
        rollouts += result.rollouts
        failed += result.failed
    assert failed == []
    assert sorted(r.reward for r in rollouts) == [float(t) for t in range(256)]  # each exactly once
    stats = engine.cache_stats()
    assert stats.free_pages == stats.total_pages
    engine.close()
    assert not handle.thread.is_alive()
    settle = time.monotonic() + 10
    while time.monotonic() < settle and (
        {t.name for t in threading.enumerate()} - threads or len(os.listdir("/proc/self/fd")) > fds
    ):
        time.sleep(0.05)
    assert {t.name for t in threading.enumerate()} - threads == set()
    assert len(os.listdir("/proc/self/fd")) <= fds
    added.sort()
    p99 = added[min(len(added) - 1, int(0.99 * len(added)))]
    print(f"\n{len(added)} responses: added latency p50 {added[len(added) // 2] * 1e3:.1f} ms, "
          f"p99 {p99 * 1e3:.1f} ms (load {os.getloadavg()[0]:.1f})")  # fmt: skip
