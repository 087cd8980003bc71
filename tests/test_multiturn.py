"""Multi-turn episodes (issue 31): a turn ends, the environment answers on a worker while the others decode,
its observation is appended (never sampled) and the next turn follows.

The environments here are deterministic in what they answer (``tests/envs.py``), with seeded latencies, so
every property is exact: the same transcripts in every mode and across a policy update, the behaviour
log-probs of one HF forward over the final transcript, every sampled token the sampler's draw at its
position in the transcript, nothing lost when an environment fails, hangs, or the step is rolled back.
"""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch
from engine_models import EOS, VOCAB, make_actor, make_reward, random_prompts
from envs import AsyncScriptedEnv, EnvLog, ScriptedEnv, scripted
from hf_check import assert_logprobs_equal_hf
from test_intra import assert_all_pages_free

from oppo_engine import EngineConfig, Observation, RolloutEngine, SamplingParams
from oppo_engine.model.sampler import Sampler
from oppo_engine.sched.prompts import derive_seed

MODES = ["sequential", "intra", "inter", "oppo"]
TURN_STOP = 9
MAX_MODEL_LEN = 160


@pytest.fixture(scope="module")
def actor():
    return make_actor()


@pytest.fixture(scope="module")
def reward():
    return make_reward()


def sampling(**kw) -> SamplingParams:
    base = dict(
        temperature=1.0, max_new_tokens=30, seed=11, turn_stop_token_ids=(TURN_STOP,), max_turn_tokens=6
    )
    return SamplingParams(**{**base, **kw})


def make_engine(actor, reward, mode, *, env, batch_size=4, sampling_params=None, **cfg) -> RolloutEngine:
    cfg.setdefault("page_size", 8)
    cfg.setdefault("max_model_len", MAX_MODEL_LEN)
    if mode in ("intra", "oppo"):
        cfg.setdefault("chunk_size", 4)
    if mode in ("inter", "oppo"):
        cfg.setdefault("overcommit", 2)
    return RolloutEngine(
        actor=actor, reward=reward, env=env, eos_token_id=EOS,
        config=EngineConfig(batch_size=batch_size, mode=mode, **cfg), sampling=sampling_params or sampling(),
    )  # fmt: skip


def drain(engine: RolloutEngine, *, between=None) -> tuple[list, list, list]:
    rollouts, failed, metrics = [], [], []
    while True:
        result = engine.step()
        failed += result.failed
        metrics.append(result.metrics)
        if not result.rollouts and not result.failed:
            return rollouts, failed, metrics
        rollouts += result.rollouts
        if between is not None:
            between(engine)


def transcripts(rollouts) -> dict:
    return {
        (r.group_id, r.sample_index): (r.response_ids, r.action_mask, r.turns, r.finish_reason)
        for r in rollouts
    }


def rule_reward(prompt, response):
    return float(sum(response) % 7)


# -- exactness ------------------------------------------------------------------------------------------


def test_transcripts_are_identical_in_all_four_modes_with_streamed_scorers(actor, reward):
    prompts = random_prompts(10, seed=3)
    runs = {}
    for mode in MODES:
        engine = make_engine(actor, reward, mode, env=scripted(EnvLog()))
        engine.add_prompts(prompts)
        rollouts, failed, metrics = drain(engine)
        assert failed == [] and len(rollouts) == len(prompts)
        assert sum(m.env_calls for m in metrics) > len(prompts)  # several turns per episode
        runs[mode] = {(r.group_id, r.sample_index): (t, r.logprobs, r.reward) for r, t in zip(
            rollouts, transcripts(rollouts).values(), strict=True)}  # fmt: skip
        assert_all_pages_free(engine)
        engine.close()
    base = runs["sequential"]
    assert any(0 in t[0][1] for t in base.values())  # observations were appended
    for mode, got in runs.items():
        assert got.keys() == base.keys()
        for key, (tr, logprobs, score) in got.items():
            assert tr == base[key][0], (mode, key)
            assert logprobs == pytest.approx(base[key][1], abs=1e-5)
            assert score == pytest.approx(base[key][2], abs=1e-4)


