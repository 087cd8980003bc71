"""``calibrate``: time the local device and fit its :class:`~oppo_engine.sim.profile.Profile`.

What is timed, per thread count on the CPU (one and the machine's default) or once on a GPU:

- bare GEMMs over a grid of sizes (rows x weight shape): achieved FLOP/s against GEMM size;
- one large copy: the memory bandwidth;
- the engine's own forwards of each given model (its runner and, for the actor, its sampler; the scorers'
  reward, reference and critic paths) over a grid of rows x new tokens x context;
- the engine's host time per iteration (its scheduler and bookkeeping around forwards that cost nothing);
- one training step (forward, backward, AdamW) of the actor.

The forwards are fitted, after the GEMMs' share is taken out, with non-negative least squares on relative
error, to device-level constants: a fixed cost per forward and per layer, attention per query-key pair and
per KV byte read, elementwise work per token and hidden unit, and logit post-processing per element. None of
them belongs to a model, so the profile prices models it was not calibrated on.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from oppo_engine.sim.cost import Batch, HostCosts
from oppo_engine.sim.profile import Calibrated, Profile, ThreadCosts, local_device_id
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
    """``timed(fn, reps)``: the fastest of at least ``reps`` calls of ``fn`` (more, up to 50, until they
    add up to 20 ms), after one warm-up call. The fastest, because other load on the machine only ever
    adds time: the profile describes the device, not its neighbours."""
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
        return min(samples)

    return timed


# Grids: (rows M) x (weight K, N) of the bare GEMMs; (rows, new tokens, context before) of the forwards.
GEMM_ROWS = (1, 4, 16, 64, 256)
GEMM_SHAPES_CPU = ((128, 128), (256, 704), (512, 512), (1024, 1024), (1024, 4096))
GEMM_ROWS_GPU = (1, 16, 64, 256, 1024, 4096)
GEMM_SHAPES_GPU = ((896, 896), (1536, 1536), (896, 4864), (3584, 3584), (3584, 18944))
ROUNDS = 3
FORWARD_GRID = (
    (1, 1, 16), (4, 1, 64), (16, 1, 256), (32, 1, 128), (1, 16, 0), (4, 16, 128),
    (8, 64, 0), (4, 64, 256), (16, 16, 64), (1, 128, 256),
)  # fmt: skip


def _time_gemms(device, dtype, timed, gpu: bool) -> dict[int, list[tuple[int, float]]]:
    import torch  # noqa: PLC0415

    best: dict[tuple[int, int, int], float] = {}
    shapes = GEMM_SHAPES_GPU if gpu else GEMM_SHAPES_CPU
    weights = {(k, n): torch.randn(k, n, device=device, dtype=dtype) for k, n in shapes}
    for _ in range(ROUNDS):  # rounds, the fastest kept (as for the forwards)
        for (k, n), w in weights.items():
            for m in GEMM_ROWS_GPU if gpu else GEMM_ROWS:
                x = torch.randn(m, k, device=device, dtype=dtype)
                seconds = timed(lambda x=x, w=w: torch.matmul(x, w), 3)
                best[m, k, n] = min(seconds, best.get((m, k, n), seconds))
    out: dict[int, list[tuple[int, float]]] = {}
    for (m, k, n), seconds in sorted(best.items()):
        out.setdefault(k * n, []).append((m, 2.0 * m * k * n / max(seconds, 1e-9)))
    return out


def _time_bandwidth(device, timed) -> float:
    import torch  # noqa: PLC0415

    numel = (256 << 20) // 4 if device.type == "cuda" else (64 << 20) // 4
    src = torch.empty(numel, device=device, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), 5)
    return 2 * src.numel() * 4 / seconds  # read and write


class _RoleBench:
    """The engine's forward path of one role over its own small arena, for timing."""

    def __init__(self, role: str, model, device) -> None:
        import torch  # noqa: PLC0415

        from oppo_engine.cache import KVArena, KVCacheManager, KVSpec  # noqa: PLC0415
        from oppo_engine.model.actor import ActorWorker  # noqa: PLC0415
        from oppo_engine.model.runner import ModelRunner  # noqa: PLC0415
        from oppo_engine.model.scorer import CriticScorer, ReferenceScorer, RewardScorer  # noqa: PLC0415

        self.role, self.model = role, model
        spec = KVSpec.from_hf_config(model.config, model.dtype)
        need = max(r * (n + c) for r, n, c in FORWARD_GRID)
        self.arena = KVArena({role: spec}, page_size=16, num_pages=need // 16 + 64, device=device)
        self.cache = KVCacheManager(self.arena, role)
        runner = ModelRunner(model, self.cache)
        self.actor = ActorWorker(runner) if role == "actor" else None
        scorers = {"reward": RewardScorer, "reference": ReferenceScorer, "critic": CriticScorer}
        self.scorer = scorers[role](runner) if role != "actor" else None
        self.vocab = model.config.vocab_size
        self._torch = torch

    def call(self, rows: int, new: int, ctx: int) -> Callable[[], object]:
        """A function running one forward of ``rows`` chunks of ``new`` tokens after ``ctx`` cached ones."""
        from oppo_engine.model.runner import SeqChunk  # noqa: PLC0415
        from oppo_engine.model.sampler import SampleBatch  # noqa: PLC0415

        counter = [0]

        def run() -> None:
            counter[0] += 1
            ids = [(counter[0], i) for i in range(rows)]
            chunks = []
            for sid in ids:
                if ctx:
                    self.cache.append_slots(sid, ctx)
                slots = self.cache.append_slots(sid, new)
                chunks.append(SeqChunk(sid, [5 + (j % (self.vocab - 5)) for j in range(new)], slots))
                if self.scorer is not None:
                    self.scorer.begin(sid, ctx + 1, 1.0)
            try:
                if self.actor is not None:
                    batch = SampleBatch(list(range(rows)), [1.0] * rows, [0] * rows, [1.0] * rows,
                                        list(range(rows)), [ctx + new] * rows)  # fmt: skip
                    self.actor.forward(chunks, batch)
                else:
                    self.scorer.prefill(chunks)
            finally:
                for sid in ids:
                    if self.scorer is not None:
                        self.scorer.release(sid)
                    self.cache.free(sid)

        return run


def _head_rows(role: str, rows: int, new: int) -> int:
    return rows if role in ("actor", "reward") else rows * new


def _fit(points: list[tuple[ModelShape, str, tuple[int, int, int], float]], ts: ThreadCosts) -> ThreadCosts:
    """Fit the per-forward constants to the timed forwards, the GEMMs' share (from ``ts.gemm``) taken out."""
    probe = Calibrated(_probe_profile(ts))
    design, target, totals = [], [], []
    for shape, role, (rows, new, ctx), seconds in points:
        batch = Batch(tuple((new, ctx + new) for _ in range(rows)), _head_rows(role, rows, new), rows)
        gemm_s = sum(probe.gemm(batch.tokens, k, n, shape.dtype_bytes)[0] for k, n in shape.layer_gemms())
        gemm_s = shape.layers * gemm_s + probe.gemm(batch.head_rows, *shape.head_gemm(), shape.dtype_bytes)[0]
        kv = shape.kv_width * 2 * shape.dtype_bytes
        logit_rows = batch.head_rows if shape.head == "lm" else 0
        cols = [
            1.0,
            shape.layers,
            shape.layers * shape.q_width * sum(attention_pairs(n, c) for n, c in batch.chunks),
            shape.layers * kv * sum(c for _, c in batch.chunks),
            shape.layers * batch.tokens * shape.hidden,
            logit_rows * shape.vocab,
        ]
        design.append([x / seconds for x in cols])
        target.append(max(0.0, seconds - gemm_s) / seconds)
        totals.append((cols, gemm_s, seconds))
    forward_s, layer_s, pair_s, kv_s, tok_s, logit_s = nnls(design, target)
    coef = (forward_s, layer_s, pair_s, kv_s, tok_s, logit_s)
    errors = [abs(g + sum(a * b for a, b in zip(cols, coef, strict=True)) - s) / s for cols, g, s in totals]
    return dataclasses.replace(
        ts, forward_s=forward_s, layer_s=layer_s, pair_s=pair_s, kv_byte_s=kv_s,
        token_hidden_s=tok_s, logit_s=logit_s, fit_error=statistics.median(errors),
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
    saved = torch.get_num_threads()
    per_thread: dict[int, ThreadCosts] = {}
    try:
        for count in counts:
            if not gpu:
                torch.set_num_threads(count)
            say(f"calibrate: GEMMs and bandwidth at {count} thread(s)")
            ts = ThreadCosts(_time_gemms(device, dtype, timed, gpu), _time_bandwidth(device, timed),
                             0, 0, 0, 0, 0, 0, 0)  # fmt: skip
            say(f"calibrate: forwards of {', '.join(models)} at {count} thread(s)")
            benches = {role: _RoleBench(role, model, device) for role, model in models.items()}
            best: dict = {}
            # NOTE: rounds over the whole grid, the fastest of each point kept: a burst of other load on
            # the machine then slows one round of a point, not all of them.
            for _ in range(ROUNDS):
                for role, bench in benches.items():
                    for point in FORWARD_GRID:
                        seconds = timed(bench.call(*point), 2)
                        best[role, point] = min(seconds, best.get((role, point), seconds))
            points = [(shapes[role], role, point, seconds) for (role, point), seconds in best.items()]
            per_thread[count] = _fit(points, ts)
        say("calibrate: host time per iteration and the update")
        host = measure_host_costs()
        training = _time_training(actor, device, timed)
    finally:
        torch.set_num_threads(saved)
    profile = Profile(
        device=local_device_id(device),
        kind="gpu" if gpu else "cpu",
        cores=1 if gpu else os.cpu_count() or 1,
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


def _time_training(actor, device, timed) -> float:
    """Achieved FLOP/s of a training step (forward, backward, AdamW) of a copy of ``actor``."""
    import copy  # noqa: PLC0415

    import torch  # noqa: PLC0415

    from oppo_engine.sim.shapes import model_shape  # noqa: PLC0415

    model = copy.deepcopy(actor).train()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-6)
    rows, width = 4, 64
    ids = torch.randint(5, model.config.vocab_size, (rows, width), device=device)

    def step() -> None:
        loss = model(input_ids=ids).logits.float().mean()
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)

    seconds = timed(step, 2)
    params = model_shape(actor, dtype_bytes=None).params
    return 6.0 * params * rows * width / seconds
