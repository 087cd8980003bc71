"""Captured decode: the actor's decode-only forwards (one new token per sequence) through a graph.

CPU: one ``torch.compile`` (inductor) graph per model, with the batch and block-table dimensions dynamic, so
every batch size from 2 up replays the same compiled code (a batch of one is padded to two). CUDA: a CUDA
graph per batch-size bucket (vLLM's capture sizes 1, 2, 4, 8, 16, 24, ...), captured on first use and
replayed on the caller's (the actor lane's) stream, over static input and metadata buffers filled in place.

Padding rows (up to the bucket) have slot ``-1``, which every cache op skips: they write no page at all,
and read one token of page 0 (a context of 1), whose result is dropped. Weights are read, never baked in:
inductor runs without freezing and reads the parameters at every call, and a CUDA graph reads them at the
addresses it captured, so in-place optimizer steps replay the same graphs; a parameter or buffer replaced by
a new tensor, or an arena rebuilt at a new address (``resume()``), drops the CUDA graphs and re-captures
them, counted in ``recompiles`` like an inductor recompilation.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import threading
import time
import types
import weakref
from collections.abc import Iterator, Sequence

import numpy as np
import torch
import torch._dynamo.config as _dynamo_config
import torch.fx.experimental._config as _fx_config

from oppo_engine.model.attention import AttentionMetadata, bound_metadata, paged_attention_enabled
from oppo_engine.model.cuda_graphs import CaptureFailed, CudaGraphs

# Each model's decode graph is compiled under its own code object (``_ModelGraph``), so its dynamo cache
# holds only its own entries. Hitting the limit must raise, never run eager silently (that is reported as a
# fallback instead).
_RECOMPILE_LIMIT = 64

_PER_GRAPH_LIMIT = "recompile_limit" in inspect.signature(torch.compile).parameters
_compiles = threading.local()  # graphs compiled by inductor on this thread (the backend runs in the caller's)


def graph_enabled(setting: bool | str, device: torch.device) -> bool:
    """``EngineConfig.graph`` resolved for ``device``. ``"auto"`` is fixed per device type, never measured:
    CUDA graphs on CUDA; eager on the CPU, where a model's first compile costs tens of seconds against a
    decode speed-up that pays back only over long runs (docs/captured-decode.md)."""
    if setting == "auto":
        return device.type == "cuda"
    return bool(setting)


def _inductor(gm: torch.fx.GraphModule, example_inputs: list) -> object:
    """Inductor, counting each graph it compiles on the calling thread."""
    from torch._inductor.compile_fx import compile_fx

    _compiles.n = getattr(_compiles, "n", 0) + 1
    return compile_fx(gm, example_inputs)


def _decode_logits(model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, keep: bool):
    """Logits ``[N, V]`` float32 of a decode forward ``[1, N]``; the metadata is bound by the caller."""
    kwargs = {"logits_to_keep": 0} if keep else {}
    return model(input_ids=input_ids, position_ids=positions, use_cache=False, **kwargs).logits[0].float()


def _guard_filter(entries: Sequence) -> list[bool]:
    """Dynamo's guards kept on a decode graph: the input tensors' and the bound metadata's (shapes, dtypes,
    dynamic dimensions, the metadata's constants), the shape relations and the global state. Dropped: the
    guards on the model's module tree (parameters, buffers, configs, flags) and on the globals of the
    modeling code (transformers' functions and registries): ~0.3 ms per forward of a small HF model on the
    CPU. ``_ModelGraph.check()``, once per step, stands in for the weights' guards."""
    return [
        not e.orig_guard.source.is_unspecialized_nn_module()
        and (not e.is_global or "_bound" in e.name or e.guard_type in ("GLOBAL_STATE", "SHAPE_ENV"))
        for e in entries
    ]


def _layout(model: torch.nn.Module) -> tuple:
    """What a compiled decode graph assumes of ``model``'s tensors: per parameter and buffer its name,
    shape, strides, dtype, device, and which tensor it aliases (tied weights are one input of the graph)."""
    first: dict[tuple, int] = {}
    out = []
    named = itertools.chain(
        model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)
    )
    for i, (name, t) in enumerate(named):
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride())
        out.append((name, t.shape, t.stride(), t.dtype, t.device, first.setdefault(key, i)))
    return tuple(out)


