"""Streaming reward scoring: incremental prefill of response chunks into the reward model's paged cache."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import nn

from oppo_engine.model.runner import ModelRunner, SeqChunk


class RewardScorer:
    """Scores sequences with a one-label reward model as their tokens arrive, chunk by chunk.

    Each ``prefill`` call is one packed forward over chunks of several sequences (any sizes); a sequence's
    chunks arrive in order over several calls, its KV staying in the reward model's pages in between, so
    only the last chunk is left to prefill when the sequence ends. ``result(seq_id)`` after the final chunk
    is the reward: equal, up to rounding, to the HF model's own score on the whole sequence.

    HF's convention is followed exactly: with ``pad_token_id`` set, the score is read at the last token
    that is not the pad token (position 0 when every token is pad) -- so when ``pad_token_id`` equals EOS, a
    response ending in EOS is scored at the token before it, as the reward model was trained; without a
    pad token it is the last token. That position may lie in an earlier chunk, so the score of the latest
    non-pad token seen is kept per sequence.

    NOTE: the scheduler reserves the slots (``runner.cache.append_slots``) before ``prefill`` and calls
    ``release`` once the reward is read or the sequence is dropped.
    """

    def __init__(self, runner: ModelRunner) -> None:
        if runner.score_head is None:
            raise ValueError(
                f"reward: RewardScorer needs a model with a score head, not {type(runner.model).__name__}"
            )
        self.runner = runner
        self.cache = runner.cache
        config = runner.model.config
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.pad_token_id: int | None = text.pad_token_id
        self._scores: dict[Hashable, float] = {}

    def prefill(self, chunks: Sequence[SeqChunk]) -> None:
        """Prefill the chunks, keeping each sequence's score at its latest non-pad token."""
        rows: list[int] = []
        owners: list[Hashable] = []
        offset = 0
        for c in chunks:
            row = self._score_row(c)
            if row is not None:
                rows.append(offset + row)
                owners.append(c.seq_id)
            offset += len(c.token_ids)
        if not rows:  # every new token is pad: the forward still writes their KV
            self.runner.forward(chunks)
            return
        scores = self.runner.score_at(chunks, rows).tolist()
        self._scores.update(zip(owners, scores, strict=True))

    def result(self, seq_id: Hashable) -> float:
        """The reward of ``seq_id`` once its final chunk is prefilled."""
        return self._scores[seq_id]

    def release(self, seq_id: Hashable) -> None:
        """Free every reward-model page of ``seq_id`` and drop its score (harmless if already released)."""
        self.cache.free(seq_id)
        self._scores.pop(seq_id, None)

    def _score_row(self, chunk: SeqChunk) -> int | None:
        """Row of ``chunk`` whose score HF would read if the sequence ended here, or None to keep the last."""
        tokens = chunk.token_ids
        if self.pad_token_id is None:
            return len(tokens) - 1
        for i in range(len(tokens) - 1, -1, -1):
            if tokens[i] != self.pad_token_id:
                return i
        starts_sequence = self.cache.num_tokens(chunk.seq_id) == len(tokens)
        return 0 if starts_sequence else None


class RetokenizedReward:
    """A reward model of another vocabulary, as a callable ``(prompt_ids, response_ids) -> float``.

    The actor's ids are decoded with ``tokenizer`` (special tokens skipped), the text is re-encoded with
    ``reward_tokenizer`` (which adds its own special tokens, as its ``__call__`` does) and scored by the
    reward model's own HF forward in eval mode -- exact for that text, and not streamed: the engine calls it
    once a sequence has finished.
    """

    def __init__(self, model: nn.Module, tokenizer, reward_tokenizer) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.reward_tokenizer = reward_tokenizer

    def __call__(self, prompt_ids: list[int], response_ids: list[int]) -> float:
        text = self.tokenizer.decode(list(prompt_ids) + list(response_ids), skip_special_tokens=True)
        ids = self.reward_tokenizer(text, return_tensors="pt")["input_ids"].to(self.model.device)
        training = [m for m in self.model.modules() if m.training]
        self.model.eval()
        try:
            with torch.inference_mode():
                return float(self.model(input_ids=ids).logits[0, 0])
        finally:
            for m in training:
                m.training = True
