"""Data-parallel engines (``RolloutEngine(..., process_group=pg)``, oppo_engine/dist/group.py) on 2 real gloo
ranks: the ranks' rollouts equal one process's, their controllers agree, bad settings and failed peers are
caught on every rank, and nothing is lost when a peer dies.

A spawned rank spends most of a test's time importing torch and transformers, so the scenarios of a healthy
group run in one spawn of 2 ranks (the module fixture ``group_runs``; each scenario builds its own engines
and a failure in one is reported by its own test), and only the dead-peer test and its restart spawn ranks
of their own. Every rank builds the same tiny models from the same seeds.
"""

from __future__ import annotations

import math
import os
import pickle
import time
import traceback
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from engine_models import EOS, make_actor, make_reward, random_prompts
from test_ppo_scorers import make_critic, make_reference

from oppo_engine import EngineConfig, RolloutEngine, SamplingParams
from oppo_engine.control import ChunkControl, DeltaControl, SwitchProfile
from oppo_engine.distributed import GroupFailed, PeerCallFailed
from oppo_engine.distributed.group import AGREED_SETTINGS, settings_mismatch, slowest_profile
from oppo_engine.sched.prompts import PromptQueue, derive_seed
from tests.distributed import run_ranks

PROMPTS = random_prompts(8, seed=11)
FAULT_PROMPTS = random_prompts(16, seed=13)  # enough that the second step still has new prompts to decode
SEEDS = [1000 + 17 * i for i in range(len(FAULT_PROMPTS))]
WORLD = 2


def _models(reward_seed: int = 1, scorers: bool = True) -> dict:
    models = dict(actor=make_actor(), reward=make_reward(reward_seed))
    if scorers:
        models.update(reference=make_reference(), critic=make_critic())
    return models


def _engine(models, mode: str, *, batch_size=2, group=True, sampling=None, **cfg) -> RolloutEngine:
    cfg.setdefault("max_model_len", 64)
    cfg.setdefault("page_size", 8)
    return RolloutEngine(
        **models,
        config=EngineConfig(batch_size=batch_size, mode=mode, **cfg),
        sampling=sampling or SamplingParams(temperature=1.0, max_new_tokens=12, seed=7),
        eos_token_id=EOS,
        process_group=dist.group.WORLD if group else None,
    )


def _seeded(indices) -> list[SamplingParams]:
    return [SamplingParams(temperature=1.0, max_new_tokens=12, seed=SEEDS[i]) for i in indices]


def _plain(rollouts) -> list[dict]:
    keys = ("prompt_ids", "response_ids", "logprobs", "reward", "ref_logprobs", "values", "group_id")
    return [{k: getattr(r, k) for k in keys} for r in rollouts]


def _group_drain(engine: RolloutEngine) -> list[dict]:
    """Step every rank until no rank returns anything (the loop a data-parallel trainer runs)."""
    out = []
    while True:
        rollouts = engine.step().rollouts
        out += _plain(rollouts)
        count = torch.tensor([len(rollouts)])
        dist.all_reduce(count)
        if count.item() == 0:
            return out


def _assert_same_rollouts(got: list[dict], want: list[dict]) -> None:
    by_prompt = {tuple(r["prompt_ids"]): r for r in want}
    assert len(got) == len(want) == len(by_prompt)
    for r in got:
        w = by_prompt[tuple(r["prompt_ids"])]
        assert r["response_ids"] == w["response_ids"]
        for key in ("logprobs", "ref_logprobs", "values"):
            if w[key] is None:  # no reference or critic
                assert r[key] is None
                continue
            assert torch.allclose(torch.tensor(r[key]), torch.tensor(w[key]), rtol=0, atol=1e-5), key
        assert r["reward"] == pytest.approx(w["reward"], abs=1e-5)


# ---------------------------------------------------------------- equivalence with one process

_MODES = {"sequential": {}, "intra": {"chunk_size": 3}}


