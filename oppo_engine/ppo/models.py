"""The four PPO models from local paths: actor and frozen reference (the same causal LM), frozen reward
model and critic (the same one-label sequence classifier, as TRL initialises its value model)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from oppo_engine.pretrained import load_tokenizer

__all__ = ["PPOModels", "load_models", "load_tokenizer"]


@dataclass(slots=True)
class PPOModels:
    actor: nn.Module
    critic: nn.Module
    reference: nn.Module
    reward: nn.Module
    tokenizer: object


def load_models(
    actor_path: str | Path,
    reward_path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> PPOModels:
    """Load an HF causal LM (with its tokenizer) and a one-label reward model from local folders.

    The reference is a frozen copy of the actor, the critic a trainable copy of the reward model. The
    tokenizer gets a pad token (its EOS) if it has none."""
    load = dict(dtype=dtype, local_files_only=True)
    tokenizer = load_tokenizer(actor_path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    actor = AutoModelForCausalLM.from_pretrained(actor_path, **load).to(device)
    reward = AutoModelForSequenceClassification.from_pretrained(reward_path, **load).to(device)
    if reward.config.pad_token_id is None:
        reward.config.pad_token_id = tokenizer.pad_token_id
    reference = copy.deepcopy(actor).eval().requires_grad_(False)
    critic = copy.deepcopy(reward).train().requires_grad_(True)
    return PPOModels(actor.train(), critic, reference, reward.eval().requires_grad_(False), tokenizer)
