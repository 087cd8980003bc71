"""Prompts sharing a prefix across prompts (``EngineConfig.share_prompt_prefix``): prompts sampled once
whose first tokens are identical compute them once per model and share their pages.

Exactness: every prompt's rollout (tokens, behaviour log-probs, reward, reference log-probs, critic values)
equals the same engine's with the feature off, in every mode -- ``oppo`` with overcommit and more prompts
than the batch, so sequences are carried -- and under memory pressure; each prompt is returned exactly
once; no page or reference is left behind. The classes (``sched/prefix.py``) and the schedulers' forks
are tested on their own.
"""

from __future__ import annotations

import random

import pytest
import torch
from engine_models import EOS, VOCAB, make_actor, make_reward, random_prompts
from test_groups import assert_no_reference_left, drain
from test_ppo_scorers import make_critic, make_reference

from oppo_engine import EngineConfig, RolloutEngine, SamplingParams
from oppo_engine.cache import KVArena, KVCacheManager, KVSpec
from oppo_engine.sched.prefix import common_prefix_len, shared_prefixes
from oppo_engine.sched.scheduler import ActorScheduler
from oppo_engine.sched.sequence import Sequence

SEED = 5
ATOL = 1e-5
MODELS = ("actor", "reward", "reference", "critic")


@pytest.fixture(scope="module")
def models():
    return dict(actor=make_actor(), reward=make_reward(), reference=make_reference(), critic=make_critic())


def make_engine(models, mode, *, share, batch_size=6, temperature=1.0, max_new=10, **cfg):
    cfg.setdefault("max_model_len", 128)
    cfg.setdefault("page_size", 8)
    return RolloutEngine(
        **models,
        config=EngineConfig(batch_size=batch_size, mode=mode, share_prompt_prefix=share, **cfg),
        sampling=SamplingParams(temperature=temperature, max_new_tokens=max_new, seed=SEED),
        eos_token_id=EOS,
    )


def _prompts() -> list[list[int]]:
    """A demo-like batch: most prompts begin with one 21-token prefix (ending mid-page at page size 8),
    some with another of 16 (a page boundary), two are identical, one is its prefix plus one token, and
    a few share nothing."""
    rng = random.Random(11)
    tail = lambda k: [rng.randrange(4, VOCAB) for _ in range(k)]  # noqa: E731
    a, b = tail(21), tail(16)
    prompts = [a + tail(rng.randrange(1, 9)) for _ in range(7)]
    prompts += [b + tail(rng.randrange(2, 6)) for _ in range(3)]
    prompts += [a + [7]]  # the class's prefix is all of it but its last token
    twin = a[:5] + tail(20)
    prompts += [twin, list(twin)]  # identical prompts: all but the last token shared
    prompts += random_prompts(3, seed=4, min_len=3, max_len=12)
    rng.shuffle(prompts)
    return prompts


PROMPTS = _prompts()


def _by_prompt(rollouts) -> dict:
    got = {}
    for r in rollouts:
        assert r.group_id not in got, f"prompt {r.group_id} returned twice"
        got[r.group_id] = r
    return got


def assert_same(got, want, atol=ATOL) -> None:
    assert got.prompt_ids == want.prompt_ids
    assert got.response_ids == want.response_ids
    assert got.policy_versions == want.policy_versions
    assert got.finish_reason == want.finish_reason
    torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=atol, rtol=0)
    assert got.reward == pytest.approx(want.reward, abs=atol)
    for field in ("ref_logprobs", "values"):
        torch.testing.assert_close(
            torch.tensor(getattr(got, field)), torch.tensor(getattr(want, field)), atol=atol, rtol=0
        )


def _run(models, mode, share, prompts=PROMPTS, **kw):
    engine = make_engine(models, mode, share=share, **kw)
    engine.add_prompts(prompts)
    rollouts, metrics = drain(engine)
    got = _by_prompt(rollouts)
    assert sorted(got) == list(range(len(prompts)))  # every prompt exactly once
    engine._arena.synchronize()  # deferred frees behind the lanes' events (CUDA)
    assert_no_reference_left(engine)
    engine.close()
    return got, metrics


MODE_CASES = [
    ("sequential", {}),
    ("intra", {"chunk_size": 3}),
    ("inter", {"overcommit": 3}),
    ("oppo", {"overcommit": 3, "chunk_size": 4}),
]


