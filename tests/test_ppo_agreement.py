"""The engine-trainer agreement measured every step, and the rollout corrections (TIS, MIS) against losses
computed by hand."""

from __future__ import annotations

import math

import pytest
import torch
from test_ppo_packing import make_trainer, ppo_models
from transformers import AutoModelForCausalLM

from oppo_engine.ppo import PPOConfig
from oppo_engine.ppo.agreement import CLASSES, correction_weights, measure
from oppo_engine.ppo.batch import canonical_order, collate
from oppo_engine.ppo.core import policy_loss


def test_agreement_statistics_by_hand():
    behaviour = torch.zeros(3, 4)
    trainer = torch.tensor([[0.2, -0.09, 0.0, 9.0], [0.05, 0.0, 0.0, 0.0], [-0.3, 0.4, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0]])  # 9.0 sits outside the mask
    stale = torch.zeros(3, 4, dtype=torch.bool)
    stale[2, 1] = True
    carried = torch.tensor([False, False, True])
    gap = measure(trainer, behaviour, mask, stale, carried)
    assert set(gap) == set(CLASSES)
    fresh = gap["fresh"]  # rows 0 and 1: deltas 0.2, -0.09, 0.0, 0.05
    assert (fresh.tokens, fresh.sequences) == (4, 2)
    assert fresh.mean_abs == pytest.approx(0.34 / 4)
    assert fresh.max_abs == pytest.approx(0.2)
    k3 = [math.expm1(d) - d for d in (0.2, -0.09, 0.0, 0.05)]
    assert fresh.mean_k3 == pytest.approx(sum(k3) / 4)
    assert fresh.frac_large == pytest.approx(0.25)  # only 0.2 exceeds 0.1
    assert fresh.seq_sum_std == pytest.approx(0.03)  # sums 0.11 and 0.05
    assert fresh.seq_sum_max_abs == pytest.approx(0.11)
    current, old = gap["carried_current"], gap["stale"]
    assert (current.tokens, current.mean_abs, current.seq_sum_std) == (1, pytest.approx(0.3), 0.0)
    assert (old.tokens, old.max_abs, old.frac_large) == (1, pytest.approx(0.4), 1.0)
    empty = measure(trainer, behaviour, mask, stale, torch.zeros(3, dtype=torch.bool))["carried_current"]
    assert empty.tokens == 0 and math.isnan(empty.mean_abs)


def test_tis_and_mis_losses_by_hand():
    log = math.log
    delta = torch.tensor([[log(3.0), log(0.5), 0.0], [log(1.2), log(1.25), 0.0]])
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]])
    adv = torch.tensor([[1.0, 2.0, 3.0], [-1.0, 4.0, 5.0]])
    logprobs = torch.full((2, 3), -1.0)  # ratio 1: every token's surrogate is -A

    def loss(w):
        return float(policy_loss(logprobs, logprobs, adv, mask, 0.2, weights=w)[0])

    tis = correction_weights(delta, mask, "tis", 2.0, "token")
    torch.testing.assert_close(tis[mask > 0], torch.tensor([2.0, 0.5, 1.0, 1.2, 1.25]))
    assert loss(tis) == pytest.approx(-(2 * 1 + 0.5 * 2 + 3 + 1.2 * -1 + 1.25 * 4) / 5)
    mis = correction_weights(delta, mask, "mis", 2.0, "token")  # 3 leaves [1/2, 2]; 0.5 is on its edge
    torch.testing.assert_close(mis[mask > 0], torch.tensor([0.0, 1.0, 1.0, 1.0, 1.0]))
    assert loss(mis) == pytest.approx(-(2 + 3 - 1 + 4) / 5)  # the denominator keeps the dropped token
    # Sequence level: row 0's ratio is 3 * 0.5 * 1 = 1.5, row 1's 1.2 * 1.25 = 1.5 (its masked 0 not counted).
    seq_tis = correction_weights(delta, mask, "tis", 1.4, "sequence")
    torch.testing.assert_close(seq_tis[mask > 0], torch.full((5,), 1.4))
    assert loss(seq_tis) == pytest.approx(-1.4 * (1 + 2 + 3 - 1 + 4) / 5)
    seq_mis = correction_weights(delta, mask, "mis", 1.4, "sequence")
    assert loss(seq_mis) == 0.0  # both sequences dropped
    assert (correction_weights(delta, mask, "mis", 1.6, "sequence")[mask > 0] == 1).all()
    assert not correction_weights(delta.clone().requires_grad_(), mask, "tis", 2.0, "token").requires_grad


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(rollout_correction="is"), "rollout_correction must be one of"),
        (dict(rollout_correction="tis", rollout_correction_cap=1.0), "rollout_correction_cap must be > 1"),
        (dict(rollout_correction_level="batch"), "rollout_correction_level must be one of"),
        (dict(on_nonfinite="ignore"), "on_nonfinite must be one of"),
    ],
)
def test_bad_correction_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PPOConfig(**kwargs)


