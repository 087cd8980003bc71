"""Captured decode (EngineConfig.graph): with graphs on, rollouts equal the eager engine's -- tokens exactly,
log-probs to 1e-5 in fp32 -- over the model families, with groups, preemption, policy updates, released
memory and a change of thread count; padding rows write no page; a run settles into zero recompilations.

Compiling is the cost here (~10-30 s per model on a busy 2-core machine), so every test reuses the models of
one cache (``functools.cache``): dynamo keys its graphs on the model's structure, and each family compiles
once per process. CI runs six families; every family of ``families.py`` runs under the ``slow`` mark.
"""

from __future__ import annotations

import functools

import pytest
import torch
from families import EOS, ROUTED, build_actor, prompts

from oppo_engine import EngineConfig, RolloutEngine, SamplingParams
from oppo_engine.cache import KVArena, KVCacheManager, KVSpec
from oppo_engine.cache.vmm import FixedAddressBuffer
from oppo_engine.model.cuda_graphs import CudaGraphs, capture_sizes, graph_addresses
from oppo_engine.model.graph import CapturedDecode, graph_enabled
from oppo_engine.model.runner import ModelRunner, SeqChunk
from oppo_engine.model.sampler import SampleBatch, Sampler, unpack

CI_FAMILIES = ("llama", "qwen2", "gemma2", "stablelm", "gpt2", "mixtral")
LOGPROB_ATOL = 1e-5
LENGTHS = (2, 5, 8, 11, 13, 16, 3, 9)


@pytest.fixture(scope="module", autouse=True)
def one_intra_op_thread(request):
    """The llama graph every test below shares is compiled first, under two intra-op threads (so the
    streamed test replays it under another thread count); the tests then run on one thread, which these
    tiny matrices prefer on a busy machine (tests/test_model_families.py). Only the CPU tests read that
    graph: a ``-m cuda`` run (bench/device_check.sh) skips its compile, tens of seconds of a tight cap."""
    threads = torch.get_num_threads()
    selected = [item for item in request.session.items if item.module is request.module]
    if any("cuda" not in item.keywords for item in selected):
        torch.set_num_threads(2)
        engine = make_engine(actor_of("llama"), graph=True, batch_size=2, max_new=2)
        engine.add_prompts(prompts([3, 4]))
        drain(engine)
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@functools.cache
def actor_of(name: str) -> torch.nn.Module:
    return build_actor(name)


def rule_reward(prompt, response) -> float:
    return float(len(response))


def make_engine(actor, *, graph, batch_size=8, mode="sequential", temperature=0.7, n=1, max_new=10, **cfg):
    cfg.setdefault("max_model_len", 128)
    cfg.setdefault("page_size", 8)
    return RolloutEngine(
        actor=actor,
        reward=rule_reward,
        config=EngineConfig(batch_size=batch_size, mode=mode, graph=graph, **cfg),
        sampling=SamplingParams(temperature=temperature, max_new_tokens=max_new, seed=7, n=n),
        eos_token_id=EOS,
    )


def drain(engine: RolloutEngine) -> tuple[list, list]:
    """Every rollout until the prompts run out, and every step's metrics."""
    rollouts, metrics = [], []
    while True:
        result = engine.step()
        if not result.rollouts:
            return rollouts, metrics
        rollouts += result.rollouts
        metrics.append(result.metrics)


PREEMPTIONS: dict[bool, int] = {}  # graph -> actor preemptions of the last run_both's engine


def run_both(actor, batch, **kw) -> tuple[list, list, list]:
    """The same prompts through an eager and a captured engine: (eager rollouts, graph rollouts, graph
    metrics)."""
    out = []
    for graph in (False, True):
        engine = make_engine(actor, graph=graph, **kw)
        engine.add_prompts(batch)
        out.append(drain(engine))
        PREEMPTIONS[graph] = engine._loop.actor_sched.num_preemptions
        engine.close()
    (eager, _), (captured, metrics) = out
    return eager, captured, metrics


