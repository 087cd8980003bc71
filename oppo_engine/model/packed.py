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
set on the instance, then removed, so the trainer's forwards and backwards never see them (a module that
already has an instance ``forward``, such as accelerate's hooks, keeps it and is not packed). They follow the
weights: before every forward a module whose weight tensor was replaced or written in place (its
``_version``, which most in-place ops bump: torch's default optimizer steps, ``copy_``, ``load_state_dict``)
is packed again, and ``update_policy()`` drops every pack of the actor and critic (``drop``), which covers
writes that bypass the version counter (``param.data.copy_``, and torch's fused optimizer kernels, which
``PPOTrainer`` uses: they leave ``_version`` as it was). ``update_policy()`` is the guarantee; the version
check catches the in-place writes of a user's own code between two of them. ``release_memory`` drops them too.
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
    """One module's pack: the weight tensor it was made from, that tensor's version then, and the forward
    that runs it (made once per pack, not once per model forward)."""

    __slots__ = ("module", "weight", "version", "packed", "forward")

    def __init__(self, module: nn.Linear) -> None:
        self.module = module
        self.weight: torch.Tensor | None = None
        self.version = -1
        self.packed: torch.Tensor | None = None
        self.forward = None


class PackedLinears:
    """Packed copies of the ``nn.Linear`` weights of one model, for its forwards on the CPU.

    ``batch_hint`` is the number of rows a forward usually has (the decode batch): oneDNN picks its layout
    for it, and any other number of rows works as well. Modules are the exact ``nn.Linear`` instances of the
    model (subclasses may change ``forward``: they are left alone) whose weight is a CPU fp32 or bf16
    tensor that ``ops.packed_linear_supported`` accepts, and not an inference tensor (made under
    ``torch.inference_mode()``: it has no version counter). A module whose ``forward`` is already set on
    the instance (accelerate's hooks, a user's wrapper) is left to it at that forward: its wrapper's work
    must run, and the object stays where it was.
    """

    def __init__(self, model: nn.Module, batch_hint: int) -> None:
        self.batch_hint = max(1, int(batch_hint))
        self._entries = [_Entry(m) for m in model.modules() if type(m) is nn.Linear]
        self._lock = threading.Lock()
        self._thread = 0  # the thread of the forward holding the packs (a packed forward checks it)
        self.repacks = 0  # modules packed so far (the first packing included)

    @property
    def nbytes(self) -> int:
        """Bytes held by the packed copies now."""
        return sum(e.packed.numel() * e.packed.element_size() for e in self._entries if e.packed is not None)

    def drop(self) -> None:
        """Free every pack; the next forward packs again from the weights as they are then."""
        with self._lock:
            for e in self._entries:
                e.weight, e.version, e.packed, e.forward = None, -1, None, None

    def _refresh(self) -> list[_Entry]:
        """The entries to use in this forward, packing what is missing or stale.

        NOTE: this runs before every forward of the actor (211 modules on SmolLM2), so the support check,
        whose answer depends on a weight's dtype, device, rank and layout and on global settings (fp32
        matmul precision), is made once per distinct (dtype, device, rank, layout) per forward, not once
        per module."""
        out = []
        supported: dict[tuple, bool] = {}
        for e in self._entries:
            w = e.module.weight
            key = (w.dtype, w.device, w.dim(), w.layout)
            ok = supported.get(key)
            if ok is None:
                ok = supported[key] = ops.packed_linear_supported(w)
            if not ok or w.is_inference() or "forward" in e.module.__dict__:
                e.weight, e.version, e.packed, e.forward = None, -1, None, None
                continue
            version = w._version
            if e.packed is None or e.weight is not w or e.version != version:
                e.packed = ops.pack_linear_weight(w, self.batch_hint)
                e.weight, e.version = w, version
                e.forward = _packed_forward(self, e.module, e.packed)
                self.repacks += 1
            out.append(e)
        return out

    @contextmanager
    def applied(self) -> Iterator[None]:
        """Inside the block, each packed module's forward is the packed product (packing first what is
        stale); outside it, the module's own. Not re-entrant per model: the runner holds it per forward."""
        with self._lock:
            installed = self._refresh()
            self._thread = threading.get_ident()
            for e in installed:
                e.module.__dict__["forward"] = e.forward
            try:
                yield
            finally:
                for e in installed:  # only what was installed here: anything set meanwhile stays
                    if e.module.__dict__.get("forward") is e.forward:
                        del e.module.__dict__["forward"]


def _packed_forward(packs: PackedLinears, module: nn.Linear, packed: torch.Tensor):
    """The module's forward while packed: the packed product on the thread of the runner's forward, the
    module's own on any other (the same model object running elsewhere meanwhile, e.g. as a scorer, gets
    exactly what it gets without packs). The bias is read at every call: only the weight is packed."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        if threading.get_ident() != packs._thread:
            return nn.Linear.forward(module, x)
        return ops.packed_linear(x, packed, module.bias)

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
