"""The engine equals HF's own forward on every decoder family it accepts, and refuses the rest when built.

For each family (tiny random models from ``families.py``) the engine's rollouts are checked against HF's
forward on the whole sequence (prompt + response), the oracle being the model itself in eager attention:
greedy tokens are HF's argmax at the previous position, behaviour log-probs are HF's ``log_softmax`` (of
``logits / T`` when sampling), rewards are HF's sequence-classification score, both for a sequence alone
(``batch_size=1``) and in a mixed batch of prompts of different lengths (page size 8: one prompt fills a
page exactly, others end mid-page). Each feature a family adds (sliding window, softcaps, logit scaling,
dropped ``**kwargs``) is shown to matter, so the equality checks can fail. Models HF itself runs in a way
no incremental decoder can reproduce (batch-dependent RoPE) and models outside ``AttentionInterface`` are
refused with a ``ValueError`` at construction.
"""

from __future__ import annotations

import functools

import pytest
import torch
import transformers
from families import (
    EOS,
    FAMILIES,
    ROUTED,
    SLIDING_WINDOW,
    VOCAB,
    build_actor,
    build_reward,
    drop_softcaps,
    drop_window,
    hf_behaviour_logprobs,
    hf_logits,
    hf_score,
    prompts,
    reward_family,
    without,
)

from oppo_engine import EngineConfig, RolloutEngine, SamplingParams

FP32_ATOL = 1e-4
MIXED_LENGTHS = (2, 5, 8, 11, 13, 16)  # page_size 8: 8 and 16 fill pages exactly, the rest end mid-page
ALONE = (0, 4)  # the mixed batch's prompts of 2 and 13 tokens, also run alone
MAX_NEW_TOKENS = 10
TEMPERATURE = 0.7
SEED = 1234


