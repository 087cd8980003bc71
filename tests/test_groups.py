"""Groups (``SamplingParams(n)``): a prompt sampled n times is prefilled once per model, its pages shared.

The n rollouts of a group equal n separate prompts run with the same derived seeds (tokens exact, scores to
rounding) in every mode; the prefix's pages are shared (counted once by the arena) and copied on write;
no page leaks after preemption, failure or draining; a step returns whole groups only.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from engine_models import EOS, make_actor, make_reward, random_prompts
from test_intra import _fail_on_call, assert_all_pages_free, assert_equals_hf
from test_ppo_scorers import make_critic, make_reference

from oppo_engine import EngineConfig, RolloutEngine, SamplingParams
from oppo_engine.cache import KVArena, KVCacheManager, KVSpec
from oppo_engine.cache.swap import swap_in, swap_out
from oppo_engine.sched.prompts import derive_seed, sample_seed

ATOL = 1e-4
SEED = 7
MODELS = ("actor", "reward", "reference", "critic")


@pytest.fixture(scope="module")
def models():
    return dict(actor=make_actor(), reward=make_reward(), reference=make_reference(), critic=make_critic())


def make_engine(models, mode, *, n, batch_size, temperature=1.0, max_new=12, sampling=None, **cfg):
    cfg.setdefault("max_model_len", 96)
    cfg.setdefault("page_size", 8)
    return RolloutEngine(
        **models,
        config=EngineConfig(batch_size=batch_size, mode=mode, **cfg),
        sampling=sampling or SamplingParams(temperature=temperature, max_new_tokens=max_new, seed=SEED, n=n),
        eos_token_id=EOS,
    )


def drain(engine: RolloutEngine) -> tuple[list, list]:
    """Every rollout (in step order) and every step's metrics."""
    rollouts, metrics = [], []
    while (result := engine.step()).rollouts:
        rollouts.extend(result.rollouts)
        metrics.append(result.metrics)
    return rollouts, metrics


def separate(models, prompts, n, *, temperature=1.0, max_new=12) -> dict:
    """(prompt index, sample index) -> the rollout of that sample run as a prompt of its own (n = 1), seeded
    as the group's sample would be."""
    flat, sampling, keys = [], [], []
    for i, p in enumerate(prompts):
        for j in range(n):
            seed = sample_seed(derive_seed(SEED, i), j)
            flat.append(p)
            sampling.append(SamplingParams(temperature=temperature, max_new_tokens=max_new, seed=seed))
            keys.append((i, j))
    engine = make_engine(models, "sequential", n=1, batch_size=4, temperature=temperature, max_new=max_new)
    engine.add_prompts(flat, sampling)
    rollouts, _ = drain(engine)
    return {keys[r.group_id]: r for r in rollouts}


def assert_same(got, want) -> None:
    assert got.prompt_ids == want.prompt_ids
    assert got.response_ids == want.response_ids
    assert got.policy_versions == want.policy_versions
    torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5, rtol=0)
    assert got.reward == pytest.approx(want.reward, abs=ATOL)
    torch.testing.assert_close(
        torch.tensor(got.ref_logprobs), torch.tensor(want.ref_logprobs), atol=ATOL, rtol=0
    )
    torch.testing.assert_close(torch.tensor(got.values), torch.tensor(want.values), atol=ATOL, rtol=0)


def assert_no_reference_left(engine: RolloutEngine) -> None:
    """Every page free and unreferenced: shared pages were dropped by every holder."""
    assert_all_pages_free(engine)
    allocator = engine._arena.allocator
    assert all(allocator.refcount(p) == 0 for p in range(engine._arena.num_pages))
    assert engine._arena._extra_refs == 0


def assert_whole_groups(rollouts, n) -> None:
    by_group = Counter(r.group_id for r in rollouts)
    assert set(by_group.values()) == {n}, by_group
    for g in by_group:
        members = [r for r in rollouts if r.group_id == g]
        assert sorted(r.sample_index for r in members) == list(range(n))
        assert len({r.deferred_steps for r in members}) == 1  # carried as a unit