def assert_same_rollouts(eager, captured) -> None:
    key = lambda r: (r.prompt_ids, r.sample_index)  # noqa: E731
    eager, captured = sorted(eager, key=key), sorted(captured, key=key)
    assert [key(r) for r in captured] == [key(r) for r in eager]
    for e, c in zip(eager, captured, strict=True):
        assert c.response_ids == e.response_ids
        torch.testing.assert_close(
            torch.tensor(c.logprobs), torch.tensor(e.logprobs), atol=LOGPROB_ATOL, rtol=0
        )


def assert_ran_captured(metrics) -> None:
    assert sum(m.graph_forwards for m in metrics) > 0
    assert all(m.graph_fallback is None for m in metrics)


def drain_beside_eager(engine: RolloutEngine, actor, batch) -> list:
    """Drain ``engine`` and a fresh eager engine on ``actor`` (batch 4, greedy) over ``batch``: the rollouts
    are the same, and ``engine`` ran captured; its step metrics."""
    eager = make_engine(actor, graph=False, batch_size=4, temperature=0.0)
    for e in (engine, eager):
        e.add_prompts(batch)
    captured, metrics = drain(engine)
    assert_same_rollouts(drain(eager)[0], captured)
    assert_ran_captured(metrics)
    eager.close()
    return metrics


@pytest.mark.parametrize(
    "name",
    [n if n in CI_FAMILIES else pytest.param(n, marks=pytest.mark.slow) for n in ROUTED],
)
def test_captured_decode_equals_eager(name):
    """One mixed batch of prompts ending mid-page and on a page boundary, sampled (every token depends on
    every logit through the Gumbel-max draw; greedy rollouts are compared in the tests below too)."""
    eager, captured, metrics = run_both(actor_of(name), prompts(LENGTHS))
    assert_same_rollouts(eager, captured)
    assert_ran_captured(metrics)


def test_captured_decode_equals_eager_with_groups_and_preemption():
    """n=2 samples share their prompt's pages; a cache too small for the batch preempts sequences in the
    middle of the decode batch, so the batch size changes from one forward to the next."""
    actor = actor_of("llama")
    page_bytes = make_engine(actor, graph=False).cache_stats().page_bytes
    eager, captured, metrics = run_both(
        actor, prompts(LENGTHS[:4]), n=2, max_new=24, temperature=0.0, kv_cache_bytes=24 * page_bytes,
        max_model_len=64,
    )  # fmt: skip
    assert PREEMPTIONS[True] > 0  # the scenario really preempted, with graphs on
    assert_same_rollouts(eager, captured)
    assert_ran_captured(metrics)


def test_graph_compiled_under_two_threads_stays_exact_in_a_streamed_step():
    """The llama graph was compiled under two intra-op threads (module fixture); a streamed step runs each
    lane on one thread, from the engine's own two."""
    actor = actor_of("llama")
    torch.set_num_threads(2)
    try:
        eager, captured, metrics = run_both(actor, prompts(LENGTHS), mode="intra", chunk_size=4)
    finally:
        torch.set_num_threads(1)
    assert_same_rollouts(eager, captured)
    assert_ran_captured(metrics)


def _ppo_run(
    actor, *, graph: bool, steps: int, release: bool, lengths=(3, 5, 7, 9, 11, 13, 2, 4), **cfg
) -> tuple[list, list]:
    """An inter-mode PPO loop: each step an in-place optimizer-like update of every weight, then
    update_policy (deferred sequences recompute), optionally releasing the cache for the update."""
    engine = make_engine(
        actor, graph=graph, mode="inter", overcommit=2, max_new=12, retained_kv="recompute", **cfg
    )
    engine.add_prompts(prompts(list(lengths) * 3, seed=5))
    saved = {k: v.clone() for k, v in actor.state_dict().items()}
    rollouts, metrics = [], []
    try:
        for step in range(steps):
            result = engine.step()
            rollouts += result.rollouts
            metrics.append(result.metrics)
            if release:
                engine.release_memory()
            with torch.no_grad():
                for i, p in enumerate(actor.parameters()):
                    p.mul_(1.0 + 0.01 * ((step + i) % 3 - 1))
            engine.update_policy()
            if release:
                engine.resume()
    finally:
        actor.load_state_dict(saved)
        engine.close()
    return rollouts, metrics