def test_transcripts_survive_a_policy_update_between_steps(actor, reward):
    prompts = random_prompts(10, seed=4)
    env = lambda: ScriptedEnv(EnvLog(), max_latency_s=0.03)  # noqa: E731
    plain = make_engine(actor, reward, "oppo", env=env)
    plain.add_prompts(prompts)
    want = transcripts(drain(plain)[0])
    updated = make_engine(actor, reward, "oppo", env=env)
    updated.add_prompts(prompts)
    rollouts, failed, metrics = drain(updated, between=lambda e: e.update_policy())
    assert failed == [] and transcripts(rollouts) == want
    assert any(m.deferred for m in metrics)  # episodes were carried across an update
    # policy_versions count sampled tokens only: -1 at every observation token.
    for r in rollouts:
        for mask, version in zip(r.action_mask, r.policy_versions, strict=True):
            assert (version == -1) == (mask == 0)


def test_action_logprobs_equal_one_hf_forward_over_the_transcript(actor):
    engine = make_engine(actor, rule_reward, "oppo", env=scripted(EnvLog(), obs_len=5))
    engine.add_prompts(random_prompts(6, seed=5))
    rollouts, failed, _ = drain(engine)
    assert failed == [] and len(rollouts) == 6
    for r in rollouts:
        assert_logprobs_equal_hf(actor, r.prompt_ids, r.response_ids, r.logprobs, r.action_mask)
        assert r.reward == rule_reward(r.prompt_ids, r.response_ids)  # the whole transcript was scored


def test_each_sampled_token_is_the_samplers_draw_at_its_transcript_position(actor):
    """Sampling noise is keyed by (seed, position in the sequence): an observation shifts positions, never
    a sampled token's stream, the same way in every mode."""
    params = sampling(top_k=20, top_p=0.9)
    engine = make_engine(
        actor, rule_reward, "intra", env=scripted(EnvLog(), obs_len=4), sampling_params=params
    )
    engine.add_prompts(random_prompts(4, seed=6))
    rollouts = drain(engine)[0]
    sampler = Sampler()
    for r in rollouts:
        ids = r.prompt_ids + r.response_ids
        with torch.inference_mode():
            logits = actor(torch.tensor([ids])).logits[0].float()
        p = len(r.prompt_ids)
        prompt_seed = derive_seed(params.seed, r.group_id)  # the sequence's seed: by its prompt's index
        for i, mask in enumerate(r.action_mask):
            if not mask:
                continue
            token, _ = sampler(
                logits[p - 1 + i : p + i], temperatures=[params.temperature], top_ks=[params.top_k],
                top_ps=[params.top_p], seeds=[prompt_seed], positions=[p + i],
            )  # fmt: skip
            assert int(token[0]) == r.response_ids[i], (r.group_id, i)


def test_without_an_environment_the_action_mask_is_all_ones_and_one_turn(actor):
    engine = RolloutEngine(
        actor=actor, reward=rule_reward, eos_token_id=EOS,
        config=EngineConfig(batch_size=3, mode="sequential", max_model_len=64, page_size=8),
        sampling=SamplingParams(max_new_tokens=8, seed=1),
    )  # fmt: skip
    engine.add_prompts(random_prompts(3, seed=7))
    for r in engine.step().rollouts:
        assert type(r.action_mask) is list and r.action_mask == [1] * len(r.response_ids)
        assert r.turns == [(0, len(r.response_ids))] and r.truncated_observations == 0


# -- turns and how an episode ends ----------------------------------------------------------------------


