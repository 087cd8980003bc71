"""Carried-over sequences across what happens between steps: a failed step (rollback), a policy update
(retained actor KV recomputed or reused; the critic always recomputed; reward and reference KV kept), a
memory release (every retained page to host and back, byte for byte), a checkpoint, and the Δ controller.
"""

from __future__ import annotations

import copy
import pickle
import random
import time
import weakref
from collections import Counter

import pytest
import torch
from engine_models import EOS, make_actor, make_reward, random_prompts
from test_inter import by_prompt, drain, lengths_sampling
from test_intra import assert_all_pages_free, assert_same_rollouts
from test_ppo_scorers import hf_ref_logprobs, hf_values, make_critic, make_reference

from oppo_engine import EngineConfig, RolloutEngine, SamplingParams
from oppo_engine.control import DeltaControl
from oppo_engine.sched.sequence import SeqStatus

ATOL = 1e-4
SCORERS = ("reward", "reference", "critic")


@pytest.fixture(scope="module")
def models():
    return dict(actor=make_actor(), reward=make_reward(), reference=make_reference(), critic=make_critic())


def make_engine(models, mode="oppo", *, batch_size=3, overcommit=3, temperature=1.0, max_new=14, **cfg):
    cfg.setdefault("max_model_len", 64)
    cfg.setdefault("page_size", 8)
    if mode in ("intra", "oppo"):
        cfg.setdefault("chunk_size", 3)
    return RolloutEngine(
        **models,
        config=EngineConfig(batch_size=batch_size, mode=mode, overcommit=overcommit, **cfg),
        sampling=SamplingParams(temperature=temperature, max_new_tokens=max_new, seed=5),
        eos_token_id=EOS,
    )


def assert_arena_invariant(engine: RolloutEngine) -> None:
    arena = engine._arena
    held = sum(c.num_pages_used for c in engine._caches.values())
    assert held == sum(arena.pages_held(name) for name in engine._caches)
    assert arena.num_free_pages() + held + arena.num_pending_pages == arena.num_pages
    if not arena.num_pending_pages:  # every reference is a sequence's: shared pages once per holder
        refs = Counter(p for c in engine._caches.values() for s in c.seq_ids for p in c.pages(s))
        assert refs == {p: arena.refcount(p) for p in range(arena.num_pages) if arena.refcount(p)}


def kv_bytes(engine: RolloutEngine, seq_ids) -> dict:
    """(model, seq) -> (page ids, cached tokens, the pages' bytes) of every carried sequence."""
    view = engine._arena.page_view()
    out = {}
    for name, cache in engine._caches.items():
        for s in seq_ids:
            if s in cache:
                pages = cache.pages(s)
                out[name, s] = (pages, cache.num_tokens(s), view[pages].clone())
    return out


# -- rollback --------------------------------------------------------------------------------------------


class Boom(RuntimeError):
    pass


def fail_randomly(obj, name: str, rng: random.Random, p: float, budget: int) -> None:
    """Make ``obj.name`` raise Boom with probability ``p`` per call, ``budget`` times at most."""
    original = getattr(obj, name)
    left = [budget]

    def wrapped(*args, **kwargs):
        if left[0] and rng.random() < p:
            left[0] -= 1
            raise Boom(f"injected into {name}")
        return original(*args, **kwargs)

    setattr(obj, name, wrapped)