# Prompts of 9..27 tokens with page_size 8: prefixes ending mid-page and on a page boundary (P - 1 = 16).
PROMPTS = random_prompts(5, seed=3, min_len=9, max_len=27) + [list(range(4, 21))]


@pytest.mark.parametrize(
    "mode, extra",
    [
        ("sequential", {}),
        ("intra", {"chunk_size": 3}),
        ("inter", {"overcommit": 4}),
        ("oppo", {"overcommit": 4}),
    ],
)
def test_a_group_equals_its_samples_run_separately_in_every_mode(models, mode, extra):
    n = 4
    want = separate(models, PROMPTS, n)
    engine = make_engine(models, mode, n=n, batch_size=8, **extra)
    engine.add_prompts(PROMPTS)
    got, metrics = drain(engine)
    assert len(got) == n * len(PROMPTS)
    for m in metrics:
        assert m.rollouts % n == 0
    assert_whole_groups(got, n)
    for r in got:
        assert_same(r, want[r.group_id, r.sample_index])
    assert_equals_hf(got, models, temperature=1.0)
    # Each prompt's prefix (all but its last token) was computed once per model, shared n - 1 times.
    shared = {name: sum(m.shared_tokens[name] for m in metrics) for name in MODELS}
    assert shared == dict.fromkeys(MODELS, (n - 1) * sum(len(p) - 1 for p in PROMPTS))
    assert_no_reference_left(engine)


def test_samples_of_a_group_differ_and_sample_zero_is_the_prompt_sampled_once(models):
    prompts = PROMPTS[:3]
    engine = make_engine(models, "sequential", n=4, batch_size=4)
    engine.add_prompts(prompts)
    got, _ = drain(engine)
    once = make_engine(models, "sequential", n=1, batch_size=3)
    once.add_prompts(prompts)
    single, _ = drain(once)
    for r in single:  # n = 1 results do not change: sample 0 is the prompt's own seed
        (zero,) = [g for g in got if g.group_id == r.group_id and g.sample_index == 0]
        assert zero.response_ids == r.response_ids
    for g in range(len(prompts)):
        responses = {tuple(r.response_ids) for r in got if r.group_id == g}
        assert len(responses) > 1  # independent samples, not copies


def test_greedy_samples_of_a_group_are_identical(models):
    engine = make_engine(models, "intra", n=3, batch_size=6, temperature=0.0, chunk_size=2)
    engine.add_prompts(PROMPTS[:4])
    got, _ = drain(engine)
    for g in range(4):
        members = [r for r in got if r.group_id == g]
        assert len({tuple(r.response_ids) for r in members}) == 1
        assert max(r.reward for r in members) - min(r.reward for r in members) < ATOL  # up to rounding


