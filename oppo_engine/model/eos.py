"""Which token ids end a response: the caller's, or those the actor's own configuration lists."""

from __future__ import annotations

import warnings
from collections.abc import Iterable

from torch import nn

from oppo_engine.model.support import text_config


def resolve_eos_token_ids(actor: nn.Module, eos_token_id: int | Iterable[int] | None) -> tuple[int, ...]:
    """The EOS ids a response stops at, sorted.

    ``None`` (the engine's default) takes the union of the ids in the actor's ``generation_config`` and its
    config, as HF ``generate`` does (Llama 3 lists several), and warns once if neither has one: generation
    then runs to ``max_new_tokens``. An int is one id; an iterable lists them; ``()`` never stops on EOS.
    """
    if eos_token_id is not None:
        ids = (eos_token_id,) if isinstance(eos_token_id, int) else tuple(eos_token_id)
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or t < 0]
        if bad:
            raise ValueError(f"eos_token_id must be an int >= 0 or a sequence of them, got {eos_token_id!r}")
        return tuple(sorted(set(ids)))
    found: set[int] = set()
    generation = getattr(actor, "generation_config", None)
    for source in (
        getattr(generation, "eos_token_id", None),
        getattr(text_config(actor), "eos_token_id", None),
    ):
        if source is None:
            continue
        found.update(int(t) for t in ((source,) if isinstance(source, int) else source))
    if not found:
        warnings.warn(
            "eos_token_id=None and the actor's generation_config and config list no EOS id: responses run to "
            "max_new_tokens; pass eos_token_id= (or eos_token_id=() to silence this)",
            stacklevel=3,
        )
    return tuple(sorted(found))
