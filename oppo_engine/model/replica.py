"""Rollout replicas: full copies of the trainer's sharded (FSDP2), remotely held or other-dtype models that
the engine runs instead of them, and the weight sync that refreshes them after every policy update.

An unsharded actor or critic is run as it is, shared with the trainer (zero-copy), unless
``EngineConfig.rollout_dtype`` differs from its dtype. A model needs a replica when the engine cannot read
its full weights in place, or should not run them in the dtype they are stored in:

- **FSDP2** (``fully_shard``): each rank holds a slice of every parameter (a ``DTensor``). The replica is
  filled by gathering the trainer's current weights, one FSDP module (a layer) at a time and one parameter
  at a time within it: each parameter's local shard is cast to the replica's dtype and all-gathered over
  the model's mesh straight into the replica's parameter (a collective: every rank of the mesh syncs in the
  same order), so the extra memory is one cast local shard; a layout other than FSDP2's even ``Shard(0)``
  goes through ``DTensor.full_tensor()`` and a copy (one full parameter extra).
- **the meta device** (``weights=`` trainers: DeepSpeed ZeRO-3 under ``GatheredParameters``, Megatron,
  another process): the engine builds the replica from the model's config and the trainer sends full
  tensors with ``RolloutEngine.update_policy(weights=...)``.
- **another dtype** (an unsharded model, ``rollout_dtype`` set and not its dtype: fp32 master weights
  rolled out in bf16): the replica is a ``deepcopy`` of the model whose parameters are allocated in
  ``rollout_dtype`` (its buffers, e.g. the rotary frequencies, are copied as they are: float32, as HF builds
  a model loaded in bf16); a sync casts each of the trainer's parameters into it. A PEFT-wrapped model is
  copied with its adapters.

A replica's ``Parameter`` objects live as long as the engine: syncs copy in place, ``release()`` frees the
storage under them (``untyped_storage().resize_(0)``, as FSDP2 frees its unsharded parameters) and
``restore()`` allocates it again, so the module tree a captured decode graph reads never changes (on CUDA
the addresses may: the graph path checks ``data_ptr`` and re-captures).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from oppo_engine.model import packed

# What a replica is fed by: the trainer's FSDP2 model (gathered), update_policy(weights=...), or the
# trainer's unsharded model, cast (copied).
GATHERED, FED, COPIED = "gathered", "fed", "copied"


def _fsdp_module_class() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed
        return None
    return FSDPModule


def _dtensor_class() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    return DTensor


def is_fsdp2(model: nn.Module) -> bool:
    """Whether ``model`` (or a submodule) was sharded with FSDP2's ``fully_shard``."""
    fsdp = _fsdp_module_class()
    return fsdp is not None and any(isinstance(m, fsdp) for m in model.modules())


def is_meta(model: nn.Module) -> bool:
    """Whether ``model``'s parameters are on the meta device (no data: a ``weights=`` trainer's model)."""
    return any(p.is_meta for p in model.parameters())


def needs_replica(model: nn.Module | None, rollout_dtype: torch.dtype | None = None) -> bool:
    """Whether the engine runs ``model`` through a replica (FSDP2, meta, or stored in a dtype other than
    ``rollout_dtype``) rather than sharing it."""
    if not isinstance(model, nn.Module):
        return False
    if is_fsdp2(model) or is_meta(model):
        return True
    return rollout_dtype is not None and stored_dtype(model) != rollout_dtype


def hf_class(model: nn.Module) -> type:
    """The model's own class: the first in its MRO that FSDP2 did not add (``fully_shard`` swaps a
    module's class for ``FSDP<Class>(FSDPModule, Class)``)."""
    fsdp = _fsdp_module_class()
    for cls in type(model).__mro__:
        if fsdp is None or not issubclass(cls, fsdp):
            return cls
    raise ValueError(f"{type(model).__name__}: no class outside FSDP in its MRO")


