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
- **Llama's attention** (``ops.rotary_and_cache``): between its projections and the engine's paged
  attention, HF's Llama attention applies the rotary embedding (``apply_rotary_pos_emb``: 16 small ops a
  layer) and the engine writes K/V into the cache; one C++ op does both, rounding where HF's ops round, and
  the rest of HF's attention forward (interface lookup, transposes, the deprecation and kernel-hub wrappers)
  is skipped. Only ``transformers.models.llama``'s own ``LlamaAttention`` qualifies, and only while its
  forward, ``apply_rotary_pos_emb`` and ``rotate_half`` read as below (``LLAMA_ATTENTION_FORWARD``,
  ``LLAMA_ROTARY``); a call falls back to HF's forward outside the runner's forward, with a mask or an HF
  cache, in training mode, or for a dtype or device the op does not take. A model whose rotary embedding
  was swapped for a hub kernel (``kernels.kernelize``) is not supported by this path.

- **The Llama-form MLP** (``down_proj(act_fn(gate_proj(x)) * up_proj(x))``, ``LLAMA_MLP_FORWARD``: Llama,
  Qwen2, Mistral, ... share it): its gate and up projections run as one product over their stacked packed
  weights where the packed weights have that group (``packed.grouped``, bitwise the two products), and the
  fused attention does the same for its q, k and v projections; the module's own forward elsewhere. Where
  its ``act_fn`` is SiLU (``is_silu``), the SiLU and the product run as one op on the grouped product's two
  halves in place (``ops.silu_mul``), wherever that is bitwise torch's two ops (``ops.silu_mul_exact``: torch
  runs its AVX-512 kernels and its SiLU loop would take its vector path for every element); torch's two ops on
  contiguous copies of the halves elsewhere.

- **The Llama-form decoder layer** (``LLAMA_DECODER_LAYER_FORWARD``: Llama, Qwen2, Mistral, ... share it):
  the same calls in the same order, but each of its four sub-modules (the two norms, the attention, the MLP)
  is entered through its ``forward`` rather than through torch's module call, where that call would do
  nothing else (``_plain_calls``: no hooks of the module's or global ones, not compiled, not traced, torch's
  own ``__call__``); HF's own forward elsewhere. The module calls and attribute lookups it skips: 0.1-0.3 ms
  of a SmolLM2 bf16 decode step at B = 1 and 16 (1-3%), nothing measurable at 64
  (``bench/results/small_linear_zen5_2026-12-06f.txt``).
- **A decoder layer of a few bf16 rows as one op** (``ops.llama_decode_layer``, ``_decode_layer``): where
  every call of that layer body would be one of the C++ ops (both norms fused, the attention's C++ path,
  each of its four products ``ops.small_linear`` with its probed run, SiLU-and-product ``ops.silu_mul``; up
  to ``packed.SMALL_ROWS`` rows: a decode step's, a short prefill's), the layer runs as one op making those
  calls, in that order, on the same operands: bit for bit the calls made one by one (tests/test_fused.py).
  What it saves is the Python between them (the packs' and fused modules' per-call checks, module calls,
  closures; the checks it makes instead cost ~25 us a layer). ``DECODE_LAYERS = False`` turns it off.
- **A Llama causal LM's decode forward with its layers as one op** (``decode_logits``, which the runner
  calls in place of the model's own call): transformers' ``LlamaForCausalLM`` and ``LlamaModel`` forwards'
  statements for the runner's call (``LLAMA_CAUSAL_LM_FORWARD``, ``LLAMA_MODEL_FORWARD``: transformers' own
  forwards, with their own wrappers, on the class or inherited unchanged), their sub-modules entered
  through their own module calls, except the decoder layers: where every layer would run as
  ``ops.llama_decode_layer``, all of them run as one ``ops.llama_decode_layers`` (bit for bit the same
  calls); HF's layer loop elsewhere. It skips the two
  models' module calls and their wrappers (``capture_outputs``, ``merge_with_config_defaults``,
  ``can_return_tuple``), and each layer's module call and Python around its op. Only where those do nothing
  for this call: no hooks on either model, no output capture asked for by the config, ``return_dict`` on.
  ``DECODE_MODEL = False`` turns it off.

