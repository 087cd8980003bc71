"""The CUDA path's host-side rules, proved on the CPU where they can be: deferred frees through a whole
engine, the reference log-prob formula, the cache ops' Triton/torch fallbacks, the build-time warm-up;
and, marked ``cuda``, the stream-order properties only a GPU can show."""

from __future__ import annotations

import pytest
import torch
from engine_models import EOS, make_actor, make_reward, random_prompts

from oppo_engine import EngineConfig, RolloutEngine, SamplingParams


class SlowEvent:
    """A lane's CUDA event that has not completed when polled; it completes once waited on."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


@pytest.fixture(scope="module")
def actor():
    return make_actor()


@pytest.fixture(scope="module")
def reward():
    return make_reward()


def make_engine(actor, reward, mode: str = "sequential", **cfg) -> RolloutEngine:
    return RolloutEngine(
        actor=actor,
        reward=reward,
        config=EngineConfig(batch_size=4, mode=mode, max_model_len=64, page_size=8, **cfg),
        sampling=SamplingParams(temperature=0.0, max_new_tokens=12),
        eos_token_id=EOS,
    )


def drain(engine: RolloutEngine) -> list:
    rollouts = []
    while result := engine.step().rollouts:
        rollouts.extend(result)
    return rollouts


@pytest.mark.parametrize("mode", ["sequential", "oppo"])
def test_free_pages_equal_total_after_a_drain_with_frees_pending_behind_lane_events(actor, reward, mode):
    prompts = random_prompts(8, seed=3)
    plain = make_engine(actor, reward, mode)
    plain.add_prompts(prompts)
    expected = {tuple(r.prompt_ids): r.response_ids for r in drain(plain)}
    engine = make_engine(actor, reward, mode)
    for cache in engine._caches.values():  # as on CUDA: every free pends behind its lane's event
        cache.free_event = SlowEvent
    engine.add_prompts(prompts)
    got = {tuple(r.prompt_ids): r.response_ids for r in drain(engine)}
    assert got == expected
    stats = engine.cache_stats()
    assert stats.free_pages == stats.total_pages, stats


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_logprobs_as_gather_minus_logsumexp_equal_the_log_softmax_formula(dtype, monkeypatch):
    from oppo_engine.model import scorer

    monkeypatch.setattr(scorer, "_LSE_ELEMENTS", 3 * 1000)  # blocks of 3 rows: chunking is exercised
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(10, 1000, generator=gen) * 4).to(dtype)
    logits[3, 17] = float("-inf")  # a masked-out token (as some heads emit)
    inv_t = 1.0 / torch.tensor([1.0, 0.7, 1.3, 1.0, 0.5, 2.0, 1.0, 0.9, 1.1, 1.0])
    rows = torch.tensor([0, 1, 3, 3, 5, 9, 9])
    tokens = torch.tensor([5, 999, 17, 18, 0, 123, 456])
    old = (logits.float() * inv_t[:, None]).log_softmax(-1)[rows, tokens]
    lse = scorer.scaled_logsumexp(logits, inv_t)
    new = scorer.picked_logprobs(logits, inv_t, lse, rows, tokens)
    assert new[2] == float("-inf")
    torch.testing.assert_close(new, old, atol=2e-6, rtol=1e-6)
