"""Packed (padding-free) PPO updates: sequences of a pack never see each other, packed losses and gradients
equal padded ones, and bad settings are refused when the trainer is built."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import (
    AttentionInterface,
    AttentionMaskInterface,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
)
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from oppo_engine.ppo import PPOConfig, PPOTrainer, core, engine_config_for
from oppo_engine.ppo.batch import canonical_order, collate
from oppo_engine.ppo.packing import pack_logprobs, pack_rows, plan_packs
from oppo_engine.ppo.task import model_config, train_tokenizer

WORDS = "please list three red things thank you the cat sat on a mat dog ran far away home now".split()


def ppo_models(seed: int = 0):
    """A tokenizer and random actor, critic, reference and reward (fp32) on its vocabulary."""
    tokenizer = train_tokenizer([" ".join(WORDS)])
    torch.manual_seed(seed)
    actor = AutoModelForCausalLM.from_config(model_config(tokenizer))
    reference = copy.deepcopy(actor).eval().requires_grad_(False)
    reward = AutoModelForSequenceClassification.from_config(model_config(tokenizer, num_labels=1)).eval()
    critic = copy.deepcopy(reward).train()
    prompts = [tokenizer.encode(" ".join(WORDS[i : i + 1 + i % 5])) for i in range(12)]
    return tokenizer, actor, critic, reference, reward, prompts


def make_trainer(models, **cfg_kwargs) -> PPOTrainer:
    tokenizer, actor, critic, reference, reward, prompts = models
    cfg = PPOConfig(
        **{"batch_size": 8, "minibatch_size": 4, "epochs": 1, "max_new_tokens": 24, "seed": 3, **cfg_kwargs}
    )
    engine_config = engine_config_for(cfg, mode="sequential", max_model_len=64)
    return PPOTrainer(actor, critic, reference, reward, tokenizer, prompts, cfg, engine_config)


def test_packs_hold_every_row_once_within_the_budget():
    lengths = [5, 17, 3, 9, 9, 1, 12, 20]
    packs = plan_packs(lengths, 20)
    assert sorted(i for p in packs for i in p) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in p) <= 20 for p in packs)
    assert packs == [[7], [1, 2], [6, 0, 5], [3, 4]]  # first-fit decreasing: 20 | 17+3 | 12+5+1 | 9+9
    with pytest.raises(ValueError, match="max_tokens_per_microbatch=16"):
        plan_packs(lengths, 16)


def test_changing_one_sequence_leaves_the_others_logits_in_the_pack_bitwise_equal():
    _, actor, *_ = ppo_models()
    g = torch.Generator().manual_seed(0)
    lengths = [7, 11, 5]
    vocab = actor.config.vocab_size
    rows = torch.randint(3, vocab, (3, max(lengths)), generator=g)
    changed = rows.clone()
    changed[1] = torch.randint(3, vocab, (max(lengths),), generator=g)
    with torch.no_grad():
        logits = []
        for ids in (rows, changed):
            pack = pack_rows(ids, lengths)
            logits.append(
                actor(input_ids=pack.input_ids, position_ids=pack.position_ids, use_cache=False).logits
            )
    starts = [0, 7, 18]
    for k in (0, 2):
        span = slice(starts[k], starts[k] + lengths[k])
        assert torch.equal(logits[0][0, span], logits[1][0, span])
    middle = slice(starts[1], starts[1] + lengths[1])
    assert not torch.equal(logits[0][0, middle], logits[1][0, middle])
    # And each sequence's packed log-probs are its own forward's (positions restart at every sequence).
    with torch.no_grad():
        packed = pack_logprobs(actor, pack_rows(rows, lengths), 1.0)
        for k, n in enumerate(lengths):
            alone = actor(input_ids=rows[k : k + 1, :n], use_cache=False).logits[0, :-1].log_softmax(-1)
            expect = alone.gather(-1, rows[k, 1:n, None])[:, 0]
            torch.testing.assert_close(packed[k, : n - 1], expect, rtol=1e-5, atol=1e-6)
            assert (packed[k, n - 1 :] == 0).all()


def test_kept_columns_equal_the_full_log_probs_and_gradients_and_the_rest_are_zero():
    """``keep`` runs the LM head and log-softmax on the kept columns alone (``logits_to_keep``): their
    log-probs and the gradients through them are the full computation's; every other column is 0. Packed
    (temperature 0.7) and padded alike."""
    _, actor, *_ = ppo_models()
    g = torch.Generator().manual_seed(1)
    lengths = [9, 4, 13]
    rows = torch.randint(3, actor.config.vocab_size, (3, max(lengths)), generator=g)
    keep = torch.rand(3, max(lengths) - 1, generator=g) < 0.6
    keep &= torch.arange(max(lengths) - 1)[None] < torch.tensor(lengths)[:, None] - 1
    weights = torch.randn(3, max(lengths) - 1, generator=g)

    def run(kept):
        actor.zero_grad()
        out = pack_logprobs(actor, pack_rows(rows, lengths, kept), 0.7)
        (out * weights * keep).sum().backward()
        return out.detach(), {n: p.grad.clone() for n, p in actor.named_parameters()}

    (full, full_grads), (kept, kept_grads) = run(None), run(keep)
    torch.testing.assert_close(kept[keep], full[keep], rtol=1e-5, atol=1e-6)
    assert (kept[~keep] == 0).all() and (full[~keep] != 0).any()
    for name in full_grads:
        torch.testing.assert_close(kept_grads[name], full_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    padded = core.token_logprobs(actor, rows, None, 0.7, keep=keep).detach()
    torch.testing.assert_close(padded[keep], full[keep], rtol=1e-5, atol=1e-6)
    assert (padded[~keep] == 0).all()


def _record_steps(trainer: PPOTrainer) -> list[dict[str, torch.Tensor]]:
    """Each optimizer step's gradients (actor and critic), recorded instead of applied: the weights stay
    those the rollouts were sampled with, so every minibatch of two trainers compares like with like."""
    steps: list[dict[str, torch.Tensor]] = []

    def record():
        grads = {}
        for role, model in (("actor", trainer.actor), ("critic", trainer.critic)):
            for name, p in model.named_parameters():
                if p.grad is not None:
                    grads[f"{role}.{name}"] = p.grad.clone()
        steps.append(grads)

    trainer.actor_optim.step = record
    trainer.critic_optim.step = lambda: None
    return steps


def assert_same_update(packed, padded, packed_grads, padded_grads) -> None:
    """Two updates of the same rollouts (stats and each optimizer step's recorded gradients) equal to fp32
    rounding: rtol 1e-5 / atol 1e-6, every statistic and every gradient tensor."""
    assert padded.response_len > 5
    for name in ("policy_loss", "value_loss", "clipfrac", "approx_kl", "grad_norm", "kl", "reward"):
        torch.testing.assert_close(getattr(packed, name), getattr(padded, name), rtol=1e-5, atol=1e-6)
    for a, b in zip(packed_grads, padded_grads, strict=True):
        assert a.keys() == b.keys()
        for name in a:
            torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("group_by_length", [False, True])
def test_packed_losses_and_gradients_equal_padded(group_by_length):
    runs = {}
    for budget in (None, 40):  # 40 tokens: several packs per minibatch of 4 rows of up to 30 tokens
        trainer = make_trainer(
            ppo_models(),
            max_tokens_per_microbatch=budget,
            pack_attention="dense" if budget else "auto",  # batched: test_ppo_pack_attention.py
            group_by_length=group_by_length,
            epochs=2,
        )
        grads = _record_steps(trainer)
        stats = trainer.step()
        trainer.close()
        runs[budget] = (stats, grads)
    (padded, padded_grads), (packed, packed_grads) = runs[None], runs[40]
    assert_same_update(packed, padded, packed_grads, padded_grads)
    assert len(packed_grads) == len(padded_grads) == 4
    assert all(len(a) > 10 for a in packed_grads)


class _NoKeepActor(torch.nn.Module):
    """A causal LM whose forward takes no ``logits_to_keep``: every position's logits come back."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)


def test_padded_forwards_run_the_lm_head_on_the_sampled_tokens_only():
    """The padded path's LM head sees only the positions whose log-probs are read (``mask > 0``: not the
    prompts, not the padding); their log-probs are the full computation's, every other column is 0. A model
    whose forward takes no ``logits_to_keep`` gets the same columns from its full logits."""
    trainer = make_trainer(ppo_models())
    rollouts = trainer.engine.step().rollouts
    batch = collate(canonical_order(rollouts), trainer.tokenizer.pad_token_id, "cpu")
    lengths = batch.attention_mask.sum(1)
    rows = torch.arange(len(batch))
    head_rows = []
    hook = trainer.actor.lm_head.register_forward_hook(
        lambda m, i, o: head_rows.append(i[0].shape[:-1].numel())
    )
    with torch.no_grad():
        got, _, width = trainer._forward(batch, rows, lengths, values=False)
    hook.remove()
    sampled = batch.mask[:, : width - 1] > 0
    assert head_rows == [int(sampled.sum())] and sampled.sum() < sampled.numel()
    ids, attention_mask = batch.input_ids[:, :width], batch.attention_mask[:, :width]
    with torch.no_grad():
        full = core.token_logprobs(trainer.actor, ids, attention_mask, trainer.config.temperature)
        other = core.token_logprobs(_NoKeepActor(trainer.actor), ids, attention_mask, 0.7, keep=sampled)
        full_07 = core.token_logprobs(trainer.actor, ids, attention_mask, 0.7)
    torch.testing.assert_close(got[sampled], full[sampled], rtol=1e-5, atol=1e-6)
    assert (got[~sampled] == 0).all() and (full[~sampled] != 0).any()
    assert torch.equal(other[sampled], full_07[sampled]) and (other[~sampled] == 0).all()
    trainer.close()


def _leaky_attention(module, query, key, value, attention_mask, **kwargs):
    """sdpa that ignores the mask it is given (causal over the whole row): packed sequences see each other."""
    return sdpa_attention_forward(module, query, key, value, None, **{**kwargs, "is_causal": True})


def test_bad_packing_settings_are_refused_at_build():
    models = ppo_models()
    longest = max(map(len, models[-1]))
    with pytest.raises(ValueError, match=r"max_tokens_per_microbatch=20 is smaller than the longest prompt"):
        make_trainer(models, max_tokens_per_microbatch=20)
    make_trainer(models, max_tokens_per_microbatch=longest + 24).close()  # exactly the longest: accepted
    with pytest.raises(ValueError, match="max_tokens_per_microbatch"):
        PPOConfig(max_tokens_per_microbatch=1)
    AttentionInterface.register("leaky_sdpa", _leaky_attention)
    AttentionMaskInterface.register("leaky_sdpa", sdpa_mask)
    tokenizer, actor, critic, reference, reward, prompts = ppo_models()
    actor.set_attn_implementation("leaky_sdpa")
    with pytest.raises(ValueError, match="the actor's attention crosses the boundary"):
        make_trainer((tokenizer, actor, critic, reference, reward, prompts), max_tokens_per_microbatch=64)
    actor.set_attn_implementation("sdpa")
    critic.set_attn_implementation("leaky_sdpa")
    with pytest.raises(ValueError, match="the critic's attention crosses the boundary"):
        make_trainer((tokenizer, actor, critic, reference, reward, prompts), max_tokens_per_microbatch=64)


@pytest.mark.parametrize("probe", ["check_packing", "check_batched_packing"])
def test_a_probe_that_fails_at_build_closes_the_engine(monkeypatch, probe: str):
    """A packing probe that fails rather than refuses (an error other than ValueError) raises as itself,
    and the engine the trainer built is closed (it was left running: only a refusal closed it)."""
    from oppo_engine import engine as engine_module
    from oppo_engine.ppo import trainer as trainer_module

    def crash(*args, **kwargs):
        raise RuntimeError("the probe crashed")

    closed = []
    real_close = engine_module.RolloutEngine.close

    def close(self):
        closed.append(self)
        real_close(self)

    monkeypatch.setattr(trainer_module, probe, crash)
    monkeypatch.setattr(engine_module.RolloutEngine, "close", close)
    pack_attention = "dense" if probe == "check_packing" else "batched"
    with pytest.raises(RuntimeError, match="the probe crashed"):
        make_trainer(ppo_models(), max_tokens_per_microbatch=64, pack_attention=pack_attention)
    assert len(closed) == 1 and closed[0]._closed


@pytest.mark.parametrize("budget", [None, 64])
def test_one_lora_ppo_step_trains_the_adapters_and_the_value_head(budget):
    """PEFT-wrapped actor and critic (LoRA): the trainer's forwards unwrap them as the engine does; the
    adapters and the critic's score head (``modules_to_save``) train, the base weights stay."""
    from peft import LoraConfig, get_peft_model

    tokenizer, actor, critic, reference, reward, prompts = ppo_models()
    lora = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    actor = get_peft_model(actor, LoraConfig(task_type="CAUSAL_LM", **lora))
    critic = get_peft_model(critic, LoraConfig(task_type="SEQ_CLS", **lora))
    trained = {
        role: {n: p.detach().clone() for n, p in model.named_parameters()}
        for role, model in (("actor", actor), ("critic", critic))
    }
    trainer = make_trainer(
        (tokenizer, actor, critic, reference, reward, prompts), max_tokens_per_microbatch=budget
    )
    stats = trainer.step()
    trainer.close()
    assert math.isfinite(stats.policy_loss) and stats.agreement["fresh"].max_abs < 1e-4
    for role, model in (("actor", actor), ("critic", critic)):
        for name, p in model.named_parameters():
            moved = not torch.equal(p, trained[role][name])
            assert moved == p.requires_grad, (role, name)
    heads = [n for n, p in critic.named_parameters() if p.requires_grad and "score" in n]
    assert heads and all("modules_to_save" in n for n in heads)  # the trainable copy of the head moved
    assert any("lora_" in n for n, p in critic.named_parameters() if p.requires_grad)


def test_multi_turn_episodes_need_a_budget_of_max_model_len_and_train_packed():
    """An episode can grow to ``max_model_len`` (observations included): a smaller budget is refused; a
    packed multi-turn step trains (observation tokens masked as in the padded path)."""
    from engine_models import make_actor, make_reward, random_prompts
    from envs import EnvLog, scripted
    from test_multiturn_ppo import _Tokenizer

    from oppo_engine import EngineConfig

    def build(budget):
        cfg = PPOConfig(batch_size=4, minibatch_size=2, max_new_tokens=24, max_tokens_per_microbatch=budget)
        return PPOTrainer(
            make_actor(), make_reward(seed=3), make_actor(seed=1), make_reward(seed=4), _Tokenizer(),
            random_prompts(8, seed=30), cfg,
            EngineConfig(batch_size=4, mode="sequential", max_model_len=128, page_size=8),
            env=scripted(EnvLog()), turn_stop_token_ids=(9,), max_turn_tokens=6, max_turns=3,
        )  # fmt: skip

    with pytest.raises(ValueError, match=r"max_tokens_per_microbatch=64 is smaller than max_model_len=128"):
        build(64)
    trainer = build(128)
    stats = trainer.step()
    trainer.close()
    assert any(0 in r.action_mask for r in stats.rollout.rollouts)
    assert math.isfinite(stats.policy_loss) and stats.agreement["fresh"].max_abs < 1e-4
