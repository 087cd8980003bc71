"""The twin checked against the real engine, and the paper's setting on paper. Every twin number is a
prediction; the real ones are measured here, side by side in one run.

    python -m bench.bench_twin              # CPU accuracy: calibrate once, predict the real engine (minutes)
    python -m bench.bench_twin --paper      # the paper's 7B and 3B settings on 8xH200 as 7+1, beside it
    python -m bench.bench_twin --host       # the engine's host time per forward (sim/cost.py: HOST)
    python -m bench.bench_twin --published  # the twin against public GPU measurements (bench/published.py)
    python -m bench.bench_twin --long       # long reasoning runs: DAPO-like and GRPO with a reference, 8xH200
    python -m bench.bench_twin --matrix     # calibrate on each shape, predict the others' workloads (long)
    python -m bench.bench_twin --phases-profile P --phases-shape S   # one matrix cell's step by phase
    python -m bench.bench_twin --drift 540  # one fixed prediction of tiny and small against 9 min of rounds
    python -m bench.bench_twin --forward-terms tiny,mid --out DIR  # a forward's terms, real vs priced
    python -m bench.bench_twin --drain      # inter vs oppo with chunk_size="auto" on a long-tail drain
    python -m bench.bench_twin --drain --drain-workloads   # ... and on drains of the workloads below
    python -m bench.bench_twin --trl-check  # the TRL-like arm's generation and forwards vs HF on this CPU
    python -m bench.bench_twin --device-check --e2e DIR --profile P.json   # on a GPU: vs bench_e2e's steps

CPU accuracy. The machine is calibrated once (``calibrate`` on one model pair: the ``small`` preset's actor
and reward), then the real engine runs, and the twin predicts, each of ``sequential``, ``intra`` at two
chunk sizes, ``inter`` and ``oppo`` on four workloads, none of which the calibration saw (it times a grid of
forwards, not workloads): a base workload, another batch size, another length law, and another model shape
(a ``mid`` model the profile never timed). Each real engine runs its steps interleaved with the other
modes' (what loads the machine then slows every mode alike); the first step of each is a warm-up. Torch
runs on one thread, as the demo does (on a shared two-core machine two threads collapse whenever the other
core is busy); the streamed steps use one thread per lane either way. The last lines give the median and
the worst error of s/step, and of the exposed scoring (as a share of the real step).
"""

from __future__ import annotations

import argparse
import csv
import gc
import math
import random
import statistics
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, Qwen2Config

from oppo_engine import EngineConfig, RolloutEngine, SamplingParams
from oppo_engine.control import ChunkControl
from oppo_engine.model.roles import ACTOR
from oppo_engine.presets import EOS_TOKEN_ID, PAD_TOKEN_ID, build_models
from oppo_engine.sim import Profile, calibrate, plan
from oppo_engine.sim.calibration import OtherCPU
from oppo_engine.sim.lengths import parse_lengths
from oppo_engine.sim.planner import _setting
from oppo_engine.sim.twin import World

# The held-out model shape: wider and deeper than the calibration pair's, never timed by calibrate.
MID = dict(vocab_size=512, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
           num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=4096)  # fmt: skip
# head_dim 128 and 8 query heads per KV head (GQA-8): a layout no preset has (the matrix's fourth shape).
GQA8 = dict(vocab_size=512, hidden_size=1024, intermediate_size=2048, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=1, max_position_embeddings=4096)  # fmt: skip
SHAPES = {"mid": MID, "gqa8": GQA8}  # the shapes that are not presets (the presets: build_models)


@dataclass(frozen=True)
class Workload:
    name: str
    model: str  # a preset ("tiny", "small") or a key of SHAPES
    batch_size: int
    lengths: str | tuple[int, ...]  # a law of sim/lengths.py, or the lengths in order
    prompt_lengths: str = "uniform:low=16,high=48"


WORKLOADS = (
    Workload("base", "small", 8, "lognormal:median=40,sigma=0.6,cap=96"),
    Workload("B=16", "small", 16, "lognormal:median=40,sigma=0.6,cap=96"),
    Workload("uniform lengths", "small", 8, "uniform:low=8,high=128"),
    Workload("mid model", "mid", 8, "lognormal:median=40,sigma=0.6,cap=96"),
)
# (mode, chunk size, Δ): intra at two chunk sizes; Δ = B / 2 where it applies.
ARMS = (("sequential", None, None), ("intra", 8, None), ("intra", 32, None), ("inter", None, "half"),
        ("oppo", 16, "half"))  # fmt: skip


def _models(name: str, seed: int):
    if name not in SHAPES:
        return build_models(name, torch.float32, "cpu", seed)
    torch.manual_seed(seed)
    shape = SHAPES[name]
    config = Qwen2Config(**shape, pad_token_id=PAD_TOKEN_ID, eos_token_id=EOS_TOKEN_ID)
    actor = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    reward_config = Qwen2Config(**shape, pad_token_id=PAD_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, num_labels=1)
    return actor, AutoModelForSequenceClassification.from_config(reward_config, dtype=torch.float32).eval()