@pytest.mark.parametrize("budget", [None, 64])
def test_every_step_measures_the_gap_and_fp32_rollouts_agree(budget):
    """fp32 on the CPU: the engine's log-probs are the trainer's to rounding, on every sampled token."""
    trainer = make_trainer(ppo_models(), max_tokens_per_microbatch=budget)
    stats = trainer.train(2)
    trainer.close()
    for s in stats:
        fresh = s.agreement["fresh"]
        assert fresh.tokens == round(s.response_len * 8)  # every sampled token of the batch
        assert fresh.max_abs < 1e-4 and fresh.mean_k3 < 1e-8 and fresh.frac_large == 0
        assert s.agreement["stale"].tokens == 0 and not s.truncated_sampling
        assert 0 < s.agreement_s < s.update_s


@pytest.mark.parametrize("budget", [None, 64])
def test_an_actor_with_dropout_in_train_mode_is_measured_and_recomputed_in_eval_semantics(budget):
    """Dropout in the actor (``attention_dropout=0.5``; the trainer holds it in ``train()``): the engine
    samples without dropout, and pi_trainer -- the agreement, the stale recompute, the corrections' ratio
    -- is of that same policy, not a dropout-masked draw: deterministic, and fp32 agreement is rounding."""
    tokenizer, actor, critic, reference, reward, prompts = ppo_models()
    config = actor.config
    config.attention_dropout = 0.5
    torch.manual_seed(0)
    actor = AutoModelForCausalLM.from_config(config).train()
    actor.load_state_dict(reference.state_dict())
    trainer = make_trainer(
        (tokenizer, actor, critic, reference, reward, prompts), max_tokens_per_microbatch=budget
    )
    assert actor.training and actor.model.layers[0].self_attn.attention_dropout == 0.5
    stats = trainer.train(1)[0]
    assert stats.agreement["fresh"].max_abs < 1e-4 and actor.training  # measured before any update
    batch = collate(canonical_order(stats.rollout.rollouts), trainer.tokenizer.pad_token_id, "cpu")
    first, second = trainer.trainer_logprobs(batch), trainer.trainer_logprobs(batch)
    assert torch.equal(first, second) and actor.training  # eval semantics, the mode given back
    trainer.close()


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_with_a_correction_the_ratio_is_taken_against_the_trainer_and_stale_tokens_keep_theirs(level):
    trainer = make_trainer(
        ppo_models(), rollout_correction="tis", off_policy="truncated_is", rollout_correction_level=level
    )
    batch = collate(canonical_order(trainer.engine.step().rollouts), trainer.tokenizer.pad_token_id, "cpu")
    with torch.no_grad():
        for p in trainer.actor.parameters():
            p.add_(0.05 * torch.randn_like(p))
    trainer.engine.update_policy()
    half = len(batch) // 2
    batch.versions[:half] = trainer.engine.policy_version  # the first half: current policy
    first = int((batch.mask[0] > 0).nonzero()[0])
    batch.versions[0, first] = trainer.engine.policy_version - 1  # one stale token in a current row
    pi_trainer = trainer.trainer_logprobs(batch)
    old = trainer.old_logprobs(batch, pi_trainer)
    m = batch.mask > 0
    current, stale = m.clone(), m.clone()
    current[half:], stale[:half] = False, False
    current[0, first], stale[0, first] = False, True
    assert torch.equal(old[current], pi_trainer[current])
    assert (old[current] - batch.logprobs[current]).abs().max() > 1e-2  # the perturbation shows
    assert torch.equal(old[stale], batch.logprobs[stale])  # truncated_is: against the behaviour policy
    weights = trainer._correction(batch, pi_trainer, (batch.versions < trainer.engine.policy_version) & m)
    assert (weights[stale] == 1).all() and (weights[current] <= 2).all()
    delta = torch.where(current, pi_trainer - batch.logprobs, 0.0)
    if level == "sequence":  # the row's summed log-ratio, for every token of a current row
        delta = delta.sum(1, keepdim=True).expand_as(delta)
    expected = torch.exp(delta).clamp(max=2.0)
    torch.testing.assert_close(weights[current], expected[current])
    trainer.close()


@pytest.mark.parametrize("correction", ["tis", "mis"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_corrected_steps_train_and_report_their_weight(correction, level):
    trainer = make_trainer(
        ppo_models(),
        rollout_correction=correction,
        rollout_correction_level=level,
        max_tokens_per_microbatch=64,
    )
    stats = trainer.train(2)
    trainer.close()
    for s in stats:
        assert math.isfinite(s.policy_loss) and s.skipped_minibatches == 0
        assert s.rollout_weight == pytest.approx(1.0, abs=1e-3)  # fp32: the ratio is 1 to rounding