def test_turns_masks_and_env_calls_follow_the_environment(actor):
    log = EnvLog()
    engine = make_engine(actor, rule_reward, "oppo", env=scripted(log, turns=3, obs_len=2))
    prompts = random_prompts(6, seed=8)
    engine.add_prompts(prompts)
    rollouts, _, metrics = drain(engine)
    assert sum(m.env_calls for m in metrics) == len(log.steps)
    for r in rollouts:
        steps = [s for s in log.steps if s[0] in _instances_of(log, r)]
        if r.finish_reason == "env_done":
            assert len(r.turns) == 3 == len(steps)
        # Each turn was sent as sampled, its stop token (or the max_turn_tokens-th token) last.
        for (start, end), (_, _, turn_ids) in zip(r.turns, sorted(steps, key=lambda s: s[1]), strict=False):
            assert tuple(r.response_ids[start:end]) == turn_ids
            assert turn_ids[-1] == TURN_STOP or end - start == 6
            assert all(r.action_mask[start:end])
        sampled = sum(r.action_mask)
        assert sampled <= 30  # max_new_tokens counts sampled tokens only
        mask_zeros = [i for i, m in enumerate(r.action_mask) if not m]
        assert len(mask_zeros) == 2 * len([s for s in steps])  # every observation: 2 tokens, mask 0
    assert {r.finish_reason for r in rollouts} <= {"env_done", "length", "eos"}
    lat = [m.env_latency_s for m in metrics if m.env_calls]
    assert lat and all(0 <= d["p50"] <= d["p90"] <= d["p99"] <= d["max"] for d in lat)


def _instances_of(log: EnvLog, rollout) -> set[int]:
    """The env instances that served ``rollout`` (one, without restarts): those whose turns match its own."""
    turns = {tuple(rollout.response_ids[s:e]) for s, e in rollout.turns}
    return {i for i, _, ids in log.steps if ids in turns}


def test_max_turns_ends_the_episode_without_calling_the_environment_again(actor):
    log = EnvLog()
    engine = make_engine(actor, rule_reward, "sequential", env=scripted(log, turns=10),
                         sampling_params=sampling(max_turns=2, max_new_tokens=60,
                                                  ignore_eos=True))  # fmt: skip
    engine.add_prompts(random_prompts(4, seed=9))
    rollouts = drain(engine)[0]
    assert [r.finish_reason for r in rollouts] == ["max_turns"] * 4
    for r in rollouts:
        assert len(r.turns) == 2 and r.turns[-1][1] == len(r.response_ids)  # the last turn: no observation
    assert len(log.steps) == 4  # one call per episode: after its first turn


def test_max_new_tokens_counts_sampled_tokens_over_all_turns(actor):
    engine = make_engine(actor, rule_reward, "oppo", env=scripted(EnvLog(), turns=100, obs_len=4),
                         sampling_params=sampling(max_new_tokens=14, ignore_eos=True))  # fmt: skip
    engine.add_prompts(random_prompts(4, seed=10))
    for r in drain(engine)[0]:
        assert r.finish_reason == "length" and sum(r.action_mask) == 14
        assert len(r.response_ids) > 14  # observations come on top


def test_eos_ends_the_episode_without_a_call(actor):
    log = EnvLog()
    # Greedy: the tiny actor's argmax; with EOS set to the first greedy token of the first prompt, that
    # episode ends at its first token, before any turn ends.
    probe = RolloutEngine(actor=actor, reward=rule_reward, eos_token_id=(),
                          config=EngineConfig(batch_size=1, mode="sequential", max_model_len=64, page_size=8),
                          sampling=SamplingParams(temperature=0.0, max_new_tokens=1))  # fmt: skip
    prompt = random_prompts(1, seed=11)
    probe.add_prompts(prompt)
    first = probe.step().rollouts[0].response_ids[0]
    engine = RolloutEngine(
        actor=actor, reward=rule_reward, eos_token_id=first, env=scripted(log),
        config=EngineConfig(batch_size=1, mode="sequential", max_model_len=64, page_size=8),
        sampling=SamplingParams(temperature=0.0, max_new_tokens=8, turn_stop_token_ids=(TURN_STOP,)),
    )  # fmt: skip
    engine.add_prompts(prompt)
    r = engine.step().rollouts[0]
    assert r.finish_reason == "eos" and r.response_ids == [first] and r.turns == [(0, 1)]
    assert log.made == 1 and log.steps == []
    deadline = time.monotonic() + 2.0
    while not log.resets and time.monotonic() < deadline:  # reset() runs on a worker, maybe after the step
        time.sleep(0.01)
    assert log.resets == [tuple(prompt[0])]