def test_ppo_run_releasing_memory_every_step_is_exact_and_settles_into_zero_recompiles():
    actor = actor_of("llama")
    eager, _ = _ppo_run(actor, graph=False, steps=4, release=True)
    captured, metrics = _ppo_run(actor, graph=True, steps=4, release=True)
    assert_same_rollouts(eager, captured)
    assert_ran_captured(metrics)
    assert [m.graph_recompiles for m in metrics[1:]] == [0] * (len(metrics) - 1)


def test_engines_of_one_process_share_the_compiled_graph():
    """Engines of other batch sizes (other arena sizes) on a model compiled before compile nothing."""
    actor = actor_of("llama")
    for batch_size in (8, 2, 16):
        engine = make_engine(actor, graph=True, batch_size=batch_size)
        engine.add_prompts(prompts(LENGTHS))
        _, metrics = drain(engine)
        engine.close()
        assert_ran_captured(metrics)
        if batch_size != 8:  # the first may be the process's first llama engine
            assert [m.graph_recompiles for m in metrics] == [0] * len(metrics)


def test_close_frees_the_arena_at_once_with_graphs_on():
    """``close()`` gives the arena back before it returns, with no garbage collection: with graphs on, the
    captured decode's runner (and on CUDA its buckets' views) held it until a cycle collection."""
    import gc
    import weakref

    engine = make_engine(actor_of("llama"), graph=True, batch_size=4)
    engine.add_prompts(prompts(LENGTHS[:4]))
    assert engine.step().metrics.graph_forwards > 0
    arena = weakref.ref(engine._arena)
    buffer = weakref.ref(engine._arena.buffer)
    gc.disable()
    try:
        engine.close()
        assert buffer() is None and (arena() is None or arena().released)
    finally:
        gc.enable()
    engine.close()  # idempotent


def test_replaced_parameter_is_read_not_baked():
    """A parameter replaced by a new tensor object (not updated in place) is what the next step reads."""
    _replace_the_head_between_steps(build_actor("llama"))  # its own copy: the weights change


def _replace_the_head_between_steps(actor) -> list:
    """One captured step, then ``lm_head.weight`` replaced by a new Parameter: the next steps equal an eager
    engine's over the new weights. Returns the captured engine's metrics of those steps."""
    batch = prompts(LENGTHS[:4])
    engine = make_engine(actor, graph=True, batch_size=4, temperature=0.0)
    engine.add_prompts(batch)
    engine.step()
    with torch.no_grad():
        actor.lm_head.weight = torch.nn.Parameter(torch.randn_like(actor.lm_head.weight))
    return drain_beside_eager(engine, actor, batch)


def test_broken_weight_tie_recompiles_the_graph():
    """GPT-2's LM head is its token embedding: the graph compiled over the tie takes them as one input. A
    head replaced by its own tensor changes the layout the graph assumes (dynamo's guards on the module
    tree are dropped: the engine's per-step check stands in), so the next step compiles a new graph."""
    actor = build_actor("gpt2")  # its own copy: the weights change
    assert actor.lm_head.weight is actor.get_input_embeddings().weight
    metrics = _replace_the_head_between_steps(actor)
    assert metrics[0].graph_recompiles > 0