@pytest.fixture(scope="module", autouse=True)
def one_intra_op_thread():
    """Matrices this small gain nothing from intra-op threads, and on a busy 2-core machine the threads'
    synchronisation made this file 6x slower (19 s against 126 s wall under a load of 4)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@functools.cache
def actor_of(name: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return build_actor(name, dtype=dtype)


@functools.cache
def reward_of(name: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return build_reward(reward_family(name), dtype=dtype)


def make_engine(actor, reward, *, batch_size: int, temperature: float = 0.0, eos: int = EOS, **cfg):
    cfg.setdefault("max_model_len", 128)
    cfg.setdefault("page_size", 8)
    return RolloutEngine(
        actor=actor,
        reward=reward,
        config=EngineConfig(batch_size=batch_size, mode="sequential", **cfg),
        sampling=SamplingParams(temperature=temperature, max_new_tokens=MAX_NEW_TOKENS, seed=SEED),
        eos_token_id=eos,
    )


def rollouts_of(engine: RolloutEngine, batch: list[list[int]]) -> list:
    """Every rollout of ``batch``, in prompt order (prompts are distinct)."""
    try:
        engine.add_prompts(batch)
        done = []
        while result := engine.step().rollouts:
            done += result
        stats = engine.cache_stats()
        assert stats.free_pages == stats.total_pages, "pages leaked"
    finally:
        engine.close()
    by_prompt = {tuple(r.prompt_ids): r for r in done}
    assert len(by_prompt) == len(batch)
    return [by_prompt[tuple(p)] for p in batch]


@functools.cache
def run(name: str, how: str, dtype: torch.dtype = torch.float32) -> tuple:
    """Rollouts of family ``name`` run ``alone`` (batch_size 1), ``mixed`` (one batch) or ``sampled``."""
    batch = prompts(MIXED_LENGTHS, seed=len(name))
    if how == "alone":
        batch = [batch[i] for i in ALONE]
    engine = make_engine(
        actor_of(name, dtype),
        reward_of(name, dtype),
        batch_size=1 if how == "alone" else len(batch),
        temperature=TEMPERATURE if how == "sampled" else 0.0,
    )
    return tuple(rollouts_of(engine, batch))


def assert_logprobs_equal_hf(actor, rollouts, temperature: float, atol: float) -> None:
    for r in rollouts:
        want, logits = hf_behaviour_logprobs(actor, r.prompt_ids, r.response_ids, temperature)
        got = torch.tensor(r.logprobs)
        assert len(r.response_ids) == len(r.logprobs) >= 1
        where = f"prompt {r.prompt_ids}, response {r.response_ids}"
        torch.testing.assert_close(got, want, atol=atol, rtol=0, msg=lambda m, where=where: f"{where}: {m}")
        if temperature == 0:
            # Greedy: each token is HF's argmax (a near-tie within the tolerance may go either way).
            chosen = logits.gather(1, torch.tensor(r.response_ids)[:, None])[:, 0]
            gap = logits.max(-1).values - chosen
            assert (gap <= atol).all(), f"prompt {r.prompt_ids}: not HF's argmax, logit gaps {gap.tolist()}"


def assert_rewards_equal_hf(reward, rollouts, atol: float) -> None:
    got = torch.tensor([r.reward for r in rollouts])
    want = torch.tensor([hf_score(reward, r.prompt_ids + r.response_ids) for r in rollouts])
    torch.testing.assert_close(got, want, atol=atol, rtol=0)


# -- every accepted family equals HF --------------------------------------------------------------------

# Every family on transformers >= 5.25; older releases refuse Falcon (before 5.25), GPT-J and CodeGen
# (before 5.24): see test_a_family_runs_from_the_release_that_routes_its_attention_and_is_refused_before.
NAMES = ROUTED


@pytest.mark.parametrize("name", NAMES)
def test_greedy_tokens_and_logprobs_equal_hf_alone(name):
    assert_logprobs_equal_hf(actor_of(name), run(name, "alone"), 0.0, FP32_ATOL)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_tokens_and_logprobs_equal_hf_in_mixed_batch(name):
    rollouts = run(name, "mixed")
    assert_logprobs_equal_hf(actor_of(name), rollouts, 0.0, FP32_ATOL)
    # The prompts run alone are in this batch too; batch composition changes nothing.
    for i, r in zip(ALONE, run(name, "alone"), strict=True):
        assert (r.response_ids, r.reward) == (
            rollouts[i].response_ids,
            pytest.approx(rollouts[i].reward, abs=1e-5),
        )


@pytest.mark.parametrize("name", NAMES)
def test_rewards_equal_hf_score(name):
    reward = reward_of(name)
    assert_rewards_equal_hf(reward, run(name, "alone"), FP32_ATOL)
    assert_rewards_equal_hf(reward, run(name, "mixed"), FP32_ATOL)


@pytest.mark.parametrize("name", NAMES)
def test_sampled_logprobs_equal_hf_tempered_log_softmax(name):
    rollouts = run(name, "sampled")
    assert_logprobs_equal_hf(actor_of(name), rollouts, TEMPERATURE, FP32_ATOL)
    # Sampling really sampled: some token is not the greedy one.
    greedy = {tuple(r.prompt_ids): r.response_ids for r in run(name, "mixed")}
    assert any(r.response_ids != greedy[tuple(r.prompt_ids)] for r in rollouts)


@pytest.mark.parametrize("name", [n for n, f in FAMILIES.items() if f.routed_since])
def test_a_family_runs_from_the_release_that_routes_its_attention_and_is_refused_before(name):
    """From the transformers release that moves a family onto ``AttentionInterface``, the engine builds on
    it and the checks above run it; on an older release (the H200's 5.17 for GPT-J and CodeGen) its actor and
    its reward model are refused when the engine is built, never run through HF's own attention."""
    family = FAMILIES[name]
    if family.routed:
        assert name in NAMES
        make_engine(actor_of(name), reward_of(name), batch_size=2).close()
        return
    with pytest.raises(ValueError, match="AttentionInterface"):
        make_engine(actor_of(name), reward_of("llama"), batch_size=2)
    if reward_family(name) == name:
        with pytest.raises(ValueError, match="AttentionInterface"):
            make_engine(actor_of("llama"), reward_of(name), batch_size=2)


# bf16: the engine and HF round at different points (other matmul shapes over the packed batch, the paged
# kernel's own softmax and accumulation order against HF's eager attention), and bf16 keeps 8 bits of
# mantissa (relative step 2^-8 = 0.4%) on logits of magnitude ~1-5. Measured over 14 families: log-probs
# within 0.033, rewards within 0.016; the tolerances are ~3x that. A wrong mask, position or logit scale
# costs far more (the fp32 bugs this file catches are 0.3-4 nats).
BF16_FAMILIES = ("llama", "qwen2", "stablelm", "gemma2", "mistral_window")
BF16_LOGPROB_ATOL = 0.1
BF16_REWARD_ATOL = 0.05


@pytest.mark.parametrize("name", BF16_FAMILIES)
def test_bf16_logprobs_and_rewards_close_to_hf(name):
    rollouts = run(name, "mixed", torch.bfloat16)
    actor, reward = actor_of(name, torch.bfloat16), reward_of(name, torch.bfloat16)
    for r in rollouts:
        want, _ = hf_behaviour_logprobs(actor, r.prompt_ids, r.response_ids, 0.0)
        torch.testing.assert_close(torch.tensor(r.logprobs), want, atol=BF16_LOGPROB_ATOL, rtol=0)
    assert_rewards_equal_hf(reward, rollouts, BF16_REWARD_ATOL)


# -- the features the families add matter, so the checks above can fail --------------------------------


def _long_sequence() -> list[int]:
    return prompts([3 * SLIDING_WINDOW + 1], seed=99)[0]


@pytest.mark.parametrize("name", [n for n, f in FAMILIES.items() if "window" in f.features])
def test_sliding_window_changes_hf_logits(name):
    ids, actor = _long_sequence(), actor_of(name)
    windowed, full = hf_logits(actor, ids), hf_logits(without(actor, drop_window), ids)
    # Identical while the context fits the window, different beyond it.
    torch.testing.assert_close(windowed[:SLIDING_WINDOW], full[:SLIDING_WINDOW], atol=1e-5, rtol=0)
    assert (windowed[SLIDING_WINDOW + 1 :] - full[SLIDING_WINDOW + 1 :]).abs().max() > 1e-2
    # The engine's prompts alone outgrow the window.
    assert max(MIXED_LENGTHS[i] for i in ALONE) > SLIDING_WINDOW + 1


def test_gemma2_attention_softcap_changes_hf_logits():
    ids, actor = _long_sequence(), actor_of("gemma2")
    final_cap = actor.config.final_logit_softcapping
    capped = hf_logits(actor, ids)
    uncapped = hf_logits(without(actor, lambda m: drop_softcaps(m, final=False)), ids)
    assert capped.abs().max() < final_cap and uncapped.abs().max() < final_cap  # the final cap is still on
    assert (capped.log_softmax(-1) - uncapped.log_softmax(-1)).abs().max() > 1e-2


@pytest.mark.parametrize(
    "name", [n for n, f in FAMILIES.items() if f.features & {"logit_scale", "final_softcap"}]
)
def test_hf_logits_are_post_processed_after_the_head(name):
    """Logits are not just ``lm_head(hidden)``: log-probs taken from the bare head would be wrong."""
    ids, actor = _long_sequence(), actor_of(name)
    with torch.inference_mode():
        hidden = actor.model(input_ids=torch.tensor([ids]), use_cache=False).last_hidden_state[0]
        bare = actor.lm_head(hidden).float()
    assert (bare.log_softmax(-1) - hf_logits(actor, ids).log_softmax(-1)).abs().max() > 1e-2


_PROBE = "oppo_probe_kwargs"
_seen: list[bool] = []


def _probe_attention(module, query, key, value, attention_mask, **kwargs):
    _seen.append("oppo_probe" in kwargs)
    return transformers.AttentionInterface()["sdpa"](module, query, key, value, attention_mask, **kwargs)


def test_stablelm_decoder_layer_drops_kwargs_before_attention():
    """The StableLM case exercises metadata that cannot travel as a keyword argument (DESIGN, Models)."""
    transformers.AttentionInterface.register(_PROBE, _probe_attention)
    seen = {}
    for name in ("llama", "stablelm"):
        model = build_actor(name)
        model.set_attn_implementation(_PROBE)
        _seen.clear()
        with torch.inference_mode():
            model(input_ids=torch.tensor([[5, 6, 7]]), use_cache=False, oppo_probe=1)
        seen[name] = set(_seen)
    assert seen == {"llama": {True}, "stablelm": {False}}


# -- pad id == EOS: HF scores the last non-pad token ----------------------------------------------------


def _emitted_token(actor, batch: list[list[int]]) -> int:
    """A non-special token the greedy actor emits mid-response for several prompts (used as EOS)."""
    counts = torch.zeros(VOCAB, dtype=torch.long)
    for p in batch:
        ids = list(p)
        for _ in range(6):
            ids.append(int(hf_logits(actor, ids)[-1].argmax()))
        counts[torch.tensor(sorted(set(ids[len(p) + 1 :])))] += 1
    counts[:4] = 0
    return int(counts.argmax())


@pytest.mark.parametrize("name", ["gpt2", "qwen2"])
def test_reward_with_pad_equal_eos_scores_last_non_pad_token(name):
    actor, batch = actor_of(name), prompts(MIXED_LENGTHS, seed=7)
    eos = _emitted_token(actor, batch)
    reward = build_reward(name, pad_token_id=eos)
    rollouts = rollouts_of(make_engine(actor, reward, batch_size=len(batch), eos=eos), batch)
    ended = [r for r in rollouts if r.response_ids[-1] == eos]
    assert len(ended) >= 2
    assert_rewards_equal_hf(reward, rollouts, FP32_ATOL)
    # HF's choice matters: scored at the final EOS instead, the rewards would differ.
    reward.config.pad_token_id = None
    try:
        at_last = [hf_score(reward, r.prompt_ids + r.response_ids) for r in ended]
    finally:
        reward.config.pad_token_id = eos
    assert all(abs(a - r.reward) > 1e-3 for a, r in zip(at_last, ended, strict=True))


# -- refused at construction ----------------------------------------------------------------------------

ORIGINAL_LEN = 64  # the RoPE's original context; MIXED_LENGTHS + MAX_NEW_TOKENS stays below it


def _dynamic_rope_llama(seed: int = 0) -> torch.nn.Module:
    return build_actor(
        "llama",
        seed=seed,
        max_position_embeddings=ORIGINAL_LEN,
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    )


def _longrope_phi3(seed: int = 0) -> torch.nn.Module:
    half_rotary = FAMILIES["phi3"].make_config().hidden_size // 4 // 2
    return build_actor(
        "phi3",
        seed=seed,
        max_position_embeddings=4 * ORIGINAL_LEN,
        original_max_position_embeddings=ORIGINAL_LEN,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0] * half_rotary,
            "long_factor": [4.0] * half_rotary,
        },
    )


