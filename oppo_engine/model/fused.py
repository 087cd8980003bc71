"""Exact fused replacements of HF modules for the engine's forwards on the CPU.

A decode step on the CPU runs hundreds of small ops a forward: HF's RMSNorm alone is eight (``to``,
``pow``, ``mean``, ``add``, ``rsqrt``, ``mul``, ``to``, ``mul``) per norm, 61 norms a SmolLM2 forward, and
on rows of a few hundred values each op costs more in dispatch and allocation than in arithmetic. The
modules replaced here run the same arithmetic in fewer ops, **bit for bit**: the engine's tokens and
log-probs are those of HF's modules (``tests/test_fused.py``).

- **RMSNorm** (``ops.rms_norm``, one C++ op): a module is replaced only where its class's ``forward`` is,
  to the character, the Llama-form forward below (``LLAMA_RMS_NORM_FORWARD``: Llama, Qwen2, Qwen3,
  Mistral, Phi3, Granite, ... share it); any other norm (Gemma's ``1 + weight``, OLMo's, a kernelized one)
  runs its own forward. Each call falls back to the module's own forward where the op does not apply: a
  dtype other than float32/bfloat16, mixed dtypes, a non-contiguous input, CUDA, autocast, or a forward
  that records gradients.

The replacements are installed for the duration of the runner's forward as instance attributes (as the
packed weights are, ``model/packed.py``) and act only on the threads running such a forward: the same
model running elsewhere meanwhile (a trainer's forward and backward) gets its own modules. Weights are read
at every call, so they follow every update.
"""

from __future__ import annotations

import inspect
import textwrap
import threading
import weakref
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from oppo_engine import ops

# The RMSNorm forward the fused op reproduces (transformers' LlamaRMSNorm.forward, as of 5.x). A class
# qualifies only if its forward's source is exactly this (dedented), so a change upstream disables the
# fusion rather than making it wrong.
LLAMA_RMS_NORM_FORWARD = """\
def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)
"""

_FUSED_DTYPES = (torch.float32, torch.bfloat16)
_forms: dict[type, bool] = {}
_forms_lock = threading.Lock()


def is_llama_rms_norm(module: nn.Module) -> bool:
    """Whether ``module`` computes the Llama-form RMSNorm: its class's forward is ``LLAMA_RMS_NORM_FORWARD``
    verbatim, it has a 1-D ``weight`` parameter and a float ``variance_epsilon``."""
    cls = type(module)
    with _forms_lock:
        form = _forms.get(cls)
        if form is None:
            try:
                source = textwrap.dedent(inspect.getsource(cls.forward))
            except (OSError, TypeError):
                source = ""
            form = _forms[cls] = source == LLAMA_RMS_NORM_FORWARD
    weight = getattr(module, "weight", None)
    return (
        form
        and isinstance(weight, nn.Parameter)
        and weight.dim() == 1
        and isinstance(getattr(module, "variance_epsilon", None), float)
    )


class FusedModules:
    """The fused replacements for one model's modules (its Llama-form RMSNorms), installed by ``applied``."""

    def __init__(self, model: nn.Module) -> None:
        self.norms = [m for m in model.modules() if is_llama_rms_norm(m)]
        self._forwards = [_fused_norm_forward(self, m) for m in self.norms]
        self._lock = threading.Lock()
        self._threads: Counter[int] = Counter()  # threads inside applied(), with their depth

    def active(self) -> bool:
        """Whether this thread is inside ``applied()``."""
        return threading.get_ident() in self._threads

    @contextmanager
    def applied(self) -> Iterator[None]:
        """Inside the block, on this thread, each fused module runs its fused forward. Re-entrant, and
        several threads may be inside at once (the modules are restored when the last one leaves)."""
        me = threading.get_ident()
        with self._lock:
            if not self._threads:
                for m, fwd in zip(self.norms, self._forwards, strict=True):
                    m.__dict__["forward"] = fwd
            self._threads[me] += 1
        try:
            yield
        finally:
            with self._lock:
                self._threads[me] -= 1
                if self._threads[me] == 0:
                    del self._threads[me]
                if not self._threads:
                    for m in self.norms:
                        m.__dict__.pop("forward", None)


def _fused_norm_forward(fused: FusedModules, module: nn.Module):
    """The norm's forward while fused: ``ops.rms_norm`` where it applies, the module's own elsewhere."""
    own = type(module).forward

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        weight = module.weight
        if (
            hidden_states.dtype not in _FUSED_DTYPES
            or weight.dtype != hidden_states.dtype
            or hidden_states.device.type != "cpu"
            or weight.device.type != "cpu"
            or not hidden_states.is_contiguous()
            or not weight.is_contiguous()
            or (torch.is_grad_enabled() and (hidden_states.requires_grad or weight.requires_grad))
            or torch.is_autocast_enabled("cpu")
            or not fused.active()
        ):
            return own(module, hidden_states)
        return ops.rms_norm(hidden_states, weight, module.variance_epsilon)

    return forward


_by_model: weakref.WeakKeyDictionary[nn.Module, FusedModules] = weakref.WeakKeyDictionary()
_by_model_lock = threading.Lock()


def for_model(model: nn.Module) -> FusedModules:
    """The fused modules of ``model``, shared by every runner of it in the process."""
    with _by_model_lock:
        fused = _by_model.get(model)
        if fused is None:
            fused = _by_model[model] = FusedModules(model)
        return fused
