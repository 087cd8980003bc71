"""The clients of multi-turn episodes train only on sampled tokens: PPO's losses and KL mask observation
tokens out exactly (zero gradient, nothing read at their columns), GAE carries across them, and the
PPOTrainer runs episodes end to end."""

from __future__ import annotations

import copy
import dataclasses
import math

import torch
from engine_models import EOS, VOCAB, make_actor, make_reward, random_prompts
from envs import EnvLog, scripted

from oppo_engine import EngineConfig, Rollout
from oppo_engine.ppo import PPOConfig, PPOTrainer, core
from oppo_engine.ppo.batch import collate


class _Tokenizer:
    """What PPOTrainer reads of a tokenizer (the models here are built from configs, with no vocabulary)."""

    eos_token_id, pad_token_id = EOS, 0

    def __len__(self) -> int:
        return VOCAB


def _rollout(prompt: list[int], spans: list[tuple[int, int, int]], seed: int) -> Rollout:
    """A rollout whose response is turns and observations: ``spans`` of (length, is_action, _)."""
    g = torch.Generator().manual_seed(seed)
    response, mask = [], []
    for length, action, _ in spans:
        response += torch.randint(4, VOCAB, (length,), generator=g).tolist()
        mask += [int(action)] * length
    n = len(response)
    rand = lambda: (torch.randn(n, generator=g) * 0.3).tolist()  # noqa: E731
    logprobs = [lp if m else 0.0 for lp, m in zip(rand(), mask, strict=True)]
    return Rollout(
        prompt_ids=prompt, response_ids=response, logprobs=logprobs,
        reward=float(torch.randn(1, generator=g)), policy_versions=[0 if m else -1 for m in mask],
        deferred_steps=0, ref_logprobs=rand(), values=rand(), action_mask=mask,
    )  # fmt: skip


def _batch():
    rollouts = [
        _rollout([5, 6, 7], [(4, 1, 0), (3, 0, 0), (5, 1, 0), (2, 0, 0)], seed=1),
        _rollout([8, 9], [(6, 1, 0), (4, 0, 0), (2, 1, 0)], seed=2),
    ]
    return rollouts, collate(rollouts, pad_token_id=0, device="cpu")


def test_collate_masks_observation_columns():
    rollouts, batch = _batch()
    for i, r in enumerate(rollouts):
        p = len(r.prompt_ids)
        cols = batch.mask[i, p - 1 : p - 1 + len(r.response_ids)]
        assert cols.tolist() == [float(m) for m in r.action_mask]
    assert batch.mask.sum() == sum(sum(r.action_mask) for r in rollouts)