def test_the_factory_is_called_once_per_sequence_each_sample_its_own_instance(actor):
    log = EnvLog()
    engine = make_engine(actor, rule_reward, "oppo", env=scripted(log), batch_size=4,
                         sampling_params=sampling(n=2))  # fmt: skip
    prompts = random_prompts(4, seed=12)
    engine.add_prompts(prompts)
    rollouts, failed, _ = drain(engine)
    assert failed == [] and len(rollouts) == 8
    assert log.made == 8 and sorted(log.resets) == sorted(tuple(p) for p in prompts for _ in range(2))
    by_instance: dict[int, list[int]] = {}
    for instance, turn, _ in log.steps:
        by_instance.setdefault(instance, []).append(turn)
    assert all(turns == list(range(1, len(turns) + 1)) for turns in by_instance.values())


def test_add_prompts_envs_gives_each_prompt_its_own_factory(actor):
    short, long = EnvLog(), EnvLog()
    # Without env= the engine's own SamplingParams may set no turn settings: the prompts bring theirs.
    engine = make_engine(actor, rule_reward, "inter", env=None, sampling_params=SamplingParams(seed=11))
    prompts = random_prompts(4, seed=13)
    engine.add_prompts(prompts, sampling=sampling(ignore_eos=True, max_new_tokens=60),
                       envs=[scripted(short, turns=1), scripted(long, turns=3)] * 2)  # fmt: skip
    rollouts = {r.group_id: r for r in drain(engine)[0]}
    assert short.made == 2 and long.made == 2
    assert [len(rollouts[i].turns) for i in range(4)] == [1, 3, 1, 3]
    assert all(r.finish_reason == "env_done" for r in rollouts.values())


def test_the_done_observations_reward_is_the_rollouts_reward(actor, reward):
    engine = make_engine(actor, reward, "oppo", env=scripted(EnvLog(), reward=True),
                         sampling_params=sampling(ignore_eos=True, max_new_tokens=60))  # fmt: skip
    engine.add_prompts(random_prompts(4, seed=14))
    for r in drain(engine)[0]:
        assert r.finish_reason == "env_done"
        last_turn = r.turns[-1]
        assert r.reward == float(last_turn[1] - last_turn[0] + len(r.turns))


def test_max_observation_tokens_cuts_each_observation_and_counts_it(actor):
    engine = make_engine(
        actor,
        rule_reward,
        "intra",
        env=scripted(EnvLog(), obs_len=6),
        sampling_params=sampling(max_observation_tokens=2, ignore_eos=True, max_new_tokens=60),
    )
    engine.add_prompts(random_prompts(3, seed=15))
    for r in drain(engine)[0]:
        observations = len(r.turns) - (r.finish_reason != "env_done")
        assert r.truncated_observations == observations == 3 - (r.finish_reason != "env_done")
        assert len(r.response_ids) - sum(r.action_mask) == 2 * observations


def test_async_step_runs_on_the_event_loop(actor):
    log = EnvLog()
    sync = make_engine(actor, rule_reward, "oppo", env=scripted(EnvLog()))
    asyn = make_engine(actor, rule_reward, "oppo", env=scripted(log, cls=AsyncScriptedEnv))
    prompts = random_prompts(6, seed=16)
    for e in (sync, asyn):
        e.add_prompts(prompts)
    assert transcripts(drain(asyn)[0]) == transcripts(drain(sync)[0])
    assert log.steps
    asyn.close()


# -- overcommit: a slow tool is carried like a long answer -----------------------------------------------


class SlowFirstPromptEnv(ScriptedEnv):
    """The episode of ``slow_prompt`` takes ``slow_s`` per call; the others are fast."""

    slow_prompt: tuple[int, ...] = ()

    def _answer(self, turn_ids):
        if self.prompt == self.slow_prompt:
            time.sleep(0.4)
        return super()._answer(turn_ids)