def _rank_equivalence(rank, world_size):
    models = _models()
    mine = list(range(rank, len(PROMPTS), world_size))
    out = {}
    for mode, cfg in _MODES.items():
        engine = _engine(models, mode, **cfg)
        engine.add_prompts([PROMPTS[i] for i in mine], sampling=_seeded(mine))
        out[mode] = _group_drain(engine)
        engine.close()
    return out


def test_two_ranks_with_half_the_prompts_each_equal_one_process_with_all(group_runs):
    ranks = _outcomes(group_runs, "equivalence")
    models = _models()
    for mode, cfg in _MODES.items():
        engine = _engine(models, mode, batch_size=4, group=False, **cfg)
        engine.add_prompts(PROMPTS, sampling=_seeded(range(len(PROMPTS))))
        single = []
        while rollouts := engine.step().rollouts:
            single += _plain(rollouts)
        for rank, got in enumerate(ranks):
            mine = {tuple(PROMPTS[i]) for i in range(rank, len(PROMPTS), WORLD)}
            assert {tuple(r["prompt_ids"]) for r in got[mode]} == mine
            # group_id stays the rank-local prompt index
            assert sorted(r["group_id"] for r in got[mode]) == list(range(len(mine)))
        _assert_same_rollouts(ranks[0][mode] + ranks[1][mode], single)


# ---------------------------------------------------------------- agreement of the controllers

_AGREE_STEPS = 7
_FIRST_REPORT = 4  # after this step's own feed, the trainer reports its own reward


def _slow_down(module, args):
    time.sleep(0.004)


def _agreement_engine(models):
    return _engine(
        models, "oppo", batch_size=4, chunk_size="auto", overcommit="auto",
        # prior="list", no budget: the search explores whatever the first step's timing bounds (the subject
        # is the agreement across ranks, not the futility rule or the exploration budget)
        chunk=ChunkControl(candidates=(2, 4, 8), explore_period=2, explore_top=2, min_samples=2,
                           noise_window=4, warmup_steps=0, prior="list", explore_budget=None),
        delta=DeltaControl(init=1, max=3, inc=1, dec=1, window=3, significance=0.0),
    )  # fmt: skip


def _rank_agreement(rank, world_size):
    # Different rewards (another reward model per rank) and different speeds (rank 1's actor sleeps).
    models = _models(reward_seed=1 + rank, scorers=False)
    if rank == 1:
        models["actor"].model.register_forward_pre_hook(_slow_down)
    engine = _agreement_engine(models)
    engine.add_prompts(random_prompts(48, seed=100 + rank))
    steps = []
    for i in range(_AGREE_STEPS):
        result = engine.step()
        m = result.metrics
        rewards = [r.reward for r in result.rollouts]
        steps.append((m.wall_s, m.tokens_generated, m.chunk_size, math.fsum(rewards), len(rewards)))
        if i >= _FIRST_REPORT:
            engine.report_reward(10.0 * (rank + 1) + i)
    with pytest.raises(ValueError, match="rank 1"):  # a non-finite report is refused on every rank
        engine.report_reward(math.nan if rank == 1 else 0.0)
    with pytest.raises(ValueError, match=r"Tensor tensor\(1\.\) on rank 0"):  # described, not pickled
        engine.report_reward(torch.tensor(1.0) if rank == 0 else 0.0)
    engine.step()  # still usable
    return engine.delta_history, engine.chunk_history, steps


