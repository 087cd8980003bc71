"""Where a response ends: EOS resolved from the actor's configs (or given; ``()`` never stops), stop tokens,
``ignore_eos``, and ``Rollout.finish_reason``. Sampling is keyed by seed and position, so a run with a stop
token must return exactly the unstopped run's tokens up to and including it."""

from __future__ import annotations

import warnings

import pytest
import torch
from engine_models import EOS, actor_config, make_actor, random_prompts
from transformers import AutoModelForCausalLM, GenerationConfig

from oppo_engine import EngineConfig, RolloutEngine, SamplingParams

MAX_NEW = 24


@pytest.fixture(scope="module")
def actor():
    return make_actor()


def run(actor, prompts, *, mode="sequential", max_model_len=64, **sampling_and_engine):
    engine_kw = {k: sampling_and_engine.pop(k) for k in ("eos_token_id",) if k in sampling_and_engine}
    sampling = SamplingParams(
        **{"temperature": 1.0, "max_new_tokens": MAX_NEW, "seed": 3, **sampling_and_engine}
    )
    engine = RolloutEngine(
        actor=actor,
        reward=lambda p, r: 0.0,
        config=EngineConfig(batch_size=len(prompts), mode=mode, max_model_len=max_model_len, page_size=8),
        sampling=sampling,
        **engine_kw,
    )
    engine.add_prompts(prompts)
    rollouts = sorted(engine.step().rollouts, key=lambda r: r.group_id)
    engine.close()
    return rollouts


def test_eos_defaults_to_the_actors_config(actor):
    engine = RolloutEngine(
        actor=actor, reward=lambda p, r: 0.0, config=EngineConfig(batch_size=1, max_model_len=64)
    )
    assert engine.eos_token_ids == (EOS,)


def test_eos_is_the_union_of_generation_config_and_config_ids():
    actor = AutoModelForCausalLM.from_config(actor_config(eos_token_id=EOS), dtype=torch.float32)
    actor.generation_config = GenerationConfig(eos_token_id=[7, 9])  # Llama 3 lists several
    engine = RolloutEngine(
        actor=actor, reward=lambda p, r: 0.0, config=EngineConfig(batch_size=1, max_model_len=64)
    )
    assert engine.eos_token_ids == (EOS, 7, 9)


def test_no_eos_anywhere_warns_once_and_runs_to_max_new_tokens():
    actor = AutoModelForCausalLM.from_config(actor_config(eos_token_id=None), dtype=torch.float32)
    actor.generation_config = GenerationConfig()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = RolloutEngine(
            actor=actor, reward=lambda p, r: 0.0, config=EngineConfig(batch_size=1, max_model_len=64)
        )
    assert engine.eos_token_ids == ()
    assert [str(w.message) for w in caught if "list no EOS id" in str(w.message)] != []
    assert len([w for w in caught if "list no EOS id" in str(w.message)]) == 1


def test_eos_finishes_with_reason_eos_and_empty_tuple_never_stops(actor):
    prompts = random_prompts(16, seed=11)
    default = run(actor, prompts)  # eos_token_id=None: the config's EOS
    never = run(actor, prompts, eos_token_id=())
    stopped = [r for r in default if r.finish_reason == "eos"]
    assert stopped, "precondition: some response samples EOS"
    for r in stopped:
        assert r.response_ids[-1] == EOS and EOS not in r.response_ids[:-1]  # kept, as RL trains on it
    for r in default:
        if r.finish_reason == "length":
            assert len(r.response_ids) == MAX_NEW and EOS not in r.response_ids
    for a, b in zip(default, never, strict=True):
        assert len(b.response_ids) == MAX_NEW and b.finish_reason == "length"
        assert b.response_ids[: len(a.response_ids)] == a.response_ids  # same draws, just not stopped


def test_stop_token_ends_the_response_keeping_it_and_ignore_eos_does_not_ignore_it(actor):
    prompts = random_prompts(8, seed=12)
    free = run(actor, prompts, eos_token_id=())
    # For each response, a token from its middle that did not occur before: stopping at it must cut there.
    stops = {}
    for r in free:
        for i, t in enumerate(r.response_ids[2:], start=2):
            if t not in r.response_ids[:i]:
                stops[r.group_id] = (t, i)
                break
    stop_ids = tuple(sorted({t for t, _ in stops.values()}))
    for ignore_eos in (False, True):
        got = run(actor, prompts, eos_token_id=(), stop_token_ids=stop_ids, ignore_eos=ignore_eos)
        for a, b in zip(free, got, strict=True):
            cut = next((i for i, t in enumerate(a.response_ids) if t in stop_ids), None)
            assert cut is not None
            assert b.response_ids == a.response_ids[: cut + 1]
            assert b.logprobs == a.logprobs[: cut + 1]
            assert b.finish_reason == "stop"


def test_ignore_eos_generates_max_new_tokens_through_eos(actor):
    prompts = random_prompts(16, seed=11)
    eos_run = run(actor, prompts)
    assert any(r.finish_reason == "eos" for r in eos_run)
    ignored = run(actor, prompts, ignore_eos=True)
    assert all(len(r.response_ids) == MAX_NEW and r.finish_reason == "length" for r in ignored)


def test_eos_as_the_last_allowed_token_is_reason_eos(actor):
    prompts = random_prompts(16, seed=11)
    ended = [r for r in run(actor, prompts) if r.finish_reason == "eos"]
    target = ended[0]
    again = run(actor, prompts, max_new_tokens=len(target.response_ids))
    same = next(r for r in again if r.group_id == target.group_id)
    assert same.response_ids == target.response_ids and same.finish_reason == "eos"


def test_max_model_len_is_its_own_reason(actor):
    prompts = [p[:4] + [5] * (12 - len(p[:4])) for p in random_prompts(2, seed=1)]  # 12 tokens each
    rollouts = run(actor, prompts, eos_token_id=(), max_model_len=20)
    assert all(len(r.response_ids) == 8 and r.finish_reason == "max_model_len" for r in rollouts)


@pytest.mark.parametrize("mode", ["inter", "oppo"])
def test_finish_reasons_of_carried_rollouts_survive_a_checkpoint(actor, mode):
    def engine():
        return RolloutEngine(
            actor=actor, reward=lambda p, r: 0.0, eos_token_id=(),
            sampling=SamplingParams(max_new_tokens=100),
            config=EngineConfig(batch_size=2, mode=mode, overcommit=2, max_model_len=32, page_size=8,
                                **({"chunk_size": 2} if mode == "oppo" else {})),
        )  # fmt: skip

    # Prompts of 28 tokens: all four in flight end together at max_model_len; two are carried finished.
    first = engine()
    first.add_prompts([[4 + (i * 7 + k) % 100 for k in range(28)] for i in range(8)])
    assert [r.finish_reason for r in first.step().rollouts] == ["max_model_len"] * 2
    restored = engine()
    restored.load_state_dict(first.state_dict())
    rollouts = []
    while (result := restored.step()).rollouts:
        rollouts += result.rollouts
    assert len(rollouts) == 6
    assert [r.finish_reason for r in rollouts] == ["max_model_len"] * 6


@pytest.mark.parametrize("bad", [(-1,), ("a",), (True,), 5, "7"])
def test_bad_stop_token_ids_are_refused(bad):
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=bad)


def test_stop_token_ids_are_kept_as_a_tuple():
    assert SamplingParams(stop_token_ids=[4, 5]).stop_token_ids == (4, 5)
