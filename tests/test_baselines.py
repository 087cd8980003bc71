import pytest
import torch

from bench.baselines import hf_rollout_step
from bench.workloads import PAD_TOKEN_ID, build_models


@pytest.fixture(scope="module")
def models():
    return build_models("tiny", torch.float32, "cpu", seed=0)


# Ragged on purpose: prompts of different lengths (left padding matters) and responses of different
# lengths (truncation to each one's own max_new_tokens matters).
PROMPTS = [[17, 40, 41, 99, 300], [18], [200, 201, 202, 203, 204, 205, 206, 207, 208], [500, 20, 30]]
MAX_NEW = [6, 1, 11, 4]


def test_greedy_responses_equal_generate_on_each_prompt_alone(models):
    actor, reward = models
    out = hf_rollout_step(actor, reward, PROMPTS, MAX_NEW, temperature=0.0, seed=0, pad_token_id=PAD_TOKEN_ID)
    assert [len(r) for r in out.response_ids] == MAX_NEW
    for prompt, n, got in zip(PROMPTS, MAX_NEW, out.response_ids, strict=True):
        ids = torch.tensor([prompt])
        alone = actor.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=PAD_TOKEN_ID,
        )
        assert got == alone[0, len(prompt) :].tolist()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_each_reward_equals_the_reward_model_on_that_sequence_alone(models, temperature):
    actor, reward = models
    out = hf_rollout_step(
        actor, reward, PROMPTS, MAX_NEW, temperature=temperature, seed=1, pad_token_id=PAD_TOKEN_ID
    )
    assert out.generation_s > 0 and out.scoring_s > 0
    for prompt, resp, got in zip(PROMPTS, out.response_ids, out.rewards, strict=True):
        seq = prompt + resp
        # HF pools at the rightmost non-pad token; only the last real one is wanted here
        assert seq[-1] != PAD_TOKEN_ID
        with torch.inference_mode():
            want = reward(input_ids=torch.tensor([seq])).logits[0, 0].item()
        assert got == pytest.approx(want, abs=1e-4)
    assert len(set(out.rewards)) == len(PROMPTS)  # rewards differ, so a mix-up between rows would fail


def test_sampling_is_seeded(models):
    actor, reward = models
    a = hf_rollout_step(actor, reward, PROMPTS, MAX_NEW, temperature=1.0, seed=7, pad_token_id=PAD_TOKEN_ID)
    b = hf_rollout_step(actor, reward, PROMPTS, MAX_NEW, temperature=1.0, seed=7, pad_token_id=PAD_TOKEN_ID)
    c = hf_rollout_step(actor, reward, PROMPTS, MAX_NEW, temperature=1.0, seed=8, pad_token_id=PAD_TOKEN_ID)
    assert a.response_ids == b.response_ids and a.rewards == b.rewards
    assert a.response_ids != c.response_ids


def test_mismatched_lengths_are_rejected(models):
    actor, reward = models
    with pytest.raises(ValueError, match="max_new_tokens"):
        hf_rollout_step(
            actor, reward, PROMPTS, MAX_NEW[:2], temperature=0.0, seed=0, pad_token_id=PAD_TOKEN_ID
        )
