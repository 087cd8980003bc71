"""Side work: sequences the actor decodes while a step runs, beside the step's own, that are never part of
it. A source of side work (``SideWork``) is registered with the step loop (``StepLoop.add_side_work``) and
leaves it once removed (``remove_side_work``) and empty; the loop knows nothing else about it. The served
endpoint's plain ``/v1`` requests are one (``serve/evals.py``).

A side sequence never becomes a ``Rollout``, never takes a place of the batch (B) or of the step's admission
(B + Δ), is never handed to the scorers, and its pages are freed when it finishes. It is marked by
``Sequence.side`` (its source) and has a negative ``seq_id`` (``side_sequence``: the step's sequences count
up from 0, so the two never share a cache entry). One that has not finished when its step ends keeps its
tokens and gives its pages back; the next step prefills it again and goes on (a policy update in between:
its later tokens come from the new weights, as a carried sequence's under ``retained_kv="reuse"``). A step
that is rolled back, or an engine that closes, fails the side work in flight.

Every method is called on the actor thread (the step loop's); how work reaches a source from other threads
is the source's business.
"""

from __future__ import annotations

import itertools
from typing import Protocol

from oppo_engine.config import SamplingParams
from oppo_engine.sched.sequence import Sequence

_SIDE_IDS = itertools.count(1)  # process-wide: two sources (or engines) never hand out one id twice


class SideWork(Protocol):
    """A source of side sequences, polled by the step loop between its forwards."""

    @property
    def in_flight(self) -> bool:
        """Work queued or decoding: a step with no batch of its own decodes it to the end."""

    def take(self) -> tuple[list[Sequence], list[Sequence]]:
        """``(new, dropped)``: sequences to decode from now on (made by ``side_sequence``), and sequences
        given before that are no longer wanted (the loop takes them out and frees their pages)."""

    def carried(self) -> list[Sequence]:
        """The source's sequences that the last step did not finish (their KV was given back)."""

    def decoded(self) -> None:
        """A forward appended a token to some of the source's unfinished sequences (called after every
        forward of a step that decodes side work; cheap when the source has nothing to do)."""

    def finished(self, seq: Sequence) -> None:
        """``seq`` has its last token (``finish_reason`` set); the loop has taken it out, its pages freed."""

    def fail(self, message: str, *, queued: bool) -> list[Sequence]:
        """Every sequence decoding (``queued``: and every request queued) fails with ``message`` (a step
        rolled back, a close); returns the sequences that were decoding, whose pages the loop frees."""


def side_sequence(source: SideWork, prompt_ids: list[int], sampling: SamplingParams, seed: int) -> Sequence:
    """A new side sequence of ``source``: a negative id of its own, marked with its source."""
    seq_id = -next(_SIDE_IDS)
    seq = Sequence(seq_id, seq_id, list(prompt_ids), sampling, seed)
    seq.side = source
    return seq
