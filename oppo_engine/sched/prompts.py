"""Prompt intake: the queue of prompts not yet in flight, their validation, and each sequence's seed."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict

from oppo_engine.config import SamplingParams
from oppo_engine.sched.sequence import Sequence as Seq
from oppo_engine.sched.state import load_sequence, save_sequence


def derive_seed(base_seed: int, prompt_index: int) -> int:
    """A sequence's RNG seed from the engine seed and its prompt's index (splitmix64, 63 bits)."""
    z = (base_seed * 0x9E3779B97F4A7C15 + prompt_index + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF


# Mixed into a prompt's seed for its samples 1..n-1, so that they do not replay the seeds of other prompts.
_SAMPLE_SALT = 0x5DEECE66D
# Mixed into the engine seed for a data-parallel rank's own base seed.
_RANK_SALT = 0x2545F4914F6CDD1D


def rank_seed(base_seed: int, rank: int) -> int:
    """A data-parallel rank's base seed: ranks that share the engine seed never draw the same noise."""
    return derive_seed(base_seed ^ _RANK_SALT, rank)


def sample_seed(prompt_seed: int, sample_index: int) -> int:
    """Sample ``sample_index``'s seed in a group: the prompt's own seed for sample 0, else derived from it."""
    if sample_index == 0:
        return prompt_seed
    return derive_seed(prompt_seed ^ _SAMPLE_SALT, sample_index)


