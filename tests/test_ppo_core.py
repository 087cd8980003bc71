"""PPO arithmetic (oppo_engine/ppo/core.py) against straightforward per-sequence references."""

import pytest
import torch

from oppo_engine.ppo import PPOConfig
from oppo_engine.ppo.core import gae, kl_penalized_rewards, masked_whiten, policy_loss, value_loss


def _response_mask(starts, lengths, width):
    mask = torch.zeros(len(starts), width)
    for i, (s, n) in enumerate(zip(starts, lengths, strict=True)):
        mask[i, s : s + n] = 1
    return mask


def test_gae_equals_per_sequence_recursion():
    g = torch.Generator().manual_seed(0)
    starts, lengths, width = [2, 0, 5], [6, 3, 1], 9
    mask = _response_mask(starts, lengths, width)
    rewards = torch.randn(3, width, generator=g) * mask
    values = torch.randn(3, width, generator=g)  # garbage outside the mask must not leak in
    gamma, lam = 0.9, 0.8
    adv, ret = gae(rewards, values, mask, gamma, lam)
    for i, (s, n) in enumerate(zip(starts, lengths, strict=True)):
        r, v = rewards[i, s : s + n].tolist(), values[i, s : s + n].tolist()
        expect, running = [0.0] * n, 0.0
        for t in reversed(range(n)):
            next_v = v[t + 1] if t + 1 < n else 0.0
            running = r[t] + gamma * next_v - v[t] + gamma * lam * running
            expect[t] = running
        torch.testing.assert_close(adv[i, s : s + n], torch.tensor(expect))
        torch.testing.assert_close(ret[i, s : s + n], torch.tensor(expect) + values[i, s : s + n])
    assert (adv * (1 - mask)).abs().max() == 0 and (ret * (1 - mask)).abs().max() == 0


def test_score_lands_on_last_response_token_and_kl_on_every_token():
    mask = _response_mask([1, 3], [3, 2], 6)
    logprobs, ref = torch.full((2, 6), -1.0), torch.full((2, 6), -1.5)
    rewards, kl = kl_penalized_rewards(torch.tensor([2.0, -3.0]), logprobs, ref, mask, kl_coef=0.1)
    assert torch.equal(kl, 0.5 * mask)
    expect = -0.05 * mask
    expect[0, 3] += 2.0
    expect[1, 4] += -3.0
    torch.testing.assert_close(rewards, expect)


def test_whitened_advantages_have_zero_mean_unit_variance_on_the_mask():
    mask = _response_mask([0, 2], [4, 3], 6)
    x = torch.randn(2, 6) * 5 + 3
    w = masked_whiten(x, mask)
    sel = w[mask > 0]
    assert abs(sel.mean().item()) < 1e-5 and abs(sel.var(unbiased=False).item() - 1) < 1e-3
    assert (w[mask == 0] == 0).all()


def test_truncated_importance_weight_bounds_a_stale_tokens_loss():
    mask = torch.ones(1, 1)
    adv = torch.tensor([[-1.0]])
    old = torch.tensor([[-8.0]])  # the behaviour policy made this token very unlikely
    new = torch.tensor([[-1.0]])  # ratio e^7
    plain, _, _ = policy_loss(new, old, adv, mask, clip_range=0.2)
    truncated, _, _ = policy_loss(new, old, adv, mask, clip_range=0.2, truncation=2.0)
    assert plain.item() == pytest.approx(torch.exp(torch.tensor(7.0)).item(), rel=1e-5)
    assert truncated.item() == pytest.approx(2.0)
    # On-policy tokens (ratio near 1) are untouched by the truncation.
    near = torch.tensor([[-7.9]])
    for a in (-1.0, 1.0):
        a = torch.tensor([[a]])
        assert (
            policy_loss(near, old, a, mask, 0.2)[0] == policy_loss(near, old, a, mask, 0.2, truncation=2.0)[0]
        )


def test_clipped_losses_stop_the_gradient_outside_the_trust_region():
    mask = torch.ones(1, 1)
    new = torch.tensor([[0.5]], requires_grad=True)  # ratio e^0.5 > 1.2, positive advantage: clipped
    policy_loss(new, torch.zeros(1, 1), torch.ones(1, 1), mask, 0.2)[0].backward()
    assert new.grad.item() == 0
    v = torch.tensor([[1.0]], requires_grad=True)  # moved 1.0 from old 0.0, further from return -1
    value_loss(v, torch.zeros(1, 1), torch.full((1, 1), -1.0), mask, 0.2).backward()
    assert v.grad.item() == pytest.approx(2.0)  # the unclipped term (larger) carries the gradient


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(batch_size=6, minibatch_size=4),
        dict(epochs=0),
        dict(lr=0.0),
        dict(gamma=1.5),
        dict(off_policy="ignore"),
        dict(is_truncation=0.5),
        dict(kl_coef=-1.0),
    ],
)
def test_ppo_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError, match="PPOConfig"):
        PPOConfig(**kwargs)