def test_delta_and_chunk_histories_agree_across_ranks_fed_different_rewards_at_different_speeds(group_runs):
    (d0, c0, s0), (d1, c1, s1) = _outcomes(group_runs, "agreement")
    assert d0 == d1 and c0 == c1
    # Δ was fed the group's mean batch reward until the first report, then the mean of the ranks' reports.
    fed = []
    for i, ((_, _, _, r0, n0), (_, _, _, r1, n1)) in enumerate(zip(s0, s1, strict=True)):
        if i <= _FIRST_REPORT:
            fed.append((r0 + r1) / (n0 + n1))
        if i >= _FIRST_REPORT:
            fed.append((10.0 + 20.0) / 2 + i)
    assert [d.reward for d in d0] == pytest.approx(fed, abs=1e-9)
    # The group's mean is not rank 0's own: the agreement is not a coincidence of equal ranks.
    assert any(r / n != d.reward for (_, _, _, r, n), d in zip(s0[:_FIRST_REPORT], d0, strict=False))
    assert len(c0) == _AGREE_STEPS + 1
    for i, ((w0, t0, k0, _, _), (w1, t1, k1, _, _)) in enumerate(zip(s0, s1, strict=True)):
        # Both ranks ran the chunk size rank 0 decided; the controller saw the slowest time per token.
        assert k0 == k1 == c0[i].chunk_size
        slowest = max(w / t for w, t in ((w0, t0), (w1, t1)) if t)
        assert c0[i].seconds_per_token == pytest.approx(slowest, rel=1e-9)
    assert len({c.chunk_size for c in c0}) > 1  # the search explored across the group


def _rank_one_runs_dry(rank, world_size):
    models = _models(scorers=False)
    engine = _agreement_engine(models)
    prompts = random_prompts(2 if rank == 0 else 14, seed=200 + rank)
    engine.add_prompts(prompts)
    steps, tokens = [], []
    while True:
        result = engine.step()
        steps.append(_plain(result.rollouts))
        tokens.append(result.metrics.tokens_generated)
        count = torch.tensor([len(result.rollouts)])
        dist.all_reduce(count)
        if count.item() == 0:
            break
    return prompts, steps, tokens, engine.delta_history, engine.chunk_history


def test_a_rank_with_no_prompts_left_gets_empty_results_while_its_peer_finishes(group_runs):
    (p0, s0, t0, d0, c0), (p1, s1, t1, d1, c1) = _outcomes(group_runs, "runs_dry")
    assert len(s0) == len(s1) > 3
    for prompts, steps in ((p0, s0), (p1, s1)):  # every prompt exactly once
        assert Counter(tuple(r["prompt_ids"]) for s in steps for r in s) == Counter(map(tuple, prompts))
    assert not any(s0[2:]) and not any(t0[2:])  # rank 0 ran dry and kept stepping with empty results
    assert d0 == d1 and c0 == c1
    # A step is token-less only if the whole group generated none: rank 1's tokens count for both.
    assert any(a == 0 < b for a, b in zip(t0, t1, strict=True))
    assert len(c0) == sum(1 for a, b in zip(t0, t1, strict=True) if a + b)


# ---------------------------------------------------------------- bad settings

_MISMATCHES = [
    ("batch_size", dict(batch_size=2), dict(batch_size=4)),
    ("mode", dict(mode="intra"), dict(mode="oppo")),
    ("chunk_size", dict(mode="intra", chunk_size=3), dict(mode="intra", chunk_size=4)),
    ("delta", dict(mode="oppo"), dict(mode="oppo", delta=DeltaControl(window=4))),
    ("retained_kv", dict(mode="inter", retained_kv="reuse"), dict(mode="inter")),
]


def _rank_mismatches(rank, world_size):
    models = _models(scorers=False)
    messages = []
    for _, cfg0, cfg1 in _MISMATCHES:
        cfg = dict(cfg1 if rank else cfg0)
        cfg.setdefault("mode", "sequential")
        try:
            _engine(models, **cfg)
        except ValueError as e:
            messages.append(str(e))
        else:
            messages.append(None)
    try:  # n differs: a SamplingParams setting
        _engine(models, "sequential", sampling=SamplingParams(max_new_tokens=4, n=1 + rank))
    except ValueError as e:
        messages.append(str(e))
    # Same settings build, and both ranks share this host's memory (the default arena is halved).
    engine = _engine(models, "inter", overcommit=1)
    sharing = engine._group.ranks_sharing_memory
    engine.add_prompts(random_prompts(2, seed=5))
    # A rank calling another collective method than its peer fails both, and only state_dict/close work.
    try:
        if rank == 0:
            engine.report_reward(1.0)
        else:
            engine.step()
    except GroupFailed as e:
        messages.append(str(e))
    refused = []
    for call in (
        engine.step,
        engine.update_policy,
        engine.resume,
        engine.release_memory,
        engine.cache_stats,
        lambda: engine.add_prompts([[5, 6]]),
        lambda: engine.report_reward(0.0),
    ):
        try:
            call()
        except GroupFailed:
            refused.append(True)
    state = engine.state_dict()
    engine.close()
    in_flight = len(state["prompts"]["requeued"]) + len(state["prompts"]["pending"]) + len(state["carried"])
    return messages, sharing, len(refused), in_flight, state["rank"]