def test_padding_rows_write_no_page():
    """One sequence decodes in a graph padded to two rows: the only bytes of the arena that change are the
    new token's K/V, in every layer; the logits equal the eager forward's."""
    actor = actor_of("llama")
    spec = KVSpec.from_hf_config(actor.config, torch.float32)
    arena = KVArena({"actor": spec}, page_size=8, num_pages=8, device="cpu")
    arena.buffer.copy_(torch.randint(0, 256, arena.buffer.shape, dtype=torch.uint8))  # no zeros to hide in
    cache = KVCacheManager(arena, "actor")
    runner = ModelRunner(actor, cache)
    runner.captured = CapturedDecode(runner, max_num_seqs=4, max_model_len=64)
    prompt = prompts([5])[0]
    runner.logits_last([SeqChunk(0, prompt, cache.append_slots(0, len(prompt)))])  # prefill: eager
    (slot,) = cache.append_slots(0, 1)
    chunk = SeqChunk(0, [11], [slot])
    before = arena.buffer.clone()
    logits = runner.logits_last([chunk])
    assert runner.captured.forwards == 1
    changed = (arena.buffer != before).nonzero().squeeze(1)
    view = cache.kv_cache  # [pages, L, 2, page_size, H, D]
    token = view[slot // 8, :, :, slot % 8]  # [L, 2, H, D]: the new token's K/V in every layer
    offset = (token.storage_offset() - view.storage_offset()) * 4
    allowed = set()
    for idx in torch.cartesian_prod(*(torch.arange(n) for n in token.shape[:-1])).tolist():
        start = offset + 4 * sum(i * s for i, s in zip(idx, token.stride()[:-1], strict=True))
        allowed.update(range(start, start + 4 * token.shape[-1]))
    assert set(changed.tolist()) <= allowed
    assert len(changed) > 0
    torch.testing.assert_close(logits, runner.eager_logits_last([chunk]), atol=LOGPROB_ATOL, rtol=0)


def test_graph_setting_is_checked_and_auto_is_fixed_per_device():
    with pytest.raises(ValueError, match="graph"):
        EngineConfig(graph="yes")
    assert graph_enabled("auto", torch.device("cuda")) and not graph_enabled("auto", torch.device("cpu"))
    assert graph_enabled(True, torch.device("cpu")) and not graph_enabled(False, torch.device("cuda"))
    engine = make_engine(actor_of("llama"), graph="auto")
    assert engine._loop.actor.runner.captured is None  # the CPU default: eager (docs/captured-decode.md)
    engine.close()


def test_capture_sizes_cover_every_batch_up_to_the_most_in_flight():
    assert capture_sizes(1) == [1]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 24]
    assert capture_sizes(72) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 72]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_equal_eager_and_replay_across_release_memory_every_step(monkeypatch):
    """CUDA graphs per bucket: exact against eager (fp32); over a PPO run that releases memory every step
    the arena comes back at its address and in-place updates keep the weights' (``cache/vmm.py``), so each
    bucket is captured once, on its first use, and replayed from then on: the rollouts equal eager's."""
    actor = build_actor("llama").cuda()
    eager, captured, metrics = run_both(actor, prompts(LENGTHS), temperature=0.7)
    assert_same_rollouts(eager, captured)
    assert_ran_captured(metrics)
    captures = []
    real_capture = CudaGraphs._capture

    def recording(self, rows):
        captures.append(rows)
        return real_capture(self, rows)

    monkeypatch.setattr(CudaGraphs, "_capture", recording)
    eager, _ = _ppo_run(actor, graph=False, steps=4, release=True)
    assert captures == []
    captured, metrics = _ppo_run(actor, graph=True, steps=4, release=True)
    assert_same_rollouts(eager, captured)
    assert all(m.graph_forwards > 0 for m in metrics if m.tokens_generated)  # (the last step may have none)
    assert captures and len(captures) == len(set(captures)), captures  # no bucket captured twice
    assert sum(m.graph_recompiles for m in metrics) == len(captures)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_without_a_fixed_address_let_release_memory_free_the_arena(monkeypatch):
    """Where the driver offers no VMM the arena is a plain ``torch.empty``: ``release_memory()`` must still
    give its memory back (the buckets' metadata views of it go with their graphs), and after ``resume()``
    the buckets are captured anew at the new address, exact against eager."""
    from oppo_engine.cache import vmm

    monkeypatch.setattr(vmm.FixedAddressBuffer, "create", classmethod(lambda cls, device, nbytes: None))
    actor = build_actor("llama").cuda()
    batch = prompts(LENGTHS[:4])
    engine = make_engine(actor, graph=True, batch_size=4, temperature=0.0)
    arena = engine._arena
    assert not arena.fixed_address
    engine.add_prompts(batch)
    assert engine.step().metrics.graph_forwards > 0
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    engine.release_memory()
    assert not engine._captured._cuda.buckets
    assert before - torch.cuda.memory_allocated() >= arena.num_pages * arena.page_bytes
    engine.resume()
    metrics = drain_beside_eager(engine, actor, batch)
    assert metrics[0].graph_recompiles > 0
    engine.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_close_gives_the_arena_and_the_graphs_memory_back_at_once():
    """A 2 GiB arena and the buckets' memory go back at ``close()``, with no garbage collection: a VMM
    arena is unmapped, a plain one freed (torch's allocated bytes drop by at least its size), and the
    buckets, their pool and their scratch are gone. Read in this process only (other test processes may
    share the GPU)."""
    import gc
    import weakref

    actor = build_actor("llama").cuda()
    engine = make_engine(actor, graph=True, batch_size=4, temperature=0.0, kv_cache_bytes=2 << 30)
    engine.add_prompts(prompts(LENGTHS[:4]))
    assert engine.step().metrics.graph_forwards > 0
    arena, graphs = engine._arena, engine._captured._cuda
    fixed, buffer = arena._fixed, weakref.ref(arena.buffer)
    assert graphs.buckets and graphs.pool is not None
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    gc.disable()
    try:
        engine.close()
        torch.cuda.synchronize()
        assert buffer() is None
        assert not graphs.buckets and graphs.pool is None and graphs._scratch is None
        if fixed is not None:
            assert not fixed.mapped  # the physical memory went back to the driver
        else:
            assert allocated - torch.cuda.memory_allocated() >= 2 << 30
    finally:
        gc.enable()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_past_one_kv_split_stay_exact_while_another_thread_calls_cuda():
    """Contexts past one KV split (512 keys): a bucket's split-KV scratch is allocated outside its capture
    and must live as long as its graph (freed, then returned to the device by ``release_memory()``'s
    ``empty_cache``, a replay writes memory that is no longer its own). Meanwhile another thread allocates,
    queries events and syncs, as the scorer lane does beside a first-use capture: neither that thread nor
    the capture may fail (a "global" capture forbids those calls in every thread)."""
    import threading

    actor = build_actor("llama", max_position_embeddings=1024).cuda()
    run = functools.partial(
        _ppo_run, actor, steps=3, release=True, lengths=(530, 7, 515, 600), max_model_len=640, batch_size=4
    )
    eager, _ = run(graph=False)
    stop, errors = threading.Event(), []

    def beside() -> None:
        try:
            with torch.cuda.stream(torch.cuda.Stream()):
                while not stop.is_set():
                    x = torch.ones(1 << 16, device="cuda")
                    event = torch.cuda.Event()
                    event.record()
                    event.query()
                    float(x.sum())  # a host sync
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    thread = threading.Thread(target=beside, daemon=True)
    thread.start()
    try:
        captured, metrics = run(graph=True)
    finally:
        stop.set()
        thread.join(timeout=30)
    assert errors == []
    assert_same_rollouts(eager, captured)
    assert_ran_captured(metrics)