def test_an_episode_waiting_on_a_slow_tool_is_carried_over_and_comes_back(actor):
    prompts = random_prompts(8, seed=17)
    SlowFirstPromptEnv.slow_prompt = tuple(prompts[0])
    log = EnvLog()
    engine = make_engine(actor, rule_reward, "oppo", env=lambda: SlowFirstPromptEnv(log), batch_size=2,
                         overcommit=2,
                         sampling_params=sampling(ignore_eos=True, max_new_tokens=60))  # fmt: skip
    engine.add_prompts(prompts)
    first = engine.step()
    assert all(r.group_id != 0 for r in first.rollouts) and len(first.rollouts) == 2
    rollouts, failed, metrics = drain(engine)
    rollouts += first.rollouts
    assert failed == [] and sorted(r.group_id for r in rollouts) == list(range(8))
    slow = next(r for r in rollouts if r.group_id == 0)
    assert slow.deferred_steps >= 1 and slow.finish_reason == "env_done"
    assert all(m.rollouts > 0 for m in metrics[:-1])  # never empty while episodes wait on environments
    assert_all_pages_free(engine)


# -- failures: never raised from step(), nothing lost ----------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_an_env_that_raises_or_hangs_ends_its_sequence_alone_in_failed(actor, reward, mode):
    prompts = random_prompts(8, seed=18)
    firsts = [p[0] for p in prompts]
    assert len(set(firsts)) == 8
    env = scripted(EnvLog(), fail_on={(firsts[1], 2)}, hang_on={(firsts[4], 1)}, hang_s=3.0)
    engine = make_engine(actor, reward, mode, env=env, env_timeout_s=0.3,
                         sampling_params=sampling(ignore_eos=True, max_new_tokens=60))  # fmt: skip
    engine.add_prompts(prompts)
    t0 = time.perf_counter()
    rollouts, failed, _ = drain(engine)
    assert time.perf_counter() - t0 < 3.0  # the hung call did not hold the engine
    assert sorted(r.group_id for r in failed) == [1, 4]
    assert sorted(r.group_id for r in rollouts) == [0, 2, 3, 5, 6, 7]  # every prompt exactly once
    for r in failed:
        assert r.finish_reason == "error" and math.isnan(r.reward)
    errors = {r.group_id: r.error for r in failed}
    assert "RuntimeError: tool failed on turn 2" in errors[1] and "ScriptedEnv" in errors[1]
    assert "env_timeout_s=0.3" in errors[4]
    assert_all_pages_free(engine)


def test_a_failing_sample_takes_its_group_to_failed_whole(actor):
    prompts = random_prompts(4, seed=19)
    env = scripted(EnvLog(), fail_on={(prompts[2][0], 1)})
    engine = make_engine(actor, rule_reward, "oppo", env=env, sampling_params=sampling(n=2, ignore_eos=True))
    engine.add_prompts(prompts)
    rollouts, failed, _ = drain(engine)
    assert sorted((r.group_id, r.sample_index) for r in failed) == [(2, 0), (2, 1)]
    assert sorted(r.group_id for r in rollouts) == [0, 0, 1, 1, 3, 3]
    assert_all_pages_free(engine)


def test_an_env_factory_that_raises_is_quarantined_per_prompt(actor):
    prompts = random_prompts(4, seed=20)
    bad_prompt = tuple(prompts[1])

    def factory_of(prompt_index):
        def factory():
            if prompt_index == 1:
                raise OSError("sandbox unavailable")
            return ScriptedEnv(EnvLog())

        return factory

    engine = make_engine(actor, rule_reward, "intra", env=None, sampling_params=SamplingParams(seed=11))
    engine.add_prompts(prompts, sampling=sampling(), envs=[factory_of(i) for i in range(4)])
    rollouts, failed, _ = drain(engine)
    assert [tuple(r.prompt_ids) for r in failed] == [bad_prompt]
    assert "OSError: sandbox unavailable" in failed[0].error
    assert sorted(r.group_id for r in rollouts) == [0, 2, 3]
    assert_all_pages_free(engine)


class BadObservationEnv(ScriptedEnv):
    def _answer(self, turn_ids):
        return Observation(tokens="not ids")  # type: ignore[arg-type]


def test_an_observation_that_is_not_token_ids_raises_type_error_naming_the_env(actor):
    engine = make_engine(actor, rule_reward, "sequential", env=lambda: BadObservationEnv(EnvLog()),
                         sampling_params=sampling(ignore_eos=True))  # fmt: skip
    engine.add_prompts(random_prompts(2, seed=21))
    with pytest.raises(TypeError, match="BadObservationEnv"):
        engine.step()
    assert_all_pages_free(engine)  # rolled back: the engine stays usable


