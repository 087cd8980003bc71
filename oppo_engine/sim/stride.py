"""Decode in strides: the twin's actor runs several decode forwards per call of the engine when nothing
the engine would react to falls between them.

The engine's step loop pays its Python (scheduling, appending each sampled token, the hand-off check) for
every sequence at every decode forward; a long-reasoning plan runs millions of such row-iterations.
Between two events -- a sequence reaching its drawn length, a hand-off to the scorers, another lane of the
rank running, a sequence that could be admitted -- each iteration of a pure decode does the same thing:
every running sequence gets one slot (a new page at a page boundary) and one non-EOS token, and the
forward's price follows from each sequence's context, one longer each time. So :class:`DecodeStride`
runs those forwards itself, right after the one the engine asked for: each one priced by the same cost
model over the same batch the engine would have scheduled, and run on the lane's device as its own piece
of work (so the contention rule sees the same works at the same times); a page boundary takes its page
from the engine's own cache at the forward where the engine would take it. The tokens of the forwards it
ran are then appended to each sequence, its slots reserved and its counters moved as the scheduler would
have; the engine appends the last forward's tokens itself.

Exact with respect to the per-step model: ``tests/sim/test_stride.py`` runs small plans strided and not
and asserts equal step records, timelines and switch profiles. What ends a stride before the next forward:

- a sequence's next token would be its last (EOS), its ``max_new_tokens`` or ``max_model_len``;
- streamed, a sequence would reach its next hand-off (``chunk_size`` tokens since the last);
- what another lane of the rank (its scorer lane) changes and the engine's loop reads before its next
  forward: the batch scored, the lane failed, pages freed so that a waiting sequence could be admitted;
- the pages the next forward needs are not free (the engine would preempt), or a page it writes is shared
  with another sequence (copy-on-write);
- a waiting sequence could be admitted (the engine tries every forward), a sequence is parked on its
  environment, or the step has room for sequences from the prompt queue.

The sequences' tokens and counters are applied when the stride ends; what another lane of the rank reads
in the meantime -- the arena's page counts, the tokens handed off before the stride -- is already
current (the scorers read only the tokens handed to them and their own caches).
"""

from __future__ import annotations

from collections.abc import Callable

from oppo_engine.sched.sequence import SeqStatus
from oppo_engine.sim.cost import Batch

TOKEN_LOGPROB = -1.0  # the stand-in's log-prob of every token (sim/models.py: TwinActor)