ROPES = {"dynamic": _dynamic_rope_llama, "longrope": _longrope_phi3}


@pytest.mark.parametrize("rope", ROPES)
def test_hf_rope_depends_on_sequence_length_beyond_original(rope):
    """Why the refusal: past the original length HF re-scales every position, the early ones included."""
    actor = ROPES[rope]()
    ids = prompts([ORIGINAL_LEN + 8], seed=5)[0]
    short = hf_logits(actor, ids[:16])
    long = hf_logits(actor, ids)[:16]
    assert (short - long).abs().max() > 1e-3


@pytest.mark.parametrize("rope", ROPES)
def test_length_dependent_rope_refused_beyond_original_length(rope):
    with pytest.raises(ValueError, match="(?i)rope"):
        make_engine(ROPES[rope](), reward_of("llama"), batch_size=4, max_model_len=2 * ORIGINAL_LEN)


@pytest.mark.parametrize("rope", ROPES)
def test_length_dependent_rope_within_original_length_equals_hf(rope):
    actor, reward = ROPES[rope](), reward_of("llama")
    batch = prompts(MIXED_LENGTHS, seed=11)
    # Strictly below: HF un-scales a grown dynamic RoPE only for batches shorter than the original length.
    engine = make_engine(actor, reward, batch_size=len(batch), max_model_len=ORIGINAL_LEN - 1)
    rollouts = rollouts_of(engine, batch)
    assert_logprobs_equal_hf(actor, rollouts, 0.0, FP32_ATOL)
    assert_rewards_equal_hf(reward, rollouts, FP32_ATOL)


