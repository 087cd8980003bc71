"""The four PPO models from local paths: actor and frozen reference (the same causal LM), frozen reward
model and critic (the same one-label sequence classifier, as TRL initialises its value model)."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedTokenizerFast,
)


def load_tokenizer(path: str | Path):
    """The tokenizer saved in ``path``. A plain ``tokenizers`` tokenizer (``TokenizersBackend``, as
    ``task.py`` saves) is loaded as such: ``AutoTokenizer`` would rebuild it as the class of the model
    type in ``config.json`` (Qwen2's byte-level BPE), with another pre-tokenizer."""
    config = Path(path) / "tokenizer_config.json"
    cls = json.loads(config.read_text()).get("tokenizer_class") if config.exists() else None
    if cls in ("TokenizersBackend", "PreTrainedTokenizerFast"):
        return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


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
