"""The PPO scorers: reward, reference log-probs and critic values, each prefilled incrementally into its own
pages of the arena as a sequence's tokens arrive, chunk by chunk; and rule rewards read once at the end.

Every scorer has the same small interface, so the step loops drive them without knowing which they hold:
``begin`` a sequence, ``prefill`` chunks of several sequences (one packed forward), ``finish`` a sequence
(its result for the ``Rollout`` field named by ``field``), ``release`` its pages and state.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from oppo_engine.cache.manager import KVCacheManager
from oppo_engine.model.finite import check_finite
from oppo_engine.model.rewards import BatchedReward, check_reward_value, reward_name
from oppo_engine.model.runner import ModelRunner, SeqChunk
from oppo_engine.model.support import text_config

RuleReward = Callable[[list[int], list[int]], float]


class Scorer(ABC):
    """Scores sequences for one ``Rollout`` field. ``cache`` is None for scorers that are not streamed.

    NOTE: the scheduler reserves a chunk's slots (``cache.append_slots``) before ``prefill`` and calls
    ``release`` once the result is read or the sequence is dropped; ``finish`` drops the per-sequence
    state but not the pages.
    """

    field: str  # "reward", "ref_logprobs" or "values"
    cache: KVCacheManager | None = None
    # ``fork`` may take over a source that has prefilled past the shared tokens: the scorer's state holds
    # nothing of the tokens before a prompt's last (per-token scorers read rows from there on), so the
    # source's state at any later point says nothing about ``dst``'s.
    fork_any_point: bool = False

    @property
    def name(self) -> str:
        """The scorer's model (its cache's name) or, for a rule, the field it fills; names its lane."""
        return self.cache.name if self.cache is not None else self.field

    def begin(self, seq_id: Hashable, prompt_len: int, temperature: float) -> None:  # noqa: B027
        """A sequence's first chunk is coming; ``temperature`` is the one it is sampled with (0 = greedy)."""

    def prefill(self, chunks: Sequence[SeqChunk]) -> None:  # noqa: B027
        """Prefill the next tokens of several sequences (slots already appended), in one forward."""

    def fork(self, src: Hashable, dst: Hashable) -> None:  # noqa: B027
        """``dst`` (begun, nothing prefilled) continues from ``src``'s prefilled tokens, which its pages now
        share: take over ``src``'s per-sequence state at that point. Stateless before the response by
        default (per-token scorers read rows from the last prompt token on, which a fork never shares)."""

    @abstractmethod
    def finish(self, seq_id: Hashable, prompt_ids: list[int], response_ids: list[int]):
        """The result for a sequence whose every token is prefilled."""

    def finish_batch(self, items: Sequence[tuple[list[int], list[int]]]) -> list:
        """The results of several whole sequences ``(prompt_ids, response_ids)`` of a scorer that is not
        streamed (``cache is None``), read together once a scoring pass has them all."""
        return [self.finish(None, p, r) for p, r in items]

    def release(self, seq_id: Hashable) -> None:
        """Free the sequence's pages and state (harmless if already released)."""
        if self.cache is not None:
            self.cache.free(seq_id)