def test_weights_refilled_in_place_of_a_released_replica_are_read_without_recompiling():
    """A rollout replica's ``release_memory(weights=True)`` frees every parameter's storage and refills the
    same Parameter objects later (branch fsdp's replicas): the CPU graph reads them at call time, so the
    next step equals an eager engine's over the refilled (changed) weights and compiles nothing."""
    actor = build_actor("llama")  # its own copy: the weights change
    batch = prompts(LENGTHS[:4])
    engine = make_engine(actor, graph=True, batch_size=4, temperature=0.0)
    engine.add_prompts(batch)
    engine.step()
    with torch.no_grad():
        for p in actor.parameters():
            refill = p.detach() * 1.01
            p.untyped_storage().resize_(0)  # released: the replica holds no memory
            p.untyped_storage().resize_(refill.numel() * refill.element_size())
            p.copy_(refill)
    metrics = drain_beside_eager(engine, actor, batch)
    assert [m.graph_recompiles for m in metrics] == [0] * len(metrics)


def test_graph_addresses_follow_a_refilled_weight_not_an_in_place_update():
    """What the CUDA-graph path compares once per step (``graph_addresses``): an in-place update keeps every
    address (the graphs replay), a parameter whose storage was freed and refilled elsewhere does not (its
    graphs are dropped and re-captured)."""
    actor = build_actor("llama")
    kv = torch.empty(16)
    before = graph_addresses(kv, actor)
    weight = actor.lm_head.weight
    with torch.no_grad():
        weight.mul_(1.5)
        assert graph_addresses(kv, actor) == before
        refill = weight.detach().clone()  # allocated while the old storage lives: another address, always
        moved_from = weight.data_ptr()
        weight.untyped_storage().resize_(0)  # freed, as FSDP2 frees an unsharded parameter
        weight.data = refill  # the same Parameter object, refilled elsewhere
    assert weight.data_ptr() != moved_from
    after = graph_addresses(kv, actor)
    assert len(after) == len(before)
    assert [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if a != b] == [
        1 + [id(p) for p in actor.parameters()].index(id(weight))
    ]  # only the refilled weight's entry (after the KV view's) moved


