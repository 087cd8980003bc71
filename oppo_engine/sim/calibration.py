"""``calibrate``: time the local device and fit its :class:`~oppo_engine.sim.profile.Profile`.

What is timed, per thread count on the CPU (one and the machine's default) or once on a GPU:

- bare GEMMs over a grid of sizes (rows x weight shape): achieved FLOP/s against GEMM size;
- one large copy: the memory bandwidth;
- where the engine's actor multiplies by packed weights (the CPU: ``EngineConfig.packed_weights``), the
  same GEMMs and weight streaming with the weights packed (``ThreadCosts.gemm_packed``,
  ``streaming_packed``);
- the engine's own forwards of each given model (its runner and, for the actor, its sampler and its packed
  weights where the engine packs them; the scorers' reward, reference and critic paths) over a grid of
  rows x new tokens x context; on the CPU also those of each model's shrunk copies (``shrunk_config``) at
  two depths (``shrunk_depths``), over a few small points (``SHRUNK_GRID``), and of each model's narrow
  copy (its width ladder's first rung, ``ladder_head_dims``: the model at its depth, head_dim 16) over the
  models' grid;
- where the actor is packed, packing its weights again (``_time_repack``: after every weight update the engine
  drops the packs and its next forward makes them), and its packed products as its forwards, its copies'
  and its width ladder's call them (``_time_packed_calls``: how much longer a product takes there than bare,
  ``_packed_in_forward``);
- on the CPU, sweeps of a decode's products over 4, 16 and 32 MiB of weights right after sweeps over as many
  other bytes, against back to back (``_time_switch``: a forward after another model's, charged in every
  mode; it matters where ``intra`` and ``oppo`` alternate the models on the shared cache);
- the engine's host time per iteration (its scheduler and bookkeeping around forwards that cost nothing);
- pairs of its forwards run at once on two threads, each pair three times, and on the CPU pairs of its
  one-layer shrunk copies' and a pair of bare projections (the cores two lanes get and the interpreter's
  hand-overs between them, ``_fit_contention``; the models' pairs read with the forwards that follow the
  other's start switched, ``_alternating``), and one streamed step (the interpreter penalty,
  ``_fit_interpreter``; on the CPU of the models' one-layer shrunk copies, whose forwards are mostly Python:
  ``_interpreter_pair``);
- one training step (forward, backward, AdamW) of the actor.

The forwards are fitted, after the GEMMs' share is taken out, with non-negative least squares on relative
error, to device-level constants: a fixed cost per forward and per layer, attention per query-key pair and
per KV byte read, elementwise work per token and hidden unit, and logit post-processing per element. None of
them belongs to a model, so the profile prices models it was not calibrated on. On the CPU the two fixed
costs are fitted from the forwards of shrunk copies of each model (its class, random weights, every width
cut down) at two depths, where they are almost the whole forward and do not move in proportion, and the rest
from the models' own forwards and their narrow copies' with those two held (``_fit``, ``_fixed_costs``): a
wide model's forwards barely determine its per-token constants, and its narrow copy's, where that work is a
larger share, carry them to narrower models.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import statistics
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

from oppo_engine.sim.cost import Batch, CostModel, HostCosts, Work
from oppo_engine.sim.profile import FEATURES, Calibrated, Profile, ThreadCosts, local_device_id
from oppo_engine.sim.shapes import ModelShape, attention_pairs


def nnls(rows: list[list[float]], targets: list[float]) -> list[float]:
    """Non-negative least squares by active-set elimination: solve, drop the most negative coefficient,
    solve again on the rest, until none is negative."""
    import numpy as np  # noqa: PLC0415

    a = np.asarray(rows, dtype=np.float64)
    b = np.asarray(targets, dtype=np.float64)
    active = list(range(a.shape[1]))
    coef = np.zeros(a.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return coef.tolist()


def _timer(device) -> Callable[[Callable[[], object], int], float]:
    """``timed(fn, reps)``: the median of at least ``reps`` calls of ``fn`` (more, up to 50, until they
    add up to 20 ms), after one warm-up call. Callers time in ``ROUNDS`` rounds and keep their median
    (``ROUND_STATISTIC``): a burst of other load slows a round, not the figure kept."""
    import torch  # noqa: PLC0415

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(fn, reps: int) -> float:
        fn()
        sync()
        samples = []
        while len(samples) < reps or (sum(samples) < 0.02 and len(samples) < 50):
            t0 = time.perf_counter()
            fn()
            sync()
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    return timed


# Grids: (rows M) x (weight K, N) of the bare GEMMs; (rows, new tokens, context before) of the forwards.
GEMM_ROWS = (1, 4, 16, 64, 256)
# The CPU's smallest sizes (2K and 4K weights) are the projections of the shrunk copies (``shrunk_config``)
# and of ``tiny``: a call of that size costs its dispatch, which the per-element price of the 16K size held
# flat below it puts at a quarter or an eighth; unpriced, it would land in the fixed cost per layer.
GEMM_SHAPES_CPU = ((32, 64), (64, 32), (64, 64), (128, 128), (256, 256), (256, 704), (704, 256), (384, 1024),
                   (1024, 384), (1024, 1024), (1024, 4096), (4096, 1024))  # fmt: skip
GEMM_ROWS_GPU = (1, 16, 64, 256, 1024, 4096)
GEMM_SHAPES_GPU = ((896, 896), (896, 4864), (4864, 896), (3584, 3584), (3584, 18944), (18944, 3584))
ROUNDS = 3
# How the ``ROUNDS`` rounds of one timing reduce to the figure a profile keeps: their median, the statistic
# the twin's steps are checked against (``bench_twin --matrix``'s real figure is the median of its rounds).
# Format version 11 and older kept the fastest round, which prices the machine at its fastest moments. On
# a Zen 5 VM whose speed comes and goes in spells, each shape calibrated both ways side by side and checked
# against the same real steps, in two sets of 3 runs: the matrix's cells meeting its goal 6 and 3 of 16
# with the fastest, 12 and 7 with the median (the medians of the runs; the second set mostly in a slow
# period; ``bench/results/twin_matrix_zen5_round_statistic_2026-12-07.txt``, ``..._2_2026-12-07.txt``).
ROUND_STATISTIC: Callable[[list[float]], float] = statistics.median


def _of_rounds(rounds: dict) -> dict:
    """``{key: seconds}`` from ``{key: [seconds of each round]}`` (``ROUND_STATISTIC``)."""
    return {key: ROUND_STATISTIC(values) for key, values in rounds.items()}


FORWARD_GRID = (
    (1, 1, 16), (4, 1, 64), (16, 1, 256), (32, 1, 128), (1, 16, 0), (4, 16, 128),
    (8, 64, 0), (4, 64, 256), (16, 16, 64), (1, 128, 256),
)  # fmt: skip


# The rows oneDNN is told to expect when the calibration packs weights (``ops.pack_linear_weight``'s
# ``batch_hint``; the engine gives its decode batch, ``B + Δ``): the calibration's middle decode batch.
PACK_HINT = 16


def packing(device, dtype) -> bool:
    """Whether the engine's actor multiplies by packed weights on ``device`` in ``dtype`` by default
    (``EngineConfig.packed_weights="auto"``: on for the CPU, where oneDNN can pack that dtype here), so the
    calibration times its forwards and the packed GEMMs that way."""
    import torch  # noqa: PLC0415

    from oppo_engine import ops  # noqa: PLC0415
    from oppo_engine.model.packed import packed_enabled  # noqa: PLC0415

    if not packed_enabled("auto", device):
        return False
    return ops.packed_linear_supported(torch.empty(2, 2, device=device, dtype=dtype))


def _linear(w, packed: bool):
    """``x -> F.linear(x, w)``, or the same product with ``w`` packed once (as the engine's actor runs it)."""
    import torch.nn.functional as F  # noqa: N812, PLC0415

    from oppo_engine import ops  # noqa: PLC0415

    if not packed:
        return lambda x: F.linear(x, w)
    from oppo_engine.model.packed import small_product  # noqa: PLC0415

    p = ops.pack_linear_weight(w, PACK_HINT)
    if not ops.small_linear_supported(w):
        return lambda x: ops.packed_linear(x, p, None)
    blocked = ops.block_linear_weight(w)  # a few bf16 rows run as ops.small_linear where the engine's do

    def product(x):
        y = small_product(x, blocked, PACK_HINT)
        return ops.packed_linear(x, p, None) if y is None else y

    return product


def _time_gemms(device, dtype, timed, gpu: bool, packed: bool = False) -> dict[int, list[tuple[int, float]]]:
    """Achieved FLOP/s of the projections the models run: ``F.linear`` of ``[1, M, K]`` activations with
    ``[N, K]`` weights (the layout of ``nn.Linear``; a ``[K, N]`` matmul takes another, faster path on the
    CPU), per weight size ``K * N`` (the shapes of one size, both orientations, averaged); ``packed``: the
    weights packed once into oneDNN's layout (``ops.packed_linear``, the engine's actor on the CPU)."""
    import torch  # noqa: PLC0415

    rounds: dict[tuple[int, int, int], list[float]] = {}
    shapes = GEMM_SHAPES_GPU if gpu else GEMM_SHAPES_CPU
    weights = {(k, n): _linear(torch.randn(n, k, device=device, dtype=dtype), packed) for k, n in shapes}
    for _ in range(ROUNDS):  # rounds, their median kept (as for the forwards)
        for (k, n), w in weights.items():
            for m in GEMM_ROWS_GPU if gpu else GEMM_ROWS:
                x = torch.randn(1, m, k, device=device, dtype=dtype)
                rounds.setdefault((m, k, n), []).append(timed(lambda x=x, w=w: w(x), 3))
    by_size: dict[tuple[int, int], list[float]] = {}
    for (m, k, n), seconds in _of_rounds(rounds).items():
        by_size.setdefault((k * n, m), []).append(seconds)
    out: dict[int, list[tuple[int, float]]] = {}
    for (kn, m), times in sorted(by_size.items()):
        out.setdefault(kn, []).append((m, 2.0 * m * kn / max(statistics.fmean(times), 1e-9)))
    return out


# Pairs of the engine's forwards run at once, as a streamed step runs them: an actor decode beside a reward
# prefill chunk, ((rows, new tokens, context before) of each).
CONTENTION_PAIRS = (
    ((4, 1, 128), (4, 16, 128)),
    ((16, 1, 256), (16, 8, 256)),
    ((8, 1, 64), (8, 32, 64)),
)
# Pairs of the models' one-layer shrunk copies (CPU), run at once as above: forwards of short ops, mostly
# Python, whose slowdown is the interpreter's hand-overs (``HostCosts.interpreter_handover``) and hardly the
# cores; fitted with the models' pairs (``_fit_contention``).
HANDOVER_PAIRS = (
    ((1, 1, 16), (1, 4, 16)),
    ((4, 1, 64), (4, 8, 64)),
)
# A pair of bare projections (CPU): ``F.linear`` of ``[1, rows, K]`` by ``[N, K]`` on each thread, a few ms
# of kernel per interpreter acquisition, 4 MB of weights each (in the shared cache): what two lanes' kernels
# get of the cores with next to no Python, so that a model whose forwards are all Python (``tiny``) has its
# cores measured apart from its hand-overs (without it, its fits put them at 1-1.25 cores: docs/twin.md).
CORES_PAIR = (256, 1024, 1024)
# Per pair: repeats of (each alone, both at once), the median slowdown kept (a burst of other load moves one
# repeat); at once, until each side has run this many calls wholly beside the other and at least this long.
CONTENTION_REPEATS = 3
CONTENTION_CALLS = 6
CONTENTION_S = 0.3


def _run_concurrently(fns, seconds: float, device, calls: int = 1) -> list[float]:
    """Each of ``fns`` looped on a thread of its own (and, on a GPU, a stream of its own), all at once, until
    each has run ``calls`` calls and ``seconds`` have passed: the median time of each one's calls that ran
    wholly while every other was still looping (:func:`_overlapped`)."""
    import threading  # noqa: PLC0415

    import torch  # noqa: PLC0415

    began = [0.0]
    start = threading.Barrier(len(fns), action=lambda: began.__setitem__(0, time.perf_counter()))
    stop = threading.Event()
    spans: list[list[tuple[float, float]]] = [[] for _ in fns]

    errors: list[BaseException] = []

    def loop(i: int, fn) -> None:
        try:
            stream = torch.cuda.Stream(device) if device.type == "cuda" else None
            with torch.cuda.stream(stream) if stream is not None else _nothing():
                fn()
                if stream is not None:
                    stream.synchronize()
                start.wait()
                while not stop.is_set():
                    t0 = time.perf_counter()
                    fn()
                    if stream is not None:
                        stream.synchronize()
                    spans[i].append((t0, time.perf_counter()))
                    if min(map(len, spans)) >= calls and time.perf_counter() - began[0] >= seconds:
                        stop.set()
        except BaseException as e:  # noqa: BLE001 -- the others must stop too, or they loop for ever
            if not isinstance(e, threading.BrokenBarrierError):
                errors.append(e)
            stop.set()
            start.abort()

    threads = [threading.Thread(target=loop, args=(i, fn)) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return [statistics.median(x) for x in _overlapped(spans)]


def _overlapped(spans: list[list[tuple[float, float]]]) -> list[list[float]]:
    """Per loop of ``spans`` (its calls' ``(start, end)``), the durations of its calls that ran wholly while
    every loop was running: started after the last loop's first call did, ended before the first loop
    to stop ended its last. A call that ran on alone after the other loop stopped is not a contended one."""
    opened = max(s[0][0] for s in spans)
    closed = min(s[-1][1] for s in spans)
    out = []
    for s in spans:
        inside = [b - a for a, b in s if a >= opened and b <= closed]
        if not inside:  # every call of this loop straddled the other's start or stop: an understatement
            warnings.warn(
                "calibrate: a contention pair's loop ran no call wholly beside the other; its calls' "
                "durations are used as they are (the slowdown may be understated)",
                RuntimeWarning,
                stacklevel=2,
            )
        out.append(inside or [b - a for a, b in s])
    return out


# Other processes' CPU (cores) above which ``calibrate`` warns that the contention pairs ran beside a
# neighbour: the fitted cores, penalty and hand-overs then describe the machine shared with it (measured:
# ``tiny`` fitted 1.0 cores while other processes took 0.6-1.0 cores, 2.0 with them idle; docs/twin.md).
NEIGHBOUR_CORES = 0.25


class OtherCPU:
    """Over a ``with`` block: the CPU seconds per wall second that other processes used (``/proc/stat``'s
    busy time, the hypervisor's steal included, less this process's own; ``cores`` None where
    ``/proc/stat`` is not there). The load average counts this process's threads too; this is what a
    neighbour took from the machine meanwhile."""

    def __enter__(self) -> OtherCPU:
        self.cores: float | None = None
        self._t, self._busy, self._own = time.perf_counter(), _busy_ticks(), _own_ticks()
        return self

    def __exit__(self, *exc) -> None:
        busy = _busy_ticks()
        if busy is None or self._busy is None:
            return
        ticks = (busy - self._busy) - (_own_ticks() - self._own)
        self.cores = max(0.0, ticks / os.sysconf("SC_CLK_TCK") / max(1e-9, time.perf_counter() - self._t))


def _busy_ticks() -> int | None:
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]  # user .. steal (guest is inside user)
    except (OSError, ValueError):
        return None
    return sum(ticks) - ticks[3] - ticks[4]  # all but idle and iowait


def _own_ticks() -> float:
    t = os.times()
    return (t.user + t.system) * os.sysconf("SC_CLK_TCK")


def neighbour_warning(cores: float | None) -> str | None:
    """What ``calibrate`` warns when other processes took ``cores`` of CPU while its contention pairs ran
    (``OtherCPU``), or None below ``NEIGHBOUR_CORES`` (or where it could not be read)."""
    if cores is None or cores <= NEIGHBOUR_CORES:
        return None
    return (
        f"calibrate: other processes took {cores:.2f} cores while the contention pairs ran; the fitted "
        "cores, interpreter penalty and hand-overs describe the machine shared with them (calibrate again "
        "when it is quiet, or where the engine will run beside the same load)"
    )


def _alternating(
    cost: CostModel, wa: Work, wb: Work, a: ModelShape, b: ModelShape, s_a: float, s_b: float
) -> tuple[Work, Work, float, float]:
    """A contention pair as ``_fit_contention`` reads it: the forwards ``wa`` and ``wb`` (of the models of
    shapes ``a`` and ``b``) as the pair loops them at once on one device's shared cache, and their measured
    slowdowns ``s_a`` and ``s_b`` against those forwards' time alone. A call follows another model's start
    (``CostModel.switched``) in the share of its calls during whose predecessor the other started one,
    about ``min(1, its length / the other's)``, each at its length in the pair (a decode beside a chunk
    three times as long: a third of the decodes, every chunk). Alone, each was timed back to back: the
    slowdowns are scaled to the switched forwards' time alone (the rule's ``contended_s / alone_s``)."""
    ta, tb = wa.alone_s, wb.alone_s
    if ta <= 0.0 or tb <= 0.0:
        return wa, wb, s_a, s_b
    la, lb = s_a * ta, s_b * tb  # each call's length in the pair, as measured
    ca = cost.switched(wa, a, share=min(1.0, la / lb))
    cb = cost.switched(wb, b, share=min(1.0, lb / la))
    return ca, cb, la / ca.alone_s, lb / cb.alone_s


def _pair_slowdowns(fa, fb, timed, device) -> tuple[float, float]:
    """How much longer each of ``fa`` and ``fb`` takes beside the other than alone: per repeat, each timed
    alone, then both at once; the median over ``CONTENTION_REPEATS`` repeats."""
    ratios: tuple[list[float], list[float]] = ([], [])
    for _ in range(CONTENTION_REPEATS):
        alone = (timed(fa, 3), timed(fb, 3))
        both = _run_concurrently([fa, fb], CONTENTION_S, device, CONTENTION_CALLS)
        for side in (0, 1):
            ratios[side].append(both[side] / alone[side])
    return statistics.median(ratios[0]), statistics.median(ratios[1])


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# The grid of the contention fit: cores in twentieths from one to the machine's (two bare projections at once
# slowed each other 2-4% on this 2-core machine, 2026-12-07: 1.92-1.96 cores, which a grid in quarters put at
# 2, pricing every overlapped kernel a few percent fast); the interpreter penalty over
# the range ``_fit_interpreter`` chooses from (capped lower, a Python-bound pair's slowdown past the cap was
# put on the cores instead); the interpreter's hand-overs (``HostCosts.interpreter_handover``) from none to
# past what the four matrix shapes' pairs showed (10-30 on this 2-core machine, 2026-12-06: docs/twin.md).
CORES_STEP = 0.05
PENALTY_GRID = tuple(1.0 + 0.25 * k for k in range(45))
HANDOVER_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0, 14.0, 16.0, 18.0, 20.0, 24.0,
                 28.0, 32.0, 40.0, 48.0, 64.0)  # fmt: skip