class FixedObservationEnv:
    tokens: list = []

    def reset(self, prompt_ids):
        pass

    def step(self, turn_ids):
        return Observation(list(self.tokens))


@pytest.mark.parametrize("tokens", [[5, VOCAB], [5] * MAX_MODEL_LEN])
def test_an_observation_past_the_vocabulary_or_max_model_len_ends_with_max_model_len(actor, tokens):
    FixedObservationEnv.tokens = tokens
    engine = make_engine(actor, rule_reward, "oppo", env=FixedObservationEnv,
                         sampling_params=sampling(ignore_eos=True))  # fmt: skip
    engine.add_prompts(random_prompts(3, seed=22))
    for r in drain(engine)[0]:
        assert r.finish_reason == "max_model_len"
        assert r.action_mask == [1] * len(r.response_ids)  # nothing of it appended, nothing cut
        assert len(r.turns) == 1
    assert_all_pages_free(engine)


def test_turn_settings_without_an_environment_are_refused(actor):
    with pytest.raises(ValueError, match="turn_stop_token_ids.*needs an environment"):
        RolloutEngine(actor=actor, reward=rule_reward, sampling=SamplingParams(turn_stop_token_ids=(5,)))
    engine = RolloutEngine(
        actor=actor, reward=rule_reward, config=EngineConfig(batch_size=2, max_model_len=64)
    )
    with pytest.raises(ValueError, match=r"sampling\[0\]\.max_turn_tokens"):
        engine.add_prompts([[5, 6]], sampling=[SamplingParams(max_turn_tokens=4)])
    with pytest.raises(ValueError, match="envs has 1 entries for 2 prompts"):
        engine.add_prompts([[5, 6], [7, 8]], envs=[ScriptedEnv])
    with pytest.raises(TypeError, match="not an environment factory"):
        engine.add_prompts([[5, 6]], envs=[3])
    with pytest.raises(TypeError, match="env must be an environment factory"):
        RolloutEngine(actor=actor, reward=rule_reward, env="calculator")
    with pytest.raises(ValueError, match="turn_stop_token_ids holds 999"):
        RolloutEngine(actor=actor, reward=rule_reward, env=ScriptedEnv,
                      sampling=SamplingParams(turn_stop_token_ids=(999,)))  # fmt: skip
    with pytest.raises(ValueError, match="env_timeout_s"):
        EngineConfig(env_timeout_s=0)
    with pytest.raises(ValueError, match="max_turns"):
        SamplingParams(max_turns=0)


# -- rollbacks, checkpoints, close -----------------------------------------------------------------------