@pytest.mark.parametrize("mode, extra", MODE_CASES)
def test_sharing_equals_the_engine_without_it_in_every_mode(models, mode, extra):
    want, off = _run(models, mode, False, **extra)
    got, on = _run(models, mode, True, **extra)
    for i in want:
        assert_same(got[i], want[i])
    for name in MODELS:
        assert sum(m.shared_tokens[name] for m in off) == 0
        assert sum(m.shared_tokens[name] for m in on) > 0, (name, [m.shared_tokens for m in on])
    if mode in ("inter", "oppo"):
        assert any(m.deferred for m in on)  # sequences were carried across steps


@pytest.mark.cuda
def test_sharing_on_cuda_streams_equals_the_engine_without_it():
    """Forks and copies on write on the lanes' CUDA streams (the actor's high-priority, the scorers' low)."""
    makers = dict(actor=make_actor, reward=make_reward, reference=make_reference, critic=make_critic)
    cuda = {name: make().to("cuda") for name, make in makers.items()}
    want, _ = _run(cuda, "oppo", False, overcommit=3, chunk_size=3)
    got, on = _run(cuda, "oppo", True, overcommit=3, chunk_size=3)
    for i in want:
        assert_same(got[i], want[i], atol=1e-4)
    assert all(sum(m.shared_tokens[name] for m in on) > 0 for name in MODELS)


def test_one_step_shares_every_class_prefix_once_per_model(models):
    """sequential, the whole batch in one step: each class's prefix is computed once per model and forked
    by every other member -- the saving a user reads in ``StepMetrics.shared_tokens``."""
    classes = shared_prefixes(PROMPTS, 8)
    want = {}
    for cls, length in classes:
        if length:
            want[cls] = length
    members = {c: sum(1 for k, _ in classes if k == c) for c in want}
    saved = sum((members[c] - 1) * want[c] for c in want)
    assert saved >= 6 * 21  # the test's classes are what it claims
    got, metrics = _run(models, "sequential", True, batch_size=len(PROMPTS))
    assert len(metrics) == 1
    assert metrics[0].shared_tokens == dict.fromkeys(MODELS, saved)
    # the actor prefilled the prompts' tokens minus the shared ones, no more (none recomputed)
    assert metrics[0].recomputed_tokens == dict.fromkeys(MODELS, 0)


def test_greedy_tight_memory_preempts_and_stays_exact(models):
    want, _ = _run(models, "intra", False, temperature=0.0, chunk_size=2)
    probe = make_engine(models, "sequential", share=True, max_model_len=64)
    page_bytes = probe.cache_stats().page_bytes
    probe.close()
    engine = make_engine(
        models, "intra", share=True, temperature=0.0, chunk_size=2, batch_size=8, max_model_len=64,
        kv_cache_bytes=40 * page_bytes,
    )  # fmt: skip
    engine.add_prompts(PROMPTS)
    rollouts, metrics = drain(engine)
    got = _by_prompt(rollouts)
    assert sorted(got) == list(range(len(PROMPTS)))
    preemptions = engine._loop.actor_sched.num_preemptions + sum(
        s.num_preemptions for s in engine._loop.scorer_lane.scheds.values()
    )
    assert preemptions > 0  # the arena was tight enough to preempt
    assert sum(m.shared_tokens["actor"] for m in metrics) > 0
    for i in want:
        assert_same(got[i], want[i])
    assert_no_reference_left(engine)


def test_a_one_shot_failure_is_retried_exactly_and_leaks_no_shared_page(models):
    from test_intra import _fail_on_call

    want, _ = _run(models, "oppo", False, overcommit=3, chunk_size=2)
    for lane, k in (("actor", 2), ("reference", 3), ("critic", 1)):
        engine = make_engine(models, "oppo", share=True, overcommit=3, chunk_size=2)
        engine.add_prompts(PROMPTS)
        if lane == "actor":
            _fail_on_call(engine._loop.actor, "forward", k=k)
        else:
            _fail_on_call(engine._loop.scorer_lane.scheds[lane].scorer, "prefill", k=k)
        rollouts, metrics = drain(engine)
        assert sum(m.retries for m in metrics) == 1
        got = _by_prompt(rollouts)
        assert sorted(got) == list(range(len(PROMPTS)))
        for i in want:
            assert_same(got[i], want[i])
        assert_no_reference_left(engine)