def _check_replicable(model: nn.Module, role: str) -> None:
    """Refuse what a replica built from the config could not reproduce."""
    for m in model.modules():
        if any(c.__module__.split(".")[0] == "peft" for c in type(m).__mro__):
            raise ValueError(
                f"{role}: a PEFT-wrapped sharded (FSDP2 or meta-device) model cannot be replicated: the "
                "replica is built from the HF config, without the adapters. Merge the adapters "
                "(merge_and_unload) before sharding, or pass the unsharded PEFT model to share it"
            )
    if not hasattr(model, "config") or not hasattr(hf_class(model), "_from_config"):
        raise ValueError(
            f"{role}: {type(model).__name__} is sharded or on the meta device, but is not an HF "
            "PreTrainedModel: the engine builds its rollout replica from the model's class and config"
        )
    if is_meta(model) and not all(p.is_meta for p in model.parameters()):
        raise ValueError(
            f"{role}: some parameters are on the meta device and some are not; pass a model wholly on "
            "the meta device (weights come from update_policy(weights=...)) or wholly materialised"
        )
    dtensor = _dtensor_class()
    if is_fsdp2(model) and any(
        dtensor is not None and isinstance(p, dtensor) and p.to_local().is_meta for p in model.parameters()
    ):
        raise ValueError(f"{role}: its FSDP2 shards are on the meta device: initialise them first")


def _gather_into(dst: torch.Tensor, src) -> bool:
    """All-gather the DTensor ``src`` straight into the replica's ``dst`` (cast to its dtype first) when
    ``src`` is FSDP2's usual layout: ``Shard(0)`` on a 1-D mesh, evenly (no padding), on ``dst``'s device.
    No full-size temporary: the extra memory is the cast local shard. False for any other layout (HSDP,
    uneven or other-dim shards, CPU offload), which takes ``DTensor.full_tensor()``."""
    from torch.distributed.tensor import Shard

    mesh = src.device_mesh
    if mesh.ndim != 1 or tuple(src.placements) != (Shard(0),) or not dst.is_contiguous():
        return False
    local = src.to_local()
    if (
        src.shape[0] % mesh.size()
        or local.device != dst.device
        or local.shape[0] * mesh.size() != dst.shape[0]
    ):
        return False
    if mesh.size() == 1:  # the shard is the whole tensor: cast in the copy
        dst.copy_(local)
    else:
        shard = local.to(dst.dtype).contiguous()
        torch.distributed.all_gather_into_tensor(dst, shard, group=mesh.get_group())
    return True


@contextlib.contextmanager
def _no_init() -> Iterable[None]:
    """Skip HF's weight initialisation where transformers offers it: the replica's weights are all
    overwritten by the first sync (initialising them is only time lost)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        try:
            from transformers.modeling_utils import no_init_weights
        except ImportError:
            no_init_weights = contextlib.nullcontext
    with no_init_weights():
        yield


def stored_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the model's (floating) parameters are stored in: the sharded weights', not a mixed
    precision policy's compute dtype."""
    return next(p.dtype for p in model.parameters() if p.is_floating_point())


