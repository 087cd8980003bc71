"""Prepacked linear weights for the actor's forwards on the CPU (``EngineConfig.packed_weights``).

A decode step multiplies a few rows (one per sequence) by every weight matrix of the model, so on the CPU it
is bound by reading the weights. ``F.linear`` (MKL's sgemm in fp32, oneDNN in bf16) repacks the weight
matrix into its blocked layout at every call: a second pass over it. Packed once into oneDNN's layout
(``ops.pack_linear_weight``), the same products read it once: measured on SmolLM2-135M's 30 layers at
M=16 with one thread, 1.43x less CPU time in fp32 and bf16 (docs/benchmarks.md, "Decode on SmolLM2").

Exactness: bf16 results are bitwise those of ``F.linear`` on contiguous inputs (oneDNN both ways; what
the model passes), and equal to rounding otherwise. fp32 results are the same products summed in oneDNN's
order instead of MKL's: they differ from ``F.linear``'s by rounding (at most ~2e-6 on unit-scale outputs,
measured), as a different GEMM library's would; fp32 is packed only while torch's fp32 matmul precision is
the full one (``"highest"``), never with reduced-precision products. tests/test_packed.py checks both, and
that the packs follow the weights.

The packed copies live beside the model's weights (one more copy of every ``nn.Linear`` weight: the
actor's only) and are swapped in for the duration of the runner's forward: each module's ``forward`` is
set on the instance, then removed, so the trainer's forwards and backwards never see them. They follow the
weights: before every forward a module whose weight tensor was replaced or written in place (its
``_version``, which every in-place op bumps: optimizer steps, ``copy_``, ``load_state_dict``) is packed
again, and ``update_policy()`` drops every pack of the actor and critic (``drop``), which covers writes that
bypass the version counter (``param.data.copy_``). ``release_memory`` drops them too.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from oppo_engine import ops


class _Entry:
    """One module's pack: the weight tensor it was made from and that tensor's version then."""

    __slots__ = ("module", "weight", "version", "packed")

    def __init__(self, module: nn.Linear) -> None:
        self.module = module
        self.weight: torch.Tensor | None = None
        self.version = -1
        self.packed: torch.Tensor | None = None


class PackedLinears:
    """Packed copies of the ``nn.Linear`` weights of one model, for its forwards on the CPU.

    ``batch_hint`` is the number of rows a forward usually has (the decode batch): oneDNN picks its layout
    for it, and any other number of rows works as well. Modules are the exact ``nn.Linear`` instances of the
    model (subclasses may change ``forward``: they are left alone) whose weight is a CPU fp32 or bf16
    tensor that ``ops.packed_linear_supported`` accepts, and not an inference tensor (made under
    ``torch.inference_mode()``: it has no version counter).
    """

    def __init__(self, model: nn.Module, batch_hint: int) -> None:
        self.batch_hint = max(1, int(batch_hint))
        self._entries = [_Entry(m) for m in model.modules() if type(m) is nn.Linear]
        self._lock = threading.Lock()
        self.repacks = 0  # modules packed so far (the first packing included)

    @property
    def nbytes(self) -> int:
        """Bytes held by the packed copies now."""
        return sum(e.packed.numel() * e.packed.element_size() for e in self._entries if e.packed is not None)

    def drop(self) -> None:
        """Free every pack; the next forward packs again from the weights as they are then."""
        with self._lock:
            for e in self._entries:
                e.weight, e.version, e.packed = None, -1, None

    def _refresh(self) -> list[tuple[nn.Linear, torch.Tensor]]:
        """The (module, pack) pairs to use in this forward, packing what is missing or stale."""
        out = []
        for e in self._entries:
            w = e.module.weight
            # An inference tensor has no version counter to tell a stale pack by: left to F.linear.
            if w.is_inference() or not ops.packed_linear_supported(w):
                e.weight, e.version, e.packed = None, -1, None
                continue
            version = w._version
            if e.packed is None or e.weight is not w or e.version != version:
                e.packed = ops.pack_linear_weight(w, self.batch_hint)
                e.weight, e.version = w, version
                self.repacks += 1
            out.append((e.module, e.packed))
        return out

    @contextmanager
    def applied(self) -> Iterator[None]:
        """Inside the block, each packed module's forward is the packed product (packing first what is
        stale); outside it, the module's own. Not re-entrant per model: the runner holds it per forward."""
        with self._lock:
            installed = self._refresh()
            thread = threading.get_ident()
            for module, packed in installed:
                # NOTE: the instance's __dict__, not setattr: nn.Module.__setattr__ costs ~1 us, and an
                # instance attribute named "forward" is what nn.Module.__call__ calls.
                module.__dict__["forward"] = _packed_forward(module, packed, thread)
            try:
                yield
            finally:
                for module, _ in installed:
                    module.__dict__.pop("forward", None)


def _packed_forward(module: nn.Linear, packed: torch.Tensor, thread: int):
    """The module's forward while packed: the packed product on the thread of the runner's forward, the
    module's own on any other (the same model object running elsewhere meanwhile, e.g. as a scorer, gets
    exactly what it gets without packs)."""
    bias = module.bias

    def forward(x: torch.Tensor) -> torch.Tensor:
        if threading.get_ident() != thread:
            return nn.Linear.forward(module, x)
        return ops.packed_linear(x, packed, bias)

    return forward


_by_model: weakref.WeakKeyDictionary[nn.Module, PackedLinears] = weakref.WeakKeyDictionary()
_by_model_lock = threading.Lock()


def packed_enabled(setting: bool | str, device: torch.device) -> bool:
    """``EngineConfig.packed_weights`` resolved for ``device``: ``"auto"`` is on for the CPU (where the
    packed layout exists), off for CUDA; ``True`` on CUDA packs nothing (no module's weight qualifies)."""
    if setting == "auto":
        return device.type == "cpu"
    return bool(setting)


def for_model(model: nn.Module, batch_hint: int) -> PackedLinears:
    """The packs of ``model``, shared by every runner of it in the process (one copy of the weights, not
    one per engine); a larger ``batch_hint`` than before wins."""
    with _by_model_lock:
        packs = _by_model.get(model)
        if packs is None:
            packs = _by_model[model] = PackedLinears(model, batch_hint)
        elif batch_hint > packs.batch_hint:
            packs.batch_hint = batch_hint
        return packs


def drop(model: nn.Module | None) -> None:
    """Free ``model``'s packs if it has any (its weights were changed or are being released)."""
    if model is None:
        return
    with _by_model_lock:
        packs = _by_model.get(model)
    if packs is not None:
        packs.drop()