def test_groups_keep_their_own_sharing_and_share_nothing_across_prompts(models):
    """n > 1: a group shares its prompt among its samples (as before); no prefix across groups."""
    cfg = EngineConfig(batch_size=4, mode="sequential", max_model_len=128, page_size=8)
    engine = RolloutEngine(
        **models, config=cfg, sampling=SamplingParams(max_new_tokens=4, seed=SEED, n=2), eos_token_id=EOS
    )
    prompts = [PROMPTS[0], PROMPTS[1]]
    engine.add_prompts(prompts)
    rollouts, metrics = drain(engine)
    assert len(rollouts) == 4
    shared = {name: sum(m.shared_tokens[name] for m in metrics) for name in MODELS}
    assert shared == dict.fromkeys(MODELS, sum(len(p) - 1 for p in prompts))
    assert_no_reference_left(engine)


def test_bad_settings_raise_value_error_naming_the_option():
    with pytest.raises(ValueError, match="share_prompt_prefix"):
        EngineConfig(share_prompt_prefix="yes")
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="shared_prefix_min_tokens"):
            EngineConfig(shared_prefix_min_tokens=bad)
    with pytest.raises(ValueError, match="shared_prefix_min_tokens=32 is ignored"):
        EngineConfig(share_prompt_prefix=False, shared_prefix_min_tokens=32)
    assert EngineConfig().share_prompt_prefix is True
    assert EngineConfig(shared_prefix_min_tokens=1).shared_prefix_min_tokens == 1


def test_min_tokens_below_which_nothing_is_shared(models):
    prompts = [[9] * 12 + [4, 5], [9] * 12 + [6], [9] * 12 + [7, 8, 4]]  # 12 shared tokens
    for least, shared in ((13, 0), (12, 24), (None, 24)):  # None: page_size (8)
        engine = make_engine(models, "sequential", share=True, batch_size=3, shared_prefix_min_tokens=least)
        engine.add_prompts(prompts)
        _, metrics = drain(engine)
        assert metrics[0].shared_tokens["actor"] == shared, least
        engine.close()


# -- the classes -------------------------------------------------------------------------------------


def test_classes_share_what_they_claim_and_split_where_it_saves_more():
    rng = random.Random(3)
    for _ in range(200):
        stems = [[rng.randrange(3) for _ in range(rng.randrange(0, 12))] for _ in range(3)]
        prompts = [
            rng.choice(stems) + [rng.randrange(3) for _ in range(rng.randrange(1, 6))]
            for _ in range(rng.randrange(0, 12))
        ]
        least = rng.randrange(1, 6)
        classes = shared_prefixes(prompts, least)
        assert len(classes) == len(prompts)
        by_class: dict[int, list[int]] = {}
        for i, (cls, length) in enumerate(classes):
            if cls < 0:
                assert length == 0
                continue
            assert least <= length <= len(prompts[i]) - 1
            by_class.setdefault(cls, []).append(i)
        for members in by_class.values():
            assert len(members) >= 2
            length = classes[members[0]][1]
            assert all(classes[i][1] == length for i in members)
            assert len({tuple(prompts[i][:length]) for i in members}) == 1
        assert sorted(by_class) == list(range(len(by_class)))
    # A long prefix is not dragged down to a short one that a third prompt shares.
    long_a, long_b, short = [1] * 20 + [2, 9], [1] * 20 + [3], [1] * 4 + [5, 6]
    classes = shared_prefixes([long_a, short, long_b], 2)
    assert classes[0] == classes[2] == (0, 20) and classes[1] == (-1, 0)
    # ... unless one class saves more: 8 forks of 4 tokens beat 1 fork of 5 and 6 of 4.
    many = [[1] * 4 + [k, 9] for k in range(5, 12)]
    classes = shared_prefixes([[1] * 5 + [2, 9], [1] * 5 + [3], *many], 2)
    assert {c for c, _ in classes} == {0} and classes[0][1] == 4


def test_common_prefix_len():
    a = list(range(100))
    assert common_prefix_len(a, a, 100) == 100
    assert common_prefix_len(a, a, 37) == 37
    assert common_prefix_len(a, [*a[:33], -1, *a[34:]], 100) == 33
    assert common_prefix_len(a, a[:5], 100) == 5
    assert common_prefix_len([], a, 10) == 0
    with pytest.raises(ValueError, match="min_len"):
        shared_prefixes([a], 0)