def test_without_a_per_graph_recompile_limit_the_dynamo_setting_stands_in(monkeypatch):
    """torch 2.11 (the H200's) has no ``torch.compile(recompile_limit=)``: the graph is built without it, and
    the process-wide limit is raised to the graph's around each call, then restored."""
    import torch._dynamo.config as dynamo_config

    from oppo_engine.model import graph as graph_module

    monkeypatch.setattr(graph_module, "_PER_GRAPH_LIMIT", False)
    seen = {}
    real_compile = torch.compile

    def compile_without_the_keyword(fn, *, recompile_limit=None, **kwargs):
        seen["recompile_limit"] = recompile_limit
        return real_compile(fn, **kwargs)

    monkeypatch.setattr(torch, "compile", compile_without_the_keyword)
    graph_module._ModelGraph(build_actor("llama"))
    assert seen == {"recompile_limit": None}
    # NOTE: torch's own patch, not monkeypatch: the config module serves its settings from __getattr__, so
    # monkeypatch's undo deletes the setting, which hides it for the rest of the process.
    before = dynamo_config.recompile_limit
    with dynamo_config.patch(recompile_limit=8):
        with graph_module._compile_settings():
            assert dynamo_config.recompile_limit == graph_module._RECOMPILE_LIMIT
        assert dynamo_config.recompile_limit == 8
    assert dynamo_config.recompile_limit == before  # still readable: later graphs compile


def test_sample_batch_packs_every_parameter_exactly():
    """The sampler's columns travel as one int64 array: each comes back bit for bit (seeds up to 2**63 - 1,
    fp32 temperatures and top-p), and a row's draw equals the list API's."""
    batch = SampleBatch(
        rows=[0, 2, 3],
        temperatures=[0.0, 0.7, 1.3],
        top_ks=[0, 5, 0],
        top_ps=[1.0, 0.9, 0.35],
        seeds=[2**63 - 1, 7, 123456789012],
        positions=[0, 17, 4095],
    )
    rows, seeds, positions, top_k, temperature, top_p = unpack(torch.from_numpy(batch.packed()), 3)
    assert rows.tolist() == batch.rows and seeds.tolist() == batch.seeds
    assert positions.tolist() == batch.positions and top_k.tolist() == batch.top_ks
    assert torch.equal(temperature, torch.tensor(batch.temperatures, dtype=torch.float32))
    assert torch.equal(top_p, torch.tensor(batch.top_ps, dtype=torch.float32))
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(3)) * 3
    packed = torch.from_numpy(batch.packed())
    got = Sampler().sample(logits, batch, packed)
    want = Sampler()(
        logits, temperatures=batch.temperatures, top_ks=batch.top_ks, top_ps=batch.top_ps, seeds=batch.seeds,
        positions=batch.positions,
    )  # fmt: skip
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_driver_that_reserves_but_will_not_map_falls_back_to_plain_memory(monkeypatch):
    """A driver (or a sandbox in front of it) that reserves an address range but refuses ``cuMemMap`` (801:
    not supported) gives a plain ``torch.empty`` arena, as one without VMM does: the engine still builds."""
    from oppo_engine.cache import vmm

    real = vmm._driver()
    if real is None:
        pytest.skip("no libcuda")

    class Refusing:
        def __getattr__(self, name):
            return getattr(real, name)

        def cuMemMap(self, *args):
            return 801

    monkeypatch.setattr(vmm, "_driver", lambda: Refusing())
    assert FixedAddressBuffer.create(torch.device("cuda"), 1 << 20) is None
    spec = KVSpec.from_hf_config(actor_of("llama").config, torch.float32)
    arena = KVArena({"actor": spec}, page_size=8, num_pages=4, device="cuda")
    assert not arena.fixed_address and arena.buffer.numel() == 4 * arena.page_bytes


