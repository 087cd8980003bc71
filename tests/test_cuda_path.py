"""The CUDA path's host-side rules, proved on the CPU where they can be: deferred frees through a whole
engine, the reference log-prob formula, the cache ops' Triton/torch fallbacks, the build-time warm-up;
and, marked ``cuda``, the stream-order properties only a GPU can show."""

from __future__ import annotations

import pytest
import torch
from engine_models import EOS, actor_config, make_actor, make_reward, random_prompts
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

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


def long_context_models() -> tuple[torch.nn.Module, torch.nn.Module]:
    """Actor and reward with 1,024 positions: contexts past one split-KV partition (512 keys)."""
    torch.manual_seed(0)
    actor = AutoModelForCausalLM.from_config(actor_config(max_position_embeddings=1024), dtype=torch.float32)
    cfg = actor_config(max_position_embeddings=1024, hidden_size=32, num_hidden_layers=1, num_labels=1)
    return actor.eval(), AutoModelForSequenceClassification.from_config(cfg, dtype=torch.float32).eval()


def make_engine(actor, reward, mode: str = "sequential", **cfg) -> RolloutEngine:
    return RolloutEngine(
        actor=actor,
        reward=reward,
        config=EngineConfig(batch_size=4, mode=mode, **{"max_model_len": 64, "page_size": 8, **cfg}),
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("pattern", ["one_token", "crossing_pages", "padded"])
def test_triton_reshape_and_cache_writes_the_same_bytes_as_the_cpp_op(dtype, pattern):
    from test_cache_ops import NUM_PAGES, SMALL, make_slots, non_contiguous_kv, poisoned_arena, small_model

    from oppo_engine.kernels import cache_ops

    gen = torch.Generator().manual_seed(len(pattern) + dtype.itemsize)
    arena = poisoned_arena(gen)
    expected = arena.clone()
    slots = make_slots(pattern, small_model(arena, dtype).shape[3], NUM_PAGES, gen)
    key, value = non_contiguous_kv(gen, len(slots), SMALL["heads"], SMALL["head_dim"], dtype)
    cache_ops.reshape_and_cache(key, value, small_model(arena, dtype), slots, 2)
    torch.ops.oppo.reshape_and_cache(key, value, small_model(expected, dtype), slots, 2)
    assert torch.equal(arena, expected)  # the whole arena: nothing written outside the slots either


@pytest.mark.parametrize(
    ("src_ids", "dst_ids", "same_buffer"),
    [
        ([0, 1, 2, 5], [3, 4, 5, 0], False),  # a run of three, then one
        ([2, 3], [3, 4], True),  # overlapping run in one buffer: page by page, in order, as the C++ op
        ([7], [7], True),
        ([], [], False),
    ],
)
def test_torch_copy_pages_copies_the_same_bytes_as_the_cpp_op(src_ids, dst_ids, same_buffer):
    from oppo_engine.kernels import cache_ops

    gen = torch.Generator().manual_seed(len(src_ids))
    src = torch.randint(0, 256, (8, 300), dtype=torch.uint8, generator=gen)
    dst = src if same_buffer else torch.randint(0, 256, (8, 300), dtype=torch.uint8, generator=gen)
    src_b, dst_b = src.clone(), dst.clone()
    if same_buffer:
        src_b = dst_b
    ids = torch.tensor(src_ids, dtype=torch.int64), torch.tensor(dst_ids, dtype=torch.int64)
    cache_ops.copy_pages(src, dst, *ids)
    torch.ops.oppo.copy_pages(src_b, dst_b, *ids)
    assert torch.equal(dst, dst_b)


def test_fallback_copy_pages_refuses_bad_ids_like_the_cpp_op():
    from oppo_engine.kernels import cache_ops

    src, dst = torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(2, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"dst_ids\[0\] = 2 outside \[0, 2\)"):
        cache_ops.copy_pages(src, dst, torch.tensor([1]), torch.tensor([2]))
    assert not dst.any()


@pytest.mark.parametrize(("max_model_len", "forwards"), [(64, 3), (640, 6)])
def test_warm_up_runs_every_launch_shape_and_leaves_the_cache_as_it_was(max_model_len, forwards):
    from oppo_engine.model.warmup import warm_up_models

    actor, reward = long_context_models()
    prompts = random_prompts(4, seed=5)
    cold = make_engine(actor, reward, max_model_len=max_model_len)
    cold.add_prompts(prompts)
    expected = [r.response_ids for r in drain(cold)]
    engine = make_engine(actor, reward, max_model_len=max_model_len)
    # On CUDA the engine does this at build; here on the CPU ops, to prove it leaves nothing behind.
    ran = warm_up_models(engine._loop.actor, engine._loop.scorer_lane.scorers, max_model_len)
    assert ran == 2 * forwards  # the actor's and the reward model's
    stats = engine.cache_stats()
    assert stats.free_pages == stats.total_pages and not any(stats.pages_per_model.values()), stats
    engine.add_prompts(prompts)
    assert [r.response_ids for r in drain(engine)] == expected


# -- on a GPU -----------------------------------------------------------------------------------------


def _compiled_variants() -> int:
    """Triton kernels compiled so far for the engine's kernels (0 caches where this Triton hides them)."""
    from oppo_engine.kernels import paged_attention as attn
    from oppo_engine.kernels import sample

    total = 0
    for fn in (attn._paged_attention_kernel, attn._split_kv_reduce_kernel, sample._sample_kernel):
        caches = getattr(fn, "device_caches", None)
        if caches is None:
            pytest.skip("this Triton does not expose its compiled-kernel cache")
        total += sum(len(entry[0]) for entry in caches.values())
    return total


@pytest.mark.cuda
def test_on_cuda_a_step_reads_weights_written_on_the_callers_stream_just_before_it():
    # The trainer's optimizer.step() writes the weights on its (default) stream; the actor lane must not
    # read them before that stream gets there. The write is queued behind a ~1 s sleep on that stream.
    actor, reward = make_actor(seed=0).cuda(), make_reward().cuda()
    new = make_actor(seed=7).cuda()
    prompts = random_prompts(4, seed=8)
    want_engine = make_engine(new, reward, "intra", chunk_size=4)
    want_engine.add_prompts(prompts)
    want = {tuple(r.prompt_ids): r.response_ids for r in drain(want_engine)}
    engine = make_engine(actor, reward, "intra", chunk_size=4)
    engine.add_prompts(prompts)
    torch.cuda.synchronize()
    with torch.no_grad():
        torch.cuda._sleep(2_000_000_000)  # cycles: about a second on an H200
        for p, q in zip(actor.parameters(), new.parameters(), strict=True):
            p.copy_(q)
    got = {tuple(r.prompt_ids): r.response_ids for r in drain(engine)}
    assert got == want


@pytest.mark.cuda
def test_on_cuda_a_preempted_sequences_swap_is_exact_and_never_waits_on_the_host():
    from oppo_engine.cache import KVArena, KVCacheManager, KVSpec
    from oppo_engine.cache.swap import swap_in_seq, swap_out_seq

    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    arena = KVArena({"reward": spec}, page_size=16, num_pages=16, device="cuda")
    cache = KVCacheManager(arena, "reward")
    cache.append_slots("s", 40)
    arena.page_view().copy_(torch.randint(0, 256, arena.page_view().shape, dtype=torch.uint8, device="cuda"))
    before = arena.page_view()[cache.pages("s")].clone()
    host = swap_out_seq(cache, "s")
    torch.cuda._sleep(1_000_000_000)  # the copy back queues behind this on the current stream
    assert swap_in_seq(cache, "s", host) == 40
    # Returned before the copy ran: the pinned buffer is held until its event, not waited for.
    assert arena.num_held_buffers >= 1
    del host
    torch.cuda.synchronize()
    assert torch.equal(arena.page_view()[cache.pages("s")], before)
    arena.reclaim()
    assert arena.num_held_buffers == 0


@pytest.mark.cuda
def test_on_cuda_the_engine_compiles_its_kernels_at_build_and_never_in_a_step():
    actor, reward = (m.cuda() for m in long_context_models())
    engine = make_engine(actor, reward, "oppo", max_model_len=640, overcommit=2, chunk_size=4)
    compiled = _compiled_variants()
    # Prompts of lengths whose metadata lands at every alignment, a long one past a split.
    vocab = actor.config.vocab_size
    prompts = [[4 + i % (vocab - 4) for i in range(n)] for n in (3, 9, 17, 30, 530, 61, 5, 2)]
    engine.add_prompts(prompts)
    drain(engine)
    assert _compiled_variants() == compiled
    stats = engine.cache_stats()
    assert stats.free_pages == stats.total_pages


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_an_engine_on_a_device_other_than_the_current_one_equals_one_on_it():
    # Triton launches on the current device, not its tensors': the build-time warm-up (and the lanes) must
    # run under the engine's own device, or its kernels read another GPU's addresses.
    assert torch.cuda.current_device() == 0
    prompts = random_prompts(4, seed=8)
    got = {}
    for device in ("cuda:0", "cuda:1"):
        engine = make_engine(make_actor(seed=0).to(device), make_reward().to(device), "intra", chunk_size=4)
        engine.add_prompts(prompts)
        got[device] = {tuple(r.prompt_ids): (r.response_ids, r.reward) for r in drain(engine)}
        engine.close()
    assert {k: v[0] for k, v in got["cuda:1"].items()} == {k: v[0] for k, v in got["cuda:0"].items()}
    for k, (_, reward) in got["cuda:1"].items():
        assert reward == pytest.approx(got["cuda:0"][k][1], abs=1e-5)
