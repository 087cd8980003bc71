"""One simulated run: the real ``RolloutEngine`` of every actor rank, on the twin's clock and stand-ins.

A :class:`World` builds one engine per actor rank with the tiny models of ``sim/models.py``, swaps its
forwards for the stand-ins (as ``tests/sim/`` does) and injects the :class:`~oppo_engine.sim.world.
TwinExecutor` and its clock through ``use_runtime``: the scheduler, step loop, overcommit buffer and
controllers are the engine's own. Each rank's steps run on a lane of their own; the ranks meet after every
step (the PPO update is synchronous), the update's predicted time passes, and the next step starts.

Placements: ``"7+1"`` (every GPU but one runs an actor rank -- actor and critic on it -- and the last one
runs the frozen reward and reference for all ranks as a :class:`~oppo_engine.sim.world.ScorerService`);
``"colocated"`` (every GPU runs a rank with all four models, whose lanes contend for it); ``"cpu"`` (one
rank on the CPU of a calibrated profile).
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from dataclasses import dataclass, field

import torch

from oppo_engine.config import EngineConfig, SamplingParams
from oppo_engine.control import ChunkControl, SwitchProfile
from oppo_engine.engine import RolloutEngine
from oppo_engine.model.roles import ACTOR, CRITIC, REFERENCE, REWARD
from oppo_engine.sim.cost import Batch, CostModel, HostCosts, Work
from oppo_engine.sim.executor import SimClock
from oppo_engine.sim.lengths import Lengths
from oppo_engine.sim.models import (
    EOS,
    TOKEN,
    TwinActor,
    TwinScorer,
    page_plan,
    tiny_models,
    tiny_page_bytes,
)
from oppo_engine.sim.shapes import ModelShape
from oppo_engine.sim.stride import DecodeStride
from oppo_engine.sim.world import Fabric, ScorerService, TwinExecutor

PLACEMENTS = ("7+1", "colocated", "cpu")
# NOTE: what a mode does not read is reset to its default, so one EngineConfig serves every mode.
_MODE_KNOBS = {
    "chunk_size": ("intra", "oppo"),
    "chunk": ("intra", "oppo"),
    "overcommit": ("inter", "oppo"),
    "delta": ("inter", "oppo"),
    "max_deferrals": ("inter", "oppo"),
    "retained_kv": ("inter", "oppo"),
    "max_policy_lag": ("inter", "oppo"),
}


def mode_config(config: EngineConfig, mode: str, **changes) -> EngineConfig:
    """``config`` for ``mode``: its mode replaced, the knobs ``mode`` does not read back at their defaults,
    then ``changes`` applied."""
    default = EngineConfig()
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(EngineConfig)}
    for knob, modes in _MODE_KNOBS.items():
        if mode not in modes:
            values[knob] = getattr(default, knob)
    values.update(mode=mode, **changes)
    if values["chunk_size"] != "auto":
        values["chunk"] = ChunkControl()
    if values["overcommit"] != "auto":
        values["delta"] = default.delta
    return EngineConfig(**values)


@dataclass
class Setting:
    """What a plan simulates, but the mode: the models' shapes by role (no ``"reward"``: a rule reward, no
    model), the cost model, the placement, the global batch (``batch_size`` rollouts: prompts times
    ``group_size`` samples each), the lengths, the engine's settings, the PPO update's shape (``epochs``,
    ``minibatch_size`` rows per rank, ``checkpointing``, ``group_by_length``, packed micro-batches of at
    most ``max_tokens_per_microbatch`` tokens or padded shares when None), an optional reward curve, the
    arena's pages per actor rank (``arena_pages``: the engine's own rule, ``sim/memory.py``; None: room for
    every sequence) and ``max_len`` (the engine's ``max_model_len``; None: prompt cap + response cap).
    ``cpu_threads`` (placement ``"cpu"``): the torch thread count of the process the engine runs in, which
    the world sets while it runs whatever the predicting process's is (a step that runs one lane runs its
    forwards on that many; a step of two lanes on one each, as the engine's own step sets it:
    ``sched/step.py::_lane_threads``). ``measure_agreement``: the update starts with one no-grad forward of
    the actor over every row (``PPOConfig.measure_agreement``, on by default, or a rollout correction),
    which the stale rows' recompute then reads instead of a forward of its own."""

    shapes: dict[str, ModelShape]
    cost: CostModel
    placement: str
    gpus: int
    batch_size: int
    lengths: Lengths
    prompt_lengths: Lengths
    config: EngineConfig
    epochs: int = 2
    minibatch_size: int = 8
    checkpointing: bool = False
    reward_curve: list[float] | None = None
    cores: float = 1.0
    seed: int = 0
    group_size: int = 1
    group_by_length: bool = False
    max_tokens_per_microbatch: int | None = None
    arena_pages: int | None = None
    max_len: int | None = None
    cpu_threads: int = 1
    measure_agreement: bool = True

    @property
    def actor_packed(self) -> bool:
        """Whether the engine's actor multiplies by packed weights (``EngineConfig.packed_weights``: on the
        CPU; ``"auto"`` is on there), so its forwards are priced packed."""
        return self.placement == "cpu" and self.config.packed_weights in ("auto", True)

    @property
    def ranks(self) -> int:
        """Actor ranks: every GPU but the scorer's under 7+1, every GPU colocated, one on the CPU."""
        return {"7+1": self.gpus - 1, "colocated": self.gpus, "cpu": 1}[self.placement]

    @property
    def training_gpus(self) -> int:
        return self.ranks

    @property
    def per_rank(self) -> int:
        return self.batch_size // self.ranks

    @property
    def max_model_len(self) -> int:
        return self.max_len if self.max_len is not None else self.prompt_lengths.cap + self.lengths.cap

    def device_of(self, rank: int) -> str:
        return "cpu" if self.placement == "cpu" else f"gpu{rank}"

    def remote(self, role: str) -> bool:
        """``role`` runs on the scorer service (7+1: the frozen reward and reference)."""
        return self.placement == "7+1" and role in (REWARD, REFERENCE)


