"""What the engine can run exactly: checks made when an engine is built, never at the first step.

A model the engine would run with silently different numbers is refused here with a ``ValueError`` that
names the feature. What is accepted is exact by construction: attention goes through the paged kernels
(causal, per-layer sliding windows, logit softcap), logits through the model's own head.
"""

from __future__ import annotations

from torch import nn


def text_config(model: nn.Module):
    """The decoder's config (the text part of a multimodal config)."""
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def check_model(model: nn.Module, *, role: str, max_model_len: int) -> None:
    """Raise ``ValueError`` naming the feature if ``model`` (the engine's ``role``) cannot be run exactly."""
    _check_attention_layers(model, role)
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


def _check_not_sharded(model: nn.Module, role: str) -> None:
    """Sharded weights (FSDP, FSDP2, DeepSpeed ZeRO-3) hold a slice of each tensor per rank."""
    for m in model.modules():
        if type(m).__name__ == "FullyShardedDataParallel" or any(
            c.__name__ == "FSDPModule" for c in type(m).__mro__
        ):
            raise ValueError(
                f"{role}: sharded weights (FSDP) are not supported yet; pass the unsharded module "
                "(e.g. gather the full state dict into a replica for rollouts)"
            )
    for p in model.parameters():
        if type(p).__name__ == "DTensor" or hasattr(p, "ds_id"):
            raise ValueError(
                f"{role}: sharded weights (FSDP2 DTensor / DeepSpeed ZeRO-3 parameters) are not supported "
                "yet; pass an unsharded replica of the model"
            )


def _rope_parameters(config) -> list[dict]:
    """Every RoPE parameter dict of a config: one, or one per layer type (Gemma3)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(params, dict):
        return []
    if "rope_type" in params or "type" in params:
        return [params]
    return [p for p in params.values() if isinstance(p, dict)]


def _check_rope(model: nn.Module, role: str, max_model_len: int) -> None:
    """Refuse RoPE whose frequencies depend on the longest sequence of the batch, where that can happen.

    HF's "dynamic" (NTK) and "longrope" RoPE size their frequencies from ``max(position_ids) + 1`` over the
    whole (packed) batch, so one sequence's numbers would depend on its neighbours. Below the original
    context length both are the plain RoPE, so they are exact when ``max_model_len`` keeps every position
    there (dynamic: strictly below, since HF resets a grown cache only for shorter batches).
    """
    config = text_config(model)
    for params in _rope_parameters(config):
        rope_type = params.get("rope_type", params.get("type", "default"))
        if "dynamic" in rope_type:
            limit = config.max_position_embeddings - 1
        elif rope_type == "longrope":
            limit = params.get("original_max_position_embeddings") or getattr(
                config, "original_max_position_embeddings", config.max_position_embeddings
            )
        else:
            continue
        if max_model_len > limit:
            raise ValueError(
                f"{role}: rope_type={rope_type!r} RoPE sizes its frequencies from the longest sequence in a "
                f"batch, so with max_model_len={max_model_len} > {limit} a rollout would depend on its "
                f"batch neighbours; set EngineConfig.max_model_len <= {limit} (exact there) or use a static "
                "RoPE scaling"
            )
