"""Remote scorers (issue 16): a ScorerService rank serves the reward and reference models of two actor ranks.

Spawned processes on gloo (tests/distributed.py). Exactness: tokens, log-probs and policy versions equal
the same engines with colocated scorers; rewards and reference log-probs equal HF's own forward, through a
service arena tight enough to preempt and swap, in ``intra`` and ``oppo`` with groups (n=2). Faults: a
service killed mid-step fails each actor's step naming its rank, rolled back with every prompt kept; a
client killed mid-step has its pages freed while the other is served to the end. Bad input is refused at
connection, naming the mismatch.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from distributed import run_ranks
from engine_models import EOS, actor_config, make_actor, make_reward, random_prompts
from test_ppo_scorers import hf_ref_logprobs, make_reference

from oppo_engine import EngineConfig, RolloutEngine, SamplingParams

CLIENTS, SERVICE = (0, 1), 2
PAGE = 8
MAX_LEN = 64
# Pages of 4 KiB (the reference's 8 tokens): 20 pages hold about three of the two clients' sequences in
# flight, so the service preempts (swaps) its younger sequences.
TIGHT_SERVICE_BYTES = 20 * 4096
LIVENESS_S = 30.0


def _config(mode: str, **overrides) -> EngineConfig:
    cfg = dict(batch_size=4, mode=mode, chunk_size=4, page_size=PAGE, max_model_len=MAX_LEN)
    if mode in ("inter", "oppo"):
        cfg["overcommit"] = 2
    cfg.update(overrides)
    return EngineConfig(**cfg)


def _sampling() -> SamplingParams:
    return SamplingParams(temperature=1.0, max_new_tokens=14, seed=11, n=2)


def _prompts(rank: int) -> list[list[int]]:
    return random_prompts(6, seed=100 + rank, min_len=2, max_len=12)


def _drain(engine: RolloutEngine) -> list[dict]:
    out = []
    while result := engine.step().rollouts:
        out += [_as_dict(r) for r in result]
    return sorted(out, key=lambda r: (r["group_id"], r["sample_index"]))


def _as_dict(r) -> dict:
    return dict(
        group_id=r.group_id, sample_index=r.sample_index, prompt_ids=r.prompt_ids, response_ids=r.response_ids,
        logprobs=r.logprobs, policy_versions=r.policy_versions, reward=r.reward, ref_logprobs=r.ref_logprobs,
    )  # fmt: skip


def _service(pg, kv_cache_bytes=TIGHT_SERVICE_BYTES, **kw):
    from oppo_engine.dist import ScorerService

    return ScorerService(
        reward=make_reward(), reference=make_reference(), group=pg, kv_cache_bytes=kv_cache_bytes,
        max_model_len=MAX_LEN, page_size=PAGE, liveness_timeout_s=LIVENESS_S, **kw,
    )  # fmt: skip


def _client_engine(pg, mode: str, **cfg) -> RolloutEngine:
    from oppo_engine.dist import RemoteScorers

    remote = RemoteScorers(service_rank=SERVICE, group=pg, liveness_timeout_s=LIVENESS_S)
    return RolloutEngine(
        actor=make_actor(), reward=remote, config=_config(mode, **cfg), sampling=_sampling(), eos_token_id=EOS
    )


def _exact_rank(rank: int, world_size: int, mode: str):
    import torch.distributed as dist

    pg = dist.group.WORLD
    if rank == SERVICE:
        return _service(pg).serve()
    engine = _client_engine(pg, mode)
    engine.add_prompts(_prompts(rank))
    rollouts = _drain(engine)
    stats = engine.cache_stats()
    lane = engine._loop.scorer_lane
    engine.close()
    return dict(rollouts=rollouts, free=stats.free_pages == stats.total_pages, messages=lane.messages_sent,
                bytes=lane.bytes_sent)  # fmt: skip


def _colocated(rank: int, mode: str) -> list[dict]:
    engine = RolloutEngine(
        actor=make_actor(), reward=make_reward(), reference=make_reference(), config=_config(mode),
        sampling=_sampling(), eos_token_id=EOS,
    )  # fmt: skip
    engine.add_prompts(_prompts(rank))
    out = _drain(engine)
    engine.close()
    return out


@pytest.mark.parametrize("mode", ["intra", "oppo"])
def test_remote_scorers_equal_colocated_and_hf_through_a_tight_service_arena(mode):
    values = run_ranks(_exact_rank, 3, mode, timeout_s=240)
    stats = values[SERVICE]
    assert stats.preemptions > 0, "the tight service arena should have preempted (swapped) sequences"
    assert stats.free_pages == stats.total_pages, stats
    assert sorted(stats.closed) == list(CLIENTS) and not stats.lost
    reward, reference = make_reward(), make_reference()
    for rank in CLIENTS:
        got = values[rank]
        assert got["free"]
        want = _colocated(rank, mode)
        prompts = _prompts(rank)
        # Every prompt exactly once (n samples each), the same as colocated.
        assert [(r["group_id"], r["sample_index"]) for r in got["rollouts"]] == [
            (g, j) for g in range(len(prompts)) for j in range(2)
        ]
        for g, w in zip(got["rollouts"], want, strict=True):
            assert g["prompt_ids"] == w["prompt_ids"] == prompts[g["group_id"]]
            assert g["response_ids"] == w["response_ids"]
            assert g["logprobs"] == w["logprobs"]
            assert g["policy_versions"] == w["policy_versions"]
            with torch.inference_mode():
                ids = torch.tensor([g["prompt_ids"] + g["response_ids"]])
                assert g["reward"] == pytest.approx(reward(ids).logits[0, 0].item(), abs=1e-5)
            want_ref = hf_ref_logprobs(reference, g["prompt_ids"], g["response_ids"], 1.0)
            torch.testing.assert_close(torch.tensor(g["ref_logprobs"]), want_ref, atol=1e-5, rtol=0)
        assert got["messages"] > 0 and got["bytes"] > 0
