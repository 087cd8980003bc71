"""The PPO trainer on N data-parallel ranks (torch.distributed; gloo on the CPU, NCCL on GPUs).

Data parallelism must change nothing but speed: K PPO steps on W ranks give the losses and weights of one
rank over the same global batch. Three rules make it so:

- **Prompts by global position.** The prompt list is cycled into one global stream; its blocks of
  ``batch_size`` prompts are dealt to the ranks round robin (rank ``r`` takes blocks ``r, r + W, ...``), and
  each prompt's seed derives from its global position. A step's global batch is thus the same prompts with
  the same noise whatever ``W`` is, and on one rank the seeds are exactly those the engine derives itself.
- **One global batch.** After ``engine.step()`` every rank gathers the step's rollouts rank-major (rank 0's
  first) and sorts them canonically, so advantages are computed and whitened over the global batch, and
  every rank holds the same numbers.
- **Rank-major minibatches.** The minibatch partition is drawn over the global batch from a generator
  seeded alike on every rank; a global minibatch of ``W * minibatch_size`` rows is cut into ``W``
  consecutive slices and rank ``r`` trains on slice ``r``. Each rank's loss is its slice's sum over the
  minibatch's global token count, scaled by ``W`` because FSDP averages gradients: the sum over ranks is
  the one-rank minibatch loss, and so is the reduced gradient.

``batch_size`` and ``minibatch_size`` count one rank's rows (the engine's ``batch_size`` is per rank);
the one-rank run over the same global batch has ``W`` times both.
"""

from __future__ import annotations

import datetime
import itertools
import os
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from oppo_engine.sched.prompts import derive_seed
from oppo_engine.sched.results import Rollout

__all__ = [
    "all_reduce_sum",
    "check_same_on_ranks",
    "exchange_group",
    "gather_rollouts",
    "group_rank_size",
    "init_from_env",
    "is_sharded",
    "prompt_seed",
    "rank_prompts",
    "refusals_on_any_rank",
    "shard_count",
    "shard_model",
    "shard_trainer_models",
]


def group_rank_size(group) -> tuple[int, int]:
    """``(rank, world_size)`` in ``group``; ``(0, 1)`` for ``None`` (a single process)."""
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def prompt_seed(seed: int, global_index: int) -> int:
    """The sampling seed of the prompt at ``global_index`` of the global stream: what a single-process
    engine derives for its prompt of that index, so one rank's rollouts are unchanged."""
    return derive_seed(seed, global_index)


def rank_prompts(
    prompts: Sequence[Sequence[int]], *, rank: int, world_size: int, block: int
) -> Iterator[tuple[int, list[int]]]:
    """``(global_index, prompt_ids)`` of rank ``rank``'s share of the cycled global prompt stream: blocks of
    ``block`` consecutive prompts dealt to the ranks round robin (rank-major within a round)."""
    for start in itertools.count(rank * block, world_size * block):
        for g in range(start, start + block):
            yield g, list(prompts[g % len(prompts)])


def gather_rollouts(rollouts: Sequence[Rollout], group) -> list[Rollout]:
    """Every rank's ``rollouts``, rank-major (rank 0's first), on every rank. Collective over ``group``."""
    if group is None:
        return list(rollouts)
    parts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, list(rollouts), group=group)
    return [r for part in parts for r in part]


def check_same_on_ranks(settings: dict, group) -> None:
    """ValueError on every rank, naming the keys, unless every rank of ``group`` passes equal
    ``settings`` (one all-gather). Nothing is checked without a group."""
    if group is None:
        return
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, settings, group=group)
    differ = sorted(k for k in settings if any(other.get(k) != settings[k] for other in everyone))
    if differ:
        raise ValueError(
            f"data-parallel PPOTrainer: the ranks differ in {', '.join(differ)} (every rank must pass the "
            "same config and prompts)"
        )


def shared_failure(error: Exception) -> bool:
    """Whether a probe's ``error`` goes to the other ranks through ``refusals_on_any_rank`` (an error of
    this rank's own work), rather than raised at once: a collective's failure (``torch.distributed``'s
    ``DistError``: a peer gone, a timeout) means the group is broken, and the agreement's all-gather
    would only wait on it."""
    return not isinstance(error, dist.DistError)


def refusals_on_any_rank(reasons: dict[str, str], group, failure: Exception | None = None) -> dict[str, str]:
    """Per key of ``reasons`` (why this rank refuses it; ``""``: it does not), the refusal of the first rank
    of ``group`` that gives one (``""`` where none does), the same on every rank: a refusal on one rank is a
    refusal on all, so every rank takes the same path. ``reasons`` itself without a group; collective (one
    all-gather).

    ``failure``: an error this rank's probe raised that is not a refusal (a crash, not a verdict). It is
    shared in the same all-gather and raised after it: on this rank as itself, on every other rank as a
    ``RuntimeError`` naming the rank and the error. A rank raising it alone would leave the others waiting
    in this all-gather until the group's timeout."""
    if group is None:
        if failure is not None:
            raise failure
        return dict(reasons)
    everyone: list = [None] * dist.get_world_size(group)
    mine = None if failure is None else f"{type(failure).__name__}: {failure}"
    dist.all_gather_object(everyone, (reasons, mine), group=group)
    if failure is not None:
        raise failure
    failed = [(rank, error) for rank, (_, error) in enumerate(everyone) if error is not None]
    if failed:
        rank, error = failed[0]
        raise RuntimeError(
            f"rank {rank} of the group failed in a probe every rank runs ({error}); raised here too, "
            "rather than left waiting in the group's next collective"
        )
    return {key: next((other[key] for other, _ in everyone if other.get(key)), "") for key in reasons}