def _config(w: Workload, mode: str, chunk: int | None, delta: str | None, max_len: int) -> EngineConfig:
    knobs = {}
    if chunk is not None:
        knobs["chunk_size"] = chunk
    if delta is not None:  # "half": Δ = B / 2; "full": Δ = B
        knobs.update(overcommit=w.batch_size // (2 if delta == "half" else 1), max_policy_lag=None)
    return EngineConfig(batch_size=w.batch_size, mode=mode, max_model_len=max_len, **knobs)


def _draws(w: Workload, count: int) -> tuple[list[int], list[int]]:
    lengths = parse_lengths(list(w.lengths) if isinstance(w.lengths, tuple) else w.lengths, seed=11)
    prompts = parse_lengths(w.prompt_lengths, seed=12)
    return [lengths[i] for i in range(count)], [prompts[i] for i in range(count)]


def _arm_engine(w: Workload, arm: tuple, actor, reward, prompts, lengths, max_len: int) -> RolloutEngine:
    """The real engine of ``w``'s arm (mode, chunk, delta), ``prompts`` queued with their forced lengths."""
    engine = RolloutEngine(
        actor=actor, reward=reward, config=_config(w, *arm, max_len), eos_token_id=EOS_TOKEN_ID,
        sampling=SamplingParams(max_new_tokens=max(lengths), ignore_eos=True, seed=0),
    )  # fmt: skip
    engine.add_prompts(prompts, sampling=[SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lengths])
    return engine


def measure(
    w: Workload, warmup: int, steps: int, arms=ARMS, cpu_share: dict | None = None
) -> dict[tuple, tuple[float, float]]:
    """The real engine's median step wall time and exposed scoring per arm (steps interleaved across
    arms). ``cpu_share``, if given, gets each arm's median CPU seconds of the process over the step's wall
    (``StepMetrics.cpu_s / wall_s``): about 1 for a one-lane step that had its core, less where other load
    took it (the step's wall is then the machine's, not the engine's)."""
    actor, reward = _models(w.model, 0)
    count = (warmup + steps + 2) * (w.batch_size * 3 // 2)
    lengths, prompt_lens = _draws(w, count)
    rng = random.Random(5)
    prompts = [[rng.randrange(4, actor.config.vocab_size) for _ in range(n)] for n in prompt_lens]
    max_len = max(prompt_lens) + max(lengths)
    engines = {arm: _arm_engine(w, arm, actor, reward, prompts, lengths, max_len) for arm in arms}
    times: dict[tuple, list[tuple[float, float]]] = {arm: [] for arm in arms}
    shares: dict[tuple, list[float]] = {arm: [] for arm in arms}
    order = list(arms)
    try:
        for k in range(warmup + steps):
            order = order[1:] + order[:1]  # no arm always right after another
            for arm in order:
                result = engines[arm].step()
                engines[arm].update_policy()
                if k >= warmup:
                    m = result.metrics
                    times[arm].append((m.wall_s, m.exposed_scoring_s))
                    if m.cpu_s is not None:
                        shares[arm].append(m.cpu_s / m.wall_s)
    finally:
        for engine in engines.values():
            engine.close()
    median = statistics.median
    if cpu_share is not None:
        cpu_share.update({arm: median(v) for arm, v in shares.items() if v})
    return {arm: (median(t for t, _ in v), median(x for _, x in v)) for arm, v in times.items()}


def _arm_setting(w: Workload, profile: Profile, source, arm: tuple, lengths, prompt_lens):
    """The twin's setting of ``w``'s arm (mode, chunk, delta) on the CPU, its actor and reward ``source``'s
    shape, and the engine config it runs: (setting, config)."""
    mode, chunk, delta = arm
    config = _config(w, mode, chunk, delta, max(prompt_lens) + max(lengths))
    setting, _ = _setting(
        source, source, None, None, device=profile, gpus=1, placement="cpu", batch_size=w.batch_size,
        lengths=lengths, prompt_lengths=prompt_lens, config=config, reward_curve=None, epochs=2,
        minibatch_size=8, weight_bytes=4, grad_bytes=4, optimizer_bytes=8, checkpointing=False,
        fsdp=False, seed=0,
    )  # fmt: skip
    return setting, config


def predict(
    w: Workload, profile: Profile, warmup: int, steps: int, arms=ARMS
) -> dict[tuple, tuple[float, float]]:
    """The twin's median step time and exposed scoring per arm, on the same prompts and lengths."""
    count = (warmup + steps + 2) * (w.batch_size * 3 // 2)
    lengths, prompt_lens = _draws(w, count)
    actor = _shape_source(w.model, SHAPES.get(w.model))
    out = {}
    for arm in arms:
        mode, chunk, delta = arm
        setting, config = _arm_setting(w, profile, actor, arm, lengths, prompt_lens)
        world = World(setting, mode, chunk_size=chunk, delta=config.overcommit if delta else None,
                      steps=warmup + steps)  # fmt: skip
        try:
            records = world.run(warmup + steps)[warmup:]
        finally:
            world.close()
        out[arm] = (statistics.median(r.rollout_s for r in records),
                    statistics.median(r.exposed_scoring_s for r in records))  # fmt: skip
    return out


def _shape_source(name: str, mid: dict | None):
    if mid is None:
        return name
    return Qwen2Config(**mid)


def accuracy(args) -> int:
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    actor, reward = _models("small", 0)
    profile = calibrate(actor, reward, path=args.out / "profile_cpu.json", threads=(1,))
    calib_s = time.perf_counter() - t0
    print(f"calibrated {profile.device} on the small actor + reward in {calib_s:.0f}s (fit error "
          f"{profile.threads[1].fit_error:.1%}); profile: {args.out / 'profile_cpu.json'}")  # fmt: skip
    rows = []
    twin_s = 0.0
    for w in WORKLOADS:
        real = measure(w, args.warmup, args.steps)
        t1 = time.perf_counter()
        twin = predict(w, profile, args.warmup, args.steps)
        twin_s += time.perf_counter() - t1
        for arm in ARMS:
            rows.append((w, arm, real[arm], twin[arm]))
    header = (f"{'workload':<16}{'mode':<12}{'real s/step':>12}{'twin s/step':>12}{'error':>8}"
              f"{'real exposed':>14}{'twin exposed':>14}{'split err':>10}")  # fmt: skip
    print("\nCPU accuracy (the twin's numbers are predictions; real: the engine measured here)")
    print(header)
    step_err, split_err = [], []
    for w, (mode, chunk, delta), (r_s, r_x), (t_s, t_x) in rows:
        label = mode + (f"@{chunk}" if chunk else "") + (f" Δ={w.batch_size // 2}" if delta else "")
        e = t_s / r_s - 1
        x = (t_x - r_x) / r_s
        step_err.append(abs(e))
        split_err.append(abs(x))
        print(f"{w.name:<16}{label:<12}{r_s:>12.3f}{t_s:>12.3f}{e:>+8.1%}{r_x:>14.3f}{t_x:>14.3f}{x:>+10.1%}")
    print(f"s/step error: median {statistics.median(step_err):.1%}, worst {max(step_err):.1%} "
          f"(goal: median <= 10%, worst <= 20%)")  # fmt: skip
    print(f"exposed scoring error, as a share of the real step: median {statistics.median(split_err):.1%}, "
          f"worst {max(split_err):.1%}")  # fmt: skip
    print(f"twin: {twin_s:.1f}s for {len(rows)} predictions; calibration {calib_s:.0f}s; "
          f"total {time.perf_counter() - t0:.0f}s")  # fmt: skip
    return 0


# -- the calibrate-on-each-shape matrix ----------------------------------------------------------------------

MATRIX_SHAPES = ("tiny", "small", "mid", "gqa8")


def pareto_tail(count: int = 64, cap: int = 160, seed: int = 3) -> tuple[int, ...]:
    """A heavy Pareto tail: most responses 10-30 tokens, a few at the cap (our choice, shaped like the
    held-out workload that missed: lengths forced with ``ignore_eos``)."""
    rng = random.Random(seed)
    return tuple(min(cap, int(10 * rng.paretovariate(1.1))) for _ in range(count))


def matrix_workloads(shape: str) -> tuple[Workload, ...]:
    """The matrix's workloads on ``shape``: a lognormal base and the heavy Pareto tail, B=8."""
    return (
        Workload(f"{shape} base", shape, 8, "lognormal:median=40,sigma=0.6,cap=96"),
        Workload(f"{shape} pareto", shape, 8, pareto_tail()),
    )


MATRIX_ARMS = (("sequential", None, None), ("inter", None, "full"), ("oppo", 16, "half"))


def matrix(args) -> int:
    """Calibrate on each shape of ``MATRIX_SHAPES`` in turn and predict every shape's workloads (off the
    diagonal, shapes it never timed), against the real engine measured here: per cell the median and worst
    signed s/step error over its workloads and arms (the goal of each cell: median <= 10%, worst <= 20%).
    Each real number is the median of ``--steps`` steps interleaved across the arms, ``--rounds`` times (the
    median of the rounds, and, in a second table, the fastest round: below); the load is printed beside
    each.

    ``--runs`` whole runs, one after another (each calibrates every shape again and measures every workload
    again, so the runs interleave the calibrations and the measurements): each run's table, then the
    matrix of the medians over the runs -- per cell, each workload's and arm's error the median of the
    runs' (the twin's prediction and the real figure both move from run to run: a calibration's fitted
    hand-overs, the real steps' spells).

    Each table is printed twice: with the real figure the median of the rounds (the goal's, and since
    profile version 12 the statistic ``calibrate`` keeps of its own rounds: ``ROUND_STATISTIC``), and with
    it the fastest round. Why both: this machine's speed comes and goes in spells of 10-30 s (a time series
    of one process, 2026-12-07: ``bench/results/twin_spells_zen5_2026-12-07.txt``: the 24 and 96 MiB
    sweeps' rates up to 35% and 30% below their medians in a spell, the ``small`` and gqa8 decodes' median
    1.12-1.13x their fastest over 4 minutes), and a spell that covers two of a workload's rounds sets their
    median. The second table shows how far the spells moved the first; it is read beside the first, never
    instead of it: a spell over every round still shows in it, and where the twin's errors are negative the
    fastest round moves them toward zero by construction.

    A third table, the carry (``carry_errors``), sets each cell's predictions against those of the column's
    own calibration in the same run: how far a calibration carries to another shape, apart from the real
    steps. It is not the goal."""
    import os  # noqa: PLC0415

    torch.set_num_threads(1)
    shapes = args.matrix_shapes.split(",")
    bad = [s for s in shapes if s not in MATRIX_SHAPES]
    if bad:
        raise SystemExit(f"--matrix-shapes: each one of {MATRIX_SHAPES}, got {bad}")
    if args.runs < 1:
        raise SystemExit(f"--runs: at least 1, got {args.runs}")
    runs: list[dict[str, dict]] = []
    for run in range(args.runs):
        if args.runs > 1:
            print(f"\n## run {run + 1} of {args.runs}")
        runs.append(_matrix_run(args, shapes, run))
    if args.runs > 1:
        for statistic, (title, _) in STATISTICS.items():
            print(f"\n## the medians of the {args.runs} runs, per cell, workload and arm; {title}")
            _matrix_table(shapes, median_errors([r[statistic] for r in runs]),
                          f"load {os.getloadavg()[0]:.1f}")  # fmt: skip
        print(f"\n## the medians of the {args.runs} runs, per cell, workload and arm; {CARRY_TITLE}")
        _matrix_table(shapes, median_errors([r[CARRY] for r in runs]), "", carry=True)
    return 0


# The real figure of a workload's arm from its rounds (each the median of its steps), by name: its title and
# how the rounds reduce to it -- the goal's (``calibrate``'s of its own rounds too, since profile version 12),
# and the fastest round (``matrix``'s docstring: why both).
STATISTICS: dict[str, tuple[str, Callable]] = {
    "median": (
        "the real figure the median of the rounds (the goal's; calibrate's of its own rounds)",
        statistics.median,
    ),
    "fastest": ("the real figure the fastest round (how far the machine's spells moved the first)", min),
}


def real_figures(rounds: list[dict], arms) -> dict[str, dict]:
    """``{statistic: {arm: seconds}}`` (``STATISTICS``) from ``rounds``, each ``measure``'s result."""
    return {
        name: {arm: reduce([r[arm][0] for r in rounds]) for arm in arms}
        for name, (_, reduce) in STATISTICS.items()
    }


_SWEEP: list = []  # reference()'s 24 MiB of one-row products, made once


def reference() -> str:
    """The machine's speed now, for the matrix's printout: the fastest of 7 timings of four fixed pieces of
    work on this thread -- 20 products of 64 x 1024 by 1024 x 1024 (in the caches: ms), a sum over 256 MiB
    (from memory: GB/s), 2,000 in-place adds on a 64 x 64 tensor (the interpreter and torch's dispatch,
    which most of a small model's step is: us an op) and a sweep of one-row products over 24 MiB of weights,
    packed as the engine's actor's are where it packs (``small``'s two models' weights, about the shared
    cache: GB/s, the second of two sweeps back to back). Neither the load average nor other processes' CPU
    sees a virtual machine's host slowing it (runs whose real steps all took 10-15% longer than the same
    code's runs before and after, at load 1.1 and no other process, 2026-12-07, while the product and the
    sum held). In a time series of such sweeps (the fastest of 3 medians of back-to-back sweeps, no other
    work between), their rate moved against the ``small`` and gqa8 decodes' times (correlation -0.50 and
    -0.53 over 4 minutes, 2026-12-07: ``bench/results/twin_spells_zen5_2026-12-07.txt``); here it follows
    a 256 MiB sum and reads lower (28-40 GB/s in the matrix's logs against 46 there), so it is comparable
    between these lines only. Read only by people: nothing is scaled by it."""
    import torch.nn.functional as F  # noqa: N812, PLC0415

    from oppo_engine.sim.calibration import _linear, packing  # noqa: PLC0415

    if not _SWEEP:
        packed = packing(torch.device("cpu"), torch.float32)
        _SWEEP.extend(_linear(torch.randn(512, 1024), packed) for _ in range(12))  # 2 MiB each
    row = torch.randn(1, 1, 1024)
    x, w = torch.randn(64, 1024), torch.randn(1024, 1024)
    big = torch.ones((256 << 20) // 4)
    small = torch.zeros(64, 64)
    product = stream = ops = sweep = float("inf")
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(20):
            F.linear(x, w)
        t1 = time.perf_counter()
        big.sum()
        t2 = time.perf_counter()
        for _ in range(2000):
            small.add_(1.0)
        t3 = time.perf_counter()
        for p in _SWEEP:  # once untimed: the sum above took the cache
            p(row)
        t4 = time.perf_counter()
        for p in _SWEEP:
            p(row)
        t5 = time.perf_counter()
        product, stream = min(product, t1 - t0), min(stream, t2 - t1)
        ops, sweep = min(ops, t3 - t2), min(sweep, t5 - t4)
    return (f"reference {product * 1e3:.2f} ms, {big.numel() * 4 / stream / 1e9:.1f} GB/s, "
            f"{ops / 2000 * 1e6:.2f} us an op, 24 MiB sweep {(24 << 20) / sweep / 1e9:.1f} GB/s")  # fmt: skip


def median_errors(runs: list[dict]) -> dict:
    """Per cell of ``runs`` (``_matrix_run``'s results), each workload's and arm's error the median over the
    runs; a cell any run refused stays refused (``None``)."""
    out = {}
    for key in runs[0]:
        if any(r[key] is None for r in runs):
            out[key] = None
        else:
            out[key] = [statistics.median(r[key][i] for r in runs) for i in range(len(runs[0][key]))]
    return out


def _matrix_run(args, shapes: list[str], run: int) -> dict[str, dict[tuple[str, str], list[float] | None]]:
    """One run of the matrix: every shape calibrated, every workload measured, the tables printed; returns
    per statistic of the real figure (``STATISTICS``) ``{(calibrated on, predicted): errors}`` (per arm,
    each workload's signed error; ``None``: refused), and under ``CARRY`` the cells' ``carry_errors``."""
    import os  # noqa: PLC0415

    profiles = {}
    for shape in shapes:
        t0 = time.perf_counter()
        actor, reward = _models(shape, 0)
        # run 1 writes where one run always did (--forward-terms and --phases-profile read it)
        name = f"profile_{shape}.json" if run == 0 else f"profile_{shape}_run{run + 1}.json"
        path = args.out / name
        with OtherCPU() as other:
            profiles[shape] = calibrate(actor, reward, path=path, threads=(1,))
        p = profiles[shape]
        table = p.costs_at(1).switched
        switch = "/".join(f"{t * 1e3:.2f}" for _, t in table) + " ms" if table else "not timed"
        print(f"calibrated on {shape} in {time.perf_counter() - t0:.0f}s, load {os.getloadavg()[0]:.1f}, "
              f"{_other(other)}, {reference()}; cores {p.cores}, penalty "
              f"{p.host.interpreter_penalty}, hand-overs {p.host.interpreter_handover}, "
              f"a switch {switch}")  # fmt: skip
    real = {}
    for shape in shapes:
        for w in matrix_workloads(shape):
            shares = [{} for _ in range(args.rounds)]
            with OtherCPU() as other:
                rounds = [measure(w, args.warmup, args.steps, MATRIX_ARMS, s) for s in shares]
            real[w] = real_figures(rounds, MATRIX_ARMS)
            # the sequential arm's CPU share: below ~0.95 its one lane waited for a core (other load)
            share = statistics.median(s[MATRIX_ARMS[0]] for s in shares if MATRIX_ARMS[0] in s)
            median, fast = real[w]["median"].items(), real[w]["fastest"].values()
            print(f"measured {w.name}: " + ", ".join(f"{a[0]} {t:.3f}s" for a, t in median)
                  + f" (median of {args.rounds} rounds; fastest " + ", ".join(f"{t:.3f}" for t in fast)
                  + f"), load {os.getloadavg()[0]:.1f}, {_other(other)}, sequential's CPU share "
                  f"{share:.2f}, {reference()}")  # fmt: skip
    errors: dict[str, dict[tuple[str, str], list[float] | None]] = {k: {} for k in STATISTICS}
    twins: dict[tuple[str, str], list[float] | None] = {}
    for cal in shapes:
        for target in shapes:
            try:
                errs: dict[str, list[float]] = {k: [] for k in STATISTICS}
                twins[cal, target] = []
                for w in matrix_workloads(target):
                    twin = predict(w, profiles[cal], args.warmup, args.steps, MATRIX_ARMS)
                    twins[cal, target] += [twin[a][0] for a in MATRIX_ARMS]
                    for k in STATISTICS:
                        errs[k] += [twin[a][0] / real[w][k][a] - 1 for a in MATRIX_ARMS]
                for k in STATISTICS:
                    errors[k][cal, target] = errs[k]
            except ValueError as e:  # a profile too small for the shape: refused by name, not guessed
                print(f"  {cal} -> {target}: refused: {e}")
                twins[cal, target] = None
                for k in STATISTICS:
                    errors[k][cal, target] = None
    for k, (title, _) in STATISTICS.items():
        print(f"\n# {title}")
        _matrix_table(shapes, errors[k], f"load {os.getloadavg()[0]:.1f}")
    errors[CARRY] = carry_errors(twins, shapes)
    print(f"\n# {CARRY_TITLE}")
    _matrix_table(shapes, errors[CARRY], "", carry=True)
    return errors


# The matrix's third table: each cell's predictions against those of the column's own calibration, in the same
# run -- how far a calibration carries to another shape, apart from the real steps (one workload's rounds
# spanned 1.7-2.7x within minutes on the development VM, idle, while two calibrations minutes apart agreed
# within 5%, or 10-28% where one landed in a slow spell: bench/results/twin_drift_zen5_2026-12-08.txt,
# ..._drift_2_zen5_2026-12-08.txt). It is not the goal: the goal compares with the real steps.
CARRY = "carry"
CARRY_TITLE = "the carry: each prediction against the column's own calibration's, same run (not the goal's)"


def carry_errors(twins: dict, shapes: list[str]) -> dict[tuple[str, str], list[float] | None]:
    """Per cell ``(calibrated on, predicted)``, each workload's and arm's prediction over the same one from
    the predicted shape's own calibration, less one: ``twins[cal, target]`` is the cell's predicted
    s/step in the order of its errors (``None``: refused), and a cell whose own or whose column's diagonal
    is refused stays refused. The diagonal is zero by construction."""
    out: dict[tuple[str, str], list[float] | None] = {}
    for cal in shapes:
        for target in shapes:
            mine, own = twins[cal, target], twins[target, target]
            if mine is None or own is None:
                out[cal, target] = None
            else:
                out[cal, target] = [a / b - 1 for a, b in zip(mine, own, strict=True)]
    return out


def _matrix_table(shapes: list[str], errors: dict, load: str, carry: bool = False) -> None:
    """The matrix of ``errors`` (``_matrix_run``'s): per cell the median / worst signed error, the cells
    meeting the goal counted, then each cell's arms, base / pareto. ``carry``: ``errors`` are
    ``carry_errors`` (each prediction over the column's own calibration's), counted against the goal's
    thresholds but not as the goal."""
    if carry:
        print("\ncalibrated on (row) -> predicting (column): median / worst signed s/step difference (twin / "
              "the column's own calibration's twin - 1; both predictions)")  # fmt: skip
    else:
        print("\ncalibrated on (row) -> predicting (column): median / worst signed s/step error (twin / real "
              "- 1; the twin's numbers are predictions)")  # fmt: skip
    print(f"{'':<10}" + "".join(f"{c:>16}" for c in shapes))
    per_arm, met = [], 0
    for cal in shapes:
        cells = []
        for target in shapes:
            errs = errors[cal, target]
            if errs is None:
                cells.append("refused")
                continue
            worst = max(errs, key=abs)
            median = statistics.median(errs)
            met += abs(median) <= 0.10 and abs(worst) <= 0.20
            cells.append(f"{median:+.0%} / {worst:+.0%}")
            arms = len(MATRIX_ARMS)
            per_arm.append(
                f"  {cal:>5} -> {target:<5} "
                + "  ".join(
                    f"{a[0]} {errs[i]:+.0%} / {errs[i + arms]:+.0%}" for i, a in enumerate(MATRIX_ARMS)
                )
            )
        print(f"{cal:<10}" + "".join(f"{c:>16}" for c in cells) + f"   {load}")
    if carry:
        print(f"cells within the goal's thresholds (median <= 10%, worst <= 20%; the diagonal by "
              f"construction): {met} of {len(errors)}")  # fmt: skip
    else:
        print(f"cells meeting the goal (median <= 10%, worst <= 20%): {met} of {len(errors)}")
    print("\nper arm, base / pareto (row -> column):")
    print("\n".join(per_arm))


# -- one fixed prediction against the machine's spells -------------------------------------------------------


def drift_summary(first: dict, last: dict, rounds: list[dict]) -> dict[tuple, dict[str, float]]:
    """Per arm of ``first`` (each of ``rounds`` is ``measure``'s result, ``{arm: (step s, exposed s)}``,
    with the same arms): the real rounds' ``min``, ``median`` and ``max`` step seconds; the ``first``
    calibration's fixed prediction (``predict``'s result) ``twin`` and its signed error against each round
    (``error min``, ``error median``, ``error max``) with the share of rounds it is within 10% of
    (``within 10%``); and the ``last`` calibration's prediction ``twin last`` with its median error
    ``last error median``."""
    out = {}
    for arm in first:
        real = [r[arm][0] for r in rounds]
        errors = [first[arm][0] / x - 1 for x in real]
        out[arm] = {
            "min": min(real),
            "median": statistics.median(real),
            "max": max(real),
            "twin": first[arm][0],
            "error min": min(errors),
            "error median": statistics.median(errors),
            "error max": max(errors),
            "within 10%": sum(abs(e) <= 0.10 for e in errors) / len(errors),
            "twin last": last[arm][0],
            "last error median": statistics.median(last[arm][0] / x - 1 for x in real),
        }
    return out


def drift(args) -> int:
    """How far one fixed prediction's error moves with the machine's spells: calibrate each of
    ``--drift-shapes`` and price its base workload (``matrix_workloads``' first) once, then measure the real
    steps of each, one round (``measure``: ``--warmup`` + ``--steps`` steps, the matrix's three arms
    interleaved) after another, for ``--drift`` seconds, each round printed with its error against the fixed
    prediction and the machine's ``reference()``; then calibrate and price again. The summary sets the
    rounds' spread beside the two calibrations' difference: the matrix's goal compares a calibration with
    real steps minutes apart."""
    import os  # noqa: PLC0415

    torch.set_num_threads(1)
    shapes = list(dict.fromkeys(args.drift_shapes.split(",")))  # each once, in the order given
    bad = [s for s in shapes if s not in MATRIX_SHAPES]
    if bad:
        raise SystemExit(f"--drift-shapes: each one of {MATRIX_SHAPES}, got {bad}")
    if not (math.isfinite(args.drift) and args.drift > 0):
        raise SystemExit(f"--drift: seconds of real rounds, finite and more than 0, got {args.drift}")
    workloads = {s: matrix_workloads(s)[0] for s in shapes}
    t_start = time.perf_counter()

    def clock() -> str:
        return f"[{time.perf_counter() - t_start:6.0f}s]"

    def priced(tag: str) -> dict:
        out = {}
        for shape in shapes:
            t0 = time.perf_counter()
            actor, reward = _models(shape, 0)
            with OtherCPU() as other:
                path = args.out / f"profile_{shape}_{tag}.json"
                profile = calibrate(actor, reward, path=path, threads=(1,))
            out[shape] = predict(workloads[shape], profile, args.warmup, args.steps, MATRIX_ARMS)
            print(f"{clock()} calibrated on {shape} ({tag}) in {time.perf_counter() - t0:.0f}s, load "
                  f"{os.getloadavg()[0]:.1f}, {_other(other)}; penalty {profile.host.interpreter_penalty}, "
                  f"hand-overs {profile.host.interpreter_handover}; twin "
                  + "  ".join(f"{a[0]} {out[shape][a][0] * 1e3:.1f} ms" for a in MATRIX_ARMS),
                  flush=True)  # fmt: skip
        return out

    first = priced("first")
    rounds: dict[str, list[dict]] = {s: [] for s in shapes}
    end = time.perf_counter() + args.drift
    while time.perf_counter() < end:
        for shape in shapes:
            with OtherCPU() as other:
                real = measure(workloads[shape], args.warmup, args.steps, MATRIX_ARMS)
            rounds[shape].append(real)
            arms = "  ".join(
                f"{a[0]} {real[a][0] * 1e3:6.1f} ms ({first[shape][a][0] / real[a][0] - 1:+4.0%})"
                for a in MATRIX_ARMS
            )
            print(f"{clock()} {shape:<5} real {arms}   load {os.getloadavg()[0]:.1f}, {_other(other)}, "
                  f"{reference()}", flush=True)  # fmt: skip
    last = priced("last")
    print("\nper shape and arm: the real rounds' min / median / max; the first calibration's fixed "
          "prediction and its signed error against each round, min / median / max, and the share of rounds "
          "within 10%; the last calibration's prediction and its median error")  # fmt: skip
    for shape in shapes:
        for arm, d in drift_summary(first[shape], last[shape], rounds[shape]).items():
            print(f"{shape:<5} {arm[0]:<10} real {d['min'] * 1e3:6.1f} / {d['median'] * 1e3:6.1f} / "
                  f"{d['max'] * 1e3:6.1f} ms over {len(rounds[shape])} rounds; first twin "
                  f"{d['twin'] * 1e3:6.1f} ms: {d['error min']:+4.0%} / {d['error median']:+4.0%} / "
                  f"{d['error max']:+4.0%}, within 10% in {d['within 10%']:.0%} of rounds; last twin "
                  f"{d['twin last'] * 1e3:6.1f} ms: {d['last error median']:+4.0%}")  # fmt: skip
    return 0


# -- where a matrix cell's time goes -------------------------------------------------------------------------


def _other(other: OtherCPU) -> str:
    return "other processes ?" if other.cores is None else f"other processes {other.cores:.2f} cores"


def phase_sums(spans: list[tuple], wall: float, rows: int) -> dict[str, float]:
    """One step's seconds by phase from its lane spans ``(lane, name, start, end, tokens)``: the actor's
    decode forwards (at most ``rows`` tokens) and its other forwards (those with prompts), and each scorer
    lane's spans by name, each counted ``beside`` where over half of it overlaps the other side's spans
    (the actor's for a scorer's, the scorers' for the actor's), else ``alone``; ``host`` is the step's
    ``wall`` outside every span. A key ending in ``" n"`` is a count: forwards, or ``tokens n`` tokens."""
    out: dict[str, float] = {}
    actor = [s for s in spans if s[0] == ACTOR]
    scorers = [s for s in spans if s[0] != ACTOR]

    def add(key: str, seconds: float, tokens: int | None) -> None:
        out[key] = out.get(key, 0.0) + seconds
        out[key + " n"] = out.get(key + " n", 0) + 1
        out[key + " tokens n"] = out.get(key + " tokens n", 0) + (tokens or 0)

    def side(t0: float, t1: float, other: list[tuple]) -> str:
        overlap = sum(max(0.0, min(t1, o[3]) - max(t0, o[2])) for o in other)
        return "beside" if overlap > (t1 - t0) / 2 else "alone"

    for _, _, t0, t1, tokens in actor:
        kind = "decode" if tokens is not None and tokens <= rows else "prompt fwd"
        add(f"actor {kind} {side(t0, t1, scorers)}", t1 - t0, tokens)
    for lane, name, t0, t1, tokens in scorers:
        add(f"{lane} {name} {side(t0, t1, actor)}", t1 - t0, tokens)
    busy, end = 0.0, float("-inf")
    for t0, t1 in sorted((s[2], s[3]) for s in spans):
        if t1 > end:
            busy += t1 - max(t0, end)
            end = t1
    out["host (outside spans)"] = wall - busy
    out["step"] = wall
    return out


def _dump(path: Path | None, title: str, spans: list[tuple], wall: float) -> None:
    if path is None or not spans:
        return
    t0 = min(sp[2] for sp in spans)
    with open(path, "a") as f:
        f.write(f"== {title}: wall {wall * 1e3:.1f} ms (lane, what, start, end, duration, tokens)\n")
        for lane, name, a, b, tokens in sorted(spans, key=lambda sp: sp[2]):
            f.write(f"  {lane:<8}{name:<9}{(a - t0) * 1e3:8.1f} {(b - t0) * 1e3:8.1f} {(b - a) * 1e3:7.2f} ms"
                    f"  {tokens}\n")  # fmt: skip


def _spans(engine) -> list[tuple]:
    return [(s.lane, s.name, s.start_s, s.end_s, s.args.get("tokens")) for s in engine.timeline.spans()]


@contextmanager
def _timing(owner, name: str, into: list[float]):
    """``owner.name`` wrapped to append each call's seconds to ``into`` while the block runs."""
    fn = getattr(owner, name)

    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            into.append(time.perf_counter() - t0)

    setattr(owner, name, timed)
    try:
        yield
    finally:
        setattr(owner, name, fn)


def _phase_round(w: Workload, arms, models, draws, warmup: int, steps: int, dump: Path | None) -> dict:
    """One round of real steps of ``arms``, interleaved as ``measure`` runs them: per arm, per measured
    step, its ``phase_sums`` with two of the engine's own costs inside its actor's forwards beside them --
    the packs' refreshes (the repacking after ``update_policy()`` is the longest) and ``silu_mul``'s
    bitwise probes (``ops.silu_mul_exact``: once per process for each new row count of a fused MLP)."""
    from oppo_engine import ops  # noqa: PLC0415
    from oppo_engine.model import packed  # noqa: PLC0415

    actor, reward = models
    lengths, prompts = draws
    max_len = max(map(len, prompts)) + max(lengths)
    real: dict[tuple, list[dict]] = {a: [] for a in arms}
    engines = {arm: _arm_engine(w, arm, actor, reward, prompts, lengths, max_len) for arm in arms}
    refreshes: list[float] = []
    probes: list[float] = []
    try:
        with _timing(packed.PackedLinears, "_refresh", refreshes), _timing(ops, "_silu_probe", probes):
            for k in range(steps):
                for arm in arms[k % len(arms) :] + arms[: k % len(arms)]:
                    refreshes.clear()
                    probes.clear()
                    result = engines[arm].step()
                    spans = _spans(engines[arm])
                    engines[arm].update_policy()
                    if k >= warmup:
                        _dump(dump, f"real {arm[0]} step {k}", spans, result.metrics.wall_s)
                        sums = phase_sums(spans, result.metrics.wall_s, 2 * w.batch_size)
                        sums["  packs' repacking (the longest refresh)"] = max(refreshes, default=0.0)
                        sums["  silu_mul probes (engine)"] = sum(probes)
                        real[arm].append(sums)
    finally:
        for engine in engines.values():
            engine.close()
    return real


def phases(args) -> int:
    """Where one matrix cell's time goes: per phase (``phase_sums``), the real engine's seconds per step
    (its steps of every round but the first: the matrix's real figure is the median of its rounds, whose
    first meets every forward's row count for the first time) beside the twin's prediction of the same
    workload from ``--phases-profile`` (a profile written by ``--matrix`` or ``calibrate``); medians over
    the steps (the real mean beside). ``--phases-dump FILE`` appends every measured step's spans."""
    import os  # noqa: PLC0415

    torch.set_num_threads(1)
    profile = Profile.load(args.phases_profile)
    w = {x.name.split()[1]: x for x in matrix_workloads(args.phases_shape)}[args.phases_workload]
    arms = [a for a in MATRIX_ARMS if a[0] in args.phases_modes.split(",")]
    steps = args.warmup + args.steps
    models = _models(w.model, 0)
    lengths, prompt_lens = _draws(w, (steps + 2) * (w.batch_size * 3 // 2))
    rng = random.Random(5)
    prompts = [[rng.randrange(4, models[0].config.vocab_size) for _ in range(n)] for n in prompt_lens]
    real: dict[tuple, list[dict]] = {a: [] for a in arms}
    with OtherCPU() as other:
        for r in range(args.rounds):
            got = _phase_round(w, arms, models, (lengths, prompts), args.warmup, steps, args.phases_dump)
            for arm in arms:
                real[arm] += got[arm] if r or args.rounds == 1 else []
    twin: dict[tuple, list[dict]] = {}
    source = _shape_source(w.model, SHAPES.get(w.model))
    for arm in arms:
        mode, chunk, delta = arm
        setting, config = _arm_setting(w, profile, source, arm, lengths, prompt_lens)
        repack = setting.cost.repack(setting.shapes[ACTOR]).alone_s if setting.actor_packed else 0.0
        world = World(
            setting, mode, chunk_size=chunk, delta=config.overcommit if delta else None, steps=steps
        )
        twin[arm] = []
        try:
            for k in range(steps):
                (record,) = world.run(1)
                spans = _spans(world.engines[0])
                if k >= args.warmup:
                    _dump(args.phases_dump, f"twin {arm[0]} step {k}", spans, record.rollout_s)
                    twin[arm].append(phase_sums(spans, record.rollout_s, 2 * w.batch_size))
                    twin[arm][-1]["  packs' repacking (the longest refresh)"] = repack
        finally:
            world.close()
    busy = "?" if other.cores is None else f"{other.cores:.2f}"
    print(f"{w.name} predicted from {args.phases_profile} (cores {profile.cores}, penalty "
          f"{profile.host.interpreter_penalty}, hand-overs {profile.host.interpreter_handover}); other "
          f"processes' CPU during the real steps {busy} cores, load {os.getloadavg()[0]:.1f}; medians "
          f"over {len(next(iter(real.values())))} real steps and {args.steps} predicted (seconds; n: "
          f"counts)")  # fmt: skip
    for arm in arms:
        print(f"  {arm[0]}:")
        for key in sorted({k for d in real[arm] + twin[arm] for k in d}):
            r = statistics.median(d.get(key, 0.0) for d in real[arm])
            t = statistics.median(d.get(key, 0.0) for d in twin[arm])
            mean = statistics.fmean(d.get(key, 0.0) for d in real[arm])
            if key.endswith(" n"):
                print(f"    {key:<42} real {r:>6.0f}   twin {t:>6.0f}")
            else:
                err = f"{t / r - 1:+5.0%}" if r > 0 else "     "
                print(f"    {key:<42} real {r:>8.4f}  twin {t:>8.4f}  {err}   (real mean {mean:.4f})")
    return 0


# -- one forward's terms, real against priced ----------------------------------------------------------

FORWARD_TERM_POINTS = ((1, 1, 16), (1, 1, 48), (8, 1, 64), (8, 64, 0))  # (rows, new, context)


def forward_terms(args) -> int:
    """The actor's forward on each of ``--forward-terms``' shapes, term by term, real against priced: the
    forward (the median of a point's timed calls, the median of 3 rounds, as ``calibrate`` times its grid),
    its packed products timed call by call inside 5 more forwards (``calibration._time_packed_calls``; per
    product shape the median call, times the calls a forward makes, beside the profile's compute and memory
    terms, the price being their ``max``), and the rest of the forward (the interpreter, the attention, the
    elementwise ops: the forward less its products) against the rest of the price (mostly the fixed costs
    fitted from the shrunk copies). The priced forward leaves out the engine's scheduler time per forward
    (``Calibrated.host_s``), which the timed calls do not run and ``calibrate``'s fit leaves out too. The
    profile is ``--out``'s ``profile_<shape>.json`` (a ``--matrix`` run's) where it exists, else calibrated
    here and written there. At a point of the calibration's grid (``FORWARD_GRID``: "fitted") the profile
    was fitted to that forward among the others; elsewhere ("held out") its price is a prediction."""
    import os  # noqa: PLC0415

    from oppo_engine.sim import calibration as cal  # noqa: PLC0415
    from oppo_engine.sim.cost import CostModel  # noqa: PLC0415
    from oppo_engine.sim.profile import Calibrated  # noqa: PLC0415
    from oppo_engine.sim.shapes import model_shape  # noqa: PLC0415

    torch.set_num_threads(1)
    device = torch.device("cpu")
    timed = cal._timer(device)
    for shape in args.forward_terms.split(","):
        if shape not in MATRIX_SHAPES:
            raise SystemExit(f"--forward-terms: each one of {MATRIX_SHAPES}, got {shape!r}")
        actor, reward = _models(shape, 0)
        path = args.out / f"profile_{shape}.json"
        if path.exists():
            profile, how = Profile.load(path), f"loaded from {path}"
        else:
            profile, how = calibrate(actor, reward, path=path, threads=(1,)), f"calibrated here into {path}"
        priced = Calibrated(profile)
        cost = CostModel(priced)
        dtype_bytes = actor.dtype.itemsize
        actor_shape = model_shape(actor, head="lm", dtype_bytes=dtype_bytes, name="actor")
        packed = profile.costs_at(1).packed
        bench = cal._RoleBench("actor", actor, device, packed=packed)
        print(f"{shape}: {actor_shape.layers} layers, {actor_shape.weight_bytes / 2**20:.1f} MiB of weights; "
              f"profile {how}; load {os.getloadavg()[0]:.1f}")  # fmt: skip
        for point in FORWARD_TERM_POINTS:
            batch = cal._batch("actor", *point)
            work = cost.forward(actor_shape, batch, packed=packed, actor=True)
            scheduler = priced.host_s(len(batch.chunks))  # priced in every forward, run by no timed call
            forward, fixed = work.alone_s - scheduler, work.host_s - scheduler
            real = cal.ROUND_STATISTIC([timed(bench.call(*point), 5) for _ in range(cal.ROUNDS)])
            calls = cal._time_packed_calls([(bench, actor_shape.weight_bytes, [point])])
            real_products = priced_products = 0.0
            lines = []
            for (m, k, n), (working, seconds) in sorted(calls.items()):
                compute, memory = priced.gemm(m, k, n, dtype_bytes, 1, working, packed)
                count = len(seconds) // cal.CALL_REPEATS
                real_products += count * statistics.median(seconds)
                priced_products += count * max(compute, memory)
                lines.append(f"{m}x{k}x{n} x{count}: {statistics.median(seconds) * 1e6:.0f} us against "
                             f"compute {compute * 1e6:.0f} / memory {memory * 1e6:.0f}")  # fmt: skip
            kind = "fitted" if point in cal.FORWARD_GRID else "held out"
            print(f"  {point} ({kind}): forward real {real * 1e3:.3f} ms, priced {forward * 1e3:.3f} "
                  f"({forward / real - 1:+.0%}); products {real_products * 1e3:.3f} against "
                  f"{priced_products * 1e3:.3f}; the rest {(real - real_products) * 1e3:.3f} against "
                  f"{(forward - priced_products) * 1e3:.3f} (fixed costs {fixed * 1e3:.3f})")  # fmt: skip
            print("    " + "; ".join(lines))
    return 0


# -- the long-tail drain: the chunk controller's cost on a CPU ---------------------------------------------

# A small Llama-layout actor whose head_dim (32) and GQA ratio (3) no preset has; the reward is the small
# preset's Qwen2 (held out from the project's calibration and bench_twin's own workloads).
DRAIN_ACTOR = dict(vocab_size=512, hidden_size=192, intermediate_size=512, num_hidden_layers=4,
                   num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=4096)  # fmt: skip
DRAIN_PROMPTS = 64


def _drain_models(seed: int = 0):
    from transformers import LlamaConfig  # noqa: PLC0415

    torch.manual_seed(seed)
    config = LlamaConfig(**DRAIN_ACTOR, pad_token_id=PAD_TOKEN_ID, eos_token_id=EOS_TOKEN_ID)
    actor = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    _, reward = build_models("small", torch.float32, "cpu", seed)
    return actor, reward


@dataclass(frozen=True)
class Drain:
    """A drain: these prompts and forced response lengths, stepped until the engine returns nothing."""

    name: str
    models: tuple  # (actor, reward)
    lengths: list[int]
    prompts: list[list[int]]
    batch_size: int
    overcommit: int


def held_out_drain() -> Drain:
    """The held-out long-tail drain: ``DRAIN_PROMPTS`` prompts of 16-48 tokens, Pareto-tailed responses
    (``pareto_tail``: most 10-30 tokens, a few at the 160 cap), B=8, Δ=B."""
    actor, reward = _drain_models()
    lengths = list(pareto_tail(DRAIN_PROMPTS))
    rng = random.Random(5)
    prompts = [[rng.randrange(4, actor.config.vocab_size) for _ in range(rng.randrange(16, 49))]
               for _ in lengths]  # fmt: skip
    return Drain("held-out pareto", (actor, reward), lengths, prompts, 8, 8)


def workload_drain(w: Workload, batches: int = 8) -> Drain:
    """``batches`` batches of a bench_twin workload, Δ = B / 2 as in its arms."""
    actor, reward = _models(w.model, 0)
    lengths, prompt_lens = _draws(w, batches * w.batch_size)
    rng = random.Random(5)
    prompts = [[rng.randrange(4, actor.config.vocab_size) for _ in range(n)] for n in prompt_lens]
    return Drain(w.name, (actor, reward), lengths, prompts, w.batch_size, w.batch_size // 2)


def drain_once(mode: str, d: Drain) -> tuple[float, list]:
    """One drain of ``d`` in ``mode`` (lengths forced with ``ignore_eos``, no lag bound, ``chunk_size``
    left at ``"auto"``; ``"oppo-list"``: ``oppo`` under ``ChunkControl(prior="list")``, which calls no arm
    futile, as the search ran before the first step's profile could decide): the wall seconds of the whole
    drain, the CPU seconds of the process (every thread: the work, which the machine's load moves less
    than the wall time), and the chunk controller's arms."""
    actor, reward = d.models
    knobs = {"chunk": ChunkControl(prior="list")} if mode == "oppo-list" else {}
    config = EngineConfig(batch_size=d.batch_size, mode=mode.removesuffix("-list"), overcommit=d.overcommit,
                          max_policy_lag=None, max_model_len=max(map(len, d.prompts)) + max(d.lengths),
                          **knobs)  # fmt: skip
    engine = RolloutEngine(
        actor=actor,
        reward=reward,
        config=config,
        eos_token_id=EOS_TOKEN_ID,
        sampling=SamplingParams(max_new_tokens=max(d.lengths), ignore_eos=True, seed=0),
    )
    engine.add_prompts(
        d.prompts, sampling=[SamplingParams(max_new_tokens=n, ignore_eos=True) for n in d.lengths]
    )
    try:
        gc.collect()  # the previous arm's engine (threads, reference cycles) is collected outside the timing
        t0, c0 = time.perf_counter(), time.process_time()
        returned = 0
        while rollouts := engine.step().rollouts:
            returned += len(rollouts)
            engine.update_policy()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        assert returned == len(d.prompts), (returned, len(d.prompts))
        return wall, cpu, [c for _, c, _ in engine.chunk_history]
    finally:
        engine.close()


def drain(args) -> int:
    """``inter`` against ``oppo`` with ``chunk_size="auto"`` (and ``oppo`` under ``prior="list"``, the
    search before the first step's profile decided), whole drains: the held-out long-tail drain, then
    (``--drain-workloads``) each bench_twin workload. ``--rounds`` rounds per drain, the arms interleaved
    (the order rotates), the median of the rounds; the load beside each."""
    import os  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    # No calibrated profile: the profiles' folder is an empty one, whatever this machine calibrated.
    with tempfile.TemporaryDirectory() as empty:
        saved = os.environ.get("OPPO_ENGINE_PROFILES")
        os.environ["OPPO_ENGINE_PROFILES"] = empty
        try:
            return _drain(args)
        finally:
            if saved is None:
                os.environ.pop("OPPO_ENGINE_PROFILES")
            else:
                os.environ["OPPO_ENGINE_PROFILES"] = saved


def _drain(args) -> int:
    import os  # noqa: PLC0415

    torch.set_num_threads(1)
    drains = [held_out_drain()]
    if args.drain_workloads:
        drains += [workload_drain(w) for w in WORKLOADS]
    summary = []
    for d in drains:
        drain_once("inter", d)  # a warm-up drain: first forwards, allocator, thread start
        modes = ("inter", "oppo", "oppo-list")
        walls: dict[str, list[float]] = {m: [] for m in modes}
        cpus: dict[str, list[float]] = {m: [] for m in modes}
        for r in range(args.rounds):
            for mode in modes[r % 3 :] + modes[: r % 3]:  # each arm first in one round of three
                wall, cpu, arms = drain_once(mode, d)
                walls[mode].append(wall)
                cpus[mode].append(cpu)
                shown = f"  arms: {' '.join(map(str, arms))}" if arms else ""
                print(f"{d.name:<16} round {r} {mode:<9} {wall:.3f}s wall {cpu:.3f}s CPU  "
                      f"load {os.getloadavg()[0]:.2f}{shown}")  # fmt: skip
        wall = [statistics.median(walls[m]) for m in modes]
        cpu = [statistics.median(cpus[m]) for m in modes]
        summary.append((d, wall, cpu, os.getloadavg()))
    print(
        f"\ninter vs oppo (chunk_size='auto', no calibrated profile), whole drains, median of {args.rounds}; "
        "ratios are inter / arm (oppo's speed, x inter: above 1 is faster):"
    )
    for d, (inter, oppo, listed), (c_inter, c_oppo, c_listed), load in summary:
        goal = "0.97x" if d.name == "held-out pareto" else "0.95x"
        print(
            f"  {d.name:<16} B={d.batch_size} Δ={d.overcommit} {len(d.prompts)} prompts: "
            f"wall inter {inter:.3f}s, oppo {oppo:.3f}s: inter/oppo {inter / oppo:.3f}x (goal >= {goal}), "
            f"prior='list' {listed:.3f}s: inter/list {inter / listed:.3f}x; CPU: inter/oppo "
            f"{c_inter / c_oppo:.3f}x, inter/list {c_inter / c_listed:.3f}x; "
            f"load {' '.join(f'{x:.2f}' for x in load)}"
        )
    return 0


# -- the paper's setting, on paper ---------------------------------------------------------------------------

PAPER = {  # Table (ablation): speed-up in time to reward against TRL's sequential PPO
    "7b": {"intra": 1.2, "inter": 1.6, "oppo": 1.9},
    "3b": {"intra": 1.3, "inter": 2.06, "oppo": 2.5},
}
# Minutes to reward of TRL and OPPO as the seed gives them (/work/shared/seeds/000_0e21a575d220e76b.txt):
# the main table gives TRL 7B 4,300 min, the ablation table 4,200 min; both are quoted, neither is chosen.
PAPER_MINUTES = {
    "7b": {"trl": (4300, 4200), "oppo": 2300, "reward": 4.17},
    "3b": {"trl": (13000, 13000), "oppo": 5200, "reward": 5.12},
}
STACK_EXCHANGE = "lognormal:median=250,sigma=0.9,cap=1024"  # long-tailed, Stack-Exchange-like (our choice)


def paper(args) -> int:
    config = EngineConfig(chunk=ChunkControl(candidates=(128, 256, 512)))
    print(paper_two_node())
    for actor in ("7b", "3b"):
        t0 = time.perf_counter()
        p = plan(actor, reward="7b", critic=actor, reference=actor, device="h200", gpus=8, placement="7+1",
                 batch_size=112, lengths=STACK_EXCHANGE, prompt_lengths=128, steps=args.paper_steps,
                 config=config, modes=("sequential", "intra", "inter", "oppo", "trl", "sync"))  # fmt: skip
        wall = time.perf_counter() - t0
        print(
            f"\n{actor} actor (value-head critic and reference of its shape), 7B reward, 8xH200 as 7+1, "
            f"B=112, responses {STACK_EXCHANGE}, prompts 128, candidates 128/256/512; twin {wall:.0f}s"
        )
        print(p.table())
        seq = p.modes["sequential"]
        print(f"{'mode':<11}{'twin speed-up':>14}{'paper':>7}{'twin rollout speed-up':>23}"
              f"{'time to reward':>16}")  # fmt: skip
        for mode, m in p.modes.items():
            paper_x = {**PAPER[actor], "sequential": 1.0}.get(
                mode
            )  # the paper has no sync arm; trl is its base
            shown = f"{paper_x:>6.2f}x" if paper_x is not None else f"{'-':>7}"
            print(f"{mode:<11}{m.speedup:>13.2f}x{shown}{seq.rollout_s / m.rollout_s:>22.2f}x"
                  f"{m.time_s / 3600:>14.1f} h")  # fmt: skip
        trl, minutes = p.modes["trl"], PAPER_MINUTES[actor]
        print(
            "against the TRL-like arm (sim/baselines.py), s/step ratios beside the paper's time-to-reward "
            "ratios -- comparable only if both reach the reward in the same number of steps (an assumption):"
        )
        for mode in ("intra", "inter", "oppo"):
            print(
                f"  {mode:<6} twin {p.modes[mode].speedup_vs['trl']:>6.2f}x   paper {PAPER[actor][mode]:.2f}x"
            )
        print(f"  paper: TRL {minutes['trl'][0]:,} min (main table) / {minutes['trl'][1]:,} min (ablation), "
              f"OPPO {minutes['oppo']:,} min to reward {minutes['reward']}; the paper's OPPO wraps TRL (its "
              "generation is TRL's), the twin's 'oppo' is this engine")  # fmt: skip
        print("  TRL-like step by phase (s): " + ", ".join(f"{k} {v:.1f}" for k, v in trl.phases.items()))
        share = seq.update_s / seq.s_per_step
        exposed = seq.exposed_scoring_s / seq.s_per_step
        print(f"terms: the update is {share:.0%} of sequential's predicted step, exposed scoring "
              f"{exposed:.0%}; the rollout is {seq.rollout_s:.1f}s of it")  # fmt: skip
        sweep = p.modes["oppo"].chunk_sweep
        best = min(sweep, key=sweep.get)
        print(
            "oppo chunk sweep (s/step): "
            + ", ".join(f"{c}: {v:.2f}" for c, v in sweep.items())
            + f"; fastest {best}; paper: 500 fastest (171 s/step), 100 and 3000 slower"
        )
        for name, prior in (("model", "model"), ("list", "list")):
            q = plan(actor, reward="7b", critic=actor, reference=actor, device="h200", gpus=8,
                     placement="7+1",
                     batch_size=112, lengths=STACK_EXCHANGE, prompt_lengths=128, steps=args.paper_steps,
                     modes=("oppo",), config=EngineConfig(chunk=ChunkControl(candidates=(128, 256, 512),
                                                                            prior=prior)))  # fmt: skip
            print(f"chunk controller, prior={name}: {exploration(q.modes['oppo'].chunk_history)}")
    return 0


def paper_two_node() -> str:
    """The paper's two-node step latency row, refused by name (bench/published.py)."""
    from bench.published import ROWS, Refused, predict  # noqa: PLC0415

    row = next(r for r in ROWS if r.key == "oppo-paper-2node")
    try:
        predict(row)
    except Refused as e:
        return (
            f"paper: TRL {row.figure} s/step, OPPO {row.settings['oppo']} s/step on 2x4 A100: REFUSED ({e})"
        )
    raise AssertionError("the two-node row must be refused")


def exploration(history: list) -> str:
    """How a controller's arms went: the arm it settled on, the first step from which it never left it but
    to explore, and the steps it spent on other arms over the run."""
    if not history:
        return "no arms"
    final = max(set(history[-max(1, len(history) // 3) :]), key=history.count)
    first = next(i for i, a in enumerate(history) if a == final)
    away = sum(1 for a in history if a != final)
    return f"settled on {final} from step {first}; {away} of {len(history)} steps on other arms"


def host(args) -> int:
    from oppo_engine.sim.twin import measure_host_costs  # noqa: PLC0415

    torch.set_num_threads(1)
    costs = [measure_host_costs() for _ in range(3)]
    # the fastest by a whole step's host time (96 forwards of 16 rows): per_step_s and per_forward_s trade
    best = min(costs, key=lambda c: c.per_step_s + 96 * (c.per_forward_s + 16 * c.per_row_s))
    print(f"HostCosts(per_forward_s={best.per_forward_s:.2g}, per_row_s={best.per_row_s:.2g}, "
          f"handoff_s={best.handoff_s:.2g}, per_step_s={best.per_step_s:.2g})  # the fastest of 3 "
          "measurements")  # fmt: skip
    return 0


def device_check(args) -> int:
    """The twin, on a profile calibrated on this GPU (``--calibrate``: now, from the preset's actor and
    reward), against bench_e2e's measured steps (its CSV), on the same workload: ``twin_error_<mode>=``
    lines."""
    from bench.workloads import make_workload  # noqa: PLC0415
    from oppo_engine.presets import PRESETS  # noqa: PLC0415

    if args.calibrate:
        t0 = time.perf_counter()
        actor, reward = build_models(args.preset, torch.bfloat16, "cuda", 0)
        profile = calibrate(actor, reward, path=args.profile)
        del actor, reward
        torch.cuda.empty_cache()
        print(f"calibrated {profile.device} in {time.perf_counter() - t0:.0f}s (fit error "
              f"{profile.threads[1].fit_error:.1%}); profile: {args.profile}")  # fmt: skip
    profile = Profile.load(args.profile)
    measured: dict[str, list[float]] = {}
    with open(args.e2e / "steps.csv") as f:
        for row in csv.DictReader(f):
            measured.setdefault(row["mode"], []).append(float(row["wall_s"]))
    steps = min(len(v) for v in measured.values())
    warmup = 1
    workload = make_workload("longtail", args.batch_size * (warmup + steps + 1), 128, args.response_len_cap,
                             PRESETS[args.preset]["vocab_size"], 0)  # fmt: skip
    for mode, walls in measured.items():
        if mode not in ("sequential", "intra", "inter", "oppo"):
            continue
        placement = "cpu" if profile.kind == "cpu" else "colocated"
        p = plan(args.preset, reward=args.preset, device=profile, gpus=1, placement=placement,
                 batch_size=args.batch_size, lengths=workload.max_new_tokens,
                 prompt_lengths=[len(x) for x in workload.prompts], steps=warmup + steps, modes=(mode,),
                 config=EngineConfig(max_model_len=128 + args.response_len_cap),
                 extrapolate=False)  # fmt: skip
        twin = p.modes[mode].rollout_s
        real = statistics.fmean(walls)
        print(f"twin_error_{mode}={twin / real - 1:+.3f} (twin {twin:.3f}s, measured {real:.3f}s per step)")
    return 0


LONG = (
    "lognormal:median=3000,sigma=0.8,cap=16384"  # long reasoning responses (our choice; Seer's are context)
)


def long_reasoning(args) -> int:
    """A DAPO-like run (no reference, no KL: nothing streams) and a GRPO run with a reference, each a 7B
    actor with a rule reward on 8xH200 colocated, 64 prompts x 8 samples, responses lognormal median 3k,
    cap 16k, prompts 512; 4 steps; the PPOTrainer's default update, then packed and grouped by length."""
    import os  # noqa: PLC0415

    config = EngineConfig(max_model_len=16384 + 512, chunk=ChunkControl(candidates=(512, 2048)))
    for name, reference in (("DAPO-like (no reference)", None), ("GRPO with a reference", "7b")):
        for update in ("padded", "packed"):
            t0 = time.perf_counter()
            packed = update == "packed"
            p = plan("7b", reward="rule", reference=reference, device="h200", gpus=8, placement="colocated",
                     batch_size=64, group_size=8, lengths=LONG, prompt_lengths=512, steps=4, config=config,
                     sweep=(512, 2048), measure=1, group_by_length=packed,
                     max_tokens_per_microbatch=16896 if packed else None)  # fmt: skip
            wall = time.perf_counter() - t0
            how = "packed (16,896 tokens), group_by_length" if packed else "padded shares"
            print(f"\n{name}; update: {how}; twin {wall:.0f}s, load {os.getloadavg()[0]:.1f}")
            print(p.table())
            for mode, m in p.modes.items():
                print(f"  {mode:<11} rollout {m.rollout_s / m.s_per_step:.0%} of the step")
    return 0


# The published rows timed per kernel (bench/published.py): a page's heading and each row's setting.
KERNEL_ROWS = {
    "gemm": ("GEMM source rows (gemm_fit)", lambda s: f"{s['m']} x {s['k']} x {s['n']}"),
    "elementwise": (
        "Elementwise source rows (elementwise_fit)",
        lambda s: f"{s['op']} x {s['tokens']} tokens",
    ),
}


def published(args) -> int:
    """Every row of ``bench/published.py``: setting, published figure, the twin's prediction, their ratio
    and the source; refused rows name why. The goals count only check rows."""
    from bench.published import table  # noqa: PLC0415

    rows = table()
    print("The twin against published GPU measurements (every twin number a prediction)")
    print(f"{'row':<34}{'role':<7}{'published':>12}{'predicted':>12}{'ratio':>7}  unit / setting / source")
    errors = []
    group = None
    for r in rows:
        row = r["row"]
        pub = f"{row.figure:.4g}"
        if row.kind in KERNEL_ROWS:  # many rows of one page: its source, GPU and software once, a line a row
            title, setting = KERNEL_ROWS[row.kind]
            if (row.url, row.gpu, row.kind) != group:
                group = (row.url, row.gpu, row.kind)
                print(f"{title}: {row.url}; {row.gpu}; {row.software}")
                print(f"{'':<41}fixes: {row.constant}")
            us = f"{row.figure * 1e6:.1f} us"
            print(f"{row.key:<34}{row.role:<7}{us:>12}{r['prediction'] * 1e6:>12.1f}{r['ratio']:>7.3f}  "
                  f"{setting(row.settings)}; quote: {row.quote}")  # fmt: skip
            continue
        if r["prediction"] is None:
            print(f"{row.key:<34}{row.role:<7}{pub:>12}{'refused':>12}{'':>7}  {row.unit}; {row.gpu}")
            print(f"{'':<41}REFUSED: {r['refused']}")
        else:
            pred, ratio = r["prediction"], r["ratio"]
            print(f"{row.key:<34}{row.role:<7}{pub:>12}{pred:>12.4g}{ratio:>7.3f}  {row.unit}; "
                  f"{row.gpu}; {row.software}")  # fmt: skip
            if row.role == "check":
                errors.append(abs(r["ratio"] - 1))
        print(f"{'':<41}source: {row.url}")
        print(f"{'':<41}quote: {row.quote}")
        if row.constant:
            print(f"{'':<41}fixes: {row.constant}")
    if errors:
        errors.sort()
        within = sum(e <= 0.25 for e in errors)
        print(f"check rows priced: {len(errors)}; within 25%: {within}; median error "
              f"{statistics.median(errors):.1%}; worst {errors[-1]:.1%} (goal: every one within 25%, median "
              f"within 15%)")  # fmt: skip
    refused = sum(r["prediction"] is None for r in rows)
    print(f"rows refused by name: {refused} of {len(rows)}")
    from bench.published import decode_fit, elementwise_fit, gemm_fit  # noqa: PLC0415
    from oppo_engine.sim.devices import device  # noqa: PLC0415

    print("GEMM fit from the gemm source rows (t = max(c, m) + a min(c, m), the twin's terms; ratios twin "
          "over published, median [min, max]):")  # fmt: skip
    for key, f in gemm_fit().items():
        (b, b0, b1), (g, g0, g1) = f["bare"], f["fitted"]
        print(f"  {key}: a = {f['unhidden']:.3f} ({len(f['rows'])} rows; the table's gemm_unhidden "
              f"{device(key).fractions.gemm_unhidden}): max alone {b:.2f} [{b0:.2f}, {b1:.2f}], fitted "
              f"{g:.2f} [{g0:.2f}, {g1:.2f}]")  # fmt: skip

    print("elementwise fit from the elementwise source rows (a layer: 6 floor + bytes / (hbm x fraction), "
          "against the sum of its profiled kernels, the add twice; ratios twin over profile, median [min, "
          "max]):")  # fmt: skip
    for key, f in elementwise_fit().items():
        fr = device(key).fractions
        (b, b0, b1), (g, g0, g1), (c, c0, c1) = f["bare"], f["fitted"], f["cells"]
        print(f"  {key}: floor {f['floor_s'] * 1e6:.2f} us, fraction {f['fraction']:.3f} ({f['layers']} "
              f"layers of {len(f['rows'])} rows; the table's {fr.elementwise_floor_s * 1e6:.1f} us, "
              f"{fr.elementwise}): "
              f"layers with bytes at stream alone {b:.2f} [{b0:.2f}, {b1:.2f}], fitted {g:.2f} [{g0:.2f}, "
              f"{g1:.2f}]; each kernel fitted {c:.2f} [{c0:.2f}, {c1:.2f}]")  # fmt: skip

    print("decode fit from the fixed-batch latency source rows (published - twin's prefill = steps * overhead"
          " + slope * twin's decode):")  # fmt: skip
    for key, f in decode_fit().items():
        joint, held = f["joint_overhead_s"] * 1e3, f["overhead_s"] * 1e3
        print(
            f"  {key}: joint fit: overhead {joint:.2f} ms/step, slope {f['joint_slope']:.2f} (stream "
            f"{f['joint_stream']:.2f}); the rows' decode terms differ by {f['spread'] - 1:.1%}: not "
            f"separable; the fraction held: {held:.2f} ms + {f['per_row_s'] * 1e3:.3f} ms a row a step"
        )
    return 0


def trl_check(args) -> int:
    """The TRL-like arm's generation and forward terms (``sim/baselines.py``) on this CPU against the HF
    pipeline the project benchmarks against (``bench/baselines.py``): 8 prompts of 16-48 tokens in
    mini-batches of ``TRL_MINI_BATCH``, left-padded through HF ``generate`` (eager, dynamic cache, EOS
    ignored, ``TRL_CHECK_NEW`` tokens each), then the reward's and the actor's forwards over the padded
    sequences; the median of ``--rounds`` rounds, the three interleaved, the load beside each. Priced from a
    profile of this CPU (``--profile``, or calibrated now on the small pair). The twin's HF decode step is
    its eager forward plus ``HF_STEP_HOST_S``, a GPU host time read from an H100 row: printed apart, with
    the host time per decode step this CPU's measurement leaves beside the twin's forward."""
    import os  # noqa: PLC0415

    from bench.baselines import _pad, hf_generate, hf_score  # noqa: PLC0415
    from oppo_engine.sim.baselines import HF_STEP_HOST_S, TRL_MINI_BATCH, _forward_s, hf_decode_s  # noqa: PLC0415
    from oppo_engine.sim.cost import CostModel  # noqa: PLC0415
    from oppo_engine.sim.profile import Calibrated, Profile  # noqa: PLC0415
    from oppo_engine.sim.shapes import model_shape  # noqa: PLC0415

    torch.set_num_threads(1)
    actor, reward = _models("small", 0)
    if args.profile is not None:
        profile = Profile.load(args.profile)
    else:
        profile = calibrate(actor, reward, path=args.out / "profile_cpu.json", threads=(1,))
    cost = CostModel(Calibrated(profile))
    a_shape = model_shape(actor, dtype_bytes=4, name="actor")
    r_shape = model_shape(reward, head="score", dtype_bytes=4, name="reward")
    rng = random.Random(7)
    prompts = [[rng.randrange(4, actor.config.vocab_size) for _ in range(rng.randrange(16, 49))]
               for _ in range(8)]  # fmt: skip
    new = TRL_CHECK_NEW
    batches = [prompts[i : i + TRL_MINI_BATCH] for i in range(0, len(prompts), TRL_MINI_BATCH)]

    def generate() -> list[list[int]]:
        out = []
        for mb in batches:
            out += hf_generate(actor, mb, [new] * len(mb), 0.0, 0, PAD_TOKEN_ID)
        return out

    responses = generate()  # a warm-up round
    seqs = [p + r for p, r in zip(prompts, responses, strict=True)]

    @torch.inference_mode()
    def actor_forward() -> None:
        ids, mask = _pad(seqs, PAD_TOKEN_ID, left=False, device=actor.device)
        actor(input_ids=ids, attention_mask=mask)

    phases = {"generation": generate, "reward forward": lambda: hf_score(reward, seqs, PAD_TOKEN_ID),
              "actor forward": actor_forward}  # fmt: skip
    times: dict[str, list[float]] = {k: [] for k in phases}
    for r in range(args.rounds):
        for name in list(phases)[r % 3 :] + list(phases)[: r % 3]:
            t0 = time.perf_counter()
            phases[name]()
            times[name].append(time.perf_counter() - t0)
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in times.items())
              + f", load {os.getloadavg()[0]:.2f}")  # fmt: skip
    measured = {k: statistics.median(v) for k, v in times.items()}
    decode_steps = sum(new - 1 for _ in batches)
    forwards = sum(_forward_s(cost, a_shape, [max(map(len, mb))] * len(mb)) for mb in batches)
    for mb in batches:
        pad = max(map(len, mb))
        forwards += sum(
            hf_decode_s(cost, a_shape, [pad + k] * len(mb)) - HF_STEP_HOST_S for k in range(1, new)
        )
    lengths = [len(s) for s in seqs]
    twin = {
        "generation": forwards + decode_steps * HF_STEP_HOST_S,
        "reward forward": _forward_s(cost, r_shape, lengths),
        "actor forward": _forward_s(cost, a_shape, lengths),
    }
    print(
        f"\nTRL-like arm's terms vs HF on this CPU ({profile.device}; small pair, 8 prompts in mini-batches "
        f"of {TRL_MINI_BATCH}, {new} tokens each; median of {args.rounds}; twin figures are predictions):"
    )
    for k in phases:
        print(f"  {k:<15} HF {measured[k]:.3f}s   twin {twin[k]:.3f}s   twin/HF {twin[k] / measured[k]:.2f}x")
    left = (measured["generation"] - forwards) / decode_steps
    print(
        f"  generation without HF_STEP_HOST_S ({HF_STEP_HOST_S * 1e3:.1f} ms a step, a GPU figure): twin "
        f"{forwards:.3f}s, twin/HF {forwards / measured['generation']:.2f}x; this CPU leaves "
        f"{left * 1e3:.2f} "
        f"ms a decode step beside the twin's forward ({decode_steps} steps); load "
        + " ".join(f"{x:.2f}" for x in os.getloadavg())
    )
    return 0


TRL_CHECK_NEW = 32  # response tokens of the TRL-like check


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_twin", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    p.add_argument("--paper", action="store_true", help="the paper's settings on paper")
    p.add_argument("--paper-steps", type=int, default=200, help="steps of the paper plans")
    p.add_argument("--host", action="store_true", help="measure the engine's host time per forward")
    p.add_argument("--published", action="store_true", help="the twin against public GPU measurements")
    p.add_argument("--long", action="store_true", help="long reasoning runs on 8xH200 (minutes)")
    p.add_argument("--matrix", action="store_true", help="calibrate on each shape, predict the others")
    p.add_argument("--drain", action="store_true", help="inter vs oppo, chunk 'auto', long-tail drain")
    p.add_argument("--drain-workloads", action="store_true", help="--drain: bench_twin's workloads too")
    p.add_argument("--trl-check", action="store_true", help="the TRL-like arm's terms vs HF on this CPU")
    p.add_argument("--matrix-shapes", default=",".join(MATRIX_SHAPES), help="the matrix's shapes (--matrix)")
    p.add_argument("--drift", type=float, default=None,
                   help="seconds of real rounds against one fixed prediction (spells)")  # fmt: skip
    p.add_argument("--drift-shapes", default="tiny,small", help="--drift: the shapes")
    p.add_argument("--phases-profile", type=Path, default=None,
                   help="where a matrix cell's time goes, predicted from this profile")  # fmt: skip
    p.add_argument("--phases-shape", default="small", help="--phases: the shape whose workload runs")
    p.add_argument("--phases-workload", default="base", help="--phases: base or pareto")
    p.add_argument("--phases-modes", default="sequential,inter,oppo", help="--phases: the arms")
    p.add_argument("--phases-dump", type=Path, default=None, help="--phases: append every step's spans here")
    p.add_argument(
        "--forward-terms", default=None, help="shapes (comma-separated): a forward's terms, real vs priced"
    )
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (--matrix, --drain)")
    p.add_argument("--runs", type=int, default=3, help="--matrix: whole runs, the cells' medians over them")
    p.add_argument("--device-check", action="store_true", help="the twin against bench_e2e on this GPU")
    p.add_argument("--e2e", type=Path, default=Path("bench_out"), help="bench_e2e's --out (--device-check)")
    p.add_argument(
        "--profile", type=Path, default=None, help="a profile (--device-check: this GPU's; --trl-check)"
    )
    p.add_argument("--calibrate", action="store_true", help="calibrate this GPU into --profile first")
    p.add_argument("--preset", default="0.5b", help="bench_e2e's --preset (--device-check)")
    p.add_argument("--batch-size", type=int, default=8, help="bench_e2e's --batch-size (--device-check)")
    p.add_argument("--response-len-cap", type=int, default=256, help="bench_e2e's cap (--device-check)")
    p.add_argument(
        "--steps", type=int, default=3, help="measured steps per arm (accuracy, --matrix, --drift)"
    )
    p.add_argument(
        "--warmup", type=int, default=1, help="warm-up steps per arm (accuracy, --matrix, --drift)"
    )
    p.add_argument("--out", type=Path, default=Path("bench_out"), help="where the CPU profile is written")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.paper:
        return paper(args)
    if args.host:
        return host(args)
    if args.published:
        return published(args)
    if args.long:
        return long_reasoning(args)
    if args.matrix:
        return matrix(args)
    if args.drift is not None:
        return drift(args)
    if args.phases_profile is not None:
        return phases(args)
    if args.forward_terms is not None:
        return forward_terms(args)
    if args.drain:
        return drain(args)
    if args.trl_check:
        return trl_check(args)
    if args.device_check:
        if args.profile is None:
            p.error("--device-check needs --profile (written by --calibrate or oppo-engine calibrate)")
        return device_check(args)
    return accuracy(args)


if __name__ == "__main__":
    raise SystemExit(main())
