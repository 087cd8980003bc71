"""A minibatch's shared prompt prefix, computed once in the PPO update.

Rows of a PPO batch often begin with the same tokens: a system prompt, a worked example, a group of
samples of one prompt. In the padded layout (``batch.py``: prompt, response, right padding) those tokens
sit in the first columns of every row, so a minibatch's longest common prefix of ``p`` tokens is the same
in each of its ``n`` rows, at the same positions. A causal model's states over them do not depend on
anything after them, so they are computed once, for one row, with the model's KV cache (``use_cache``),
and that cache is repeated for the ``n`` rows before the rest of each row runs over it. Gradients flow back
through the repeat into the one prefix pass, summed over the rows, as in the padded forward. The rows'
own columns are what the losses read (``p`` is capped below the first sampled token), so the result is the
padded forward's to rounding (the products have other row counts), and the projections and MLP run on
``p + n * (w - p)`` positions instead of ``n * w``.

:func:`check_prefix` probes a model once, when the trainer is built: a model whose forward takes no cache,
or whose output over a cache differs from its output over the whole row, is not used this way.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from oppo_engine.model.runner import unwrap_model
from oppo_engine.model.support import text_config
from oppo_engine.ppo import core

MIN_PREFIX = 16  # shorter shared prefixes are not worth a second forward call


def shared_prefix(
    input_ids: torch.Tensor,
    keep: torch.Tensor,
    min_prefix: int = MIN_PREFIX,
    lengths: torch.Tensor | None = None,
) -> int:
    """How many leading columns every row of ``input_ids`` (``[n, w]``, right-padded) has in common and no
    row needs a log-prob before (``keep``, ``[n, w-1]``: column ``t`` predicts token ``t + 1``; the prefix
    stops at the first kept column of any row), within every row's own tokens (``lengths``, ``[n]``: the
    prefix ends before the shortest row's last token, never in its padding). 0 if that is under
    ``min_prefix`` or there is one row."""
    n, w = input_ids.shape
    if n < 2 or w < 3:
        return 0
    differs = (input_ids != input_ids[:1]).any(0)  # [w]
    common = int(differs.int().argmax()) if bool(differs.any()) else w
    kept = keep.any(0)
    first_kept = int(kept.int().argmax()) if bool(kept.any()) else w - 1
    p = min(common, first_kept, w - 2)
    if lengths is not None:
        p = min(p, int(lengths.min()) - 1)
    return p if p >= min_prefix else 0


def _cache_kwarg(model: nn.Module) -> str:
    """The name transformers gives the KV cache argument of ``model``'s forward (``cache`` from 5.2x,
    ``past_key_values`` before)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _backbone(model: nn.Module) -> nn.Module:
    return getattr(model, model.base_model_prefix)


def _prefix_cache(backbone: nn.Module, prefix: torch.Tensor, rows: int):
    """The KV cache of ``prefix`` (``[1, p]``) computed once, repeated for ``rows`` rows."""
    out = backbone(input_ids=prefix, use_cache=True)
    cache = getattr(out, "cache", None)
    if cache is None:
        cache = getattr(out, "past_key_values", None)
    if cache is None:  # e.g. activation checkpointing turned on after the trainer was built: never guess
        raise RuntimeError(
            f"share_prefix: {type(backbone).__name__} returned no KV cache for the shared prefix (activation "
            "checkpointing drops it in training); build the trainer with share_prefix=False"
        )
    cache.batch_repeat_interleave(rows)
    return cache


def _over_prefix(model: nn.Module, forward: nn.Module, input_ids: torch.Tensor, p: int):
    """The rows' positions after the prefix, and the arguments of ``forward`` (``model`` or its backbone)
    that hand them its KV cache: computed once by ``model``'s backbone for ``input_ids[0, :p]``, repeated
    for every row."""
    n, w = input_ids.shape
    cache = _prefix_cache(_backbone(model), input_ids[:1, :p], n)
    positions = torch.arange(p, w, device=input_ids.device).expand(n, -1)
    return positions, {_cache_kwarg(forward): cache, "use_cache": True}


def prefix_logprobs(
    actor: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float,
    keep: torch.Tensor,
    p: int,
) -> torch.Tensor:
    """:func:`core.token_logprobs` of right-padded rows whose first ``p`` columns are shared (``p`` from
    :func:`shared_prefix`): ``[n, w-1]``, 0 outside ``keep``."""
    model = unwrap_model(actor)
    positions, over = _over_prefix(model, model, input_ids, p)
    rest = core.token_logprobs(
        model, input_ids[:, p:], attention_mask, temperature, positions, keep[:, p:], model_kwargs=over
    )
    return torch.nn.functional.pad(rest, (p, 0))


def prefix_values(
    critic: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, p: int
) -> torch.Tensor:
    """:func:`core.token_values` of right-padded rows whose first ``p`` columns are shared: ``[n, w-1]``,
    0 in the first ``p`` columns (states inside the prefix, which no loss reads)."""
    model = unwrap_model(critic)
    positions, over = _over_prefix(model, _backbone(model), input_ids, p)
    rest = core.token_values(model, input_ids[:, p:], attention_mask, positions, model_kwargs=over)
    return torch.nn.functional.pad(rest, (p, 0))


