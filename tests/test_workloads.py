import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from bench.workloads import (
    DISTRIBUTIONS,
    EOS_TOKEN_ID,
    PAD_TOKEN_ID,
    PRESETS,
    TOKEN_ID_LOW,
    build_models,
    make_workload,
    preset_config,
)


@pytest.mark.parametrize("name", sorted(DISTRIBUTIONS))
def test_same_seed_same_workload_other_seed_other_workload(name):
    a = make_workload(name, 64, 32, 256, 512, seed=3)
    assert a == make_workload(name, 64, 32, 256, 512, seed=3)
    b = make_workload(name, 64, 32, 256, 512, seed=4)
    assert a.prompts != b.prompts and a.max_new_tokens != b.max_new_tokens


@pytest.mark.parametrize("name", sorted(DISTRIBUTIONS))
@pytest.mark.parametrize("cap", [1, 7, 1024])
def test_lengths_and_token_ids_stay_in_range(name, cap):
    w = make_workload(name, 500, cap, cap, 100, seed=0)
    assert len(w.prompts) == len(w.max_new_tokens) == 500
    assert all(1 <= len(p) <= cap for p in w.prompts)
    assert all(1 <= n <= cap for n in w.max_new_tokens)
    ids = np.concatenate([np.asarray(p) for p in w.prompts])
    assert ids.min() >= TOKEN_ID_LOW and ids.max() < 100
    assert w.response_tokens == sum(w.max_new_tokens)


def test_longtail_median_is_an_eighth_of_the_cap_with_a_heavy_tail():
    cap = 2048
    lens = np.asarray(make_workload("longtail", 4000, cap, cap, 512, seed=1).max_new_tokens)
    median = np.median(lens)
    assert 0.8 * cap / 8 <= median <= 1.2 * cap / 8
    assert lens.max() >= 6 * median  # the stragglers that hold a sequential batch back
    assert (lens == cap).mean() < 0.05  # clipping touches only the tail


def test_uniform_covers_the_range_evenly():
    cap = 1000
    lens = np.asarray(make_workload("uniform", 5000, cap, cap, 512, seed=2).max_new_tokens)
    counts, _ = np.histogram(lens, bins=5, range=(1, cap + 1))
    assert counts.min() > 0.8 * counts.max()


def test_bimodal_has_two_modes_separated_by_a_valley():
    cap = 1000
    lens = np.asarray(make_workload("bimodal", 4000, cap, cap, 512, seed=5).max_new_tokens)
    counts, _ = np.histogram(lens, bins=10, range=(1, cap + 1))
    short_peak, long_peak = counts[:3].max(), counts[6:].max()
    valley = counts[3:6].max()
    assert valley < 0.1 * min(short_peak, long_peak)
    assert long_peak > 0.1 * short_peak


def test_unknown_workload_and_tiny_vocab_are_rejected():
    with pytest.raises(ValueError, match="workload 'zipf'"):
        make_workload("zipf", 4, 8, 8, 512, seed=0)
    with pytest.raises(ValueError, match="vocab_size"):
        make_workload("uniform", 4, 8, 8, TOKEN_ID_LOW, seed=0)


def test_qwen_presets_have_the_released_shapes():
    on_meta = {}
    for name in ("0.5b", "1.5b", "7b"):
        cfg = preset_config(name)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
        on_meta[name] = sum(p.numel() for p in model.parameters()) / 1e9
    # parameter counts of Qwen2.5-0.5B / 1.5B / 7B as published
    assert on_meta["0.5b"] == pytest.approx(0.494, abs=0.01)
    assert on_meta["1.5b"] == pytest.approx(1.544, abs=0.01)
    assert on_meta["7b"] == pytest.approx(7.616, abs=0.01)
    assert {PRESETS[n]["vocab_size"] for n in ("0.5b", "1.5b")} == {151936}


def test_build_models_tiny_is_seeded_eval_and_reward_has_one_label():
    actor, reward = build_models("tiny", torch.float32, "cpu", seed=0)
    actor2, _ = build_models("tiny", torch.float32, "cpu", seed=0)
    assert not actor.training and not reward.training
    assert reward.config.num_labels == 1 and reward.config.pad_token_id == PAD_TOKEN_ID
    assert actor.config.eos_token_id == EOS_TOKEN_ID
    assert actor.config.hidden_size == reward.config.hidden_size == 64
    for a, b in zip(actor.state_dict().values(), actor2.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    ids = torch.tensor([[20, 21, 22]])
    assert reward(input_ids=ids).logits.shape == (1, 1)


def test_build_models_loads_a_local_checkpoint(tmp_path):
    actor, _ = build_models("tiny", torch.float32, "cpu", seed=0)
    actor.save_pretrained(tmp_path)
    loaded, reward = build_models(str(tmp_path), torch.float32, "cpu", seed=0)
    assert torch.equal(loaded.lm_head.weight, actor.lm_head.weight)
    assert reward.config.num_labels == 1 and reward.config.pad_token_id is not None


def test_unknown_preset_names_the_choices():
    with pytest.raises(ValueError, match="tiny"):
        build_models("13b", torch.float32, "cpu", seed=0)
