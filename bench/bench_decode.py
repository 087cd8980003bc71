"""Decode throughput: the engine (mode="sequential") against HF `generate`, side by side in one run.

Same models, same prompts, same response lengths (``ignore_eos``), greedy; the two alternate for
``--repeats`` rounds and the median of each is reported. Generation only: scoring is left out on both sides
(the engine's reward is a constant rule), so the ratio is about decode.

``--graph`` runs the engine with ``graph=True`` ("engine") and with ``graph=False`` ("eager") beside HF, the
three alternating, and prints ``decode_graph_vs_eager=`` (the device check's decode step).

``--table`` prints the captured-decode table instead: the engine eager, the engine with ``graph=True`` and
HF ``generate`` at B = 1, 16, 64 and 256 on the ``tiny`` preset and on a GQA Llama with head_dim 80, the
three alternating within each batch size; the graph's compile time is reported apart (it is cached across
the engines of the process, so it is paid once per model):

    python -m bench.bench_decode --table

``--host`` times only the step loop's host work per decode forward (scheduling, the sampler's columns,
``append_token``) at B = 16, 64 and 256, without a model:

    python -m bench.bench_decode --host

``--sampler`` adds the CPU sampler at B=16, V=151,936 against ``torch.multinomial`` (bench/bench_sampler.py);
``--metadata`` adds the host side of one decode forward at B=256 with 4,096 tokens of context: the
runner's per-forward metadata (persistent block tables) against the rebuild it replaced, side by side.

    python -m bench.bench_decode --preset tiny --batch-size 16 --new-tokens 64 --sampler --metadata

``--model smollm2`` runs the bundled SmolLM2-135M-Instruct (``load_pretrained``, in ``--dtype``) instead of a
random preset: the engine eager (with and without ``packed_weights``) against HF ``generate`` at each of
``--batches``, the three alternating for
``--repeats`` rounds, the fastest of each reported (``min``: on a shared machine the load only ever adds),
in wall time and in the process's CPU time (which the other processes of a loaded machine move less; with
one thread it is the work done),
with ``os.getloadavg()`` beside every figure, and the step time against this machine's roofline (the
weights' bytes over the bandwidth, the GEMM FLOPs over the GEMM rate of a 2048^3 ``matmul`` and over
torch's rate at a decode product's shape (the MLP's up projection), all measured in the run:
``measure_roofline``). ``--profile`` adds a ``torch.profiler`` table of one engine step per cell:

    python -m bench.bench_decode --model smollm2 --dtype fp32 --batches 16 64 --new-tokens 48 --profile
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Sequence

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from bench import bench_sampler
from bench.baselines import hf_generate
from bench.workloads import PAD_TOKEN_ID, build_models
from oppo_engine import EngineConfig, RolloutEngine, SamplingParams, ops
from oppo_engine.cache import KVArena, KVCacheManager, KVSpec
from oppo_engine.model import fused as fused_module
from oppo_engine.model import packed as packed_module
from oppo_engine.model.runner import ModelRunner, SeqChunk


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_engine(
    actor, new_tokens: int, batch_size: int, graph: bool | str = "auto", packed: bool | str = "auto"
) -> RolloutEngine:
    """The engine as a PPO loop holds it: built once, then stepped (its construction is not timed)."""
    return RolloutEngine(
        actor=actor,
        reward=lambda prompt, response: 0.0,
        config=EngineConfig(
            batch_size=batch_size, mode="sequential", max_model_len=1024, graph=graph, packed_weights=packed
        ),
        sampling=SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True),
    )


def run_engine(engine: RolloutEngine, prompts: list[list[int]]) -> tuple[float, int]:
    """One step over ``prompts``: (seconds, tokens generated)."""
    engine.add_prompts(prompts)
    _sync(engine.device)
    t0 = time.perf_counter()
    tokens = sum(len(r.response_ids) for r in engine.step().rollouts)
    _sync(engine.device)
    return time.perf_counter() - t0, tokens


def run_hf(actor, prompts: list[list[int]], new_tokens: int) -> tuple[float, int]:
    _sync(actor.device)
    t0 = time.perf_counter()
    out = hf_generate(actor, prompts, [new_tokens] * len(prompts), 0.0, 0, PAD_TOKEN_ID)
    _sync(actor.device)
    return time.perf_counter() - t0, sum(len(r) for r in out)


def rebuild_metadata(runner: ModelRunner, chunks: list[SeqChunk]) -> list[torch.Tensor]:
    """The runner's per-forward metadata as it was built before persistent block tables (the baseline):
    every sequence's page list copied out of the cache and flattened into a zero-padded Python table."""
    ids, positions, slots, cu, context_lens, tables = [], [], [], [0], [], []
    for c in chunks:
        q_len, ctx = len(c.token_ids), runner.cache.num_tokens(c.seq_id)
        ids.extend(c.token_ids)
        positions.extend(range(ctx - q_len, ctx))
        slots.extend(c.slots)
        cu.append(cu[-1] + q_len)
        context_lens.append(ctx)
        tables.append(runner.cache.pages(c.seq_id))
    width = max(len(t) for t in tables)
    flat: list[int] = []
    for t in tables:
        flat += t + [0] * (width - len(t))
    last = [i - 1 for i in cu[1:]]
    return [
        torch.tensor(ids + positions + slots + last, dtype=torch.int64),
        torch.tensor(cu + context_lens + flat, dtype=torch.int32),
    ]