def test_mismatched_settings_raise_on_every_rank_naming_the_field(group_runs):
    ranks = _outcomes(group_runs, "mismatches")
    for rank, (messages, sharing, refused, in_flight, saved_by) in enumerate(ranks):
        assert saved_by == [rank, WORLD]
        names = [name for name, _, _ in _MISMATCHES] + ["n"]
        for name, message in zip(names, messages, strict=False):
            assert message is not None, name
            assert f"{name} is " in message and "rank 1" in message, message
        assert "different engine methods" in messages[len(names)]
        assert sharing == WORLD
        assert refused == 7
        assert in_flight == 2  # the rolled-back step's prompts are still held


# ---------------------------------------------------------------- faults


class Interrupt(BaseException):
    """Raised in a forward: not retried or quarantined, so it surfaces from step() after the rollback."""


def _fail_at(model, calls: int, action) -> None:
    count = [0]

    def hook(module, args):
        count[0] += 1
        if count[0] == calls:
            action()

    model.model.register_forward_pre_hook(hook)


def _raise_interrupt():
    raise Interrupt("rank 1's forward was interrupted")


_FAIL_AT_FORWARD = 15  # an actor forward a few steps in (a step may end without one: its batch was done)


def _fault_engine(models) -> RolloutEngine:
    return _engine(models, "oppo", chunk_size=3, overcommit=2)


def _rank_peer_raises(rank, world_size):
    mine = list(range(rank, len(FAULT_PROMPTS), world_size))
    out = {}
    for failing in (False, True):
        models = _models(scorers=False)
        engine = _fault_engine(models)
        engine.add_prompts([FAULT_PROMPTS[i] for i in mine], sampling=_seeded(mine))
        if failing and rank == 1:
            _fail_at(models["actor"], _FAIL_AT_FORWARD, _raise_interrupt)
        returned, errors = [], []
        while True:  # the group is intact after a failed step: every rank goes on
            try:
                rollouts = engine.step().rollouts
            except (Interrupt, PeerCallFailed) as e:
                errors.append(f"{type(e).__name__}: {e}")
                continue
            returned += _plain(rollouts)
            count = torch.tensor([len(rollouts)])
            dist.all_reduce(count)
            if count.item() == 0:
                break
        out[failing] = (returned, errors, engine.delta_history)
    return out


def test_a_rank_that_raises_in_step_makes_its_peers_raise_and_every_rank_roll_back(group_runs):
    ranks = _outcomes(group_runs, "peer_raises")
    (_, errors1, _) = ranks[1][True]
    (_, errors0, _) = ranks[0][True]
    assert len(errors1) == 1 and errors1[0].startswith("Interrupt")
    assert len(errors0) == 1 and errors0[0].startswith("PeerCallFailed") and "rank 1: Interrupt" in errors0[0]
    for out in ranks:
        clean, no_errors, clean_delta = out[False]
        retried, _, retried_delta = out[True]
        assert no_errors == []
        _assert_same_rollouts(retried, clean)  # nothing lost, and the retry is exact
        # (streamed rewards are batched as the lanes' timing has it: equal to rounding)
        assert [d.delta for d in retried_delta] == [d.delta for d in clean_delta]
        assert [d.reward for d in retried_delta] == pytest.approx([d.reward for d in clean_delta], abs=1e-5)


# ---------------------------------------------------------------- one spawn for the healthy group's scenarios