def all_reduce_sum(t: torch.Tensor, group) -> torch.Tensor:
    """``t`` summed over ``group``, in place (``t`` itself without a group); through host memory on a gloo
    group (the exchange group of GPU ranks)."""
    if group is None:
        return t
    host = t.cpu() if t.is_cuda and dist.get_backend(group) == "gloo" else t
    dist.all_reduce(host, op=dist.ReduceOp.SUM, group=group)
    if host is not t:
        t.copy_(host)
    return t


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` holds FSDP2 (DTensor) parameters."""
    return any(type(p).__name__ == "DTensor" for p in model.parameters())


def shard_count(model: nn.Module) -> int:
    """How many ranks ``model``'s FSDP2 parameters are spread over (1 when it is not sharded)."""
    meshes = [p.device_mesh for p in model.parameters() if type(p).__name__ == "DTensor"]
    return max((m.size() for m in meshes), default=1)


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def shard_model(model: nn.Module, group=None, device: torch.device | str | None = None) -> nn.Module:
    """``model`` sharded in place with FSDP2 (``fully_shard``) over ``group`` (default: the world): one
    unit per decoder layer (HF's ``_no_split_modules``) and the root for the rest (embeddings, head). The
    gradients of a backward are then averaged over the group (FSDP2's default). Returns ``model``."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    device = torch.device(device) if device is not None else next(model.parameters()).device
    group = group if group is not None else dist.group.WORLD
    ranks = dist.get_process_group_ranks(group)
    # An NCCL group shards over CUDA whatever device the model is on now (fully_shard moves it there): a
    # "cpu" mesh would run FSDP's collectives on CPU tensors over NCCL.
    mesh_type = "cuda" if dist.get_backend(group) == "nccl" else device.type
    mesh = DeviceMesh.from_group(group, mesh_type, mesh=torch.tensor(ranks))
    for layer in _decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def init_from_env(device_type: str = "cuda", timeout_s: float | None = None) -> tuple[object, torch.device]:
    """Under ``torchrun``: join the process group its environment describes and return ``(group,
    device)``: ``cuda:LOCAL_RANK`` with NCCL when ``device_type`` is ``"cuda"`` and CUDA is there, else the
    CPU with gloo. ``timeout_s`` is every collective's timeout (``None``: torch's default, 30 minutes for
    gloo): a rank that fails makes its peers raise within it. ``ValueError`` outside ``torchrun``."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise ValueError(
            "--fsdp runs under torchrun (RANK and WORLD_SIZE are unset): launch it with `torchrun "
            "--nproc-per-node N -m oppo_engine.cli demo --fsdp ...` or `oppo-engine demo --nproc N`"
        )
    if device_type == "cuda" and torch.cuda.is_available():
        # A launcher that shows each process only its own GPU (srun --gpus-per-task=1) sets LOCAL_RANK k
        # with one visible device: it is cuda:0 there.
        local = int(os.environ.get("LOCAL_RANK", "0"))
        count = torch.cuda.device_count()
        device = torch.device("cuda", local if local < count else local % count)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        kwargs = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
        dist.init_process_group(backend, **kwargs)
    return dist.group.WORLD, device


_EXCHANGE_GROUP = None


def exchange_group():
    """The group for the trainer's and the engine's exchanges (small Python objects and sums): the world
    itself when it runs gloo, else one gloo group over the same ranks, made once (collective the first
    time): its timeouts raise, where NCCL's are left to its watchdog."""
    global _EXCHANGE_GROUP
    world = dist.group.WORLD
    if dist.get_backend() == "gloo":
        return world
    # Made for this world: after destroy_process_group() and a new init_process_group(), made anew.
    if _EXCHANGE_GROUP is None or _EXCHANGE_GROUP[0] is not world:
        _EXCHANGE_GROUP = (world, dist.new_group(backend="gloo"))
    return _EXCHANGE_GROUP[1]


def shard_trainer_models(models):
    """Shard a ``PPOModels``' actor and critic over the world with ``shard_model`` (NCCL on GPUs); the
    frozen reference and reward stay whole on every rank. Returns the trainer's ``process_group``
    (``exchange_group()``: gloo over the same ranks)."""
    shard_model(models.actor)
    shard_model(models.critic)
    return exchange_group()