class FlakyReward:
    """A reward function that fails its first call: the step is rolled back and retried."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, prompt, response):
        self.calls += 1
        if self.calls == 1:
            raise ConnectionError("reward server hiccup")
        return rule_reward(prompt, response)


@pytest.mark.parametrize("mode", ["sequential", "oppo"])
def test_a_rollback_restarts_stepped_episodes_from_their_prompts_with_fresh_envs(actor, mode):
    prompts = random_prompts(6, seed=23)
    clean = make_engine(actor, rule_reward, mode, env=scripted(EnvLog()))
    clean.add_prompts(prompts)
    want = transcripts(drain(clean)[0])
    log = EnvLog()
    engine = make_engine(actor, FlakyReward(), mode, env=scripted(log))
    engine.add_prompts(prompts)
    rollouts, failed, metrics = drain(engine)
    assert failed == [] and transcripts(rollouts) == want
    assert metrics[0].retries == 1 and log.made > len(prompts)  # fresh environments for the retry
    # No environment instance was ever sent a turn twice: each saw turns 1, 2, ... once.
    by_instance: dict[int, list[int]] = {}
    for instance, turn, _ in log.steps:
        by_instance.setdefault(instance, []).append(turn)
    assert all(t == list(range(1, len(t) + 1)) for t in by_instance.values())
    assert_all_pages_free(engine)


class ShortTurnsEnv(ScriptedEnv):
    """Each observation caps the next turn at 2 sampled tokens (``Observation.next_turn_tokens``)."""

    def step(self, turn_ids: list[int]) -> Observation:
        obs = self._answer(turn_ids)
        return Observation(obs.tokens, done=obs.done, reward=obs.reward, next_turn_tokens=2)


def test_a_restarted_episode_replays_its_first_turn_under_the_samplings_limit_not_a_later_turns(actor):
    """A turn limit set by an observation belongs to the episode that got it: a rollback that restarts the
    sequence from its prompt replays turn 1 under max_turn_tokens (6), as first sampled."""
    prompts = random_prompts(6, seed=26)
    clean = make_engine(actor, rule_reward, "sequential", env=scripted(EnvLog(), cls=ShortTurnsEnv))
    clean.add_prompts(prompts)
    want = transcripts(drain(clean)[0])
    assert any(t[2][0][1] - t[2][0][0] > 2 for t in want.values())  # a first turn longer than later caps
    engine = make_engine(actor, FlakyReward(), "sequential", env=scripted(EnvLog(), cls=ShortTurnsEnv))
    engine.add_prompts(prompts)
    rollouts, failed, metrics = drain(engine)
    assert failed == [] and metrics[0].retries == 1
    assert transcripts(rollouts) == want
    assert_all_pages_free(engine)


def test_state_dict_with_calls_in_flight_requeues_them_from_their_prompts(actor):
    prompts = random_prompts(8, seed=24)
    env = scripted(EnvLog(), max_latency_s=0.05)
    clean = make_engine(actor, rule_reward, "oppo", env=env, batch_size=2)
    clean.add_prompts(prompts)
    want = transcripts(drain(clean)[0])
    engine = make_engine(actor, rule_reward, "oppo", env=env, batch_size=2)
    engine.add_prompts(prompts)
    got = list(engine.step().rollouts)
    in_flight = [s for s in engine._buffer.carried if s.episode.stepped and s.finish_reason is None]
    assert in_flight  # the check below is about them
    state = engine.state_dict()
    engine.close()
    saved = {d["seq_id"]: d for d in state["carried"]}
    for seq in in_flight:
        assert saved[seq.seq_id]["response_ids"] == []  # requeued from its prompt
    restored = make_engine(actor, rule_reward, "oppo", env=env, batch_size=2)
    restored.load_state_dict(state)
    got += drain(restored)[0]
    assert sorted(r.group_id for r in got) == list(range(8))  # every prompt exactly once
    assert transcripts(got) == want  # a fresh environment replays the episode
    assert_all_pages_free(restored)


def test_close_cancels_the_calls_pending(actor):
    """Two episodes end before any turn does and make the batch; the other two are carried with their
    calls: one running (held at a gate), one queued behind it (one worker). close() cancels the queued one:
    it never starts, even once the gate opens."""
    gate, started = threading.Event(), []

    class Gated:
        def reset(self, prompt_ids):
            pass

        def step(self, turn_ids):
            started.append(turn_ids)
            gate.wait(5.0)
            return Observation([], done=True)

    engine = make_engine(actor, rule_reward, "oppo", env=Gated, env_workers=1, batch_size=2, overcommit=2)
    # The short episodes never end a turn (no call) and take 8 tokens; the long ones end theirs at 3.
    short = SamplingParams(max_new_tokens=8, ignore_eos=True, seed=1)
    long = sampling(max_new_tokens=30, max_turn_tokens=3, ignore_eos=True)
    engine.add_prompts(random_prompts(4, seed=25), sampling=[short, short, long, long])
    first = engine.step()
    assert sorted(r.group_id for r in first.rollouts) == [0, 1]
    assert engine._loop.envs.pool.in_flight == 2
    engine.close()
    gate.set()
    time.sleep(0.3)
    assert len(started) == 1  # the queued call never ran
    assert engine._loop is None


def test_scorers_read_the_whole_transcript_observations_included(actor, reward):
    reference = make_actor(seed=5)
    critic = make_reward(seed=6)
    engine = RolloutEngine(
        actor=actor, reward=reward, reference=reference, critic=critic, env=scripted(EnvLog(), obs_len=4),
        eos_token_id=EOS, sampling=sampling(),
        config=EngineConfig(batch_size=4, mode="oppo", chunk_size=3, overcommit=2,
                            max_model_len=MAX_MODEL_LEN, page_size=8),
    )  # fmt: skip
    engine.add_prompts(random_prompts(6, seed=26))
    rollouts, failed, _ = drain(engine)
    assert failed == [] and any(0 in r.action_mask for r in rollouts)
    for r in rollouts:
        ids = torch.tensor([r.prompt_ids + r.response_ids])
        p = len(r.prompt_ids)
        with torch.inference_mode():
            ref = reference(ids).logits[0].float().log_softmax(-1)
            score = reward(ids).logits[0, 0].item()
            hidden = critic.base_model(ids).last_hidden_state
            values = critic.score(hidden)[0, :, 0]
        want_ref = [ref[p - 1 + i, t].item() for i, t in enumerate(r.response_ids)]
        assert r.ref_logprobs == pytest.approx(want_ref, abs=1e-4)
        assert r.values == pytest.approx(values[p - 1 : p - 1 + len(r.response_ids)].tolist(), abs=1e-4)
        assert r.reward == pytest.approx(score, abs=1e-4)
    assert_all_pages_free(engine)


def test_parked_sequences_give_up_their_pages_first_under_page_pressure(actor):
    prompts = random_prompts(8, seed=27)
    env = scripted(EnvLog(), max_latency_s=0.02, obs_len=6, turns=5)
    params = sampling(ignore_eos=True, max_new_tokens=40)
    roomy = make_engine(actor, rule_reward, "oppo", env=env, sampling_params=params, max_model_len=100)
    roomy.add_prompts(prompts)
    want = transcripts(drain(roomy)[0])
    page_bytes = roomy.cache_stats().page_bytes
    tight = make_engine(actor, rule_reward, "oppo", env=env, sampling_params=params, max_model_len=100,
                        kv_cache_bytes=page_bytes * 16)  # fmt: skip
    tight.add_prompts(prompts)
    rollouts, failed, metrics = drain(tight)
    assert failed == [] and transcripts(rollouts) == want
    assert any(m.recomputed_tokens.get("actor") for m in metrics)  # pages were given up and recomputed
    assert_all_pages_free(tight)


@pytest.mark.parametrize("mode", ["intra", "oppo"])
def test_an_episode_ending_on_an_empty_observation_is_scored_when_streamed(actor, reward, mode):
    """With chunk_size=1 every token is with the scorers as soon as it is sampled: the final hand-off of an
    episode whose environment ends it with no tokens brings nothing new, and must still complete it."""
    engine = make_engine(actor, reward, mode, env=scripted(EnvLog(), empty=True), chunk_size=1)
    engine.add_prompts(random_prompts(6, seed=28))
    rollouts, failed, _ = drain(engine)
    assert failed == [] and len(rollouts) == 6
    assert any(r.finish_reason == "env_done" and r.action_mask == [1] * len(r.response_ids) for r in rollouts)
    for r in rollouts:
        with torch.inference_mode():
            score = reward(torch.tensor([r.prompt_ids + r.response_ids])).logits[0, 0].item()
        assert r.reward == pytest.approx(score, abs=1e-4)
    assert_all_pages_free(engine)


def test_a_snapshot_from_before_a_restart_never_applies_again():
    """A failed step is rolled back twice (in the quarantine's attempt, then by step()): the first restarts a
    stepped episode from its prompt; the second must see that, not restore the old snapshot's status over
    the fresh episode (which would leave it parked with no call, forever)."""
    from oppo_engine.sched.episode import Episode

    episode = Episode(ScriptedEnv)
    snap = episode.snapshot()
    assert not episode.changed_since(snap)
    episode.fresh()
    assert episode.changed_since(snap)  # same counters as the snapshot, but another episode
    before = episode.snapshot()
    episode.pending_turn = [1, 2]  # a turn ends in the step while reset() is still under way
    episode.restore(before)
    assert episode.pending_turn is None  # it was the rolled-back step's: the retry samples it again
