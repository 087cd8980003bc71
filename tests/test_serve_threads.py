"""The public API's threading contract (docs/serve.md, "Which calls are thread-safe"): the calls that change
the engine's state run one at a time, a second one from any thread is refused with a ``RuntimeError``
naming the call in progress and changes nothing; ``add_prompts`` may be called from any thread at any time."""

from __future__ import annotations

import threading
import time

import pytest
from engine_models import EOS, make_actor, random_prompts

from oppo_engine import EngineConfig, RolloutEngine, SamplingParams

TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def actor():
    return make_actor()


def rule_reward(prompt, response) -> float:
    return float(len(response))


def make_engine(actor, mode="oppo", batch_size=4) -> RolloutEngine:
    extra = {"overcommit": 2} if mode in ("inter", "oppo") else {}
    if mode in ("intra", "oppo"):
        extra["chunk_size"] = 4
    return RolloutEngine(
        actor=actor, reward=rule_reward, eos_token_id=EOS,
        config=EngineConfig(batch_size=batch_size, mode=mode, max_model_len=96, page_size=8, **extra),
        sampling=SamplingParams(max_new_tokens=24, seed=3),
    )  # fmt: skip


def _join(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.join(TIMEOUT_S)
    assert not any(t.is_alive() for t in threads), "a thread did not finish: the engine hung"


@pytest.mark.parametrize("mode", ["sequential", "oppo"])
def test_two_threads_calling_step_get_every_prompt_exactly_once(actor, mode):
    engine = make_engine(actor, mode)
    prompts = random_prompts(24, seed=5)
    engine.add_prompts(prompts)
    returned, failed, refusals, errors = [], [], [], []
    lock = threading.Lock()

    def trainer() -> None:
        try:
            empty = 0
            while empty < 3:
                try:
                    result = engine.step()
                except RuntimeError as e:
                    with lock:
                        refusals.append(str(e))
                    time.sleep(0.001)
                    continue
                with lock:
                    returned.extend(result.rollouts)
                    failed.extend(result.failed)
                empty = empty + 1 if not result.rollouts else 0
        except BaseException as e:  # surfaced by the main thread's asserts
            errors.append(e)

    threads = [threading.Thread(target=trainer, name=f"trainer-{i}", daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    _join(threads)
    assert not errors, errors
    assert not failed, [r.error for r in failed]
    assert sorted(r.group_id for r in returned) == list(range(len(prompts)))
    assert all(list(r.prompt_ids) == prompts[r.group_id] for r in returned)
    assert refusals, "the two threads never overlapped: the test proved nothing"
    expected = "RolloutEngine.step() was called while RolloutEngine.step() is in progress"
    assert all(expected in m for m in refusals)
    stats = engine.cache_stats()
    assert stats.free_pages == stats.total_pages
    engine.close()


def test_each_guarded_call_is_refused_while_step_runs_and_names_it(actor):
    engine = make_engine(actor, "sequential")
    engine.add_prompts(random_prompts(4, seed=7))
    entered, leave = threading.Event(), threading.Event()
    real_forward = engine._loop.actor.forward

    def slow_forward(*args, **kwargs):  # holds the step open until the main thread has tried every call
        entered.set()
        assert leave.wait(TIMEOUT_S)
        return real_forward(*args, **kwargs)

    engine._loop.actor.forward = slow_forward
    box = {}
    stepper = threading.Thread(target=lambda: box.setdefault("result", engine.step()), daemon=True)
    stepper.start()
    try:
        assert entered.wait(TIMEOUT_S)
        for call in (engine.step, engine.update_policy, engine.release_memory, engine.resume, engine.close,
                     lambda: engine.load_state_dict({})):  # fmt: skip
            with pytest.raises(RuntimeError, match=r"while RolloutEngine\.step\(\) is in progress"):
                call()
        engine.add_prompts(random_prompts(2, seed=8))  # any thread, any time
    finally:
        leave.set()
        engine._loop.actor.forward = real_forward
        _join([stepper])
    assert len(box["result"].rollouts) == 4 and not box["result"].failed
    assert engine.policy_version == 0  # the refused update_policy() changed nothing
    assert len(engine.step().rollouts) == 2  # the prompts queued during the step come next
    engine.close()
    engine.close()  # idempotent once the guard is free


def test_add_prompts_from_many_threads_queues_every_prompt_once(actor):
    engine = make_engine(actor, "oppo")
    prompts = random_prompts(32, seed=9)
    stop = threading.Event()
    returned = []

    def stepper() -> None:
        while not stop.is_set() or len(returned) < len(prompts):
            returned.extend(engine.step().rollouts)
            if len(returned) >= len(prompts):
                return

    def adder(part: list[list[int]]) -> None:
        for p in part:
            engine.add_prompts([p])

    adders = [threading.Thread(target=adder, args=(prompts[i::4],), daemon=True) for i in range(4)]
    s = threading.Thread(target=stepper, daemon=True)
    for t in [*adders, s]:
        t.start()
    _join(adders)
    stop.set()
    _join([s])
    assert sorted(tuple(r.prompt_ids) for r in returned) == sorted(tuple(p) for p in prompts)
    engine.close()


def _env_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("oppo-env")]


def _wait_until(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def _env_engine(actor) -> RolloutEngine:
    from envs import EnvLog, scripted

    return RolloutEngine(
        actor=actor, reward=rule_reward, eos_token_id=EOS, env=scripted(EnvLog()),
        config=EngineConfig(batch_size=2, mode="oppo", overcommit=2, chunk_size=4, max_model_len=96,
                            page_size=8),
        sampling=SamplingParams(max_new_tokens=24, seed=3, turn_stop_token_ids=(9,), max_turn_tokens=6),
    )  # fmt: skip


def test_a_dropped_engine_leaves_no_environment_thread_after_gc(actor):
    import gc

    assert _wait_until(lambda: not _env_threads())  # none left by earlier tests
    engine = _env_engine(actor)
    engine.add_prompts(random_prompts(4, seed=11))
    assert engine.step().rollouts
    assert _env_threads()
    del engine
    gc.collect()
    assert _wait_until(lambda: not _env_threads()), _env_threads()


def test_idle_environment_workers_exit_and_come_back_when_needed(actor, monkeypatch):
    from oppo_engine.env import pool

    monkeypatch.setattr(pool, "IDLE_EXIT_S", 0.2)
    engine = _env_engine(actor)
    engine.add_prompts(random_prompts(4, seed=12))
    first = engine.step()
    assert _wait_until(lambda: not [n for n in _env_threads() if "worker" in n])
    engine.add_prompts(random_prompts(4, seed=13))
    returned = list(first.rollouts)
    deadline = time.monotonic() + TIMEOUT_S
    while len(returned) < 8 and time.monotonic() < deadline:
        returned += engine.step().rollouts
    assert len(returned) == 8  # later calls started workers again
    engine.close()


def test_an_interrupt_while_the_guard_is_being_entered_does_not_leave_it_held(monkeypatch):
    import oppo_engine.guard as guard_module
    from oppo_engine.guard import CallGuard, exclusive

    class Engine:
        def __init__(self) -> None:
            self._guard = CallGuard()

        @exclusive
        def step(self) -> str:
            return "stepped"

    class Interrupted:  # the guard module's ``threading``: a KeyboardInterrupt right after the lock is taken
        @staticmethod
        def current_thread():
            raise KeyboardInterrupt

    engine = Engine()
    monkeypatch.setattr(guard_module, "threading", Interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    monkeypatch.undo()
    assert engine.step() == "stepped"  # not refused: the interrupted call let go of the guard
