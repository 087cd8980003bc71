"""Packed varlen forward of an unmodified HF decoder through the paged KV cache."""

from __future__ import annotations

import contextlib
import inspect
import itertools
import operator
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from oppo_engine import ops
from oppo_engine.cache.arena import KVSpec
from oppo_engine.cache.manager import KVCacheManager
from oppo_engine.model import fused
from oppo_engine.model.attention import AttentionMetadata, bound_metadata, paged_attention_enabled
from oppo_engine.model.graph import CapturedDecode
from oppo_engine.model.packed import PackedLinears
from oppo_engine.model.support import text_config


@dataclass(slots=True)
class SeqChunk:
    """New tokens of one sequence for one forward.

    ``slots`` come from ``KVCacheManager.append_slots`` (already called), so the tokens sit at positions
    ``[cache.num_tokens(seq_id) - len(token_ids), cache.num_tokens(seq_id))``.
    """

    seq_id: Hashable
    token_ids: Sequence[int]
    slots: Sequence[int]


class ModelRunner:
    """Runs ``model`` (``AutoModelForCausalLM`` or a one-label ``AutoModelForSequenceClassification``) on
    packed chunks of several sequences, writing their K/V into ``cache`` and attending over it.

    Logits come from the model's own forward (``logits_to_keep`` selects the rows), so its head and every
    post-processing step (Granite's ``logits_scaling``, Cohere's ``logit_scale``, Gemma2's final softcap)
    apply exactly as in HF; scores come from the reward model's score head on the base model's final hidden
    states (HF's sequence classifiers do nothing else). A PEFT wrapper is unwrapped to the HF model it
    injected its adapters into.

    The model, ``cache.kv_cache`` and every output live on the model's device; the cache's dtype must be
    the model's (checked here). Every call is one forward over ``input_ids [1, T]`` under
    ``torch.inference_mode()`` with the model's attention switched to the paged one for its duration, so
    outputs are inference tensors. Kernels and copies run on the caller's current stream. The scheduler
    has already reserved the slots: the runner never allocates or frees pages.
    """

    def __init__(self, model: nn.Module, cache: KVCacheManager, *, backend: str = "triton") -> None:
        model = unwrap_model(model)
        self.model = model
        self.cache = cache
        self.backend = backend
        self.base = getattr(model, model.base_model_prefix, model)
        self.lm_head: nn.Module | None = model.get_output_embeddings()
        self.score_head: nn.Module | None = None
        if self.lm_head is None:
            self.score_head = _score_head(model, cache.name)
        # Causal LMs without `logits_to_keep` compute logits for every row, then the wanted rows are kept.
        self.keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.device = model.device
        self.num_q_heads = text_config(model).num_attention_heads
        # Decode-only forwards through captured graphs (the actor's, when EngineConfig.graph is on).
        self.captured: CapturedDecode | None = None
        # The weights packed for the CPU's GEMMs (the actor's, when EngineConfig.packed_weights is on).
        self.packed: PackedLinears | None = None
        # Exact fused replacements of the model's small-op modules (its RMSNorms) for the CPU's forwards.
        self.fused: fused.FusedModules | None = fused.for_model(model) if self.device.type == "cpu" else None
        _check_cache(model, cache)
        with paged_attention_enabled(model):  # validates the switch now rather than at the first forward
            pass

    # -- outputs ---------------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, chunks: Sequence[SeqChunk]) -> torch.Tensor:
        """Final-normed hidden states ``[T, hidden]`` of every new token, packed in chunk order."""
        batch = self._prepare(chunks)
        return self._base_forward(batch)

    @torch.inference_mode()
    def hidden_last(self, chunks: Sequence[SeqChunk]) -> torch.Tensor:
        """Hidden state ``[N, hidden]`` of each chunk's last token."""
        batch = self._prepare(chunks)
        return self._base_forward(batch).index_select(0, batch.last)

    @torch.inference_mode()
    def logits_last(self, chunks: Sequence[SeqChunk]) -> torch.Tensor:
        """Next-token logits ``[N, V]`` float32 after each chunk's last token; a decode-only forward runs
        through ``captured`` where it is set."""
        if self.captured is not None and self.captured.accepts(chunks):
            return self.captured.logits_last(chunks)
        return self.eager_logits_last(chunks)

    @torch.inference_mode()
    def logits_last_with(
        self, chunks: Sequence[SeqChunk], extra: np.ndarray, *, float32: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``logits_last``, and ``extra`` (a host int64 array: the sampler's parameters) on the device, where
        it travels in the forward's own metadata copy rather than in one of its own. ``float32=False``
        leaves eager logits in the model's dtype (a captured graph's are float32 either way): the sampler
        widens bf16 exactly itself, and the ``[N, V]`` float32 copy of a 49,152-token vocabulary costs
        0.2 ms at N=16 and 0.7 ms at N=64 (one thread)."""
        if self.captured is not None and self.captured.accepts(chunks):
            return self.captured.logits_last_with(chunks, extra)
        return self.eager_logits_last_with(chunks, extra, float32=float32)

    @torch.inference_mode()
    def eager_logits_last(self, chunks: Sequence[SeqChunk]) -> torch.Tensor:
        """``logits_last`` through the eager module tree."""
        batch = self._prepare(chunks)
        return self._logits(batch, batch.last)

    @torch.inference_mode()
    def eager_logits_last_with(
        self, chunks: Sequence[SeqChunk], extra: np.ndarray, *, float32: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``logits_last_with`` through the eager module tree."""
        batch = self._prepare(chunks, extra)
        return self._logits(batch, batch.last, float32=float32), batch.extra

    @torch.inference_mode()
    def logits_at(
        self, chunks: Sequence[SeqChunk], rows: Sequence[int], *, float32: bool = True
    ) -> torch.Tensor:
        """Logits ``[len(rows), V]`` after the tokens at packed ``rows`` of the forward: float32, or the
        model's own dtype with ``float32=False`` (no float32 copy of a large block)."""
        batch = self._prepare(chunks)
        picked = torch.as_tensor(rows, dtype=torch.int64).to(self.device)
        return self._logits(batch, picked, float32=float32)

    @torch.inference_mode()
    def logits_all(self, chunks: Sequence[SeqChunk]) -> torch.Tensor:
        """Logits ``[T, V]`` float32 after every new token (prefill log-probs, tests)."""
        return self._logits(self._prepare(chunks), None)

    @torch.inference_mode()
    def score_at(self, chunks: Sequence[SeqChunk], rows: Sequence[int]) -> torch.Tensor:
        """Score-head outputs ``[len(rows)]`` float32 at packed ``rows`` of the forward over ``chunks``."""
        if self.score_head is None:
            raise ValueError(
                f"{self.cache.name}: {type(self.model).__name__} is a language model, it has no score head"
            )
        batch = self._prepare(chunks)
        hidden = self._base_forward(batch)
        picked = hidden.index_select(0, torch.as_tensor(rows, dtype=torch.int64).to(hidden.device))
        return self.score_head(picked).float()[:, 0]

    @torch.inference_mode()
    def score_last(self, chunks: Sequence[SeqChunk]) -> torch.Tensor:
        """Score-head output ``[N]`` float32 at each chunk's last token."""
        if self.score_head is None:
            raise ValueError(
                f"{self.cache.name}: {type(self.model).__name__} is a language model, it has no score head"
            )
        batch = self._prepare(chunks)
        return self.score_head(self._base_forward(batch).index_select(0, batch.last)).float()[:, 0]

    # -- internals -------------------------------------------------------------------------------------

    def _base_forward(self, batch: _Batch) -> torch.Tensor:
        """One base-model forward; the hidden states ``[T, hidden]``."""
        with paged_attention_enabled(self.model), bound_metadata(batch.meta), self._packed(), self._fused():
            out = self.base(input_ids=batch.input_ids, position_ids=batch.positions, use_cache=False)
        return out.last_hidden_state[0]

    def _logits(self, batch: _Batch, rows: torch.Tensor | None, *, float32: bool = True) -> torch.Tensor:
        """Logits ``[len(rows), V]`` (every row when ``rows`` is None) through the model's own forward."""
        if self.lm_head is None:
            raise ValueError(f"{type(self.model).__name__} has no LM head (get_output_embeddings() is None)")
        keep = rows if rows is not None and self.keeps_logits else 0
        kwargs = {"logits_to_keep": keep} if self.keeps_logits else {}
        with paged_attention_enabled(self.model), bound_metadata(batch.meta), self._packed(), self._fused():
            # The model's own call, or its statements with the decoder layers as one op where that is the
            # same arithmetic (model/fused.py's decode_logits; None where it does not apply).
            logits = None
            if self.fused is not None and self.keeps_logits:
                logits = fused.decode_logits(self.fused, self.model, batch.input_ids, batch.positions, keep)
            if logits is None:
                logits = self.model(
                    input_ids=batch.input_ids, position_ids=batch.positions, use_cache=False, **kwargs
                ).logits
        logits = logits[0]
        if rows is not None and not self.keeps_logits:
            logits = logits.index_select(0, rows)
        return logits.float() if float32 else logits

    def _packed(self) -> contextlib.AbstractContextManager:
        """The packed weights swapped in for one forward, where the runner has them."""
        return self.packed.applied() if self.packed is not None else contextlib.nullcontext()

    def _fused(self) -> contextlib.AbstractContextManager:
        """The fused modules installed for one forward, where the runner has them."""
        return self.fused.applied() if self.fused is not None else contextlib.nullcontext()

    def _prepare(self, chunks: Sequence[SeqChunk], extra: np.ndarray | None = None) -> _Batch:
        """Index tensors of one forward, built on the host and moved in two copies (int64, int32), no sync;
        ``extra`` (host int64) rides in the int64 copy and comes back as ``_Batch.extra``.

        Block tables are rows of the cache's persistent table, gathered in one indexing op.
        """
        if not chunks:
            raise ValueError("chunks: a forward needs at least one chunk")
        seq_ids = [c.seq_id for c in chunks]
        if len(set(seq_ids)) != len(chunks):
            raise ValueError("chunks: a sequence may appear only once per forward")
        # NOTE: list comprehensions over the chunks, not one loop of appends: this runs every decode step
        # for every running sequence (B=256 is ~3x faster this way).
        q_lens = [len(c.token_ids) for c in chunks]
        context_lens = self.cache.token_counts(seq_ids)
        if not (
            min(q_lens) > 0
            and [len(c.slots) for c in chunks] == q_lens
            and all(map(operator.ge, context_lens, q_lens))
        ):
            c, q_len, ctx = next(
                (c, q, x)
                for c, q, x in zip(chunks, q_lens, context_lens, strict=True)
                if q == 0 or len(c.slots) != q or x < q
            )
            raise ValueError(
                f"chunks: sequence {c.seq_id!r} has {q_len} tokens, {len(c.slots)} slots, {ctx} cached; "
                "a chunk needs >= 1 token, one slot per token, and its slots appended"
            )
        cu = list(itertools.accumulate(q_lens, initial=0))
        if cu[-1] == len(chunks):  # all decode: one token per sequence
            ids = [c.token_ids[0] for c in chunks]
            slots = [c.slots[0] for c in chunks]
            positions = [ctx - 1 for ctx in context_lens]
        else:
            ids = [t for c in chunks for t in c.token_ids]
            slots = [t for c in chunks for t in c.slots]
            positions = [p for q, ctx in zip(q_lens, context_lens, strict=True) for p in range(ctx - q, ctx)]
        T, N = cu[-1], len(chunks)
        max_context_len = max(context_lens)
        width = -(-max_context_len // self.cache.page_size)
        tables = self.cache.block_table_rows(seq_ids, width)
        last = [i - 1 for i in cu[1:]]

        i64 = np.array(ids + positions + slots + last, dtype=np.int64)
        if extra is not None:
            i64 = np.concatenate([i64, extra])
        i64 = self._to_device(i64)
        i32 = self._to_device(np.concatenate([np.array(cu + context_lens, dtype=np.int32), tables.ravel()]))
        cu_seqlens_q, context_lens_t = i32[: N + 1], i32[N + 1 : 2 * N + 1]
        block_tables = i32[2 * N + 1 :].view(N, width)
        max_q_len = max(q_lens)
        meta = AttentionMetadata(
            kv_cache=self.cache.kv_cache,
            slot_mapping=i64[2 * T : 3 * T],
            block_tables=block_tables,
            context_lens=context_lens_t,
            cu_seqlens_q=cu_seqlens_q,
            max_q_len=max_q_len,
            max_context_len=max_context_len,
            backend=self.backend,
            plan=ops.plan_forward(
                self.cache.kv_cache,
                block_tables,
                context_lens_t,
                cu_seqlens_q,
                self.num_q_heads,
                max_q_len=max_q_len,
                max_context_len=max_context_len,
                q_lens=q_lens,
            ),  # fmt: skip
        )
        extra_t = i64[3 * T + N :] if extra is not None else None
        return _Batch(i64[:T].view(1, T), i64[T : 2 * T].view(1, T), i64[3 * T : 3 * T + N], meta, extra_t)

    def _to_device(self, values: np.ndarray) -> torch.Tensor:
        host = torch.from_numpy(values)
        if self.device.type == "cpu":
            return host
        # Pinned host memory makes the copy truly asynchronous on the caller's current stream.
        return host.pin_memory().to(self.device, non_blocking=True)


@dataclass(slots=True)
class _Batch:
    """The device inputs of one forward."""

    input_ids: torch.Tensor  # [1, T] int64
    positions: torch.Tensor  # [1, T] int64, absolute position of each new token
    last: torch.Tensor  # [N] int64, packed row of each chunk's last token
    meta: AttentionMetadata
    extra: torch.Tensor | None = None  # the caller's extra int64 values (the sampler's), on the device


def unwrap_model(model: nn.Module) -> nn.Module:
    """The HF model to run: a PEFT wrapper gives way to the model its adapters are injected into."""
    get_base_model = getattr(model, "get_base_model", None)
    if callable(get_base_model) and hasattr(model, "peft_config"):
        return get_base_model()
    return model


def _score_head(model: nn.Module, role: str) -> nn.Module:
    """The one-label score head of a sequence-classification model (the reward or the critic, ``role``),
    or ValueError naming the role."""
    score = getattr(model, "score", None)
    if not isinstance(score, nn.Module):
        raise ValueError(f"{role}: {type(model).__name__} has neither an LM head nor a score head (`score`)")
    num_labels = getattr(model.config, "num_labels", None)
    out_features = getattr(score, "out_features", None)
    if num_labels != 1 or out_features not in (None, 1):
        raise ValueError(
            f"{role}: the {role} model must have num_labels == 1 (one score), got num_labels={num_labels}"
            f" and a score head with out_features={out_features}"
        )
    return score


def _check_cache(model: nn.Module, cache: KVCacheManager) -> None:
    """The cache view must have the model's layers, KV heads, head dim, dtype and device."""
    spec = KVSpec.from_hf_config(model.config, model.dtype)
    view = cache.kv_cache
    want = (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype, model.device)
    have = (view.shape[1], view.shape[4], view.shape[5], view.dtype, view.device)
    if want != have:
        raise ValueError(
            f"cache: model '{cache.name}' needs a KV view of (layers, kv_heads, head_dim, dtype, device) = "
            f"{want}, the cache has {have}"
        )