class RewardScorer(Scorer):
    """A one-label reward model. The score after a sequence's final chunk is its reward: equal, up to
    rounding, to the HF model's own score on the whole sequence.

    HF's convention is followed exactly: with ``pad_token_id`` set, the score is read at the last token
    that is not the pad token (position 0 when every token is pad) -- so when ``pad_token_id`` equals EOS, a
    response ending in EOS is scored at the token before it, as the reward model was trained; without a
    pad token it is the last token. That position may lie in an earlier chunk, so the score of the latest
    non-pad token seen is kept per sequence.
    """

    field = "reward"

    def __init__(self, runner: ModelRunner) -> None:
        if runner.score_head is None:
            raise ValueError(
                f"reward: RewardScorer needs a model with a score head, not {type(runner.model).__name__}"
            )
        self.runner = runner
        self.cache = runner.cache
        self.pad_token_id: int | None = text_config(runner.model).pad_token_id
        self._scores: dict[Hashable, float] = {}

    def prefill(self, chunks: Sequence[SeqChunk]) -> None:
        """Prefill the chunks, keeping each sequence's score at its latest non-pad token."""
        rows: list[int] = []
        owners: list[Hashable] = []
        positions: list[int] = []
        offset = 0
        for c in chunks:
            row = self._score_row(c)
            if row is not None:
                rows.append(offset + row)
                owners.append(c.seq_id)
                positions.append(self.cache.num_tokens(c.seq_id) - len(c.token_ids) + row)
            offset += len(c.token_ids)
        if not rows:  # every new token is pad: the forward still writes their KV
            self.runner.forward(chunks)
            return
        scores = self.runner.score_at(chunks, rows).tolist()
        check_finite(self.name, "score", scores, owners, positions)
        self._scores.update(zip(owners, scores, strict=True))

    def fork(self, src: Hashable, dst: Hashable) -> None:
        """The score of ``src``'s latest non-pad token so far is ``dst``'s too."""
        if src in self._scores:
            self._scores[dst] = self._scores[src]

    def result(self, seq_id: Hashable) -> float:
        """The score HF would give the tokens prefilled so far."""
        return self._scores[seq_id]

    def finish(self, seq_id: Hashable, prompt_ids: list[int], response_ids: list[int]) -> float:
        return self._scores.pop(seq_id)

    def release(self, seq_id: Hashable) -> None:
        super().release(seq_id)
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


@dataclass(slots=True)
class _Progress:
    """What a per-token scorer keeps of one sequence between chunks."""

    prompt_len: int
    temperature: float
    out: list[float] = field(default_factory=list)
    carry: torch.Tensor | None = None  # [V] log-probs after the previous chunk's last token (reference)


_Span = tuple[SeqChunk, int, int]  # a chunk, its first position at or after prompt_len - 1, its first row


