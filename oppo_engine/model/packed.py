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

**Grouped products.** Sibling projections that read one input (a Llama-form attention's ``q_proj``,
``k_proj`` and ``v_proj``; a Llama-form MLP's ``gate_proj`` and ``up_proj``) are also packed as one stacked
weight, and the fused forwards of ``model/fused.py``, which call them on one input, run one product in place
of two or three (``grouped``) and split its columns: on SmolLM2-135M's layers' bare products at M=16,
1.18x less time in bf16 and 1.09x in fp32, 1.01-1.04x from 128 rows up; in the engine's decode step
0.96-1.08x, within the measuring machine's spread (docs/benchmarks.md, "Grouped products"). A group is used
only where its product equals its members' own packed products bit for bit, checked on probes of
``PROBE_ROWS`` rows (once per process for each dtype, shape, bias, batch hint and thread count: measured,
oneDNN sums an output column over K alike whatever N is at these sizes; where it does not, the group is
declined and ``PackedLinears.ungrouped`` counts it), so the engine's numbers are those of the members alone;
a member with forward hooks (or global module hooks) runs alone, so its hooks run. The members keep their
own packs (for any other caller): a group's stacked copy is memory on top, held only while grouping serves.

**A few bf16 rows.** Up to ``SMALL_ROWS`` rows (a decode batch of up to 64 sequences), a bias-free bf16
product runs as ``ops.small_linear`` over a second copy of the weight, blocked in 16-column panels (made with
the pack from the same tensor, held and dropped with it, counted in ``nbytes``; for a group's stacked weight
and not its members' while the group serves), which reads each panel once for up to 16 rows a pass (oneDNN's
kernels took 1.02-1.82x its time there, 1.02-1.21x at 64 rows: docs/benchmarks.md). It is used only where a
probe found it bit for bit oneDNN's product for those rows, that shape, the pack's batch hint and the thread
count (``ops.small_linear_kblock``, once per process and band of rows): oneDNN sums an output in float32 over
runs of 512 or 1024 inputs and adds the runs' sums, and the op does the same. So the rollouts are those of
oneDNN's products to the bit (tests/test_small_linear.py); a product with a bias, in fp32, or of more rows
is oneDNN's.

The packed copies live beside the model's weights (one more copy of every ``nn.Linear`` weight: the
actor's only) and are swapped in for the duration of the runner's forward: each module's ``forward`` is
set on the instance, then removed, so the trainer's forwards and backwards never see them (a module that
already has an instance ``forward``, such as accelerate's hooks, keeps it and is not packed). They follow the
weights: before every forward a module whose weight tensor was replaced or written in place (its
``_version``, which most in-place ops bump: torch's default optimizer steps, ``copy_``, ``load_state_dict``),
or whose data was swapped under it (``param.data = t``, ``module.to(dtype)``: the same tensor and version at
another address or with other strides; the old storage is held until then, so its address cannot come back
while it stays allocated), is packed again, and ``update_policy()`` drops every pack of the actor and
critic (``drop``), which covers writes that bypass the version counter (``param.data.copy_``, and torch's
fused optimizer kernels, which ``PPOTrainer`` uses: they leave ``_version`` as it was), and swaps to data at
the same address with the same strides (``vector_to_parameters`` of a vector updated in place since, a held
storage freed and allocated again under the same object). ``update_policy()`` is the guarantee; the checks
catch the in-place writes and swaps of a user's own code between two of them.
``release_memory(weights=True)`` drops them too.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from oppo_engine import ops


class _Entry:
    """One module's pack: the weight tensor it was made from, that tensor's version then, and the forward
    that runs it (made once per pack, not once per model forward)."""

    __slots__ = (
        "module",
        "weight",
        "version",
        "address",
        "strides",
        "storage",
        "packed",
        "forward",
        "blocked",
    )

    def __init__(self, module: nn.Linear) -> None:
        self.module = module
        self.weight: torch.Tensor | None = None
        self.version = -1
        # The weight's data address and strides when packed, and its storage, held so that the address cannot
        # be reused: ``param.data = t`` and ``module.to(dtype)`` keep the tensor and its version, not the
        # address (``w.data = w.data.t()`` keeps the address of a square weight, not its strides).
        self.address = 0
        self.strides: tuple[int, ...] = ()
        self.storage = None
        self.packed: torch.Tensor | None = None
        self.forward = None
        # The weight blocked for ops.small_linear, made with the pack from the same weight (``_blocked``);
        # None where the small products are off or not possible for this weight.
        self.blocked: torch.Tensor | None = None


# Attribute names of sibling projections that a fused forward calls on one input through ``grouped``, each
# with the predicate on their parent module that says its fused forward is that one: registered by
# model/fused.py, which owns those forwards (this module does not import it).
GROUPS: list[tuple[tuple[str, ...], Callable[[nn.Module], bool]]] = []
# Up to this many rows a packed bf16 product runs as ``ops.small_linear`` where that is bitwise oneDNN's
# (``PackedLinears._small``); 0 turns it off (for comparisons).
SMALL_ROWS = ops.SMALL_LINEAR_ROWS
# Rows of the probes on which a group's stacked product is checked against its members' own (besides the
# pack's batch hint): decode batches and prefill chunks, even and odd.
PROBE_ROWS = (1, 3, 8, 17, 64, 100, 256, 1000)


class _Group:
    """Sibling modules packed as one stacked weight: their entries, the members' (weight, version, pack) the
    pack was made from, the pack (``None`` where the stacked product is not bitwise the members'), each
    member's output width, and whether every member is packed for the current forward (``live``)."""

    __slots__ = ("entries", "made_from", "packed", "widths", "live", "blocked")

    def __init__(self, entries: list[_Entry]) -> None:
        self.entries = entries
        self.made_from: tuple | None = None
        self.packed: torch.Tensor | None = None
        self.widths = [e.module.out_features for e in entries]
        self.live = False
        self.blocked: torch.Tensor | None = None  # as _Entry.blocked, of the stacked weight


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
        self._by_module = by_module = {id(e.module): e for e in self._entries}
        self._groups: dict[tuple[int, ...], _Group] = {}
        for m in model.modules():  # only the groups a fused forward calls ``grouped`` for: nothing held idle
            for names, form in GROUPS:
                members = [getattr(m, name, None) for name in names]
                if all(id(x) in by_module for x in members) and form(m):
                    self._groups[tuple(map(id, members))] = _Group([by_module[id(x)] for x in members])
        self._lock = threading.Lock()
        self._thread = 0  # the thread of the forward holding the packs (a packed forward checks it)
        self.repacks = 0  # modules packed so far (the first packing included)
        self._made_hint = self.batch_hint  # the batch hint the packs held were made with
        self.grouping = True  # whether ``grouped`` serves groups (off: every member alone; for comparisons)
        self.ungrouped = 0  # group packings whose stacked product was not bitwise the members' (declined)

    @property
    def nbytes(self) -> int:
        """Bytes held by the packed copies now."""
        return sum(p.numel() * p.element_size() for p in self._held())

    @property
    def held(self) -> int:
        """How many packed tensors are held now (the modules' and the groups' stacked ones)."""
        return len(self._held())

    def _held(self) -> list[torch.Tensor]:
        holders = [*self._entries, *self._groups.values()]
        packs = [h.packed for h in holders] + [h.blocked for h in holders]
        return [p for p in packs if isinstance(p, torch.Tensor)]

    def drop(self) -> None:
        """Free every pack; the next forward packs again from the weights as they are then."""
        with self._lock:
            self._clear()

    def _clear(self) -> None:
        # The caller holds the lock.
        for e in self._entries:
            e.weight, e.version, e.packed, e.forward, e.blocked = None, -1, None, None, None
            e.address, e.strides, e.storage = 0, (), None
        for g in self._groups.values():
            g.made_from, g.packed, g.live, g.blocked = None, None, False, None

    def _refresh(self) -> list[_Entry]:
        """The entries to use in this forward, packing what is missing or stale.

        NOTE: this runs before every forward of the actor (211 modules on SmolLM2), so the support check,
        whose answer depends on a weight's dtype, device, rank and layout and on global settings (fp32
        matmul precision), is made once per distinct (dtype, device, rank, layout) per forward, not once
        per module."""
        if self._made_hint != self.batch_hint:  # every pack (and group verdict) at one batch hint
            self._clear()
            self._made_hint = self.batch_hint
        out = []
        supported: dict[tuple, bool] = {}
        for e in self._entries:
            w = _attribute(e.module, "weight")
            key = (w.dtype, w.device, w.dim(), w.layout)
            ok = supported.get(key)
            if ok is None:
                ok = supported[key] = ops.packed_linear_supported(w)
            if not ok or w.is_inference() or "forward" in e.module.__dict__:
                e.weight, e.version, e.packed, e.forward, e.blocked = None, -1, None, None, None
                e.address, e.strides, e.storage = 0, (), None
                continue
            version = w._version
            if (
                e.packed is None
                or e.weight is not w
                or e.version != version
                or e.address != w.data_ptr()
                or e.strides != w.stride()
            ):
                e.packed, e.blocked = ops.pack_linear_weight(w, self.batch_hint), _blocked(w)
                e.weight, e.version = w, version
                e.address, e.strides, e.storage = w.data_ptr(), w.stride(), w.untyped_storage()
                e.forward = _packed_forward(self, e)
                self.repacks += 1
            out.append(e)
        installed = {id(e) for e in out}
        for g in self._groups.values():
            self._refresh_group(g, installed)
        return out

    def _refresh_group(self, g: _Group, installed: set[int]) -> None:
        """``g`` is live when ``grouping`` is on and its members are all packed for this forward, in one
        dtype and input width, with biases on all or none; its stacked pack is made again when a member's
        pack was, and kept only where its product is bitwise the members' (``_bitwise_grouped``)."""
        # NOTE: loops and the modules' own tables rather than generators and ``Module.__getattr__``: this runs
        # for every group (60 on SmolLM2) before every forward.
        members = g.entries
        biases = [_attribute(e.module, "bias") for e in members]
        live = self.grouping
        for e in members:
            if id(e) not in installed:  # not packed for this forward (its weight may be None)
                live = False
                break
        if live:
            first = members[0].weight
            dtype, width, unbiased = first.dtype, first.shape[1], biases[0] is None
            for e, bias in zip(members, biases, strict=True):
                w = e.weight
                if w.dtype != dtype or w.shape[1] != width or (bias is None) != unbiased:
                    live = False
                    break
        g.live = live
        if not live:
            g.made_from, g.packed, g.blocked = None, None, None  # nothing held that no forward uses
            return
        made = g.made_from
        if made is not None:
            for (w, version, pack), e in zip(made, members, strict=True):
                if w is not e.weight or version != e.version or pack is not e.packed:
                    break
            else:
                return
        made_from = tuple((e.weight, e.version, e.packed) for e in members)  # a member packed again: stale
        g.made_from, g.packed, g.blocked = made_from, None, None
        if _verdicts.get(_verdict_key(g, biases, self.batch_hint)) is False:  # declined before: not packed
            self.ungrouped += 1
            return
        stacked = torch.cat([e.weight.detach() for e in members])
        g.packed = ops.pack_linear_weight(stacked, self.batch_hint)
        if not _bitwise_grouped(g, biases, self.batch_hint):
            g.packed = None
            self.ungrouped += 1
        elif all(b is None for b in biases):
            g.blocked = _blocked(stacked)
            if g.blocked is not None:  # the group serves these rows: its members' own copies are not kept
                for e in members:  # (alone, a member's product is then oneDNN's: the same bits)
                    e.blocked = None

    def grouped(self, modules: tuple[nn.Module, ...], x: torch.Tensor) -> list[torch.Tensor] | None:
        """``[m(x) for m in modules]`` as one product over their stacked pack: each output a view of its
        columns (contiguous in the last dimension, not across rows), bitwise what the member's own pack
        gives; ``None`` where that is not available (not a group of this model, a member not packed for this
        forward, the check failed, grouping off, another thread)."""
        g = self._groups.get(tuple(map(id, modules)))
        if g is None or not g.live or g.packed is None or threading.get_ident() != self._thread:
            return None
        if _hooked(modules):  # the members' hooks run only through their own calls
            return None
        biases = [m.bias for m in modules]  # read at every call, as a lone module's
        bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
        y = self._small(g, x, bias)
        if y is None:
            y = ops.packed_linear(x, g.packed, bias)
        return list(torch.split(y, g.widths, dim=-1))

    def _small(
        self, holder: _Entry | _Group, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor | None:
        """The packed product of a few bf16 rows as ``ops.small_linear`` (up to ``SMALL_ROWS`` rows, without
        a bias) over the copy blocked with the pack, where its probe found it bit for bit oneDNN's for these
        rows, this shape and the pack's batch hint (``small_product``); ``None`` elsewhere (the caller runs
        oneDNN's product)."""
        blocked = holder.blocked
        if bias is not None or blocked is None:
            return None
        return small_product(x, blocked, self._made_hint)

    def small_operands(self, modules: tuple[nn.Module, ...], rows: int) -> tuple[torch.Tensor, int] | None:
        """``(blocked weight, run)`` where the product of ``rows`` bf16 rows that this thread's forward would
        run for ``modules`` now -- ``grouped(modules, x)`` for several, the module's installed packed forward
        for one -- is ``ops.small_linear`` over that copy with that run; ``None`` where it would be anything
        else (oneDNN's product, the members alone, the module's own forward, a bias, another thread). The
        caller runs the product itself (``ops.llama_decode_layer``), so these are ``grouped``'s and
        ``_packed_forward``'s conditions, in full; the caller checks that a lone module's call would run only
        its ``forward``. The modules are exact ``nn.Linear``s (every entry is), whose ``bias`` is always in
        ``_parameters``: read there, without ``Module.__getattr__`` (this runs four times a layer)."""
        if threading.get_ident() != self._thread:
            return None
        if len(modules) > 1:
            g = self._groups.get(tuple(map(id, modules)))
            if g is None or not g.live or g.packed is None:
                return None
            if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
                return None
            for m in modules:
                if m._forward_hooks or m._forward_pre_hooks:
                    return None
            blocked = g.blocked
        else:
            m = modules[0]
            e = self._by_module.get(id(m))
            # Its packed forward installed for this forward (made with its current pack: ``_refresh`` makes a
            # new one at every packing), not a wrapper's.
            if e is None or e.forward is None or m.__dict__.get("forward") is not e.forward:
                return None
            blocked = e.blocked
        if blocked is None:
            return None
        for m in modules:
            if m._parameters.get("bias") is not None:
                return None
        kblock = _small_kblock(rows, blocked, self._made_hint)
        return None if kblock is None else (blocked, kblock)

    @contextmanager
    def applied(self) -> Iterator[None]:
        """Inside the block, each packed module's forward is the packed product (packing first what is
        stale); outside it, the module's own. Not re-entrant per model: the runner holds it per forward."""
        with self._lock:
            installed = self._refresh()
            self._thread = threading.get_ident()
            for e in installed:
                e.module.__dict__["forward"] = e.forward
            outer = getattr(_applied, "packs", None)
            _applied.packs = self
            try:
                yield
            finally:
                _applied.packs = outer
                for e in installed:  # only what was installed here: anything set meanwhile stays
                    if e.module.__dict__.get("forward") is e.forward:
                        del e.module.__dict__["forward"]


def _packed_forward(packs: PackedLinears, entry: _Entry):
    """The module's forward while packed: the packed product on the thread of the runner's forward, the
    module's own on any other (the same model object running elsewhere meanwhile, e.g. as a scorer, gets
    exactly what it gets without packs). The bias is read at every call: only the weight is packed."""
    module, packed = entry.module, entry.packed

    def forward(x: torch.Tensor) -> torch.Tensor:
        if threading.get_ident() != packs._thread:
            return nn.Linear.forward(module, x)
        y = packs._small(entry, x, module.bias) if entry.packed is packed else None  # its own pack's copy
        return ops.packed_linear(x, packed, module.bias) if y is None else y

    return forward


def _attribute(module: nn.Linear, name: str):
    """``getattr(module, name)`` for a parameter of an exact ``nn.Linear`` (``weight``, ``bias``): from the
    module's ``_parameters`` where it is registered there (what attribute access returns then: torch keeps a
    parameter's name out of the instance ``__dict__``), without ``Module.__getattr__``."""
    params = module._parameters
    return params[name] if name in params else getattr(module, name)


def _blocked(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight blocked for ``ops.small_linear`` beside its pack, from the same tensor at the same moment
    (a write that bypasses the version counter then reaches neither copy until both are made again), or
    ``None`` where the small products are off or the weight does not qualify."""
    if SMALL_ROWS < 1 or not ops.small_linear_supported(weight):
        return None
    return ops.block_linear_weight(weight)


def small_product(x: torch.Tensor, blocked: torch.Tensor, batch_hint: int) -> torch.Tensor | None:
    """oneDNN's product of a bf16 ``x`` by a weight packed at ``batch_hint``, as ``ops.small_linear`` over
    ``blocked`` (the same weight, ``ops.block_linear_weight``), where that is bit for bit oneDNN's for ``x``'s
    rows (up to ``SMALL_ROWS``), this shape and hint (``ops.small_linear_kblock``); ``None`` elsewhere. The
    engine's packs and the twin's calibration (which times the products as the engine runs them) both go
    through it."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    kblock = _small_kblock(rows, blocked, batch_hint) if x.dtype == torch.bfloat16 else None
    if kblock is None:
        return None
    return ops.small_linear(x.reshape(rows, k).contiguous(), blocked, kblock).view(*x.shape[:-1], -1)


def _small_kblock(rows: int, blocked: torch.Tensor, batch_hint: int) -> int | None:
    """The run with which ``ops.small_linear`` over ``blocked`` is oneDNN's product of ``rows`` bf16 rows (a
    weight packed at ``batch_hint``), or ``None`` (more than ``SMALL_ROWS`` rows, or no run found)."""
    if not 1 <= rows <= SMALL_ROWS:
        return None
    return ops.small_linear_kblock(rows, blocked.shape[1] * 2, blocked.shape[0] * 16, batch_hint)


def applied_packs() -> PackedLinears | None:
    """The packs whose ``applied()`` block this thread is in, or ``None``."""
    return getattr(_applied, "packs", None)


_applied = threading.local()  # .packs: the PackedLinears whose applied() block this thread is in


def grouped(modules: tuple[nn.Module, ...], x: torch.Tensor) -> list[torch.Tensor] | None:
    """``PackedLinears.grouped`` of the packs applied on this thread, or ``None`` outside such a block."""
    packs = getattr(_applied, "packs", None)
    return None if packs is None else packs.grouped(modules, x)


# The probes' verdicts by what decides them: the products' order of summation is oneDNN's for the dtype,
# the shapes, the pack's batch hint and the thread count, not the weights' values, so a repacking after a
# weight update (every PPO step) reuses the verdict instead of probing again.
_verdicts: dict[tuple, bool] = {}
_verdicts_lock = threading.Lock()


def _hooked(modules) -> bool:
    """Whether any of ``modules`` has forward hooks, or the process global module hooks (which only the
    module's own call runs)."""
    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in modules)


def _verdict_key(group: _Group, biases: list, batch_hint: int) -> tuple:
    w = group.entries[0].weight
    bias = biases[0] is not None
    return (w.dtype, w.shape[1], tuple(group.widths), bias, batch_hint, torch.get_num_threads())


def _bitwise_grouped(group: _Group, biases: list, batch_hint: int) -> bool:
    """Whether the group's stacked product equals its members' own packed products bit for bit on random
    inputs of ``PROBE_ROWS`` and ``batch_hint`` rows, with the members' biases where they have them; probed
    once per process for each dtype, input width, member widths, bias or not, batch hint and thread count."""
    key = _verdict_key(group, biases, batch_hint)
    with _verdicts_lock:
        verdict = _verdicts.get(key)
    if verdict is None:
        verdict = _probe_grouped(group, biases, batch_hint)
        with _verdicts_lock:
            _verdicts[key] = verdict
    return verdict


def _probe_grouped(group: _Group, biases: list, batch_hint: int) -> bool:
    w = group.entries[0].weight
    gen = torch.Generator().manual_seed(0)
    bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
    for rows in sorted({*PROBE_ROWS, batch_hint}):
        x = torch.randn(1, rows, w.shape[1], generator=gen).to(w.dtype)
        alone = [ops.packed_linear(x, e.packed, b) for e, b in zip(group.entries, biases, strict=True)]
        if not torch.equal(ops.packed_linear(x, group.packed, bias), torch.cat(alone, dim=-1)):
            return False
    return True


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