@dataclass
class StepRecord:
    """One simulated step over all ranks: the rollout (the slowest rank's ``step()``), its exposed scoring,
    the update, tokens generated, the chunk size and Δ of rank 0, device busy seconds, and the rows of the
    batch (prompt + response lengths, and how many were deferred) that the update trains on."""

    step: int
    rollout_s: float
    exposed_scoring_s: float
    update_s: float
    tokens: int
    chunk_size: int | str | None
    delta: int
    busy_s: float
    gpu_seconds: float
    rows: list[int] = field(default_factory=list)
    deferred_rows: list[int] = field(default_factory=list)

    @property
    def s_per_step(self) -> float:
        return self.rollout_s + self.update_s


def rank_slices(rows: list, ranks: int) -> list[list]:
    """``rows`` cut into ``ranks`` consecutive slices as ``torch.tensor_split`` cuts them (the first
    ``len % ranks`` one longer): each rank's share of a global minibatch (``ppo/trainer.py::_my_rows``)."""
    q, r = divmod(len(rows), ranks)
    out, start = [], 0
    for k in range(ranks):
        end = start + q + (1 if k < r else 0)
        out.append(rows[start:end])
        start = end
    return out


def _rule_reward(prompt_ids, response_ids) -> float:
    """A rule reward (``plan(reward="rule")``): no model, nothing on any GPU."""
    return 0.0