def _fit_contention(pairs, profile: Profile, device, bare=()) -> tuple[float, float, float]:
    """``(cores, penalty, handover)`` under which the contention rule (``sim/world.py``) best predicts the
    measured slowdowns of the ``pairs`` run at once: ``(work_a, work_b, slowdown_a, slowdown_b)``. A grid
    search on log error. ``bare``: pairs of the same form whose works have next to no Python (two bare
    projections, ``CORES_PAIR``): where given, the cores are fitted to them alone -- what two lanes' kernels
    get of the cores --, and the rest to ``pairs`` at those cores; else everything to ``pairs``. The
    interpreter's hand-overs (``handover``: ``HostCosts.interpreter_handover``) are what the pairs' Python
    shows at any demand -- the pairs of the models' one-layer copies, mostly Python, show them most --; the
    penalty what it shows past a demand of one, fitted with them so that it does not bias them, and fitted
    again from a streamed step (``_fit_interpreter``). On a tie the most cores fitted to ``bare`` (the
    fewest fitted to ``pairs``), the lowest penalty and the lowest hand-over win."""
    from oppo_engine.sim.cost import contended_s  # noqa: PLC0415

    cpu = device.type != "cuda"

    def error(among, cores: float, penalty: float, handover: float) -> float:
        err = 0.0
        for a, b, s_a, s_b in among:
            p_a = contended_s(a, [(b, True)], cores, penalty, cpu, handover) / a.alone_s
            p_b = contended_s(b, [(a, True)], cores, penalty, cpu, handover) / b.alone_s
            err += math.log(p_a / s_a) ** 2 + math.log(p_b / s_b) ** 2
        return err

    # At least one core: a lane alone runs at its timed speed; slower than serial is the interpreter's doing.
    steps = int(round((float(profile.cores) - 1.0) / CORES_STEP)) if cpu else 0
    grid = [round(1.0 + CORES_STEP * k, 6) for k in range(steps + 1)]
    if bare:
        grid = [min(grid, key=lambda cores: (error(bare, cores, 1.0, 0.0), -cores))]
    best, best_err = (grid[0], 1.0, 0.0), math.inf
    for cores in grid:
        for handover in HANDOVER_GRID:
            for penalty in PENALTY_GRID:
                err = error(pairs, cores, penalty, handover)
                if err < best_err - 1e-12:
                    best, best_err = (cores, penalty, handover), err
    return best


