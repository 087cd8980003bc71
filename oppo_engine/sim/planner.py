"""``plan``: what a PPO run on N GPUs gains per mode, with which chunk size and Δ, and whether it fits --
predicted by the twin (the real engine on the cost model's clock, ``sim/twin.py``). Every number a plan
holds is a prediction.

How a plan extrapolates (``extrapolate=True``, the default). A step of a mode depends on the arm it runs
(a chunk size, or "off") and on the state carried over from earlier steps; the twin reaches steady state in
a few steps. So each arm a mode can run is simulated on its own world -- the non-streamed modes once; the
streamed ones at every chunk size of the sweep (32 to 4096) and every candidate of ``config.chunk``, "off"
being the non-streamed mode's steps -- for ``warmup`` unmeasured steps (2 with overcommit, whose carried
sequences need them; none otherwise) and ``measure`` measured ones. The chunk-size controller then runs for
real over the plan's ``steps``: the engine's own :class:`~oppo_engine.control.ChunkSizeController`, fed
each step the time of the arm it chose (that arm's measured steps in turn) and the switch-cost profile the
engine's profiler measured on that arm's world, its prior (``prior="model"``) predicted from the same
cost model. A mode's s/step is the mean over the steps of its arms' times. Δ follows the Δ controller fed
``reward_curve`` (without one it stays at its initial value); the mode's chosen arm is simulated at each
value Δ takes. ``extrapolate=False`` runs every mode live for all ``steps`` (the controllers inside the
engines), which agrees with the extrapolation (``tests/sim/test_twin.py``) and takes ``steps`` times longer.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from oppo_engine.config import MODES, EngineConfig
from oppo_engine.control import OFF, ChunkSizeController, DeltaController, SwitchProfile
from oppo_engine.sim.baselines import SYNC_ASSUMPTIONS, TRL_ASSUMPTIONS, recompute_forward_s, trl_step
from oppo_engine.sim.cost import CostModel, Roofline
from oppo_engine.sim.devices import device as table_device
from oppo_engine.sim.lengths import Lengths, parse_lengths
from oppo_engine.sim.memory import MemoryPlan, memory_plan
from oppo_engine.sim.prior import predicted_profile
from oppo_engine.sim.profile import Calibrated, Profile
from oppo_engine.sim.shapes import ModelShape, model_shape
from oppo_engine.sim.twin import PLACEMENTS, Setting, StepRecord, World, mode_config

SWEEP = (32, 64, 128, 256, 512, 1024, 2048, 4096)
STREAMED = ("intra", "oppo")
OVERCOMMITTED = ("inter", "oppo")
UNSTREAMED = {"intra": "sequential", "oppo": "inter"}  # the "off" arm of a streamed mode
BASELINES = ("trl", "sync")  # arms of sim/baselines.py, priced beside the engine's modes (never run by it)
ARMS = (*MODES, *BASELINES)
RULE = "rule"  # reward="rule": a rule reward, no reward model on any GPU


@dataclass
class ModePlan:
    """One mode's predictions (seconds per step unless named otherwise).

    ``s_per_step = rollout_s + update_s``; ``rollout_s`` is the engine's ``step()`` of the slowest rank;
    ``exposed_scoring_s`` the part of it after the batch's last token; ``speedup`` sequential's s/step over
    this mode's; ``chunk_sweep`` s/step at each fixed chunk size (streamed modes); ``chunk_chosen`` the arm
    the controller settles on (an int or "off"; None for the modes that do not stream); ``chunk_history``
    the arm of every step; ``delta`` Δ of every step (per actor rank); ``utilisation`` the predicted
    fraction of GPU time with kernels running; ``time_s`` the plan's steps in all."""

    mode: str
    s_per_step: float
    rollout_s: float
    exposed_scoring_s: float
    update_s: float
    speedup: float = 1.0
    chunk_sweep: dict[int, float] = field(default_factory=dict)
    chunk_chosen: int | str | None = None
    chunk_history: list = field(default_factory=list)
    delta: list[int] = field(default_factory=list)
    utilisation: float = 0.0
    time_s: float = 0.0
    timeline: list = field(default_factory=list, repr=False)  # one step's lane spans (lane, what, start, end)
    speedup_vs: dict[str, float] = field(default_factory=dict)  # s/step of each baseline arm over this mode's
    phases: dict[str, float] = field(default_factory=dict)  # a baseline arm's seconds by phase


