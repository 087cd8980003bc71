"""Actor-side scheduling: admission, chunked prefill, decode and preemption over a page budget.

The scheduler decides which tokens of which sequences go into the next actor forward and reserves their
KV slots; it never reads tensor contents (sampled tokens come back to it as Python ints).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from oppo_engine.cache import KVCacheManager
from oppo_engine.sched.sequence import SeqStatus, Sequence


@dataclass(slots=True)
class ScheduledChunk:
    """Tokens ``[start, start + len(token_ids))`` of ``seq`` in the next forward, with their KV slots.

    ``samples`` is set when the chunk reaches the sequence's last token, so its logits draw the next token.
    """

    seq: Sequence
    start: int
    token_ids: list[int]
    slots: list[int]
    samples: bool


class ActorScheduler:
    """Continuous batching of the actor: running sequences first (oldest first), then admission.

    Short of pages, it admits fewer; then a running sequence that cannot get a page preempts the most
    recently admitted sequence that was never deferred (its pages are freed, its tokens kept; it is
    recomputed when readmitted, which reproduces the same tokens since sampling is keyed by seed and
    position), then a deferred one, and a sequence at the deferral limit (``max_deferrals``) only when
    nothing else holds pages -- so the engine cannot deadlock, and the step still waits for it. Admission
    never preempts: it waits for pages, keeping a small watermark free for the running sequences' next
    pages. A carried-over sequence keeps its KV pages while it waits to be admitted again. When nothing
    can run at all, it gives up first the kept pages of finished sequences (see ``kept_tokens``; a rollback
    then recomputes them), then those of the step's sequences this run leaves out (``leave_out``), then
    the retained pages of the last waiting sequence. So every actor page is one the scheduler can give
    up: with nothing left to give, it holds no page, and the arena's actor reserve (one ``max_model_len``
    sequence) admits any waiting sequence.

    The scheduler holds sequences only for one step: ``detach_all`` hands the unfinished ones back (their
    pages stay in the cache) and the next step adds them again, first.

    Multi-turn episodes: a sequence whose turn ends (a turn-stop token, ``max_turn_tokens``) is *parked*
    while its environment answers -- out of the batch, its pages kept -- and ``resume`` brings it back with
    the observation's tokens pending (prefilled in the next forward, beside the others' decode). Under page
    pressure a parked sequence is the first to lose its pages (it is recomputed when it resumes).

    Groups (a prompt sampled n > 1 times): a sample's first chunk stops at the group's shared prefix (all
    of the prompt but its last token), so that prefix's KV is complete after one forward; a sample that
    needs the prefix forks it from any sample of its group holding it from an earlier forward (its pages
    shared, ``KVCacheManager.fork``), and waits -- letting younger sequences pass -- while another sample
    of its group is computing it. A preempted sample forks again (or, if none holds it, prefills again).

    Prompts sharing a prefix (``Sequence.share_id``, ``EngineConfig.share_prompt_prefix``) are handled the
    same way, keyed by ``Sequence.prefix_key``: the first member admitted computes the class's
    ``prefix_len`` tokens as a chunk of its own, the others fork them. A source must have computed those
    tokens in this step (it held no KV when the step began: ``kept_tokens``), so a fork never hands out KV
    of an earlier policy (``retained_kv="reuse"``); a member with no source computes the prefix itself.
    """

    def __init__(
        self,
        cache: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: Iterable[int] = (),
        max_deferrals: int | None = None,
    ) -> None:
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.watermark_pages = max(1, cache.arena.num_pages // 100)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.parked: list[Sequence] = []  # waiting on their environment (SeqStatus.ENV)
        self.max_deferrals = max_deferrals
        # seq_id -> tokens of KV the sequence held when the step began: kept until the step ends even if
        # the sequence finishes, so a failed step can give them back (reused KV cannot be recomputed).
        self.kept_tokens: dict[int, int] = {}
        self._finished_kept: list[int] = []  # finished sequences that still hold kept pages
        self._left_out: list[Sequence] = []  # the step's sequences outside this run (``leave_out``)
        # prefix key -> the sequences of this step sharing that prefix (a group's samples, a class of prompts)
        self._groups: dict[int, list[Sequence]] = {}
        self.num_preemptions = 0
        self.recomputed_tokens = 0  # tokens prefilled again after their KV was dropped

    def add(self, seq: Sequence) -> None:
        """Queue ``seq`` for admission (after those already waiting); the KV it holds now is kept until
        ``detach_all`` even if it finishes."""
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)
        if seq.seq_id in self.cache:
            self.kept_tokens[seq.seq_id] = self.cache.num_tokens(seq.seq_id)
        if seq.prefix_len:
            self._groups.setdefault(seq.prefix_key, []).append(seq)

    def park(self, seq: Sequence) -> None:
        """Hold ``seq``, waiting on its environment since an earlier step, until ``resume``; its KV is kept as
        ``add`` keeps it."""
        self.parked.append(seq)
        if seq.seq_id in self.cache:
            self.kept_tokens[seq.seq_id] = self.cache.num_tokens(seq.seq_id)
        if seq.prefix_len:
            self._groups.setdefault(seq.prefix_key, []).append(seq)

    def resume(self, seq: Sequence) -> None:
        """``seq``'s observation is appended: back into the batch if it kept its pages, else first in line."""
        self.parked.remove(seq)
        if seq.num_computed:
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
        else:
            seq.status = SeqStatus.WAITING
            self.waiting.appendleft(seq)

    def finish_parked(self, seq: Sequence, reason: str) -> None:
        """``seq``'s episode ended while it was parked (a done observation, ``max_model_len``)."""
        self.parked.remove(seq)
        seq.finish_reason = reason
        self._finished(seq)

    def hold(self, seq: Sequence) -> None:
        """``seq`` has finished (``append_token`` or ``finish_parked`` said so: its pages are given back) but
        waits for its environment's last word (an agent's reward): parked until ``finish_parked``."""
        seq.status = SeqStatus.ENV
        self.parked.append(seq)

    def set_aside(self, seq: Sequence) -> None:
        """Take ``seq`` out of the batch, keeping its pages and tokens (a quarantine probe stopped it: the
        probe's rollback truncates its KV and brings it back). Its KV is then given up like that of the
        sequences the run leaves out (``leave_out``) when the run is starved: no lane schedules it."""
        for queue in (self.running, self.waiting, self.parked):
            if seq in queue:
                queue.remove(seq)
        if seq.seq_id in self.cache and seq not in self._left_out:
            self._left_out.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take ``seq`` out for good (its environment failed) and free its actor pages."""
        for queue in (self.running, self.waiting, self.parked):
            if seq in queue:
                queue.remove(seq)
        self.cache.free(seq.seq_id)
        self.kept_tokens.pop(seq.seq_id, None)
        if seq.seq_id in self._finished_kept:
            self._finished_kept.remove(seq.seq_id)

    def leave_out(self, seqs: Iterable[Sequence]) -> None:
        """``seqs`` belong to the step but not to this run (a quarantine probe's other groups, a group the
        quarantine took out): never scheduled, but the KV they hold is this scheduler's to give up when it
        is starved (their ``num_computed`` drops to 0; a rollback then recomputes them). Without it their
        pages would be held by no lane that can free them, and a run short of exactly those pages would
        wait for them forever."""
        self._left_out = [s for s in seqs if s.seq_id in self.cache]

    @property
    def has_work(self) -> bool:
        """Sequences are waiting or running (parked ones wait for their environment, not for the actor)."""
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        """Reserve slots for the next forward and return its chunks (empty when there is no work, or when
        pages held elsewhere -- another lane's -- must be freed first)."""
        chunks = self._schedule()
        while not chunks and self.waiting:
            # Starved: give up pages only a rollback would need, then those of the step's sequences outside
            # this run, then those of sequences waiting on their environment, then carried-over KV, last
            # first.
            if self._finished_kept:
                self.cache.free(self._finished_kept.pop())
            elif self._left_out:
                self._drop_kv(self._left_out.pop())
            elif (parked := self._last_parked_holder()) is not None:
                self._drop_parked_kv(parked)
            elif (holder := self._last_waiting_holder()) is not None:
                self._drop_kv(holder)
            else:
                break
            chunks = self._schedule()
        return chunks

    def _schedule(self) -> list[ScheduledChunk]:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        prefixing: set[int] = set()  # sequences whose prefix KV this forward writes: not forkable yet
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._chunk_len(seq, budget, prefixing)
            slots = self.cache.append_slots(seq.seq_id, n)
            while slots is None and (parked := self._last_parked_holder()) is not None:
                self._drop_parked_kv(parked)  # waiting on its environment: the first to give up its pages
                slots = self.cache.append_slots(seq.seq_id, n)
            while slots is None and (victim := self._victim(after=i)) is not None:
                self.preempt(victim)
                slots = self.cache.append_slots(seq.seq_id, n)
            if slots is None:
                self.preempt(seq)  # the youngest itself: wait for pages freed by finishing sequences
                break
            chunks.append(self._chunk(seq, n, slots))
            budget -= n
            i += 1
        if not (self.waiting and budget > 0 and len(self.running) < self.max_num_seqs):
            return chunks  # nothing to admit (every decode forward once the batch is running)
        # Pages the running sequences still need for their pending tokens (a prompt prefilled in chunks):
        # admission leaves them, so that it never takes what an older sequence needs next forward.
        committed = sum(self.cache.pages_needed(s.seq_id, s.num_pending) for s in self.running)
        j = 0
        while j < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[j]
            source = None
            if seq.num_computed < seq.prefix_len and seq.seq_id not in self.cache:
                source = self._prefix_source(seq, prefixing)
                if source is None and self._prefix_in_progress(seq, prefixing):
                    j += 1  # a sample of its group is computing the prefix: fork it next forward
                    continue
            reserve = self.watermark_pages if self.running else 0
            # NOTE: admitted only if the pool holds the pages of all its pending tokens, not just of its
            # first chunk (one that stops at its group's prefix, or at the token budget): admitting it for a
            # first chunk only to preempt it at the next would prefill that chunk again forever, while the
            # pages that could let it pass (kept ones, another sequence's retained KV) are never given up.
            # A fork is made only then: one undone at once would hold no page, and a starved scheduler
            # giving up a forked sample's KV would free nothing.
            if source is not None:
                needed = self.cache.pages_needed_forked(seq.prefix_len, seq.num_tokens)
            else:
                needed = self.cache.pages_needed(seq.seq_id, seq.num_pending)
            if needed + reserve + committed > self.cache.num_available_pages():
                break
            if source is not None:
                self._fork(source, seq)
            n = self._chunk_len(seq, budget, prefixing)
            slots = self.cache.append_slots(seq.seq_id, n)
            if slots is None:
                prefixing.discard(seq.seq_id)
                break
            del self.waiting[j]
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            chunks.append(self._chunk(seq, n, slots))
            committed += self.cache.pages_needed(seq.seq_id, seq.num_pending)
            budget -= n
        return chunks

    def _chunk_len(self, seq: Sequence, budget: int, prefixing: set[int]) -> int:
        """Tokens of ``seq`` in the next forward; a chunk that writes a group's prefix stops at its end."""
        # NOTE: num_pending and prefix_len spelled out: this runs for every running sequence every forward.
        n = min(len(seq.prompt_ids) + len(seq.response_ids) - seq.num_computed, budget)
        prefix = seq.prefix_len
        if seq.num_computed < prefix:
            prefixing.add(seq.seq_id)
            n = min(n, prefix - seq.num_computed)
        return n

    def _prefix_source(self, seq: Sequence, prefixing: set[int]) -> Sequence | None:
        """A sequence sharing ``seq``'s prefix (a sample of its group, a prompt of its class) that holds the
        prefix's KV from an earlier forward, if any. A class member's source computed it in this step."""
        need = seq.prefix_len
        group = seq.sampling.n > 1
        for other in self._groups.get(seq.prefix_key, ()):
            if (
                other is not seq
                and other.seq_id not in prefixing
                and self.cache.num_tokens(other.seq_id) >= need
                and (group or (other.seq_id not in self.kept_tokens and _same_prefix(other, seq, need)))
            ):
                return other
        return None

    def _fork(self, source: Sequence, seq: Sequence) -> None:
        """Share ``source``'s prefix KV with ``seq``, which continues after it."""
        need = seq.prefix_len
        self.cache.fork(source.seq_id, seq.seq_id, need)
        seq.num_computed = need
        seq.computed_high = max(seq.computed_high, need)

    def _prefix_in_progress(self, seq: Sequence, prefixing: set[int]) -> bool:
        """Another sequence sharing ``seq``'s prefix is computing it (in this forward, or over several)."""
        return any(
            other is not seq
            and (
                other.seq_id in prefixing
                or (other.status is SeqStatus.RUNNING and other.num_computed < other.prefix_len)
            )
            for other in self._groups.get(seq.prefix_key, ())
        )

    def _victim(self, after: int) -> Sequence | None:
        """The sequence to preempt for ``running[after]``: among those admitted after it, the most recently
        admitted never-deferred one, else a deferred one, else one at the deferral limit."""
        later = self.running[after + 1 :]
        for rank in range(3):
            for seq in reversed(later):
                if self._rank(seq) == rank:
                    return seq
        return None

    def _rank(self, seq: Sequence) -> int:
        if seq.deferred_steps == 0:
            return 0
        limit = self.max_deferrals
        return 1 if limit is None or seq.deferred_steps < limit else 2

    def _last_parked_holder(self) -> Sequence | None:
        for seq in reversed(self.parked):
            if seq.seq_id in self.cache:
                return seq
        return None

    def _drop_parked_kv(self, seq: Sequence) -> None:
        self._drop_kv(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1

    def _last_waiting_holder(self) -> Sequence | None:
        for seq in reversed(self.waiting):
            if seq.seq_id in self.cache:
                return seq
        return None

    def _drop_kv(self, seq: Sequence) -> None:
        self.cache.free(seq.seq_id)
        seq.num_computed = 0

    def _chunk(self, seq: Sequence, n: int, slots: list[int]) -> ScheduledChunk:
        start = seq.num_computed
        end = start + n
        high = seq.computed_high
        if high > start:
            self.recomputed_tokens += min(end, high) - start
        if end > high:
            seq.computed_high = end
        seq.num_computed = end
        samples = end == len(seq.prompt_ids) + len(seq.response_ids)
        return ScheduledChunk(seq, start, seq.token_slice(start, end), slots, samples)

    def preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s actor pages and put it first in line; its tokens are kept for recomputation."""
        self.cache.free(seq.seq_id)
        self.running.remove(seq)
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def append_token(self, seq: Sequence, token: int, logprob: float, policy_version: int) -> bool:
        """Record a sampled token; returns True (and frees the actor pages, but those of ``kept_tokens``)
        when the sequence is finished."""
        seq.response_ids.append(token)
        seq.logprobs.append(logprob)
        seq.policy_versions.append(policy_version)
        seq.finish_reason = reason = self._finish_reason(seq, token)
        episode = seq.episode
        if reason is None and episode is not None and self._turn_ended(seq, token):
            episode.end_turn(len(seq.response_ids))
            limit = seq.sampling.max_turns
            if limit is not None and len(episode.turns) >= limit:
                seq.finish_reason = reason = "max_turns"
            else:  # the environment answers while the others decode: parked, its pages kept
                self.running.remove(seq)
                seq.status = SeqStatus.ENV
                self.parked.append(seq)
                return False
        if reason is None:
            return False
        self.running.remove(seq)
        self._finished(seq)
        return True

    def _finished(self, seq: Sequence) -> None:
        """Free a finished sequence's actor pages but those of ``kept_tokens``."""
        self.cache.truncate(seq.seq_id, self.kept_tokens.get(seq.seq_id, 0))
        if seq.seq_id in self.cache and seq.seq_id not in self._finished_kept:  # (held: finished twice)
            self._finished_kept.append(seq.seq_id)
        seq.status = SeqStatus.FINISHED

    @staticmethod
    def _turn_ended(seq: Sequence, token: int) -> bool:
        p = seq.sampling
        if token in p.turn_stop_token_ids:
            return True
        episode = seq.episode
        limit = episode.turn_tokens if episode.turn_tokens is not None else p.max_turn_tokens
        return limit is not None and len(seq.response_ids) - episode.turn_start >= limit

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        """Why ``seq`` ends with ``token`` (None: it goes on). EOS first: when EOS is also the last allowed
        token, the response ended on its own. A turn-stop token ends the turn, not the episode, even when it
        is an EOS id too (a chat template's end of turn usually is its tokenizer's EOS)."""
        p = seq.sampling
        if not p.ignore_eos and token in self.eos_token_ids and token not in p.turn_stop_token_ids:
            return "eos"
        if p.stop_token_ids and token in p.stop_token_ids:
            return "stop"
        num_response = len(seq.response_ids)
        num_sampled = num_response if seq.episode is None else num_response - seq.episode.num_observed
        if num_sampled >= p.max_new_tokens:
            return "length"
        if len(seq.prompt_ids) + num_response >= self.max_model_len:
            return "max_model_len"
        return None

    def detach_all(self) -> list[Sequence]:
        """Hand back every unfinished sequence (running first); their pages stay in the cache,
        ``num_computed`` with them, so a later step can continue them or the caller can truncate their KV.
        The kept pages of finished sequences are the caller's to free (or to roll back to)."""
        seqs = self.running + list(self.waiting)
        self.running.clear()
        self.waiting.clear()
        self.parked.clear()
        self.kept_tokens.clear()
        self._finished_kept.clear()
        self._left_out = []
        self._groups.clear()
        return seqs


def _same_prefix(a: Sequence, b: Sequence, n: int) -> bool:
    """``a`` and ``b`` begin with the same ``n`` prompt tokens (a class guarantees it: checked where a fork
    would otherwise hand out another prompt's KV without an error)."""
    return a.prompt_ids[:n] == b.prompt_ids[:n]
