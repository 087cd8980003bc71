"""Compile, once and on the thread that builds the engine, the Triton variants a model's forwards launch.

On CUDA the first streamed step used to compile them on two lanes at once (the actor's and the scorers'
thread, each hitting the same cold variants): a multi-second stall inside a timed step, paid twice over,
under one GIL. Warming up at build runs each model over scratch sequences through every launch shape the
engine uses -- prefill, decode-only and mixed forwards, each unsplit and (where ``max_model_len`` allows
contexts past one split) split-KV -- so the variants of every layer kind (sliding window, softcap) of
that model are compiled, and the actor's sampler too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from oppo_engine import ops
from oppo_engine.model.actor import ActorWorker
from oppo_engine.model.runner import ModelRunner, SeqChunk
from oppo_engine.model.sampler import SampleBatch

_SCRATCH = ("oppo-warm-up", 0), ("oppo-warm-up", 1)  # sequence ids no engine sequence uses
_TOKEN = 0


def warm_up(runner: ModelRunner, max_model_len: int, actor: ActorWorker | None = None) -> int:
    """Run ``runner``'s model over two scratch sequences so every launch shape is compiled; returns the
    number of forwards. With ``actor`` (the runner's worker), forwards sample too.

    NOTE: runs on the caller's current stream, before any lane uses the cache; the scratch pages are
    freed after a device sync (no lane event covers this stream), leaving the cache as it found it.
    """
    cache = runner.cache
    a, b = _SCRATCH
    # b ends one page short of max_model_len (a holds one page: both fit the model's reserve) and past
    # one split where the model length allows.
    b_len = min(max_model_len - cache.page_size, ops.KV_PER_SPLIT + 16)

    def step(pieces: Sequence[tuple[object, int]]) -> None:
        chunks = []
        for seq_id, n in pieces:
            slots = cache.append_slots(seq_id, n)
            if slots is None:
                raise RuntimeError(f"warm-up: the cache of {cache.name!r} cannot hold {n} scratch tokens")
            chunks.append(SeqChunk(seq_id, [_TOKEN] * n, slots))
        run(chunks)

    run: Callable[[list[SeqChunk]], object] = runner.forward
    if actor is not None:

        def run(chunks: list[SeqChunk]) -> object:
            n = len(chunks)
            positions = cache.token_counts([c.seq_id for c in chunks])
            return actor.forward(
                chunks, SampleBatch(list(range(n)), [1.0] * n, [0] * n, [1.0] * n, [0] * n, positions)
            )

    shapes = [[(a, 2)], [(a, 1)], [(a, 1), (b, 2)]]  # prefill, decode-only, mixed: one split
    if b_len - 2 > ops.KV_PER_SPLIT:
        # b past one split (a split-KV prefill), then decode-only and mixed forwards over its context.
        shapes += [[(b, b_len - 4)], [(a, 1), (b, 1)], [(b, 1), (a, 2)]]
    tokens = {seq: sum(n for step in shapes for s, n in step if s == seq) for seq in (a, b)}
    pages = sum(-(-n // cache.page_size) for n in tokens.values())
    if pages > cache.num_available_pages():  # an arena sized to the bone: one sequence's shapes only
        shapes = shapes[:2]
    try:
        for pieces in shapes:
            step(pieces)
    finally:
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
        saved, cache.free_event = cache.free_event, None
        try:
            cache.free(a)
            cache.free(b)
        finally:
            cache.free_event = saved
    return len(shapes)


def warm_up_models(actor: ActorWorker, scorers: Sequence[object], max_model_len: int) -> int:
    """:func:`warm_up` the actor (with sampling) and every scorer that runs a model; returns forwards run."""
    forwards = warm_up(actor.runner, max_model_len, actor)
    for scorer in scorers:
        runner = getattr(scorer, "runner", None)
        if isinstance(runner, ModelRunner):
            forwards += warm_up(runner, max_model_len)
    return forwards