@pytest.mark.parametrize("mode", ["inter", "oppo"])
@pytest.mark.parametrize("lane", ["actor", "reward", "reference", "critic"])
def test_failed_steps_roll_carried_sequences_back_and_every_retry_is_exact(models, mode, lane):
    prompts = random_prompts(12, seed=60, max_len=13)
    want = by_prompt(drain(_with(make_engine(models, mode), prompts)), prompts)
    engine = _with(make_engine(models, mode), prompts)
    loop = engine._loop
    target = loop.actor if lane == "actor" else loop.scorer_lane.scheds[lane].scorer
    # At most 3 failures: a step's retry absorbs one; two in a row start an isolation that a third cannot
    # confirm (a culprit must fail alone twice), so it propagates; nothing is ever quarantined.
    fail_randomly(target, "forward" if lane == "actor" else "prefill", random.Random(lane + mode), 0.35, 3)
    steps, failures = [], 0
    while True:
        carried = list(engine._buffer.carried)
        before = {
            s.seq_id: (list(s.response_ids), list(s.logprobs), list(s.policy_versions)) for s in carried
        }
        actor_before = {s.seq_id: engine._caches["actor"].pages(s.seq_id) for s in carried}
        try:
            result = engine.step()
        except Boom:
            failures += 1
            # Every sequence is where the step found it (tokens, log-probs, versions, actor pages), first
            # in line.
            assert [s.seq_id for s in engine._buffer.carried] == [s.seq_id for s in carried]
            for s in carried:
                assert (s.response_ids, s.logprobs, s.policy_versions) == tuple(map(list, before[s.seq_id]))
                assert engine._caches["actor"].pages(s.seq_id) == actor_before[s.seq_id]
            assert_arena_invariant(engine)
            continue
        assert_arena_invariant(engine)
        assert result.failed == []
        failures += result.metrics.retries  # absorbed within the step
        if not result.rollouts:
            break
        steps.append(result.rollouts)
    assert failures >= 1  # the scenario really failed
    assert_same_rollouts(by_prompt(steps, prompts), want)
    assert_all_pages_free(engine)


def _with(engine: RolloutEngine, prompts, sampling=None) -> RolloutEngine:
    engine.add_prompts(prompts, sampling=sampling)
    return engine


# -- a policy update -------------------------------------------------------------------------------------


