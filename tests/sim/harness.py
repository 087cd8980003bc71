"""One simulated schedule: a random workload drawn from a seed, run on the real engine under the seeded
executor with the stand-in models, every invariant checked after every unit and every step.

``run_schedule(seed)`` returns a ``Report`` or raises ``SimFailure`` naming the seed, the broken invariant
and the trace of the last units, so ``python -m tests.sim --seed N`` replays it.

Progress bound. A step's sequences hold at most ``S = B + Δ_max`` sequences of at most ``L =
max_model_len`` tokens, prefilled by ``1 + m`` models (``m`` streamed scorers). Without preemption every
forward advances some sequence by a token in some model, so ``(1 + m)·S·L`` forwards finish the step;
preemption and recomputation multiply that by a small factor. The bound is ``PROGRESS_FACTOR·(1+m)·S·L``
model forwards (plus ``POLL_UNITS`` other units); a step past it is reported as a livelock.
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from dataclasses import dataclass, field

from oppo_engine import EngineConfig, RolloutEngine, SamplingParams
from oppo_engine.cache.arena import KVSpec, fit_page_size, page_bytes_for
from oppo_engine.obs import StepMetrics
from oppo_engine.sched.results import StepResult
from oppo_engine.sim.executor import Policy, SimClock, SimExecutor
from oppo_engine.sim.standin import (
    Costs,
    EnvSpec,
    Faults,
    InjectedFault,
    Oracle,
    StandInActor,
    StandInEnv,
    StandInScorer,
)

from .models import EOS, VOCAB, sim_models

PROGRESS_FACTOR = 4
POLL_UNITS = 20_000
MODES = ("sequential", "intra", "inter", "oppo")
_TAGS = {"reward": 2, "ref_logprobs": 3, "values": 4}
# Poison prompts (every forward holding one fails) run once steps quarantine their culprit into
# StepResult.failed (issue 19); before that such a prompt blocks every later step, by contract.
QUARANTINE = "failed" in StepResult.__dataclass_fields__ and "retries" in StepMetrics.__dataclass_fields__


class Livelock(BaseException):
    """A step ran past the progress bound."""


class InvariantViolation(BaseException):
    """A page or sequence invariant broke after a unit or a step."""


class SimFailure(AssertionError):
    """A schedule broke an invariant: its seed, the failure and the trace of its last units."""

    def __init__(self, seed: int, workload: Workload, error: BaseException, trace: list) -> None:
        self.seed, self.workload, self.error, self.trace = seed, workload, error, trace
        lines = "\n".join(f"  unit {u} t={t} {lane}: {what}" for u, t, lane, what in trace)
        super().__init__(
            f"seed {seed}: {type(error).__name__}: {error}\n{workload}\nlast units:\n{lines}\n"
            f"replay: python -m tests.sim --seed {seed}"
        )


@dataclass
class Workload:
    """What one seed runs: the engine's settings, its prompts, the schedule policy, the faults and the
    actions between steps."""

    seed: int
    mode: str
    n: int
    batch_size: int
    overcommit: int | str
    max_deferrals: int
    retained_kv: str
    chunk_size: int | str
    page_size: int
    max_model_len: int
    max_new_tokens: int
    budget: int
    reward: str  # "model" or "rule"
    reference: bool
    critic: bool
    extra_pages: int
    prompts: list[list[int]]
    policy: str
    event_latency: float
    mean_len: float
    p_long: float
    fail_forward_at: int | None
    interrupt_at: int | None
    p_update: float
    p_release: float
    p_reload: float
    p_report: float
    late_prompts: int  # prompts added after the first step
    poison: bool  # one prompt's every forward fails (only where steps quarantine: QUARANTINE)
    poison_role: str  # the model whose forwards the poison prompt fails, or "every" model
    max_policy_lag: int | None  # inter, oppo; None elsewhere (the knob is refused there)
    # Multi-turn episodes (drawn after every field above: their draws stay those of the seeds on record)
    env: EnvSpec | None = None
    max_turn_tokens: int | None = None
    max_turns: int | None = None
    env_timeout_s: float | None = None
    # Set by a caller, never drawn (the draws stay those of the seeds on record): None is the default.
    shared_prefix_min_tokens: int | None = None

    @classmethod
    def draw(cls, seed: int) -> Workload:
        r = random.Random(seed)
        mode = r.choice(MODES)
        n = r.choice((1, 1, 1, 2, 2, 3, 4))
        batch_size = n * r.randint(1, 4)
        over = mode in ("inter", "oppo")
        overcommit: int | str = (n * r.randint(0, 3) if r.random() < 0.85 else "auto") if over else "auto"
        max_model_len = r.choice((12, 16, 24, 32, 48, 64))
        num_groups = r.randint(1, 3 * batch_size // n + 2)
        prompts = []
        for _ in range(num_groups):
            length = min(max_model_len - 1, 1 + int(r.expovariate(1 / r.choice((2, 4, 8)))))
            prompts.append([r.randrange(4, VOCAB) for _ in range(length)])
        late = r.randint(0, len(prompts) // 2) if r.random() < 0.3 else 0
        w = cls(
            seed=seed,
            mode=mode,
            n=n,
            batch_size=batch_size,
            overcommit=overcommit,
            max_deferrals=r.randint(1, 4) if over else 4,
            retained_kv=r.choice(("recompute", "reuse")) if over else "recompute",
            chunk_size=r.choice((1, 2, 3, 4, 8, 16)) if mode in ("intra", "oppo") else "auto",
            page_size=r.choice((8, 8, 16)),
            max_model_len=max_model_len,
            max_new_tokens=r.randint(1, max_model_len),
            budget=r.choice((4, 8, 16, 64, 4096)),
            reward=r.choice(("model", "model", "rule")),
            reference=r.random() < 0.3,
            critic=r.random() < 0.3,
            extra_pages=r.choice((0, 0, 1, 2, 4, r.randint(0, 64))),
            prompts=prompts,
            policy=r.choice(Policy.KINDS),
            event_latency=r.choice((0.0, 0.0005, 0.003, 0.05)),
            mean_len=r.choice((2.0, 6.0, 16.0)),
            p_long=r.choice((0.0, 0.1, 0.3)),
            fail_forward_at=r.randint(1, 60) if r.random() < 0.25 else None,
            interrupt_at=r.randint(1, 300) if r.random() < 0.2 else None,
            p_update=r.choice((0.0, 0.5, 1.0)),
            p_release=r.choice((0.0, 0.0, 0.2)),
            p_reload=r.choice((0.0, 0.0, 0.15)),
            p_report=r.choice((0.0, 0.2)),
            late_prompts=late,
            poison=r.random() < 0.15,  # drawn last: the draws above stay those of the seeds on record
            poison_role="actor",
            max_policy_lag=None,
        )
        # Drawn after the fields above, so that those stay the draws of the seeds on record.
        w.poison_role = r.choice([*w.roles(), "every"])
        if over:
            # While a lag is set the engine refuses a fixed Δ above B (an "auto" Δ stays within B/4).
            fits = not isinstance(overcommit, int) or overcommit <= batch_size
            lag = r.choice((None, 1, 2, 3))
            w.max_policy_lag = lag if fits else None
        if r.random() < 0.35:  # multi-turn episodes with a seeded environment
            p_hang = r.choice((0.0, 0.0, 0.1))
            w.env = EnvSpec(
                seed=seed, vocab=VOCAB, max_turns=r.randint(1, 4), max_obs=r.choice((0, 1, 3, 6)),
                latency=r.choice((0.0, 1e-4, 3e-3, 0.05, 0.5)), p_fail=r.choice((0.0, 0.0, 0.05, 0.2)),
                p_hang=p_hang,
            )  # fmt: skip
            w.max_turn_tokens = r.choice((1, 2, 3, 5))
            w.max_turns = r.choice((None, None, 2, 3))
            # Far between the longest latency (1 s) and a hang (1e6 s), and past what one step's progress
            # bound of forwards can cost (a starved worker's call never times out): see EnvSpec.
            w.env_timeout_s = 100.0 if p_hang else r.choice((None, 100.0))
        return w

    def roles(self) -> list[str]:
        """The models whose forwards can fail: the actor and the scorers (a rule reward runs none)."""
        scorers = {"reward": self.reward == "model", "ref_logprobs": self.reference, "values": self.critic}
        return ["actor"] + [name for name, on in scorers.items() if on]

    def config(self, kv_cache_bytes: int) -> EngineConfig:
        over = self.mode in ("inter", "oppo")
        kwargs = dict(
            batch_size=self.batch_size,
            mode=self.mode,
            page_size=self.page_size,
            kv_cache_bytes=kv_cache_bytes,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=self.budget,
        )
        if over:
            kwargs.update(
                overcommit=self.overcommit,
                max_deferrals=self.max_deferrals,
                retained_kv=self.retained_kv,
                max_policy_lag=self.max_policy_lag,
            )
        if self.mode in ("intra", "oppo"):
            kwargs.update(chunk_size=self.chunk_size)
        if self.env is not None:
            kwargs.update(env_timeout_s=self.env_timeout_s)
        if self.shared_prefix_min_tokens is not None:
            kwargs.update(shared_prefix_min_tokens=self.shared_prefix_min_tokens)
        return EngineConfig(**kwargs)

    def sampling(self) -> SamplingParams:
        turns = dict(max_turn_tokens=self.max_turn_tokens, max_turns=self.max_turns) if self.env else {}
        return SamplingParams(temperature=1.0, max_new_tokens=self.max_new_tokens, seed=self.seed, n=self.n,
                              **turns)  # fmt: skip


@dataclass
class Report:
    """What a schedule did."""

    seed: int
    steps: int = 0
    failed_steps: int = 0
    units: int = 0
    forwards: int = 0
    rollouts: int = 0
    quarantined: int = 0
    max_forward_ratio: float = 0.0  # forwards of the worst step over its bound's (1+m)·S·L
    env_calls: int = 0  # environment step() calls answered (multi-turn workloads)
    env_failed: int = 0  # rollouts failed by their environment (an error, or a hang past the timeout)
    env_timeouts: int = 0
    shared_tokens: int = 0  # prompt tokens forked rather than prefilled, every model (StepMetrics)
    notes: list[str] = field(default_factory=list)


class Sim:
    """The simulated world of one schedule: clock, executor, stand-ins and the checks."""

    def __init__(self, w: Workload) -> None:
        self.w = w
        self.rng = random.Random(w.seed ^ 0x5EED)
        self.clock = SimClock()
        self.ex = SimExecutor(self.rng, self.clock, Policy(w.policy, self.rng), on_unit=self._on_unit)
        self.ex.interrupt_at = w.interrupt_at
        self.faults = Faults()
        self.faults.fail_at = w.fail_forward_at
        if QUARANTINE and w.poison:
            self.faults.poison_prompt = w.seed % len(w.prompts)
            self.faults.poison_role = w.poison_role
        self.oracle = Oracle(
            vocab=VOCAB, eos=EOS, mean_len=w.mean_len, long_len=w.max_model_len, p_long=w.p_long
        )
        self.engine: RolloutEngine | None = None
        self.forward_limit: int | None = None
        self.unit_limit: int | None = None
        self.models = sim_models()

    # -- building ---------------------------------------------------------------------------------------

    def _model_kwargs(self) -> dict:
        m = self.models
        return dict(
            actor=m.actor,
            reward=m.reward if self.w.reward == "model" else self.oracle.reward,
            reference=m.reference if self.w.reference else None,
            critic=m.critic if self.w.critic else None,
        )

    def min_pages(self) -> tuple[int, int]:
        """The arena's page bytes and the fewest pages the engine accepts for this workload."""
        kw = self._model_kwargs()
        specs = [KVSpec.from_hf_config(v.config, v.dtype) for v in kw.values() if hasattr(v, "config")]
        page_bytes = page_bytes_for(dict(enumerate(specs)), self.w.page_size)
        one = sum(-(-self.w.max_model_len // fit_page_size(s, page_bytes)) for s in specs)
        return page_bytes, max(one, self.w.batch_size)

    def build(self) -> RolloutEngine:
        w = self.w
        page_bytes, pages = self.min_pages()
        env = w.env
        engine = RolloutEngine(
            **self._model_kwargs(),
            config=w.config((pages + w.extra_pages) * page_bytes),
            sampling=w.sampling(),
            eos_token_id=EOS,
            env=None if env is None else (lambda: StandInEnv(env, self.ex)),
        )
        loop = engine._loop
        sched = loop.actor_sched
        costs = lambda: Costs(self.rng, self.rng.uniform(1e-4, 2e-3), self.rng.uniform(1e-6, 1e-4))  # noqa: E731
        loop.actor = StandInActor(
            self.oracle,
            sched.cache,
            lambda: {s.seq_id: s for s in sched.running},
            self.clock,
            costs(),
            self.faults,
        )
        loop.actor.note = self.ex.note
        lane = loop.scorer_lane
        for name, ssched in lane.scheds.items():
            old = ssched.scorer
            ssched.scorer = StandInScorer(
                old.field,
                ssched.cache,
                _TAGS[old.field],
                self.oracle,
                lambda s=ssched: {q.seq_id: q for q in s.active},
                self.clock,
                costs(),
                self.faults,
            )
            ssched.scorer.note = self.ex.note
            lane.scorers[lane.scorers.index(old)] = ssched.scorer
            del name
        for cache in engine._caches.values():
            cache.free_event = self._free_event
        loop.use_runtime(self.clock, self.ex)
        self.engine = engine
        self.num_streamed = len(lane.scheds)
        return engine

    def _free_event(self):
        w = self.w.event_latency
        return self.ex.event(self.rng.uniform(0, w) if w else 0.0)

    # -- invariants after every unit --------------------------------------------------------------------

    def _on_unit(self) -> None:
        ex = self.ex
        if self.forward_limit is not None and ex.forwards > self.forward_limit:
            self.forward_limit = None
            raise Livelock(f"a step ran past its bound of {self.bound} model forwards")
        if self.unit_limit is not None and ex.units > self.unit_limit:
            self.unit_limit = None
            raise Livelock(f"a step ran past {self.bound + POLL_UNITS} units")
        check_pages(self.engine)

    def step_bound(self) -> int:
        """The progress bound of one step (module docstring)."""
        w = self.w
        over = w.mode in ("inter", "oppo")
        delta_max = (
            (w.overcommit if isinstance(w.overcommit, int) else self.engine._max_overcommit) if over else 0
        )
        return (1 + self.num_streamed) * (w.batch_size + delta_max) * w.max_model_len


def check_pages(engine: RolloutEngine) -> None:
    """Every page is free, pending (a deferred free), or referenced exactly once per holding sequence."""
    arena = engine._arena
    if arena is None or arena.released:
        return
    holders = Counter()
    for name, cache in engine._caches.items():
        distinct = set()
        for seq_id in cache.seq_ids:
            pages = cache.pages(seq_id)
            holders.update(pages)
            distinct.update(pages)
        if arena.pages_held(name) != len(distinct):
            raise InvariantViolation(
                f"{name}: arena counts {arena.pages_held(name)} pages held, sequences {len(distinct)}"
            )
    # NOTE: a page neither held nor pending but not free (a leak) shows in the count; a page held but
    # freed (a double free) in its reference count.
    refcount = arena.allocator.refcount
    for p, h in holders.items():
        rc = refcount(p)
        if rc != h:
            raise InvariantViolation(f"page {p}: reference count {rc}, {h} holders")
    free, pending = arena.num_free_pages(), arena.num_pending_pages
    if free + pending + len(holders) != arena.num_pages:
        raise InvariantViolation(
            f"{free} pages free, {pending} pending and {len(holders)} held of {arena.num_pages}: "
            f"{arena.num_pages - free - pending - len(holders)} leaked"
        )


def run_schedule(seed: int, **changes) -> Report:
    """Run the workload of ``seed`` (with ``changes`` to its fields); raise ``SimFailure`` on any broken
    invariant."""
    w = dataclasses.replace(Workload.draw(seed), **changes)
    sim = Sim(w)
    try:
        return _run(sim)
    except SimFailure:
        raise
    except BaseException as e:  # noqa: BLE001  (every failure is reported with its seed)
        if isinstance(e, KeyboardInterrupt) and "injected" not in str(e):
            raise
        raise SimFailure(seed, w, e, list(sim.ex.trace)) from e
    finally:
        sim.ex.closed = True
        if sim.engine is not None:
            sim.engine.close()


def _run(sim: Sim) -> Report:
    from .checks import Ledger  # noqa: PLC0415

    w = sim.w
    report = Report(w.seed)
    engine = sim.build()
    first, late = w.prompts[: len(w.prompts) - w.late_prompts], w.prompts[len(w.prompts) - w.late_prompts :]
    ledger = Ledger(sim, engine)
    ledger.add(first)
    r = sim.rng
    max_steps = 4 * len(w.prompts) * w.n + 20
    for _ in range(max_steps):
        engine = sim.engine
        before = ledger.snapshot()
        bound = sim.bound = sim.step_bound()
        sim.forward_limit = sim.ex.forwards + PROGRESS_FACTOR * bound
        sim.unit_limit = sim.ex.units + PROGRESS_FACTOR * bound + POLL_UNITS
        forwards0 = sim.ex.forwards
        try:
            result = engine.step()
        except (InjectedFault, KeyboardInterrupt) as e:
            if isinstance(e, KeyboardInterrupt) and "injected" not in str(e):
                raise
            report.failed_steps += 1
            ledger.check_restored(before)
            continue
        finally:
            sim.forward_limit = sim.unit_limit = None
        report.steps += 1
        report.max_forward_ratio = max(report.max_forward_ratio, (sim.ex.forwards - forwards0) / bound)
        report.env_calls += result.metrics.env_calls
        report.shared_tokens += sum(result.metrics.shared_tokens.values())
        env_failed = [r for r in result.failed if "environment" in (r.error or "")]
        report.env_failed += len(env_failed)
        report.env_timeouts += sum("env_timeout_s" in r.error for r in env_failed)
        done = ledger.record(result)
        if late:
            ledger.add(late)
            late = []
            continue
        if done:
            break
        if r.random() < w.p_report:
            engine.report_reward(r.uniform(-1, 1))
        if r.random() < w.p_update:
            engine.update_policy()
        if r.random() < w.p_release:
            engine.release_memory()
            if r.random() < 0.5:
                engine.update_policy()
            engine.resume()
            check_pages(engine)
        if r.random() < w.p_reload:
            state = engine.state_dict()
            fresh = sim.build()
            fresh.load_state_dict(state)
            engine.close()
            ledger.engine = fresh
        ledger.check_between_steps()
    else:
        raise Livelock(f"{max_steps} steps did not return every prompt")
    ledger.check_end()
    report.units, report.forwards = sim.ex.units, sim.ex.forwards
    report.rollouts, report.quarantined = ledger.returned, ledger.quarantined
    return report