def test_arena_on_the_cpu_is_plain_memory():
    """Fixed addresses are a CUDA matter (cache/vmm.py): the CPU arena is a torch.empty buffer."""
    assert FixedAddressBuffer.create(torch.device("cpu"), 1 << 20) is None
    spec = KVSpec.from_hf_config(actor_of("llama").config, torch.float32)
    arena = KVArena({"actor": spec}, page_size=8, num_pages=4, device="cpu")
    arena.release()
    arena.rebuild()
    assert arena.buffer.numel() == 4 * arena.page_bytes


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_arena_keeps_its_address_across_release_and_rebuild():
    spec = KVSpec.from_hf_config(actor_of("llama").config, torch.float32)
    arena = KVArena({"actor": spec}, page_size=8, num_pages=64, device="cuda")
    assert arena._fixed is not None, "the driver offers no VMM: every resume() re-captures the graphs"
    before = arena.buffer.data_ptr()
    arena.buffer.fill_(7)
    arena.release()
    assert not arena._fixed.mapped  # the memory went back to the driver (cuMemUnmap, cuMemRelease)
    arena.rebuild()
    assert arena.buffer.data_ptr() == before
    arena.buffer.fill_(3)  # the remapped range is writable
    torch.cuda.synchronize()
    assert int(arena.buffer[-1]) == 3


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_recapture_after_a_weight_moves():
    """A parameter refilled at another address (a replica after ``release_memory(weights=True)``): the next
    step re-captures the buckets it uses (counted) and equals an eager engine over the same weights."""
    actor = build_actor("llama").cuda()
    batch = prompts(LENGTHS[:4])
    engine = make_engine(actor, graph=True, batch_size=4, temperature=0.0)
    engine.add_prompts(batch)
    engine.step()
    captured_decode = engine._loop.actor.runner.captured
    with torch.no_grad():
        for p in actor.parameters():
            p.data = p.data * 1.01  # same Parameter, new storage at a new address
    eager = make_engine(actor, graph=False, batch_size=4, temperature=0.0)
    for e in (engine, eager):
        e.add_prompts(batch)
    t0 = captured_decode.compile_s
    captured, metrics = drain(engine)
    assert_same_rollouts(drain(eager)[0], captured)
    assert metrics[0].graph_recompiles > 0
    print(f"re-capture after a weight moved: {metrics[0].graph_recompiles} buckets, "
          f"{captured_decode.compile_s - t0:.3f} s")  # fmt: skip


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_capture_that_fails_on_a_host_sync_runs_eager_and_leaves_the_allocator_usable():
    """A decode forward that syncs with the host (here a hook calling ``.item()``; in the wild a rope
    variant's ``if`` on a CUDA tensor, an eager MoE's ``nonzero()``) cannot be captured: the step runs eager,
    exact, and says why; torch's allocator is left as it was, so ``empty_cache()`` (every
    ``release_memory()``) and another engine's capture still work."""
    actor = build_actor("llama").cuda()

    def host_sync(module, args, out):
        (out[0] if isinstance(out, tuple) else out).sum().item()  # returns None: the output stays

    hook = actor.model.layers[0].register_forward_hook(host_sync)
    batch = prompts(LENGTHS[:4])
    engine = make_engine(actor, graph=True, batch_size=4, temperature=0.0)
    eager = make_engine(actor, graph=False, batch_size=4, temperature=0.0)
    for e in (engine, eager):
        e.add_prompts(batch)
    captured, metrics = drain(engine)
    assert_same_rollouts(drain(eager)[0], captured)
    assert all(m.graph_forwards == 0 for m in metrics)
    assert "cannot be captured" in metrics[0].graph_fallback
    torch.cuda.empty_cache()
    engine.release_memory()
    engine.resume()
    engine.close()
    hook.remove()
    other = make_engine(actor, graph=True, batch_size=4, temperature=0.0)
    other.add_prompts(batch)
    again, metrics = drain(other)
    assert_same_rollouts(captured, again)
    assert_ran_captured(metrics)
    other.close()