_SCENARIOS = {
    "equivalence": _rank_equivalence,
    "agreement": _rank_agreement,
    "runs_dry": _rank_one_runs_dry,
    "peer_raises": _rank_peer_raises,
    "mismatches": _rank_mismatches,  # last: it ends with a group failure of its engine (not of the pg)
}


def _rank_scenarios(rank, world_size):
    out = {}
    for name, scenario in _SCENARIOS.items():
        try:
            out[name] = (True, scenario(rank, world_size))
        except BaseException:  # noqa: BLE001 - reported by the scenario's own test
            out[name] = (False, traceback.format_exc())
    return out


@pytest.fixture(scope="module")
def group_runs():
    return run_ranks(_rank_scenarios, WORLD, timeout_s=600, pg_timeout_s=60)


def _outcomes(runs, name: str) -> list:
    """Each rank's value of scenario ``name``; the test fails with the traceback of a rank that raised."""
    failed = [f"--- rank {rank} ---\n{r[name][1]}" for rank, r in enumerate(runs) if not r[name][0]]
    if failed:
        pytest.fail(f"scenario {name} failed:\n" + "\n".join(failed))
    return [r[name][1] for r in runs]


# ---------------------------------------------------------------- a dead peer


def _die():
    os._exit(3)


def _rank_dies(rank, world_size, tmp):
    mine = list(range(rank, len(FAULT_PROMPTS), world_size))
    models = _models(scorers=False)
    engine = _fault_engine(models)
    engine.add_prompts([FAULT_PROMPTS[i] for i in mine], sampling=_seeded(mine))
    if rank == 1:
        _fail_at(models["actor"], _FAIL_AT_FORWARD, _die)
    returned, error = [], None
    while error is None:
        try:
            rollouts = engine.step().rollouts
        except GroupFailed as e:
            error = str(e)
            break
        returned += _plain(rollouts)
        with open(os.path.join(tmp, f"checkpoint{rank}.pkl"), "wb") as f:  # the trainer's checkpoint
            pickle.dump((returned, engine.state_dict()), f)
        count = torch.tensor([len(rollouts)])
        dist.all_reduce(count)
        if count.item() == 0:
            break
    with pytest.raises(GroupFailed, match="only state_dict"):
        engine.step()
    state = engine.state_dict()  # after the failed collective: still there, with every prompt in flight
    engine.close()
    engine.close()  # idempotent, and neither close communicates
    with open(os.path.join(tmp, f"failed{rank}.pkl"), "wb") as f:
        pickle.dump(state, f)
    return error


def _rank_restarts(rank, world_size, tmp):
    engine = _fault_engine(_models(scorers=False))
    name = "failed0.pkl" if rank == 0 else "checkpoint1.pkl"  # rank 1 died: its last checkpoint
    with open(os.path.join(tmp, name), "rb") as f:
        state = pickle.load(f)
    engine.load_state_dict(state[1] if rank == 1 else state)
    return _group_drain(engine)


def test_a_dead_peer_makes_the_others_raise_and_a_restart_from_every_state_dict_loses_nothing(tmp_path):
    outcomes = run_ranks(_rank_dies, WORLD, str(tmp_path), pg_timeout_s=30, check=False)
    assert outcomes[1].exitcode == 3
    assert outcomes[0].ok, outcomes[0].error
    assert "all_gather_object" in outcomes[0].value and "step()" in outcomes[0].value
    restarted = run_ranks(_rank_restarts, WORLD, str(tmp_path))
    for rank in range(WORLD):
        with open(tmp_path / f"checkpoint{rank}.pkl", "rb") as f:
            before, _ = pickle.load(f)
        finished = Counter(tuple(r["prompt_ids"]) for r in before + restarted[rank])
        mine = Counter(tuple(FAULT_PROMPTS[i]) for i in range(rank, len(FAULT_PROMPTS), WORLD))
        assert before and restarted[rank] and finished == mine  # every prompt finished exactly once


# ---------------------------------------------------------------- without processes


