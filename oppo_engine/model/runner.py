"""Packed varlen forward of an unmodified HF decoder through the paged KV cache."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from oppo_engine.cache.arena import KVSpec
from oppo_engine.cache.manager import KVCacheManager
from oppo_engine.model.attention import AttentionMetadata, paged_attention_enabled


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

    The model, ``cache.kv_cache`` and every output live on the model's device; the cache's dtype must be
    the model's (checked here). Every call is one base-model forward over ``input_ids [1, T]`` under
    ``torch.inference_mode()`` with the model's attention switched to the paged one for its duration, so
    outputs are inference tensors. Kernels and copies run on the caller's current stream. The scheduler
    has already reserved the slots: the runner never allocates or frees pages.
    """

    def __init__(self, model: nn.Module, cache: KVCacheManager, *, backend: str = "triton") -> None:
        self.model = model
        self.cache = cache
        self.backend = backend
        self.base = getattr(model, model.base_model_prefix, model)
        self.lm_head: nn.Module | None = model.get_output_embeddings()
        self.score_head: nn.Module | None = None
        if self.lm_head is None:
            self.score_head = _reward_score_head(model)
        self.device = model.device
        _check_model(model)
        _check_cache(model, cache)
        with paged_attention_enabled(model):  # validates the switch now rather than at the first forward
            pass

    # -- outputs ---------------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, chunks: Sequence[SeqChunk]) -> torch.Tensor:
        """Final-normed hidden states ``[T, hidden]`` of every new token, packed in chunk order."""
        hidden, _ = self._run(chunks)
        return hidden

    @torch.inference_mode()
    def hidden_last(self, chunks: Sequence[SeqChunk]) -> torch.Tensor:
        """Hidden state ``[N, hidden]`` of each chunk's last token."""
        hidden, last = self._run(chunks)
        return hidden.index_select(0, last)

    @torch.inference_mode()
    def logits_last(self, chunks: Sequence[SeqChunk]) -> torch.Tensor:
        """Next-token logits ``[N, V]`` float32 after each chunk's last token."""
        return self._lm_head()(self.hidden_last(chunks)).float()

    @torch.inference_mode()
    def logits_all(self, chunks: Sequence[SeqChunk]) -> torch.Tensor:
        """Logits ``[T, V]`` float32 after every new token (prefill log-probs, tests)."""
        return self._lm_head()(self.forward(chunks)).float()

    @torch.inference_mode()
    def score_last(self, chunks: Sequence[SeqChunk]) -> torch.Tensor:
        """Reward-model score ``[N]`` float32 at each chunk's last token."""
        if self.score_head is None:
            raise ValueError(f"reward: {type(self.model).__name__} is a language model, it has no score head")
        return self.score_head(self.hidden_last(chunks)).float()[:, 0]

    # -- internals -------------------------------------------------------------------------------------

    def _lm_head(self) -> nn.Module:
        if self.lm_head is None:
            raise ValueError(f"{type(self.model).__name__} has no LM head (get_output_embeddings() is None)")
        return self.lm_head

    def _run(self, chunks: Sequence[SeqChunk]) -> tuple[torch.Tensor, torch.Tensor]:
        """One base-model forward; returns ``(hidden [T, hidden], last-token rows [N] int64)``."""
        input_ids, positions, last, meta = self._prepare(chunks)
        with paged_attention_enabled(self.model):
            out = self.base(input_ids=input_ids, position_ids=positions, use_cache=False, oppo_meta=meta)
        return out.last_hidden_state[0], last

    def _prepare(
        self, chunks: Sequence[SeqChunk]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Build every index tensor on the host and move it in two copies (int64, int32), without a sync."""
        if not chunks:
            raise ValueError("chunks: a forward needs at least one chunk")
        if len({c.seq_id for c in chunks}) != len(chunks):
            raise ValueError("chunks: a sequence may appear only once per forward")
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu = [0]
        context_lens: list[int] = []
        tables: list[list[int]] = []
        max_q_len = 0
        for c in chunks:
            q_len, ctx = len(c.token_ids), self.cache.num_tokens(c.seq_id)
            if q_len == 0 or len(c.slots) != q_len or ctx < q_len:
                raise ValueError(
                    f"chunks: sequence {c.seq_id!r} has {q_len} tokens, {len(c.slots)} slots, {ctx} cached; "
                    "a chunk needs >= 1 token, one slot per token, and its slots appended"
                )
            ids.extend(c.token_ids)
            positions.extend(range(ctx - q_len, ctx))
            slots.extend(c.slots)
            cu.append(cu[-1] + q_len)
            context_lens.append(ctx)
            tables.append(self.cache.pages(c.seq_id))
            max_q_len = max(max_q_len, q_len)
        T, N = cu[-1], len(chunks)
        width = max(len(t) for t in tables)
        flat_tables: list[int] = []
        for t in tables:  # zero-padded rows: the kernels read only the first ceil(ctx / page_size) entries
            flat_tables += t + [0] * (width - len(t))
        last = [i - 1 for i in cu[1:]]

        i64 = self._to_device(ids + positions + slots + last, torch.int64)
        i32 = self._to_device(cu + context_lens + flat_tables, torch.int32)
        meta = AttentionMetadata(
            kv_cache=self.cache.kv_cache,
            slot_mapping=i64[2 * T : 3 * T],
            block_tables=i32[2 * N + 1 :].view(N, width),
            context_lens=i32[N + 1 : 2 * N + 1],
            cu_seqlens_q=i32[: N + 1],
            max_q_len=max_q_len,
            max_context_len=max(context_lens),
            backend=self.backend,
        )
        return i64[:T].view(1, T), i64[T : 2 * T].view(1, T), i64[3 * T :], meta

    def _to_device(self, values: list[int], dtype: torch.dtype) -> torch.Tensor:
        if self.device.type == "cpu":
            return torch.tensor(values, dtype=dtype)
        # Pinned host memory makes the copy truly asynchronous on the caller's current stream.
        host = torch.tensor(values, dtype=dtype, pin_memory=True)
        return host.to(self.device, non_blocking=True)


def _reward_score_head(model: nn.Module) -> nn.Module:
    """The one-label score head of a sequence-classification reward model, or ValueError."""
    score = getattr(model, "score", None)
    if not isinstance(score, nn.Module):
        raise ValueError(
            f"reward: {type(model).__name__} has neither an LM head nor a reward score head (`score`)"
        )
    num_labels = getattr(model.config, "num_labels", None)
    out_features = getattr(score, "out_features", None)
    if num_labels != 1 or out_features not in (None, 1):
        raise ValueError(
            f"reward: the reward model must have num_labels == 1 (one score), got num_labels={num_labels}"
            f" and a score head with out_features={out_features}"
        )
    return score


def _check_model(model: nn.Module) -> None:
    """The paged kernel is plain causal attention: no sliding windows."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        raise ValueError(f"model: {type(model).__name__} uses sliding-window layers, which the engine lacks")


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
