"""The update's shared prompt prefix (``PPOConfig.share_prefix``, ``ppo/prefix.py``): a minibatch's common
prefix computed once over the KV cache gives the padded forward's losses and gradients to fp32 rounding,
is capped below the first sampled token, and is refused by name where a model cannot run it."""

from __future__ import annotations

import pytest
import torch
from test_ppo_packing import WORDS, _record_steps, make_trainer, ppo_models
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from oppo_engine.ppo import PPOConfig, prefix
from oppo_engine.ppo.task import model_config

PREAMBLE = "the cat sat on a mat the dog ran far away home now please list three red things thank you".split()


def prefixed_models(seed: int = 0):
    """``ppo_models`` whose prompts all begin with the same 20-odd token preamble (a system prompt)."""
    tokenizer, actor, critic, reference, reward, _ = ppo_models(seed)
    prompts = [tokenizer.encode(" ".join(PREAMBLE + WORDS[i : i + 1 + i % 5])) for i in range(12)]
    return tokenizer, actor, critic, reference, reward, prompts


def test_shared_prefix_is_the_common_columns_capped_below_the_first_sampled_token():
    ids = torch.tensor([[5] * 20 + [1, 2, 3], [5] * 20 + [1, 9, 9], [5] * 18 + [7, 7, 7, 7, 7]])
    keep = torch.zeros(3, 22, dtype=torch.bool)
    assert prefix.shared_prefix(ids, keep) == 18  # the third row differs at column 18
    assert prefix.shared_prefix(ids[:2], keep[:2]) == 21  # up to w - 2: one column of each row stays
    keep[1, 17] = True  # row 1 needs the log-prob of token 18: the prefix stops before column 17
    assert prefix.shared_prefix(ids[:2], keep[:2]) == 17
    assert prefix.shared_prefix(ids[:2], keep[:2], min_prefix=18) == 0  # too short to be worth it
    assert prefix.shared_prefix(ids[:1], keep[:1]) == 0  # one row: nothing to share
    assert prefix.shared_prefix(ids[:2], keep[:2], lengths=torch.tensor([23, 19])) == 17  # within each row
    assert prefix.shared_prefix(ids[:2], keep[:2], lengths=torch.tensor([23, 17])) == 16
    assert prefix.shared_prefix(torch.tensor([[5] * 20, [6] + [5] * 19]), torch.zeros(2, 19, dtype=bool)) == 0


@pytest.mark.parametrize("group_by_length", [False, True])
def test_shared_prefix_losses_and_gradients_equal_padded(group_by_length, monkeypatch):
    calls = []
    for name in ("prefix_logprobs", "prefix_values"):
        real = getattr(prefix, name)
        monkeypatch.setattr(prefix, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    runs = {}
    for share in (False, True):
        calls.clear()
        trainer = make_trainer(
            prefixed_models(), share_prefix=share, group_by_length=group_by_length, epochs=2
        )
        assert trainer._share_prefix is share
        grads = _record_steps(trainer)
        stats = trainer.step()
        trainer.close()
        runs[share] = (stats, grads, len(calls))
    (padded, padded_grads, none), (shared, shared_grads, used) = runs[False], runs[True]
    assert none == 0 and used >= 8  # the prefix path ran: every minibatch's actor and critic (2 epochs)
    assert padded.response_len > 5
    for name in ("policy_loss", "value_loss", "clipfrac", "approx_kl", "grad_norm", "kl", "reward"):
        torch.testing.assert_close(getattr(shared, name), getattr(padded, name), rtol=1e-5, atol=1e-6)
    assert shared.agreement["fresh"].mean_abs == pytest.approx(
        padded.agreement["fresh"].mean_abs, rel=1e-4, abs=1e-7
    )
    assert len(shared_grads) == len(padded_grads) == 4
    for a, b in zip(shared_grads, padded_grads, strict=True):
        assert a.keys() == b.keys() and len(a) > 10
        for name in a:
            torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)


def _forgetful_attention(module, query, key, value, attention_mask, **kwargs):
    """sdpa over the new positions' keys only: the cache handed to the forward is ignored."""
    q = query.shape[2]
    mask = attention_mask[..., -q:] if attention_mask is not None else None
    return sdpa_attention_forward(module, query, key[:, :, -q:], value[:, :, -q:], mask, **kwargs)


