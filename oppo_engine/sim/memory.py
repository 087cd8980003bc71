"""What a PPO run holds on each GPU, and whether it fits.

Defaults are what this project's ``PPOTrainer`` does: FSDP over the training GPUs (the actor and critic
sharded: weights, gradients and Adam state), bf16 weights and gradients, fp32 Adam moments (two per
parameter), no activation checkpointing, full logits, a rank's whole share of a minibatch in one forward
(or, with ``max_tokens_per_microbatch``, packed micro-batches of that many tokens). The engine adds a full
rollout replica of each sharded model. Frozen models (reward, reference) are whole on every GPU that runs
them.

The KV arena follows the engine's own rule (``oppo_engine/cache/plan.py::plan_pages``): the pages of B + Δ
sequences of ``max_model_len`` tokens in every model it runs, capped to 40% of the GPU's free memory when
the engine is built (the weights, shards and replicas, are allocated then; the optimizer's moments and the
gradients are not yet: AdamW allocates its state at its first step), or on a CPU to 25% of the host's
memory less the rollout replicas. Under the cap the engine preempts, and so does the twin (``World`` gets
the same page count).

Activations: a layer's activations are ``s h (34 + 5 a s / h)`` bytes a row in 16 bits (Korthikanti et
al., "Reducing Activation Recomputation in Large Transformer Models", arXiv:2205.05198), of which the
``5 a s / h`` attention-score term is dropped where attention is fused (SDPA / flash); with checkpointing
each layer's input is kept (``2 s h`` bytes a row) and one layer is recomputed at a time; plus the logits
of the rows (bf16, and their fp32 log-softmax and gradient).
"""

from __future__ import annotations

from dataclasses import dataclass

from oppo_engine.cache.plan import DEFAULT_CUDA_MEMORY_FRACTION, DEFAULT_HOST_MEMORY_FRACTION
from oppo_engine.sim.models import page_plan
from oppo_engine.sim.shapes import ModelShape

PARTS = ("weights", "grads", "optimizer", "kv", "activations")


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """Bytes per GPU by part, for each kind of GPU of the placement (``"actor"``: a training GPU running an
    actor rank; ``"scorer"``: the 7+1 scoring GPU), the capacity of one GPU, and the verdict."""

    by_gpu: dict[str, dict[str, int]]
    capacity: int
    arena_pages: int | None = None
    pages_wanted: int | None = None
    one_sequence_pages: int = 0

    @property
    def worst(self) -> str:
        return max(self.by_gpu, key=lambda g: sum(self.by_gpu[g].values()))

    @property
    def per_gpu(self) -> dict[str, int]:
        return dict(self.by_gpu[self.worst])

    @property
    def fits(self) -> bool:
        arena = self.arena_pages is None or self.arena_pages >= self.one_sequence_pages
        return arena and all(sum(parts.values()) <= self.capacity for parts in self.by_gpu.values())

    @property
    def preempts(self) -> bool:
        """The engine's arena holds fewer pages than B + Δ sequences of ``max_model_len`` need: it
        preempts."""
        return (
            self.arena_pages is not None
            and self.pages_wanted is not None
            and self.arena_pages < self.pages_wanted
        )

    def verdict(self) -> str | None:
        """None when every GPU fits; else which GPU, which part is largest and by how much it is over."""
        over = []
        if self.arena_pages is not None and self.arena_pages < self.one_sequence_pages:
            over.append(
                f"the engine's KV arena (40% of the free memory) holds {self.arena_pages} pages, one "
                f"sequence of max_model_len needs {self.one_sequence_pages}: the engine refuses to build"
            )
        for gpu, parts in self.by_gpu.items():
            total = sum(parts.values())
            if total > self.capacity:
                largest = max(parts, key=parts.get)
                over.append(
                    f"the {gpu} GPU needs {total / 1e9:.1f} GB of {self.capacity / 1e9:.1f} GB: over by "
                    f"{(total - self.capacity) / 1e9:.1f} GB; its largest part is {largest} "
                    f"({parts[largest] / 1e9:.1f} GB)"
                )
        return "; ".join(over) or None


def memory_plan(
    shapes: dict[str, ModelShape],
    *,
    placement: str,
    training_gpus: int,
    ranks: int,
    in_flight: int,
    max_model_len: int,
    minibatch_rows: int,
    page_size: int,
    capacity: int,
    weight_bytes: int = 2,
    grad_bytes: int = 2,
    optimizer_bytes: int = 8,
    checkpointing: bool = False,
    fsdp: bool = True,
    tokens_per_microbatch: int | None = None,
) -> MemoryPlan:
    """The :class:`MemoryPlan` of ``shapes`` (by role) under ``placement`` with ``in_flight`` sequences per
    actor rank (B + Δ_max), minibatches of ``minibatch_rows`` rows per GPU padded to ``max_model_len`` (or
    packed micro-batches of ``tokens_per_microbatch`` tokens). ``arena_pages``: the engine's arena on an actor
    GPU by its own rule (module docstring)."""
    trained = [s for role, s in shapes.items() if role in ("actor", "critic")]
    frozen = [s for role, s in shapes.items() if role in ("reward", "reference")]
    shard = training_gpus if fsdp else 1
    params = sum(s.params for s in trained)
    page_bytes, tokens = page_plan(shapes, page_size)

    def kv(roles, sequences: int) -> int:
        pages = sequences * sum(-(-max_model_len // tokens[r]) for r in roles)
        return pages * page_bytes

    actor_roles = [r for r in shapes if placement != "7+1" or r in ("actor", "critic")]
    replicas = sum(s.params * weight_bytes for s in trained)
    weights = params * weight_bytes // shard + replicas
    if placement != "7+1":
        weights += sum(s.params * s.dtype_bytes for s in frozen)
    one = sum(-(-max_model_len // tokens[r]) for r in actor_roles)
    wanted = in_flight * one
    if placement == "cpu":
        budget = max(0, int(capacity * DEFAULT_HOST_MEMORY_FRACTION) - replicas)
    else:
        budget = int(max(0, capacity - weights) * DEFAULT_CUDA_MEMORY_FRACTION)
    arena = min(wanted, budget // page_bytes)
    if tokens_per_microbatch is not None:
        acts = (_activations(s, 1, tokens_per_microbatch, checkpointing) for s in trained)
    else:
        acts = (_activations(s, minibatch_rows, max_model_len, checkpointing) for s in trained)
    actor_gpu = {
        "weights": weights,
        "grads": params * grad_bytes // shard,
        "optimizer": params * optimizer_bytes // shard,
        "kv": arena * page_bytes,
        "activations": max(acts, default=0),
    }  # fmt: skip
    by_gpu = {"actor": actor_gpu}
    if placement == "7+1":
        by_gpu["scorer"] = {
            "weights": sum(s.params * s.dtype_bytes for s in frozen),
            "grads": 0,
            "optimizer": 0,
            "kv": kv([r for r in shapes if r in ("reward", "reference")], in_flight * ranks),
            "activations": 0,
        }
    return MemoryPlan(by_gpu, capacity, arena, wanted, one)


def _activations(shape: ModelShape, rows: int, seq: int, checkpointing: bool) -> int:
    h, layers = shape.hidden, shape.layers
    per_layer = rows * seq * h * 34  # bytes, 16-bit activations, fused attention (module docstring)
    logits = rows * seq * shape.vocab * (2 + 4 + 4) if shape.head == "lm" else 0
    if checkpointing:
        return layers * 2 * rows * seq * h + per_layer + logits
    return layers * per_layer + logits