STREAMING_MB = (4, 16, 48, 128)
STREAMING_ROWS = (1, 4, 16, 64)


def _time_streaming(device, dtype, timed, gpu: bool, packed: bool = False) -> list[tuple[float, int, float]]:
    """``(working set bytes, rows, bytes/s)``: how fast projections of ``rows`` rows read their weights when a
    working set of that many bytes of them is cycled through, as a forward does through its layers (more
    than the cache holds, and they come from memory; with more than one row the CPU's GEMMs also repack
    them, unless ``packed``: packed once into oneDNN's layout, as the engine's actor has them on the CPU).
    The weights have one decoder layer's proportions (hidden ``h``: ``h x h`` twice, ``h/3 x h`` twice,
    ``8h/3 x h`` twice, ``h x 8h/3``), in ``nn.Linear``'s layout."""
    import torch  # noqa: PLC0415

    h = 1024 if gpu else 384
    layer = [(h, h), (h // 3, h), (h // 3, h), (h, h), (8 * h // 3, h), (8 * h // 3, h), (h, 8 * h // 3)]
    per_layer = sum(n * k for n, k in layer) * dtype.itemsize
    out = []
    for mb in STREAMING_MB if not gpu else (64, 256, 1024):
        layers = max(1, (mb << 20) // per_layer)
        weights = [(k, _linear(torch.randn(n, k, device=device, dtype=dtype), packed))
                   for _ in range(layers) for n, k in layer]  # fmt: skip
        for rows in STREAMING_ROWS:
            rate = _swept_rate(weights, layers * per_layer, rows, device, dtype, timed)
            out.append((float(layers * per_layer), rows, rate))
        del weights
    return out


def _swept_rate(weights: list[tuple[int, Callable]], nbytes: int, rows: int, device, dtype, timed) -> float:
    """Bytes/s of one sweep through ``weights`` (``(K, x -> product)`` pairs, ``nbytes`` of weights in all)
    at ``rows`` rows: the median of ``ROUNDS`` of ``timed``'s timings (``_time_streaming``,
    ``_time_streaming_products``)."""
    import torch  # noqa: PLC0415

    xs = {k: torch.randn(1, rows, k, device=device, dtype=dtype) for k, _ in weights}

    def sweep() -> None:
        for k, w in weights:
            w(xs[k])

    return nbytes / ROUND_STATISTIC([timed(sweep, 2) for _ in range(ROUNDS)])


# The products of ``_time_streaming_products``: (K, N) of 0.56, 1.5, 4 and 16 MiB of float32 weights (a
# 384-wide layer's square and widest products, a 1024-wide layer's square one, a 1024 x 4096 one), each swept
# over a working set of ``PRODUCTS_WORKING_MB`` (far past any CPU's cache here: weights from memory).
STREAMING_PRODUCTS = ((384, 384), (384, 1024), (1024, 1024), (1024, 4096))
PRODUCTS_WORKING_MB = 128


def _time_streaming_products(
    device, dtype, timed, gpu: bool, packed: bool = False
) -> list[tuple[float, int, float]]:
    """``(product bytes, rows, bytes/s)``: how fast a sweep of products of one size reads their weights out
    of memory (``ThreadCosts.streaming_products``). Why: ``_time_streaming`` sweeps a layer's mix of small
    products, and a product of many megabytes streams about twice as fast at one row (measured 2026-12-07,
    one thread, packed float32: 19 GB/s at 0.56 MiB, 30 at 1.5, 39-42 at 4-8, 40-44 at 16-32), which priced
    gqa8's decode products 37-67% high. Empty on a GPU (not timed there)."""
    import torch  # noqa: PLC0415

    if gpu:
        return []
    out = []
    for k, n in STREAMING_PRODUCTS:
        size = k * n * dtype.itemsize
        count = max(2, (PRODUCTS_WORKING_MB << 20) // size)
        weights = [(k, _linear(torch.randn(n, k, device=device, dtype=dtype), packed)) for _ in range(count)]
        for rows in STREAMING_ROWS:
            out.append((float(size), rows, _swept_rate(weights, count * size, rows, device, dtype, timed)))
        del weights
    return out


# The bytes streamed through the caches before each timed forward of ``_time_evicted``, and the calls per
# timing (each after its own stream).
EVICTED_MB = (1, 4, 16, 48, 128)
EVICTED_CALLS = 7


def _median_after_stream(fn, stream) -> float:
    """The median of ``EVICTED_CALLS`` timed calls of ``fn`` after one untimed, each call after ``stream``
    (a tensor, or None: back to back) has passed through the caches."""
    fn()
    samples = []
    for _ in range(EVICTED_CALLS):
        if stream is not None:
            stream.mul_(1.0)  # read and written: every line of it passes through the caches
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


# The weights of ``_time_switch``'s sweeps (MiB, one set; the other model's set as large), their products'
# rows (a decode's) and each sweep's timed calls per order.
SWITCH_MB = (4, 16, 32)
SWITCH_ROWS = 8
SWITCH_REPEATS = 9


def _time_switch(device, dtype) -> list[tuple[float, float]]:
    """``ThreadCosts.switched``: ``(bytes, seconds)`` for each of ``SWITCH_MB``: how much longer a sweep of
    ``SWITCH_ROWS``-row products over that many bytes of weights (512 x 1024 products) takes right after a
    sweep over as many other bytes than back to back (the median of ``SWITCH_REPEATS`` calls of each order,
    interleaved; never below 0). Why: in ``intra`` and ``oppo`` two models' forwards alternate on one
    device's shared cache, and every forward the calibration times runs back to back. Bare sweeps, not the
    calibration's models: a model's own forwards would give it at one size only, and ``tiny``'s 0.5 MiB show
    nothing but noise (fitted per byte of its weights, 0 in one calibration and 53 ps in the next, which
    priced a switch of a 38 MiB model at 1.8 ms). Measured 2026-12-07, one thread: the models' own forwards
    after the other model's (the actor's 8-row decode and the reward's 8 x 16-token chunk, averaged per
    byte held, ``min(weights, 32 MiB)``): 12.9-22.4 ps on ``small`` (12 MiB: 0.16-0.28 ms), 12.2-18.6 on
    ``mid`` (0.41-0.62 ms), 5.7 on gqa8 (0.19 ms); these sweeps in the matrix's calibrations: 0.00 ms at 4
    MiB, 0.15-0.29 at 16, 0.16-0.38 at 32 (a 32 MiB cache). Held flat past 32 MiB: a sweep after a 64 MiB
    stream read no slower than back to back at 48-64 MiB, but a model's forward has more in the cache than
    its weights (its code, activations and KV), and gqa8's own 70 MiB measured 0.19 ms. CPU only."""
    import torch  # noqa: PLC0415
    import torch.nn.functional as F  # noqa: N812, PLC0415

    out = []
    x = torch.randn(SWITCH_ROWS, 1024, dtype=dtype, device=device)
    for mib in SWITCH_MB:
        count = max(1, (mib << 20) // (512 * 1024 * dtype.itemsize))  # of 512 x 1024 products
        sets = [[torch.randn(512, 1024, dtype=dtype, device=device) for _ in range(count)]
                for _ in range(2)]  # fmt: skip
        sweeps = [lambda ws=ws: [F.linear(x, w) for w in ws] for ws in sets]
        nbytes = float(sum(w.numel() * w.element_size() for w in sets[0]))
        out.append((nbytes, _switch_excess(*sweeps, SWITCH_REPEATS)))
        del sets, sweeps
    return out


def _switch_excess(own: Callable[[], object], other: Callable[[], object], repeats: int) -> float:
    """How much longer ``own`` takes right after ``other`` than right after itself: the medians of
    ``repeats`` timed calls of each order, interleaved, after one untimed call; never below 0."""
    own()
    samples: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for after, before in enumerate((own, other)):
            before()
            t0 = time.perf_counter()
            own()
            samples[after].append(time.perf_counter() - t0)
    return max(0.0, statistics.median(samples[1]) - statistics.median(samples[0]))


def _time_evicted(benches: dict[int, _RoleBench], device) -> list[tuple[float, float, float, int]]:
    """``ThreadCosts.evicted``: ``(bytes, per forward s, per layer s, deepest layers)`` for each of
    ``EVICTED_MB``: how much longer the actor's shrunk copies' one-token forwards take after that many bytes
    streamed through the caches than back to back (the median of ``EVICTED_CALLS`` calls, each after its own
    stream, the median of ``ROUNDS`` rounds over every pair), fitted as a cost per forward and per layer over
    the copies' two depths (``benches``: depth -> bench; ``_fit_evicted``). Why: the fixed costs are fitted on
    copies whose weights never leave a core's caches, while a model's products stream its weights through them
    between its Python; measured on ``tiny``, ``small``, ``mid`` and gqa8's copies alike (2026-12-07, one
    thread): +0.00-0.05 ms after 4 MiB, +0.07-0.15 after 16, +0.26-0.45 after 48, +0.38-0.53 after 128,
    against a model's decode forward priced 0.02-0.08 ms low on ``tiny`` (0.5 MiB of weights), 0.19-0.39 on
    ``small`` (12 MiB), 0.31-0.51 on ``mid`` (38 MiB) and 0.43-0.63 on gqa8 (70 MiB) before. CPU only."""
    import torch  # noqa: PLC0415

    buffer = torch.ones((max(EVICTED_MB) << 20) // 4, device=device)

    def median_after(fn, mib: int) -> float:
        return _median_after_stream(fn, buffer[: (mib << 20) // 4] if mib else None)

    (d1, b1), (d2, b2) = sorted(benches.items())
    calls = {d1: b1.call(1, 1, 0), d2: b2.call(1, 1, 0)}
    pairs = [(d, mib) for d in calls for mib in (0, *EVICTED_MB)]
    rounds: dict[tuple[int, int], list[float]] = {}
    # NOTE: rounds over every (depth, bytes) pair, the median of each kept: the back-to-back reference and
    # each streamed timing come from every moment of the run alike (one pair timed in a burst of other load
    # would otherwise move a difference, not both of its terms).
    for _ in range(ROUNDS):
        for d, mib in pairs:
            rounds.setdefault((d, mib), []).append(median_after(calls[d], mib))
    return _fit_evicted(_of_rounds(rounds), d1, d2)


def _fit_evicted(
    kept: dict[tuple[int, int], float], d1: int, d2: int
) -> list[tuple[float, float, float, int]]:
    """``ThreadCosts.evicted`` from the copies' timings ``kept[depth, MiB]`` (0 MiB: back to back) at the
    depths ``d1 < d2``: at each streamed size, the excess over back to back split into a cost per forward
    and per layer along the line through the two depths, the per-layer part at least 0 (a copy's layers do
    not run faster after a stream: a negative slope is the two timings' noise, and the per-forward part is
    then the two depths' mean excess), and ``d2``, the deepest layer count measured: a deeper model is
    charged the per-layer part up to it only (``ThreadCosts.evicted_s``)."""
    out = []
    for mib in EVICTED_MB:
        e1, e2 = kept[d1, mib] - kept[d1, 0], kept[d2, mib] - kept[d2, 0]
        per_layer = max(0.0, (e2 - e1) / (d2 - d1))
        per_forward = e1 - per_layer * d1 if per_layer > 0 else (e1 + e2) / 2
        out.append((float(mib << 20), per_forward, per_layer, d2))
    return out


# Forwards of each point the in-forward products are timed over (``_time_packed_calls``).
CALL_REPEATS = 5


def _time_packed_calls(runs) -> dict[tuple[int, int, int], tuple[float, list[float]]]:
    """``{(rows, K, N): (working set bytes, [seconds of each call])}``: each packed product of the actor's
    forwards as the forward calls it. ``runs``: ``(bench, working set bytes, grid)`` of the actor and its
    shrunk copies (their packed ``_RoleBench``); each point's forward runs once to warm up, then
    ``CALL_REPEATS`` times with ``ops.packed_linear`` (the one entry of every packed product, the grouped
    ones included: ``model/packed.py``) and ``ops.small_linear`` (a few bf16 rows' products) timed call by
    call, the forward's own work left as it is."""
    from oppo_engine import ops  # noqa: PLC0415
    from oppo_engine.model import fused  # noqa: PLC0415

    with _timing_lock:  # the swap is process-wide: one timing at a time, and the original put back
        # Each product through ops' names, where the wrappers see it: not inside a decoder layer's one op
        # (``ops.llama_decode_layer``, which calls the products in C++), for the timed calls only.
        layers, fused.DECODE_LAYERS = fused.DECODE_LAYERS, False
        try:
            return _time_packed_calls_locked(ops, runs)
        finally:
            fused.DECODE_LAYERS = layers


_timing_lock = threading.Lock()


def _time_packed_calls_locked(ops, runs) -> dict[tuple[int, int, int], tuple[float, list[float]]]:
    product, small = ops.packed_linear, ops.small_linear
    calls: dict[tuple[int, int, int], tuple[float, list[float]]] = {}
    working = [0.0]
    me = threading.get_ident()

    def timed(op):
        def timed_op(x, *args):
            if threading.get_ident() != me:  # another thread's products (an engine beside it) are not timed
                return op(x, *args)
            t0 = time.perf_counter()
            out = op(x, *args)
            seconds = time.perf_counter() - t0
            k, n = x.shape[-1], out.shape[-1]
            calls.setdefault((x.numel() // k, k, n), (working[0], []))[1].append(seconds)
            return out

        return timed_op

    timed_product, timed_small = timed(product), timed(small)

    for bench, weights, grid in runs:
        for point in grid:
            fn = bench.call(*point)
            fn()
            working[0] = weights
            ops.packed_linear, ops.small_linear = timed_product, timed_small
            try:
                for _ in range(CALL_REPEATS):
                    fn()
            finally:
                ops.packed_linear, ops.small_linear = product, small
    return calls


def _packed_in_forward(calls, ts: ThreadCosts, dtype_bytes: int) -> dict[int, list[tuple[int, float]]]:
    """``ThreadCosts.packed_in_forward``: per weight size ``K*N`` and row count, the median time of its
    calls inside the forwards (``_time_packed_calls``) over their bare price by ``ts.gemm_packed`` --
    counted only where that price is the product's compute term (its weights' streaming at the forward's
    working set, ``ts.streaming_packed``, is shorter): a product bound by its weights' bandwidth inside a
    forward is the streaming table's to price. Why: a bare GEMM is timed in a loop of one product, whose
    weights and oneDNN's code and state stay hot in the core's caches and predictors; in the actor's forward
    the interpreter's work between two products has taken them. Measured on ``small``'s actor (fastest
    forwards, one thread, 2026-12-06): its 25 products took 0.52-0.64 ms inside a one-row decode forward,
    0.43-0.48 ms replayed back to back and 0.455 ms priced; 0.75-1.01 ms against 0.55-0.77 and 0.56-0.73 at
    8-16 rows; call by call 1.2-2.0x their bare time at 1-32 rows, 1.04-1.2x at 128-512 rows, and
    1.06-1.4x on its shrunk copies' products, whose excess the fixed costs fitted from them used to absorb
    (now taken out with the rest of their projections). A ratio, not seconds: the excess grows with the
    product (2 us at one row on the copies' 4K weights, 115 us at 512 rows on ``small``'s 360K)."""
    probe = Calibrated(_probe_profile(ts))
    ratios: dict[tuple[int, int], list[float]] = {}
    for (m, k, n), (weights, seconds) in sorted(calls.items()):
        compute, memory = probe.gemm(m, k, n, dtype_bytes, 1, weights, True)
        if compute < memory or compute <= 0:
            continue
        # NOTE: both orientations of one size (64 x 128 and 128 x 64) share its bare price: one point.
        ratios.setdefault((k * n, m), []).extend(s / compute for s in seconds)
    by_size: dict[int, list[tuple[int, float]]] = {}
    for (kn, m), values in sorted(ratios.items()):
        by_size.setdefault(kn, []).append((m, statistics.median(values)))
    return by_size


def _time_repack(packs, timed, stream=None) -> tuple[int, int, float]:
    """``(packed tensors, bytes, seconds)`` of packing a model's weights again: the packs dropped, then made
    by the next forward's refresh, as after every weight update (the grouped products' stacked copies
    included; their bitwise probe runs once per process, in the warm-up call). ``stream`` (a tensor larger
    than the caches): each timed repacking comes after it has passed through them, as one comes after the
    update's optimizer streamed the weights and moments (the median of ``EVICTED_CALLS``, the median of
    ``ROUNDS`` rounds); back to back, the weights read hot, measured 7-13% faster on ``tiny``, ``small`` and
    ``mid`` than after a 128 MiB stream (2026-12-07)."""

    def repack() -> None:
        packs.drop()
        with packs.applied():
            pass

    if stream is None:
        seconds = ROUND_STATISTIC([timed(repack, 3) for _ in range(ROUNDS)])
        return packs.held, packs.nbytes, seconds
    # each round's first call untimed (the first of all: the bitwise probes)
    seconds = ROUND_STATISTIC([_median_after_stream(repack, stream) for _ in range(ROUNDS)])
    return packs.held, packs.nbytes, seconds


def _fit_repack(points: list[tuple[int, int, float]]) -> tuple[float, float]:
    """Seconds per packed tensor and per byte (NNLS on relative error) to the timed repackings of the actor
    and its shrunk copies: the copies' are mostly the per-tensor cost (their weights are small), the
    actor's adds its bytes; one model alone would price a small model's per-tensor cost per byte of a
    large one (a 2-layer model's 2.6e-9 s a byte against 2.4e-10 for a 6-layer one, measured)."""
    rows = [[tensors / seconds, nbytes / seconds] for tensors, nbytes, seconds in points if seconds > 0]
    per_pack, per_byte = nnls(rows, [1.0] * len(rows)) if rows else (0.0, 0.0)
    return per_pack, per_byte


# The calibration pair's streamed step: batch, prompt and response tokens, chunk size.
STREAMED_STEP = (4, 16, 48, 8)
PENALTIES = (1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0)


def _interpreter_pair(actor, reward, shrunk: dict) -> tuple:
    """The actor and reward whose streamed step ``_fit_interpreter`` times: their one-layer shrunk copies
    where the calibration made them (the CPU), else the models. Why the copies: the penalty prices two
    lanes' Python interleaving, and only a step whose forwards are mostly Python shows it. On a wide pair
    the twin's step barely moves with it -- ``small``'s 0.1017-0.1038 s and ``mid``'s 0.2141-0.2153 s over
    penalties 1-12, against measured steps 16% and 8% slower (2026-12-06; the gap is something else) -- so
    the fit went to the grid's edge, 12, which priced a Python-bound model's streamed steps (``tiny``'s
    ``oppo``) 1.7-2.2x slow. Their copies' step moves 2.3x over the grid and fitted 1-3 on all four matrix
    shapes (``tiny`` 2, ``small`` 3, ``mid`` 1.5, gqa8 1; one streamed step each, ``bench_twin --matrix``'s
    profiles). The penalty is a property of the interpreter and the machine, not of a model."""
    if ("actor", 1) in shrunk and ("reward", 1) in shrunk:
        return shrunk["actor", 1], shrunk["reward", 1]
    return actor, reward


def _fit_interpreter(actor, reward, profile: Profile) -> float:
    """The interpreter penalty under which the twin's streamed step of the calibration pair takes what the
    engine's own takes (``STREAMED_STEP``, measured here): two lanes of one process interleave Python and
    kernels, and a lane waiting for the GIL waits for the other's next hand-over (the contention pairs time
    forwards, not the step loop around them)."""
    from oppo_engine import EngineConfig, RolloutEngine, SamplingParams  # noqa: PLC0415
    from oppo_engine.sim.lengths import parse_lengths  # noqa: PLC0415
    from oppo_engine.sim.shapes import model_shape  # noqa: PLC0415
    from oppo_engine.sim.twin import Setting, World  # noqa: PLC0415

    batch, prompt, response, chunk = STREAMED_STEP
    config = EngineConfig(batch_size=batch, mode="intra", chunk_size=chunk, max_model_len=prompt + response)
    engine = RolloutEngine(actor=actor, reward=reward, config=config, eos_token_id=(),
                           sampling=SamplingParams(max_new_tokens=response, ignore_eos=True))  # fmt: skip
    vocab = actor.config.vocab_size
    engine.add_prompts([[5 + (i + j) % (vocab - 5) for j in range(prompt)] for i in range(4 * batch)])
    try:
        walls = [engine.step().metrics.wall_s for _ in range(3)][1:]
    finally:
        engine.close()
    measured = statistics.fmean(walls)
    itemsize = next(actor.parameters()).dtype.itemsize
    shapes = {"actor": model_shape(actor, dtype_bytes=itemsize, name="actor"),
              "reward": model_shape(reward, head="score", dtype_bytes=itemsize, name="reward")}  # fmt: skip
    placement = "cpu" if profile.kind == "cpu" else "colocated"
    best, best_err = 1.0, math.inf
    for penalty in PENALTIES:
        host = dataclasses.replace(profile.host, interpreter_penalty=penalty)
        setting = Setting(
            shapes=shapes, cost=CostModel(Calibrated(dataclasses.replace(profile, host=host))),
            placement=placement, gpus=1, batch_size=batch, lengths=parse_lengths(response),
            prompt_lengths=parse_lengths(prompt), config=config, cores=profile.cores,
        )  # fmt: skip
        world = World(setting, "intra", chunk_size=chunk, steps=3)
        try:
            twin = statistics.fmean(r.rollout_s for r in world.run(3)[1:])
        finally:
            world.close()
        err = abs(math.log(twin / measured))
        if err < best_err:
            best, best_err = penalty, err
    return best


def _time_bandwidth(device, timed) -> float:
    import torch  # noqa: PLC0415

    numel = (256 << 20) // 4 if device.type == "cuda" else (64 << 20) // 4
    src = torch.empty(numel, device=device, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), 5)
    return 2 * src.numel() * 4 / seconds  # read and write


class _ArenaShort(RuntimeError):
    """A bench's arena cannot hold a point's rows (``_RoleBench._make``)."""


class _RoleBench:
    """The engine's forward path of one role over its own small arena (room for the forwards of ``grid``),
    for timing."""

    def __init__(self, role: str, model, device, packed: bool = False, grid=FORWARD_GRID) -> None:
        import torch  # noqa: PLC0415

        from oppo_engine.cache import KVArena, KVCacheManager, KVSpec  # noqa: PLC0415
        from oppo_engine.model.actor import ActorWorker  # noqa: PLC0415
        from oppo_engine.model.runner import ModelRunner  # noqa: PLC0415
        from oppo_engine.model.scorer import CriticScorer, ReferenceScorer, RewardScorer  # noqa: PLC0415

        self.role, self.model = role, model
        spec = KVSpec.from_hf_config(model.config, model.dtype)
        need = max(r * (n + c) for r, n, c in grid) + sum({c for _, _, c in grid})  # and the contexts (below)
        self.arena = KVArena({role: spec}, page_size=16, num_pages=need // 16 + 64, device=device)
        # NOTE: the timed forwards attend over ``ctx`` slots that nothing wrote: zeroed, they read finite
        # keys and values (uninitialised bytes may be NaN, which the engine's finiteness checks refuse).
        self.arena.buffer.zero_()
        self.cache = KVCacheManager(self.arena, role)
        runner = ModelRunner(model, self.cache)
        if packed:  # the actor's weights packed as the engine packs them on the CPU (sched/build.py)
            from oppo_engine.model.packed import PackedLinears  # noqa: PLC0415

            # NOTE: its own packs, not ``packed.for_model``'s shared ones: a later engine of this model
            # packs with its own batch hint, as it would without a calibration before it.
            runner.packed = PackedLinears(model, PACK_HINT)
        self.runner = runner
        self.actor = ActorWorker(runner) if role == "actor" else None
        scorers = {"reward": RewardScorer, "reference": ReferenceScorer, "critic": CriticScorer}
        self.scorer = scorers[role](runner) if role != "actor" else None
        self.vocab = model.config.vocab_size
        self._torch = torch
        self._contexts: dict[int, tuple] = {}  # ctx -> the sequence holding ctx cached tokens, forked per row
        self._made: dict[tuple[int, int, int], tuple[list, object]] = {}  # (rows, new, ctx) -> _rows' rows

    def _context(self, ctx: int) -> tuple:
        """The sequence whose first ``ctx`` tokens every timed row shares (``KVCacheManager.fork``), made
        once.

        Why: the engine's rows come to a forward with their context cached; appending ``ctx`` slots to each
        row in the timed call (``append_slots``, a Python list of the slots) cost 48-52 ns per row and
        context token on every shape (timed apart, 2026-12-07), which the fit put in ``kv_byte_s`` per
        layer and KV byte: two thirds of ``tiny``'s per-context cost, and on gqa8's narrow copy (2 layers of
        128-byte KV rows) ``kv_byte_s`` 1.9-2.0e-10 against 8-9e-11 on ``small`` and ``mid``. A fork shares
        the context's pages: a reference per page, no per-token work."""
        sid = self._contexts.get(ctx)
        if sid is None:
            sid = ("context", ctx)
            self._append(sid, ctx)  # recorded once its pages are held
            self._contexts[ctx] = sid
        return sid

    def call(self, rows: int, new: int, ctx: int) -> Callable[[], object]:
        """A function running one forward of ``rows`` chunks of ``new`` tokens after ``ctx`` cached ones (a
        context of whole pages shared with ``_context``'s sequence; another appended to each row): the
        forward alone, on rows the bench made once for the point (``_rows``)."""
        forward = self.actor.forward if self.actor is not None else None
        prefill = self.scorer.prefill if self.scorer is not None else None

        def run() -> None:
            chunks, batch = self._rows(rows, new, ctx)
            if forward is not None:
                forward(chunks, batch)
            else:
                prefill(chunks)

        return run

    def _rows(self, rows: int, new: int, ctx: int) -> tuple[list, object]:
        """The rows of a point (their chunks and the actor's sampling batch), made at its first forward and
        kept: each row's sequence forked from the point's context (appended where the context ends inside a
        page), its ``new`` tokens' slots appended and, for a scorer, begun. Every later forward of the point
        writes the same slots again and attends over the same context, as the first did.

        Why kept: the engine's forward finds its rows made (its scheduler's bookkeeping -- slots, pages,
        a sequence's start and end -- is priced apart: ``HostCosts``, measured with the engine's own steps).
        Made inside each timed call, they cost 7 us a row and 0.18 us a context page on ``tiny``'s models
        (a fork, an append, a free, a scorer's start and release: 221 us of a 1.17 ms actor forward of 32
        rows; bench/results/twin_v11_probes_zen5_2026-12-07.txt), which the fit read as per-context costs:
        with them the profiles priced ``small``'s decode at 512 context tokens 27-156% high
        (twin_v11_forwards_zen5_2026-12-07.txt). Where the arena cannot hold another point's rows beside
        the kept ones, those are released and the point made again; a point the arena cannot hold alone
        is refused (``RuntimeError``)."""
        key = (rows, new, ctx)
        made = self._made.get(key)
        if made is None:
            try:
                made = self._make(rows, new, ctx)
            except _ArenaShort:
                if not self._made:
                    raise
                self.release()  # the kept rows make room, and are made again at their next forward
                made = self._make(rows, new, ctx)
            self._made[key] = made
        return made

    def _make(self, rows: int, new: int, ctx: int) -> tuple[list, object]:
        """``_rows``' rows of a point, made now; nothing of them kept where the arena runs short."""
        from oppo_engine.model.runner import SeqChunk  # noqa: PLC0415
        from oppo_engine.model.sampler import SampleBatch  # noqa: PLC0415

        ids = [("rows", rows, new, ctx, i) for i in range(rows)]
        chunks = []
        try:
            for sid in ids:
                if ctx and ctx % self.cache.page_size == 0:  # new tokens start a page: nothing is copied
                    self.cache.fork(self._context(ctx), sid, ctx)
                elif ctx:
                    self._append(sid, ctx)
                slots = self._append(sid, new)
                chunks.append(SeqChunk(sid, [5 + (j % (self.vocab - 5)) for j in range(new)], slots))
                if self.scorer is not None:
                    self.scorer.begin(sid, ctx + 1, 1.0)
        except BaseException:
            self._drop(ids)  # nothing of a point half made is kept
            raise
        batch = None
        if self.actor is not None:
            batch = SampleBatch(list(range(rows)), [1.0] * rows, [0] * rows, [1.0] * rows,
                                list(range(rows)), [ctx + new] * rows)  # fmt: skip
        return chunks, batch

    def _append(self, sid, count: int) -> list[int]:
        slots = self.cache.append_slots(sid, count)
        if slots is None:
            raise _ArenaShort(f"calibrate: the bench's arena cannot hold {count} more tokens of {sid}")
        return slots

    def release(self) -> None:
        """Free every point's rows (the contexts stay: ``_context``)."""
        self._drop([chunk.seq_id for chunks, _ in self._made.values() for chunk in chunks])
        self._made.clear()

    def _drop(self, ids) -> None:
        """The scorer's state and the pages of these rows, freed (unknown ids are ignored)."""
        for sid in ids:
            if self.scorer is not None:
                self.scorer.release(sid)
            self.cache.free(sid)


# The shrunk copies (CPU only: ``calibrate``): each timed model's architecture class at two depths, with
# random weights and every width cut down. Their forwards are almost all fixed cost (Python, dispatch), so
# the fixed costs per forward and per layer are fitted from them (``_fixed_costs``). head_dim 16: even (RoPE
# rotates pairs), a whole AVX-512 vector of fp32, Triton's smallest dot block; the vocabulary: 64 tokens
# (``_RoleBench`` feeds ids from 5). The grid: forwards of one row and one or two tokens (a token alone, a
# decode after one, a prefill of two), where a copy's other terms (neglected by the fit: ``_fixed_costs``)
# are a token's worth, which every forward has anyway; at (4, 16, 128) they were 75% of the forward with
# eight query heads, at (1, 1, 16) 2% of it and 11% of the cost per layer (computed with made-up constants:
# tests/sim/test_fixed_costs.py). One row: a cost per row adds one row's worth to the cost per forward.
SHRUNK_HEAD_DIM = 16
SHRUNK_VOCAB = 64
SHRUNK_GRID = ((1, 1, 0), (1, 1, 1), (1, 2, 0))
# Per-layer lists of a config (a layer's kind: sliding or full attention, RoPE or none), tiled to the
# copy's depth so that its layers run the model's code paths in the model's order.
PER_LAYER_KEYS = ("layer_types", "no_rope_layers")


def ladder_head_dims(head_dim: int) -> tuple[int, ...]:
    """The head_dims of a model's width ladder: ``SHRUNK_HEAD_DIM``, doubling, while below the model's own
    ``head_dim`` (none for a model no wider than its shrunk copies). Its copies (``shrunk_copy`` at the
    model's depth and each of these head_dims: the model narrowed) serve two fits (``calibrate``):

    - the first rung, of every role (the *narrow copies*): their forwards over ``FORWARD_GRID`` join the
      models' in the fit of the per-token constants (``pair_s``, ``kv_byte_s``, ``token_hidden_s``,
      ``logit_s``: ``_fit``'s ``narrow``). A wide model's forwards are mostly its projections, so they
      barely determine those constants; and the columns ``1 x layers x tokens x hidden`` and the like scale
      each kind of per-token work by one width where the work is several (RMSNorms and residuals over the
      hidden size, the MLP's activation over the intermediate, RoPE and the KV writes over the heads, a
      cost per token besides): a constant fitted at one width prices that width. gqa8's forwards (hidden
      1024, 2 layers, 93% projections) fitted ``token_hidden_s`` at 0.2-3.3e-9 s (six calibrations, 2026-12-06
      and -07) against 4.3-12.7e-9 on the narrower shapes, and its profile priced ``small``'s and ``mid``'s
      steps 11-14% fast. With the narrow copies the constants are fitted over the two widths and carry to
      the narrower ones (bench/results/twin_matrix_zen5_narrowfork_*_2026-12-07.txt; docs/twin.md).
    - every rung, of the packed actor: their packed products as their forwards call them, beside the
      actor's and its shrunk copies' (``ThreadCosts.packed_in_forward``). A wide actor's decode products are
      bound by their weights' streaming and so not measured; its profile held every narrower model's
      products at few rows at its shrunk copies' ratios (1.0-1.4x at 2K-33K weights), where ``small``'s own
      measured 1.3-2.0x at its 33K-360K. The ladder's products span the sizes between, their weights in
      cache."""
    dims, d = [], SHRUNK_HEAD_DIM
    while d < head_dim:
        dims.append(d)
        d *= 2
    return tuple(dims)


def _ladder_copies(models: dict, packs: bool, say: Callable[[str], None]) -> dict:
    """``{(role, head_dim): copy}``: each model's width ladder (``ladder_head_dims``) at its own depth, the
    first rung for every role and every rung for the actor where it packs (``packs``); none, with a
    warning, where one cannot be made (``shrunk_copy``'s ``ValueError``): the per-token constants are then
    fitted from the models' own forwards."""
    from oppo_engine.sim.shapes import model_shape  # noqa: PLC0415

    copies = {}
    try:
        for role, model in models.items():
            own = model_shape(model, dtype_bytes=None)
            dims = ladder_head_dims(own.head_dim)
            for d in dims if role == "actor" and packs else dims[:1]:
                copies[role, d] = shrunk_copy(model, own.layers, d)
    except ValueError as e:
        warnings.warn(
            f"{e}; the per-token constants are fitted from the models' own forwards (a wide model's barely "
            "determine them) and the packed products measured at the actor's and its copies' sizes only",
            RuntimeWarning,
            stacklevel=3,
        )
        return {}
    if copies:
        say(f"calibrate: width ladders {sorted(copies)}")
    return copies


def shrunk_depths(layers: int) -> tuple[int, int]:
    """The two depths of a model's shrunk copies: 1, where a forward is the fixed cost per forward and one
    layer's, and twice the model's own, so that the fitted line spans its depth (interpolated, not
    extrapolated) and reaches past it, where a profile is asked to price deeper models."""
    return (1, 2 * max(1, layers))


WIDTH_KEYS = ("intermediate_size", "ffn_dim", "ffn_hidden_size", "word_embed_proj_dim")


def _module_layout(model) -> set[str]:
    """``model``'s module names with layer indices folded: what it computes, whatever its depth."""
    return {re.sub(r"\.\d+(\.|$)", r".N\1", name) for name, _ in model.named_modules()}


def shrunk_config(config, layers: int, head_dim: int = SHRUNK_HEAD_DIM):
    """A copy of the HF decoder ``config`` with ``layers`` layers and every width cut down: its query and
    KV head counts kept (the GQA layout), head_dim ``head_dim`` (``SHRUNK_HEAD_DIM`` unless a width ladder's
    copy asks for more: ``ladder_head_dims``; the model's own where smaller),
    hidden size heads x head_dim, every MLP width (and OPT's embedding width) the hidden size, a vocabulary of
    ``SHRUNK_VOCAB`` tokens (special token ids past it moved to its last), per-layer lists
    (``PER_LAYER_KEYS``) tiled to the new depth. ``ValueError`` naming what it cannot shrink (a multimodal
    config: its decoder's config nested in another; a config without the usual names of its widths)."""
    name = type(config).__name__
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text is not config:
        raise ValueError(f"calibrate: cannot shrink {name}: its decoder's config is nested (multimodal)")
    cfg = config.to_dict()
    if not isinstance(cfg.get("hidden_size"), int) or not isinstance(cfg.get("num_attention_heads"), int):
        raise ValueError(f"calibrate: cannot shrink {name}: no hidden_size and num_attention_heads")
    heads = cfg["num_attention_heads"]
    own = cfg.get("head_dim") or cfg["hidden_size"] // heads
    head_dim = min(head_dim, own - own % 2) or own
    hidden = heads * head_dim
    depth = cfg.get("num_hidden_layers")
    cfg.update(hidden_size=hidden, vocab_size=SHRUNK_VOCAB, num_hidden_layers=layers)
    if cfg.get("head_dim") is not None:
        cfg["head_dim"] = head_dim
    for key, value in list(cfg.items()):
        # The MLP's widths by their several names (OPT's ffn_dim, Falcon's ffn_hidden_size), and OPT's
        # embedding width (a projection in and out of the decoder where it differs from the hidden size).
        if key.endswith(WIDTH_KEYS) and isinstance(value, int):
            cfg[key] = hidden
        if key in PER_LAYER_KEYS and isinstance(value, list) and len(value) == depth:
            cfg[key] = [value[i % depth] for i in range(layers)]
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        ids = cfg.get(key)
        if isinstance(ids, int):
            cfg[key] = min(ids, SHRUNK_VOCAB - 1)
        elif isinstance(ids, list):
            cfg[key] = [min(i, SHRUNK_VOCAB - 1) for i in ids]
    try:
        return type(config).from_dict(cfg)
    except (TypeError, KeyError, AttributeError, IndexError) as e:  # a shape its config class refuses
        raise ValueError(f"calibrate: cannot shrink {name} ({e!r})") from e


def shrunk_copy(model, layers: int, head_dim: int = SHRUNK_HEAD_DIM):
    """A model of ``model``'s architecture class and dtype, on its device, in eval mode, with random
    weights (``from_config``) and :func:`shrunk_config`'s shape at ``layers`` layers and ``head_dim``.
    ``ValueError`` where the copy does not come out so (another class, other head counts, another depth)."""
    import torch  # noqa: PLC0415

    from oppo_engine.model.runner import unwrap_model  # noqa: PLC0415
    from oppo_engine.sim.shapes import model_shape  # noqa: PLC0415

    base = unwrap_model(model)
    config = shrunk_config(base.config, layers, head_dim)
    device, dtype = next(base.parameters()).device, next(base.parameters()).dtype
    try:
        with torch.device(device):
            copy = type(base)._from_config(config, dtype=dtype)
    except (TypeError, KeyError, AttributeError, IndexError) as e:  # a config its class cannot build
        raise ValueError(f"calibrate: cannot build the shrunk copy of {type(base).__name__} ({e!r})") from e
    copy = copy.to(device).eval()
    own, got = model_shape(base, dtype_bytes=None), model_shape(copy, dtype_bytes=None)
    extra = _module_layout(copy) ^ _module_layout(base)
    if extra:  # a module the model lacks (or the other way round): its work would land in the fit unpriced
        raise ValueError(
            f"calibrate: the shrunk copy of {type(base).__name__} does not compute what the model does: "
            f"modules {sorted(extra)} in one and not the other"
        )
    if (
        type(copy) is not type(base)
        or (got.layers, got.heads, got.kv_heads) != (layers, own.heads, own.kv_heads)
        or got.head_dim > max(head_dim, SHRUNK_HEAD_DIM)
    ):
        raise ValueError(
            f"calibrate: the shrunk copy of {type(base).__name__} came out as {type(copy).__name__} with "
            f"(layers, heads, KV heads, head_dim) {(got.layers, got.heads, got.kv_heads, got.head_dim)}, "
            f"not {(layers, own.heads, own.kv_heads)} and head_dim <= {max(head_dim, SHRUNK_HEAD_DIM)}"
        )
    return copy


def _head_rows(role: str, rows: int, new: int) -> int:
    return rows if role in ("actor", "reward") else rows * new


def _batch(role: str, rows: int, new: int, ctx: int) -> Batch:
    return Batch(tuple((new, ctx + new) for _ in range(rows)), _head_rows(role, rows, new), rows)


Point = tuple[ModelShape, str, tuple[int, int, int], float]  # (shape, role, (rows, new, ctx), seconds)

# The constants of the forwards' fit, in the order of its columns after the GEMMs' scale; with shrunk copies
# (CPU), the fixed ones are fitted from the copies' forwards (``_fixed_costs``), the rest from the models'.
CONSTANTS = ("forward_s", "layer_s", "pair_s", "kv_byte_s", "token_hidden_s", "logit_s")
FIXED = CONSTANTS[:2]


def _fit(
    points: list[Point], ts: ThreadCosts, shrunk: list[Point] | None = None, narrow: list[Point] | None = None
) -> ThreadCosts:
    """Fit the per-forward constants to the timed forwards, the GEMMs' share as the bare GEMMs
    (``ts.gemm``, ``ts.streaming``) price it taken out. Where that leaves the fit poor (a median error
    over ``POOR_FIT``: the projections inside a forward do not run as the bare ones did, say two threads
    thrashing on a loaded machine), a scale on the GEMMs' share is fitted with the rest, if that fits
    better (it is left at 1 otherwise: fitted freely it trades off against the per-token costs and prices
    other models worse).

    ``shrunk``: the forwards of the models' shrunk copies at two depths (``shrunk_config``): ``forward_s``
    and ``layer_s`` are fitted from them (``_fixed_costs``) and held, and the other constants fitted from
    ``points``; ``fit_error`` and the ``unfitted`` marks are still the fit's over ``points``. Why: a model's
    forwards measure its fixed costs by how much of them they are. On a wide model a forward is mostly its
    projections, and a fit of the fixed costs from it fits noise (a gqa8 profile priced ``tiny``, mostly
    Python, 77% fast); a shrunk copy's forward is almost all fixed cost. And models of one depth ``L`` have
    the columns 1 and ``L`` in proportion: the fit sees only ``forward_s + L * layer_s`` and splits it as
    ``lstsq``'s minimum norm does, for a model of another depth to inherit; the copies have two depths.
    None: every constant from ``points`` (a GPU's calibration).

    ``narrow``: the forwards of the models' narrow copies (``ladder_head_dims``' first rung: each model at its
    own depth, every width cut down) over ``FORWARD_GRID``: the constants fitted here are fitted to them and
    ``points`` together (``fit_error`` and the ``unfitted`` marks still ``points``' alone). Why: a wide
    model's forwards are mostly its projections and barely determine its per-token constants, and each
    column scales its kind of work by one width; fitted over two widths they carry to narrower models."""
    fit = CONSTANTS
    if shrunk:
        fixed = _fixed_costs(shrunk, ts)
        ts = dataclasses.replace(
            ts,
            forward_s=fixed.forward_s,
            layer_s=fixed.layer_s,
            actor_forward_s=fixed.actor_forward_s,
            actor_layer_s=fixed.actor_layer_s,
        )
        fit = CONSTANTS[2:]
    both = points + list(narrow or ())

    def fitted(free_scale: bool) -> ThreadCosts:
        got = _fit_with(both, ts, free_scale=free_scale, fit=fit)
        # its error and unfitted marks over the models' own forwards (nothing fitted again: ``fit=()``)
        return _fit_with(points, got, free_scale=False, fit=()) if narrow else got

    fixed = fitted(False)
    if fixed.fit_error <= POOR_FIT:
        return fixed
    free = fitted(True)
    return free if free.fit_error < fixed.fit_error else fixed


POOR_FIT = 0.2


def _fixed_costs(shrunk: list[Point], ts: ThreadCosts) -> ThreadCosts:
    """``forward_s`` and ``layer_s`` fitted (NNLS on relative error, as ``_fit_with``) to the scorers'
    ``shrunk`` copies' forwards, and the actor's own (``actor_forward_s``, ``actor_layer_s``: its copies'
    fit less the scorers', signed), their GEMMs' share as ``ts``'s tables price it taken out (at scale 1)
    and their other terms neglected: at ``SHRUNK_GRID``'s points those are a token's or two's worth of
    attention and elementwise work (1-2% of ``layer_s`` with made-up constants), which every forward has,
    where pricing them by the constants fitted from the models would charge the copies the models' noise (a
    wide model fits its per-token costs poorly: 14x off in a made-up gqa8 with 3% noise, 15% off in
    ``layer_s``). Why the actor apart: its forward is not a scorer's. Its packed products each pass through
    the packs' bookkeeping (``model/packed.py``: every module refreshed, installed and removed at every
    forward, a closure per call), and it samples; measured on ``small``'s copies (one row, one token, the
    fastest of 5 rounds, 2026-12-06): 204 us a layer packed, 115 unpacked, against the reward's 114, and
    291 us a forward packed against 185. Fitted together, as before, the two roles' copies were priced
    14-16% low (the actor's) and 9-19% high (the reward's), and the actor's decode forwards of ``small``
    15-20% low, where most of a small model's step is. With copies of one role only, every copy fits
    ``forward_s`` and ``layer_s`` and the actor's own are 0. ``fit_error``: the worse of the two fits' over
    their copies. Copies of one depth are refused (``ValueError``): the two columns are then in proportion."""
    depths = sorted({shape.layers for shape, *_ in shrunk})
    if len(depths) < 2:
        raise ValueError(
            f"calibrate: the fixed costs per forward and per layer need shrunk copies of two depths, got "
            f"{depths}: of one depth, the two are in proportion and only their sum is measured"
        )
    bare = dataclasses.replace(ts, pair_s=0.0, kv_byte_s=0.0, token_hidden_s=0.0, logit_s=0.0, gemm_scale=1.0,
                               actor_forward_s=0.0, actor_layer_s=0.0)  # fmt: skip
    actor = [p for p in shrunk if p[1] == "actor"]
    scorers = [p for p in shrunk if p[1] != "actor"]
    if not actor or not scorers:
        return _fit_with(shrunk, bare, free_scale=False, fit=FIXED)
    fixed = _fit_with(scorers, bare, free_scale=False, fit=FIXED)
    own = _fit_with(actor, bare, free_scale=False, fit=FIXED)
    return dataclasses.replace(
        fixed,
        actor_forward_s=own.forward_s - fixed.forward_s,
        actor_layer_s=own.layer_s - fixed.layer_s,
        fit_error=max(fixed.fit_error, own.fit_error),
    )


def _fit_with(points: list[Point], ts: ThreadCosts, *, free_scale: bool, fit=CONSTANTS) -> ThreadCosts:
    """The non-negative least-squares fit, on relative error, of the constants named in ``fit`` (and of the
    GEMMs' scale where ``free_scale``) to the timed forwards ``points``; the GEMMs' share (at ``ts``'s
    scale where the scale is not fitted) and the terms of the constants not in ``fit`` (at ``ts``'s
    values) are taken out of each forward first."""
    probe = Calibrated(_probe_profile(ts))
    design, target, totals = [], [], []
    fitted = [0] if free_scale else []
    fitted += [j for j, name in enumerate(CONSTANTS, start=1) if name in fit]
    held = [j for j, name in enumerate(CONSTANTS, start=1) if name not in fit]
    for shape, role, (rows, new, ctx), seconds in points:
        batch = Batch(tuple((new, ctx + new) for _ in range(rows)), _head_rows(role, rows, new), rows)
        weights = shape.weight_bytes
        packed = role == "actor" and ts.packed  # the actor's forwards were timed packed (calibrate)

        def gemm(m, k, n, weights=weights, shape=shape, packed=packed):
            return max(probe.gemm(m, k, n, shape.dtype_bytes, 1, weights, packed))

        gemm_s = shape.layers * sum(gemm(batch.tokens, k, n) for k, n in shape.layer_gemms(grouped=packed))
        gemm_s += gemm(batch.head_rows, *shape.head_gemm())
        kv = shape.kv_width * 2 * shape.dtype_bytes
        logit_rows = batch.head_rows if shape.head == "lm" else 0
        cols = [
            gemm_s,
            1.0,
            shape.layers,
            shape.layers * shape.q_width * sum(attention_pairs(n, c) for n, c in batch.chunks),
            shape.layers * kv * sum(c for _, c in batch.chunks),
            shape.layers * batch.tokens * shape.hidden,
            logit_rows * shape.vocab,
        ]
        fixed_s = 0.0 if free_scale else gemm_s
        fixed_s += sum(getattr(ts, CONSTANTS[j - 1]) * cols[j] for j in held)
        fixed_s += ts.evicted_s(weights, shape.layers)  # measured apart (_time_evicted), as priced
        if role == "actor":  # its own fixed costs beside the scorers' (held: fitted from its copies)
            fixed_s += ts.actor_forward_s + ts.actor_layer_s * shape.layers
        design.append([cols[j] / seconds for j in fitted])
        target.append(1.0 - fixed_s / seconds)
        totals.append((cols, fixed_s, seconds))
    coef = dict(zip(fitted, nnls(design, target), strict=True))
    errors = [abs(f + sum(c * cols[j] for j, c in coef.items()) - s) / s for cols, f, s in totals]
    values = {name: coef.get(j, getattr(ts, name)) for j, name in enumerate(CONSTANTS, start=1)}
    # A constant whose feature no timed forward had (its column zero in every one) was not measured: the
    # profile records it with the largest amount of its feature the calibration's models had
    # (Profile.check_shape refuses beyond). Decided from the columns alone: a coefficient the fit put at
    # zero (NNLS does so under timing noise) is a measurement, not a refusal.
    shapes = {shape for shape, *_ in points}
    unfitted = {
        name: max(FEATURES[name][1](s) for s in shapes)
        for j, name in enumerate(CONSTANTS[1:], start=2)
        if all(cols[j] == 0 for cols, _, _ in totals)
    }
    return dataclasses.replace(
        ts, gemm_scale=coef.get(0, 1.0) if free_scale else ts.gemm_scale, **values,
        fit_error=statistics.median(errors), unfitted=unfitted,
    )  # fmt: skip


def _probe_profile(ts: ThreadCosts) -> Profile:
    return Profile("probe", "cpu", {1: ts}, HostCosts(0.0, 0.0, 0.0), 1.0)


def calibrate(
    actor,
    reward,
    critic=None,
    reference=None,
    path: str | Path | None = None,
    *,
    threads: tuple[int, ...] | None = None,
    progress: Callable[[str], None] | None = None,
) -> Profile:
    """Time the local device (where ``actor`` lives) and return its :class:`Profile`; ``path``: also write it
    there (JSON, whole or not at all).

    ``actor`` (a causal LM), ``reward`` (a one-label sequence classifier) and the optional ``critic`` and
    ``reference`` are HF models on one device; they are run through the engine's own forwards, never
    changed. ``threads``: the CPU thread counts to calibrate (default: 1 and the current torch setting);
    ignored on a GPU. ``progress`` is called with a line per stage.
    """
    import torch  # noqa: PLC0415

    from oppo_engine.sim.shapes import model_shape  # noqa: PLC0415
    from oppo_engine.sim.twin import measure_host_costs  # noqa: PLC0415

    models = {"actor": actor, "reward": reward, "critic": critic, "reference": reference}
    models = {role: m for role, m in models.items() if m is not None}
    devices = {str(next(m.parameters()).device) for m in models.values()}
    if len(devices) != 1:
        raise ValueError(f"calibrate: the models must share one device, got {sorted(devices)}")
    device = torch.device(devices.pop())
    gpu = device.type == "cuda"
    dtype = next(actor.parameters()).dtype
    timed = _timer(device)
    say = progress or (lambda _line: None)
    heads = {"actor": "lm", "reference": "lm", "reward": "score", "critic": "value"}
    shapes = {
        role: model_shape(m, head=heads[role], dtype_bytes=dtype.itemsize, name=role)
        for role, m in models.items()
    }
    counts = (1,) if gpu else tuple(sorted(set(threads or (1, torch.get_num_threads()))))
    packs = packing(device, dtype)
    # The fixed costs per forward and per layer are fitted from shrunk copies of each model at two depths
    # (``_fit``, ``_fixed_costs``). On the CPU only: on a GPU the copies' projections (a few thousand
    # weights) lie far below the GPU's GEMM table (896 x 896 up), which prices them per weight element at
    # nearly nothing, so their launches would land in the fixed cost per layer and be charged again in
    # every timed projection of a real model; and a GPU's decode forwards are launch-bound themselves, so
    # its own models show the fixed costs. The GPU keeps the one-depth fit (untested here: no GPU).
    shrunk = {} if gpu else _shrunk_copies(models, say)
    # The models' width ladders (CPU, where their copies could be made; ``ladder_head_dims``): the narrow
    # copies' forwards for the per-token constants, the packed actor's rungs for its products in forward.
    ladder = _ladder_copies(models, packs, say) if shrunk else {}
    narrow = {key: m for key, m in ladder.items() if key[1] == SHRUNK_HEAD_DIM}
    shrunk_shapes = {
        (role, depth): model_shape(m, head=heads[role], dtype_bytes=dtype.itemsize, name=f"{role}@{depth}")
        for (role, depth), m in shrunk.items()
    }
    ladder_shapes = {
        (role, d): model_shape(m, head=heads[role], dtype_bytes=dtype.itemsize, name=f"{role}@hd{d}")
        for (role, d), m in ladder.items()
    }
    saved = torch.get_num_threads()
    per_thread: dict[int, ThreadCosts] = {}
    try:
        for count in counts:
            if not gpu:
                torch.set_num_threads(count)
            say(f"calibrate: GEMMs and bandwidth at {count} thread(s)")
            products = _time_streaming_products(device, dtype, timed, gpu)
            ts = ThreadCosts(_time_gemms(device, dtype, timed, gpu), _time_bandwidth(device, timed),
                             0, 0, 0, 0, 0, 0, 0, _time_streaming(device, dtype, timed, gpu),
                             streaming_products=products)  # fmt: skip
            if packs:  # the engine's actor multiplies by packed weights here: time those products too
                say(f"calibrate: packed GEMMs and streaming at {count} thread(s)")
                gemm_packed = _time_gemms(device, dtype, timed, gpu, packed=True)
                streaming_packed = _time_streaming(device, dtype, timed, gpu, packed=True)
                products_packed = _time_streaming_products(device, dtype, timed, gpu, packed=True)
                ts = dataclasses.replace(ts, gemm_packed=gemm_packed, streaming_packed=streaming_packed,
                                         streaming_products_packed=products_packed)  # fmt: skip
            say(f"calibrate: forwards of {', '.join(models)} at {count} thread(s)")
            benches = {role: _RoleBench(role, model, device, packed=packs and role == "actor")
                       for role, model in models.items()}  # fmt: skip
            # The shrunk copies through the same machinery (the actor's packed as the actor's are).
            copies = {(role, depth): _RoleBench(role, m, device, packed=packs and role == "actor",
                                                grid=SHRUNK_GRID)
                      for (role, depth), m in shrunk.items()}  # fmt: skip
            rungs = {key: _RoleBench(key[0], m, device, packed=packs and key[0] == "actor")
                     for key, m in ladder.items()}  # fmt: skip
            actor_copies = {depth: b for (role, depth), b in copies.items() if role == "actor"}
            if len(actor_copies) == 2:  # the fixed costs after the weights stream (CPU: copies exist)
                say(f"calibrate: the actor's copies after their caches are taken, at {count} thread(s)")
                ts = dataclasses.replace(ts, evicted=_time_evicted(actor_copies, device))
            runs = [(role, bench, FORWARD_GRID) for role, bench in benches.items()]
            runs += [(key, bench, SHRUNK_GRID) for key, bench in copies.items()]
            runs += [(("narrow", key), rungs[key], FORWARD_GRID) for key in narrow]
            rounds: dict = {}
            # NOTE: rounds over the whole grid, the median of each point kept: a burst of other load on
            # the machine then slows one round of a point, not the figure kept.
            for _ in range(ROUNDS):
                for key, bench, grid in runs:
                    for point in grid:
                        rounds.setdefault((key, point), []).append(timed(bench.call(*point), 2))
            kept = _of_rounds(rounds)
            points = [(shapes[key], key, point, s) for (key, point), s in kept.items() if key in benches]
            shrunk_points = [(shrunk_shapes[key], key[0], point, s)
                             for (key, point), s in kept.items() if key in copies]  # fmt: skip
            narrow_points = [(ladder_shapes[key[1]], key[1][0], point, s)
                             for (key, point), s in kept.items() if key[0] == "narrow"]  # fmt: skip
            if packs:  # the actor's packed products as its forwards call them (ThreadCosts.packed_in_forward)
                calls = [(benches["actor"], shapes["actor"].weight_bytes, FORWARD_GRID)]
                calls += [(b, shrunk_shapes[key].weight_bytes, SHRUNK_GRID)
                          for key, b in copies.items() if key[0] == "actor"]  # fmt: skip
                # and its width ladder's (``ladder_head_dims``): the sizes between its copies' and its own
                calls += [(b, ladder_shapes[key].weight_bytes, FORWARD_GRID)
                          for key, b in rungs.items() if key[0] == "actor"]  # fmt: skip
                ratios = _packed_in_forward(_time_packed_calls(calls), ts, dtype.itemsize)
                ts = dataclasses.replace(ts, packed_in_forward=ratios)
            if packs:  # the actor's packs made again, as after every weight update (update_policy)
                actor_packs = [benches["actor"].runner.packed]
                actor_packs += [b.runner.packed for (role, _), b in copies.items() if role == "actor"]
                stream = torch.ones((max(EVICTED_MB) << 20) // 4, device=device)
                per_pack, per_byte = _fit_repack([_time_repack(p, timed, stream) for p in actor_packs])
                del stream
                ts = dataclasses.replace(ts, repack_s=per_pack, repack_byte_s=per_byte)
            per_thread[count] = _fit(points, ts, shrunk_points, narrow_points)
            if not gpu:  # two models' forwards alternating on the shared cache (intra, oppo)
                say(f"calibrate: weights read after another model's, at {count} thread(s)")
                switched = _time_switch(device, dtype)
                per_thread[count] = dataclasses.replace(per_thread[count], switched=switched)
            del copies, rungs
        say("calibrate: host time per iteration, two lanes at once, and the update")
        host = measure_host_costs()
        if not gpu:
            torch.set_num_threads(1)  # a streamed step's lanes run on one thread each
        probe = Profile("probe", "gpu" if gpu else "cpu", {1: per_thread[min(per_thread)]}, host, 1.0,
                        cores=float(os.cpu_count() or 1))  # fmt: skip
        cost = CostModel(Calibrated(probe))
        pairs = []
        with OtherCPU() as neighbour:  # a neighbour's load moves every pair (NEIGHBOUR_CORES)
            for a, b in CONTENTION_PAIRS:
                s_a, s_b = _pair_slowdowns(
                    benches["actor"].call(*a), benches["reward"].call(*b), timed, device
                )
                wa = cost.forward(shapes["actor"], _batch("actor", *a), packed=packs, actor=True)
                wb = cost.forward(shapes["reward"], _batch("reward", *b))
                pairs.append(_alternating(cost, wa, wb, shapes["actor"], shapes["reward"], s_a, s_b))
            if ("actor", 1) in shrunk and ("reward", 1) in shrunk:  # the copies' pairs: the hand-overs
                grid = tuple(p for pair in HANDOVER_PAIRS for p in pair)
                copy_a = _RoleBench("actor", shrunk["actor", 1], device, packed=packs, grid=grid)
                copy_b = _RoleBench("reward", shrunk["reward", 1], device, grid=grid)
                for a, b in HANDOVER_PAIRS:
                    s_a, s_b = _pair_slowdowns(copy_a.call(*a), copy_b.call(*b), timed, device)
                    wa = cost.forward(
                        shrunk_shapes["actor", 1], _batch("actor", *a), packed=packs, actor=True
                    )
                    wb = cost.forward(shrunk_shapes["reward", 1], _batch("reward", *b))
                    pairs.append(_alternating(cost, wa, wb, shrunk_shapes["actor", 1],
                                              shrunk_shapes["reward", 1], s_a, s_b))  # fmt: skip
                del copy_a, copy_b
            bare = []
            if not gpu:  # the bare projections' pair: the cores, next to no Python
                import torch.nn.functional as F  # noqa: N812, PLC0415

                rows, k, n = CORES_PAIR
                sides = [
                    (torch.randn(1, rows, k, dtype=dtype), torch.randn(n, k, dtype=dtype)) for _ in range(2)
                ]
                fns = [lambda x=x, w=w: F.linear(x, w) for x, w in sides]
                s_a, s_b = _pair_slowdowns(*fns, timed, device)
                product = Work(0.0, 0.0, ((probe.costs_at(1).gemm_s(rows, k * n), 0.0),), 1)
                bare = [(product, product, s_a, s_b)]
                del sides, fns
        if not gpu and (message := neighbour_warning(neighbour.cores)):
            warnings.warn(message, RuntimeWarning, stacklevel=2)
        cores, penalty, handover = _fit_contention(pairs, probe, device, bare)
        host = dataclasses.replace(host, interpreter_penalty=penalty, interpreter_handover=handover)
        training = _time_training(actor, device, timed)
        say("calibrate: a streamed step of the engine, for its lanes' interpreter")
        profile = Profile(local_device_id(device), "gpu" if gpu else "cpu", per_thread, host, training,
                          cores=1.0 if gpu else cores)  # fmt: skip
        pair = _interpreter_pair(actor, reward, shrunk)
        host = dataclasses.replace(host, interpreter_penalty=_fit_interpreter(*pair, profile))
    finally:
        torch.set_num_threads(saved)
    profile = Profile(
        device=profile.device,
        kind=profile.kind,
        cores=profile.cores,
        threads=per_thread,
        host=host,
        training_flops=training,
        torch_version=torch.__version__,
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        models={role: dataclasses.asdict(s) for role, s in shapes.items()},
    )
    if path is not None:
        profile.save(path)
    return profile


def _shrunk_copies(models: dict, say: Callable[[str], None]) -> dict:
    """``{(role, depth): copy}``: each model's shrunk copies at its two depths (``shrunk_depths``), or none,
    with a warning, where one cannot be made (``shrunk_copy``'s ``ValueError``): the fit then falls back to
    the models' own forwards, of one depth, whose fixed costs per forward and per layer it cannot split."""
    from oppo_engine.sim.shapes import model_shape  # noqa: PLC0415

    try:
        copies = {}
        for role, model in models.items():
            for depth in shrunk_depths(model_shape(model, dtype_bytes=None).layers):
                copies[role, depth] = shrunk_copy(model, depth)
    except ValueError as e:
        warnings.warn(
            f"{e}; the fixed costs per forward and per layer are fitted from the models' own forwards, which "
            "measure them poorly (barely, on a wide model; their split not at all, at one depth)",
            RuntimeWarning,
            stacklevel=3,
        )
        return {}
    say(f"calibrate: shrunk copies at depths {sorted({d for _, d in copies})} for the fixed costs")
    return copies


def _time_training(actor, device, timed) -> float:
    """Achieved FLOP/s of a training step's forward and backward of a copy of ``actor``, counted as
    :meth:`CostModel.update <oppo_engine.sim.cost.CostModel.update>` charges them
    (:func:`~oppo_engine.sim.cost.training_flops`). The optimizer is not timed: ``update`` prices it apart
    (its reads and writes of the weights and moments), so it is counted once."""
    import copy  # noqa: PLC0415

    import torch  # noqa: PLC0415

    from oppo_engine.sim.cost import training_flops  # noqa: PLC0415
    from oppo_engine.sim.shapes import model_shape  # noqa: PLC0415

    model = copy.deepcopy(actor).train()
    rows, width = 4, 64
    ids = torch.randint(5, model.config.vocab_size, (rows, width), device=device)

    def step() -> None:
        loss = model(input_ids=ids).logits.float().mean()
        loss.backward()
        model.zero_grad(set_to_none=True)

    seconds = timed(step, 2)
    return training_flops(model_shape(actor, dtype_bytes=None), [width] * rows, 3.0) / seconds
