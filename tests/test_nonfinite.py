"""Non-finite numbers never pass silently: the PPO trainer refuses a non-finite loss or gradient norm before
the optimizer step."""

from __future__ import annotations

import math

import pytest
import torch
from test_ppo_packing import make_trainer, ppo_models

from oppo_engine.ppo.batch import canonical_order, collate


def _weights(trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for m in (trainer.actor, trainer.critic) for p in m.parameters()]


@pytest.mark.parametrize("on_nonfinite", ["raise", "skip"])
def test_a_nan_loss_never_reaches_the_weights(on_nonfinite, caplog):
    trainer = make_trainer(ppo_models(), on_nonfinite=on_nonfinite, max_tokens_per_microbatch=64)
    batch = collate(canonical_order(trainer.engine.step().rollouts), trainer.tokenizer.pad_token_id, "cpu")
    batch.scores[0] = math.nan  # one row's reward: whitening spreads NaN over every advantage
    before = _weights(trainer)
    if on_nonfinite == "raise":
        with pytest.raises(
            RuntimeError, match="loss or gradient norm is not finite.*optimizer step is refused"
        ):
            trainer._update(batch)
    else:
        stats = trainer._update(batch)
        assert stats["skipped_minibatches"] == 2  # both minibatches of the one epoch
        assert math.isnan(stats["policy_loss"]) and math.isnan(stats["grad_norm"])
        assert "skipped (on_nonfinite='skip')" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(trainer), strict=True))
    assert all(p.grad is None for m in (trainer.actor, trainer.critic) for p in m.parameters())
    # A finite batch afterwards trains as usual.
    batch.scores[0] = 0.0
    assert trainer._update(batch)["skipped_minibatches"] == 0
    assert not all(torch.equal(a, b) for a, b in zip(before, _weights(trainer), strict=True))
    trainer.close()
