"""Nothing lost, nothing stuck (issue 19): the resolved max_model_len, the quarantine of a failing group,
step() all-or-nothing after its loop, a real Ctrl-C during a streamed step, checkpoints across modes, and
errors that name their role. Each test here fails on the engine before these fixes.
"""

from __future__ import annotations

import contextlib
import json
import math
import pathlib
import signal
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Iterator

import pytest
import torch
from engine_models import EOS, actor_config, make_actor, make_reward, random_prompts
from families import build_actor, build_reward
from test_intra import assert_all_pages_free
from transformers import AutoModelForSequenceClassification

from oppo_engine import EngineConfig, RolloutEngine, SamplingParams
from oppo_engine.sched.runtime import LaneExecutor

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
MODES = ["sequential", "intra", "inter", "oppo"]
_STREAMED = ("intra", "oppo")
_OVERCOMMIT = ("inter", "oppo")


@pytest.fixture(scope="module")
def models():
    return dict(actor=make_actor(), reward=make_reward())


def make_engine(models, mode: str, *, batch_size=4, max_new=10, n=1, **cfg) -> RolloutEngine:
    cfg.setdefault("page_size", 8)
    if "max_model_len" not in cfg:
        cfg["max_model_len"] = 64
    if mode in _STREAMED:
        cfg.setdefault("chunk_size", 3)
    if mode in _OVERCOMMIT:
        cfg.setdefault("overcommit", 2 * n)
    return RolloutEngine(
        **models,
        config=EngineConfig(batch_size=batch_size, mode=mode, **cfg),
        sampling=SamplingParams(temperature=1.0, max_new_tokens=max_new, seed=7, n=n),
        eos_token_id=EOS,
    )


def drain(engine: RolloutEngine) -> tuple[list, list]:
    """Every rollout and every quarantined rollout until the engine runs dry."""
    rollouts, failed = [], []
    while True:
        result = engine.step()
        failed.extend(result.failed)
        if not result.rollouts:
            return rollouts, failed
        rollouts.extend(result.rollouts)


def tokens(rollouts) -> dict:
    return {(tuple(r.prompt_ids), r.sample_index): r.response_ids for r in rollouts}


# -- max_model_len --------------------------------------------------------------------------------------


def test_max_model_len_none_resolves_to_the_smallest_position_limit(models):
    engine = RolloutEngine(**models, config=EngineConfig(batch_size=2, mode="sequential"))
    assert engine.max_model_len == 512  # the Qwen2 models' max_position_embeddings, under 4096
    assert engine.config.max_model_len is None
    gpt2 = RolloutEngine(
        actor=build_actor("gpt2"),
        reward=models["reward"],
        config=EngineConfig(batch_size=2, mode="sequential"),
    )
    assert gpt2.max_model_len == 256  # GPT-2's n_positions


def test_max_model_len_past_a_learned_position_table_raises_naming_both_numbers(models):
    with pytest.raises(
        ValueError, match=r"actor: max_model_len=512 exceeds its learned position table of 256"
    ):
        RolloutEngine(
            actor=build_actor("gpt2"), reward=models["reward"],
            config=EngineConfig(batch_size=2, mode="sequential", max_model_len=512),
        )  # fmt: skip


def test_max_model_len_past_a_rope_limit_warns(models):
    with pytest.warns(UserWarning, match="max_position_embeddings=512"):
        engine = make_engine(models, "sequential", max_model_len=1024)
    assert engine.max_model_len == 1024


def test_the_poison_prompt_of_a_gpt2_no_longer_blocks_the_engine():
    """Ten good prompts and one of 250 tokens on a GPT-2 (n_positions=256): the long one stops at the
    position limit, and every prompt comes back once."""
    engine = RolloutEngine(
        actor=build_actor("gpt2"), reward=build_reward("gpt2"),
        config=EngineConfig(batch_size=4, mode="oppo", overcommit=2, chunk_size=4, page_size=8),
        sampling=SamplingParams(temperature=1.0, max_new_tokens=12, seed=3), eos_token_id=EOS,
    )  # fmt: skip
    prompts = random_prompts(10, seed=4) + [[4 + i % 120 for i in range(250)]]
    engine.add_prompts(prompts)
    got, failed = drain(engine)
    assert failed == [] and sorted(map(tuple, (r.prompt_ids for r in got))) == sorted(map(tuple, prompts))
    long = next(r for r in got if len(r.prompt_ids) == 250)
    assert len(long.prompt_ids) + len(long.response_ids) == engine.max_model_len == 256
    assert_all_pages_free(engine)


