"""Streaming reward scoring: incremental prefill of response chunks into the reward model's paged cache."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from oppo_engine.model.runner import ModelRunner, SeqChunk


class RewardScorer:
    """Scores sequences with a one-label reward model as their tokens arrive, chunk by chunk.

    Each ``prefill`` call is one packed forward over chunks of several sequences (any sizes); a sequence's
    chunks arrive in order over several calls, its KV staying in the reward model's pages in between, so
    only the last chunk is left to prefill when the sequence ends. The score after a sequence's final
    chunk is its reward (equal to the HF model's score on the whole sequence, up to rounding).

    NOTE: the scheduler reserves the slots (``runner.cache.append_slots``) before ``prefill`` and calls
    ``release`` once the reward is read or the sequence is dropped; the scorer owns no other state.
    """

    def __init__(self, runner: ModelRunner) -> None:
        if runner.score_head is None:
            raise ValueError(
                f"reward: RewardScorer needs a model with a score head, not {type(runner.model).__name__}"
            )
        self.runner = runner
        self.cache = runner.cache

    def prefill(self, chunks: Sequence[SeqChunk]) -> torch.Tensor:
        """Prefill the chunks; returns the score ``[N]`` float32 at each chunk's last token."""
        return self.runner.score_last(chunks)

    def prefill_scores(self, chunks: Sequence[SeqChunk]) -> list[float]:
        """``prefill`` with the scores read back to the host (one sync), for the schedulers."""
        return self.prefill(chunks).tolist()

    def release(self, seq_id: Hashable) -> None:
        """Free every reward-model page of ``seq_id`` (harmless if already released)."""
        self.cache.free(seq_id)