The replacements are installed for the duration of the runner's forward as instance attributes (as the
packed weights are, ``model/packed.py``) and act only on the threads running such a forward: the same
model running elsewhere meanwhile (a trainer's forward and backward) gets its own modules. Weights are read
at every call, so they follow every update.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import threading
import weakref
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from oppo_engine import ops
from oppo_engine.model import attention, packed

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

LLAMA_ATTENTION_FORWARD = """\
@deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
def forward(
    self,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    cache: Cache | None = None,
    **kwargs: Unpack[TransformersKwargs],
) -> tuple[torch.Tensor, torch.Tensor]:
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)

    query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

    cos, sin = position_embeddings
    query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

    if cache is not None:
        key_states, value_states = cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)

    attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
        self.config._attn_implementation, eager_attention_forward
    )

    attn_output, attn_weights = attention_interface(
        self,
        query_states,
        key_states,
        value_states,
        attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling,
        **kwargs,
    )

    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    attn_output = self.o_proj(attn_output)
    return attn_output, attn_weights
"""
# The rotary helpers of transformers.models.llama.modeling_llama that the forward above calls; the module's
# source must contain each verbatim.
LLAMA_ROTARY = (
    """\
def rotate_half(x):
    \"\"\"Rotates half the hidden dims of the input.\"\"\"
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)
""",
    "def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):\n",
    """\
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed
""",
)
# The MLP forward whose two input projections may run as one grouped product (transformers' LlamaMLP's,
# verbatim; Qwen2's and Mistral's read the same).
LLAMA_MLP_FORWARD = """\
def forward(self, x):
    down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
    return down_proj
"""
# The decoder layer forward whose sub-modules the fused layer enters through their forwards (transformers'
# LlamaDecoderLayer's, as of 5.x, verbatim; Qwen2's, Mistral's, ... read the same).
LLAMA_DECODER_LAYER_FORWARD = """\
@deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
def forward(
    self,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    cache: Cache | None = None,
    use_cache: bool | None = False,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    **kwargs: Unpack[TransformersKwargs],
) -> torch.Tensor:
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    # Self Attention
    hidden_states, _ = self.self_attn(
        hidden_states=hidden_states,
        attention_mask=attention_mask,
        position_ids=position_ids,
        cache=cache,
        use_cache=use_cache,
        position_embeddings=position_embeddings,
        **kwargs,
    )
    hidden_states = residual + hidden_states

    # Fully Connected
    residual = hidden_states
    hidden_states = self.post_attention_layernorm(hidden_states)
    hidden_states = self.mlp(hidden_states)
    hidden_states = residual + hidden_states
    return hidden_states
"""
_LAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
# transformers' SiLUActivation's forward (ACT2FN["silu"], as of 5.x): an MLP whose act_fn reads so, or is
# ``nn.SiLU``, has its SiLU and product fused (``ops.silu_mul``) where that is bitwise the two ops.
SILU_ACTIVATION_FORWARD = """\
def forward(self, input: Tensor) -> Tensor:
    return nn.functional.silu(input)
"""
_NN_SILU_FORWARD = nn.SiLU.forward  # as imported: a class-level replacement disqualifies nn.SiLU
_F_SILU = torch.nn.functional.silu
_LLAMA_MODULE = "transformers.models.llama.modeling_llama"
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")

_FUSED_DTYPES = (torch.float32, torch.bfloat16)
# (form, class, the class's forward) -> whether the class reads as that form: a forward replaced on the class
# later (a monkeypatch) is read again, not judged by its predecessor's verdict.
_forms: dict[tuple, bool] = {}
_forms_lock = threading.Lock()


def _reads_as(kind: str, cls: type, forward: str) -> bool:
    """Whether ``cls``'s forward's source is ``forward`` verbatim (dedented), read once per (kind, class,
    forward)."""
    key = (kind, cls, getattr(cls, "forward", None))
    form = _forms.get(key)  # a verdict never changes once set: read without the lock (per layer, per forward)
    if form is not None:
        return form
    with _forms_lock:
        form = _forms.get(key)
        if form is None:
            try:
                source = textwrap.dedent(inspect.getsource(cls.forward))
            except (OSError, TypeError):
                source = ""
            form = _forms[key] = source == forward
    return form


def is_llama_rms_norm(module: nn.Module) -> bool:
    """Whether ``module`` computes the Llama-form RMSNorm: its class's forward is ``LLAMA_RMS_NORM_FORWARD``
    verbatim, it has a 1-D ``weight`` parameter and a float ``variance_epsilon``."""
    form = _reads_as("norm", type(module), LLAMA_RMS_NORM_FORWARD)
    weight = getattr(module, "weight", None)
    return (
        form
        and isinstance(weight, nn.Parameter)
        and weight.dim() == 1
        and isinstance(getattr(module, "variance_epsilon", None), float)
    )


def is_llama_attention(module: nn.Module) -> bool:
    """Whether ``module`` is transformers' own ``LlamaAttention`` with the forward and rotary helpers above
    (``LLAMA_ATTENTION_FORWARD``, ``LLAMA_ROTARY``) and an even head dim."""
    cls = type(module)
    key = ("attention", cls, getattr(cls, "forward", None))
    with _forms_lock:
        form = _forms.get(key)
        if form is None:
            form = _forms[key] = _reads_as_llama_attention(cls)
    head_dim = getattr(module, "head_dim", None)
    return (
        form
        and isinstance(head_dim, int)
        and head_dim % 2 == 0
        and all(isinstance(getattr(module, n, None), nn.Module) for n in _PROJECTIONS)
        and isinstance(getattr(module, "layer_idx", None), int)
        and isinstance(getattr(module, "scaling", None), float)
    )


def is_llama_mlp(module: nn.Module) -> bool:
    """Whether ``module``'s class's forward is ``LLAMA_MLP_FORWARD`` verbatim, with its three projections
    and a callable ``act_fn``."""
    form = _reads_as("mlp", type(module), LLAMA_MLP_FORWARD)
    return (
        form
        and all(isinstance(getattr(module, n, None), nn.Module) for n in _MLP_PROJECTIONS)
        and callable(getattr(module, "act_fn", None))
    )


def is_llama_decoder_layer(module: nn.Module) -> bool:
    """Whether ``module``'s class's forward is ``LLAMA_DECODER_LAYER_FORWARD`` verbatim (read through its
    wrappers: transformers' ``deprecate_kwarg`` and gradient-checkpointing ones), with its four parts."""
    form = _reads_as("layer", type(module), LLAMA_DECODER_LAYER_FORWARD)
    return form and all(isinstance(module._modules.get(n), nn.Module) for n in _LAYER_PARTS)


_MODULE_CALL = nn.Module.__call__
_MODULE_CALL_IMPL = nn.Module._call_impl


def _plain_calls(modules) -> bool:
    """Whether calling each of ``modules`` runs exactly its ``forward`` and nothing else: torch's own module
    call (``__call__``, ``_call_impl``, neither replaced on the class nor ``_call_impl`` on the instance), not
    compiled, no forward or backward hooks of the module's nor global ones, not under JIT tracing (the fast
    path of ``Module._call_impl``, which calls ``forward`` alone)."""
    if (
        torch_module._global_forward_hooks
        or torch_module._global_forward_pre_hooks
        or torch_module._global_backward_hooks
        or torch_module._global_backward_pre_hooks
        or torch._C._get_tracing_state()
    ):
        return False
    for m in modules:
        cls = type(m)
        if (
            cls.__call__ is not _MODULE_CALL
            or cls._call_impl is not _MODULE_CALL_IMPL
            or "_call_impl" in m.__dict__
            or m._compiled_call_impl is not None
            or m._forward_hooks
            or m._forward_pre_hooks
            or m._backward_hooks
            or m._backward_pre_hooks
        ):
            return False
    return True


def is_silu(act: object) -> bool:
    """Whether the activation module ``act`` computes ``F.silu`` as its own forward: ``nn.SiLU`` (not in
    place) or transformers' ``SiLUActivation`` whose forward reads ``SILU_ACTIVATION_FORWARD`` (not swapped
    for a hub kernel), with no instance ``forward`` and no forward hooks (nor global ones), which only its
    own call would run."""
    if not isinstance(act, nn.Module) or "forward" in act.__dict__:
        return False
    if act._forward_hooks or act._forward_pre_hooks:
        return False
    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return False
    if torch.nn.functional.silu is not _F_SILU:  # both forms call it by name at every call
        return False
    cls = type(act)
    if cls is nn.SiLU:
        return cls.forward is _NN_SILU_FORWARD and not act.inplace
    return cls.__name__ == "SiLUActivation" and _reads_as("silu", cls, SILU_ACTIVATION_FORWARD)


def _reads_as_llama_attention(cls: type) -> bool:
    forward = inspect.unwrap(cls.forward)
    if getattr(forward, "__module__", None) != _LLAMA_MODULE:
        return False
    try:
        source = textwrap.dedent(inspect.getsource(forward))
        module_source = inspect.getsource(inspect.getmodule(forward))
    except (OSError, TypeError):
        return False
    return source == LLAMA_ATTENTION_FORWARD and all(part in module_source for part in LLAMA_ROTARY)


class FusedModules:
    """The fused replacements for one model's modules (its Llama-form RMSNorms, its Llama attention, its
    Llama-form MLPs and decoder layers), installed by ``applied``."""

    def __init__(self, model: nn.Module) -> None:
        self.norms = [m for m in model.modules() if is_llama_rms_norm(m)]
        self.attentions = [m for m in model.modules() if is_llama_attention(m)]
        self.mlps = [m for m in model.modules() if is_llama_mlp(m)]
        self.layers = [m for m in model.modules() if is_llama_decoder_layer(m)]
        self._installs = [(m, _fused_norm_forward(self, m)) for m in self.norms]
        self._installs += [(m, _fused_attention_forward(self, m)) for m in self.attentions]
        self._installs += [(m, _fused_mlp_forward(self, m)) for m in self.mlps]
        self._installs += [(m, _fused_layer_forward(self, m)) for m in self.layers]
        # Each fused module's forward, by module: ``_decode_layer`` runs a layer in one op only where its
        # parts run these (installed by ``applied``, not a wrapper's own).
        self._forward_of = {id(m): fwd for m, fwd in self._installs}
        self._norms = {id(m) for m in self.norms}
        self._attention_constants = {id(m): (m.layer_idx, m.head_dim, m.scaling) for m in self.attentions}
        self._mlps = {id(m) for m in self.mlps}
        self._lock = threading.Lock()
        self._threads: Counter[int] = Counter()  # threads inside applied(), with their depth
        self._installed: list = []  # what applied() installed: (module, forward), where it had no own forward

    def active(self) -> bool:
        """Whether this thread is inside ``applied()``."""
        return threading.get_ident() in self._threads

    @contextmanager
    def applied(self) -> Iterator[None]:
        """Inside the block, on this thread, each fused module runs its fused forward. Re-entrant, and
        several threads may be inside at once (the modules are restored when the last one leaves)."""
        me = threading.get_ident()
        with self._lock:
            if not self._threads:  # a module with its own instance forward (a wrapper's) keeps it
                self._installed = [(m, fwd) for m, fwd in self._installs if "forward" not in m.__dict__]
                for m, fwd in self._installed:
                    m.__dict__["forward"] = fwd
            self._threads[me] += 1
        try:
            yield
        finally:
            with self._lock:
                self._threads[me] -= 1
                if self._threads[me] == 0:
                    del self._threads[me]
                if not self._threads:  # only what was installed here: anything set meanwhile stays
                    for m, fwd in self._installed:
                        if m.__dict__.get("forward") is fwd:
                            del m.__dict__["forward"]


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


def _fused_attention_forward(fused: FusedModules, module: nn.Module):
    """Llama's attention while fused: HF's projections, ``ops.rotary_and_cache`` in place of its rotary
    embedding and the engine's cache write, the engine's paged attention (as ``paged_attention_forward``
    calls it), HF's output projection. HF's own forward wherever the fused path does not apply."""
    own = type(module).forward
    layer, head_dim, scaling = module.layer_idx, module.head_dim, module.scaling

    def forward(hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        meta = attention.bound()
        if (
            meta is None
            or attention_mask is not None
            or cache is not None
            or kwargs.get("past_key_values") is not None
            or position_embeddings is None
            or module.training
            or hidden_states.dim() != 3
            or hidden_states.shape[0] != 1
            or hidden_states.dtype not in _FUSED_DTYPES
            or hidden_states.device.type != "cpu"
            or meta.kv_cache.dtype != hidden_states.dtype
            or meta.kv_cache.device.type != "cpu"
            or position_embeddings[0].dtype != hidden_states.dtype
            or torch.is_grad_enabled()
            or torch.is_autocast_enabled("cpu")
            or not fused.active()
        ):
            return own(module, hidden_states, position_embeddings, attention_mask, cache, **kwargs)
        num_tokens = hidden_states.shape[1]
        cos, sin = position_embeddings
        # The projections are looked up at every call (an adapter library may have wrapped them since).
        projections = (module.q_proj, module.k_proj, module.v_proj)
        qkv = packed.grouped(projections, hidden_states) or [p(hidden_states) for p in projections]
        # [T, H, D] views, rows strided where the product was grouped: rotary_and_cache reads them in place
        q, k, v = ((t if t.stride(-1) == 1 else t.contiguous()).view(num_tokens, -1, head_dim) for t in qkv)
        q = ops.rotary_and_cache(q, k, v, cos[0], sin[0], meta.kv_cache, meta.slot_mapping, layer)
        out = ops.paged_attention(
            q,
            meta.kv_cache,
            layer,
            meta.block_tables,
            meta.context_lens,
            meta.cu_seqlens_q,
            scaling,
            max_q_len=meta.max_q_len,
            max_context_len=meta.max_context_len,
            backend=meta.backend,
            plan=meta.plan,
        )
        return module.o_proj(out.view(1, num_tokens, -1)), None

    return forward


def _fused_mlp_forward(fused: FusedModules, module: nn.Module):
    """The MLP's forward while fused: its gate and up projections as one grouped product of the packed
    weights (``packed.grouped``) where the packs have it, on this thread, outside autograd; the module's own
    forward elsewhere (the same arithmetic, one product per projection)."""
    own = type(module).forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        gate_up = None
        if fused.active() and not torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu"):
            gate_up = packed.grouped((module.gate_proj, module.up_proj), x)
        if gate_up is None:
            return own(module, x)
        gate, up = gate_up
        width = gate.shape[-1]
        if is_silu(module.act_fn) and ops.silu_mul_exact(gate.numel() // max(1, width), width, gate.dtype):
            return module.down_proj(ops.silu_mul(gate, up))  # on the halves in place, bitwise the two ops
        # Contiguous, as the members' own products are: an elementwise op over a view whose rows are strided
        # takes each row's tail through its scalar path, which rounds otherwise (SiLU's exp).
        gate, up = (t.contiguous() for t in gate_up)
        return module.down_proj(module.act_fn(gate) * up)

    return forward


def _fused_layer_forward(fused: FusedModules, module: nn.Module):
    """The decoder layer's forward while fused: HF's forward's calls, in its order, each sub-module entered
    through its ``forward`` where ``_plain_calls`` says torch's module call would do nothing else, on this
    thread, outside autograd; the layer's own forward elsewhere (its wrappers included: a ``past_key_values``
    keyword, gradient checkpointing)."""
    own = type(module).forward
    parts = module._modules

    def forward(*args, **kwargs):
        # The sub-modules are looked up at every call (a wrapper may have replaced them since).
        norm, attn, post_norm, mlp = (parts.get(n) for n in _LAYER_PARTS)
        if (
            not fused.active()
            or torch.is_grad_enabled()
            or "past_key_values" in kwargs
            or not _plain_calls((norm, attn, post_norm, mlp))
        ):
            # HF's forward with the arguments exactly as given: its wrappers rename ``past_key_values`` and
            # act on ``cache`` only where the caller passed them.
            return own(module, *args, **kwargs)
        out = _decode_layer(fused, norm, attn, post_norm, mlp, *args, **kwargs)
        return _layer_body(norm, attn, post_norm, mlp, *args, **kwargs) if out is None else out

    return forward


def _layer_body(
    norm,
    attn,
    post_norm,
    mlp,
    hidden_states,
    attention_mask=None,
    position_ids=None,
    cache=None,
    use_cache=False,
    position_embeddings=None,
    **kwargs,
):
    """``LLAMA_DECODER_LAYER_FORWARD``'s body (its parameters and defaults), each part entered through its
    ``forward``."""
    residual = hidden_states
    hidden_states = norm.forward(hidden_states)
    hidden_states, _ = attn.forward(
        hidden_states=hidden_states,
        attention_mask=attention_mask,
        position_ids=position_ids,
        cache=cache,
        use_cache=use_cache,
        position_embeddings=position_embeddings,
        **kwargs,
    )
    hidden_states = residual + hidden_states
    residual = hidden_states
    hidden_states = post_norm.forward(hidden_states)
    hidden_states = mlp.forward(hidden_states)
    return residual + hidden_states


def _decode_layer(
    fused: FusedModules,
    norm,
    attn,
    post_norm,
    mlp,
    hidden_states,
    attention_mask=None,
    position_ids=None,  # noqa: ARG001 (the fused attention does not read it either)
    cache=None,
    use_cache=False,  # noqa: ARG001
    position_embeddings=None,
    **kwargs,
) -> torch.Tensor | None:
    """``_layer_body``'s result in one op (``ops.llama_decode_layer``), where every call the body would make
    is one that op makes, on the same operands (``_decode_ready`` and ``_layer_operands``); ``None`` elsewhere
    (the caller runs the body). The op's result is bit for bit the body's (tests/test_fused.py)."""
    meta = attention.bound()
    if (
        attention_mask is not None
        or cache is not None
        or (kwargs and kwargs.get("past_key_values") is not None)
        or not _decode_ready(meta, hidden_states, position_embeddings)
    ):
        return None
    packs = packed.applied_packs()
    d = (
        None
        if packs is None
        else _layer_operands(fused, norm, attn, post_norm, mlp, hidden_states.shape[1], packs)
    )
    if d is None:
        return None
    cos, sin = position_embeddings
    return ops.llama_decode_layer(
        hidden_states,
        d.input_norm,
        d.qkv,
        d.head_dim,
        cos[0],
        sin[0],
        meta.kv_cache,
        meta.slot_mapping,
        d.layer,
        meta.block_tables,
        meta.context_lens,
        meta.cu_seqlens_q,
        d.scale,
        d.o,
        d.post_norm,
        d.gate_up,
        d.down,
    )


def _decode_ready(meta, hidden_states: torch.Tensor, position_embeddings) -> bool:
    """The conditions of ``_decode_layer`` that do not depend on the layer: the layer op on, the attention's
    C++ path bound (``_fused_attention_forward``'s: a CPU cache of the hidden states' dtype, rotary tables of
    that dtype, no autocast, Triton not standing in for the C++ ops), bf16 hidden states ``[1, T, H]``."""
    return not (
        not DECODE_LAYERS
        or meta is None
        or position_embeddings is None
        or hidden_states.dtype != _BF16
        or hidden_states.dim() != 3
        or hidden_states.shape[0] != 1
        or hidden_states.device.type != "cpu"
        or not hidden_states.is_contiguous()
        or meta.kv_cache.dtype != _BF16
        or meta.kv_cache.device.type != "cpu"
        or position_embeddings[0].dtype != _BF16
        or torch.is_autocast_enabled("cpu")
        or ops.triton_on_cpu_active()
    )


def _layer_operands(
    fused: FusedModules, norm, attn, post_norm, mlp, rows: int, packs: packed.PackedLinears
) -> ops.DecodeLayer | None:
    """A layer's operands for ``ops.llama_decode_layer(s)`` (``_decode_ready`` holding, inside ``applied`` on
    this thread, outside autograd), where every call the layer body would make over ``rows`` bf16 rows is one
    that op makes: each of the four parts runs its fused forward (installed by ``applied``), both norms
    ``ops.rms_norm``, the attention its C++ path, each of the four products ``ops.small_linear`` with its
    probed run (``packed.small_operands``: the grouped q|k|v and gate|up, the output and down projections,
    each entered through a plain module call), and the MLP's SiLU and product ``ops.silu_mul``; ``None``
    elsewhere. Sub-modules and parameters are read from the modules' own tables (``_modules``,
    ``_parameters``: what attribute access returns for these exact classes, without
    ``Module.__getattr__``), since these checks run for every layer of every decode forward."""
    if attn.training:
        return None
    ours = fused._forward_of
    for m in (norm, attn, post_norm, mlp):
        own = ours.get(id(m))
        if own is None or m.__dict__.get("forward") is not own:
            return None
    constants = fused._attention_constants.get(id(attn))
    if constants is None or id(mlp) not in fused._mlps or id(norm) not in fused._norms:
        return None
    if id(post_norm) not in fused._norms:
        return None
    weights = (norm._parameters.get("weight"), post_norm._parameters.get("weight"))
    for w in weights:
        if w is None or w.dtype != _BF16 or w.device.type != "cpu" or not w.is_contiguous():
            return None
    am, mm = attn._modules, mlp._modules
    q, k, v, o = am.get("q_proj"), am.get("k_proj"), am.get("v_proj"), am.get("o_proj")
    gate, up, down = mm.get("gate_proj"), mm.get("up_proj"), mm.get("down_proj")
    if o is None or down is None or gate is None or up is None or not _plain_calls((o, down)):
        return None
    if not is_silu(mm.get("act_fn")):
        return None
    qkv = packs.small_operands((q, k, v), rows)
    o_op = qkv and packs.small_operands((o,), rows)
    gate_up = o_op and packs.small_operands((gate, up), rows)
    down_op = gate_up and packs.small_operands((down,), rows)
    if down_op is None:
        return None
    gate_width = gate.out_features
    if not ops.silu_mul_exact(rows, gate_width, _BF16):
        return None
    layer, head_dim, scaling = constants
    return ops.DecodeLayer(
        (weights[0], norm.variance_epsilon),
        (*qkv, [q.out_features, k.out_features, v.out_features]),
        head_dim,
        layer,
        scaling,
        o_op,
        (weights[1], post_norm.variance_epsilon),
        (*gate_up, [gate_width, up.out_features]),
        down_op,
    )


# transformers' LlamaModel and LlamaForCausalLM forwards (as of 5.x), normalised (``ast.unparse``, the
# docstring dropped): ``decode_logits`` runs their statements for the runner's call, so a class qualifies
# only where its forwards read exactly so, decorators included.
LLAMA_MODEL_FORWARD = """\
@deprecate_kwarg('past_key_values', '5.40.0', new_name='cache')
@merge_with_config_defaults
@capture_outputs
@auto_docstring
def forward(self, input_ids: torch.LongTensor | None=None, attention_mask: torch.Tensor | None=None, \
position_ids: torch.LongTensor | None=None, cache: Cache | None=None, \
inputs_embeds: torch.Tensor | None=None, use_cache: bool | None=None, \
**kwargs: Unpack[TransformersKwargs]) -> BaseModelOutputWithPast:
    if (input_ids is None) ^ (inputs_embeds is not None):
        raise ValueError('You must specify exactly one of input_ids or inputs_embeds')
    if inputs_embeds is None:
        inputs_embeds: torch.Tensor = self.embed_tokens(input_ids)
    if use_cache and cache is None:
        cache = DynamicCache(config=self.config)
    if position_ids is None:
        past_seen_tokens = cache.get_seq_length() if cache is not None else 0
        position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
        position_ids = position_ids.unsqueeze(0)
    causal_mask = create_causal_mask(config=self.config, inputs_embeds=inputs_embeds, \
attention_mask=attention_mask, cache=cache, position_ids=position_ids)
    hidden_states = inputs_embeds
    position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
    for decoder_layer in self.layers[:self.config.num_hidden_layers]:
        hidden_states = decoder_layer(hidden_states, attention_mask=causal_mask, \
position_embeddings=position_embeddings, position_ids=position_ids, cache=cache, use_cache=use_cache, \
**kwargs)
    hidden_states = self.norm(hidden_states)
    return BaseModelOutputWithPast(last_hidden_state=hidden_states, cache=cache)"""
LLAMA_CAUSAL_LM_FORWARD = """\
@deprecate_kwarg('past_key_values', '5.40.0', new_name='cache')
@can_return_tuple
@auto_docstring
def forward(self, input_ids: torch.LongTensor | None=None, attention_mask: torch.Tensor | None=None, \
position_ids: torch.LongTensor | None=None, cache: Cache | None=None, \
inputs_embeds: torch.Tensor | None=None, labels: torch.LongTensor | None=None, use_cache: bool | None=None, \
logits_to_keep: int | torch.Tensor=0, \
**kwargs: Unpack[TransformersKwargs]) -> CausalLMOutputWithPast:
    outputs: BaseModelOutputWithPast = self.model(input_ids=input_ids, attention_mask=attention_mask, \
position_ids=position_ids, cache=cache, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
    hidden_states = outputs.last_hidden_state
    hidden_states = slice_logits_to_keep(hidden_states, logits_to_keep)
    logits = self.lm_head(hidden_states)
    loss = None
    if labels is not None:
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
    return CausalLMOutputWithPast(loss=loss, logits=logits, cache=outputs.cache, \
hidden_states=outputs.hidden_states, attentions=outputs.attentions)"""
_MODEL_PARTS = ("embed_tokens", "layers", "norm", "rotary_emb")


def _normalised_source(function) -> str:
    """``function``'s source (through its wrappers, decorators included) as ``ast.unparse`` writes it, without
    its docstring; ``""`` where it cannot be read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return ""
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.FunctionDef):
        return ""
    node = tree.body[0]
    first = node.body[0] if node.body else None
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        node.body = node.body[1:]
    return ast.unparse(node)


def _reads_as_normalised(kind: str, cls: type, forward: str, wrappers: tuple[str, ...] = ()) -> bool:
    """Whether ``cls``'s forward reads as ``forward`` (``_normalised_source``) and is wrapped by exactly
    ``wrappers`` (``_WRAPPERS``' names, outermost first) around a function of transformers' Llama module: the
    source read through the wrappers is the innermost function's, so the chain itself is checked too (a
    wrapper patched on over it, or a copy with wrappers of its own, does not read so). Read once per (kind,
    class, forward)."""
    key = (kind, cls, getattr(cls, "forward", None), wrappers)
    form = _forms.get(key)  # read without the lock, as in _reads_as
    if form is not None:
        return form
    with _forms_lock:
        form = _forms.get(key)
        if form is None:
            form = _forms[key] = (
                _wrapped_as(cls.forward, wrappers) and _normalised_source(cls.forward) == forward
            )
    return form


def _wrapped_as(function, wrappers: tuple[str, ...]) -> bool:
    """Whether ``function`` is ``wrappers`` (by their code: transformers' own decorators') around a function
    defined in transformers' ``modeling_llama`` module."""
    import sys  # noqa: PLC0415

    codes = _wrapper_codes()
    for name in wrappers:
        code = getattr(function, "__code__", None)
        if code is None or code is not codes.get(name):
            return False
        function = getattr(function, "__wrapped__", None)
    llama = sys.modules.get(_LLAMA_MODULE)
    code = getattr(function, "__code__", None)
    return (
        llama is not None
        and code is not None
        and not hasattr(function, "__wrapped__")
        and code.co_filename == getattr(llama, "__file__", None)
    )


_wrapper_code_cache: dict[str, object] = {}
_wrapper_code_lock = threading.Lock()


def _wrapper_codes() -> dict[str, object]:
    """The code of the wrapper each of transformers' decorators makes (``_WRAPPERS``), by name; empty where
    transformers lacks one (nothing then reads as a form that names it)."""
    with _wrapper_code_lock:  # not _forms_lock: _reads_as_normalised holds that one while calling here
        if _wrapper_code_cache:
            return _wrapper_code_cache
    codes = {}
    try:
        from transformers.utils.deprecation import deprecate_kwarg  # noqa: PLC0415
        from transformers.utils.generic import can_return_tuple, merge_with_config_defaults  # noqa: PLC0415
        from transformers.utils.output_capturing import capture_outputs  # noqa: PLC0415

        def probe(self):  # noqa: ARG001
            return None

        codes = {
            "deprecate_kwarg": deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")(probe).__code__,
            "merge_with_config_defaults": merge_with_config_defaults(probe).__code__,
            "capture_outputs": capture_outputs(probe).__code__,
            "can_return_tuple": can_return_tuple(probe).__code__,
        }
    except (ImportError, AttributeError, TypeError):
        codes = {"": None}  # cached: no form naming a wrapper qualifies
    with _wrapper_code_lock:
        _wrapper_code_cache.update(codes)
        return _wrapper_code_cache


# The wrappers transformers' LlamaModel and LlamaForCausalLM forwards carry (as of 5.x), outermost first
# (``auto_docstring`` returns the function itself).
_MODEL_WRAPPERS = ("deprecate_kwarg", "merge_with_config_defaults", "capture_outputs")
_CAUSAL_LM_WRAPPERS = ("deprecate_kwarg", "can_return_tuple")


def _output_capture_asked(config) -> bool:
    """Whether ``config`` asks the model's wrappers for anything beyond the logits: captured outputs
    (``output_attentions``, ``output_hidden_states``, any other ``output_*`` flag), a tuple
    (``return_dict`` off), a causal flag the wrappers pass to every layer (``is_causal``)."""
    if getattr(config, "return_dict", True) is not True or getattr(config, "is_causal", None) is not None:
        return True
    if getattr(config, "output_attentions", False) or getattr(config, "output_hidden_states", False):
        return True
    return any(k.startswith("output_") and v for k, v in vars(config).items())


def decode_logits(
    fused: FusedModules,
    model: nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    logits_to_keep: int | torch.Tensor,
) -> torch.Tensor | None:
    """``model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
    logits_to_keep=logits_to_keep).logits`` for a causal LM whose forward and whose base model's read as
    transformers' Llama ones (``LLAMA_CAUSAL_LM_FORWARD``, ``LLAMA_MODEL_FORWARD``): their statements for this
    call, each sub-module entered through its own module call (the embedding, the rotary embedding, the
    final norm, the LM head: their hooks run), except the decoder layers, which run as one
    ``ops.llama_decode_layers`` where each would run as ``ops.llama_decode_layer`` (``_layer_operands``), and
    through HF's loop elsewhere. ``None`` (nothing run: the caller calls the model) where the two models'
    calls and wrappers would do more than their statements: a hook on either, a wrapper's instance forward,
    output capture or a tuple asked for by a config, autograd, outside ``applied`` on this thread."""
    if not (DECODE_MODEL and DECODE_LAYERS) or not fused.active() or torch.is_grad_enabled():
        return None
    base = model._modules.get("model")
    if base is None or not _reads_as_normalised(
        "causal_lm", type(model), LLAMA_CAUSAL_LM_FORWARD, _CAUSAL_LM_WRAPPERS
    ):
        return None
    if not _reads_as_normalised("llama_model", type(base), LLAMA_MODEL_FORWARD, _MODEL_WRAPPERS):
        return None
    if "forward" in model.__dict__ or "forward" in base.__dict__ or not _plain_calls((model, base)):
        return None
    config, head_config = base.__dict__.get("config"), model.__dict__.get("config")
    if (
        config is None
        or head_config is None
        or _output_capture_asked(config)
        or _output_capture_asked(head_config)
    ):
        return None
    # transformers' output-capture hooks, once installed, record into the collector its wrapper sets for
    # the model's call: that call runs them.
    if model.__dict__.get("_output_capturing_hooks_installed") or base.__dict__.get(
        "_output_capturing_hooks_installed"
    ):
        return None
    parts = base._modules
    embed, layers, norm, rotary = (parts.get(n) for n in _MODEL_PARTS)
    lm_head = model._modules.get("lm_head")
    if embed is None or layers is None or norm is None or rotary is None or lm_head is None:
        return None
    stack = layers[: config.num_hidden_layers]
    if not len(stack) or not _plain_calls(stack):  # a hooked layer: the model's call
        return None
    head_names = inspect.unwrap(type(model).forward).__globals__
    names = inspect.unwrap(type(base).forward).__globals__
    # LlamaModel.forward's statements for (input_ids, position_ids, use_cache=False), then LlamaForCausalLM's.
    inputs_embeds = embed(input_ids)
    causal_mask = names["create_causal_mask"](
        config=config, inputs_embeds=inputs_embeds, attention_mask=None, cache=None, position_ids=position_ids
    )
    hidden_states = inputs_embeds
    position_embeddings = rotary(hidden_states, position_ids=position_ids)
    operands = _model_operands(fused, stack, hidden_states, causal_mask, position_embeddings)
    if operands is None:
        for decoder_layer in stack:
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=causal_mask,
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                cache=None,
                use_cache=False,
            )
    else:
        meta = attention.bound()
        cos, sin = position_embeddings
        hidden_states = ops.llama_decode_layers(
            hidden_states,
            operands,
            cos[0],
            sin[0],
            meta.kv_cache,
            meta.slot_mapping,
            meta.block_tables,
            meta.context_lens,
            meta.cu_seqlens_q,
        )
    hidden_states = norm(hidden_states)
    hidden_states = head_names["slice_logits_to_keep"](hidden_states, logits_to_keep)
    return lm_head(hidden_states)


def _model_operands(
    fused: FusedModules, stack, hidden_states: torch.Tensor, causal_mask, position_embeddings
) -> list[ops.DecodeLayer] | None:
    """Each layer's ``_layer_operands`` where every layer of ``stack`` called as HF's loop calls it would run
    as ``ops.llama_decode_layer``: the call (plain: ``decode_logits`` checked) enters the fused layer forward
    installed by ``applied``, which passes to ``_decode_layer`` (its four parts' calls plain, no mask), which
    takes the op; ``None`` where any would not."""
    meta = attention.bound()
    if causal_mask is not None or not _decode_ready(meta, hidden_states, position_embeddings):
        return None
    packs = packed.applied_packs()
    if packs is None:
        return None
    rows = hidden_states.shape[1]
    ours = fused._forward_of
    out = []
    for layer in stack:
        own = ours.get(id(layer))
        if own is None or layer.__dict__.get("forward") is not own:
            return None
        parts = layer._modules
        norm, attn, post_norm, mlp = (parts.get(n) for n in _LAYER_PARTS)
        if not _plain_calls((norm, attn, post_norm, mlp)):
            return None
        d = _layer_operands(fused, norm, attn, post_norm, mlp, rows, packs)
        if d is None:
            return None
        out.append(d)
    return out


_BF16 = torch.bfloat16
# Whether a Llama-form decoder layer of a few bf16 rows may run as one op (``_decode_layer``); off, each of
# its calls runs one by one (for comparisons, and for the twin's calibration, which times each product as the
# forward calls it: ``sim/calibration.py``'s ``_time_packed_calls``).
DECODE_LAYERS = True
# Whether a Llama causal LM's forward may run its layers as one op (``decode_logits``, with
# ``DECODE_LAYERS``):
# off, the runner calls the model (each layer then runs as ``_decode_layer`` decides).
DECODE_MODEL = True


_by_model: weakref.WeakKeyDictionary[nn.Module, FusedModules] = weakref.WeakKeyDictionary()
_by_model_lock = threading.Lock()


def for_model(model: nn.Module) -> FusedModules:
    """The fused modules of ``model``, shared by every runner of it in the process."""
    with _by_model_lock:
        fused = _by_model.get(model)
        if fused is None:
            fused = _by_model[model] = FusedModules(model)
        return fused


# The sibling projections the fused forwards above call through ``packed.grouped``, by parent module.
packed.GROUPS.extend(
    [
        (("q_proj", "k_proj", "v_proj"), is_llama_attention),
        (("gate_proj", "up_proj"), is_llama_mlp),
    ]
)