# -- the actor's scheduler ------------------------------------------------------------------------------


def _manager(num_pages=32, page_size=8):
    spec = KVSpec(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32)
    arena = KVArena({"m": spec}, page_size=page_size, num_pages=num_pages)
    return arena, KVCacheManager(arena, "m")


def _seq(seq_id, prompt, share_id, share_len):
    seq = Sequence(seq_id, seq_id, list(prompt), SamplingParams(max_new_tokens=4), seed=seq_id)
    seq.share_id, seq.share_len = share_id, share_len
    return seq


def _schedule(sched: ActorScheduler):
    """One forward's chunks; each sampling chunk draws a token (5)."""
    chunks = sched.schedule()
    for c in chunks:
        if c.samples:
            sched.append_token(c.seq, 5, 0.0, 0)
    return chunks


def test_the_prefix_is_a_chunk_of_its_own_and_the_others_fork_it_next_forward():
    arena, cache = _manager()
    sched = ActorScheduler(cache, max_num_seqs=8, max_num_batched_tokens=4096, max_model_len=64)
    prefix = list(range(4, 17))  # 13 tokens: a page and 5 tokens
    seqs = [_seq(i, prefix + [20 + i] * (i + 1), 0, 13) for i in range(3)]
    for s in seqs:
        sched.add(s)
    first = sched.schedule()
    assert [(c.seq.seq_id, c.start, len(c.token_ids)) for c in first] == [(0, 0, 13)]
    second = sched.schedule()
    assert [(c.seq.seq_id, c.start, len(c.token_ids)) for c in second] == [(0, 13, 1), (1, 13, 2), (2, 13, 3)]
    pages = [cache.pages(s.seq_id) for s in seqs]
    assert pages[1][0] == pages[2][0] == pages[0][0]  # the full page shared
    assert len({p[1] for p in pages}) == 3  # the partial one copied on write
    assert cache.shared_tokens == 26
    for s in seqs:
        cache.free(s.seq_id)
    assert arena.num_free_pages() == arena.num_pages


def test_a_carried_sequence_with_kv_from_an_earlier_step_is_never_a_source():
    """Its prefix KV may come from an older policy (``retained_kv="reuse"``): a member with no KV prefills
    the prefix itself rather than fork it."""
    arena, cache = _manager()
    sched = ActorScheduler(cache, max_num_seqs=8, max_num_batched_tokens=4096, max_model_len=64)
    prefix = list(range(4, 20))
    carried = _seq(0, prefix + [30, 31], 0, 16)
    carried.response_ids, carried.logprobs, carried.policy_versions = [5], [0.0], [0]
    cache.append_slots(carried.seq_id, 18)
    carried.num_computed = 18
    fresh = _seq(1, prefix + [40], 0, 16)
    sched.add(carried)
    sched.add(fresh)
    chunks = sched.schedule()
    assert [(c.seq.seq_id, c.start, len(c.token_ids)) for c in chunks] == [(0, 18, 1), (1, 0, 16)]
    assert cache.shared_tokens == 0
    sched.detach_all()
    for s in (carried, fresh):
        cache.free(s.seq_id)
    assert arena.num_free_pages() == arena.num_pages


def test_a_preempted_member_forks_again_or_prefills_again():
    arena, cache = _manager()
    sched = ActorScheduler(cache, max_num_seqs=8, max_num_batched_tokens=4096, max_model_len=64)
    prefix = list(range(4, 20))
    a, b = _seq(0, prefix + [30], 0, 16), _seq(1, prefix + [31, 32], 0, 16)
    sched.add(a)
    sched.add(b)
    _schedule(sched)
    _schedule(sched)
    sched.preempt(b)
    chunks = _schedule(sched)  # a decodes (its token is pending), b forks from a again
    # b: its prompt's last 2 tokens and its response token
    assert (b.seq_id, 16, 3) in [(c.seq.seq_id, c.start, len(c.token_ids)) for c in chunks]
    assert cache.shared_tokens == 32
    sched.preempt(b)
    sched.preempt(a)
    chunks = _schedule(sched)  # nobody holds the prefix: one computes it again, the other waits
    assert [(c.seq.seq_id, c.start, len(c.token_ids)) for c in chunks] == [(0, 0, 16)]
    sched.detach_all()
    for s in (a, b):
        cache.free(s.seq_id)
    assert arena.num_free_pages() == arena.num_pages
