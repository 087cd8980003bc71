"""The tiny HF models a simulated engine is built with: their configs shape the caches (layers, heads,
page sizes differ per model); their weights never run (the stand-ins replace the forwards)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, Qwen2Config

VOCAB = 64
EOS = 3


def _config(**overrides) -> Qwen2Config:
    cfg = dict(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        eos_token_id=EOS,
        pad_token_id=0,
    )
    cfg.update(overrides)
    return Qwen2Config(**cfg)


@dataclass(frozen=True)
class SimModels:
    actor: torch.nn.Module
    reward: torch.nn.Module
    reference: torch.nn.Module
    critic: torch.nn.Module


@functools.cache
def sim_models() -> SimModels:
    """Built once per process (the engines built from them never write their weights)."""
    torch.manual_seed(0)
    causal = AutoModelForCausalLM.from_config
    seqcls = AutoModelForSequenceClassification.from_config
    return SimModels(
        actor=causal(_config(num_hidden_layers=2), dtype=torch.float32).eval(),
        reward=seqcls(_config(num_labels=1, num_key_value_heads=2), dtype=torch.float32).eval(),
        reference=causal(_config(), dtype=torch.float32).eval(),
        critic=seqcls(_config(num_labels=1, num_hidden_layers=3), dtype=torch.float32).eval(),
    )
