"""The engine's attention for unmodified HF decoders: K/V into the paged cache, paged attention out of it.

The function is registered with ``transformers.AttentionInterface`` under ``ATTN_IMPL`` and switched on
only while the engine runs (``paged_attention_enabled``), together with eval semantics (no dropout); the
trainer gets the model back as it was. No mask function is registered for ``ATTN_IMPL``, so HF skips
building the ``T x T`` mask and passes ``attention_mask=None``: the paged kernel does the causal masking
(and each layer's sliding window) from ``AttentionMetadata``, which the runner binds to the thread for the
duration of its forward.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AttentionInterface, PreTrainedModel

from oppo_engine import ops

ATTN_IMPL = "oppo_paged"
# A fresh interface instance reads the class-level global mapping, i.e. every registered function.
_INTERFACE = AttentionInterface()


@dataclass(slots=True)
class AttentionMetadata:
    """Per-forward inputs of the paged attention, built once by the runner and read by every layer.

    All tensors live on the model's device; sequence ``n`` owns packed rows
    ``cu_seqlens_q[n]:cu_seqlens_q[n + 1]`` of the ``T`` new tokens.
    """

    kv_cache: torch.Tensor  # [num_pages, L, 2, page_size, Hkv, D], the model's view of the arena
    slot_mapping: torch.Tensor  # [T] int64, cache slot of each new token (-1 skips)
    block_tables: torch.Tensor  # [N, max_pages] int32, zero-padded
    context_lens: torch.Tensor  # [N] int32, cached tokens including the new ones
    cu_seqlens_q: torch.Tensor  # [N + 1] int32
    max_q_len: int
    max_context_len: int
    backend: str = "triton"
    plan: ops.AttentionPlan | None = None  # checks and launch plan of every layer, made once per forward


# The metadata of the forward running on this thread. It is bound around the model call rather than passed
# as a keyword argument, because not every decoder forwards ``**kwargs`` to its attention modules (StableLM's
# decoder layer drops them): a keyword could be lost silently, a binding cannot. Thread-local, because the
# engine's lanes run different models' forwards on different threads at once.
_bound = threading.local()


@contextmanager
def bound_metadata(meta: AttentionMetadata) -> Iterator[None]:
    """Make ``meta`` the metadata of every paged attention call on this thread inside the block."""
    saved = getattr(_bound, "meta", None)
    _bound.meta = meta
    try:
        yield
    finally:
        _bound.meta = saved


def bound() -> AttentionMetadata | None:
    """The metadata bound to this thread by ``bound_metadata`` (None outside the runner's forward)."""
    return getattr(_bound, "meta", None)


def paged_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """HF attention: ``query [1, Hq, T, D]``, ``key``/``value [1, Hkv, T, D]`` -> ``([1, T, Hq, D], None)``.

    The new K/V are written to the pages and the queries attend over the cache, as the metadata bound by
    the runner (``bound_metadata``) says. ``sliding_window`` and ``softcap`` come from the model's attention
    module, so they apply per layer. A call with no metadata bound (the model called outside the engine's
    forward while the engine holds its attention switch) raises: plain attention over the new tokens alone
    would be silently wrong from the first decode token on. So does a mask the model built itself.
    """
    meta: AttentionMetadata | None = getattr(_bound, "meta", None)
    if meta is None:
        raise RuntimeError(
            f"{type(module).__name__}: the model is switched to the engine's paged attention (a "
            "RolloutEngine step is running, or a paged_attention_enabled block is open) and was called "
            "outside the engine's forward; call it once the step has returned"
        )
    if attention_mask is not None:
        # No mask function is registered for ATTN_IMPL, so a mask here was built by the model itself: a
        # bias (ALiBi) or a pattern the paged kernel would silently not apply.
        raise ValueError(
            f"{type(module).__name__}: the model passed its own attention mask (a position bias or a custom "
            "pattern); the engine's paged attention masks causally from the cache and cannot apply it"
        )
    if dropout:
        raise ValueError(f"oppo_paged attention has no dropout (got {dropout}); run the model in eval mode")
    if kwargs.get("s_aux") is not None:
        raise ValueError(f"{type(module).__name__}: attention sinks (s_aux) are not supported by the engine")
    layer = module.layer_idx
    # [1, H, T, D] -> [T, H, D]: a view; the ops need only the head dim contiguous.
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    ops.reshape_and_cache(k, v, meta.kv_cache, meta.slot_mapping, layer)
    out = ops.paged_attention(
        q,
        meta.kv_cache,
        layer,
        meta.block_tables,
        meta.context_lens,
        meta.cu_seqlens_q,
        scaling if scaling is not None else q.shape[-1] ** -0.5,
        sliding_window=sliding_window,
        softcap=softcap,
        max_q_len=meta.max_q_len,
        max_context_len=meta.max_context_len,
        backend=meta.backend,
        plan=meta.plan,
    )
    return out.unsqueeze(0), None


_register_lock = threading.Lock()


def register() -> None:
    """Register ``ATTN_IMPL`` with ``transformers.AttentionInterface`` (idempotent, no mask function)."""
    with _register_lock:
        if ATTN_IMPL not in _INTERFACE:
            AttentionInterface.register(ATTN_IMPL, paged_attention_forward)


class _Switch:
    """Reference-counted switch of one model to the engine's attention and eval mode (nested, cross-thread).

    While on, every config of the model names ``ATTN_IMPL`` and every module is in eval mode (a trainer
    holds its models in ``train()``: dropout would make rollouts random in a way the sampler does not
    key); switching off restores both exactly as they were.
    """

    __slots__ = ("model", "configs", "lock", "depth", "saved", "training")

    def __init__(self, model: nn.Module) -> None:
        register()
        # A weak reference: the switch is the value of a weak-keyed map whose key is the model.
        self.model = weakref.ref(model)
        # Every PreTrainedModel inside the model reads its own config; parents come before children in
        # `modules()`, so restoring in this order undoes a parent's recursive set before a child's own value.
        configs: dict[int, object] = {}
        for m in model.modules():
            if isinstance(m, PreTrainedModel):
                configs.setdefault(id(m.config), m.config)
        self.configs = list(configs.values())
        self.lock = threading.Lock()
        self.depth = 0
        self.training: list[nn.Module] = []
        self.saved = [c._attn_implementation for c in self.configs]
        # The public API validates once (it refuses models whose attention ignores the interface, with only
        # a warning, so check the result); later switches just set the configs' `_attn_implementation`.
        try:
            model.set_attn_implementation(ATTN_IMPL)
            switched = all(c._attn_implementation == ATTN_IMPL for c in self.configs)
        finally:
            self._restore_attention()
        if not switched:
            raise ValueError(
                f"model: {type(model).__name__} does not dispatch attention through "
                "transformers.AttentionInterface, so the engine cannot run it"
            )

    def enable(self) -> None:
        """Switch every config of the model to ``ATTN_IMPL`` and every module to eval, saving both."""
        self.saved = [c._attn_implementation for c in self.configs]
        for c in self.configs:
            c._attn_implementation = ATTN_IMPL
        self.training = [m for m in self.model().modules() if m.training]
        for m in self.training:
            m.training = False

    def restore(self) -> None:
        """Give every config back its saved implementation and every module its training flag."""
        self._restore_attention()
        for m in self.training:
            m.training = True
        self.training = []

    def _restore_attention(self) -> None:
        for c, impl in zip(self.configs, self.saved, strict=True):
            c._attn_implementation = impl


_switches: weakref.WeakKeyDictionary[nn.Module, _Switch] = weakref.WeakKeyDictionary()
_switches_lock = threading.Lock()


@contextmanager
def paged_attention_enabled(model: nn.Module) -> Iterator[nn.Module]:
    """Run ``model`` with ``ATTN_IMPL``, in eval mode, inside the block; restore both after it.

    Re-entrant and thread-safe: the implementation is switched on by the outermost entry and restored by
    the last exit, so an engine may hold the switch for a whole step and the runner's own per-forward entry
    costs a lock and a counter (~2 us). The first entry for a model validates it (``set_attn_implementation``,
    ~0.5 ms); a later on/off pair sets ``_attn_implementation`` on each config (~35 us: HF configs validate
    every attribute write).
    """
    with _switches_lock:
        switch = _switches.get(model)
        if switch is None:
            switch = _switches[model] = _Switch(model)
    with switch.lock:
        if switch.depth == 0:
            switch.enable()
        switch.depth += 1
    try:
        yield model
    finally:
        with switch.lock:
            switch.depth -= 1
            if switch.depth == 0:
                switch.restore()
