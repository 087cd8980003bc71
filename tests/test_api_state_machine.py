"""The public API under a hypothesis state machine, over tiny real models (random-init Qwen2s).

Rules: add_prompts (valid and invalid), step, update_policy, report_reward, release_memory / resume,
state_dict + load_state_dict into a fresh engine, close, every call after close. Invariants: a call raises
only what docs/reliability.md ("What each call raises") says it raises then (``EXPECTED``); the engine
stays usable after a refused call; no page is held but by a carried sequence; every accepted prompt comes
back exactly once over the run (or is quarantined with its reason), which ``teardown`` checks by draining
the engine.

Loads into another mode: a state that records the settings its carried sequences depend on (``settings``,
issue 19) loads into any mode; one that carries sequences without them (version 2) into the same mode.
"""

from __future__ import annotations

from collections import Counter

import hypothesis.strategies as st
import pytest
from engine_models import VOCAB, make_actor, make_reward
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from oppo_engine import EngineConfig, RolloutEngine, SamplingParams

MODES = ("sequential", "intra", "inter", "oppo")
MAX_MODEL_LEN = 24
MAX_NEW = 4

# docs/reliability.md ("What each call raises"): the only exceptions each call may raise, by state.
EXPECTED = {
    ("add_prompts", "closed"): RuntimeError,
    ("add_prompts", "released"): RuntimeError,
    ("add_prompts", "bad input"): ValueError,
    ("add_prompts", "bad type"): TypeError,
    ("step", "closed"): RuntimeError,
    ("step", "released"): RuntimeError,
    ("step", "bad source"): (TypeError, ValueError),  # a bad prompt from the prompt source
    ("update_policy", "closed"): RuntimeError,
    ("report_reward", "closed"): RuntimeError,
    ("resume", "closed"): RuntimeError,
    ("state_dict", "closed"): RuntimeError,
    ("load_state_dict", "closed"): RuntimeError,
    ("load_state_dict", "bad state"): ValueError,
    ("cache_stats", "closed"): RuntimeError,
    ("set_prompt_source", "closed"): RuntimeError,
}
RULE_COUNTS: Counter = Counter()

_MODELS: dict = {}


def _models():
    if not _MODELS:
        _MODELS["actor"], _MODELS["reward"] = make_actor(), make_reward()
    return _MODELS["actor"], _MODELS["reward"]


def _build(mode: str, n: int) -> RolloutEngine:
    actor, reward = _models()
    over = {"overcommit": 2 * n} if mode in ("inter", "oppo") else {}  # sequences are carried over
    return RolloutEngine(
        actor=actor,
        reward=reward,
        config=EngineConfig(batch_size=2 * n, mode=mode, page_size=8, max_model_len=MAX_MODEL_LEN, **over),
        sampling=SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW, seed=0, n=n),
        eos_token_id=3,
    )


prompt = st.lists(st.integers(4, VOCAB - 1), min_size=1, max_size=8)
BAD_INPUTS = ("empty", "out_of_vocab", "too_long", "sampling_length", "sampling_n")
BAD_TYPES = ("not_params", "sampling_str", "text", "floats", "bools", "nested_mapping")
# Items of a prompt source that step() refuses: (TypeError) and (ValueError) ones.
BAD_ITEMS = {"text": "hello", "floats": [5.0, 6.0], "empty": [], "out_of_vocab": [VOCAB]}


class EngineMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.engine: RolloutEngine | None = None
        self.engines: list[RolloutEngine] = []

    # -- bookkeeping ------------------------------------------------------------------------------------

    def _state(self) -> str:
        if self.closed:
            return "closed"
        return "released" if self.released else "open"

    def _call(self, name: str, fn, *, state: str | None = None):
        """Run a call: ``(True, result)``, or ``(False, None)`` if it raised the exception ``EXPECTED`` names
        for this state (any other is a failure)."""
        RULE_COUNTS[name] += 1
        state = state or self._state()
        expected = EXPECTED.get((name, state))
        try:
            out = fn()
        except Exception as e:
            if expected is None or not isinstance(e, expected):
                raise AssertionError(f"{name} in state {state!r} raised {type(e).__name__}: {e}") from e
            RULE_COUNTS[f"{name} refused"] += 1
            return False, None
        if expected is not None and state != "open":
            raise AssertionError(f"{name} in state {state!r} did not raise {expected}")
        return True, out

    def _record(self, result) -> None:
        for r in result.rollouts:
            key = (self.epoch, r.group_id, r.sample_index)
            self.returned[key] += 1
            assert self.returned[key] == 1, f"prompt {r.group_id} sample {r.sample_index} returned twice"
            assert r.prompt_ids == self.accepted[(self.epoch, r.group_id)]
            assert 1 <= len(r.response_ids) <= MAX_NEW
        for r in getattr(result, "failed", []):
            assert r.finish_reason == "error" and r.error
            self.quarantined.add((self.epoch, r.group_id, r.sample_index))

    # -- rules ------------------------------------------------------------------------------------------

    @initialize(mode=st.sampled_from(MODES), n=st.sampled_from((1, 2)))
    def start(self, mode: str, n: int) -> None:
        self.mode, self.n = mode, n
        self.engine = _build(mode, n)
        self.engines.append(self.engine)
        self.closed = self.released = False
        self.epoch = 0
        self.accepted: dict[tuple[int, int], list[int]] = {}  # (epoch, prompt index) -> prompt
        self.next_index = 0
        self.returned: Counter = Counter()
        self.quarantined: set = set()
        self.steps = 0

    @rule(prompts=st.lists(prompt, min_size=1, max_size=5))
    def add_prompts(self, prompts) -> None:
        ok, _ = self._call("add_prompts", lambda: self.engine.add_prompts(prompts))
        if ok:
            for p in prompts:
                self.accepted[(self.epoch, self.next_index)] = p
                self.next_index += 1

    @rule(kind=st.sampled_from(BAD_INPUTS))
    def add_bad_prompts(self, kind: str) -> None:
        good = [5, 6, 7]
        calls = {
            "empty": lambda: self.engine.add_prompts([good, []]),
            "out_of_vocab": lambda: self.engine.add_prompts([good, [VOCAB]]),
            "too_long": lambda: self.engine.add_prompts([good, [5] * MAX_MODEL_LEN]),
            "sampling_length": lambda: self.engine.add_prompts([good], [SamplingParams(n=self.n)] * 2),
            "sampling_n": lambda: self.engine.add_prompts([good], [SamplingParams(n=self.n + 1)]),
            "not_params": lambda: self.engine.add_prompts([good], [None]),
        }
        state = "bad input" if self._state() == "open" else None
        ok, _ = self._call("add_prompts", calls[kind], state=state)
        RULE_COUNTS[f"add_prompts bad: {kind}"] += 1
        assert not ok

    @rule(kind=st.sampled_from(BAD_TYPES))
    def add_prompts_of_a_bad_type(self, kind: str) -> None:
        good = [5, 6, 7]
        calls = {
            "not_params": lambda: self.engine.add_prompts([good], [None]),
            "sampling_str": lambda: self.engine.add_prompts([good], "greedy"),
            "text": lambda: self.engine.add_prompts([good, "hello"]),
            "floats": lambda: self.engine.add_prompts([good, [5.0, 6.0]]),
            "bools": lambda: self.engine.add_prompts([good, [True, False]]),
            "nested_mapping": lambda: self.engine.add_prompts([good, {"input_ids": {"a": [5]}}]),
        }
        state = "bad type" if self._state() == "open" else None
        ok, _ = self._call("add_prompts", calls[kind], state=state)
        RULE_COUNTS[f"add_prompts bad type: {kind}"] += 1
        assert not ok

    def _nothing_queued(self) -> bool:
        prompts = self.engine._prompts
        return not (prompts.requeued or prompts._pending or prompts._source)

    @precondition(lambda self: self._state() == "open" and self._nothing_queued())
    @rule(kind=st.sampled_from(sorted(BAD_ITEMS)))
    def step_over_a_bad_prompt_source(self, kind: str) -> None:
        """The source's good prompt is taken, its bad one refused by the step: the good one stays first."""
        good = [5, 6, 7]
        self._call("set_prompt_source", lambda: self.engine.set_prompt_source(iter([good, BAD_ITEMS[kind]])))
        self.accepted[(self.epoch, self.next_index)] = good
        self.next_index += 1
        ok, _ = self._call("step", self.engine.step, state="bad source")
        RULE_COUNTS[f"step bad source: {kind}"] += 1
        assert not ok

    @rule(times=st.integers(1, 3))
    def step(self, times: int) -> None:
        for _ in range(times):
            ok, result = self._call("step", self.engine.step)
            if not ok:
                return
            assert len(result.rollouts) <= 2 * self.n
            self._record(result)
            self.steps += 1

    @rule(then_step=st.booleans())
    def update_policy(self, then_step: bool) -> None:
        self._call("update_policy", self.engine.update_policy)
        if then_step:
            self.step(1)

    @rule(x=st.floats(-5, 5))
    def report_reward(self, x: float) -> None:
        self._call("report_reward", lambda: self.engine.report_reward(x))

    @rule()
    def release_memory(self) -> None:
        self._call("release_memory", self.engine.release_memory)
        self.released = not self.closed

    @rule()
    def resume(self) -> None:
        self._call("resume", self.engine.resume)
        self.released = False

    @rule(then_step=st.booleans())
    def cache_stats(self, then_step: bool) -> None:
        self._call("cache_stats", self.engine.cache_stats)
        if then_step:
            self.step(1)

    @rule(mode=st.sampled_from(MODES), then_step=st.booleans())
    def checkpoint_into_fresh_engine(self, mode: str, then_step: bool) -> None:
        ok, state = self._call("state_dict", self.engine.state_dict)
        if not ok:
            return
        records_settings = "mode" in state or "settings" in state
        if state["carried"] and not records_settings:
            mode = self.mode
        if state["carried"] and mode != self.mode:
            RULE_COUNTS["load_state_dict: carried into another mode"] += 1
        fresh = _build(mode, self.n)
        self.engines.append(fresh)
        RULE_COUNTS["load_state_dict"] += 1
        fresh.load_state_dict(state)
        self.engine.close()
        self.engine, self.mode, self.released = fresh, mode, False
        if then_step:
            self.step(1)

    @rule()
    def load_a_state_of_another_group_size(self) -> None:
        if self.closed:
            return
        other = _build(self.mode, 3 - self.n)
        self.engines.append(other)
        # Per-prompt params record n in the state (a pending prompt without them does not: README)
        other.add_prompts([[5, 6, 7]], [SamplingParams(max_new_tokens=MAX_NEW, n=3 - self.n)])
        state = other.state_dict()
        other.close()
        self._call("load_state_dict", lambda: self.engine.load_state_dict(state), state="bad state")

    @precondition(lambda self: self.steps >= 3)  # a run mostly exercises an open engine
    @rule()
    def close(self) -> None:
        self._call("close", self.engine.close)
        self.closed = True

    @precondition(lambda self: self.closed)
    @rule(call=st.sampled_from(
        ("add_prompts", "step", "update_policy", "report_reward", "resume", "state_dict", "cache_stats",
         "set_prompt_source", "release_memory", "close")
    ))  # fmt: skip
    def call_after_close(self, call: str) -> None:
        e = self.engine
        fns = {
            "add_prompts": lambda: e.add_prompts([[5]]),
            "step": e.step,
            "update_policy": e.update_policy,
            "report_reward": lambda: e.report_reward(0.0),
            "resume": e.resume,
            "state_dict": e.state_dict,
            "cache_stats": e.cache_stats,
            "set_prompt_source": lambda: e.set_prompt_source(iter(())),
            "release_memory": e.release_memory,
            "close": e.close,
        }
        self._call(call, fns[call])

    @precondition(lambda self: self.closed)
    @rule(mode=st.sampled_from(MODES))
    def new_engine(self, mode: str) -> None:
        """A closed engine dropped what it held (by contract); the run goes on with a new one."""
        self._forget_outstanding()
        self.engine = _build(mode, self.n)
        self.engines.append(self.engine)
        self.mode, self.closed, self.released = mode, False, False
        self.epoch += 1
        self.next_index = self.steps = 0

    def _forget_outstanding(self) -> None:
        for key in [k for k in self.accepted if k[0] == self.epoch]:
            for j in range(self.n):
                self.returned.setdefault((*key, j), 1)

    # -- invariants -------------------------------------------------------------------------------------

    @invariant()
    def no_page_held_but_for_carried_sequences(self) -> None:
        if self.engine is None or self.closed:
            return
        stats = self.engine.cache_stats()
        used = stats.total_pages - stats.free_pages
        if self.released:
            assert used == 0
            return
        assert used == sum(stats.pages_per_model.values()), stats
        assert used <= stats.retained_pages, stats
        if not self.engine._buffer.carried:
            assert used == 0, stats

    def teardown(self) -> None:
        """Drain the engine: every accepted prompt's samples come back exactly once (or quarantined)."""
        try:
            if self.engine is not None and not self.closed:
                self.engine.resume()
                for _ in range(200):
                    result = self.engine.step()
                    self._record(result)
                    if not result.rollouts and not getattr(result, "failed", []):
                        break
                stats = self.engine.cache_stats()
                assert stats.free_pages == stats.total_pages, stats
            else:
                self._forget_outstanding()
            for g, j in [(k, j) for k in self.accepted for j in range(self.n) if k[0] == self.epoch]:
                key = (*g, j)
                assert self.returned[key] == 1 or key in self.quarantined, f"prompt {g} sample {j} lost"
        finally:
            for e in self.engines:
                e.close()


TestEngineMachine = EngineMachine.TestCase
TestEngineMachine.settings = settings(
    max_examples=30,
    stateful_step_count=30,
    deadline=None,
    derandomize=True,  # CI runs the same examples every time; a failure replays
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(scope="module", autouse=True)
def _report_rule_counts():
    yield
    print("\nstate machine rule counts:", dict(sorted(RULE_COUNTS.items())))
