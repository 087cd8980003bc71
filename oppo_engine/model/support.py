"""What the engine can run exactly: checks made when an engine is built, never at the first step.

A model the engine would run with silently different numbers is refused here with a ``ValueError`` that
names the feature. What is accepted is exact by construction: attention goes through the paged kernels
(causal, per-layer sliding windows, logit softcap), logits through the model's own head.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

from torch import nn

# The longest sequence an engine runs when EngineConfig.max_model_len is None and no model is shorter.
DEFAULT_MAX_MODEL_LEN = 4096
# Names HF gives a learned (absolute) position-embedding table: GPT-2, GPT-Neo, GPT-BigCode, OPT, ...
_POSITION_TABLES = frozenset({"wpe", "embed_positions", "position_embeddings"})


def text_config(model: nn.Module):
    """The decoder's config (the text part of a multimodal config)."""
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def check_model(model: nn.Module, *, role: str, max_model_len: int) -> None:
    """Raise ``ValueError`` naming the feature if ``model`` (the engine's ``role``) cannot be run exactly."""
    _check_attention_layers(model, role)
    _check_position_bias(model, role)
    _check_not_sharded(model, role)
    _check_rope(model, role, max_model_len)


# Layer kinds the paged kernels compute exactly (per-layer windows come from the attention module itself).
_ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "attention"})


def _check_attention_layers(model: nn.Module, role: str) -> None:
    """Every layer must be softmax attention with a K/V cache the arena can hold."""
    config = text_config(model)
    if getattr(config, "num_attention_heads", None) is None:
        raise ValueError(
            f"{role}: {type(model).__name__} has no attention heads (a recurrent / state-space model): "
            "the engine runs decoders whose layers attend over a K/V cache"
        )
    for attr in ("layer_types", "block_types"):
        other = set(getattr(config, attr, None) or ()) - _ATTENTION_LAYER_TYPES
        if other:
            raise ValueError(
                f"{role}: {type(model).__name__} has {attr} {sorted(other)}, which are not softmax "
                "attention over a K/V cache; the engine cannot run them"
            )
    if any(isinstance(getattr(m, "sinks", None), nn.Parameter) for m in model.modules()):
        raise ValueError(f"{role}: {type(model).__name__} uses attention sinks, which the engine lacks")


# Families whose attention always carries ALiBi, with no config flag to say so.
_ALIBI_MODEL_TYPES = frozenset({"bloom"})


def uses_alibi(model: nn.Module) -> bool:
    """Whether ``model`` adds ALiBi's per-head linear bias to its attention scores (Falcon's ``alibi``, MPT's
    ``attn_config.alibi``, BLOOM always)."""
    config = text_config(model)
    if getattr(config, "model_type", None) in _ALIBI_MODEL_TYPES:
        return True
    attn = getattr(config, "attn_config", None)
    nested = attn.get("alibi") if isinstance(attn, dict) else getattr(attn, "alibi", None)
    flags = (getattr(config, "alibi", None), getattr(config, "use_alibi", None), nested)
    return any(bool(flag) for flag in flags)


def _check_position_bias(model: nn.Module, role: str) -> None:
    """HF gives ALiBi models their position bias through the attention mask, and the paged kernels take no
    mask (they mask causally from the cache's metadata): such a model would run with no position
    information at all. Falcon routes its attention through ``AttentionInterface`` from transformers 5.25,
    its ALiBi variant too."""
    if uses_alibi(model):
        raise ValueError(
            f"{role}: {type(model).__name__} uses ALiBi position biases, which HF adds to the attention "
            "mask; the engine's paged attention takes no mask, so it cannot run them"
        )


def _check_not_sharded(model: nn.Module, role: str) -> None:
    """Sharded weights hold a slice of each tensor per rank. An FSDP2 actor or critic never gets here (the
    engine runs a replica of it, ``model/replica.py``); FSDP1 and DeepSpeed ZeRO-3 parameters cannot be
    gathered by the engine, so their trainers send full weights instead."""
    explicit = (
        "build the engine on a copy of the model on the meta device and send full weights with "
        "update_policy(weights=...) (docs/scale-out.md, 'Sharded trainer models')"
    )
    for m in model.modules():
        if type(m).__name__ == "FullyShardedDataParallel":
            raise ValueError(f"{role}: sharded weights (FSDP1) cannot be read by the engine; {explicit}")
        if any(c.__name__ == "FSDPModule" for c in type(m).__mro__):
            raise ValueError(
                f"{role}: sharded weights (FSDP2) are supported for the actor and the critic only (they run "
                f"as rollout replicas); pass an unsharded {role}"
            )
    for p in model.parameters():
        if hasattr(p, "ds_id"):
            raise ValueError(
                f"{role}: sharded weights (DeepSpeed ZeRO-3 parameters) cannot be read by the engine; "
                f"{explicit}"
            )
        if type(p).__name__ == "DTensor":
            raise ValueError(
                f"{role}: sharded weights (DTensor parameters outside FSDP2) are not supported; {explicit}"
            )


