"""Reward-side scheduling: incremental prefill of sequences into the reward model's pages, in chunks."""

from __future__ import annotations

from collections import deque

from oppo_engine.cache import KVCacheManager
from oppo_engine.sched.scheduler import ScheduledChunk
from oppo_engine.sched.sequence import Sequence


class RewardScheduler:
    """Feeds finished sequences to the reward model under a per-forward token budget.

    A sequence is admitted only when the pages for all of its tokens can be reserved at once, so an admitted
    sequence always completes and several partly scored sequences can never deadlock on pages. The chunk
    that reaches a sequence's last token carries its reward.
    """

    def __init__(self, cache: KVCacheManager, *, max_num_batched_tokens: int) -> None:
        self.cache = cache
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.active: list[Sequence] = []
        self._slots: dict[int, list[int]] = {}

    def add(self, seq: Sequence) -> None:
        """Queue a finished sequence for scoring."""
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        """Sequences are waiting or partly scored."""
        return bool(self.waiting or self.active)

    def schedule(self) -> list[ScheduledChunk]:
        """Admit what fits, then the next forward's chunks; ``samples`` marks a sequence's final chunk."""
        while self.waiting:
            seq = self.waiting[0]
            slots = self.cache.append_slots(seq.seq_id, seq.num_tokens - seq.num_scored)
            if slots is None:
                break
            self._slots[seq.seq_id] = slots
            self.active.append(self.waiting.popleft())
        budget = self.max_num_batched_tokens
        chunks = []
        for seq in self.active:
            if budget == 0:
                break
            n = min(seq.num_tokens - seq.num_scored, budget)
            slots = self._slots[seq.seq_id]
            start = seq.num_scored
            seq.num_scored += n
            chunks.append(
                ScheduledChunk(
                    seq, start, seq.token_slice(start, start + n), slots[:n], seq.num_scored == seq.num_tokens
                )
            )
            self._slots[seq.seq_id] = slots[n:]
            budget -= n
        return chunks

    def complete(self, seq: Sequence) -> None:
        """The sequence's reward is read: free its reward pages."""
        self.cache.free(seq.seq_id)
        self.active.remove(seq)
        self._slots.pop(seq.seq_id, None)

    def abort_all(self) -> list[Sequence]:
        """Free every reward page and return all sequences, reset to unscored."""
        seqs = self.active + list(self.waiting)
        for seq in seqs:
            self.cache.free(seq.seq_id)
            seq.num_scored = 0
        self.active.clear()
        self.waiting.clear()
        self._slots.clear()
        return seqs
