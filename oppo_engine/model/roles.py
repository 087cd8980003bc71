"""The four models of PPO (actor, reward, reference, critic) as the engine receives them: checked, and
sorted into the ones it runs through its paged cache and a reward it only calls."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from oppo_engine.model.eos import resolve_eos_token_ids
from oppo_engine.model.rewards import BatchedReward, check_reward_arity
from oppo_engine.model.runner import unwrap_model
from oppo_engine.model.scorer import RetokenizedReward, RuleReward
from oppo_engine.model.support import check_model, resolve_max_model_len, text_config

ACTOR, REWARD, REFERENCE, CRITIC = "actor", "reward", "reference", "critic"


def device_of(model: nn.Module) -> torch.device:
    """The device of the model's parameters."""
    return next(model.parameters()).device


def dtype_of(model: nn.Module) -> torch.dtype:
    """The dtype of the model's parameters."""
    return next(model.parameters()).dtype


@dataclass(slots=True)
class Roles:
    """The models the engine runs by role (actor first), the reward it calls instead when that one is not
    streamed (``rule``), and what the models settle: the longest sequence, the vocabulary, the EOS ids."""

    models: dict[str, nn.Module]
    rule: RuleReward | None
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]


def resolve_roles(
    actor: nn.Module,
    reward: nn.Module | RuleReward,
    reference: nn.Module | None,
    critic: nn.Module | None,
    *,
    max_model_len: int | None,
    eos_token_id: int | Iterable[int] | None,
    tokenizer=None,
    reward_tokenizer=None,
    remote: bool = False,
) -> Roles:
    """The engine's ``Roles``: ``max_model_len`` resolved against every model's position limit
    (``support.resolve_max_model_len``), the models checked and collected (``collect_models``), the EOS ids
    resolved (``eos.resolve_eos_token_ids``)."""
    resolved = resolve_max_model_len(
        max_model_len, {ACTOR: actor, REWARD: reward, REFERENCE: reference, CRITIC: critic}
    )
    models, rule = collect_models(
        actor, reward, reference, critic, max_model_len=resolved, tokenizer=tokenizer,
        reward_tokenizer=reward_tokenizer, remote=remote,
    )  # fmt: skip
    vocab_size = int(text_config(actor).vocab_size)
    return Roles(models, rule, resolved, vocab_size, resolve_eos_token_ids(actor, eos_token_id))


def collect_models(
    actor: nn.Module,
    reward: nn.Module | RuleReward,
    reference: nn.Module | None,
    critic: nn.Module | None,
    *,
    max_model_len: int,
    tokenizer=None,
    reward_tokenizer=None,
    remote: bool = False,
) -> tuple[dict[str, nn.Module], RuleReward | None]:
    """``(models, rule)``: the models the engine runs through its cache by role, actor first, and the
    reward as a callable when it is not streamed (a rule, or a reward model of another vocabulary, then
    wrapped to re-tokenize); ``remote``: the reward is scored on another rank (no model, no rule).
    Raises ``ValueError`` naming the role and the feature for anything the
    engine cannot run exactly (``support.check_model``), models on another device than the actor's, and a
    scorer that would read the actor's token ids in another vocabulary.
    """
    if not isinstance(actor, nn.Module) or actor.get_output_embeddings() is None:
        raise ValueError("actor must be an HF causal LM (a model with an output embedding / LM head)")
    check_model(actor, role=ACTOR, max_model_len=max_model_len)
    vocab_size = int(text_config(actor).vocab_size)
    if isinstance(reward, nn.Module):
        reward = _reward_for_vocab(reward, vocab_size, tokenizer, reward_tokenizer)
    elif remote:
        reward = None  # scored on another rank (dist.RemoteScorers): nothing to run here
    elif not callable(reward):
        raise ValueError("reward must be an HF sequence-classification model or a callable(prompt, response)")
    elif not isinstance(reward, BatchedReward):  # BatchedReward checked its fn when it was made
        check_reward_arity(reward, "reward")
    models: dict[str, nn.Module] = {ACTOR: actor}
    streamed = ((REWARD, reward if isinstance(reward, nn.Module) else None), (REFERENCE, reference),
                (CRITIC, critic))  # fmt: skip
    for role, model in streamed:
        if model is None:
            continue
        if not isinstance(model, nn.Module):
            raise ValueError(f"{role} must be an HF model, got {type(model).__name__}")
        if device_of(model) != device_of(actor):
            raise ValueError(
                f"{role} is on {device_of(model)} but actor is on {device_of(actor)}: models on different "
                "devices need a configured placement, which this engine does not support yet"
            )
        if role != REWARD:  # the reward's vocabulary was settled above
            vocab = getattr(text_config(model), "vocab_size", None)
            if vocab != vocab_size:
                raise ValueError(
                    f"{role}: its vocabulary has {vocab} tokens, the actor's {vocab_size}; it reads the "
                    "actor's token ids, so it needs the actor's vocabulary"
                )
        check_model(model, role=role, max_model_len=max_model_len)
        models[role] = model
    return models, None if isinstance(reward, nn.Module) or remote else reward


def _reward_for_vocab(reward: nn.Module, vocab_size: int, tokenizer, reward_tokenizer):
    """The reward model itself when it reads the actor's ids; a re-tokenizing callable when it cannot."""
    if reward_tokenizer is not None and tokenizer is None:
        raise ValueError("reward_tokenizer needs tokenizer= (the actor's) to decode the actor's token ids")
    reward_tokenizer = reward_tokenizer if reward_tokenizer is not None else tokenizer  # alone: shared
    if tokenizer is not None and tokenizer.get_vocab() != reward_tokenizer.get_vocab():
        return RetokenizedReward(unwrap_model(reward), tokenizer, reward_tokenizer)
    reward_vocab = getattr(text_config(reward), "vocab_size", None)
    if reward_vocab != vocab_size:
        raise ValueError(
            f"reward: its vocabulary has {reward_vocab} tokens, the actor's {vocab_size}; the actor's token "
            "ids would be read as other tokens. Pass tokenizer= and reward_tokenizer= to re-tokenize each "
            "response for the reward model (not streamed)"
        )
    return reward