class World:
    """The engines of every actor rank of ``setting`` in ``mode`` (``chunk_size`` an int, ``"auto"``, or
    None for the modes that do not stream), ``delta`` a fixed Δ (or None: the controller, fed
    ``setting.reward_curve``), and ``prior``: a predicted :class:`SwitchProfile` for the chunk controller.
    ``stride``: decode in strides between events (``sim/stride.py``; exact, ``tests/sim/test_stride.py``)."""

    def __init__(
        self,
        setting: Setting,
        mode: str,
        *,
        chunk_size: int | str | None = None,
        delta: int | None = None,
        prior: SwitchProfile | None = None,
        steps: int = 8,
        stride: bool = True,
    ) -> None:
        self.setting, self.mode, self.stride = setting, mode, stride
        s = setting
        if s.batch_size % s.ranks:
            raise ValueError(f"batch_size={s.batch_size} is not a multiple of the {s.ranks} actor ranks")
        self.clock = SimClock()
        devices = {s.device_of(r): (s.cores if s.placement == "cpu" else 1) for r in range(s.ranks)}
        cpus = frozenset(devices) if s.placement == "cpu" else frozenset()
        host = s.cost.source.host
        self.fabric = Fabric(devices, host.interpreter_penalty, cpus, host.interpreter_handover)
        remote = tuple(r for r in (REWARD, REFERENCE) if r in s.shapes and s.remote(r))
        self.service = ScorerService(self._price, remote) if remote else None
        handoff = s.cost.handoff()
        unit_cost = lambda what: handoff if what == "hand-off" else None  # noqa: E731
        self.ex = TwinExecutor(self.clock, self.fabric, self.service, unit_cost=unit_cost)
        self.models = tiny_models(s.shapes, s.config.page_size, s.max_model_len)
        self._targets: list[list[int]] = [[] for _ in range(s.ranks)]
        # Per device, per role: the count of forward starts on the world at its last forward's start
        # (``_switch``: a forward after another model's is priced with its weights out of the cache).
        self._starts: dict[str, dict[str, int]] = {}
        self._started = 0
        cfg = self._engine_config(mode, chunk_size, delta)
        self.engines = [self._build(r, cfg, prior, steps) for r in range(s.ranks)]
        self.records: list[StepRecord] = []

    # -- building -------------------------------------------------------------------------------------

    def _engine_config(self, mode: str, chunk_size, delta) -> EngineConfig:
        s = self.setting
        base = s.config
        changes = dict(batch_size=s.per_rank, max_model_len=s.max_model_len, graph=False)
        if mode in ("intra", "oppo"):
            changes["chunk_size"] = chunk_size if chunk_size is not None else base.chunk_size
            if changes["chunk_size"] == "auto":
                # The prior comes from this twin's cost model (set below), not from the engine's own lookup.
                changes["chunk"] = dataclasses.replace(base.chunk, prior="list")
        if mode in ("inter", "oppo") and delta is not None:
            changes["overcommit"] = delta
        cfg = mode_config(base, mode, **changes)
        page_bytes, tokens = page_plan(s.shapes, cfg.page_size)
        in_flight = cfg.batch_size + self._max_delta(cfg, s.group_size)
        pages = in_flight * sum(-(-cfg.max_model_len // t) for t in tokens.values())
        if base.kv_cache_bytes is not None:  # the target's arena, in the target's pages
            pages = max(1, base.kv_cache_bytes // page_bytes)
        elif s.arena_pages is not None:  # the engine's own cap on a GPU (sim/memory.py: arena_pages)
            pages = min(pages, s.arena_pages)
        self.target_pages = pages
        return dataclasses.replace(cfg, kv_cache_bytes=pages * tiny_page_bytes(self.models, cfg.page_size))

    @staticmethod
    def _max_delta(cfg: EngineConfig, group: int = 1) -> int:
        """Δ_max in rollouts, whole groups of ``group`` (``sched/overcommit.py::delta_controller``)."""
        if cfg.mode not in ("inter", "oppo"):
            return 0
        if isinstance(cfg.overcommit, int):
            return cfg.overcommit
        return -(-cfg.delta.resolve(cfg.batch_size, group).max // group) * group

    def _build(self, rank: int, cfg: EngineConfig, prior: SwitchProfile | None, steps: int) -> RolloutEngine:
        s = self.setting
        m = self.models
        engine = RolloutEngine(
            actor=m[ACTOR], reward=m.get(REWARD, _rule_reward), critic=m.get(CRITIC),
            reference=m.get(REFERENCE), config=cfg, eos_token_id=EOS,
            sampling=SamplingParams(temperature=1.0, max_new_tokens=s.lengths.cap, seed=s.seed,
                                    n=s.group_size),
        )  # fmt: skip
        loop = engine._loop
        sched = loop.actor_sched
        device = s.device_of(rank)
        gpu = s.placement != "cpu"
        threads = (lambda: 1) if gpu else torch.get_num_threads
        targets = self._targets[rank]
        # a stride's decodes run as the engine's own would: each one after another model's start is charged
        strided = lambda work: self.ex.work(self._switch(ACTOR, device, work, work.threads))  # noqa: E731
        stride = DecodeStride(loop, None, strided, self.clock, TOKEN) if self.stride else None
        loop.actor = TwinActor(
            s.shapes[ACTOR], s.cost, sched.cache, lambda: {q.seq_id: q for q in sched.running},
            lambda seq: targets[seq.prompt_index][seq.sample_index], self.ex.work,
            captured=gpu and s.config.graph in ("auto", True), threads=threads, stride=stride,
            packed=s.actor_packed,
            switched=lambda work, t, charge=True: self._switch(ACTOR, device, work, t, charge),
        )  # fmt: skip
        if stride is not None:
            stride.price = loop.actor.price
            stride.wrap()
        lane = loop.scorer_lane
        for name, ssched in lane.scheds.items():
            old = ssched.scorer
            run = self._remote_run if s.remote(name) else self._local_run(name, device)
            twin = TwinScorer(name, ssched.cache, run)
            ssched.scorer = twin
            lane.scorers[lane.scorers.index(old)] = twin
        loop.use_runtime(self.clock, self.ex)
        if prior is not None and engine._chunk_control is not None and engine._chunk_control.fixed is None:
            engine._chunk_control.set_prior(prior)
        self._feed(rank, engine, steps)
        return engine

    def _local_run(self, role: str, device: str):
        cost, shape, ex = self.setting.cost, self.setting.shapes[role], self.ex
        threads = (lambda: 1) if self.setting.placement != "cpu" else torch.get_num_threads

        def run(role: str, batch: Batch) -> None:
            t = threads()
            ex.work(self._switch(role, device, cost.forward(shape, batch, threads=t), t), device)

        return run

    def _switch(self, role: str, device: str, work: Work, threads: int, charge: bool = True) -> Work:
        """``work``, a forward of ``role``'s model starting now on ``device``: priced with its weights out of
        the cache (``CostModel.switched``) where another model's forward started there since this model's
        last one did. The first forward of a model after none of another's is priced as timed. ``charge``
        False: work of the model that is not priced so (the actor's repacking, timed after a stream, which
        leaves its packs in the cache), recorded as its start all the same."""
        starts = self._starts.setdefault(device, {})
        mine = starts.get(role, -1)
        self._started += 1
        starts[role] = self._started
        if charge and any(n > mine for other, n in starts.items() if other != role):
            return self.setting.cost.switched(work, self.setting.shapes[role], threads)
        return work

    def _remote_run(self, role: str, batch: Batch) -> None:
        self.ex.serve(role, batch)

    def _price(self, role: str, batch: Batch) -> Work:
        return self.setting.cost.forward(self.setting.shapes[role], batch)

    def _feed(self, rank: int, engine: RolloutEngine, steps: int) -> None:
        """Queue the prompts of ``steps`` steps (and one more's worth): rank ``r`` takes every
        ``ranks``-th prompt of the global stream, whose lengths it draws."""
        s = self.setting
        cfg = engine.config
        group = s.group_size
        count = -(-(steps + 2) * (cfg.batch_size + self._max_delta(cfg, group)) // group)
        prompts = []
        targets = self._targets[rank]
        for local in range(len(targets), len(targets) + count):
            g = local * s.ranks + rank
            # The first three tokens spell g in base 59, so no two prompts of a run begin alike: the real
            # engine's benches draw random prompts, and the twin prices no shared prompt prefix
            # (EngineConfig.share_prompt_prefix forks only tokens that are the same).
            head = [4 + (g // 59**k) % 59 for k in range(3)]
            prompts.append(
                [*head, *(4 + (g + j) % 59 for j in range(3, s.prompt_lengths[g]))][: s.prompt_lengths[g]]
            )
            targets.append([s.lengths[g * group + j] for j in range(group)])
        engine.add_prompts(prompts)

    # -- running --------------------------------------------------------------------------------------

    def run(self, steps: int) -> list[StepRecord]:
        """Run ``steps`` more steps of every rank (the ranks meeting after each), and return their records."""
        s = self.setting
        ranks = s.ranks
        ex, clock = self.ex, self.clock
        cond = ex.condition()
        state = {"arrived": 0, "generation": 0, "release": 0.0}
        results: list = [None] * ranks
        starts = [0.0] * ranks
        busy0 = [self._busy()]
        per_step = s.cost.source.host.per_step_s

        def rank_main(r: int) -> None:
            ex.set_home(s.device_of(r), f"rank{r}")
            engine = self.engines[r]
            for _ in range(steps):
                starts[r] = clock.now
                if per_step > 0.0:  # the step's own host time, outside its forwards (HostCosts.per_step_s)
                    ex.sleep(per_step)
                results[r] = (engine.step(), clock.now - starts[r])
                with cond:
                    state["arrived"] += 1
                    generation = state["generation"]
                    if state["arrived"] == ranks:
                        state["release"] = clock.now + self._close_step(results, busy0)
                        state["arrived"] = 0
                        state["generation"] += 1
                        cond.notify_all()
                    while state["generation"] == generation:
                        cond.wait()
                if state["release"] > clock.now:
                    ex.sleep(state["release"] - clock.now)
                engine.update_policy()
                engine._loop.actor.weights_updated()  # the TwinActor: its packs are made again (CPU)
                curve = s.reward_curve
                if curve and engine._delta_control is not None:
                    step = len(self.records) - 1
                    engine.report_reward(float(curve[min(step, len(curve) - 1)]))

        saved = torch.get_num_threads()
        if s.placement == "cpu":
            torch.set_num_threads(s.cpu_threads)
        try:
            threads = [ex.start(lambda r=r: rank_main(r), f"rank{r}") for r in range(ranks)]
            ex.homes[ex.current] = ("main", "main")
            for t in threads:
                t.join()
        finally:
            torch.set_num_threads(saved)
        return self.records[-steps:]

    def _busy(self) -> float:
        return sum(self.fabric.busy_s.values()) + (self.service.busy_s if self.service else 0.0)

    def _close_step(self, results: list, busy0: list[float]) -> float:
        """Record the step the ranks just finished; returns the update's seconds."""
        s = self.setting
        slowest = max(range(len(results)), key=lambda r: results[r][1])
        result, rollout = results[slowest]
        rows, deferred = [], []
        for res, _ in results:
            for r in res.rollouts:
                n = len(r.prompt_ids) + len(r.response_ids)
                rows.append(n)
                if r.deferred_steps:
                    deferred.append(n)
        update = self._update_s(rows, deferred)
        busy = self._busy()
        gpus = s.gpus if s.placement != "cpu" else 1
        m = result.metrics
        self.records.append(StepRecord(
            step=len(self.records), rollout_s=rollout, exposed_scoring_s=m.exposed_scoring_s,
            update_s=update, tokens=sum(res.metrics.tokens_generated for res, _ in results),
            chunk_size=m.chunk_size, delta=m.overcommit,
            busy_s=busy - busy0[0] + update * s.training_gpus, gpu_seconds=gpus * (rollout + update),
            rows=rows, deferred_rows=deferred,
        ))  # fmt: skip
        busy0[0] = busy
        return update

    def _update_s(self, rows: list[int], deferred: list[int]) -> float:
        """The PPO update on the batch's rows as ``PPOTrainer`` cuts them (``ppo/trainer.py``): minibatches of
        ``minibatch_size`` rows per rank, random (or, ``group_by_length``, rows of similar length together,
        in random order), each cut into one consecutive slice per rank; each slice padded to its own longest
        row, or packed (``max_tokens_per_microbatch``); first one no-grad actor forward over every row (the
        agreement, ``measure_agreement``) or, without it, over the stale rows, in chunks of similar length
        (packed: one group), each rank its slice."""
        s = self.setting
        if not rows:
            return 0.0
        order = rows[:]
        rng = random.Random(s.seed * 1_000_003 + len(self.records))
        size = s.minibatch_size * s.ranks
        if s.group_by_length:
            order.sort()
            chunks = [order[i : i + size] for i in range(0, len(order), size)]
            rng.shuffle(chunks)
        else:
            rng.shuffle(order)
            chunks = [order[i : i + size] for i in range(0, len(order), size)]
        minibatches = [rank_slices(c, s.ranks) for c in chunks]
        # The no-grad actor forward before the first optimizer step (``PPOTrainer.trainer_logprobs``): over
        # every row where the update measures the agreement (the stale rows' recompute reads it), else over
        # the stale rows alone where a mode carries some. Packed, they are one group in the batch's order,
        # split by rank; padded, sorted chunks of a minibatch's rows, each split by rank.
        if s.measure_agreement:
            ahead = list(rows)
        else:
            ahead = list(deferred) if self.mode in ("inter", "oppo") else []
        if s.max_tokens_per_microbatch is not None:
            recompute = [rank_slices(ahead, s.ranks)] if ahead else []
        else:
            ahead.sort()
            recompute = [rank_slices(ahead[i : i + size], s.ranks) for i in range(0, len(ahead), size)]
        trained = [s.shapes[ACTOR]] + ([s.shapes[CRITIC]] if CRITIC in s.shapes else [])
        return s.cost.update(
            trained, minibatches, gpus=s.training_gpus, epochs=s.epochs, checkpointing=s.checkpointing,
            packed=s.max_tokens_per_microbatch is not None, budget=s.max_tokens_per_microbatch,
            recompute=recompute,
        )  # fmt: skip

    def timeline(self) -> list[tuple[str, str, float, float]]:
        """Rank 0's lane spans of its last step: ``(lane, what, start, end)`` in virtual seconds."""
        spans = self.engines[0].timeline.spans()
        return [(sp.lane, sp.name, sp.start_s, sp.end_s) for sp in spans]

    def close(self) -> None:
        self.ex.closed = True
        for engine in self.engines:
            engine.close()


def measure_host_costs(
    rows: tuple[int, ...] = (4, 16), tokens: tuple[int, int] = (16, 96), repeats: int = 3
) -> HostCosts:
    """The engine's host time per step, per forward and per row: real time of steps of the real engine, on
    OS threads and the real clock, around stand-in forwards that cost nothing; and per hand-off, from a
    streamed step.

    The steps: sequential ones of ``tokens[1]`` response tokens at each of ``rows`` (the cost per row), one
    of ``tokens[0]`` at the smallest of ``rows`` (a step's own cost, outside its forwards: the intercept
    against the number of forwards at one row count; a long step alone spreads it over its forwards, and a
    short step, ``inter``'s of a heavy tail, is then priced without most of it), and streamed ones of
    ``tokens[1]`` (the hand-offs). Each point is the fastest of ``repeats`` steps after a warm-up: other
    work on the machine only adds time, and one slow step at the larger batch would tilt the fit to all
    per-row cost and no per-forward cost (a loaded 2-core machine did, with one step per point)."""
    if repeats < 1:
        raise ValueError(f"measure_host_costs: repeats must be >= 1, got {repeats}")
    if len(tokens) != 2 or not 0 < tokens[0] < tokens[1]:
        raise ValueError(f"measure_host_costs: tokens must be (short, long), 0 < short < long, got {tokens}")
    from oppo_engine.sim.lengths import parse_lengths  # noqa: PLC0415
    from oppo_engine.sim.shapes import model_shape  # noqa: PLC0415

    source = _Free()
    source.host = HostCosts(0.0, 0.0, 0.0)
    free = CostModel(source)
    shapes = {ACTOR: model_shape("tiny"), REWARD: model_shape("tiny", head="score")}

    def fastest(mode: str, r: int, n: int) -> tuple[float, int, int]:
        setting = Setting(
            shapes=shapes, cost=free, placement="cpu", gpus=1, batch_size=r,
            lengths=parse_lengths(n), prompt_lengths=parse_lengths(8), config=EngineConfig(),
        )  # fmt: skip
        chunk = 8 if mode == "intra" else None
        world = _RealTimeWorld(setting, mode, chunk_size=chunk, steps=1 + repeats)
        try:
            world.step()  # warm-up
            timed = [world.step() for _ in range(repeats)]
        finally:
            world.close()
        return min(timed, key=lambda t: t[0] / t[1])

    short, long = tokens
    seq = {r: fastest("sequential", r, long) for r in rows}
    brief = fastest("sequential", min(rows), short)  # at the smallest row count, as fit_host_costs reads it
    intra = {r: fastest("intra", r, long) for r in rows}
    return fit_host_costs(seq, brief, intra)


def fit_host_costs(
    seq: dict[int, tuple[float, int, int]],
    brief: tuple[float, int, int],
    intra: dict[int, tuple[float, int, int]],
) -> HostCosts:
    """``HostCosts`` from timed steps ``(seconds, forwards, hand-offs)``: ``seq``, long sequential steps by
    row count; ``brief``, a short sequential step at the smallest row count; ``intra``, long streamed steps
    by row count. A step takes ``per_step + forwards * (per_forward + per_row * rows)``, plus ``handoff``
    per hand-off where it streams: the per-step cost is the intercept of the two steps at the smallest row
    count against their forwards, and none of the others is found with it spread over the forwards."""
    rows = sorted(seq)
    (t_long, f_long, _), (t_short, f_short, _) = seq[rows[0]], brief
    per_step = 0.0
    if f_long > f_short:
        per_step = max(0.0, t_short - f_short * (t_long - t_short) / (f_long - f_short))
    per_forward = {r: (t - per_step) / f for r, (t, f, _) in seq.items()}
    per_row = max(0.0, (per_forward[rows[-1]] - per_forward[rows[0]]) / (rows[-1] - rows[0]))
    base = max(0.0, per_forward[rows[0]] - per_row * rows[0])
    streamed = [((t - per_step) / f - per_forward[r]) / (h / f) for r, (t, f, h) in intra.items() if h > 0]
    handoff = max(0.0, statistics.median(streamed)) if streamed else 0.0
    return HostCosts(base, per_row, handoff, per_step_s=per_step)


class _Free:
    """A cost source under which every piece of work is free (host time measurement)."""

    kind = "cpu"

    def gemm(self, *a, **k):
        return 0.0, 0.0

    def attention(self, *a, **k):
        return 0.0, 0.0

    def elementwise(self, *a, **k):
        return 0.0

    def fixed(self, *a, **k):
        return 0.0, 0.0

    def switched_s(self, *a, **k):
        return 0.0

    def host_s(self, rows):
        return 0.0


class _RealTimeWorld(World):
    """One rank of the engine on OS threads and the real clock: forwards cost nothing, so a step's wall
    time is the engine's own host work."""

    def __init__(self, setting: Setting, mode: str, *, chunk_size=None, steps: int = 2) -> None:
        super().__init__(setting, mode, chunk_size=chunk_size, steps=steps, stride=False)
        loop = self.engines[0]._loop
        from oppo_engine.sched.runtime import THREADS  # noqa: PLC0415

        loop.use_runtime(time.perf_counter, THREADS)
        self._switch = lambda role, device, work, threads, charge=True: work  # host time only: no pricing
        loop.actor.run = lambda work: None
        for sched in loop.scorer_lane.scheds.values():
            sched.scorer.run = lambda role, batch: None

    def step(self) -> tuple[float, int, int]:
        engine = self.engines[0]
        t0 = time.perf_counter()
        result = engine.step()
        seconds = time.perf_counter() - t0
        forwards = sum(1 for sp in engine.timeline.spans() if sp.lane == ACTOR)
        engine.update_policy()
        return seconds, max(1, forwards), result.metrics.handoffs