def _tensor_ids(model: torch.nn.Module) -> list[int]:
    return [id(t) for t in itertools.chain(model.parameters(), model.buffers())]


class _ModelGraph:
    """The compiled decode of one model, shared by every engine of the process on that model.

    Its own code object (a copy of ``_decode_logits``'), so no other model's graphs share its dynamo
    cache, and without dynamo's guards on the module tree (``_guard_filter``): ``check()``, once per step,
    stands in for them. The graph reads the weights through the module at every call (inductor runs without
    freezing), so a parameter updated in place, or replaced by a tensor of the same layout, needs nothing;
    a replacement that changes the layout (shape, dtype, a tie broken) drops the graph, which is compiled
    anew on the next forward. Not detected (eager would see them): hooks added to the model, config fields
    changed after the first compile, and the modeling code's globals patched.
    """

    _count = itertools.count()

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = weakref.ref(model)
        self._build(model)

    def _build(self, model: torch.nn.Module) -> None:
        code = _decode_logits.__code__
        code = code.replace(co_name=f"{code.co_name}_{next(self._count)}")
        fn = types.FunctionType(code, _decode_logits.__globals__, code.co_name)
        # torch.compile takes a per-graph recompile limit in recent releases (2.13; not the H200's 2.11):
        # where it does not, the process-wide dynamo setting stands in for it (set around every call, in
        # _compile_settings).
        limit = {"recompile_limit": _RECOMPILE_LIMIT} if _PER_GRAPH_LIMIT else {}
        self.fn = torch.compile(
            fn, backend=_inductor, dynamic=False, options={"guard_filter_fn": _guard_filter}, **limit
        )
        self.ids = _tensor_ids(model)
        self.layout = _layout(model)

    def check(self) -> None:
        """Rebuild if a parameter or buffer was replaced by one of another layout (a few us when none was)."""
        model = self.model()
        if model is None or _tensor_ids(model) == self.ids:
            return
        if _layout(model) == self.layout:
            self.ids = _tensor_ids(model)
        else:
            self._build(model)


_model_graphs: weakref.WeakKeyDictionary[torch.nn.Module, _ModelGraph] = weakref.WeakKeyDictionary()
_model_graphs_lock = threading.Lock()


def _model_graph(model: torch.nn.Module) -> _ModelGraph:
    with _model_graphs_lock:
        graph = _model_graphs.get(model)
        if graph is None:
            graph = _model_graphs[model] = _ModelGraph(model)
        return graph


