"""Tiny random-init HF models shared by the engine tests (no hub access: built from configs)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, Qwen2Config

VOCAB = 128
EOS = 3


def actor_config(**overrides) -> Qwen2Config:
    cfg = dict(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=EOS,
        pad_token_id=0,
    )
    cfg.update(overrides)
    return Qwen2Config(**cfg)


def make_actor(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(actor_config(), dtype=torch.float32).eval()


def make_reward(seed: int = 1) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = actor_config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_key_value_heads=4, num_labels=1
    )
    return AutoModelForSequenceClassification.from_config(cfg, dtype=torch.float32).eval()


def random_prompts(n: int, *, seed: int, min_len: int = 2, max_len: int = 12) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    # Ids from 4 up: never the EOS or pad ids, so prompts stay what they claim to be.
    return [torch.randint(4, VOCAB, (k,), generator=g).tolist() for k in lens]
