"""Scorer-side scheduling: incremental prefill of sequences into one scorer's pages, chunk by chunk."""

from __future__ import annotations

from oppo_engine.cache.swap import HostPages, swap_in_seq, swap_out_seq
from oppo_engine.model.scorer import Scorer
from oppo_engine.sched.scheduler import ScheduledChunk
from oppo_engine.sched.sequence import Sequence


class ScorerScheduler:
    """Feeds sequences to one streamed scorer under a per-forward token budget, oldest first.

    The actor lane hands a sequence's tokens over in chunks (``hand_off``: tokens ``[0, upto)`` are
    available, ``final`` once the sequence has finished); each forward prefills the next available ones
    and reserves their slots then, chunk by chunk, so a scorer never holds pages for tokens it has not
    seen. The chunk that reaches the last token of a finished sequence is marked ``samples`` (its result
    can be read). Only the lane that owns the scheduler calls it: hand-offs reach it through that lane.

    When the pool is short, the oldest sequence goes first: younger sequences holding this scorer's pages
    are preempted, so the oldest always completes if the arena holds one sequence -- partly scored
    sequences cannot deadlock. A preempted sequence's pages are swapped to host memory (``copy_pages``)
    and its scorer state kept; they come back, under new page ids, before its next chunk. The rule: always
    swap, never recompute -- copying a page both ways moves its bytes twice, where prefilling it again
    runs the whole model over its tokens (``swapped_tokens`` counts what came back).

    Groups: as on the actor, a sample's chunks stop at the group's shared prefix; a sample with nothing
    prefilled forks the prefix (pages and the scorer's state at that point: ``Scorer.fork``) from a sample
    of its group that has prefilled exactly the prefix -- or any part past it, for a scorer whose state
    holds nothing of the prefix (``Scorer.fork_any_point``) -- and waits while one is still prefilling it. A
    sample that finds none prefills the prefix itself. Prompts sharing a prefix
    (``Sequence.share_id``) share it the same way, keyed by ``Sequence.prefix_key``.

    Sequences carried over to the next step stay here, with their pages and progress, until scored.
    ``recomputed_tokens`` counts tokens prefilled again below a sequence's high-water mark (after a
    preemption, a restart, or a rolled-back step).
    """

    def __init__(self, scorer: Scorer, *, max_num_batched_tokens: int) -> None:
        if scorer.cache is None:
            raise ValueError(f"{type(scorer).__name__} is not streamed: it has no pages to schedule")
        self.scorer = scorer
        self.cache = scorer.cache
        self.max_num_batched_tokens = max_num_batched_tokens
        self.active: list[Sequence] = []  # admission order: oldest first
        self._scored: dict[int, int] = {}  # seq_id -> tokens prefilled
        self._handed: dict[int, tuple[int, bool]] = {}  # seq_id -> (tokens available, final)
        self.num_preemptions = 0
        self.recomputed_tokens = 0
        self.swapped_tokens = 0
        self._swapped: dict[int, HostPages] = {}  # seq_id -> its pages on host (preempted)
        # prefix key -> the sequences here sharing that prefix (a group's samples, a class of prompts)
        self._groups: dict[int, list[Sequence]] = {}
        self._keys: dict[int, int] = {}  # seq_id -> its prefix key when added (it never changes)

    def __contains__(self, seq: Sequence) -> bool:
        return seq.seq_id in self._scored

    def add(self, seq: Sequence) -> None:
        """Start scoring ``seq`` (its first tokens may follow later)."""
        self.scorer.begin(seq.seq_id, len(seq.prompt_ids), seq.sampling.temperature)
        self._scored[seq.seq_id] = 0
        self._handed[seq.seq_id] = (0, False)
        self.active.append(seq)
        if seq.prefix_len:
            self._keys[seq.seq_id] = key = seq.prefix_key
            self._groups.setdefault(key, []).append(seq)

    def hand_off(self, seq: Sequence, upto: int, final: bool) -> None:
        """Tokens ``[0, upto)`` of ``seq`` may be prefilled; ``final``: they are all it will ever have."""
        self._handed[seq.seq_id] = (upto, final)

    def complete_without_forward(self) -> list[Sequence]:
        """Sequences whose final hand-off brought no token left to prefill (an episode that ended with an
        empty observation, or with none): every token is in, so their results can be read now (a sequence
        swapped to host comes back first: its pages hold what the result is read from)."""
        done = []
        for i, seq in enumerate(self.active):
            upto, final = self._handed[seq.seq_id]
            if final and 0 < upto == self._scored[seq.seq_id]:
                if seq.seq_id in self._swapped and not self._swap_in(seq, after=i):
                    continue  # no pages for it yet: a later round
                done.append(seq)
        return done

    @property
    def has_work(self) -> bool:
        """Sequences are being scored."""
        return bool(self.active)

    def schedule(self) -> list[ScheduledChunk]:
        """The next forward's chunks, with their slots reserved."""
        if self._groups:
            # Before any sample moves past it: samples with nothing prefilled fork their group's prefix.
            for seq in self.active:
                if self._scored[seq.seq_id] == 0 < seq.prefix_len:
                    self._fork_prefix(seq)
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        prefixing: set[int] = set()  # sequences whose prefix this forward prefills
        i = 0
        while i < len(self.active) and budget > 0:
            seq = self.active[i]
            start = self._scored[seq.seq_id]
            upto, final = self._handed[seq.seq_id]
            if start == 0 < seq.prefix_len and self._prefix_in_progress(seq, prefixing):
                i += 1  # a sample of its group is prefilling the prefix: fork it next forward
                continue
            n = min(upto - start, budget)
            if start < seq.prefix_len:
                n = min(n, seq.prefix_len - start)  # the prefix is a chunk of its own (it can be forked)
            if n <= 0:
                i += 1
                continue
            if seq.seq_id in self._swapped and not self._swap_in(seq, after=i):
                break  # wait for pages held elsewhere
            slots = self.cache.append_slots(seq.seq_id, n)
            while slots is None and (victim := self._youngest_holding_pages(after=i)) is not None:
                self._preempt(victim)
                slots = self.cache.append_slots(seq.seq_id, n)
            if slots is None:
                break  # wait for pages held elsewhere (the actor's, another scorer's)
            if start < seq.prefix_len:
                prefixing.add(seq.seq_id)
            high = seq.prefilled_high.get(self.scorer.name, 0)
            self.recomputed_tokens += max(0, min(start + n, high) - start)
            seq.prefilled_high[self.scorer.name] = max(high, start + n)
            self._scored[seq.seq_id] = start + n
            last = final and start + n == upto
            chunks.append(ScheduledChunk(seq, start, seq.token_slice(start, start + n), slots, last))
            budget -= n
            i += 1
        return chunks

    def _fork_prefix(self, seq: Sequence) -> bool:
        """Share the prefix -- pages and scorer state -- with ``seq`` (nothing prefilled) from a sequence
        sharing it that has prefilled exactly the prefix, or at least the prefix where the scorer's state
        holds nothing of it (``Scorer.fork_any_point``), in an earlier forward (called before scheduling)."""
        need = seq.prefix_len
        past = self.scorer.fork_any_point
        for other in self._groups.get(seq.prefix_key, ()):
            have = self._scored[other.seq_id]
            if (
                other is not seq
                and (have == need or (past and have > need))
                and other.seq_id not in self._swapped
                and self.cache.num_tokens(other.seq_id) == have
                and other.prompt_ids[:need] == seq.prompt_ids[:need]
            ):
                self.cache.fork(other.seq_id, seq.seq_id, need)
                self.scorer.fork(other.seq_id, seq.seq_id)
                self._scored[seq.seq_id] = need
                name = self.scorer.name
                seq.prefilled_high[name] = max(seq.prefilled_high.get(name, 0), need)
                return True
        return False

    def _prefix_in_progress(self, seq: Sequence, prefixing: set[int]) -> bool:
        """Another sequence sharing ``seq``'s prefix is prefilling it (in this forward, or over several)."""
        scored = self._scored
        return any(
            other is not seq and (other.seq_id in prefixing or 0 < scored[other.seq_id] < other.prefix_len)
            for other in self._groups.get(seq.prefix_key, ())
        )

    def complete(self, seq: Sequence):
        """Read ``seq``'s result after its final chunk; its pages and state are released."""
        result = self.scorer.finish(seq.seq_id, seq.prompt_ids, seq.response_ids)
        self._drop(seq)
        return result

    def abort_all(self) -> list[Sequence]:
        """Release every sequence (pages and state); returns them."""
        seqs = list(self.active)
        for seq in seqs:
            self._drop(seq)
        return seqs

    def drop(self, seq: Sequence) -> None:
        """Release ``seq`` (pages, on host too, and state) if this scheduler holds it."""
        if seq in self:
            self._drop(seq)

    def swapped_pages(self, seq_ids: set[int]) -> int:
        """Pages of ``seq_ids`` swapped to host by this scheduler."""
        return sum(host.num_pages() for s, host in self._swapped.items() if s in seq_ids)

    def _preempt(self, seq: Sequence) -> None:
        """Swap ``seq``'s pages to host; its scorer state stays, and it continues where it was."""
        self.num_preemptions += 1
        host = swap_out_seq(self.cache, seq.seq_id)
        if host is not None:
            self._swapped[seq.seq_id] = host

    def _swap_in(self, seq: Sequence, after: int) -> bool:
        host = self._swapped[seq.seq_id]
        tokens = swap_in_seq(self.cache, seq.seq_id, host)
        while tokens is None and (victim := self._youngest_holding_pages(after=after)) is not None:
            self._preempt(victim)
            tokens = swap_in_seq(self.cache, seq.seq_id, host)
        if tokens is None:
            return False
        del self._swapped[seq.seq_id]
        self.swapped_tokens += tokens
        return True

    def _drop(self, seq: Sequence) -> None:
        self._swapped.pop(seq.seq_id, None)
        self.scorer.release(seq.seq_id)
        self.active.remove(seq)
        del self._scored[seq.seq_id]
        del self._handed[seq.seq_id]
        key = self._keys.pop(seq.seq_id, None)
        if key is not None:
            group = self._groups[key]
            group.remove(seq)
            if not group:
                del self._groups[key]

    def _youngest_holding_pages(self, after: int) -> Sequence | None:
        for seq in reversed(self.active[after + 1 :]):
            if seq.seq_id in self.cache:
                return seq
        return None

    def restart(self, seq: Sequence) -> None:
        """Drop ``seq``'s KV and state in this scorer; it is prefilled again from its first token (a
        trained scorer after a policy update, whose KV and results are stale)."""
        self._swapped.pop(seq.seq_id, None)
        self.scorer.release(seq.seq_id)
        self.scorer.begin(seq.seq_id, len(seq.prompt_ids), seq.sampling.temperature)
        self._scored[seq.seq_id] = 0