def test_gae_carries_across_observations_as_over_the_sampled_tokens_alone():
    rollouts, batch = _batch()
    rewards, _ = core.kl_penalized_rewards(batch.scores, batch.logprobs, batch.ref_logprobs, batch.mask, 0.1)
    adv, ret = core.gae(rewards, batch.values, batch.mask, gamma=0.99, lam=0.9)
    for i in range(len(rollouts)):
        cols = batch.mask[i].nonzero().flatten()
        # GAE over the sampled columns only, as one contiguous episode.
        r, v = rewards[i, cols][None], batch.values[i, cols][None]
        dense_adv, dense_ret = core.gae(r, v, torch.ones_like(r), gamma=0.99, lam=0.9)
        torch.testing.assert_close(adv[i, cols], dense_adv[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(ret[i, cols], dense_ret[0], rtol=0, atol=1e-6)
        assert adv[i][batch.mask[i] == 0].abs().sum() == 0


def test_nothing_at_an_observation_column_reaches_the_advantages():
    rollouts, batch = _batch()
    poisoned = dataclasses.replace(batch)
    hole = batch.mask == 0
    for name in ("logprobs", "ref_logprobs", "values"):
        setattr(poisoned, name, getattr(batch, name).masked_fill(hole, 1e6))
    outs = []
    for b in (batch, poisoned):
        rewards, kl = core.kl_penalized_rewards(b.scores, b.logprobs, b.ref_logprobs, b.mask, 0.1)
        outs.append((core.gae(rewards, b.values, b.mask, 1.0, 0.95), kl))
    (adv, ret), kl = outs[0]
    (adv2, ret2), kl2 = outs[1]
    assert torch.equal(adv, adv2) and torch.equal(ret, ret2) and torch.equal(kl, kl2)


def test_a_masked_token_contributes_exactly_zero_gradient():
    _, batch = _batch()
    mask = batch.mask
    new_logprobs = (batch.logprobs + 0.05 * torch.randn_like(batch.logprobs)).requires_grad_(True)
    new_values = (batch.values + 0.05 * torch.randn_like(batch.values)).requires_grad_(True)
    rewards, _ = core.kl_penalized_rewards(batch.scores, batch.logprobs, batch.ref_logprobs, mask, 0.1)
    adv, ret = core.gae(rewards, batch.values, mask, 1.0, 0.95)
    adv = core.masked_whiten(adv, mask)
    pg, _, _ = core.policy_loss(new_logprobs, batch.logprobs, adv, mask, 0.2)
    vf = core.value_loss(new_values, batch.values, ret, mask, 0.2)
    (pg + 0.1 * vf).backward()
    hole = mask == 0
    assert (
        torch.count_nonzero(new_logprobs.grad[hole]) == 0 and torch.count_nonzero(new_values.grad[hole]) == 0
    )
    assert (
        torch.count_nonzero(new_logprobs.grad[~hole]) > 0 and torch.count_nonzero(new_values.grad[~hole]) > 0
    )


def test_the_ppo_update_ignores_what_rollouts_carry_at_observation_tokens():
    """End to end through the trainer's update: rollouts whose observation entries (log-probs, reference
    log-probs, values) are garbage train the actor and critic to the very same weights."""
    actor, critic = make_actor(), make_reward(seed=3)
    weights = []
    rollouts, _ = _batch()
    for poison in (False, True):
        torch.manual_seed(0)
        trainer = PPOTrainer(
            copy.deepcopy(actor), copy.deepcopy(critic), make_actor(seed=1), lambda p, r: 0.0, _Tokenizer(),
            [[5, 6, 7]], PPOConfig(batch_size=2, minibatch_size=1, max_new_tokens=8),
            EngineConfig(batch_size=2, mode="sequential", max_model_len=64, page_size=8),
        )  # fmt: skip
        batch = [copy.deepcopy(r) for r in rollouts]
        if poison:
            for r in batch:
                for i, m in enumerate(r.action_mask):
                    if not m:
                        r.ref_logprobs[i], r.values[i], r.logprobs[i] = 1e3, -1e3, 7.0
        trainer._update(collate(batch, 0, "cpu"))
        weights.append(
            [p.detach().clone() for p in (*trainer.actor.parameters(), *trainer.critic.parameters())]
        )
        trainer.close()
    assert all(torch.equal(a, b) for a, b in zip(*weights, strict=True))


def test_ppo_trainer_trains_on_multi_turn_episodes():
    log = EnvLog()
    trainer = PPOTrainer(
        make_actor(), make_reward(seed=3), make_actor(seed=1), make_reward(seed=4), _Tokenizer(),
        random_prompts(8, seed=30), PPOConfig(batch_size=4, minibatch_size=2, max_new_tokens=24),
        EngineConfig(batch_size=4, mode="oppo", overcommit=2, chunk_size=4, max_model_len=128, page_size=8),
        env=scripted(log), turn_stop_token_ids=(9,), max_turn_tokens=6, max_turns=3,
    )  # fmt: skip
    stats = trainer.train(2)
    trainer.close()
    assert log.steps and all(math.isfinite(s.policy_loss) and math.isfinite(s.value_loss) for s in stats)
    rollouts = [r for s in stats for r in s.rollout.rollouts]
    assert any(0 in r.action_mask for r in rollouts)
    # response_len counts the sampled tokens the update trained on
    assert stats[0].response_len == sum(sum(r.action_mask) for r in stats[0].rollout.rollouts) / 4