def bench_metadata(actor, batch: int = 256, context: int = 4096, repeats: int = 200) -> dict[str, float]:
    """Host time of one decode forward's metadata at ``batch`` x ``context``: today's vs the old rebuild."""
    spec = KVSpec.from_hf_config(actor.config, torch.float32)
    page_size = 16
    pages = batch * -(-(context + 1) // page_size)
    arena = KVArena({"actor": spec}, page_size=page_size, num_pages=pages, device="cpu")  # untouched memory
    runner = ModelRunner(actor, KVCacheManager(arena, "actor"))
    for s in range(batch):
        runner.cache.append_slots(s, context)
    chunks = [SeqChunk(s, [7], runner.cache.append_slots(s, 1)) for s in range(batch)]
    times: dict[str, list[float]] = {"persistent": [], "rebuild": []}
    # Rounds of 10 calls each, the two alternating by round: per-call alternation would charge one side
    # for the other's memory churn (the rebuild allocates 65k-element lists).
    for _ in range(repeats // 10):
        for name, fn in (
            ("persistent", lambda: runner._prepare(chunks)),
            ("rebuild", lambda: rebuild_metadata(runner, chunks)),
        ):
            t0 = time.perf_counter()
            for _ in range(10):
                fn()
            times[name].append((time.perf_counter() - t0) / 10)
    ms = {name: 1e3 * statistics.median(ts) for name, ts in times.items()}
    print(f"host metadata per forward, B={batch} context={context}:")
    for name, v in ms.items():
        print(f"  {name:>10}: {v:8.3f} ms")
    ratio = ms["rebuild"] / ms["persistent"]
    print(f"metadata_speedup_vs_rebuild={ratio:.1f}")
    return {"metadata_ms": ms["persistent"], "rebuild_ms": ms["rebuild"], "metadata_speedup": ratio}


def bench_host(batch: int = 64, new_tokens: int = 64, repeats: int = 25) -> float:
    """The step loop's host work per decode forward, without a model: ``schedule()``, the sampler's columns
    and their packing, and ``append_token`` for ``batch`` sequences over ``new_tokens`` forwards; thread CPU
    time (the machine's load changes it less than wall time), the fastest of ``repeats``. Returns us."""
    from oppo_engine.config import SamplingParams as Params
    from oppo_engine.sched.scheduler import ActorScheduler
    from oppo_engine.sched.sequence import Sequence
    from oppo_engine.sched.step import _sample_batch, _seq_chunks

    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    params = Params(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)

    def run() -> float:
        arena = KVArena({"actor": spec}, page_size=16, num_pages=batch * 8, device="cpu")
        cache = KVCacheManager(arena, "actor")
        sched = ActorScheduler(cache, max_num_seqs=batch, max_num_batched_tokens=8192, max_model_len=1024)
        for i in range(batch):
            sched.add(Sequence(seq_id=i, prompt_index=i, prompt_ids=list(range(32)), sampling=params, seed=i))
        t0 = time.thread_time()
        while sched.has_work:
            chunks = sched.schedule()
            samples = _sample_batch(chunks)
            _seq_chunks(chunks)
            samples.packed()
            for row in samples.rows:
                sched.append_token(chunks[row].seq, 5, 0.0, 0)
        return time.thread_time() - t0

    us = 1e6 * min(run() for _ in range(repeats)) / new_tokens
    print(f"host work per decode forward, B={batch}: {us:.0f} us")
    return us


def gqa_llama80(dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """A GQA Llama with head_dim 80 (4 query heads, 2 KV heads, 2 layers), random weights."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=320,
        intermediate_size=864,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=80,
        max_position_embeddings=4096,
        pad_token_id=PAD_TOKEN_ID,
    )
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


TABLE_BATCHES = (1, 16, 64, 256)


def decode_table(
    device: torch.device, *, prompt_len: int, new_tokens: int, repeats: int, batches=TABLE_BATCHES
) -> dict[str, dict[int, dict[str, float]]]:
    """tok/s of eager engine, graph engine and HF at each batch size, per model; compile seconds apart."""
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    models = {
        "tiny": build_models("tiny", dtype, device, seed=0)[0],
        "llama-gqa-hd80": gqa_llama80(dtype, device),
    }
    table: dict[str, dict[int, dict[str, float]]] = {}
    for model_name, actor in models.items():
        g = torch.Generator().manual_seed(0)
        vocab = actor.config.vocab_size
        compile_s = 0.0
        table[model_name] = {}
        for batch in batches:
            prompts = [torch.randint(16, vocab, (prompt_len,), generator=g).tolist() for _ in range(batch)]
            engines = {
                "eager": make_engine(actor, new_tokens, batch, graph=False),
                "graph": make_engine(actor, new_tokens, batch, graph=True),
            }
            for engine in engines.values():
                run_engine(engine, prompts)  # warm-up; the graph's first step compiles
            captured = engines["graph"]._loop.actor.runner.captured
            compile_s += captured.compile_s
            run_hf(actor, prompts[:2], 4)
            times: dict[str, list[float]] = {"eager": [], "graph": [], "hf": []}
            for _ in range(repeats):
                for name in times:
                    if name == "hf":
                        elapsed, tokens = run_hf(actor, prompts, new_tokens)
                    else:
                        elapsed, tokens = run_engine(engines[name], prompts)
                    assert tokens == batch * new_tokens, (name, tokens)
                    times[name].append(elapsed)
            rates = {name: batch * new_tokens / statistics.median(ts) for name, ts in times.items()}
            assert captured.forwards > 0 and captured.fallback is None, captured.fallback
            table[model_name][batch] = rates
            for engine in engines.values():
                engine.close()
        print(f"\n{model_name}: compile {compile_s:.1f} s (first graph step; cached for later engines)")
        print(
            f"{'B':>5} {'eager tok/s':>12} {'graph tok/s':>12} {'HF tok/s':>10} {'graph/eager':>12} "
            f"{'graph/HF':>9} {'eager/HF':>9}"
        )
        for batch, r in table[model_name].items():
            print(
                f"{batch:>5} {r['eager']:12.1f} {r['graph']:12.1f} {r['hf']:10.1f} "
                f"{r['graph'] / r['eager']:12.2f} {r['graph'] / r['hf']:9.2f} {r['eager'] / r['hf']:9.2f}"
            )
        table[model_name]["compile_s"] = compile_s  # type: ignore[index]
    return table


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def cpu_identity() -> str:
    """The CPU this run is on (model name, family/model, the AVX-512 and AMX flags): sessions of this
    project have run on more than one kind of machine, and a CPU figure means nothing without it."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
    except OSError:
        return "unknown CPU"
    flags = [f for f in info.get("flags", "").split() if f.startswith(("avx512f", "avx512_bf16", "amx"))]
    family, model = info.get("cpu family", "?"), info.get("model", "?")
    return (
        f"{info.get('model name', '?')} (family {family}, model {model}; "
        f"{' '.join(flags) or 'no AVX-512'}; {os.cpu_count()} CPUs)"
    )


def measure_roofline(
    dtype: torch.dtype, repeats: int = 5, step_shape: tuple[int, int, int] | None = None
) -> dict[str, float]:
    """This machine's roofline, measured in the run at the process's thread count: the read bandwidth (the
    fastest ``sum`` over 512 MB of ``dtype``) and the GEMM rate (the fastest 2048^3 ``matmul`` in ``dtype``).
    Both are the best the machine does on a large, simple case: a decode step's floor, not its expectation.

    With ``step_shape=(rows, in_features, out_features)``, also ``linear_rate``: the fastest
    ``torch.nn.functional.linear`` of ``rows`` rows by an ``out_features x in_features`` weight in ``dtype``
    (the weight in cache, as repeated calls leave it): the rate torch itself reaches at a decode product's
    shape, the yardstick issue 35 measured (a 16 x 576 x 1536 linear) and priced the step's GEMMs by. On a
    2-core Zen 5, oneDNN's bf16 product of 16 rows on two threads ran by spells at about one thread's rate
    or at ~1.7x it (2026-12-07): the fastest of several processes is the yardstick."""

    def best(fn, repeats: int = repeats) -> float:
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    big = torch.ones(512 * 2**20 // torch.finfo(dtype).bits * 8, dtype=dtype)
    bandwidth = big.numel() * big.element_size() / best(big.sum)
    del big
    n = 2048
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    out = {"bandwidth": bandwidth, "gemm_rate": 2 * n**3 / best(lambda: a @ b)}
    if step_shape is not None:
        rows, k, m = step_shape
        x, w = torch.randn(rows, k).to(dtype), torch.randn(m, k).to(dtype)
        # One timing is 50 calls (a single call of a few rows is too short for the clock), the fastest of
        # 20 timings: a small product's rate swings by up to 1.7x from one timing to the next on a shared
        # machine, so the best of many is this shape's rate, as the 2048^3 product's best is the GEMM rate.
        calls = 50
        with torch.inference_mode():

            def linears() -> None:
                for _ in range(calls):
                    torch.nn.functional.linear(x, w)

            out["linear_rate"] = calls * 2 * rows * k * m / best(linears, repeats=max(repeats, 20))
    return out


def roofline(actor, batch: int, measured: dict[str, float]) -> dict[str, float]:
    """One decode step's floor in seconds: every linear layer's weights (the LM head's included) read once
    at the measured bandwidth (``bytes_s``), and their ``2 * B * params`` FLOPs at the measured GEMM rate
    (``gemm_s``), and at torch's rate for the MLP up projection's shape where ``measured`` has it
    (``linear_gemm_s``); ``measured`` is :func:`measure_roofline`'s."""
    linears = [m for m in actor.modules() if isinstance(m, torch.nn.Linear)]
    params = sum(m.weight.numel() for m in linears)
    nbytes = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    out = {"bytes_s": nbytes / measured["bandwidth"], "gemm_s": 2 * batch * params / measured["gemm_rate"]}
    if "linear_rate" in measured:
        out["linear_gemm_s"] = 2 * batch * params / measured["linear_rate"]
    return out


def step_shape(actor, batch: int) -> tuple[int, int, int]:
    """A decode step's product shape for :func:`measure_roofline`: ``batch`` rows by the MLP's up
    projection (hidden x intermediate; 576 x 1536 for SmolLM2)."""
    config = actor.config
    return batch, config.hidden_size, config.intermediate_size


# Where a step's CPU time goes, by op name (self time): the first category whose pattern is in the name.
PROFILE_GROUPS = (
    ("GEMM (mm/addmm/linear)", ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "mkldnn")),
    ("paged attention", ("oppo::paged_attention",)),
    ("cache writes", ("oppo::reshape_and_cache",)),
    ("sampler", ("oppo::sample",)),
    ("norms/RoPE/act (elementwise)", ("aten::mul", "aten::add", "aten::pow", "aten::mean", "aten::rsqrt",
                                      "aten::neg", "aten::cat", "aten::silu", "aten::sigmoid", "aten::sub")),
    ("copies/casts", ("aten::copy_", "aten::to", "aten::_to_copy", "aten::contiguous", "aten::clone")),
    ("embedding/index", ("aten::embedding", "aten::index", "aten::gather", "aten::slice", "aten::select")),
)  # fmt: skip


def profile_step(engine: RolloutEngine, prompts: list[list[int]], top: int = 18) -> dict[str, float]:
    """``torch.profiler`` over one engine step: the top ops by self CPU time, and the grouped shares."""
    from torch.profiler import ProfilerActivity, profile

    engine.add_prompts(prompts)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    print(events.table(sort_by="self_cpu_time_total", row_limit=top))
    total_us = sum(e.self_cpu_time_total for e in events)
    groups = {name: 0.0 for name, _ in PROFILE_GROUPS} | {"other ops": 0.0}
    for e in events:
        name = next((g for g, pats in PROFILE_GROUPS if any(e.key.startswith(p) for p in pats)), "other ops")
        groups[name] += e.self_cpu_time_total
    print(f"profiled step {wall:.3f} s (ops' self time {total_us / 1e6:.3f} s)")
    for name, us in groups.items():
        print(f"  {name:<30} {us / 1e3:9.1f} ms  {100 * us / total_us:5.1f}%")
    return {name: us / 1e6 for name, us in groups.items()}


def bench_smollm2(
    dtype: torch.dtype,
    batches: Sequence[int],
    *,
    prompt_len: int,
    new_tokens: int,
    repeats: int,
    profile: bool,
    arms: Sequence[str] = ("unpacked",),
) -> dict[int, dict[str, float]]:
    """The engine (eager, packed weights, the exact fusions: "engine") against HF ``generate`` on
    SmolLM2-135M-Instruct at each batch size, with the ``arms`` beside it ("unpacked": without packed
    weights; "unfused": without the fused modules of ``oppo_engine/model/fused.py``; "unfused_silu": the MLPs'
    SiLU and product as torch's two ops on copies of the halves (``ops.silu_mul`` off); "onednn_small":
    every product of a few bf16 rows as oneDNN's (``ops.small_linear`` off, ``packed.SMALL_ROWS = 0``);
    "ungrouped": every projection alone, ``PackedLinears.grouping`` off; "unmodelled": the model's own call,
    each decoder layer its own op (``fused.DECODE_MODEL`` off); "unlayered": each decoder layer's
    calls one by one, not as ``ops.llama_decode_layer``, ``fused.DECODE_LAYERS`` off), all alternating: tok/s
    from the fastest of ``repeats`` rounds, the step time beside the roofline."""
    from oppo_engine.pretrained import load_pretrained

    actor, _ = load_pretrained("smollm2-135m-instruct", dtype=dtype)
    print(f"CPU: {cpu_identity()}")
    g = torch.Generator().manual_seed(0)
    vocab = actor.config.vocab_size
    results: dict[int, dict[str, float]] = {}
    for batch in batches:
        prompts = [torch.randint(16, vocab, (prompt_len,), generator=g).tolist() for _ in range(batch)]
        # Each engine arm twice: with new_tokens and with fewer ("<arm>@short"); the same prefill, so the
        # difference of the two is decode steps alone (a decode step's time, prefill excluded).
        short = max(1, new_tokens // 6)
        engines: dict[str, RolloutEngine] = {}
        for name in ("engine", *arms):
            for suffix, tokens in (("", new_tokens), ("@short", short)):
                before = {id(r) for r in actor_runners(actor)}
                packed = name != "unpacked"
                engines[name + suffix] = make_engine(actor, tokens, batch, graph=False, packed=packed)
                if name == "unfused":  # without the fused modules of model/fused.py
                    (runner,) = [r for r in actor_runners(actor) if id(r) not in before]  # the new engine's
                    runner.fused = None
        for engine in engines.values():
            run_engine(engine, prompts)  # warm-up (the packed engine packs its weights here)
        run_hf(actor, prompts[:2], 4)
        silu_mul, small_rows = ops.SILU_MUL_AVAILABLE, packed_module.SMALL_ROWS
        layers, model_path = fused_module.DECODE_LAYERS, fused_module.DECODE_MODEL
        times: dict[str, list[float]] = {name: [] for name in (*engines, "hf")}
        cpu: dict[str, list[float]] = {name: [] for name in times}
        loads = []
        try:
            for _ in range(repeats):
                for name in times:
                    packs = actor_runner_of(engines[name]).packed if name != "hf" else None
                    # "unfused_silu": the MLPs' SiLU and product as torch's two ops (ops.silu_mul off)
                    ops.SILU_MUL_AVAILABLE = silu_mul and not name.startswith("unfused_silu")
                    # "onednn_small": a few bf16 rows' products as oneDNN's (ops.small_linear off)
                    packed_module.SMALL_ROWS = 0 if name.startswith("onednn_small") else small_rows
                    grouping = not name.startswith("ungrouped")  # "ungrouped": PackedLinears.grouping off
                    # "unlayered": each decoder layer's calls one by one (fused.DECODE_LAYERS off)
                    fused_module.DECODE_LAYERS = layers and not name.startswith("unlayered")
                    # "unmodelled": the model's own call, each layer its own op (fused.DECODE_MODEL off)
                    fused_module.DECODE_MODEL = model_path and not name.startswith("unmodelled")
                    if packs is not None and packs.grouping != grouping:
                        packs.grouping = grouping
                        with torch.inference_mode(), packs.applied():
                            pass  # the stacked packs made (or freed) here, outside the timed run
                    c0 = time.process_time()
                    if name == "hf":
                        elapsed, tokens = run_hf(actor, prompts, new_tokens)
                    else:
                        elapsed, tokens = run_engine(engines[name], prompts)
                    cpu[name].append(time.process_time() - c0)
                    want = batch * (short if name.endswith("@short") else new_tokens)
                    assert tokens == want, (name, tokens)
                    times[name].append(elapsed)
                loads.append(os.getloadavg()[0])
        finally:
            ops.SILU_MUL_AVAILABLE, packed_module.SMALL_ROWS = silu_mul, small_rows
            fused_module.DECODE_LAYERS, fused_module.DECODE_MODEL = layers, model_path
        best = {name: min(ts) for name, ts in times.items()}
        best_cpu = {name: min(ts) for name, ts in cpu.items()}
        measured = measure_roofline(dtype, step_shape=step_shape(actor, batch))
        roof = roofline(actor, batch, measured)
        step_ms = 1e3 * best["engine"] / new_tokens  # prefill included, spread over the tokens
        # A decode step alone: the long run less the short one (the same prefill), over the extra tokens.
        extra = new_tokens - short
        decode = {name: 1e3 * (best[name] - best.pop(name + "@short")) / extra for name in ("engine", *arms)}
        decode_ms = decode["engine"]
        for name in decode:
            best_cpu.pop(name + "@short")
            times.pop(name + "@short")
        r = {f"{name}_tok_s": batch * new_tokens / t for name, t in best.items()}
        r |= {f"{name}_cpu_ms": 1e3 * t / new_tokens for name, t in best_cpu.items()}
        r |= {
            "step_ms": step_ms,
            "decode_step_ms": decode_ms,
            **{f"{name}_decode_step_ms": ms for name, ms in decode.items() if name != "engine"},
            "bytes_ms": 1e3 * roof["bytes_s"],
            "gemm_ms": 1e3 * roof["gemm_s"],
            "bandwidth_gb_s": measured["bandwidth"] / 1e9,
            "gemm_gflop_s": measured["gemm_rate"] / 1e9,
            "linear_gemm_ms": 1e3 * roof["linear_gemm_s"],
            "linear_gflop_s": measured["linear_rate"] / 1e9,
            "load": max(loads),
            "ratio": r["engine_tok_s"] / r["hf_tok_s"],
            "cpu_ratio": best_cpu["hf"] / best_cpu["engine"],
        }
        print(
            f"smollm2 {str(dtype).removeprefix('torch.')} B={batch} prompt={prompt_len} new={new_tokens} "
            f"threads={torch.get_num_threads()} load={min(loads):.1f}-{max(loads):.1f}, min of {repeats}:"
        )
        for name in times:
            alone = f", {decode[name]:5.1f} ms a decode step alone" if name in decode else ""
            print(
                f"  {name:>8}: {r[f'{name}_tok_s']:8.1f} tok/s, "
                f"{1e3 * best[name] / new_tokens:6.1f} ms/token wall, {r[f'{name}_cpu_ms']:6.1f} ms/token CPU"
                f"{alone}"
            )
        others = "".join(
            f"{name}/HF {r[f'{name}_tok_s'] / r['hf_tok_s']:.2f}x wall, "
            f"{best_cpu['hf'] / best_cpu[name]:.2f}x CPU; "
            for name in arms
        )
        print(
            f"  engine/HF {r['ratio']:.2f}x wall, {r['cpu_ratio']:.2f}x CPU time; {others}"
            f"roofline (measured: {r['bandwidth_gb_s']:.0f} GB/s, {r['gemm_gflop_s']:.0f} GFLOP/s): weights "
            f"{r['bytes_ms']:.1f} ms, GEMM {r['gemm_ms']:.1f} ms a step; engine step "
            f"{step_ms:.1f} ms = {step_ms / r['gemm_ms']:.2f}x GEMM (prefill included); a decode step alone "
            f"(the {new_tokens}-token run less a {short}-token one) {decode_ms:.1f} ms = "
            f"{decode_ms / r['gemm_ms']:.2f}x GEMM"
        )
        rows, k, m = step_shape(actor, batch)
        print(
            f"  at torch's rate for the MLP up projection's shape ({rows} x {k} x {m} linear: "
            f"{r['linear_gflop_s']:.0f} GFLOP/s), the GEMM time is {r['linear_gemm_ms']:.1f} ms: "
            f"a decode step alone {decode_ms / r['linear_gemm_ms']:.2f}x; "
            f"the weights' read {r['bytes_ms']:.1f} ms, {decode_ms / r['bytes_ms']:.2f}x"
        )
        if profile:
            r |= {f"profile:{k}": v for k, v in profile_step(engines["engine"], prompts).items()}
        for engine in engines.values():
            engine.close()
        results[batch] = r
    return results


def actor_runner_of(engine: RolloutEngine) -> ModelRunner:
    """The engine's actor runner (its packed weights are shared with every engine of the same actor)."""
    return engine._loop.actor.runner


def actor_runners(actor: torch.nn.Module) -> list[ModelRunner]:
    """Every live runner of ``actor``."""
    import gc

    return [o for o in gc.get_objects() if isinstance(o, ModelRunner) and o.model is actor]


def actor_runner(engine: RolloutEngine) -> ModelRunner:
    """The engine's actor runner (the only live runner of the engine's actor)."""
    runners = actor_runners(engine.actor)
    if len(runners) != 1:
        raise RuntimeError(f"expected one actor runner, found {len(runners)}")
    return runners[0]


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--model", choices=["smollm2"], default=None, help="a bundled pretrained model")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="--model's dtype")
    p.add_argument("--profile", action="store_true", help="--model: torch.profiler over one engine step")
    p.add_argument(
        "--arms",
        nargs="*",
        choices=[
            "unpacked",
            "unfused",
            "unfused_silu",
            "onednn_small",
            "ungrouped",
            "unmodelled",
            "unlayered",
        ],
        default=["unpacked"],
        help="--model: the engine variants run beside the engine and HF",
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--metadata", action="store_true", help="also time the host metadata at B=256, ctx 4096")
    p.add_argument("--sampler", action="store_true", help="also time the sampler at B=16, V=151,936")
    p.add_argument("--host", action="store_true", help="only the step loop's host work per decode forward")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads, both sides")
    p.add_argument(
        "--graph",
        action="store_true",
        help="the engine with graph=True and with graph=False, beside HF (decode_graph_vs_eager=)",
    )
    p.add_argument(
        "--table", action="store_true", help="eager / graph / HF at B = 1, 16, 64, 256, two models"
    )
    p.add_argument(
        "--batches", type=int, nargs="+", default=list(TABLE_BATCHES), help="--table's, --model's batch sizes"
    )
    args = p.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.host:
        return {f"host_us_b{b}": bench_host(b, args.new_tokens) for b in (16, 64, 256)}
    if args.model == "smollm2":
        bench_smollm2(
            DTYPES[args.dtype],
            args.batches,
            prompt_len=args.prompt_len,
            new_tokens=args.new_tokens,
            repeats=args.repeats,
            profile=args.profile,
            arms=args.arms,
        )
        return {}
    if args.table:
        decode_table(
            device,
            prompt_len=args.prompt_len,
            new_tokens=args.new_tokens,
            repeats=args.repeats,
            batches=tuple(args.batches),
        )
        return {}
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    actor, _ = build_models(args.preset, dtype, device, seed=0)
    g = torch.Generator().manual_seed(0)
    vocab = actor.config.vocab_size
    prompts = [
        torch.randint(16, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.batch_size)
    ]
    # With --graph: the engine captured (graph=True) is "engine", and the same engine eager runs beside it.
    engines = {
        "engine": make_engine(actor, args.new_tokens, args.batch_size, graph=True if args.graph else "auto")
    }
    if args.graph:
        engines["eager"] = make_engine(actor, args.new_tokens, args.batch_size, graph=False)
    for engine in engines.values():
        run_engine(engine, prompts)  # warm-up (a graph's first step compiles or captures)
    run_hf(actor, prompts[:2], 4)
    times: dict[str, list[float]] = {name: [] for name in (*engines, "hf")}
    for _ in range(args.repeats):
        for name in times:
            if name == "hf":
                elapsed, tokens = run_hf(actor, prompts, args.new_tokens)
            else:
                elapsed, tokens = run_engine(engines[name], prompts)
            assert tokens == args.batch_size * args.new_tokens, (name, tokens)
            times[name].append(elapsed)
    if args.graph:
        captured = engines["engine"]._loop.actor.runner.captured
        assert captured.forwards > 0 and captured.fallback is None, captured.fallback
    tok = args.batch_size * args.new_tokens
    rates = {name: tok / statistics.median(ts) for name, ts in times.items()}
    print(
        f"preset={args.preset} device={device} B={args.batch_size} "
        f"prompt={args.prompt_len} new={args.new_tokens} threads={torch.get_num_threads()}"
    )
    for name, rate in rates.items():
        print(
            f"{name:>7}: {rate:10.1f} tok/s  "
            f"(median of {args.repeats}: {statistics.median(times[name]):.3f}s)"
        )
    for engine in engines.values():
        engine.close()
    ratio = rates["engine"] / rates["hf"]
    print(f"decode_throughput_engine_vs_hf={ratio:.2f}")
    result = {"engine_tok_s": rates["engine"], "hf_tok_s": rates["hf"], "ratio": ratio}
    if args.graph:
        result["graph_vs_eager"] = rates["engine"] / rates["eager"]
        print(f"decode_graph_vs_eager={result['graph_vs_eager']:.2f} (engine with graph=True vs graph=False)")
    if args.sampler:
        ms = bench_sampler.measure(16, 151_936, reps=10)
        print("sampler B=16 V=151936: " + ", ".join(f"{k} {v:.2f} ms" for k, v in ms.items()))
        result["sampler_vs_multinomial"] = ms["cpp"] / ms["multinomial"]
        print(f"sampler_cpp_vs_multinomial={result['sampler_vs_multinomial']:.3f}")
    if args.metadata:
        result |= bench_metadata(actor)
    return result


if __name__ == "__main__":
    main()