@dataclass
class Plan:
    """A plan's predictions: per mode (:class:`ModePlan`), memory per GPU (bytes, by part: the GPU that
    needs most), whether it fits (and if not, ``why``), and what was simulated."""

    modes: dict[str, ModePlan]
    memory: MemoryPlan
    setting: dict
    steps: int
    wall_s: float = 0.0

    @property
    def fits(self) -> bool:
        return self.memory.fits

    @property
    def memory_per_gpu(self) -> dict[str, int]:
        return self.memory.per_gpu

    @property
    def why(self) -> str | None:
        return self.memory.verdict()

    def to_json(self) -> dict:
        return {
            "prediction": True,
            "note": "every number here is predicted by oppo_engine's twin, none is measured",
            "setting": self.setting,
            "steps": self.steps,
            "fits": self.fits,
            "why": self.why,
            "memory_per_gpu": self.memory_per_gpu,
            "memory_by_gpu": self.memory.by_gpu,
            "gpu_capacity": self.memory.capacity,
            "modes": {m: _mode_json(p) for m, p in self.modes.items()},
            "assumptions": {arm: list(a) for arm, a in (("trl", TRL_ASSUMPTIONS), ("sync", SYNC_ASSUMPTIONS))
                            if arm in self.modes},
            "arena_pages": self.memory.arena_pages,
            "arena_pages_wanted": self.memory.pages_wanted,
            "preempts": self.memory.preempts,
            "wall_s": self.wall_s,
        }  # fmt: skip

    def save(self, path: str | Path) -> Path:
        """Write ``plan.json`` (whole or not at all)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        try:
            tmp.write_text(json.dumps(self.to_json(), indent=1, default=str))
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return path

    def table(self) -> str:
        """The predictions as a table (every number a prediction)."""
        s = self.setting
        where = "the CPU" if s["placement"] == "cpu" else f"{s['gpus']} GPU(s) as {s['placement']}"
        group = f" prompts x {s['group_size']}" if s.get("group_size", 1) > 1 else ""
        lines = [
            f"PREDICTED by the twin ({s['cost_model']}; {where}, "
            f"B={s['batch_size']}{group}, "
            f"responses {s['lengths']}, prompts {s['prompt_lengths']}, "
            f"{self.steps} steps)",
            f"{'mode':<11}{'s/step':>8}{'rollout':>9}{'exposed':>9}{'update':>8}{'speed-up':>9}"
            f"{'chunk':>7}{'Δ':>4}{'util':>6}{'total h':>9}"
            + "".join(f"{'vs ' + b:>9}" for b in BASELINES if b in self.modes),
        ]
        for m in self.modes.values():
            chunk = "-" if m.chunk_chosen is None else str(m.chunk_chosen)
            delta = statistics.median(m.delta) if m.delta else 0
            lines.append(
                f"{m.mode:<11}{m.s_per_step:>8.2f}{m.rollout_s:>9.2f}{m.exposed_scoring_s:>9.2f}"
                f"{m.update_s:>8.2f}{m.speedup:>8.2f}x{chunk:>7}{delta:>4g}{m.utilisation:>6.2f}"
                f"{m.time_s / 3600:>9.2f}"
                + "".join(f"{m.speedup_vs[b]:>8.2f}x" for b in BASELINES if b in m.speedup_vs)
            )
        if self.memory.preempts:
            lines.append(
                f"the engine's KV arena (40% of free memory) holds {self.memory.arena_pages} of the "
                f"{self.memory.pages_wanted} pages B + Δ sequences of max_model_len need: it preempts"
            )
        gb = {k: v / 1e9 for k, v in self.memory_per_gpu.items()}
        lines.append(
            "memory per device (GB, the fullest): "
            + ", ".join(f"{k} {v:.1f}" for k, v in gb.items())
            + f" of {self.memory.capacity / 1e9:.0f}: "
            + ("fits" if self.fits else f"DOES NOT FIT: {self.why}")
        )
        return "\n".join(lines)


def plan(
    actor,
    reward=None,
    critic=None,
    reference=None,
    *,
    device: str | Profile = "h200",
    gpus: int = 8,
    placement: str = "7+1",
    batch_size: int = 112,
    lengths="lognormal:median=250,sigma=0.9,cap=1024",
    prompt_lengths=128,
    steps: int = 50,
    modes: Sequence[str] = MODES,
    config: EngineConfig | None = None,
    reward_curve: Sequence[float] | None = None,
    epochs: int | None = None,
    minibatch_size: int | None = None,
    weight_bytes: int = 2,
    grad_bytes: int = 2,
    optimizer_bytes: int = 8,
    activation_checkpointing: bool = False,
    fsdp: bool = True,
    group_size: int = 1,
    group_by_length: bool = False,
    max_tokens_per_microbatch: int | None = None,
    measure_agreement: bool | None = None,
    sweep: Sequence[int] = SWEEP,
    extrapolate: bool = True,
    warmup: int | None = None,
    measure: int = 2,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
    cpu_threads: int = 1,
) -> Plan:
    """Predict a PPO run (module docstring). ``actor``, ``reward``, ``critic``, ``reference``: a preset
    name, a ``config.json`` path or an HF config (``reward=None``: the actor's shape; ``reward="rule"``: a
    rule reward, no reward model on any GPU; ``critic`` and ``reference`` optional). ``group_size``: samples
    per prompt (``batch_size`` prompts times ``group_size`` responses a step). ``modes`` may add the
    baseline arms ``"trl"`` and ``"sync"`` (``sim/baselines.py``); every mode's ``speedup_vs`` holds its
    speed-up against each. ``device``: a key of the roofline table (``sim/devices.py``) or a calibrated
    :class:`Profile`; ``placement``: ``"7+1"``, ``"colocated"`` or ``"cpu"`` (a CPU profile). ``batch_size``
    is the global batch (split over the actor ranks). ``lengths``/``prompt_lengths``: an int, a list (used
    in order, one per prompt, cycled), a file of lengths or a ``records.json``, or a law like
    ``"lognormal:median=250,sigma=0.9,cap=1024"`` (``sim/lengths.py``). ``config``: one ``EngineConfig``
    for every mode (its ``mode`` replaced by each of ``modes``; what a mode does not use is ignored).
    ``reward_curve``: mean reward per step for the Δ controller. ``epochs`` and ``minibatch_size`` (per
    rank) shape the update (default: the reference trainer's ``PPOConfig``); the memory defaults are bf16
    weights and gradients, fp32 Adam moments and FSDP over the training GPUs, without activation
    checkpointing, each rank's share of a minibatch padded to its longest row (``PPOTrainer`` today);
    ``group_by_length`` and ``max_tokens_per_microbatch`` (packed micro-batches) as the trainer's options;
    ``measure_agreement`` (default: ``PPOConfig``'s, on) prices the trainer's no-grad actor forward over
    every row before its first optimizer step.
    ``config.max_model_len``, when set, bounds prompt + response: a larger prompt cap plus response cap is
    refused with ``ValueError``. A plan that does not fit returns ``fits=False`` with the numbers; it does
    not raise. ``progress(done, total)`` is called after each simulated world. ``cpu_threads`` (placement
    ``"cpu"``): the torch thread count of the process the engine would run in, priced whatever this
    process's is; a count the profile was not calibrated at (or 1, which a step of two lanes runs at) is
    refused with ``ValueError``.
    """
    t0 = time.perf_counter()
    from oppo_engine.ppo.config import PPOConfig  # noqa: PLC0415

    ppo = PPOConfig()
    setting, memory = _setting(
        actor, reward, critic, reference, device=device, gpus=gpus, placement=placement,
        batch_size=batch_size, lengths=lengths, prompt_lengths=prompt_lengths,
        config=config or EngineConfig(), reward_curve=reward_curve, epochs=epochs or ppo.epochs,
        minibatch_size=minibatch_size or ppo.minibatch_size, weight_bytes=weight_bytes, grad_bytes=grad_bytes,
        optimizer_bytes=optimizer_bytes, checkpointing=activation_checkpointing, fsdp=fsdp, seed=seed,
        group_size=group_size, group_by_length=group_by_length, max_tokens=max_tokens_per_microbatch,
        cpu_threads=cpu_threads,
        measure_agreement=ppo.measure_agreement if measure_agreement is None else measure_agreement,
    )  # fmt: skip
    modes = tuple(modes)
    bad = [m for m in modes if m not in ARMS]
    if bad or not modes:
        raise ValueError(f"modes: each one of {ARMS}, got {list(modes) or 'none'}")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    sweep = tuple(sorted(set(sweep)))
    planner = _Planner(setting, steps, sweep, warmup, measure, progress)
    engine_modes = tuple(m for m in modes if m in MODES)
    if "sync" in modes and "sequential" not in engine_modes:
        engine_modes = ("sequential", *engine_modes)
    results = planner.run(engine_modes) if extrapolate else planner.run_live(engine_modes)
    if "trl" in modes:
        results["trl"] = _trl_plan(setting, steps)
    if "sync" in modes:
        results["sync"] = _sync_plan(setting, planner, results["sequential"])
    results = {m: results[m] for m in modes}
    base = results.get("sequential")
    for m in results.values():
        m.speedup = base.s_per_step / m.s_per_step if base and m.s_per_step > 0 else float("nan")
        m.speedup_vs = {b: results[b].s_per_step / m.s_per_step for b in BASELINES if b in results}
    describe = {
        "actor": setting.shapes["actor"].name,
        "models": {r: dataclasses.asdict(s) for r, s in setting.shapes.items()},
        "cost_model": _describe(setting.cost),
        "gpus": gpus,
        "placement": placement,
        "cpu_threads": setting.cpu_threads if placement == "cpu" else None,
        "batch_size": batch_size,
        "lengths": setting.lengths.describe(),
        "prompt_lengths": setting.prompt_lengths.describe(),
        "epochs": setting.epochs,
        "minibatch_size": setting.minibatch_size,
        "group_size": setting.group_size,
        "reward": "rule" if "reward" not in setting.shapes else "model",
        "max_model_len": setting.max_model_len,
        "activation_checkpointing": setting.checkpointing,
        "group_by_length": setting.group_by_length,
        "max_tokens_per_microbatch": setting.max_tokens_per_microbatch,
        "measure_agreement": setting.measure_agreement,
        "extrapolated": extrapolate,
        "config": repr(setting.config),
    }
    return Plan(results, memory, describe, steps, time.perf_counter() - t0)


def _trl_plan(setting: Setting, steps: int) -> ModePlan:
    """The TRL-like arm (``sim/baselines.py``): its phases in series; the rollout is generation, scoring
    and the log-prob/value/reference forwards, all after generation (exposed)."""
    t = trl_step(setting)
    rollout = t["generation_s"] + t["scoring_s"] + t["forwards_s"]
    phases = {k: v for k, v in t.items() if k != "s_per_step"}
    return ModePlan("trl", t["s_per_step"], rollout, t["scoring_s"] + t["forwards_s"], t["update_s"],
                    time_s=t["s_per_step"] * steps, phases=phases)  # fmt: skip


def _sync_plan(setting: Setting, planner: _Planner, seq: ModePlan) -> ModePlan:
    """The synchronous-engine arm: ``sequential`` plus verl's old-log-prob forward (``sim/baselines.py``)."""
    run = planner._arm("sequential", None, None)
    extra = statistics.fmean(recompute_forward_s(setting, r.rows) for r in run.records)
    out = dataclasses.replace(seq, mode="sync", s_per_step=seq.s_per_step + extra,
                              update_s=seq.update_s + extra,
                              time_s=(seq.s_per_step + extra) * planner.steps, timeline=[],
                              phases={"rollout_s": seq.rollout_s, "old_logprob_forward_s": extra,
                                      "update_s": seq.update_s})  # fmt: skip
    return out


def _mode_json(m: ModePlan) -> dict:
    out = dataclasses.asdict(m)
    out.pop("timeline")
    out["chunk_sweep"] = {str(k): v for k, v in m.chunk_sweep.items()}
    return out


def _describe(cost: CostModel) -> str:
    src = cost.source
    if isinstance(src, Roofline):
        return f"roofline {src.device.key} ({src.device.name})"
    return f"calibrated profile of {src.profile.device}"


def _check_cpu_threads(profile: Profile, cpu_threads) -> None:
    """``ValueError`` unless ``profile`` was calibrated at ``cpu_threads`` and at 1 (a step of two lanes
    runs each on one): the costs of a thread count never timed are not priced from another's."""
    if not isinstance(cpu_threads, int) or isinstance(cpu_threads, bool) or cpu_threads < 1:
        raise ValueError(f"cpu_threads must be an int >= 1, got {cpu_threads!r}")
    missing = sorted({cpu_threads, 1} - set(profile.threads))
    if missing:
        raise ValueError(
            f"cpu_threads={cpu_threads}: the profile of {profile.device!r} was calibrated at "
            f"{sorted(profile.threads)} thread(s), not at {missing}; calibrate at those too "
            f"(oppo-engine calibrate --threads {','.join(map(str, sorted({cpu_threads, 1})))}) or plan "
            "with a calibrated count"
        )


def _setting(actor, reward, critic, reference, *, device, gpus, placement, batch_size, lengths,
             prompt_lengths, config, reward_curve, epochs, minibatch_size, weight_bytes, grad_bytes,
             optimizer_bytes, checkpointing, fsdp, seed, group_size=1, group_by_length=False,
             max_tokens=None, cpu_threads=1,
             measure_agreement=True) -> tuple[Setting, MemoryPlan]:  # fmt: skip
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    if isinstance(device, Profile):
        cost = CostModel(Calibrated(device))
        want = "cpu" if placement == "cpu" else "gpu"
        if device.kind != want:
            raise ValueError(
                f"device: a profile calibrated on {device.device!r} ({device.kind}) cannot plan placement "
                f"{placement!r} ({want})"
            )
        capacity = _host_memory() if placement == "cpu" else None
    else:
        if placement == "cpu":
            raise ValueError(
                "placement 'cpu' plans with a calibrated CPU Profile as device (oppo-engine calibrate)"
            )
        dev = table_device(device)
        cost = CostModel(Roofline(dev))
        capacity = int(dev.memory)
    least = 2 if placement == "7+1" else 1
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < least:
        raise ValueError(f"gpus must be an int >= {least} for placement {placement!r}, got {gpus!r}")
    if placement == "cpu":
        gpus = 1
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        raise ValueError(f"group_size must be an int >= 1 (samples per prompt), got {group_size!r}")
    if max_tokens is not None and (
        not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1
    ):
        raise ValueError(f"max_tokens_per_microbatch must be an int >= 1 or None, got {max_tokens!r}")
    shapes = {"actor": model_shape(actor, name="actor")}
    if not (isinstance(reward, str) and reward == RULE):
        scored = reward if reward is not None else actor
        shapes["reward"] = model_shape(scored, head="score", name="reward")
    if critic is not None:
        shapes["critic"] = model_shape(critic, head="value", name="critic")
    if reference is not None:
        shapes["reference"] = model_shape(reference, name="reference")
    if placement == "cpu":  # the engine's CPU models are float32
        shapes = {r: s.with_head(s.head, 4) for r, s in shapes.items()}
    if isinstance(device, Profile):
        _check_profile_range(device, shapes)
    if placement == "cpu":
        _check_cpu_threads(device, cpu_threads)
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1 (prompts a step), got {batch_size!r}")
    response_lengths = parse_lengths(lengths, what="lengths", seed=seed)
    prompts = parse_lengths(prompt_lengths, what="prompt_lengths", seed=seed + 1)
    if config.max_model_len is not None and prompts.cap + response_lengths.cap > config.max_model_len:
        raise ValueError(
            f"config.max_model_len={config.max_model_len} is below the prompt cap {prompts.cap} plus the "
            f"response cap {response_lengths.cap}: raise max_model_len or lower the caps"
        )
    setting = Setting(
        shapes=shapes, cost=cost, placement=placement, gpus=gpus, batch_size=batch_size * group_size,
        lengths=response_lengths, prompt_lengths=prompts,
        config=config, epochs=epochs, minibatch_size=minibatch_size, checkpointing=checkpointing,
        reward_curve=list(reward_curve) if reward_curve is not None else None,
        cores=device.cores if isinstance(device, Profile) else 1, seed=seed, group_size=group_size,
        group_by_length=group_by_length, max_tokens_per_microbatch=max_tokens, max_len=config.max_model_len,
        cpu_threads=cpu_threads, measure_agreement=measure_agreement,
    )  # fmt: skip
    if batch_size < setting.ranks or batch_size % setting.ranks:
        raise ValueError(
            f"batch_size={batch_size} is the global batch of prompts: it must split evenly over the "
            f"{setting.ranks} actor ranks of {gpus} GPU(s) as {placement!r}"
        )
    rank_cfg = mode_config(config, "oppo", batch_size=setting.per_rank)
    in_flight = setting.per_rank + World._max_delta(rank_cfg, group_size)
    memory = memory_plan(
        shapes, placement=placement, training_gpus=setting.training_gpus, ranks=setting.ranks,
        in_flight=in_flight, max_model_len=setting.max_model_len, minibatch_rows=minibatch_size,
        page_size=config.page_size, capacity=capacity, weight_bytes=weight_bytes, grad_bytes=grad_bytes,
        optimizer_bytes=optimizer_bytes, checkpointing=checkpointing, fsdp=fsdp,
        tokens_per_microbatch=max_tokens,
    )  # fmt: skip
    if config.kv_cache_bytes is None and memory.arena_pages >= max(
        memory.one_sequence_pages, setting.per_rank
    ):
        # The engine's arena (sim/memory.py); one the engine would refuse to build is in p.why, and the
        # steps are then simulated with room for every sequence.
        setting.arena_pages = memory.arena_pages
    return setting, memory


# How far past the largest projection a profile timed (K x N) its FLOP/s may be held flat; beyond, the
# profile cannot price the shape (a model too small to fit the constants a larger one needs).
PROFILE_REACH = 16


def _check_profile_range(profile: Profile, shapes: dict[str, ModelShape]) -> None:
    """``ValueError`` naming the model whose projections are over ``PROFILE_REACH`` times larger than any
    the profile timed (its FLOP/s there would be a guess), or that has more of a feature than the
    calibration's models had where no timed forward had that feature (``Profile.check_shape``)."""
    for role, shape in shapes.items():
        profile.check_shape(shape, role)
    for threads, costs in profile.threads.items():
        timed = max(costs.gemm)
        for role, shape in shapes.items():
            need = max(k * n for k, n in shape.layer_gemms())
            if need > PROFILE_REACH * timed:
                raise ValueError(
                    f"device: the profile of {profile.device!r} timed projections of K x N up to {timed:,} "
                    f"({threads} thread(s)); the {role} model ({shape.name}) has one of {need:,}, over "
                    f"{PROFILE_REACH}x beyond: calibrate with a model that wide (oppo-engine calibrate)"
                )


def _host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass
class _ArmRun:
    """The measured steps of one arm's world (and the switch profile its profiler measured)."""

    records: list[StepRecord]
    profile: SwitchProfile | None
    timeline: list = field(default_factory=list)


class _Planner:
    def __init__(self, setting: Setting, steps: int, sweep, warmup, measure: int, progress) -> None:
        self.s, self.steps, self.sweep = setting, steps, sweep
        self.warmup, self.measure, self.progress = warmup, max(1, measure), progress
        self.done = 0
        self.total = 0
        self.runs: dict[tuple, _ArmRun] = {}
        cfg = setting.config
        self.candidates = tuple(cfg.chunk.candidates)
        self.delta0 = self._initial_delta()

    # -- the arms ---------------------------------------------------------------------------------------

    def _initial_delta(self) -> int:
        cfg = mode_config(self.s.config, "oppo", batch_size=self.s.per_rank)
        if isinstance(cfg.overcommit, int):
            return cfg.overcommit
        group = self.s.group_size
        return -(-cfg.delta.resolve(cfg.batch_size, group).init // group) * group

    def _deltas(self, mode: str) -> list[int]:
        """Δ of every step: the controller fed the reward curve, or the initial Δ throughout."""
        if mode not in OVERCOMMITTED:
            return [0] * self.steps
        curve = self.s.reward_curve
        cfg = mode_config(self.s.config, mode, batch_size=self.s.per_rank)
        if not curve or isinstance(cfg.overcommit, int):
            return [self.delta0] * self.steps
        ctrl = DeltaController(cfg.delta.resolve(cfg.batch_size, self.s.group_size))
        out = []
        for t in range(self.steps):
            out.append(ctrl.delta())
            ctrl.observe_reward(float(curve[min(t, len(curve) - 1)]))
        return out

    def _prior(self, mode: str) -> SwitchProfile | None:
        cfg = mode_config(self.s.config, mode, batch_size=self.s.per_rank)
        if cfg.chunk.prior != "model":
            return None
        s = self.s
        local = {r for r in s.shapes if r != "actor" and not s.remote(r)}
        delta = self.delta0 if mode in OVERCOMMITTED else 0
        return predicted_profile(
            s.cost, s.shapes, self.candidates, batch_size=s.per_rank, running=s.per_rank + delta,
            prompt_len=s.prompt_lengths.mean(256), response_len=s.lengths.mean(256), local=local,
            captured=s.placement != "cpu" and s.config.graph in ("auto", True), threads=1, cores=s.cores,
            packed=s.actor_packed,
        )  # fmt: skip

    def _arm(self, mode: str, chunk: int | None, delta: int | None) -> _ArmRun:
        key = (mode, chunk, delta)
        if key not in self.runs:
            warmup = self.warmup if self.warmup is not None else (2 if mode in OVERCOMMITTED else 0)
            world = World(self.s, mode, chunk_size=chunk, delta=delta, steps=warmup + self.measure)
            try:
                records = world.run(warmup + self.measure)[warmup:]
                profiler = world.engines[0]._profiler
                profile = profiler.profile() if profiler is not None else None
                self.runs[key] = _ArmRun(records, profile, world.timeline())
            finally:
                world.close()
            self.done += 1
            if self.progress is not None:
                self.progress(self.done, self.total)
        return self.runs[key]

    def _arms(self, mode: str) -> list[int | None]:
        if mode not in STREAMED:
            return [None]
        cfg = self.s.config
        fixed = cfg.chunk_size if isinstance(cfg.chunk_size, int) else None
        return sorted(set(self.sweep) | set(self.candidates) | ({fixed} if fixed else set()))

    # -- extrapolated -----------------------------------------------------------------------------------

    def run(self, modes: tuple[str, ...]) -> dict[str, ModePlan]:
        needed = set(modes) | {UNSTREAMED[m] for m in modes if m in STREAMED}
        silent = self.nothing_streams()
        if silent:
            needed -= set(STREAMED)
        self.total = sum(len(self._arms(m)) for m in needed)
        results = {}
        for mode in sorted(needed, key=MODES.index):
            results[mode] = self._mode(mode)
        if silent:  # no scorer model: a streamed mode is its unstreamed one, step for step
            for mode in (m for m in STREAMED if m in modes):
                base = results[UNSTREAMED[mode]]
                results[mode] = dataclasses.replace(base, mode=mode, chunk_chosen=OFF,
                                                    chunk_history=[OFF] * self.steps)  # fmt: skip
        return {m: results[m] for m in modes}

    def nothing_streams(self) -> bool:
        """No model scores what the actor generates (a rule reward, no reference, no critic): the streamed
        modes have nothing to stream, so ``intra`` is ``sequential`` and ``oppo`` is ``inter``."""
        return set(self.s.shapes) == {"actor"}

    def _mode(self, mode: str) -> ModePlan:
        deltas = self._deltas(mode)
        d0 = self.delta0 if mode in OVERCOMMITTED else None
        if mode not in STREAMED:
            arms = [None] * self.steps
        else:
            arms = self._replay(mode, d0)
        per_delta = sorted(set(deltas)) if mode in OVERCOMMITTED else [None]
        records: list[StepRecord] = []
        counters: dict = {}
        for t, (arm, delta) in enumerate(zip(arms, deltas, strict=True)):
            chunk = None if arm in (None, OFF) else arm
            run_mode = UNSTREAMED[mode] if arm == OFF else mode
            d = delta if mode in OVERCOMMITTED and len(per_delta) > 1 else d0
            run = self._arm(run_mode, chunk, d)
            i = counters.get((run_mode, chunk, d), 0)
            counters[(run_mode, chunk, d)] = i + 1
            records.append(run.records[i % len(run.records)])
            del t
        sweep = {}
        if mode in STREAMED:
            for c in self._arms(mode):
                recs = self._arm(mode, c, d0).records
                sweep[c] = statistics.fmean(r.s_per_step for r in recs)
        chosen = None
        if mode in STREAMED:
            fixed = self.s.config.chunk_size
            chosen = fixed if isinstance(fixed, int) else self._settled(arms)
        out = _summary(mode, records, arms if mode in STREAMED else [], deltas, sweep, chosen, self.steps)
        shown = (UNSTREAMED[mode], None) if chosen == OFF else (mode, chosen)
        out.timeline = self._arm(*shown, d0).timeline
        return out

    def _replay(self, mode: str, delta: int | None) -> list:
        """The arm of every step, chosen by the engine's chunk-size controller (module docstring)."""
        cfg = mode_config(self.s.config, mode, batch_size=self.s.per_rank)
        if isinstance(cfg.chunk_size, int):
            return [cfg.chunk_size] * self.steps
        ctrl = ChunkSizeController(cfg.chunk)
        prior = self._prior(mode)
        if prior is not None:
            ctrl.set_prior(prior)
        used: dict = {}
        slowdowns: dict = {}
        arms = []
        for _ in range(self.steps):
            arm = ctrl.chunk_size()
            if arm == OFF:
                run = self._arm(UNSTREAMED[mode], None, delta)
            else:
                run = self._arm(mode, arm, delta)
            i = used.get(arm, 0)
            used[arm] = i + 1
            rec = run.records[i % len(run.records)]
            ctrl.observe(arm, rec.rollout_s, max(1, rec.tokens))
            if run.profile is not None:
                # What the engine's profiler holds after this step: its slowdowns so far, this arm's added.
                slowdowns.update({k: v for k, v in run.profile.slowdown.items() if k == arm})
                ctrl.set_profile(dataclasses.replace(run.profile, slowdown=dict(slowdowns)))
            arms.append(arm)
        return arms

    @staticmethod
    def _settled(arms: list):
        """The arm of the last third of the steps (the incumbent; explorations aside)."""
        tail = arms[-max(1, len(arms) // 3) :]
        return max(set(tail), key=tail.count)

    # -- live -------------------------------------------------------------------------------------------

    def run_live(self, modes: tuple[str, ...]) -> dict[str, ModePlan]:
        self.total = len(modes) + sum(len(self._arms(m)) for m in modes if m in STREAMED)
        out = {}
        for mode in modes:
            prior = self._prior(mode) if mode in STREAMED else None
            # Without a reward curve Δ stays at its initial value (module docstring); with one, the engine's
            # Δ controller is fed it.
            fixed = self.delta0 if mode in OVERCOMMITTED and not self.s.reward_curve else None
            world = World(self.s, mode, prior=prior, delta=fixed, steps=self.steps)
            try:
                records = world.run(self.steps)
                timeline = world.timeline()
            finally:
                world.close()
            self.done += 1
            if self.progress is not None:
                self.progress(self.done, self.total)
            arms = [r.chunk_size for r in records] if mode in STREAMED else []
            sweep = {}
            d0 = self.delta0 if mode in OVERCOMMITTED else None
            if mode in STREAMED:
                for c in self._arms(mode):
                    sweep[c] = statistics.fmean(r.s_per_step for r in self._arm(mode, c, d0).records)
            fixed = self.s.config.chunk_size
            chosen = (fixed if isinstance(fixed, int) else self._settled(arms)) if mode in STREAMED else None
            out[mode] = _summary(mode, records, arms, [r.delta for r in records], sweep, chosen, self.steps)
            out[mode].timeline = timeline
        return out


def _summary(mode, records, arms, deltas, sweep, chosen, steps) -> ModePlan:
    rollout = statistics.fmean(r.rollout_s for r in records)
    update = statistics.fmean(r.update_s for r in records)
    busy = sum(r.busy_s for r in records)
    gpu_s = sum(r.gpu_seconds for r in records)
    return ModePlan(
        mode=mode,
        s_per_step=rollout + update,
        rollout_s=rollout,
        exposed_scoring_s=statistics.fmean(r.exposed_scoring_s for r in records),
        update_s=update,
        chunk_sweep=sweep,
        chunk_chosen=chosen,
        chunk_history=list(arms),
        delta=list(deltas),
        utilisation=busy / gpu_s if gpu_s > 0 else 0.0,
        time_s=(rollout + update) * steps,
    )


def shapes_of(plan_: Plan) -> dict[str, ModelShape]:
    """The model shapes a plan simulated."""
    return {r: ModelShape(**d) for r, d in plan_.setting["models"].items()}


__all__ = ["SWEEP", "Lengths", "ModePlan", "Plan", "plan", "shapes_of"]