def _copy_in_dtype(source: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``deepcopy(source)`` whose parameters are fresh (uninitialised) tensors of ``dtype``: the trainer's
    weights are never copied whole in their own dtype (no full-size temporary). Tied parameters stay one
    tensor; buffers and everything else are deep copies, but for a ``forward`` set on a module instance.

    NOTE: trainers wrap ``forward`` on the instance in closures over the source's own bound forward (TRL's
    ``GRPOTrainer``: ``add_fused_lm_head``; accelerate: autocast). A deep copy keeps the closure, so the
    copy's forward would run the *source's* weights (fp32, trainer's attention, train mode): wrong log-probs,
    no error. The copy runs its class's forward instead, over its own weights."""
    memo = {
        id(p): nn.Parameter(torch.empty(p.shape, dtype=dtype, device=p.device), requires_grad=False)
        for p in source.parameters()
    }
    model = copy.deepcopy(source, memo)
    for module in model.modules():
        vars(module).pop("forward", None)
    return model


class RolloutReplica:
    """A full copy of the trainer's ``source`` model on ``device`` in ``dtype``; ``model`` is what the engine
    runs. ``kind`` is ``GATHERED`` (FSDP2: ``gather()`` reads the trainer's shards; the replica is built from
    the model's HF class and config), ``FED`` (meta device: ``load(weights)``; built from the config too) or
    ``COPIED`` (an unsharded model in another dtype: a copy of it, which ``gather()`` fills by casting its
    parameters). ``ready`` is False until a complete set of weights has been copied in, and again after
    ``release()`` or a failed sync."""

    def __init__(self, source: nn.Module, *, role: str, device: torch.device, dtype: torch.dtype) -> None:
        self.role = role
        self.kind = GATHERED if is_fsdp2(source) else FED if is_meta(source) else COPIED
        self.source = source if self.kind != FED else None
        self.dtype = dtype
        if self.kind == COPIED:
            model = _copy_in_dtype(source, dtype)
        else:
            _check_replicable(source, role)
            with torch.device(device), _no_init():
                model = hf_class(source)._from_config(copy.deepcopy(source.config), dtype=dtype)
            model.tie_weights()  # skipped with the initialisation: tied weights are one tensor, as trained
            if getattr(source, "generation_config", None) is not None:  # EOS ids are read from it
                model.generation_config = copy.deepcopy(source.generation_config)
        self.model = model.eval().requires_grad_(False)
        # Tied weights once: the names update_policy(weights=...) takes.
        self.params: dict[str, nn.Parameter] = dict(self.model.named_parameters())
        self._aliases = {
            alias: name
            for name, p in self.params.items()
            for alias, q in self.model.named_parameters(remove_duplicate=False)
            if q is p and alias != name
        }
        self._nbytes = {name: p.untyped_storage().nbytes() for name, p in self.params.items()}
        self.ready = False
        self.released = False
        self._order = self._match_sources(source) if self.kind == GATHERED else list(self.params)
        # The mesh a gather runs over, and the device its collectives take tensors on (None: no DTensor).
        dtensor = _dtensor_class()
        shard = next(
            (p for p in source.parameters() if dtensor is not None and isinstance(p, dtensor)), None
        ) if self.kind == GATHERED else None  # fmt: skip
        self.mesh = shard.device_mesh if shard is not None else None
        self.mesh_device = shard.to_local().device if shard is not None else None

    @property
    def nbytes(self) -> int:
        """Bytes of the replica's parameters (held unless released)."""
        return sum(self._nbytes.values())

    def _match_sources(self, source: nn.Module) -> list[str]:
        """The replica's parameter names in the trainer's order (its FSDP modules', layer by layer: every
        rank gathers in this order), each checked to exist there with the same shape."""
        theirs = dict(source.named_parameters(remove_duplicate=False))
        order = {name: i for i, name in enumerate(theirs)}
        for name, p in self.params.items():
            src = theirs.get(name)
            if src is None:
                raise ValueError(
                    f"{self.role}: the replica's parameter {name!r} has no counterpart in the sharded "
                    f"{type(source).__name__} (its names: {', '.join(itertools.islice(theirs, 4))}, ...)"
                )
            if tuple(src.shape) != tuple(p.shape):
                raise ValueError(
                    f"{self.role}: parameter {name!r} is {tuple(src.shape)} in the sharded model, "
                    f"{tuple(p.shape)} in its replica built from the config"
                )
        return sorted(self.params, key=order.__getitem__)

    # -- the syncs ---------------------------------------------------------------------------------------

    @torch.no_grad()
    def gather(self) -> None:
        """Copy the trainer's current weights into the replica, cast to its dtype (FSDP2: collective over
        the mesh; an unsharded source: a local copy). A ``COPIED`` replica checks each floating parameter
        once cast (one read of the copy): a non-finite one raises ``ValueError`` naming it, and the replica
        stays not ready (partly overwritten) until a sync succeeds."""
        theirs = dict(self.source.named_parameters(remove_duplicate=False))
        self.ready = False
        dtensor = _dtensor_class()
        for name in self._order:
            src, dst = theirs[name].detach(), self.params[name]
            if dtensor is None or not isinstance(src, dtensor):  # FSDP2 holds it unsharded right now
                dst.copy_(src)
                if self.kind == COPIED and dst.is_floating_point() and not bool(torch.isfinite(dst).all()):
                    raise ValueError(
                        f"{self.role}: parameter {name!r} holds non-finite values (NaN or inf) once cast to "
                        f"{self.dtype}: a diverged update? The replica is not synced until update_policy() "
                        "succeeds"
                    )
            elif not _gather_into(dst, src):
                # NOTE: cast before the gather: elementwise, so bit-equal to casting the gathered tensor,
                # and half the bytes on the wire for bf16 replicas of fp32 weights.
                dst.copy_(src.to(self.dtype).full_tensor())
        self.ready = True

    def validate(self, weights) -> dict[str, torch.Tensor]:
        """``weights`` (a mapping, or an iterable of ``(name, full tensor)``) checked against the replica's
        parameters: each exactly once, with its shape. A mapping's tensors are used as they are; an
        iterable's are staged on the host in the replica's dtype as they come (one full copy of the model
        in host memory), since an iterator's tensors may be gone once it moves on. Every floating tensor must
        be finite (one read of it, as the copy makes). Raises ``ValueError`` naming the parameter; nothing is
        copied into the replica."""
        if isinstance(weights, Mapping):
            items, staged = weights.items(), False
        elif isinstance(weights, Iterable) and not isinstance(weights, str | bytes | torch.Tensor):
            items, staged = weights, True
        else:
            raise ValueError(
                f"{self.role}: weights must be a mapping or an iterable of (name, tensor), got "
                f"{type(weights).__name__}"
            )
        dtensor = _dtensor_class()
        got: dict[str, torch.Tensor] = {}
        for item in items:
            if not (isinstance(item, tuple) and len(item) == 2):
                raise ValueError(f"{self.role}: weights must yield (name, tensor) pairs, got {item!r:.80}")
            name, tensor = item
            where = f"{self.role}: weights[{name!r}]"
            if name in self._aliases:
                raise ValueError(
                    f"{where} is tied to {self._aliases[name]!r}: give tied weights once, under "
                    f"{self._aliases[name]!r} (the replica's named_parameters() names)"
                )
            if name not in self.params:
                raise ValueError(
                    f"{where}: no such parameter in the replica ({type(self.model).__name__}; names are its "
                    "named_parameters(), e.g. "
                    + ", ".join(repr(n) for n in itertools.islice(self.params, 3))
                    + ")"
                )
            if name in got:
                raise ValueError(f"{where} is given twice")
            if not isinstance(tensor, torch.Tensor) or (dtensor is not None and isinstance(tensor, dtensor)):
                raise ValueError(f"{where}: expected a full torch.Tensor, got {type(tensor).__name__}")
            if tensor.is_meta:
                raise ValueError(f"{where} is on the meta device: it holds no weights")
            want = tuple(self.params[name].shape)
            if tuple(tensor.shape) != want:
                raise ValueError(f"{where} has shape {tuple(tensor.shape)}, the replica's is {want}")
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise ValueError(f"{where} holds non-finite values (NaN or inf): a diverged update?")
            if staged:
                tensor = tensor.detach().to("cpu", self.dtype, copy=True)
            got[name] = tensor
        missing = [n for n in self.params if n not in got]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise ValueError(f"{self.role}: weights lack parameter {missing[0]!r}{more}")
        return got

    @torch.no_grad()
    def load(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy validated ``weights`` (``validate``'s result) into the replica, cast to its dtype."""
        self.ready = False
        for name, tensor in weights.items():
            self.params[name].copy_(tensor)
        self.ready = True

    # -- memory --------------------------------------------------------------------------------------------

    def release(self) -> None:
        """Free the parameters' storage (the ``Parameter`` objects stay); ``restore()`` gives it back."""
        if self.released:
            return
        for p in self.params.values():
            p.untyped_storage().resize_(0)
        self.released = True
        self.ready = False

    def restore(self) -> None:
        """Allocate the parameters' storage again (contents undefined until the next sync)."""
        if not self.released:
            return
        for name, p in self.params.items():
            p.untyped_storage().resize_(self._nbytes[name])
        self.released = False


def rollout_device(models: Iterable[object]) -> torch.device:
    """Where replicas live: the device of the first given model that holds data (an FSDP2 model's local
    shards); with only meta-device models (and callables), the current CUDA device, else the CPU."""
    for m in models:
        if isinstance(m, nn.Module) and not is_meta(m):
            p = next(m.parameters())
            dtensor = _dtensor_class()
            if dtensor is None or not isinstance(p, dtensor):
                return p.device
            local = p.to_local().device
            if local.type != p.device_mesh.device_type:
                raise ValueError(
                    f"a model sharded over a {p.device_mesh.device_type} mesh keeps its shards on "
                    f"{local.type} (FSDP2 CPUOffloadPolicy): rollout replicas of CPU-offloaded models are "
                    "not supported; shard without offload, or feed a meta-device replica with "
                    "update_policy(weights=...)"
                )
            return local
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


# The update_policy() argument that feeds each role's replica.
WEIGHTS_ARGUMENT = {"actor": "weights", "critic": "critic_weights"}


class RolloutReplicas:
    """The engine's replicas by role (``"actor"``, ``"critic"``): built and filled at construction (the
    FSDP2 ones by a gather, collective over each model's mesh), refreshed by ``update()``, freed by
    ``release()`` and given back by ``restore()``. ``rollout_dtype=None``: each model's stored dtype."""

    def __init__(
        self,
        trained: Mapping[str, nn.Module | None],
        others: Iterable[object],
        rollout_dtype: torch.dtype | None,
    ) -> None:
        # NOTE: an unsharded model already stored in rollout_dtype is shared (zero-copy), as without it.
        self.trained = dict(trained)
        wanted = {role: m for role, m in trained.items() if needs_replica(m, rollout_dtype)}
        device = rollout_device([*trained.values(), *others]) if wanted else None
        self.by_role: dict[str, RolloutReplica] = {
            role: RolloutReplica(m, role=role, device=device, dtype=rollout_dtype or stored_dtype(m))
            for role, m in wanted.items()
        }
        for replica in self.by_role.values():
            if replica.kind != FED:
                replica.gather()

    def runs(self, role: str, model: nn.Module | None) -> nn.Module | None:
        """The model the engine runs for ``role``: its replica, or ``model`` itself (shared)."""
        replica = self.by_role.get(role)
        return replica.model if replica is not None else model

    @property
    def nbytes(self) -> int:
        """Bytes of every replica's parameters."""
        return sum(r.nbytes for r in self.by_role.values())

    def check_ready(self) -> None:
        """Raise ``RuntimeError`` if a replica holds no complete set of weights."""
        for role, r in self.by_role.items():
            if r.ready:
                continue
            if r.kind == FED:
                raise RuntimeError(
                    f"{role}: its rollout replica has no weights (the model is on the meta device, or its "
                    f"replica was released): call update_policy({WEIGHTS_ARGUMENT[role]}=...) first"
                )
            raise RuntimeError(
                f"{role}: its rollout replica is not synced (released, or the last sync failed): call "
                "resume() or update_policy() first"
            )

    def update(self, weights: Mapping[str, object]) -> None:
        """Refresh every replica: from ``weights[role]`` where given (validated for every role before
        anything is copied), else by a gather from the FSDP2 model (deferred to ``restore()`` while the
        replica is released). Raises ``ValueError`` for weights of a role without a replica and for a
        meta-device model's replica left without weights. With a replica to gather, the ranks of its mesh
        agree first (one small all-reduce): a check failing on one rank fails ``update`` on every rank of
        the mesh, before any gather, rather than leaving the others waiting in it."""
        try:
            staged = self._validate(weights)
            error = None
        except Exception as e:  # every rank learns of it before any gather: see _agree
            staged, error = {}, e
        failed_rank = self._agree(failed=error is not None)
        if error is not None:
            raise error
        if failed_rank is not None:
            raise ValueError(
                f"update_policy: the weights given on rank {failed_rank} failed validation there (its error "
                "names the parameter); nothing was copied on this rank either and the policy version is "
                "unchanged, so the ranks' replicas stay in step: call update_policy again on every rank"
            )
        for role, r in self.by_role.items():
            if role in staged:
                r.restore()
                r.load(staged[role])
            elif not r.released:
                r.gather()
            else:
                r.ready = False  # released: restore() (resume()) gathers it
        self._drop_packs()

    def _drop_packs(self) -> None:
        """Free the packed weights of the models run for the trained roles (model/packed.py): they are
        packed again from the new weights at their next forward."""
        for role, model in self.trained.items():
            packed.drop(self.runs(role, model))

    def _validate(self, weights: Mapping[str, object]) -> dict[str, dict[str, torch.Tensor]]:
        """``update``'s checks, and each given role's weights validated (``RolloutReplica.validate``)."""
        for role, w in weights.items():
            if w is not None and role not in self.by_role:
                raise ValueError(
                    f"update_policy: {WEIGHTS_ARGUMENT[role]}= was given, but the engine has no replica of "
                    f"its {role}: an unsharded {role} is shared with the trainer, so its weights already "
                    "are the trainer's (and an absent one has none)"
                )
            if w is not None and self.by_role[role].kind == COPIED:
                raise ValueError(
                    f"update_policy: {WEIGHTS_ARGUMENT[role]}= was given, but the {role} is an unsharded "
                    f"model whose rollout_dtype replica is refreshed from it: update_policy() (no weights) "
                    "casts the trainer's current weights into it"
                )
        for role, r in self.by_role.items():
            if r.kind == FED and weights.get(role) is None:
                raise ValueError(
                    f"update_policy: the {role} was given on the meta device, so the engine cannot read its "
                    f"weights: pass them as update_policy({WEIGHTS_ARGUMENT[role]}=...)"
                )
        return {role: self.by_role[role].validate(w) for role, w in weights.items() if w is not None}

    def _agree(self, *, failed: bool) -> int | None:
        """Whether any rank's checks failed, agreed over the mesh of every replica that ``update`` would
        gather now (collective; nothing to agree on, and no collective, without one): the highest failing
        rank, or None. Without it, a rank whose ``weights=`` failed validation would return while the others
        entered the gather and waited for it."""
        meshes = []
        for r in self.by_role.values():
            if r.kind == GATHERED and not r.released and r.mesh is not None and r.mesh.size() > 1:
                if r.mesh not in [m for m, _ in meshes]:
                    meshes.append((r.mesh, r.mesh_device))
        if not meshes:
            return None
        dist = torch.distributed
        flag = torch.tensor([dist.get_rank() + 1 if failed else 0], dtype=torch.int64, device=meshes[0][1])
        for mesh, device in meshes:
            flag = flag.to(device)
            for dim in range(mesh.ndim):  # a max over each dimension's groups in turn is the mesh's max
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))
        rank = int(flag.item()) - 1
        return None if rank < 0 else rank

    def release(self) -> None:
        """Free every replica's storage, and the packed weights of the trained models."""
        for r in self.by_role.values():
            r.release()
        self._drop_packs()

    def restore(self) -> None:
        """Give the replicas their storage back; the FSDP2 ones are gathered again (collective), the copied
        ones cast again from their model."""
        for r in self.by_role.values():
            r.restore()
            if r.kind != FED and not r.ready:
                r.gather()