def _perturb(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def _fresh_models():
    return dict(actor=make_actor(), reward=make_reward(), reference=make_reference(), critic=make_critic())


def _one_long_carried(retained_kv: str):
    """An oppo engine (greedy) that returned a short rollout and carries a long one, and its models.

    The step ends once the short one is scored; the actor waits for that score before its next forward (on
    a loaded machine the scorer lane could otherwise lag until the long one had finished too)."""
    models = _fresh_models()
    engine = make_engine(models, "oppo", batch_size=1, overcommit=1, temperature=0.0, retained_kv=retained_kv)
    prompts = random_prompts(2, seed=61)
    _with(engine, prompts, lengths_sampling([2, 24], temperature=0.0))
    lane, actor = engine._loop.scorer_lane, engine._loop.actor
    finished = []
    real_hand_off, real_forward = lane.hand_off, actor.forward

    def hand_off(seq, upto, final):
        if final:
            finished.append(seq)
        real_hand_off(seq, upto, final)

    def forward(chunks, batch):
        deadline = time.monotonic() + 60
        while any(s.status is not SeqStatus.SCORED for s in finished) and time.monotonic() < deadline:
            lane.check()
            time.sleep(0.001)
        return real_forward(chunks, batch)

    lane.hand_off, actor.forward = hand_off, forward
    try:
        assert [len(r.response_ids) for r in engine.step().rollouts] == [2]
    finally:
        del lane.hand_off, actor.forward
    (seq,) = engine._buffer.carried
    assert 0 < len(seq.response_ids) < 24 and seq.status is SeqStatus.RUNNING
    return engine, models, seq


@pytest.mark.parametrize("retained_kv", ["recompute", "reuse"])
def test_after_a_policy_update_frozen_scorer_pages_are_untouched_and_the_critic_recomputed(retained_kv):
    engine, models, seq = _one_long_carried(retained_kv)
    before = kv_bytes(engine, [seq.seq_id])
    assert {name for name, _ in before} == {"actor", *SCORERS}  # streamed: every model holds its KV
    _perturb(models["actor"], 1)
    _perturb(models["critic"], 2)
    engine.update_policy()
    after = kv_bytes(engine, [seq.seq_id])
    for name in ("reward", "reference"):  # frozen: the same pages, the same bytes
        pages, n, data = before[name, seq.seq_id]
        assert after[name, seq.seq_id][:2] == (pages, n) and torch.equal(after[name, seq.seq_id][2], data)
    assert ("critic", seq.seq_id) not in after  # trained: its KV is dropped, prefilled again
    if retained_kv == "reuse":
        pages, n, data = before["actor", seq.seq_id]
        assert after["actor", seq.seq_id][:2] == (pages, n) and torch.equal(
            after["actor", seq.seq_id][2], data
        )
    else:
        assert ("actor", seq.seq_id) not in after and seq.num_computed == 0
    result = engine.step()
    (r,) = result.rollouts
    k = r.policy_versions.count(0)
    assert r.policy_versions == [0] * k + [1] * (24 - k) and 0 < k < 24
    # The critic's values are the new critic's, over the whole sequence (prefix included).
    want = hf_values(models["critic"], r.prompt_ids, r.response_ids)
    torch.testing.assert_close(torch.tensor(r.values), want, atol=ATOL, rtol=0)
    want_ref = hf_ref_logprobs(models["reference"], r.prompt_ids, r.response_ids, 0.0)
    torch.testing.assert_close(torch.tensor(r.ref_logprobs), want_ref, atol=ATOL, rtol=0)
    with torch.inference_mode():
        hf_reward = models["reward"](torch.tensor([r.prompt_ids + r.response_ids])).logits[0, 0].item()
    assert r.reward == pytest.approx(hf_reward, abs=ATOL)
    m = result.metrics
    assert m.reused_tokens["reward"] > 0 and m.reused_tokens["critic"] == 0
    assert m.recomputed_tokens["critic"] >= len(r.prompt_ids)  # what it had prefilled before the update
    if retained_kv == "reuse":
        assert m.recomputed_tokens["actor"] == 0 and m.reused_tokens["actor"] > 0
    else:  # the whole kept prefix, once
        assert m.recomputed_tokens["actor"] == len(r.prompt_ids) + k - 1 and m.reused_tokens["actor"] == 0
    assert_all_pages_free(engine)


def test_recompute_continues_exactly_as_a_fresh_engine_with_the_new_weights():
    engine, models, seq = _one_long_carried("recompute")
    _perturb(models["actor"], 3)
    engine.update_policy()
    (r,) = engine.step().rollouts
    k = r.policy_versions.count(0)
    fresh = make_engine(dict(actor=models["actor"], reward=models["reward"]), "sequential", overcommit="auto",
                        batch_size=1, temperature=0.0)  # fmt: skip
    _with(fresh, [r.prompt_ids + r.response_ids[:k]], lengths_sampling([24 - k], temperature=0.0))
    (want,) = fresh.step().rollouts
    assert r.response_ids[k:] == want.response_ids
    torch.testing.assert_close(torch.tensor(r.logprobs[k:]), torch.tensor(want.logprobs), atol=1e-5, rtol=0)


@torch.inference_mode()
def test_reuse_continues_from_the_kept_pages():
    engine, models, seq = _one_long_carried("reuse")
    old_actor = copy.deepcopy(models["actor"])
    computed = seq.num_computed  # tokens whose (old-policy) KV the engine keeps
    ids = seq.prompt_ids + seq.response_ids
    _perturb(models["actor"], 4)
    engine.update_policy()
    (r,) = engine.step().rollouts
    new = models["actor"]
    # The two policies really differ on this prefix: reading the old KV is not the same as recomputing it.
    reused = new(torch.tensor([ids[computed:]]), past_key_values=_cache(old_actor, ids[:computed])).logits
    recomputed = new(torch.tensor([ids])).logits
    assert not torch.allclose(reused[0, -1], recomputed[0, -1], atol=1e-4)
    # HF: the old actor's KV of the kept tokens, then the new actor from there on, greedy.
    cache = _cache(old_actor, ids[:computed])
    feed, out = ids[computed:], []
    while len(r.prompt_ids) + len(r.response_ids) > len(ids) + len(out):
        logits = new(torch.tensor([feed]), past_key_values=cache, use_cache=True).logits[0, -1]
        out.append(int(logits.argmax()))
        feed = out[-1:]
    assert r.response_ids[len(ids) - len(r.prompt_ids) :] == out


def _cache(model, ids):
    return model(torch.tensor([ids]), use_cache=True).past_key_values


# -- memory release --------------------------------------------------------------------------------------


def test_release_and_resume_bring_every_retained_page_back_byte_for_byte_and_change_no_token():
    prompts = random_prompts(10, seed=62, max_len=13)
    sampling = lengths_sampling([random.Random(i).choice([2, 4, 20]) for i in range(10)])
    twin = _with(make_engine(_models_once()), prompts, sampling)
    engine = _with(make_engine(_models_once()), prompts, sampling)
    got, want, swapped = [], [], {}
    while True:
        result = engine.step()
        assert result.metrics.swapped_tokens == swapped  # what came back from host before this step
        want_step = twin.step().rollouts
        got.append(result.rollouts)
        want.append(want_step)
        if not result.rollouts:
            break
        carried = [s.seq_id for s in engine._buffer.carried]
        before = kv_bytes(engine, carried)
        retained = engine.cache_stats().retained_pages
        assert retained == sum(len(pages) for pages, _, _ in before.values())
        engine.release_memory()
        assert engine._arena.released and engine.cache_stats().retained_pages == retained
        with pytest.raises(RuntimeError, match="resume"):
            engine.step()
        engine.resume()
        after = kv_bytes(engine, carried)
        assert before.keys() == after.keys()
        for key, (_, n, data) in before.items():
            assert after[key][1] == n and torch.equal(after[key][2], data)
        assert engine.cache_stats().retained_pages == retained
        assert_arena_invariant(engine)
        swapped = _tokens_per_model(before)
    assert_same_rollouts(by_prompt(got, prompts), by_prompt(want, prompts))
    assert_all_pages_free(engine)


@pytest.mark.parametrize("fails", ["alloc", "copy"])
def test_a_release_whose_copy_to_host_fails_loses_nothing_and_the_run_goes_on_exactly(monkeypatch, fails):
    # The host buffer's allocation (pinned on CUDA: it can fail for a large retained set) or the copy raises:
    # every manager keeps its sequences and pages, the arena stays, and the next release succeeds.
    import oppo_engine.cache.swap as swap

    prompts = random_prompts(10, seed=63, max_len=13)
    sampling = lengths_sampling([random.Random(i).choice([2, 4, 20]) for i in range(10)])
    twin = _with(make_engine(_models_once()), prompts, sampling)
    engine = _with(make_engine(_models_once()), prompts, sampling)
    real_empty, real_copy = torch.empty, swap.ops.copy_pages
    failed = 0
    got, want = [], []
    while True:
        result = engine.step()
        got.append(result.rollouts)
        want.append(twin.step().rollouts)
        if not result.rollouts:
            break
        carried = [s.seq_id for s in engine._buffer.carried]
        before = kv_bytes(engine, carried)
        if not before:  # no carried sequence holds a page (yet): nothing would be copied
            continue

        def boom(*args, **kwargs):
            raise Boom(f"injected into the swap-out's {fails}")

        if fails == "alloc":
            engine._swap_buffer = None  # no buffer of a former release to reuse: a fresh allocation
            monkeypatch.setattr(swap.torch, "empty", boom)
        else:
            monkeypatch.setattr(swap.ops, "copy_pages", boom)
        with pytest.raises(Boom):
            engine.release_memory()
        monkeypatch.setattr(swap.torch, "empty", real_empty)
        monkeypatch.setattr(swap.ops, "copy_pages", real_copy)
        failed += 1
        assert not engine._arena.released
        after = kv_bytes(engine, carried)
        assert before.keys() == after.keys()
        for key, (pages, n, data) in before.items():
            assert after[key][:2] == (pages, n) and torch.equal(after[key][2], data)
        assert_arena_invariant(engine)
        if failed % 2:  # every other time, release again (it succeeds) before the next step
            engine.release_memory()
            engine.resume()
            assert_arena_invariant(engine)
    assert failed >= 1
    assert_same_rollouts(by_prompt(got, prompts), by_prompt(want, prompts))
    assert_all_pages_free(engine)


def test_each_release_reuses_the_last_host_buffer_where_it_holds_the_pages():
    """One host buffer across a run's releases (pinned on CUDA, where torch would keep every freed block of
    every size pinned): written again where it holds the pages, replaced by a larger one where not."""
    prompts = random_prompts(10, seed=64, max_len=13)
    sampling = lengths_sampling([random.Random(i).choice([2, 4, 20]) for i in range(10)])
    engine = _with(make_engine(_models_once()), prompts, sampling)
    previous, reused = None, 0
    while engine.step().rollouts:
        engine.release_memory()
        host = engine._host
        whole = host.whole
        assert host.buffer.data_ptr() == whole.data_ptr() and host.buffer.shape[0] <= whole.shape[0]
        # The test keeps the former buffer alive: a fresh allocation cannot land at its address.
        if previous is not None and previous.shape[0] >= host.buffer.shape[0]:
            assert whole.data_ptr() == previous.data_ptr() and whole.shape == previous.shape
            reused += 1
        engine.resume()
        previous = whole
        del host
    assert reused >= 1
    assert_all_pages_free(engine)


def test_a_host_buffer_too_small_for_a_release_is_freed_before_the_larger_one_is_allocated(monkeypatch):
    """The engine hands its last host buffer to the swap-out without keeping a reference: where the buffer is
    too small, its memory goes back before the larger one is taken (on CUDA that is what lets the caching
    host allocator unpin it, rather than keep a pinned block of every size a run retained)."""
    import oppo_engine.cache.swap as swap

    prompts = random_prompts(10, seed=65, max_len=13)
    sampling = lengths_sampling([random.Random(i).choice([2, 4, 20]) for i in range(10)])
    engine = _with(make_engine(_models_once()), prompts, sampling)
    engine.step()
    small = torch.empty((1, engine._arena.page_bytes), dtype=torch.uint8)
    alive = weakref.ref(small)
    engine._swap_buffer = [small]
    del small
    seen = []
    real_empty = swap.torch.empty

    def empty(*args, **kwargs):
        seen.append(alive() is None)
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(swap.torch, "empty", empty)
    engine.release_memory()
    monkeypatch.setattr(swap.torch, "empty", real_empty)
    assert engine._host.num_pages() > 1  # the one-page buffer could not hold them
    assert seen == [True]  # one allocation, made after the small buffer was gone
    engine.resume()
    assert len(engine._swap_buffer) == 1 and engine._swap_buffer[0].shape[0] > 1  # kept for the next release
    drain(engine)
    assert_all_pages_free(engine)


def _tokens_per_model(kv: dict) -> dict:
    out: dict[str, int] = {}
    for (name, _), (_, n, _) in kv.items():
        out[name] = out.get(name, 0) + n
    return out


_MODELS = None


def _models_once():
    global _MODELS
    if _MODELS is None:
        _MODELS = _fresh_models()
    return _MODELS


def test_a_policy_update_while_released_applies_on_resume():
    engine, models, seq = _one_long_carried("recompute")
    reward_before = kv_bytes(engine, [seq.seq_id])["reward", seq.seq_id]
    engine.release_memory()
    engine.update_policy()  # allowed while released: the actor's and critic's host copies are dropped
    engine.resume()
    after = kv_bytes(engine, [seq.seq_id])
    assert ("actor", seq.seq_id) not in after and ("critic", seq.seq_id) not in after
    assert after["reward", seq.seq_id][1] == reward_before[1]
    assert torch.equal(after["reward", seq.seq_id][2], reward_before[2])
    (r,) = engine.step().rollouts
    assert r.policy_versions[-1] == 1
    assert_all_pages_free(engine)


# -- checkpoints -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["inter", "oppo"])
def test_a_restored_engine_continues_exactly(models, mode):
    prompts = random_prompts(12, seed=63, max_len=13)
    engine = _with(make_engine(models, mode), prompts[:9])
    first = [engine.step().rollouts]
    engine.update_policy()
    first.append(engine.step().rollouts)
    assert engine._buffer.carried  # something in flight to save
    state = pickle.loads(pickle.dumps(engine.state_dict()))
    restored = make_engine(models, mode)
    restored.load_state_dict(state)
    for e in (engine, restored):
        e.add_prompts(prompts[9:])
    want = drain(engine)
    got = drain(restored)
    if mode == "inter":  # the cut is deterministic: step for step the same
        assert [[r.prompt_ids for r in s] for s in got] == [[r.prompt_ids for r in s] for s in want]
    done = {tuple(r.prompt_ids) for s in first for r in s}
    rest = [p for p in prompts if tuple(p) not in done]
    assert_same_rollouts(by_prompt(got, rest), by_prompt(want, rest))
    assert [r.deferred_steps for r in by_prompt(got, rest)] == [
        r.deferred_steps for r in by_prompt(want, rest)
    ]
    assert_all_pages_free(restored)


# -- Δ control -------------------------------------------------------------------------------------------


def test_auto_overcommit_follows_the_reward_trend_and_the_trainers_signal():
    step = [0]

    def rising(prompt, response):  # the reward of the step a rollout is scored in: the mean rises
        return float(step[0])

    models = dict(actor=_models_once()["actor"], reward=rising)
    control = DeltaControl(init=1, min=0, max=3, inc=1, dec=1, window=3, significance=0.0)
    engine = RolloutEngine(
        **models,
        # Δ up to 3 > B: only without the policy-lag bound (the controller is what is tested here).
        config=EngineConfig(
            batch_size=2, mode="inter", delta=control, max_model_len=64, page_size=8, max_policy_lag=None
        ),
        sampling=SamplingParams(temperature=1.0, max_new_tokens=6, seed=1),
        eos_token_id=EOS,
    )
    engine.add_prompts(random_prompts(40, seed=64))
    deltas = []
    for t in range(6):
        step[0] = t
        deltas.append(engine.step().metrics.overcommit)
    assert deltas == [1, 1, 1, 2, 3, 3]  # the window fills, then Δ grows by inc up to max
    assert [rec.delta for rec in engine.delta_history] == deltas[1:] + [3]
    for x in (5.0, 4.0, 3.0, 2.0):  # the trainer's signal falls: Δ shrinks, batch rewards are ignored
        engine.report_reward(x)
    assert engine.step().metrics.overcommit == 0  # 3 -> 2 -> 1 -> 0, and held at min
    assert [rec.reward for rec in engine.delta_history[-4:]] == [5.0, 4.0, 3.0, 2.0]


def test_in_inter_a_policy_update_leaves_unscored_carried_sequences_to_be_scored_whole():
    models = _fresh_models()
    engine = make_engine(models, "inter", batch_size=1, overcommit=1, temperature=0.0)
    _with(engine, random_prompts(2, seed=65), lengths_sampling([2, 24], temperature=0.0))
    engine.step()
    (seq,) = engine._buffer.carried
    assert seq.status is SeqStatus.RUNNING and len(seq.response_ids) < 24
    _perturb(models["critic"], 5)
    engine.update_policy()
    assert seq.status is SeqStatus.RUNNING  # not taken for finished by the critic's rescoring
    (r,) = engine.step().rollouts
    assert len(r.response_ids) == 24
    torch.testing.assert_close(
        torch.tensor(r.values), hf_values(models["critic"], r.prompt_ids, r.response_ids), atol=ATOL, rtol=0
    )
    assert_all_pages_free(engine)