class PromptQueue:
    """Prompts waiting for a step, in order: sequences a failed step gave back first, then the queued
    prompts, then a lazy source. Every prompt is checked against ``max_model_len`` and the vocabulary
    before it is queued; a sequence's seed derives from ``sampling.seed`` and its prompt's index (and
    ``rank``, a data-parallel rank's index, unless ``None``) unless its own ``SamplingParams`` give one, so
    rollouts do not depend on batch composition.

    A prompt becomes ``sampling.n`` sequences (a group), taken together: ``take`` hands out whole groups.
    """

    def __init__(
        self, sampling: SamplingParams, *, max_model_len: int, vocab_size: int, rank: int | None = None
    ) -> None:
        self.sampling = sampling
        self.rank = rank
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.requeued: deque[Seq] = deque()  # new sequences of a failed step, rolled back, taken first
        self._pending: deque[tuple[list[int], SamplingParams | None]] = deque()
        self._source: Iterator[Sequence[int]] | None = None
        self._next_prompt_index = 0
        self._next_seq_id = 0
        self.check_sampling(sampling, "sampling")

    def check_sampling(self, params: SamplingParams, where: str) -> None:
        """ValueError if ``params`` names a stop token outside the vocabulary (it could never be sampled)."""
        bad = next((t for t in params.stop_token_ids if t >= self.vocab_size), None)
        if bad is not None:
            raise ValueError(
                f"{where}.stop_token_ids holds {bad}, outside the vocabulary [0, {self.vocab_size})"
            )

    def validate(self, where: str, ids: Sequence[int]) -> list[int]:
        """``ids`` as a list of ints, or ValueError naming ``where`` and the limit it breaks."""
        ids = [int(t) for t in ids]
        if not ids:
            raise ValueError(f"{where} is empty: a prompt needs at least one token")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"{where} has {len(ids)} tokens; max_model_len={self.max_model_len} leaves room for prompts "
                f"of at most {self.max_model_len - 1} tokens"
            )
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"{where} holds token id {bad}, outside the vocabulary [0, {self.vocab_size})")
        return ids

    def add(
        self,
        prompts: Iterable[Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams] | None,
    ) -> None:
        """Queue ``prompts``; all are validated before any is queued, so a bad call queues nothing.
        ``sampling`` is one ``SamplingParams`` for all of them, or one per prompt."""
        prompts = list(prompts)
        if isinstance(sampling, SamplingParams):
            sampling = [sampling] * len(prompts)
        if sampling is not None:
            if not isinstance(sampling, Iterable):
                raise TypeError(
                    f"sampling must be a SamplingParams or a list of them, got {type(sampling).__name__}"
                )
            sampling = list(sampling)
            # NOTE: the type before the length: a str is iterable, and no list of SamplingParams.
            if not all(isinstance(s, SamplingParams) for s in sampling):
                raise TypeError("sampling must be a SamplingParams or a list of them")
            if len(sampling) != len(prompts):
                raise ValueError(f"sampling has {len(sampling)} entries for {len(prompts)} prompts")
            for i, s in enumerate(sampling):
                self.check_sampling(s, f"sampling[{i}]")
            other = next((i for i, s in enumerate(sampling) if s.n != self.sampling.n), None)
            if other is not None:
                raise ValueError(
                    f"sampling[{other}].n={sampling[other].n}, but this engine samples every prompt "
                    f"n={self.sampling.n} times: all prompts of one engine use the same n"
                )
        checked = [self.validate(f"prompt_token_ids[{i}]", p) for i, p in enumerate(prompts)]
        per_prompt = sampling if sampling is not None else [None] * len(checked)
        self._pending.extend(zip(checked, per_prompt, strict=True))

    def set_source(self, source: Iterable[Sequence[int]]) -> None:
        """Pull prompts lazily from ``source`` once the queued ones run out."""
        self._source = iter(source)

    def take(self, n: int) -> list[Seq]:
        """Up to ``n`` sequences in whole groups (``n`` is rounded up to a multiple of the group size), fewer
        once every supply is exhausted. A bad prompt from the source raises; the good ones taken before it
        stay first in line."""
        seqs: list[Seq] = []
        group = self.sampling.n
        while len(seqs) < n:
            if self.requeued:
                seqs.extend(self.requeued.popleft() for _ in range(group))  # given back in whole groups
                continue
            if self._pending:
                ids, params = self._pending.popleft()
            elif self._source is not None:
                try:
                    raw = next(self._source)
                except StopIteration:
                    self._source = None
                    break
                except BaseException:  # the source's own failure: what was taken stays first in line
                    self.requeued.extendleft(reversed(seqs))
                    raise
                try:
                    ids, params = self.validate("a prompt from the prompt source", raw), None
                except ValueError:
                    self.requeued.extendleft(reversed(seqs))
                    raise
            else:
                break
            seqs.extend(self._new_group(ids, params))
        return seqs

    def _new_group(self, ids: list[int], params: SamplingParams | None) -> list[Seq]:
        index = self._next_prompt_index
        self._next_prompt_index += 1
        if params is not None and params.seed is not None:
            seed = params.seed
        else:
            base = self.sampling.seed or 0
            if self.rank is not None:  # (seed, rank, local index): group_id stays the local index
                base = rank_seed(base, self.rank)
            seed = derive_seed(base, index)
        params = params or self.sampling
        group = []
        for j in range(params.n):
            group.append(Seq(self._next_seq_id, index, ids, params, sample_seed(seed, j), sample_index=j))
            self._next_seq_id += 1
        return group

    def state_dict(self) -> dict:
        """Queued prompts, given-back sequences and the counters (a prompt source is not saved)."""
        return {
            "next_prompt_index": self._next_prompt_index,
            "next_seq_id": self._next_seq_id,
            "requeued": [save_sequence(s) for s in self.requeued],
            "pending": [(list(ids), None if p is None else asdict(p)) for ids, p in self._pending],
        }

    def load_state_dict(self, state: dict) -> None:
        """Replace the queue with ``state``'s."""
        self._next_prompt_index = state["next_prompt_index"]
        self._next_seq_id = state["next_seq_id"]
        self.requeued = deque(load_sequence(d) for d in state["requeued"])
        self._pending = deque(
            (list(ids), None if p is None else SamplingParams(**p)) for ids, p in state["pending"]
        )
