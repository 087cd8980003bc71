"""ModelRunner: packed paged forward of unmodified HF decoders equals their own forward on whole sequences."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, LlamaConfig, Qwen2Config

from oppo_engine.cache import KVArena, KVCacheManager, KVSpec
from oppo_engine.model.attention import ATTN_IMPL, paged_attention_enabled
from oppo_engine.model.runner import ModelRunner, SeqChunk

ATOL = 1e-4


def qwen2_config(**overrides) -> Qwen2Config:
    """GQA 4 q heads / 2 KV heads, head_dim 16."""
    kw = dict(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1,
    )  # fmt: skip
    return Qwen2Config(**{**kw, **overrides})


def llama_config(**overrides) -> LlamaConfig:
    """GQA group 3 (6 q heads / 2 KV heads), head_dim 24 (not a power of two, not hidden / heads)."""
    kw = dict(
        vocab_size=89, hidden_size=96, intermediate_size=128, num_hidden_layers=3, num_attention_heads=6,
        num_key_value_heads=2, head_dim=24, max_position_embeddings=256, initializer_range=0.1,
    )  # fmt: skip
    return LlamaConfig(**{**kw, **overrides})


CONFIGS = {"qwen2": qwen2_config, "llama": llama_config}


def causal_lm(config, device) -> torch.nn.Module:
    # A larger initializer_range than HF's default makes attention far from uniform, so errors show.
    return AutoModelForCausalLM.from_config(config).to(device).eval()


def make_runner(model, device, *, page_size: int = 4, num_pages: int = 64) -> ModelRunner:
    spec = KVSpec.from_hf_config(model.config, torch.float32)
    arena = KVArena({"m": spec}, page_size=page_size, num_pages=num_pages, device=device)
    return ModelRunner(model, KVCacheManager(arena, "m"))


def chunk(cache: KVCacheManager, seq_id, tokens) -> SeqChunk:
    """Reserve slots for ``tokens`` (the scheduler's job) and wrap them as a chunk."""
    tokens = [int(t) for t in tokens]
    slots = cache.append_slots(seq_id, len(tokens))
    assert slots is not None, "test arena too small"
    return SeqChunk(seq_id, tokens, slots)


@torch.no_grad()
def hf_logits(model, ids) -> torch.Tensor:
    """The HF model's own logits ``[len(ids), V]`` on the whole unpadded sequence."""
    return model(torch.as_tensor(ids, device=model.device)[None]).logits[0].float()


def assert_pages_match_tokens(cache: KVCacheManager, seq_ids) -> None:
    for s in seq_ids:
        assert len(cache.pages(s)) == -(-cache.num_tokens(s) // cache.page_size)
    allocator = cache.arena.allocator
    assert allocator.num_free() + cache.num_pages_used == cache.arena.num_pages


@pytest.mark.parametrize("arch", CONFIGS)
def test_paged_prefill_then_decode_equals_hf_forward(arch, device):
    torch.manual_seed(0)
    model = causal_lm(CONFIGS[arch](), device)
    runner = make_runner(model, device)
    vocab = model.config.vocab_size
    prompt, continuation = torch.randint(0, vocab, (13,)), torch.randint(0, vocab, (20,))

    steps = [runner.logits_all([chunk(runner.cache, "s", prompt)])]
    for token in continuation:  # 13 + 20 tokens cross 9 pages of 4
        steps.append(runner.logits_last([chunk(runner.cache, "s", [token])]))

    got = torch.cat(steps)
    want = hf_logits(model, torch.cat([prompt, continuation]))
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    assert_pages_match_tokens(runner.cache, ["s"])


@pytest.mark.parametrize("arch", CONFIGS)
def test_one_packed_batch_mixes_prefill_decode_and_chunks_of_several_sequences(arch, device):
    torch.manual_seed(1)
    model = causal_lm(CONFIGS[arch](), device)
    runner = make_runner(model, device)
    cache = runner.cache
    # Lengths hit a page that is exactly full (8, 12) and one-token sequences.
    lengths = {"a": 12, "b": 8, "c": 1, "d": 19}
    seqs = {s: torch.randint(0, model.config.vocab_size, (n,)).tolist() for s, n in lengths.items()}
    # Each call: (sequence, number of new tokens); sequences progress at different paces in one batch.
    schedule = [
        [("a", 11), ("b", 3)],
        [("a", 1), ("b", 5), ("c", 1), ("d", 4)],  # decode of a next to prefill of d
        [("d", 1)],
        [("d", 7), ("b", 0)],
        [("d", 7)],
    ]
    got: dict[str, list[torch.Tensor]] = {s: [] for s in seqs}
    for step in schedule:
        chunks = [chunk(cache, s, seqs[s][cache.num_tokens(s) :][:n]) for s, n in step if n]
        logits = runner.logits_all(chunks)
        offsets = torch.tensor([0] + [len(c.token_ids) for c in chunks]).cumsum(0).tolist()
        for c, lo, hi in zip(chunks, offsets, offsets[1:], strict=False):
            got[c.seq_id].append(logits[lo:hi])
        assert_pages_match_tokens(cache, seqs)

    for s, ids in seqs.items():
        assert cache.num_tokens(s) == len(ids)
        torch.testing.assert_close(torch.cat(got[s]), hf_logits(model, ids), atol=ATOL, rtol=0)


def test_last_token_outputs_are_the_last_rows_of_the_packed_output(device):
    torch.manual_seed(2)
    model = causal_lm(qwen2_config(), device)
    runner = make_runner(model, device)
    ids = {s: torch.randint(0, model.config.vocab_size, (n,)).tolist() for s, n in (("a", 6), ("b", 9))}
    chunks = [chunk(runner.cache, s, t) for s, t in ids.items()]
    hidden = runner.forward(chunks)
    # Running the same chunks again rewrites identical K/V into the same slots: same inputs, same outputs.
    last_rows = torch.tensor([5, 14], device=device)
    torch.testing.assert_close(runner.hidden_last(chunks), hidden[last_rows], atol=0, rtol=0)
    # The LM head over 2 rows and over 15 rows may round differently (BLAS blocking): not bit-equal.
    all_rows = runner.logits_all(chunks)[last_rows]
    torch.testing.assert_close(runner.logits_last(chunks), all_rows, atol=1e-5, rtol=0)
    assert hidden.shape == (15, model.config.hidden_size)


def test_actor_and_reward_models_share_one_arena(device):
    torch.manual_seed(3)
    actor = causal_lm(qwen2_config(), device)
    reward_config = llama_config(num_labels=1, pad_token_id=None, vocab_size=97)  # the actor's tokenizer
    reward = AutoModelForSequenceClassification.from_config(reward_config).to(device).eval()
    specs = {
        "actor": KVSpec.from_hf_config(actor.config, torch.float32),
        "reward": KVSpec.from_hf_config(reward.config, torch.float32),
    }
    arena = KVArena(specs, page_size=4, num_pages=48, device=device)
    actor_runner = ModelRunner(actor, KVCacheManager(arena, "actor"))
    reward_runner = ModelRunner(reward, KVCacheManager(arena, "reward"))
    # The smaller model fits more tokens into a page of the same bytes.
    assert reward_runner.cache.page_size == 4 and actor_runner.cache.page_size > 4

    prompts = {s: torch.randint(0, 97, (n,)).tolist() for s, n in (("x", 10), ("y", 3))}
    seqs = {s: list(p) for s, p in prompts.items()}
    logits = actor_runner.logits_last([chunk(actor_runner.cache, s, p) for s, p in prompts.items()])
    scores = reward_runner.score_last([chunk(reward_runner.cache, s, p) for s, p in prompts.items()])
    for _ in range(6):  # greedy decode on the actor, streamed token by token into the reward model
        new = {s: int(row.argmax()) for s, row in zip(seqs, logits, strict=True)}
        for s, t in new.items():
            seqs[s].append(t)
        logits = actor_runner.logits_last([chunk(actor_runner.cache, s, [t]) for s, t in new.items()])
        scores = reward_runner.score_last([chunk(reward_runner.cache, s, [t]) for s, t in new.items()])

    used = actor_runner.cache.num_pages_used + reward_runner.cache.num_pages_used
    assert arena.allocator.num_free() + used == arena.num_pages
    actor_pages = {p for s in seqs for p in actor_runner.cache.pages(s)}
    assert actor_pages.isdisjoint(p for s in seqs for p in reward_runner.cache.pages(s))
    for i, (s, ids) in enumerate(seqs.items()):
        for cache in (actor_runner.cache, reward_runner.cache):
            assert len(cache.pages(s)) == -(-len(ids) // cache.page_size)
        torch.testing.assert_close(logits[i], hf_logits(actor, ids)[-1], atol=ATOL, rtol=0)
        with torch.no_grad():
            want = reward(torch.tensor([ids], device=device)).logits[0, 0].float()
        torch.testing.assert_close(scores[i], want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_attention_implementation_is_restored_and_plain_forward_still_works(impl, device):
    torch.manual_seed(4)
    model = causal_lm(qwen2_config(), device)
    model.set_attn_implementation(impl)
    ids = torch.randint(0, model.config.vocab_size, (1, 11), device=device)
    before = hf_logits(model, ids[0])

    runner = make_runner(model, device)
    runner.logits_all([chunk(runner.cache, 0, ids[0])])

    assert model.config._attn_implementation == impl
    assert model.model.config._attn_implementation == impl
    torch.testing.assert_close(hf_logits(model, ids[0]), before, atol=0, rtol=0)
    # Training still works: gradients flow through the restored implementation.
    model(ids, labels=ids).loss.backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None


def test_plain_forward_while_switched_raises_instead_of_returning_wrong_numbers(device):
    """A padded HF batch run while the engine holds the switch must not silently skip its padding mask."""
    torch.manual_seed(5)
    model = causal_lm(llama_config(), device)
    ids = torch.randint(1, model.config.vocab_size, (2, 9), device=device)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
    errors = []

    def other_thread():  # the metadata is bound per thread: another thread's forward has none
        try:
            with torch.no_grad():
                model(ids, attention_mask=mask)
        except RuntimeError as e:
            errors.append(e)

    with paged_attention_enabled(model):
        with pytest.raises(RuntimeError, match="paged attention.*outside the engine's forward"):
            with torch.no_grad():
                model(ids, attention_mask=mask)
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
    assert len(errors) == 1
    with torch.no_grad():  # switched off: the model is HF's again
        torch.testing.assert_close(model(ids, attention_mask=mask).logits, want, atol=0, rtol=0)


def test_switch_is_reentrant_thread_safe_and_restores_on_error():
    model = causal_lm(qwen2_config(), "cpu")
    with paged_attention_enabled(model):  # an engine holding it for a whole step
        with paged_attention_enabled(model):  # the runner's own per-forward entry
            pass
        assert model.config._attn_implementation == ATTN_IMPL

        def worker():
            for _ in range(50):
                with paged_attention_enabled(model):
                    assert model.config._attn_implementation == ATTN_IMPL

        threads = [threading.Thread(target=worker) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert model.config._attn_implementation == ATTN_IMPL
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError), paged_attention_enabled(model):
        raise RuntimeError("a failing forward")
    assert model.config._attn_implementation == "sdpa"


def test_runner_rejects_a_cache_of_another_shape_or_dtype():
    model = causal_lm(qwen2_config(), "cpu")
    other = KVSpec.from_hf_config(llama_config(), torch.float32)
    arena = KVArena({"m": other}, page_size=4, num_pages=4)
    with pytest.raises(ValueError, match="cache"):
        ModelRunner(model, KVCacheManager(arena, "m"))
    half = KVArena({"m": KVSpec.from_hf_config(model.config, torch.float16)}, page_size=4, num_pages=4)
    with pytest.raises(ValueError, match="dtype"):
        ModelRunner(model, KVCacheManager(half, "m"))


def test_runner_rejects_chunks_without_slots():
    model = causal_lm(qwen2_config(), "cpu")
    runner = make_runner(model, "cpu")
    with pytest.raises(ValueError, match="chunks"):
        runner.forward([SeqChunk("s", [1, 2, 3], [])])
    with pytest.raises(ValueError, match="chunks"):
        runner.forward([])
    c = chunk(runner.cache, "s", [1, 2])
    with pytest.raises(ValueError, match="once"):
        runner.forward([c, c])


@pytest.mark.cuda
def test_bf16_paged_decode_tracks_hf_forward_on_cuda():
    torch.manual_seed(6)
    model = AutoModelForCausalLM.from_config(llama_config(), dtype=torch.bfloat16).cuda().eval()
    spec = KVSpec.from_hf_config(model.config, torch.bfloat16)
    arena = KVArena({"m": spec}, page_size=16, num_pages=32, device="cuda")
    runner = ModelRunner(model, KVCacheManager(arena, "m"))
    ids = torch.randint(0, model.config.vocab_size, (70,)).tolist()
    steps = [runner.logits_all([chunk(runner.cache, 0, ids[:50])])]
    steps += [runner.logits_last([chunk(runner.cache, 0, [t])]) for t in ids[50:]]
    got, want = torch.cat(steps), hf_logits(model, ids)
    # bf16 rounding differs between kernels; the error must stay small against the logits' scale.
    assert (got - want).abs().max() <= 0.05 * want.abs().max()