def logprobs(
    actor, input_ids, attention_mask, temperature: float, keep: torch.Tensor, p: int
) -> torch.Tensor:
    """The actor's log-probs of the ``keep`` columns (``[n, w-1]``): over the shared prefix if ``p``, else
    one padded forward (:func:`core.token_logprobs`)."""
    if p:
        return prefix_logprobs(actor, input_ids, attention_mask, temperature, keep, p)
    return core.token_logprobs(actor, input_ids, attention_mask, temperature, keep=keep)


def values(critic, input_ids, attention_mask, p: int) -> torch.Tensor:
    """The critic's values (``[n, w-1]``): over the shared prefix if ``p`` (0 in its columns), else one
    padded forward (:func:`core.token_values`)."""
    if p:
        return prefix_values(critic, input_ids, attention_mask, p)
    return core.token_values(critic, input_ids, attention_mask)


def _dropout(model: nn.Module) -> bool:
    """Some dropout is active in training: a ``Dropout`` module with p > 0, or a config's dropout rate (HF
    attention passes ``attention_dropout`` to the kernel as a number)."""
    if any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules()):
        return True
    if getattr(model, "config", None) is None:
        return False
    configs = {id(c): c for c in (model.config, text_config(model))}
    for config in configs.values():
        for name, value in vars(config).items():
            if ("dropout" in name or name.endswith("pdrop")) and isinstance(value, float) and value > 0:
                return True
    return False


def checkpointing(model: nn.Module) -> bool:
    """Activation checkpointing is on somewhere in ``model`` (transformers then drops the KV cache in
    training, so the prefix path cannot run)."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def can_share(model: nn.Module) -> bool:
    """Whether ``model`` is one this path can run at all: an unsharded transformers model (a PEFT wrapper
    is unwrapped) whose backbone takes a KV cache, without a sliding attention window, dropout (one mask over
    the prefix would serve every row, where the padded forward draws one per row) or activation
    checkpointing (which drops the cache in training). An FSDP2 model is not: its ranks would make different
    numbers of forward calls, and its collectives would hang."""
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        return False
    if checkpointing(model) or _dropout(unwrap_model(model)):
        return False
    inner = unwrap_model(model)
    prefix = getattr(inner, "base_model_prefix", None)
    if not prefix or not isinstance(getattr(inner, prefix, None), nn.Module):
        return False
    config = text_config(inner)
    # A windowed layer's cache keeps only its window, and the probe's rows are shorter than windows are.
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        if any("sliding" in str(t) for t in layer_types):
            return False
    elif getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return False
    params = inspect.signature(_backbone(inner).forward).parameters
    return ("cache" in params or "past_key_values" in params) and "use_cache" in params


def check_prefix(model: nn.Module, role: str, probe, forward) -> str | None:
    """Whether ``model`` (``role``: for the message) gives over a shared prefix what it gives over whole
    rows: two rows built from ``probe`` (token ids) with a common prefix of ``MIN_PREFIX`` tokens, run
    both ways (``forward(model, ids, mask, keep, p)`` for the prefix path; ``p = 0`` for the padded one),
    in eval mode, without gradients. ``None`` if they agree to the dtype's rounding, else the reason."""
    if not can_share(model):
        return (
            f"the {role} ({type(model).__name__}) takes no KV cache, is sharded, or has a sliding window, "
            "dropout or activation checkpointing"
        )
    vocab = int(text_config(model).vocab_size)
    base = [int(t) % vocab for t in probe] or [1]
    prefix = (base * MIN_PREFIX)[:MIN_PREFIX]
    rows = [prefix + [(t + 3) % vocab for t in prefix[:5]], prefix + [(t + 7) % vocab for t in prefix[:3]]]
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    w = max(map(len, rows))
    ids = torch.zeros(2, w, dtype=torch.long, device=device)
    mask = torch.zeros(2, w, dtype=torch.long, device=device)
    for k, r in enumerate(rows):
        ids[k, : len(r)] = torch.tensor(r, device=device)
        mask[k, : len(r)] = 1
    keep = torch.zeros(2, w - 1, dtype=torch.bool, device=device)
    for k, r in enumerate(rows):
        keep[k, MIN_PREFIX : len(r) - 1] = True
    p = shared_prefix(ids, keep)
    if p != MIN_PREFIX:
        return f"the probe found a shared prefix of {p} tokens, not {MIN_PREFIX}"
    try:
        with torch.no_grad(), core.eval_semantics(model):
            shared, whole = forward(model, ids, mask, keep, p), forward(model, ids, mask, keep, 0)
    except Exception as e:  # a model whose forward refuses the cache arguments
        return f"the {role} ({type(model).__name__}) failed over a cache: {type(e).__name__}: {e}"
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    if not torch.allclose(shared[keep], whole[keep], rtol=tol, atol=tol):
        gap = float((shared[keep] - whole[keep]).abs().max())
        return f"the {role} ({type(model).__name__}) differs over a cache from its whole rows by {gap:.3g}"
    return None