class DecodeStride:
    """The stride of one rank's actor (module docstring). ``loop`` is the engine's ``StepLoop``;
    ``price(batch, captured, threads)`` a decode forward's :class:`~oppo_engine.sim.cost.Work`, ``run(work)``
    runs it on the lane's device; ``token`` is what the stand-in emits before a sequence's last token."""

    def __init__(self, loop, price: Callable, run: Callable, clock: Callable[[], float], token: int) -> None:
        self.loop, self.price, self.run, self.clock = loop, price, run, clock
        self.token = token
        self.step: tuple | None = None  # (policy_version, cut, chunk_size, commit) of the step under way
        self.extra_tokens = 0  # tokens the strides sampled in this step (the engine counts the rest)
        self.peak_pages = 0  # the largest page count a strided forward saw in this step
        self.boundaries: list[float] = []  # start times of the forwards of the last stride, after the first
        self.forwards = 0  # forwards run in strides (beyond the engine's own), over the world's life

    def wrap(self) -> None:
        """Hook the loop's ``run`` (to learn the step's cut, chunk size and version and to add the strides'
        tokens and peak pages to its outcome) and the timeline's ``record`` (a strided forward is recorded
        as the forwards it ran, as the engine would have recorded them one by one)."""
        loop = self.loop
        run, record = loop.run, loop.timeline.record

        def strided_run(seqs, policy_version, cut, chunk_size=None, commit=True, left_out=()):
            self.step, self.extra_tokens, self.peak_pages = (policy_version, cut, chunk_size, commit), 0, 0
            try:
                out = run(seqs, policy_version, cut, chunk_size=chunk_size, commit=commit, left_out=left_out)
            finally:
                self.step = None
            out.tokens_generated += self.extra_tokens
            out.peak_pages = max(out.peak_pages, self.peak_pages)
            return out

        def split_record(lane, name, start_s, end_s, **args):
            if self.boundaries and name == "forward" and lane == "actor":
                starts, self.boundaries = [start_s, *self.boundaries], []
                for a, b in zip(starts, [*starts[1:], end_s], strict=True):
                    record(lane, name, a, b, **args)
                return
            record(lane, name, start_s, end_s, **args)

        loop.run, loop.timeline.record = strided_run, split_record

    # -- one stride ---------------------------------------------------------------------------------------

    def _allowed(self, seqs: list, counts: list[int]) -> bool:
        """Whether the engine's loop, back from this forward, would do nothing but schedule the same
        sequences for another decode forward (the conditions of the module docstring that hold for a whole
        stride; those another lane can change are checked before every forward, ``_loop_stops``)."""
        loop, sched = self.loop, self.loop.actor_sched
        if self.step is None or sched.parked or loop.envs.waiting() or len(seqs) != len(sched.running):
            return False
        if self.token in sched.eos_token_ids or any(
            s.episode is not None or self.token in s.sampling.stop_token_ids for s in seqs
        ):
            return False
        if len(seqs) > sched.max_num_batched_tokens:
            return False
        _, cut, _, commit = self.step
        if commit and loop.admission is not None and not cut.determined:
            room = cut.capacity - sum(s.status is not SeqStatus.FAILED for s in loop._seqs)
            if room > 0:
                return False
        cache = sched.cache
        if self._admissible():
            return False
        shared = cache._shared_upto
        if shared:
            ps = cache.page_size
            if any(shared.get(s.seq_id, 0) > n // ps for s, n in zip(seqs, counts, strict=True)):
                return False
        return True

    def _admissible(self) -> bool:
        """Whether the scheduler could admit a waiting sequence before the stride ends. Only the scorers free
        pages during a stride (checked before every forward), and the actor's take them: a waiting sequence
        whose need, with nothing committed and forked or not, exceeds the free pages now cannot be admitted
        before the next check."""
        sched = self.loop.actor_sched
        if not sched.waiting or len(sched.running) >= sched.max_num_seqs:
            return False
        cache = sched.cache
        free = cache.num_available_pages() - sched.watermark_pages
        for w in sched.waiting:
            need = cache.pages_needed(w.seq_id, w.num_pending)
            if w.num_computed < w.prefix_len and w.seq_id not in cache:
                need = min(need, cache.pages_needed_forked(w.prefix_len, w.num_tokens))
            if need <= free:
                return True
        return False

    def _loop_stops(self) -> bool:
        """Whether the engine's loop, at the top of its next iteration, would do anything but schedule the
        same decode: the batch determined (streamed: scored), the scorer lane failed, a sequence
        admissible."""
        _, cut, chunk_size, _ = self.step
        if self.loop.scorer_lane.error is not None:
            return True
        if cut.scored() if chunk_size is not None else cut.determined:
            return True
        return self._admissible()

    def extend(self, seqs: list, counts: list[int], positions: list[int], targets: list[int],
               captured: bool, threads: int) -> int:  # fmt: skip
        """After the engine's forward over ``seqs`` (decode rows whose caches hold ``counts`` tokens; their
        sampled ``positions``; their drawn lengths ``targets``): run more decode forwards while nothing
        falls between (module docstring), apply their tokens, and return how many ran."""
        if not seqs or not self._allowed(seqs, counts):
            return 0
        _, _, chunk_size, _ = self.step
        sched = self.loop.actor_sched
        # The forward j (1, 2, ...) after the engine's appends token j - 1 of the stride (before it,
        # the first token this call returns is kept, not returned): at most the tokens before each
        # sequence's last (or its hand-off).
        most = None
        for seq, pos, target in zip(seqs, positions, targets, strict=True):
            p = len(seq.prompt_ids)
            after = pos - p + 1  # its response's length with the engine's forward's token
            limit = min(target, seq.sampling.max_new_tokens, sched.max_model_len - p) - after
            if chunk_size is not None:
                limit = min(limit, chunk_size - 1 - (pos - seq.num_handed_off))
            most = limit if most is None else min(most, limit)
        if most is None or most <= 0:
            return 0
        cache, ps = sched.cache, sched.cache.page_size
        reserved = list(counts)
        done = 0
        boundaries = []
        while done < most:
            if self._loop_stops():
                break
            j = done + 1
            crossing = [i for i, n in enumerate(counts) if (n + j - 1) % ps == 0]
            if len(crossing) > cache.num_available_pages():
                break
            for i in crossing:
                slots = cache.append_slots(seqs[i].seq_id, counts[i] + j - reserved[i])
                assert slots is not None, "a page the stride counted as free was not"
                reserved[i] = counts[i] + j
            self.peak_pages = max(self.peak_pages, self.loop.pages_in_use())
            rows = len(seqs)
            work = self.price(Batch(tuple((1, n + j) for n in counts), rows, rows), captured, threads)
            boundaries.append(self.clock())
            self.run(work)
            done = j
        if not done:
            return 0
        version = self.step[0]
        token = self.token
        for seq, n, r in zip(seqs, counts, reserved, strict=True):
            if n + done > r:
                cache.append_slots(seq.seq_id, n + done - r)  # no page: the boundaries took theirs
            start = seq.num_computed
            if seq.computed_high > start:
                sched.recomputed_tokens += min(start + done, seq.computed_high) - start
            seq.num_computed = start + done
            seq.computed_high = max(seq.computed_high, start + done)
            seq.response_ids.extend([token] * done)
            seq.logprobs.extend([TOKEN_LOGPROB] * done)
            seq.policy_versions.extend([version] * done)
        self.extra_tokens += done * len(seqs)
        self.boundaries = boundaries
        self.forwards += done
        return done
