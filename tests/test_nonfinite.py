"""Non-finite numbers never pass silently: the PPO trainer refuses a non-finite loss or gradient norm before
the optimizer step."""

from __future__ import annotations

import math
import re

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


def _engine(actor, reward, critic=None, batch_size=4):
    from engine_models import EOS

    from oppo_engine import EngineConfig, RolloutEngine, SamplingParams

    return RolloutEngine(
        actor=actor,
        reward=reward,
        critic=critic,
        config=EngineConfig(batch_size=batch_size, mode="sequential", max_model_len=64),
        sampling=SamplingParams(max_new_tokens=8, seed=0),
        eos_token_id=EOS,
    )


def test_an_actor_with_one_nan_weight_fails_the_step_naming_the_actor():
    from engine_models import make_actor, make_reward, random_prompts

    from oppo_engine.model.finite import NonFiniteModel

    actor = make_actor()
    with torch.no_grad():
        actor.model.layers[0].mlp.down_proj.weight[0, 0] = math.nan
    engine = _engine(actor, make_reward())
    engine.add_prompts(random_prompts(4, seed=0))
    with pytest.raises(
        NonFiniteModel, match=r"actor: non-finite logits for every one of the 4 sequences.*position"
    ):
        engine.step()
    # Rolled back, nothing leaked; with the weight repaired the same prompts run.
    with torch.no_grad():
        actor.model.layers[0].mlp.down_proj.weight[0, 0] = 0.0
    result = engine.step()
    assert len(result.rollouts) == 4 and not result.failed
    assert all(math.isfinite(lp) for r in result.rollouts for lp in r.logprobs)
    engine.close()


@pytest.mark.parametrize("role", ["reward", "critic"])
def test_a_scorer_nan_for_one_sequence_only_quarantines_its_group(role):
    """A scorer whose embedding of one token is NaN: only the sequence holding that token gets a NaN score
    (or values); its group is quarantined with an error naming the model and position, the others return."""
    from engine_models import make_actor, make_reward, random_prompts

    prompts = random_prompts(4, seed=0)
    clean = _engine(make_actor(), make_reward(), critic=make_reward(2))
    clean.add_prompts(prompts)
    rollouts = clean.step().rollouts
    clean.close()
    others = {t for r in rollouts if r.group_id != 0 for t in r.prompt_ids + r.response_ids}
    poison = next(t for t in prompts[0] if t not in others)  # in prompt 0 only
    scorer = make_reward(1 if role == "reward" else 2)
    with torch.no_grad():
        scorer.model.embed_tokens.weight[poison] = math.nan
    models = (
        dict(reward=scorer, critic=make_reward(2))
        if role == "reward"
        else dict(reward=make_reward(), critic=scorer)
    )
    engine = _engine(make_actor(), **models)
    engine.add_prompts(prompts)
    result = engine.step()
    engine.close()
    assert [r.group_id for r in result.failed] == [0]
    what = "score" if role == "reward" else "values"
    assert result.failed[0].error.startswith(f"{role}: NonFiniteOutput: {role}: non-finite {what}")
    assert re.search(r"first sequence \d+ at position \d+ \(nan\)$", result.failed[0].error)
    assert sorted(r.group_id for r in result.rollouts) == [1, 2, 3]
    assert all(math.isfinite(r.reward) and all(map(math.isfinite, r.values)) for r in result.rollouts)


def test_a_refusal_after_a_stepped_minibatch_still_updates_the_engines_policy():
    """The first minibatch is stepped, the second's loss goes NaN and is refused (raise): the weights moved,
    so the engine's policy version moves too (a shared actor is never sampled under the old version)."""
    trainer = make_trainer(ppo_models(), on_nonfinite="raise", max_tokens_per_microbatch=64)
    refuse, calls = trainer._refuse_nonfinite, []

    def second_goes_nan(shares, actor_norm, critic_norm):
        calls.append(1)
        return refuse(shares * math.nan if len(calls) == 2 else shares, actor_norm, critic_norm)

    trainer._refuse_nonfinite = second_goes_nan
    version = trainer.engine.policy_version
    with pytest.raises(RuntimeError, match="optimizer step is refused"):
        trainer.step()
    assert len(calls) == 2 and trainer.engine.policy_version == version + 1
    trainer.close()