def test_reward_with_other_vocab_refused_without_tokenizers():
    reward = build_reward("llama", vocab_size=VOCAB - 28)
    with pytest.raises(ValueError, match="(?i)vocab"):
        make_engine(actor_of("llama"), reward, batch_size=4)


_COMMON = dict(vocab_size=VOCAB, initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=EOS)
_GPT_OSS = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=32,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=SLIDING_WINDOW,
    layer_types=["sliding_attention", "full_attention"],
)
_RECURRENT_GEMMA = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=1,
    intermediate_size=64,
    lru_width=32,
    attention_window_size=8,
    block_types=["recurrent", "attention"],
)
# name: (config class, its tiny arguments, what the refusal must name)
REFUSED = {
    # ALiBi: HF adds the bias to the attention mask, which the paged kernels do not take (every release).
    "bloom": ("BloomConfig", dict(hidden_size=32, n_layer=2, n_head=4), "ALiBi"),
    "falcon_alibi": (
        "FalconConfig",
        dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, alibi=True),
        "ALiBi",
    ),
    "mpt": ("MptConfig", dict(d_model=32, n_layers=2, n_heads=4), "ALiBi"),
    # MPT without ALiBi still runs its own attention, outside AttentionInterface.
    "mpt_no_alibi": (
        "MptConfig",
        dict(d_model=32, n_layers=2, n_heads=4, attn_config=dict(alibi=False)),
        "AttentionInterface",
    ),
    "mamba": ("MambaConfig", dict(hidden_size=32, num_hidden_layers=2, state_size=4), "(?i)attention"),
    "recurrent_gemma": ("RecurrentGemmaConfig", _RECURRENT_GEMMA, "(?i)attention"),
    "gpt_oss": ("GptOssConfig", _GPT_OSS, "(?i)sink"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_models_the_engine_cannot_run_are_refused_at_construction(name):
    config_class, kwargs, feature = REFUSED[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**_COMMON, **kwargs)
    actor = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with pytest.raises(ValueError, match=feature):
        make_engine(actor, reward_of("llama"), batch_size=4)


def test_an_alibi_model_let_through_fails_its_rollouts_rather_than_running_without_its_bias(monkeypatch):
    """Behind the ALiBi refusal: with no mask function registered for the engine's attention, HF builds no
    mask, and Falcon's ALiBi path fails on it; its rollouts come back failed, none scored. Were a release
    to run that path without the bias, this test would see rollouts and fail."""
    from oppo_engine.model import support

    if not FAMILIES["falcon"].routed:
        pytest.skip(f"transformers {transformers.__version__} keeps Falcon outside AttentionInterface")
    torch.manual_seed(0)
    config = transformers.FalconConfig(
        **_COMMON, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, alibi=True
    )
    actor = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    monkeypatch.setattr(support, "uses_alibi", lambda model: False)
    engine = make_engine(actor, reward_of("llama"), batch_size=2)
    try:
        engine.add_prompts(prompts((3, 5), seed=0))
        result = engine.step()
        assert result.rollouts == [] and len(result.failed) == 2
        assert all(r.finish_reason == "error" and r.error.startswith("actor: ") for r in result.failed)
    finally:
        engine.close()


def test_a_mask_passed_to_the_engines_attention_is_refused_not_ignored():
    """A mask reaching the paged attention was built by the model itself (a bias, a custom pattern): the
    kernel masks causally from the cache's metadata and would silently drop it, so the call raises."""
    from oppo_engine.model.attention import AttentionMetadata, bound_metadata, paged_attention_forward

    layer = torch.nn.Module()
    layer.layer_idx = 0
    q = k = v = torch.zeros(1, 1, 2, 4)
    meta = AttentionMetadata(
        kv_cache=torch.zeros(1, 1, 2, 8, 1, 4), slot_mapping=torch.arange(2),
        block_tables=torch.zeros(1, 1, dtype=torch.int32), context_lens=torch.tensor([2], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, 2], dtype=torch.int32), max_q_len=2, max_context_len=2, backend="cpu",
    )  # fmt: skip
    with bound_metadata(meta):
        out, _ = paged_attention_forward(layer, q, k, v, None)
        assert out.shape == (1, 2, 1, 4)
        with pytest.raises(ValueError, match="its own attention mask"):
            paged_attention_forward(layer, q, k, v, torch.zeros(1, 1, 2, 2))
