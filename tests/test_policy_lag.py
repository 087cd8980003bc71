"""On-policy-safe defaults: Δ scales with the batch, no returned token lags more than max_policy_lag policy
versions, a fixed overcommit above B is refused while the lag is bounded, an entirely stale batch warns."""

from __future__ import annotations

import warnings

import pytest
from engine_models import EOS, make_actor, random_prompts

from oppo_engine import EngineConfig, RolloutEngine, SamplingParams
from oppo_engine.control import DeltaControl


@pytest.fixture(scope="module")
def actor():
    return make_actor()


def rule(prompt, response):
    return float(len(response) % 5)


def make_engine(actor, *, batch_size, sampling=None, **cfg) -> RolloutEngine:
    cfg.setdefault("max_model_len", 96)
    cfg.setdefault("page_size", 8)
    return RolloutEngine(
        actor=actor,
        reward=rule,
        config=EngineConfig(batch_size=batch_size, **cfg),
        sampling=sampling or SamplingParams(temperature=1.0, max_new_tokens=40),
        eos_token_id=EOS,
    )


@pytest.mark.parametrize(
    ("batch_size", "group", "init", "max_"),
    [
        (8, 1, 1, 2),
        (2, 1, 1, 1),
        (64, 1, 8, 16),
        (112, 1, 14, 28),
        (64, 4, 8, 16),
        (8, 4, 4, 4),
        (12, 3, 3, 3),
    ],
)
def test_delta_defaults_resolve_to_an_eighth_and_a_quarter_of_the_batch_in_whole_groups(
    batch_size, group, init, max_
):
    resolved = DeltaControl().resolve(batch_size, group)
    assert (resolved.init, resolved.max) == (init, max_)
    assert resolved.init % group == 0 and resolved.max % group == 0


def test_explicit_delta_settings_stay_as_given():
    assert DeltaControl(init=5, max=9).resolve(64) == DeltaControl(init=5, max=9)
    assert DeltaControl(init=0, max=0).resolve(64) == DeltaControl(init=0, max=0)
    # Explicit bounds shape the resolved default: max at least min and the explicit init.
    assert DeltaControl(min=4).resolve(8) == DeltaControl(init=4, min=4, max=4)
    assert DeltaControl(init=30).resolve(64).max == 30


def test_resolved_defaults_are_not_explicit_settings(actor):
    # overcommit fixed: a DeltaControl at its (unresolved) defaults is not "set", so no ValueError.
    EngineConfig(batch_size=8, overcommit=2, delta=DeltaControl())
    engine = make_engine(actor, batch_size=8, mode="inter")
    engine.add_prompts(random_prompts(24, seed=3))
    assert engine.step().metrics.overcommit == 1  # B/8 in flight beyond the batch, not the paper's 16
    assert engine.config.delta == DeltaControl()  # the user's config is not rewritten
    engine.close()


@pytest.mark.parametrize("retained_kv", ["recompute", "reuse"])
@pytest.mark.parametrize(("mode", "lag"), [("inter", 1), ("inter", 2), ("oppo", 2)])
def test_no_returned_token_lags_more_than_max_policy_lag(actor, mode, lag, retained_kv):
    # Δ = B and long-tailed lengths: without the bound, sequences wait up to max_deferrals=4 steps.
    lengths = [2, 40, 3, 40, 2, 3, 40, 2] * 6
    engine = make_engine(
        actor, batch_size=2, mode=mode, overcommit=2, max_policy_lag=lag, retained_kv=retained_kv,
        **({"chunk_size": 4} if mode == "oppo" else {}),
    )  # fmt: skip
    prompts = random_prompts(len(lengths), seed=7)
    engine.add_prompts(prompts, sampling=[SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lengths])
    seen, lags = 0, []
    for _ in range(len(lengths)):
        result = engine.step()
        if not result.rollouts:
            break
        seen += len(result.rollouts)
        lags += [engine.policy_version - v for r in result.rollouts for v in r.policy_versions]
        engine.update_policy()
    assert seen == len(lengths)  # every prompt exactly once
    assert max(lags) == lag  # the bound is reached (deferrals happen) and never passed


def test_without_the_lag_bound_only_max_deferrals_holds(actor):
    lengths = [2, 40, 3, 40, 2, 3, 40, 2] * 6
    engine = make_engine(actor, batch_size=2, mode="inter", overcommit=2, max_policy_lag=None)
    engine.add_prompts(
        random_prompts(len(lengths), seed=7),
        sampling=[SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lengths],
    )
    lags = []
    while (result := engine.step()).rollouts:
        lags += [engine.policy_version - v for r in result.rollouts for v in r.policy_versions]
        engine.update_policy()
    assert max(lags) > 2  # what the default bound prevents


@pytest.mark.parametrize("knob", [dict(overcommit=3), dict(delta=DeltaControl(max=3))])
def test_overcommit_above_batch_size_is_refused_while_the_lag_is_bounded(knob):
    with pytest.raises(ValueError, match="exceeds batch_size=2 while max_policy_lag=2"):
        EngineConfig(batch_size=2, mode="inter", **knob)
    EngineConfig(batch_size=2, mode="inter", max_policy_lag=None, **knob)  # the old behaviour, asked for
    EngineConfig(batch_size=2, mode="inter", overcommit=2)  # Δ = B: every due sequence fits


@pytest.mark.parametrize("lag", [0, -1, 1.5, True, "2"])
def test_max_policy_lag_must_be_an_int_of_at_least_one(lag):
    with pytest.raises(ValueError, match="max_policy_lag must be an int >= 1 or None"):
        EngineConfig(max_policy_lag=lag)


def test_max_policy_lag_set_for_a_mode_without_overcommit_is_refused():
    with pytest.raises(ValueError, match="max_policy_lag=1 is ignored by mode='sequential'"):
        EngineConfig(mode="sequential", max_policy_lag=1)


def test_an_entirely_stale_batch_warns_once(actor):
    # max_new_tokens=1: all B + Δ sequences finish in the first forward; the Δ carried ones return next step,
    # after the update, with every token from the older policy.
    engine = make_engine(actor, batch_size=2, mode="inter", overcommit=2,
                         sampling=SamplingParams(max_new_tokens=1, ignore_eos=True))  # fmt: skip
    engine.add_prompts(random_prompts(12, seed=5))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = engine.step()
        engine.update_policy()
        stale = engine.step()
        engine.update_policy()
        engine.step()
        engine.update_policy()
        engine.step()
    assert first.metrics.stale_tokens == 0
    assert stale.metrics.stale_tokens == sum(len(r.response_ids) for r in stale.rollouts) == 2
    messages = [str(w.message) for w in caught if "sampled by an older policy" in str(w.message)]
    assert len(messages) == 1, messages