# -- errors name their role -----------------------------------------------------------------------------


def test_a_critic_with_two_labels_is_refused_naming_the_critic(models):
    critic = AutoModelForSequenceClassification.from_config(actor_config(num_labels=2)).eval()
    with pytest.raises(ValueError, match=r"^critic: the critic model must have num_labels == 1"):
        RolloutEngine(**models, critic=critic, config=EngineConfig(batch_size=2, max_model_len=64))


# -- quarantine -----------------------------------------------------------------------------------------


class PoisonError(ValueError):
    pass


def poisoned_reward(poison: list[int]):
    def reward(prompt_ids, response_ids):
        if prompt_ids == poison:
            raise PoisonError("cannot score this prompt")
        return float(len(response_ids)) - 0.1 * len(prompt_ids)

    return reward


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("mode", MODES)
def test_a_reward_that_always_fails_for_one_prompt_quarantines_its_group_and_the_rest_goes_on(
    models, mode, n
):
    prompts = random_prompts(8, seed=40)
    poison = prompts[3]
    clean = make_engine(dict(models, reward=poisoned_reward([-1])), mode, n=n)
    clean.add_prompts(prompts)
    want, _ = drain(clean)
    engine = make_engine(dict(models, reward=poisoned_reward(poison)), mode, n=n)
    engine.add_prompts(prompts)
    got, failed = [], []
    retries = 0
    while (result := engine.step()).rollouts or result.failed:
        assert all(r.prompt_ids != poison for r in result.rollouts)  # never among the B
        got += result.rollouts
        failed += result.failed
        retries += result.metrics.retries
    assert len(failed) == n and {r.sample_index for r in failed} == set(range(n))  # the whole group
    for r in failed:
        assert r.prompt_ids == poison and r.finish_reason == "error" and math.isnan(r.reward)
        assert r.error == "reward: PoisonError: cannot score this prompt"
    assert retries >= 2  # the retry, then the probes of the isolation
    # Every other sample exactly once, generated as in a fault-free run.
    others = {k: v for k, v in tokens(want).items() if list(k[0]) != poison}
    assert tokens(got) == others and len(got) == len(others)
    assert_all_pages_free(engine)


@pytest.mark.parametrize("mode", ["sequential", "oppo"])
def test_an_actor_forward_that_fails_for_one_sequence_is_quarantined(models, mode):
    prompts = random_prompts(6, seed=41)
    want, _ = drain(_with(make_engine(models, mode), prompts))
    engine = _with(make_engine(models, mode), prompts)
    forward = engine._loop.actor.forward

    def failing_forward(chunks, specs):
        if any(c.seq_id == 2 for c in chunks):  # prompt 2's sequence: an IndexError in the embedding
            raise IndexError("index out of range in self")
        return forward(chunks, specs)

    engine._loop.actor.forward = failing_forward
    got, failed = drain(engine)
    assert [r.prompt_ids for r in failed] == [prompts[2]]
    assert failed[0].error == "actor: IndexError: index out of range in self"
    others = {k: v for k, v in tokens(want).items() if list(k[0]) != prompts[2]}
    assert tokens(got) == others
    assert_all_pages_free(engine)


def test_a_failure_no_single_group_explains_propagates_after_an_exact_rollback(models):
    prompts = random_prompts(4, seed=42)
    want = tokens(_with(make_engine(models, "sequential"), prompts).step().rollouts)
    engine = _with(make_engine(models, "sequential"), prompts)
    forward = engine._loop.actor.forward
    armed = [True]

    def pair_forward(chunks, specs):  # fails only while sequences 0 and 3 share a forward
        if armed[0] and {0, 3} <= {c.seq_id for c in chunks}:
            raise RuntimeError("these two together")
        return forward(chunks, specs)

    engine._loop.actor.forward = pair_forward
    with pytest.raises(RuntimeError, match="these two together"):
        engine.step()
    assert_all_pages_free(engine)
    armed[0] = False
    result = engine.step()
    assert result.metrics.retries == 0 and tokens(result.rollouts) == want  # nothing lost, exact