def test_prompt_pages_are_shared_while_a_group_is_carried(models):
    """oppo: a carried group holds its prompt's pages once in every model (cache_stats counts them)."""
    prompt = list(range(4, 4 + 33))  # 32 shared tokens: 4 full pages of 8 in each model
    short = SamplingParams(temperature=1.0, max_new_tokens=2, ignore_eos=True, n=4)
    long = SamplingParams(temperature=1.0, max_new_tokens=40, ignore_eos=True, n=4)
    engine = make_engine(models, "oppo", n=4, batch_size=4, overcommit=4, chunk_size=64)
    engine.add_prompts([prompt[:10], prompt], [short, long])
    first = engine.step()
    assert {r.group_id for r in first.rollouts} == {0}
    stats = engine.cache_stats()
    # The long group is carried with its prompt's pages shared by its 4 samples.
    for name in MODELS:
        ps = engine._caches[name].page_size
        assert stats.shared_pages[name] >= 32 // ps, stats
        held = {s.seq_id: engine._caches[name].pages(s.seq_id) for s in engine._buffer.carried}
        prefixes = {tuple(pages[: 32 // ps]) for pages in held.values() if pages}
        assert len(prefixes) == 1  # the same page ids in every sample
    assert stats.retained_pages < sum(
        len(c.pages(s.seq_id)) for c in engine._caches.values() for s in engine._buffer.carried
    )
    rest, _ = drain(engine)
    assert_whole_groups(rest, 4)
    assert_no_reference_left(engine)


def test_tight_memory_preempts_samples_and_stays_exact(models):
    n = 4
    want = separate(models, PROMPTS, n, temperature=0.0)
    probe = make_engine(models, "sequential", n=n, batch_size=8)
    page_bytes = probe.cache_stats().page_bytes
    engine = make_engine(
        models, "intra", n=n, batch_size=8, temperature=0.0, chunk_size=2, kv_cache_bytes=60 * page_bytes
    )
    engine.add_prompts(PROMPTS)
    got, metrics = drain(engine)
    assert (
        engine._loop.actor_sched.num_preemptions
        + sum(s.num_preemptions for s in engine._loop.scorer_lane.scheds.values())
        > 0
    )  # the arena was tight enough to preempt
    for r in got:
        assert_same(r, want[r.group_id, r.sample_index])
    assert_no_reference_left(engine)


@pytest.mark.parametrize("lane", ["actor", "reward", "critic"])
def test_a_one_shot_failure_leaks_no_shared_page_and_the_retry_is_exact(models, lane):
    n = 3
    prompts = PROMPTS[:4]
    want = separate(models, prompts, n)

    def lane_call(engine):
        if lane == "actor":
            return engine._loop.actor, "forward"
        return engine._loop.scorer_lane.scheds[lane].scorer, "prefill"

    rng = random.Random(lane)
    for _ in range(2):
        engine = make_engine(models, "oppo", n=n, batch_size=6, overcommit=3, chunk_size=2,
                             max_num_batched_tokens=8)  # fmt: skip
        engine.add_prompts(prompts)
        _fail_on_call(*lane_call(engine), k=rng.randrange(1, 10))
        got, metrics = drain(engine)  # the failure is absorbed by its step's own retry
        assert sum(m.retries for m in metrics) == 1
        assert_whole_groups(got, n)
        assert sorted((r.group_id, r.sample_index) for r in got) == sorted(want)
        for r in got:
            assert_same(r, want[r.group_id, r.sample_index])
        assert_no_reference_left(engine)


def test_release_and_resume_keep_the_shared_pages_shared(models):
    prompt = list(range(4, 4 + 25))
    short = SamplingParams(temperature=1.0, max_new_tokens=2, ignore_eos=True, n=2)
    long = SamplingParams(temperature=1.0, max_new_tokens=30, ignore_eos=True, n=2)
    engine = make_engine(models, "oppo", n=2, batch_size=2, overcommit=2, chunk_size=4, retained_kv="reuse")
    engine.add_prompts([prompt[:5], prompt], [short, long])
    engine.step()
    before = engine.cache_stats()
    assert all(v > 0 for v in before.shared_pages.values())
    engine.release_memory()
    assert engine.cache_stats().retained_pages == before.retained_pages  # a shared page once, on host too
    engine.resume()
    after = engine.cache_stats()
    assert after.shared_pages == before.shared_pages
    assert after.pages_per_model == before.pages_per_model
    rest, _ = drain(engine)
    assert_whole_groups(rest, 2)
    assert_no_reference_left(engine)


def test_a_checkpoint_of_carried_groups_continues_exactly(models):
    prompts = PROMPTS[:4]
    kwargs = dict(n=2, batch_size=2, overcommit=2, chunk_size=4)
    clean = make_engine(models, "oppo", **kwargs)
    clean.add_prompts(prompts)
    clean.step()
    state = clean.state_dict()
    want, _ = drain(clean)
    restored = make_engine(models, "oppo", **kwargs)
    restored.load_state_dict(state)
    got, _ = drain(restored)
    key = lambda r: (r.group_id, r.sample_index)  # noqa: E731
    for g, w in zip(sorted(got, key=key), sorted(want, key=key), strict=True):
        assert (g.group_id, g.sample_index, g.response_ids) == (w.group_id, w.sample_index, w.response_ids)
    assert_no_reference_left(restored)
    with pytest.raises(ValueError, match="groups cannot change size"):
        make_engine(models, "oppo", n=4, batch_size=4, overcommit=4).load_state_dict(state)


@pytest.mark.cuda
def test_groups_on_cuda_streams_equal_their_samples_run_separately():
    """Copy on write and forks on the lanes' CUDA streams (the actor's high-priority, the scorers' low)."""
    makers = dict(actor=make_actor, reward=make_reward, reference=make_reference, critic=make_critic)
    cuda = {name: make().to("cuda") for name, make in makers.items()}
    n = 4
    want = separate(cuda, PROMPTS, n)
    engine = make_engine(cuda, "oppo", n=n, batch_size=8, overcommit=4, chunk_size=3)
    engine.add_prompts(PROMPTS)
    got, metrics = drain(engine)
    assert_whole_groups(got, n)
    for r in got:
        assert_same(r, want[r.group_id, r.sample_index])
    shared = {name: sum(m.shared_tokens[name] for m in metrics) for name in MODELS}
    assert shared == dict.fromkeys(MODELS, (n - 1) * sum(len(p) - 1 for p in PROMPTS))
    engine._arena.synchronize()  # deferred frees behind the lanes' events
    assert_no_reference_left(engine)


# -- the cache: fork, copy on write, reference counts --------------------------------------------------


def _manager(num_pages=16, page_size=8):
    spec = KVSpec(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32)
    arena = KVArena({"m": spec}, page_size=page_size, num_pages=num_pages)
    arena.buffer.fill_(0)
    return arena, KVCacheManager(arena, "m")


def _write(cache: KVCacheManager, seq, slots, value: float) -> None:
    view = cache.kv_cache  # [P, L, 2, ps, H, D]
    ps = cache.page_size
    for slot in slots:
        view[slot // ps, :, :, slot % ps] = value


def test_fork_shares_full_pages_and_copies_the_partial_one_on_write():
    arena, cache = _manager()
    _write(cache, "a", cache.append_slots("a", 13), 1.0)  # pages: 1 full, 1 with 5 tokens
    a_pages = cache.pages("a")
    cache.fork("a", "b", 13)
    assert cache.pages("b") == a_pages and [arena.refcount(p) for p in a_pages] == [2, 2]
    assert arena.pages_held("m") == 2 and cache.num_pages_used == 2 and cache.num_shared_pages == 2
    assert arena.num_free_pages() + arena.pages_held("m") == arena.num_pages  # a shared page counted once
    assert cache.pages_needed("b", 1) == 1  # the copy of the partial page
    (slot,) = cache.append_slots("b", 1)
    b_pages = cache.pages("b")
    assert b_pages[0] == a_pages[0] and b_pages[1] != a_pages[1]  # copied on write
    assert slot // 8 == b_pages[1]
    view = cache.kv_cache
    assert torch.equal(view[b_pages[1], :, :, :5], view[a_pages[1], :, :, :5])  # the shared tokens came along
    _write(cache, "b", [slot], 2.0)
    assert torch.all(view[a_pages[1], :, :, 5] == 0)  # a's page is untouched by b's write
    assert [arena.refcount(p) for p in a_pages] == [2, 1]
    assert cache.pages_needed("a", 1) == 0  # a is its page's last holder: it writes in place
    cache.append_slots("a", 1)
    assert cache.pages("a") == a_pages
    cache.free("a")
    assert arena.refcount(a_pages[0]) == 1 and arena.pages_held("m") == 2  # b still holds the first page
    cache.free("b")
    assert arena.num_free_pages() == arena.num_pages and arena.pages_held("m") == 0


def test_fork_at_a_page_boundary_copies_nothing():
    arena, cache = _manager()
    cache.append_slots("a", 16)
    cache.fork("a", "b", 16)
    assert cache.pages_needed("b", 1) == 1  # a new page, not a copy
    cache.append_slots("b", 1)
    assert cache.pages("b")[:2] == cache.pages("a") and arena.pages_held("m") == 3


def test_fork_refuses_what_it_cannot_share():
    _, cache = _manager()
    cache.append_slots("a", 5)
    with pytest.raises(ValueError, match="cannot share 6"):
        cache.fork("a", "b", 6)
    cache.append_slots("c", 1)
    with pytest.raises(ValueError, match="already holds"):
        cache.fork("a", "c", 3)


def test_truncating_into_a_shared_page_copies_before_the_next_write():
    arena, cache = _manager()
    _write(cache, "a", cache.append_slots("a", 16), 1.0)
    cache.fork("a", "b", 16)
    cache.truncate("b", 10)  # back into b's second page, still shared with a
    assert cache.pages("b") == cache.pages("a")
    (slot,) = cache.append_slots("b", 1)
    _write(cache, "b", [slot], 3.0)
    assert cache.pages("b")[1] != cache.pages("a")[1]
    assert torch.all(cache.kv_cache[cache.pages("a")[1]] == 1.0)


def test_swap_out_and_in_keep_sharing_and_bytes():
    arena, cache = _manager(num_pages=8)
    _write(cache, "a", cache.append_slots("a", 20), 1.5)
    cache.fork("a", "b", 19)
    _write(cache, "b", cache.append_slots("b", 3), 2.5)  # b copies page 2 and writes its own tokens
    want = {s: (cache.num_tokens(s), cache.kv_cache[cache.pages(s)].clone()) for s in ("a", "b")}
    host = swap_out(arena, {"m": cache})
    assert host.num_pages() == arena.pages_held("m") == 4  # 2 shared, a's third, b's third
    arena.release()
    arena.rebuild()
    swap_in(host, arena, {"m": cache})
    assert cache.num_shared_pages == 2 and arena.pages_held("m") == 4
    for s, (n, data) in want.items():
        assert cache.num_tokens(s) == n and torch.equal(cache.kv_cache[cache.pages(s)], data)
    cache.free("a")
    cache.free("b")
    assert arena.num_free_pages() == arena.num_pages


# -- bad input ------------------------------------------------------------------------------------------


def test_bad_group_configurations_raise_value_error(models):
    with pytest.raises(ValueError, match="SamplingParams.n"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="batch_size=6 is not a multiple of SamplingParams.n=4"):
        make_engine(models, "sequential", n=4, batch_size=6)
    with pytest.raises(ValueError, match="overcommit=2 is not a multiple of SamplingParams.n=4"):
        make_engine(models, "oppo", n=4, batch_size=8, overcommit=2)
    engine = make_engine(models, "sequential", n=2, batch_size=2)
    with pytest.raises(ValueError, match="same n"):
        engine.add_prompts([[5, 6]], [SamplingParams(n=3)])
    engine.add_prompts([[5, 6, 7]])  # the engine stays usable
    assert len(engine.step().rollouts) == 2


def test_a_sample_is_admitted_only_when_all_its_pending_tokens_fit():
    """Regression (found by the groups soak): a sample's first chunk stops at its group's prefix; admitted for
    that chunk alone, it was preempted at the next one and prefilled the prefix again, forever, while a
    waiting sequence kept the pages it needed. Now it waits for room for all its pending tokens, so the
    scheduler gives up that retained KV and the sample gets through."""
    from oppo_engine.sched.scheduler import ActorScheduler
    from oppo_engine.sched.sequence import Sequence

    arena, cache = _manager(num_pages=6)
    sched = ActorScheduler(cache, max_num_seqs=1, max_num_batched_tokens=4096, max_model_len=64)
    params = SamplingParams(max_new_tokens=40, n=2)
    # A sample whose KV was dropped (a policy update): 8 prompt and 25 response tokens to prefill, 5 pages.
    sample = Sequence(0, 0, list(range(4, 12)), params, seed=1, response_ids=[5] * 25, sample_index=1)
    # A carried sequence of another group holding 3 pages of retained KV, waiting behind it.
    carried = Sequence(2, 1, list(range(4, 12)), params, seed=2, response_ids=[5] * 17)
    cache.append_slots(carried.seq_id, 24)
    carried.num_computed = 24
    sched.add(sample)
    sched.add(carried)
    for _ in range(6):
        for chunk in sched.schedule():
            if chunk.samples:
                sched.append_token(chunk.seq, 6, 0.0, 0)
        if sample.num_computed > sample.prefix_len + 1:
            break
    assert sample.num_computed >= len(sample.prompt_ids) + 25  # past its prompt and old response
    assert carried.seq_id not in cache  # its retained KV was given up (it is prefilled again later)