class CapturedDecode:
    """The decode-only forwards of one ``ModelRunner`` (the actor's) through captured graphs.

    ``logits_last(chunks)`` equals the runner's eager ``logits_last`` (tokens exactly under greedy, logits
    to float rounding); a forward it cannot capture (on CUDA more sequences than the largest bucket, a model
    that cannot be compiled or captured) runs eager and says why in ``fallback``. Counters, cumulative:
    ``forwards`` (decode forwards that ran captured), ``recompiles`` (graphs compiled or captured,
    re-captures included), ``compile_s`` (seconds spent in them).
    """

    def __init__(self, runner, *, max_num_seqs: int, max_model_len: int) -> None:
        self.runner = runner
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.forwards = 0
        self.recompiles = 0
        self.compile_s = 0.0
        self.fallback: str | None = None
        self._step_start = (0, 0)
        self._broken: str | None = None  # why this model can never run captured (a failed compile)
        self._cuda = CudaGraphs(self, _decode_logits) if runner.device.type == "cuda" else None
        self._graph = _model_graph(runner.model) if self._cuda is None else None

    def start_step(self) -> None:
        """Mark the start of an engine step: ``step_metrics()`` counts from here."""
        self.fallback = None
        self._step_start = (self.forwards, self.recompiles)
        if self._graph is not None:
            self._graph.check()
        if self._cuda is not None:
            self._cuda.start_step()

    def arena_released(self, fixed_address: bool) -> None:
        """The arena was released (``release_memory()``). Without a fixed address (``cache/vmm.py``) the CUDA
        graphs are dropped now: their metadata views would keep its memory from the trainer, and it comes
        back elsewhere anyway."""
        if self._cuda is not None and not fixed_address:
            self._cuda.drop()

    def close(self) -> None:
        """Drop the CUDA graphs (their pool, static buffers and arena views) and unhook from the runner, so
        nothing of this engine's arena is held from here (the engine is closing)."""
        if self._cuda is not None:
            self._cuda.drop()
            self._cuda = None
        if self.runner.captured is self:
            self.runner.captured = None
        self._broken = "the engine is closed"

    def step_metrics(self) -> dict[str, object]:
        """``StepMetrics``' graph fields since ``start_step()``."""
        forwards, recompiles = self._step_start
        return {
            "graph_forwards": self.forwards - forwards,
            "graph_recompiles": self.recompiles - recompiles,
            "graph_fallback": self.fallback,
        }

    @staticmethod
    def accepts(chunks: Sequence) -> bool:
        """Whether ``chunks`` is a decode-only forward (one new token per sequence)."""
        return all(len(c.token_ids) == 1 for c in chunks)

    def logits_last(self, chunks: Sequence) -> torch.Tensor:
        """Next-token logits ``[N, V]`` float32 of the decode-only forward over ``chunks``."""
        return self._forward(chunks, None)[0]

    def logits_last_with(self, chunks: Sequence, extra: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """``logits_last``, and the host int64 array ``extra`` on the device (in the inputs' own copy)."""
        return self._forward(chunks, extra)

    def _forward(
        self, chunks: Sequence, extra: np.ndarray | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        reason = self._broken
        if reason is None and self._cuda is not None and len(chunks) > self._cuda.sizes[-1]:
            reason = f"{len(chunks)} sequences decode at once, more than the largest CUDA graph's rows"
        if reason is not None:
            return self._eager(chunks, extra, reason)
        try:
            with paged_attention_enabled(self.runner.model):
                if self._cuda is not None:
                    out = self._cuda.logits(chunks, extra)
                else:
                    out = self._compiled_logits(chunks), None if extra is None else torch.from_numpy(extra)
        except CaptureFailed as e:
            self._broken = str(e)
            return self._eager(chunks, extra, self._broken)
        except (torch._dynamo.exc.TorchDynamoException, torch._dynamo.exc.FailOnRecompileLimitHit) as e:
            self._broken = f"the decode graph cannot be compiled ({type(e).__name__}: {str(e)[:200]})"
            return self._eager(chunks, extra, self._broken)
        self.forwards += 1
        return out

    def _eager(self, chunks: Sequence, extra: np.ndarray | None, reason: str) -> tuple:
        """The forward through the eager module tree, ``reason`` reported as the step's fallback."""
        self.fallback = reason
        if extra is None:
            return self.runner.eager_logits_last(chunks), None
        return self.runner.eager_logits_last_with(chunks, extra)

    # -- CPU: inductor ---------------------------------------------------------------------------------

    def _compiled_logits(self, chunks: Sequence) -> torch.Tensor:
        n = len(chunks)
        rows = max(n, 2)  # sizes 0 and 1 are specialised by dynamo: pad one sequence to two
        # Each input its own contiguous tensor: a view's storage offset would be guarded on.
        ids, positions, slots, context_lens, tables = map(torch.from_numpy, self.decode_inputs(chunks, rows))
        meta = AttentionMetadata(
            kv_cache=self.runner.cache.kv_cache,
            slot_mapping=slots,
            block_tables=tables,
            context_lens=context_lens,
            cu_seqlens_q=torch.arange(rows + 1, dtype=torch.int32),
            max_q_len=1,
            max_context_len=self.max_model_len,  # a constant: the C++ op ignores it, and a graph guards on it
            backend=self.runner.backend,
        )
        # Only the batch, table and arena (pages) dimensions vary: every other size stays static (faster
        # code), and no size is unified with another that happens to be equal today (duck shapes would
        # recompile later). The pages vary between engines, so the engines of a process share one graph.
        torch._dynamo.maybe_mark_dynamic(meta.kv_cache, 0)
        for t, dims in ((ids, (1,)), (positions, (1,)), (slots, (0,)), (tables, (0, 1)), (context_lens, (0,)),
                        (meta.cu_seqlens_q, (0,))):  # fmt: skip
            for d in dims:
                torch._dynamo.maybe_mark_dynamic(t, d)
        before = getattr(_compiles, "n", 0)
        t0 = time.perf_counter()
        with _compile_settings(), bound_metadata(meta):
            logits = self._graph.fn(self.runner.model, ids, positions, self.runner.keeps_logits)
        compiled = getattr(_compiles, "n", 0) - before
        if compiled:
            self.recompiles += compiled
            self.compile_s += time.perf_counter() - t0
        return logits[:n]

    def decode_inputs(self, chunks: Sequence, rows: int, width: int | None = None) -> list[np.ndarray]:
        """Host arrays of a decode forward over ``chunks`` padded to ``rows``: ids ``[1, rows]``, positions
        ``[1, rows]``, slots ``[rows]`` (padding ``-1``), context lengths ``[rows]`` int32 (padding 1),
        block tables ``[rows, width]`` int32 (``width`` None: the fewest pages that hold the longest
        context, at least 2). Checked as the eager path checks them."""
        cache = self.runner.cache
        seq_ids = [c.seq_id for c in chunks]
        if len(set(seq_ids)) != len(chunks):
            raise ValueError("chunks: a sequence may appear only once per forward")
        context = cache.token_counts(seq_ids)
        if not all(len(c.slots) == 1 for c in chunks) or min(context) < 1:
            raise ValueError("chunks: a decode chunk needs one token with one slot, appended to the cache")
        pad = rows - len(chunks)
        if width is None:
            width = max(2, -(-max(context) // cache.page_size))
        tables = np.zeros((rows, width), dtype=np.int32)
        tables[: len(chunks)] = cache.block_table_rows(seq_ids, width)
        return [
            np.array([[c.token_ids[0] for c in chunks] + [0] * pad], dtype=np.int64),
            np.array([[x - 1 for x in context] + [0] * pad], dtype=np.int64),
            np.array([c.slots[0] for c in chunks] + [-1] * pad, dtype=np.int64),
            np.array(context + [1] * pad, dtype=np.int32),
            tables,
        ]


@contextlib.contextmanager
def _compile_settings() -> Iterator[None]:
    """Dynamo's settings for a (re)compilation of the decode graph, set around every call (a cache miss
    compiles inside it): no duck shapes, and a recompile limit that raises. Plain attribute writes
    (~5 us), not ``config.patch`` (~40-300 us per call); the per-graph limit is ``torch.compile``'s."""
    saved = (_dynamo_config.fail_on_recompile_limit_hit, _fx_config.use_duck_shape,
             _dynamo_config.recompile_limit)  # fmt: skip
    _dynamo_config.fail_on_recompile_limit_hit, _fx_config.use_duck_shape = True, False
    if not _PER_GRAPH_LIMIT:
        _dynamo_config.recompile_limit = max(saved[2], _RECOMPILE_LIMIT)
    try:
        yield
    finally:
        _dynamo_config.fail_on_recompile_limit_hit, _fx_config.use_duck_shape = saved[:2]
        _dynamo_config.recompile_limit = saved[2]