def _with(engine: RolloutEngine, prompts) -> RolloutEngine:
    engine.add_prompts(prompts)
    return engine


# -- all-or-nothing after the loop ----------------------------------------------------------------------


def test_a_nan_reward_in_oppo_raises_and_loses_nothing(models):
    prompts = random_prompts(4, seed=43)
    calls = {"n": 0}

    def nan_once(prompt_ids, response_ids):
        calls["n"] += 1
        return math.nan if calls["n"] == 1 else float(len(response_ids))

    engine = _with(make_engine(dict(models, reward=nan_once), "oppo", overcommit="auto"), prompts)
    # A callable's result is checked where it is read (the front door's rule): raised at once, not retried.
    with pytest.raises(ValueError, match="nan_once.* returned nan: rewards must be finite"):
        engine.step()
    assert_all_pages_free(engine)
    got, _ = drain(engine)
    clean = _with(
        make_engine(dict(models, reward=lambda p, r: float(len(r))), "oppo", overcommit="auto"), prompts
    )
    want, _ = drain(clean)
    assert tokens(got) == tokens(want)  # the batch was not lost


@pytest.mark.parametrize("mode", ["inter", "oppo"])
def test_an_interrupt_after_the_loop_restores_the_step_exactly(models, mode, monkeypatch):
    import oppo_engine.engine as engine_module

    prompts = random_prompts(8, seed=44)
    want, _ = drain(_with(make_engine(models, mode), prompts))
    engine = _with(make_engine(models, mode), prompts)
    first = engine.step()  # some sequences are carried now
    carried = [(s.seq_id, list(s.response_ids), s.deferred_steps) for s in engine._buffer.carried]
    assert carried
    original = engine_module.log_step

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(engine_module, "log_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    assert [(s.seq_id, list(s.response_ids), s.deferred_steps) for s in engine._buffer.carried] == carried
    monkeypatch.setattr(engine_module, "log_step", original)
    got, _ = drain(engine)
    assert tokens(first.rollouts + got) == tokens(want)


# -- a real Ctrl-C during a streamed step ---------------------------------------------------------------


class _WatchedJoins(LaneExecutor):
    """OS threads, the engine's default, that tell when the caller waits in a lane's join (``joining``) and
    when an interrupt came out of that wait (``interrupted``): the test's Ctrl-C lands there, on events, not
    after a guess at how long the step takes."""

    def __init__(self) -> None:
        self.joining = threading.Event()
        self.interrupted = threading.Event()

    def start(self, target, name):
        thread, watch = super().start(target, name), self

        class Watched:
            def join(self) -> None:
                try:
                    watch.joining.set()
                    thread.join()
                except KeyboardInterrupt:
                    watch.interrupted.set()
                    raise

        return Watched()


def _where(thread_id: int) -> str:
    """Where a thread is, for a failure message: its Python stack, and what the kernel says of it (state,
    blocked, pending and caught signals, the system call it is in)."""
    thread = next(t for t in threading.enumerate() if t.ident == thread_id)
    task = pathlib.Path(f"/proc/self/task/{thread.native_id}")
    status = [x for x in (task / "status").read_text().splitlines() if x.startswith(("State", "Sig"))]
    frame = sys._current_frames().get(thread_id)
    stack = "".join(traceback.format_stack(frame)[-6:]) if frame is not None else "?"
    return f"{status} syscall={(task / 'syscall').read_text().split()[:1]} stack:\n{stack}"


@contextlib.contextmanager
def _ctrl_c_raises() -> Iterator[None]:
    """SIGINT raises ``KeyboardInterrupt`` in the main thread, as in a terminal, whatever this process was
    started with.

    NOTE: a process started with SIGINT ignored (a background job of a non-interactive shell, ``nohup``,
    some CI runners) keeps it ignored: Python installs its handler only over the default. There a Ctrl-C
    is rightly lost -- the engine leaves the process's signals alone -- and this test, run that way, saw
    no interrupt at all."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("mode", ["intra", "oppo"])
def test_a_real_sigint_while_the_scorer_lane_works_rolls_back_and_the_next_step_is_exact(models, mode):
    prompts = random_prompts(6, seed=45)
    rule = lambda p, r: float(len(r))  # noqa: E731
    want, _ = drain(_with(make_engine(dict(models, reward=rule), mode, batch_size=6), prompts))
    main = threading.get_ident()
    watch = _WatchedJoins()
    landed = []

    def slow_reward(prompt_ids, response_ids):
        calls.append(threading.current_thread().name)
        if not landed:
            # The actor is done once the main thread waits in the lane's join: the interrupt lands there,
            # while this reward still runs, and the reward returns only after the main thread has it.
            assert watch.joining.wait(60), "the main thread never waited for the scorer lane"
            before.append(f"handler={signal.getsignal(signal.SIGINT)} {_where(main)}")
            signal.pthread_kill(main, signal.SIGINT)
            landed.append(watch.interrupted.wait(10) or _where(main))
        return rule(prompt_ids, response_ids)

    engine = _with(make_engine(dict(models, reward=slow_reward), mode, batch_size=6), prompts)
    engine._loop.use_runtime(time.perf_counter, watch)
    threads = torch.get_num_threads()
    before: list[str] = []  # for a failure's message: where the main thread was, and its SIGINT handler
    calls: list[str] = []  # the threads the reward ran on
    unraisable = []
    hook, sys.unraisablehook = sys.unraisablehook, unraisable.append
    try:
        with _ctrl_c_raises():
            result = engine.step()
    except KeyboardInterrupt:
        pass
    else:
        lost = [(u.exc_type, u.object, u.err_msg) for u in unraisable]
        failed = [(r.finish_reason, r.error) for r in result.failed]
        pytest.fail(
            f"step() returned: the interrupt was lost. At the kill: {before}; after it: {landed}; reward "
            f"calls on {sorted(set(calls))} ({len(calls)}); unraisable: {lost}; failed: {failed}"
        )
    finally:
        sys.unraisablehook = hook
    assert landed == [True], f"the interrupt did not reach the main thread's wait for the lane: {landed}"
    assert not any(t.name == "oppo-scorer-lane" for t in threading.enumerate())
    assert engine._loop.scorer_lane._thread is None
    assert_all_pages_free(engine)
    assert torch.get_num_threads() == threads
    got, _ = drain(engine)
    assert tokens(got) == tokens(want)
    assert_all_pages_free(engine)


# -- checkpoints across modes ---------------------------------------------------------------------------


def _carrying(models, prompts, **cfg) -> tuple[RolloutEngine, list]:
    """An oppo engine after one step of B = 4 with Δ = 16: 16 sequences carried."""
    cfg = dict(batch_size=4, overcommit=16, max_policy_lag=None, max_new=12, **cfg)
    engine = _with(make_engine(models, "oppo", **cfg), prompts)
    first = engine.step().rollouts
    assert len(engine._buffer.carried) == 16
    return engine, first


@pytest.mark.parametrize("mode", ["sequential", "intra"])
def test_a_checkpoint_loaded_into_a_mode_that_cannot_carry_requeues_every_prompt(models, mode):
    prompts = random_prompts(20, seed=46)
    source, first = _carrying(models, prompts)
    state = source.state_dict()
    assert state["settings"] == dict(mode="oppo", overcommit=16, n=1, max_model_len=64, eos_token_ids=[EOS])
    target = make_engine(models, mode, batch_size=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restarted = target.load_state_dict(state)
    assert restarted == 16
    assert len([w for w in caught if "start over from their prompts" in str(w.message)]) == 1
    got, _ = drain(target)
    returned = sorted(map(tuple, (r.prompt_ids for r in first + got)))
    assert returned == sorted(map(tuple, prompts))  # all 20, each once
    assert all(r.deferred_steps == 0 for r in got)
    assert_all_pages_free(target)


@pytest.mark.parametrize(
    "other", [dict(max_model_len=48), dict(eos=(EOS, 5))], ids=["shorter_max_model_len", "other_eos_ids"]
)
def test_a_checkpoint_whose_settings_differ_restarts_its_carried_sequences(models, other):
    prompts = random_prompts(20, seed=47)
    source, first = _carrying(models, prompts)
    state = source.state_dict()
    target = RolloutEngine(
        **models,
        config=EngineConfig(batch_size=4, mode="oppo", overcommit=16, max_policy_lag=None, chunk_size=3,
                            page_size=8, max_model_len=other.get("max_model_len", 64)),
        sampling=SamplingParams(temperature=1.0, max_new_tokens=12, seed=7),
        eos_token_id=other.get("eos", EOS),
    )  # fmt: skip
    with pytest.warns(UserWarning, match="start over"):
        assert target.load_state_dict(state) == 16
    got, _ = drain(target)
    assert sorted(map(tuple, (r.prompt_ids for r in first + got))) == sorted(map(tuple, prompts))


def test_a_checkpoint_into_a_matching_engine_continues_its_carried_sequences(models):
    prompts = random_prompts(20, seed=48)
    source, first = _carrying(models, prompts)
    state = source.state_dict()
    want, _ = drain(source)
    target = make_engine(models, "inter", batch_size=4, overcommit=16, max_policy_lag=None, max_new=12)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert target.load_state_dict(state) == 0
    got, _ = drain(target)
    assert tokens(got) == tokens(want)  # tokens carried, continued exactly


@pytest.mark.parametrize("mode", ["oppo", "sequential"])
def test_a_state_saved_by_version_2_still_loads_and_loses_no_prompt(models, mode):
    fixture = json.loads((FIXTURES / "engine_state_v2.json").read_text())  # saved by the engine before
    state = fixture["state"]
    assert state["version"] == 2 and "settings" not in state and len(state["carried"]) == 4
    cfg = dict(overcommit=4, max_policy_lag=None, chunk_size=4) if mode == "oppo" else {}
    target = RolloutEngine(
        **models,
        config=EngineConfig(batch_size=2, mode=mode, max_model_len=64, page_size=8, **cfg),
        sampling=SamplingParams(temperature=1.0, max_new_tokens=14, seed=7),
        eos_token_id=EOS,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restarted = target.load_state_dict(state)
    assert restarted == (0 if mode == "oppo" else 4) and len(caught) == (0 if mode == "oppo" else 1)
    got, _ = drain(target)
    returned = sorted(map(tuple, fixture["returned"] + [r.prompt_ids for r in got]))
    assert returned == sorted(map(tuple, fixture["prompts"]))
    if mode == "oppo":  # carried on: the tokens saved are the start of what comes back
        saved = {tuple(d["prompt_ids"]): d["response_ids"] for d in state["carried"]}
        for r in got:
            if tuple(r.prompt_ids) in saved:
                assert r.response_ids[: len(saved[tuple(r.prompt_ids)])] == saved[tuple(r.prompt_ids)]


def test_a_checkpoint_whose_prompts_do_not_fit_is_refused_and_changes_nothing(models):
    engine = _with(make_engine(models, "sequential", max_model_len=64), [list(range(4, 44))])
    state = engine.state_dict()
    small = _with(make_engine(models, "sequential", max_model_len=32), [[5, 6, 7]])
    before = small.state_dict()
    with pytest.raises(ValueError, match="state: queued prompt 0 has 40 tokens"):
        small.load_state_dict(state)
    assert small.state_dict() == before


def test_a_failing_prompt_source_loses_none_of_the_prompts_taken_before_it(models):
    good = random_prompts(3, seed=49)

    def source():
        yield from good
        raise OSError("dataset shard unreadable")

    engine = make_engine(models, "sequential", batch_size=4)
    engine.set_prompt_source(source())
    with pytest.raises(OSError, match="unreadable"):
        engine.step()
    engine.set_prompt_source(iter(()))
    got, _ = drain(engine)
    assert sorted(r.prompt_ids for r in got) == sorted(good)