def test_a_state_saved_by_another_rank_is_refused_and_changes_nothing():
    """Each rank loads its own state: another rank's would run that rank's prompts twice and lose this one's.
    A single process is rank 0 of 1; a state from before the rank was recorded loads."""
    models = _models(scorers=False)
    engine = _engine(models, "inter", group=False, overcommit=1)
    engine.add_prompts(random_prompts(3, seed=5))
    state = engine.state_dict()
    assert state["rank"] == [0, 1]
    other = _engine(models, "inter", group=False, overcommit=1)
    other.add_prompts(random_prompts(1, seed=6))
    before = other.state_dict()
    for saved_by, named in (([1, 2], "rank 1 of 2"), ([0, 2], "rank 0 of 2")):
        with pytest.raises(ValueError, match=f"saved by {named}, this engine is rank 0 of 1"):
            other.load_state_dict({**state, "rank": saved_by})
        assert other.state_dict() == before
    legacy = dict(state)
    del legacy["rank"]
    other.load_state_dict(legacy)
    assert other.state_dict()["prompts"] == state["prompts"]
    for e in (engine, other):
        e.close()


def test_settings_mismatch_names_each_field_and_rank():
    base = dict.fromkeys(AGREED_SETTINGS, 0)
    assert settings_mismatch([base, dict(base)]) is None
    message = settings_mismatch([base, dict(base), {**base, "batch_size": 8, "n": 2}])
    assert message == "batch_size is 0 on rank 0 but 8 on rank 2; n is 0 on rank 0 but 2 on rank 2"


def test_slowest_profile_is_the_fieldwise_max_of_the_measured_profiles():
    a = SwitchProfile(0.1, 0.01, 0.5, {4: 0.2}, running_seqs=4.0, tail_seqs=1.0, tokens_per_step=40.0)
    b = SwitchProfile(0.3, 0.005, 0.2, {4: 0.1, 8: 0.4}, running_seqs=2.0, tail_seqs=0.0, tokens_per_step=50)
    assert slowest_profile([None, None]) is None
    assert slowest_profile([None, a]) == a
    m = slowest_profile([a, None, b])
    assert (m.handoff_s, m.prefill_s_per_token, m.decode_iter_s) == (0.3, 0.01, 0.5)
    assert m.slowdown == {4: 0.2, 8: 0.4}
    assert (m.running_seqs, m.tail_seqs, m.tokens_per_step) == (4.0, 1.0, 50.0)


def test_default_seeds_differ_across_ranks_and_stay_unchanged_without_a_group():
    def seeds(rank, sampling=None):
        queue = PromptQueue(SamplingParams(seed=7), max_model_len=64, vocab_size=128, rank=rank)
        queue.add([[5, 6]] * 4, sampling)
        return [s.seed for s in queue.take(4)]

    assert seeds(None) == [derive_seed(7, i) for i in range(4)]
    assert not set(seeds(0)) & set(seeds(1)) and not set(seeds(0)) & set(seeds(None))
    explicit = [SamplingParams(seed=100 + i) for i in range(4)]
    assert seeds(0, explicit) == seeds(1, explicit) == [100, 101, 102, 103]


def test_process_group_must_be_a_process_group():
    with pytest.raises(TypeError, match="process_group"):
        RolloutEngine(actor=make_actor(), reward=make_reward(), process_group="gloo")


def _nccl_engines_off_then_on_the_current_device(rank, world_size):
    models = {name: m.to("cuda:1") for name, m in _models(scorers=False).items()}
    try:
        _engine(models, "sequential")
        refused = None
    except ValueError as e:
        refused = str(e)
    torch.cuda.set_device(1)
    engine = _engine(models, "sequential")  # the constructor's exchange runs on NCCL, on cuda:1
    engine.add_prompts(PROMPTS[:2])
    return refused, len(engine.step().rollouts)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_an_nccl_group_is_refused_unless_the_current_device_is_the_engines():
    (outcome,) = run_ranks(_nccl_engines_off_then_on_the_current_device, 1, backend="nccl", timeout_s=120)
    refused, rollouts = outcome
    assert refused is not None and "set_device(1)" in refused
    assert rollouts == 2
