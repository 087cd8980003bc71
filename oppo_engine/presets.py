"""Model presets: random-init Qwen2-shaped models (real shapes, random weights) or a local checkpoint.

Used by the demo (``oppo-engine demo``) and the benchmarks; no network access is ever made.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, Qwen2Config

PAD_TOKEN_ID = 0
EOS_TOKEN_ID = 1

# Random-init Qwen2.5 shapes (config.json of the released checkpoints); only the cost matters here.
PRESETS: dict[str, dict] = {
    "tiny": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    ),
    # Big enough that a forward's matmuls, not Python, dominate on a CPU core (DESIGN.md, "What a CPU
    # allows"): where two lanes can overlap on a CPU.
    "small": dict(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    ),
    "0.5b": dict(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "1.5b": dict(
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    # Qwen2.5-3B's config.json: 36 layers of 2048, 16 heads over 2 KV heads, tied embeddings.
    "3b": dict(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "7b": dict(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    ),
}


def preset_config(preset: str) -> Qwen2Config:
    """The Qwen2 config of a named preset, with this module's pad/eos ids."""
    if preset not in PRESETS:
        raise ValueError(
            f"preset {preset!r} is neither {sorted(PRESETS)} nor an existing checkpoint directory"
        )
    return Qwen2Config(**PRESETS[preset], pad_token_id=PAD_TOKEN_ID, eos_token_id=EOS_TOKEN_ID)


def build_models(
    preset: str, dtype: torch.dtype, device: str | torch.device, seed: int
) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(actor causal LM, reward model with one label and pad_token_id set) in eval mode on `device`.

    A named preset builds both with random weights from the same shape (seeded, different weights);
    a directory path loads the actor checkpoint from it and a reward model on the same backbone
    whose score head is freshly initialised (HF warns about it), never touching the network.
    """
    torch.manual_seed(seed)
    if Path(preset).is_dir():
        config = AutoConfig.from_pretrained(preset, local_files_only=True)
        pad = config.pad_token_id
        if pad is None:  # Qwen2.5 checkpoints name no pad token; eos is the usual stand-in
            pad = config.eos_token_id if isinstance(config.eos_token_id, int) else PAD_TOKEN_ID
        load = dict(dtype=dtype, local_files_only=True)
        actor = AutoModelForCausalLM.from_pretrained(preset, **load)
        reward = AutoModelForSequenceClassification.from_pretrained(
            preset, num_labels=1, pad_token_id=pad, **load
        )
    else:
        # NOTE: built on the device itself: initialising 7B random weights on the host is slow and large.
        with torch.device(device):
            actor = AutoModelForCausalLM.from_config(preset_config(preset), dtype=dtype)
            reward_config = preset_config(preset)
            reward_config.num_labels = 1
            reward = AutoModelForSequenceClassification.from_config(reward_config, dtype=dtype)
    return actor.to(device).eval(), reward.to(device).eval()