def test_auto_shares_where_the_probe_passes_and_true_refuses_by_name_where_it_cannot():
    trainer = make_trainer(prefixed_models())  # "auto", the default
    assert trainer._share_prefix
    trainer.close()
    AttentionInterface.register("forgetful_sdpa", _forgetful_attention)
    AttentionMaskInterface.register("forgetful_sdpa", sdpa_mask)
    for role in ("actor", "critic"):
        models = prefixed_models()
        models[1 if role == "actor" else 2].set_attn_implementation("forgetful_sdpa")
        trainer = make_trainer(models)
        assert not trainer._share_prefix  # "auto": the padded forward, exactly as before
        trainer.close()
        with pytest.raises(ValueError, match=rf"share_prefix=True: the {role} \(\w+\) differs over a cache"):
            make_trainer(models, share_prefix=True)


def test_a_model_with_no_backbone_to_hand_a_cache_to_is_not_shared():
    class Opaque(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)

    _, actor, *_ = ppo_models()
    assert prefix.can_share(actor)
    assert not prefix.can_share(Opaque(actor))
    reason = prefix.check_prefix(Opaque(actor), "actor", [1, 2, 3], None)
    assert "takes no KV cache, is sharded, or has a sliding window" in reason


def test_bad_share_prefix_settings_are_refused():
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="share_prefix must be True, False or 'auto'"):
            PPOConfig(share_prefix=bad)
    with pytest.raises(ValueError, match="with max_tokens_per_microbatch the update runs on packs"):
        PPOConfig(share_prefix=True, max_tokens_per_microbatch=256)


def test_sliding_window_models_are_not_shared():
    from transformers import AutoModelForCausalLM

    tokenizer, actor, *_ = ppo_models()
    config = model_config(tokenizer).to_dict()
    del config["layer_types"]  # derived from the window settings when the config is made
    config.update(use_sliding_window=True, sliding_window=8, max_window_layers=0)
    windowed = AutoModelForCausalLM.from_config(type(actor.config)(**config))
    assert any("sliding" in t for t in windowed.config.layer_types)
    assert prefix.can_share(actor) and not prefix.can_share(windowed)


def test_one_lora_ppo_step_over_a_shared_prefix_equals_the_padded_one():
    """PEFT-wrapped actor and critic (LoRA): the prefix path unwraps them as the padded one does."""
    from peft import LoraConfig, get_peft_model

    lora = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    runs = {}
    for share in (False, True):
        tokenizer, actor, critic, reference, reward, prompts = prefixed_models()
        actor = get_peft_model(actor, LoraConfig(task_type="CAUSAL_LM", **lora))
        critic = get_peft_model(critic, LoraConfig(task_type="SEQ_CLS", **lora))
        trainer = make_trainer((tokenizer, actor, critic, reference, reward, prompts), share_prefix=share)
        assert trainer._share_prefix is share
        grads = _record_steps(trainer)
        runs[share] = (trainer.step(), grads)
        trainer.close()
    (padded, padded_grads), (shared, shared_grads) = runs[False], runs[True]
    for name in ("policy_loss", "value_loss", "grad_norm"):
        torch.testing.assert_close(getattr(shared, name), getattr(padded, name), rtol=1e-5, atol=1e-6)
    for a, b in zip(shared_grads, padded_grads, strict=True):
        assert a.keys() == b.keys() and any("lora_" in n for n in a)
        for name in a:
            torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)


def test_dropout_or_activation_checkpointing_turn_sharing_off():
    """Dropout would draw one mask over the prefix for every row (the padded forward draws one per row), and
    activation checkpointing drops the KV cache in training: neither model is shared, at build or (turned on
    after the build) at the forward, where the padded path runs instead."""
    models = prefixed_models()
    models[1].config.attention_dropout = 0.1
    assert not prefix.can_share(models[1])
    trainer = make_trainer(models)
    assert not trainer._share_prefix
    trainer.close()
    with pytest.raises(ValueError, match="dropout or activation checkpointing"):
        make_trainer(models, share_prefix=True)

    models = prefixed_models()
    models[2].gradient_checkpointing_enable()
    assert not prefix.can_share(models[2])
    make_trainer(models).close()

    trainer = make_trainer(prefixed_models())
    assert trainer._share_prefix
    trainer.actor.gradient_checkpointing_enable()  # after the build
    stats = trainer.step()  # the padded path: no crash, no prefix pass without a cache
    trainer.close()
    assert stats.response_len > 0