class _PerTokenScorer(Scorer):
    """A scorer with one output per response token, read from the rows at positions ``prompt_len - 1`` on
    (the row before each response token)."""

    fork_any_point = True  # a shared prefix ends before prompt_len - 1: it leaves no state (``fork``)

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.cache = runner.cache
        self._progress: dict[Hashable, _Progress] = {}

    def begin(self, seq_id: Hashable, prompt_len: int, temperature: float) -> None:
        self._progress[seq_id] = _Progress(prompt_len, temperature)

    def finish(self, seq_id: Hashable, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
        progress = self._progress.pop(seq_id)
        # The last response token's own row predicts nothing the rollout holds: drop what it produced.
        return progress.out[: len(response_ids)]

    def release(self, seq_id: Hashable) -> None:
        super().release(seq_id)
        self._progress.pop(seq_id, None)

    def prefill(self, chunks: Sequence[SeqChunk]) -> None:
        rows, spans = self._response_rows(chunks)
        if not rows:  # every chunk lies before the response: the forward still writes their KV
            self.runner.forward(chunks)
            return
        self._read(chunks, rows, spans)

    @abstractmethod
    def _read(self, chunks: Sequence[SeqChunk], rows: list[int], spans: list[_Span]) -> None:
        """Run the forward over ``chunks`` and append each sequence's outputs at ``rows``."""

    def _response_rows(self, chunks: Sequence[SeqChunk]) -> tuple[list[int], list[_Span]]:
        """Packed rows at positions >= prompt_len - 1, and per chunk (chunk, first position, first row)."""
        rows: list[int] = []
        spans = []
        offset = 0
        for c in chunks:
            end = self.cache.num_tokens(c.seq_id)
            start = end - len(c.token_ids)
            first = max(start, self._progress[c.seq_id].prompt_len - 1)
            spans.append((c, first, len(rows)))
            rows.extend(offset + p - start for p in range(first, end))
            offset += len(c.token_ids)
        return rows, spans


class ReferenceScorer(_PerTokenScorer):
    """A frozen causal LM: ``ref_logprobs[i]`` = log-prob of ``response_ids[i]`` under its logits divided
    by the sequence's temperature (1 for greedy; no top-k/top-p truncation), as TRL's PPO computes them.

    The row before the first token of a chunk belongs to the previous chunk: its log-probs are carried over.
    """

    field = "ref_logprobs"

    def __init__(self, runner: ModelRunner) -> None:
        if runner.lm_head is None:
            raise ValueError(f"reference: {type(runner.model).__name__} is not a causal LM (no LM head)")
        super().__init__(runner)

    def _read(self, chunks: Sequence[SeqChunk], rows: list[int], spans: list[_Span]) -> None:
        logits = self.runner.logits_at(chunks, rows, float32=False)  # [R, V] in the model's dtype
        inv_t = torch.tensor(
            [1.0 / self._temperature(c.seq_id) for c, first, _ in spans for _ in range(first, self._end(c))],
            device=logits.device,
        )
        lse = scaled_logsumexp(logits, inv_t)  # [R] float32, never a [R, V] float32 tensor
        # Gather every sequence's picks at once and read them back in one copy each (no sync per sequence):
        # a chunk's first token is predicted by the previous chunk's last row (its carry), the others by the
        # rows before them in this chunk.
        carries: list[torch.Tensor] = []
        rows_picked: list[int] = []
        tokens_picked: list[int] = []
        layout: list[tuple[_Progress, bool, int]] = []  # per chunk: (progress, carry used, picks from rows)
        for c, first, row0 in spans:
            progress = self._progress[c.seq_id]
            end = self._end(c)
            start = end - len(c.token_ids)
            targets = c.token_ids[first + 1 - start :]  # the tokens the rows before them predict
            use_carry = progress.carry is not None and start >= progress.prompt_len
            if use_carry:
                carries.append(progress.carry[c.token_ids[0]])
            rows_picked.extend(range(row0, row0 + len(targets)))
            tokens_picked.extend(targets)
            layout.append((progress, use_carry, len(targets)))
            # One row's log-probs: the next chunk's first token is not known yet.
            last = row0 + end - 1 - first
            progress.carry = logits[last].float() * inv_t[last] - lse[last] if end - 1 >= first else None
        from_carries = torch.stack(carries).tolist() if carries else []
        from_rows = []
        if rows_picked:
            index = torch.tensor([rows_picked, tokens_picked], device=logits.device)
            from_rows = picked_logprobs(logits, inv_t, lse, index[0], index[1]).tolist()
        check_finite(self.name, "log-probs", from_carries + from_rows, *_owners(spans, self.cache, layout))
        next_carry = next_row = 0
        for progress, use_carry, n in layout:
            if use_carry:
                progress.out.append(from_carries[next_carry])
                next_carry += 1
            progress.out.extend(from_rows[next_row : next_row + n])
            next_row += n

    def _temperature(self, seq_id: Hashable) -> float:
        t = self._progress[seq_id].temperature
        return t if t > 0 else 1.0

    def _end(self, chunk: SeqChunk) -> int:
        return self.cache.num_tokens(chunk.seq_id)


def _owners(
    spans: list[_Span], cache: KVCacheManager, layout: list[tuple[_Progress, bool, int]]
) -> tuple[list[Hashable], list[int]]:
    """The sequence and position of each reference log-prob read (the carries first, then the picks from
    rows, as ``ReferenceScorer._read`` lists them): a pick at row ``p`` is the log-prob of token ``p + 1``."""
    carried: tuple[list[Hashable], list[int]] = ([], [])
    picked: tuple[list[Hashable], list[int]] = ([], [])
    for (c, first, _), (_, use_carry, n) in zip(spans, layout, strict=True):
        start = cache.num_tokens(c.seq_id) - len(c.token_ids)
        if use_carry:
            carried[0].append(c.seq_id)
            carried[1].append(start)
        picked[0].extend([c.seq_id] * n)
        picked[1].extend(range(first + 1, first + 1 + n))
    return carried[0] + picked[0], carried[1] + picked[1]


class CriticScorer(_PerTokenScorer):
    """A one-label value model: ``values[i]`` = its score head on the hidden state of the token before
    ``response_ids[i]`` (TRL's convention)."""

    field = "values"

    def __init__(self, runner: ModelRunner) -> None:
        if runner.score_head is None:
            raise ValueError(f"critic: {type(runner.model).__name__} has no one-label score head")
        super().__init__(runner)

    def _read(self, chunks: Sequence[SeqChunk], rows: list[int], spans: list[_Span]) -> None:
        values = self.runner.score_at(chunks, rows).tolist()
        owners = [c.seq_id for c, first, _ in spans for _ in range(first, self.cache.num_tokens(c.seq_id))]
        positions = [p for c, first, _ in spans for p in range(first, self.cache.num_tokens(c.seq_id))]
        check_finite(self.name, "values", values, owners, positions)
        for c, first, row0 in spans:
            n = max(0, self.cache.num_tokens(c.seq_id) - first)  # 0 for a chunk before the response
            self._progress[c.seq_id].out.extend(values[row0 : row0 + n])


class RuleScorer(Scorer):
    """A plain callable ``reward(prompt_ids, response_ids) -> float`` read once a sequence has finished, or a
    ``BatchedReward`` read once for every sequence a scoring pass finishes."""

    field = "reward"

    def __init__(self, rule: RuleReward | BatchedReward) -> None:
        self.rule = rule
        self.name_for_errors = reward_name(rule)

    def finish(self, seq_id: Hashable, prompt_ids: list[int], response_ids: list[int]) -> float:
        return self.finish_batch([(prompt_ids, response_ids)])[0]

    def finish_batch(self, items: Sequence[tuple[list[int], list[int]]]) -> list[float]:
        """The rewards of several finished sequences ``(prompt_ids, response_ids)``; every result checked."""
        return self.check_batch(self.call_batch(items), len(items))

    def call_batch(self, items: Sequence[tuple[list[int], list[int]]]) -> list[object] | object:
        """The user's reward, unchecked: one call of a ``BatchedReward``, one call per sequence of a plain
        callable. Kept apart from ``check_batch``: a failure here is the reward's, one there the engine's."""
        if isinstance(self.rule, BatchedReward):
            return self.rule.fn([list(p) for p, _ in items], [list(r) for _, r in items])
        return [self.rule(list(p), list(r)) for p, r in items]

    def check_batch(self, results: list[object] | object, num_sequences: int) -> list[float]:
        """``call_batch``'s results as finite floats: ``TypeError``/``ValueError`` naming the reward."""
        if isinstance(self.rule, BatchedReward):
            return self.rule.check(results, num_sequences)
        return [check_reward_value(r, self.name_for_errors) for r in results]


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


# Rows of fp32 temporaries per step of scaled_logsumexp: about 256 MB at most, whatever the vocabulary.
_LSE_ELEMENTS = 1 << 26


def scaled_logsumexp(logits: torch.Tensor, inv_t: torch.Tensor) -> torch.Tensor:
    """``logsumexp(logits[r] * inv_t[r])`` in float32 for each row ``r`` of ``logits [R, V]`` (any float
    dtype), a block of rows at a time, so no ``[R, V]`` float32 tensor is made (7.5 GB at 4,096 rows of a
    152K vocabulary)."""
    rows = logits.shape[0]
    out = torch.empty(rows, dtype=torch.float32, device=logits.device)
    step = max(1, _LSE_ELEMENTS // max(1, logits.shape[1]))
    for lo in range(0, rows, step):
        block = logits[lo : lo + step].to(torch.float32, copy=True).mul_(inv_t[lo : lo + step, None])
        out[lo : lo + step] = torch.logsumexp(block, dim=-1)
    return out


def picked_logprobs(
    logits: torch.Tensor, inv_t: torch.Tensor, lse: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor
) -> torch.Tensor:
    """``log_softmax(logits[r] * inv_t[r])[t]`` for each pair of ``rows``/``tokens``: a gather minus the
    row's ``lse`` (from :func:`scaled_logsumexp`)."""
    return logits[rows, tokens].float() * inv_t[rows] - lse[rows]
