"""Reference log-probs and critic values: prefilled in chunks of any size, they equal the HF models' own
forward on the whole sequence (TRL's conventions), through the scorers alone and through the engine."""

from __future__ import annotations

import pytest
import torch
from engine_models import EOS, VOCAB, actor_config, make_actor, make_reward, random_prompts
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from oppo_engine import EngineConfig, RolloutEngine, SamplingParams
from oppo_engine.cache import KVArena, KVCacheManager, KVSpec
from oppo_engine.model.runner import ModelRunner, SeqChunk
from oppo_engine.model.scorer import CriticScorer, ReferenceScorer

ATOL = 1e-4


def make_reference(seed: int = 2) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = actor_config(hidden_size=32, intermediate_size=64, num_key_value_heads=4, initializer_range=0.1)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def make_critic(seed: int = 3) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = actor_config(hidden_size=32, intermediate_size=64, num_labels=1, initializer_range=0.1)
    return AutoModelForSequenceClassification.from_config(cfg, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_ref_logprobs(ref, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    ids = torch.tensor([prompt + response])
    logits = ref(ids).logits[0, len(prompt) - 1 : -1].float() / (temperature if temperature > 0 else 1.0)
    return logits.log_softmax(-1).gather(1, torch.tensor(response)[:, None])[:, 0]


@torch.inference_mode()
def hf_values(critic, prompt: list[int], response: list[int]) -> torch.Tensor:
    hidden = critic.base_model(torch.tensor([prompt + response])).last_hidden_state
    return critic.score(hidden)[0, len(prompt) - 1 : -1, 0].float()


def stream(scorer, seqs: dict[str, tuple[list[int], list[int]]], chunk: int, temperature: float) -> dict:
    """Feed (prompt, response) sequences to ``scorer`` in chunks of ``chunk`` tokens, all packed per call."""
    cache = scorer.cache
    for s, (prompt, _) in seqs.items():
        scorer.begin(s, len(prompt), temperature)
    while True:
        chunks = []
        for s, (prompt, response) in seqs.items():
            ids, done = prompt + response, cache.num_tokens(s)
            if done < len(ids):
                new = ids[done : done + chunk]
                chunks.append(SeqChunk(s, new, cache.append_slots(s, len(new))))
        if not chunks:
            break
        scorer.prefill(chunks)
    out = {s: scorer.finish(s, prompt, response) for s, (prompt, response) in seqs.items()}
    for s in seqs:
        scorer.release(s)
    assert cache.num_pages_used == 0
    return out


def scorer_for(cls, model, page_size: int = 8):
    arena = KVArena(
        {"m": KVSpec.from_hf_config(model.config, torch.float32)}, page_size=page_size, num_pages=64
    )
    return cls(ModelRunner(model, KVCacheManager(arena, "m")))


def random_pairs(seed: int) -> dict[str, tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(seed)
    lens = {"short": (3, 1), "mid_page": (11, 9), "long": (5, 30), "one_prompt_token": (1, 6)}
    return {
        s: tuple(torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in pr) for s, pr in lens.items()
    }


@pytest.mark.parametrize("chunk", [1, 4, 7, 64])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_reference_logprobs_streamed_in_chunks_equal_hf(chunk, temperature):
    ref = make_reference()
    seqs = random_pairs(chunk)
    got = stream(scorer_for(ReferenceScorer, ref), seqs, chunk, temperature)
    for s, (prompt, response) in seqs.items():
        assert len(got[s]) == len(response)
        want = hf_ref_logprobs(ref, prompt, response, temperature)
        torch.testing.assert_close(torch.tensor(got[s]), want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("chunk", [1, 4, 7, 64])
def test_critic_values_streamed_in_chunks_equal_hf(chunk):
    critic = make_critic()
    seqs = random_pairs(10 + chunk)
    got = stream(scorer_for(CriticScorer, critic), seqs, chunk, 1.0)
    for s, (prompt, response) in seqs.items():
        assert len(got[s]) == len(response)
        want = hf_values(critic, prompt, response)
        torch.testing.assert_close(torch.tensor(got[s]), want, atol=ATOL, rtol=0)


def test_reference_uses_the_temperature_and_no_truncation():
    """The temperature matters (the check can fail), and top-k/top-p of the sampler do not apply."""
    ref = make_reference()
    seqs = random_pairs(7)
    got = stream(scorer_for(ReferenceScorer, ref), seqs, 3, 0.5)
    prompt, response = seqs["long"]
    at_t1 = hf_ref_logprobs(ref, prompt, response, 1.0)
    assert not torch.allclose(torch.tensor(got["long"]), at_t1, atol=1e-2)


@pytest.mark.parametrize("budget", [3, 64])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_engine_fills_ref_logprobs_and_values_like_hf(budget, temperature):
    actor, ref, critic = make_actor(), make_reference(), make_critic()
    engine = RolloutEngine(
        actor=actor,
        reward=make_reward(),
        reference=ref,
        critic=critic,
        config=EngineConfig(batch_size=5, max_model_len=64, page_size=8, max_num_batched_tokens=budget),
        sampling=SamplingParams(temperature=temperature, top_k=20 if temperature else 0, max_new_tokens=12),
        eos_token_id=EOS,
    )
    engine.add_prompts(random_prompts(5, seed=budget))
    rollouts = engine.step().rollouts
    assert len(rollouts) == 5
    for r in rollouts:
        assert len(r.ref_logprobs) == len(r.values) == len(r.response_ids)
        want = hf_ref_logprobs(ref, r.prompt_ids, r.response_ids, temperature)
        torch.testing.assert_close(torch.tensor(r.ref_logprobs), want, atol=ATOL, rtol=0)
        torch.testing.assert_close(
            torch.tensor(r.values), hf_values(critic, r.prompt_ids, r.response_ids), atol=ATOL, rtol=0
        )
    stats = engine.cache_stats()
    assert stats.free_pages == stats.total_pages
    assert set(stats.pages_per_model) == {"actor", "reward", "reference", "critic"}


def test_without_reference_and_critic_the_fields_are_none():
    engine = RolloutEngine(
        actor=make_actor(), reward=make_reward(), config=EngineConfig(batch_size=2, max_model_len=64),
        sampling=SamplingParams(temperature=0.0, max_new_tokens=4), eos_token_id=EOS,
    )  # fmt: skip
    engine.add_prompts(random_prompts(2, seed=1))
    assert all(r.ref_logprobs is None and r.values is None for r in engine.step().rollouts)


def test_bad_reference_and_critic_are_refused_at_construction():
    actor, reward = make_actor(), make_reward()
    with pytest.raises(ValueError, match="reference: .* not a causal LM"):
        RolloutEngine(actor=actor, reward=reward, reference=make_critic())
    with pytest.raises(ValueError, match="critic: .*score head"):
        RolloutEngine(actor=actor, reward=reward, critic=make_reference())
    torch.manual_seed(0)
    other_vocab = AutoModelForCausalLM.from_config(actor_config(vocab_size=VOCAB + 1)).eval()
    with pytest.raises(ValueError, match="reference: its vocabulary has 129 tokens"):
        RolloutEngine(actor=actor, reward=reward, reference=other_vocab)
