"""Tiny random-init HF models shared by the engine tests (no hub access: built from configs)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, Qwen2Config

from oppo_engine import ops

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


def small_linear_reproduces_onednn() -> bool:
    """Whether ``ops.small_linear`` runs here: the CPU has AVX-512 BF16 and its probe finds the order in which
    this CPU's oneDNN sums a few bf16 rows' products (``ops.small_linear_kblock``, on a plain 576 x 576
    product). Not on a CPU where oneDNN multiplies with AMX tiles (a Xeon with AMX-BF16, 2026-12-07: no run
    found at any row count; with ``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16`` the same probe found its runs):
    there the engine leaves such products to oneDNN (a few narrow ones, 48 wide, the probe did match), and
    the tests of the op and of the decoder layer run as one op, written for products it runs, skip."""
    return ops.SMALL_LINEAR_AVAILABLE and ops.small_linear_kblock(4, 576, 576, 1) is not None


SMALL_LINEAR_SKIP = (
    "needs ops.small_linear: a CPU with AVX-512 BF16 whose oneDNN sums bf16 products in an order it "
    "reproduces (not AMX tiles)"
)
