"""Benchmark workloads (seeded prompt/response length distributions) and model presets.

Responses run with `ignore_eos=True`, so each rollout's length is exactly its `max_new_tokens` and
the distribution alone shapes the step: `longtail` is the RLHF case OPPO targets (most responses
short, a few near the cap hold the batch back).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from oppo_engine.presets import EOS_TOKEN_ID, PAD_TOKEN_ID, PRESETS, build_models, preset_config

__all__ = [
    "DISTRIBUTIONS",
    "EOS_TOKEN_ID",
    "PAD_TOKEN_ID",
    "PRESETS",
    "Workload",
    "build_models",
    "make_workload",
    "preset_config",
    "sample_lengths",
]

# Ids below this are left to special tokens (pad, eos, ...) so prompts are plain text-like ids.
TOKEN_ID_LOW = 16

LONGTAIL_SIGMA = 1.0  # log-space spread: ~2% of draws exceed the cap and are clipped to it
BIMODAL_MODES = (0.1, 0.8)  # centres of the short and long mode, as fractions of the cap
BIMODAL_STD = 0.05  # spread of each mode, fraction of the cap
BIMODAL_LONG_WEIGHT = 0.3  # share of draws from the long mode


def _longtail(rng: np.random.Generator, n: int, cap: int) -> np.ndarray:
    """Lognormal with median cap/8."""
    return rng.lognormal(mean=math.log(cap / 8), sigma=LONGTAIL_SIGMA, size=n)


def _uniform(rng: np.random.Generator, n: int, cap: int) -> np.ndarray:
    return rng.integers(1, cap + 1, size=n).astype(np.float64)


def _bimodal(rng: np.random.Generator, n: int, cap: int) -> np.ndarray:
    """Mixture of two normals: mostly short responses plus a block near the cap."""
    centre = np.where(rng.random(n) < BIMODAL_LONG_WEIGHT, BIMODAL_MODES[1], BIMODAL_MODES[0])
    return rng.normal(centre * cap, BIMODAL_STD * cap)


DISTRIBUTIONS: dict[str, Callable[[np.random.Generator, int, int], np.ndarray]] = {
    "longtail": _longtail,
    "uniform": _uniform,
    "bimodal": _bimodal,
}


def sample_lengths(name: str, n: int, cap: int, rng: np.random.Generator) -> list[int]:
    """`n` lengths from distribution `name`, rounded and clipped to [1, cap]."""
    if name not in DISTRIBUTIONS:
        raise ValueError(f"workload {name!r} is unknown; choose from {sorted(DISTRIBUTIONS)}")
    if cap < 1:
        raise ValueError(f"length cap must be >= 1, got {cap}")
    raw = DISTRIBUTIONS[name](rng, n, cap)
    return np.clip(np.rint(raw), 1, cap).astype(np.int64).tolist()


@dataclass(frozen=True, slots=True)
class Workload:
    """Prompts and per-prompt response lengths of one benchmark run."""

    name: str
    prompts: list[list[int]]
    max_new_tokens: list[int]
    seed: int

    @property
    def response_tokens(self) -> int:
        """Total tokens to generate over all prompts."""
        return sum(self.max_new_tokens)


def make_workload(
    name: str, num_prompts: int, prompt_len_cap: int, response_len_cap: int, vocab_size: int, seed: int
) -> Workload:
    """A seeded workload: same arguments, same prompts and lengths, on any machine."""
    if vocab_size <= TOKEN_ID_LOW:
        raise ValueError(f"vocab_size must exceed {TOKEN_ID_LOW} (reserved special ids), got {vocab_size}")
    # NOTE: independent streams, so the response lengths of a seed do not change with prompt_len_cap.
    len_rng, resp_rng, ids_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(3))
    prompt_lens = sample_lengths(name, num_prompts, prompt_len_cap, len_rng)
    max_new = sample_lengths(name, num_prompts, response_len_cap, resp_rng)
    prompts = [ids_rng.integers(TOKEN_ID_LOW, vocab_size, size=n).tolist() for n in prompt_lens]
    return Workload(name, prompts, max_new, seed)