def _rope_parameters(config) -> list[dict]:
    """Every RoPE parameter dict of a config: one, or one per layer type (Gemma3)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(params, dict):
        return []
    if "rope_type" in params or "type" in params:
        return [params]
    return [p for p in params.values() if isinstance(p, dict)]


def _rope_exact_limit(model: nn.Module) -> tuple[int, str] | None:
    """``(limit, rope_type)`` for RoPE whose frequencies depend on the longest sequence of the batch: the
    longest ``max_model_len`` at which it is still exact (None for every other position encoding).

    HF's "dynamic" (NTK) and "longrope" RoPE size their frequencies from ``max(position_ids) + 1`` over the
    whole (packed) batch, so one sequence's numbers would depend on its neighbours. Below the original
    context length both are the plain RoPE, so they are exact when ``max_model_len`` keeps every position
    there (dynamic: strictly below, since HF resets a grown cache only for shorter batches).
    """
    config = text_config(model)
    limits = []
    for params in _rope_parameters(config):
        rope_type = params.get("rope_type", params.get("type", "default"))
        if "dynamic" in rope_type:
            limits.append((config.max_position_embeddings - 1, rope_type))
        elif rope_type == "longrope":
            limit = params.get("original_max_position_embeddings") or getattr(
                config, "original_max_position_embeddings", config.max_position_embeddings
            )
            limits.append((limit, rope_type))
    return min(limits) if limits else None


def _check_rope(model: nn.Module, role: str, max_model_len: int) -> None:
    """Refuse RoPE whose frequencies depend on the longest sequence of the batch, past where it is exact
    (``_rope_exact_limit``)."""
    found = _rope_exact_limit(model)
    if found is not None and max_model_len > found[0]:
        limit, rope_type = found
        raise ValueError(
            f"{role}: rope_type={rope_type!r} RoPE sizes its frequencies from the longest sequence in a "
            f"batch, so with max_model_len={max_model_len} > {limit} a rollout would depend on its "
            f"batch neighbours; set EngineConfig.max_model_len <= {limit} (exact there) or use a static "
            "RoPE scaling"
        )


def position_limit(model: nn.Module) -> tuple[int | None, bool]:
    """``(limit, learned)``: the most positions ``model`` was built for (``n_positions`` or
    ``max_position_embeddings``; None when its config states none) and whether they index a learned
    position-embedding table (a position past it fails, or reads another row) rather than RoPE (past it the
    model runs, but outside the lengths it was trained on)."""
    config = text_config(model)
    limit = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    if not isinstance(limit, int):
        return None, False
    learned = any(
        isinstance(m, nn.Embedding) and name.rsplit(".", 1)[-1] in _POSITION_TABLES
        for name, m in model.named_modules()
    )
    return limit, learned


def resolve_max_model_len(configured: int | None, models: Mapping[str, nn.Module]) -> int:
    """The longest sequence (prompt + response) the engine runs, from ``EngineConfig.max_model_len``.

    ``None``: the smallest of ``DEFAULT_MAX_MODEL_LEN`` and every model's position limit (for a dynamic or
    longrope RoPE, the longest length at which it is exact). An explicit value
    past a learned position table raises ``ValueError`` naming the role and both numbers; past a RoPE
    model's ``max_position_embeddings`` it warns (exact, but beyond what the model was trained on).
    ``models`` maps role to model; entries that are not ``nn.Module`` (a reward callable) are skipped.
    """
    modules = {role: m for role, m in models.items() if isinstance(m, nn.Module)}
    limits = {role: position_limit(m) for role, m in modules.items()}
    if configured is None:
        exact = [found[0] for m in modules.values() if (found := _rope_exact_limit(m)) is not None]
        stated = [limit for limit, _ in limits.values() if limit is not None]
        return min([DEFAULT_MAX_MODEL_LEN, *stated, *exact])
    for role, (limit, learned) in limits.items():
        if limit is None or configured <= limit:
            continue
        if learned:
            raise ValueError(
                f"{role}: max_model_len={configured} exceeds its learned position table of {limit} "
                f"positions (n_positions / max_position_embeddings); set EngineConfig.max_model_len <= "
                f"{limit}, or leave it None to take the models' limit"
            )
        exact = _rope_exact_limit(modules[role])
        if exact is not None and configured > exact[0]:
            continue  # refused by check_model, with the reason
        warnings.warn(
            f"{role}: max_model_len={configured} exceeds its max_position_embeddings={limit}: positions "
            "past it are computed exactly but lie beyond the lengths the model was trained on",
            stacklevel=3,
        )
    return configured
