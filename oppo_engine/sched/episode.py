"""A sequence's multi-turn episode: its environment, its turns and observations, as token positions.

A response is turns (sampled tokens) and observations (the environment's, never sampled) in turn; each is
a ``(start, end)`` range of ``response_ids``. ``steps`` and ``answers`` count the environment's ``step``
calls issued and answered: a step rolled back across either has moved the environment on, so the
sequence restarts from its prompt with a fresh one (``changed_since``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class EpisodeSnapshot:
    """An episode as a step found it."""

    steps: int
    answers: int
    failed: bool
    generation: int
    turn_start: int
    num_turns: int
    truncated: int
    pending_turn: list[int] | None
    listening: bool = False
    started: bool = False


@dataclass(slots=True, eq=False)
class Episode:
    """The environment side of one sequence.

    ``factory`` makes its environment (called at the sequence's first step, on a worker, with ``reset``);
    ``engine_factory`` says it is the engine's ``env=`` rather than one given with the prompt (a
    checkpoint names it rather than saving it). ``call`` is the environment call in flight, if any;
    ``ready`` once ``reset`` has returned; ``pending_turn`` is a turn that ended before it had (sent once
    it has). ``turn_start`` is where the current turn began in ``response_ids``; ``turns`` and
    ``observations`` the ranges of the ended turns and of the observations. ``truncated`` counts the
    observations cut to ``max_observation_tokens``; ``reward`` is a done observation's; ``error`` says
    why the environment ended the sequence.
    """

    factory: Callable[[], Any]
    engine_factory: bool = False
    env: Any = None
    call: Any = None
    ready: bool = False
    pending_turn: list[int] | None = None
    turn_start: int = 0
    turns: list[tuple[int, int]] = field(default_factory=list)
    observations: list[tuple[int, int]] = field(default_factory=list)
    truncated: int = 0
    reward: float | None = None
    num_observed: int = 0  # observation tokens in the response
    steps: int = 0
    answers: int = 0
    error: str | None = None
    done_by_env: bool = False  # a done observation ended it (its environment knows)
    generation: int = 0  # environments made afresh so far (a snapshot from before one no longer applies)
    # The environment's limit on the next turn (Observation.next_turn_tokens; None: the sampling's
    # max_turn_tokens). Kept here, not in the sequence's SamplingParams: a restart replays turn 1 as sampled.
    turn_tokens: int | None = None
    # Its environment hears the turn as it is decoded (``EnvDriver.listening``): kept with the snapshot, so a
    # rollback brings back the listening of a sequence its aborted attempt ended, and only that.
    listening: bool = False

    @property
    def started(self) -> bool:
        """The environment has been made (its ``reset`` is under way or done)."""
        return self.env is not None or self.call is not None

    @property
    def stepped(self) -> bool:
        """The environment has been sent a turn: it holds state that no checkpoint can save."""
        return self.steps > 0

    def snapshot(self) -> EpisodeSnapshot:
        return EpisodeSnapshot(
            self.steps, self.answers, self.error is not None, self.generation, self.turn_start,
            len(self.turns), self.truncated, self.pending_turn, self.listening, self.started,
        )  # fmt: skip

    def changed_since(self, snap: EpisodeSnapshot) -> bool:
        """Its environment moved on (a turn sent, an answer taken, a failure) after ``snap``, or it was made
        afresh since (a rollback restarted the sequence: ``snap`` describes another episode)."""
        now = (self.steps, self.answers, self.error is not None, self.generation)
        return now != (snap.steps, snap.answers, snap.failed, snap.generation)

    def restore(self, snap: EpisodeSnapshot) -> None:
        """Back to ``snap`` when its environment did not move on (``changed_since`` is False): the turns
        ended in the step are undone (none was sent: a turn waiting for ``reset`` is the snapshot's)."""
        self.turn_start = snap.turn_start
        del self.turns[snap.num_turns :]
        self.truncated = snap.truncated
        self.pending_turn = snap.pending_turn
        # Listening as the step found it; an environment made in the step listens from its start, as made.
        self.listening = snap.listening if snap.started else hasattr(self.env, "decoded")

    def fresh(self) -> None:
        """Start over: no environment (the factory makes a new one), no turns."""
        self.env = self.call = self.pending_turn = self.reward = self.error = self.turn_tokens = None
        self.ready = self.done_by_env = self.listening = False
        self.generation += 1
        self.turn_start = self.truncated = self.steps = self.answers = self.num_observed = 0
        self.turns = []
        self.observations = []

    def end_turn(self, num_response: int) -> None:
        """Close the current turn at ``num_response`` tokens; the next starts after its observation."""
        self.turns.append((self.turn_start, num_response))
        self.turn_start = num_response

    def observed(self, start: int, end: int) -> None:
        """An observation took ``response_ids[start:end]``; the next turn starts after it."""
        self.observations.append((start, end))
        self.num_observed += end - start
        self.turn_start = end

    def action_mask(self, num_response: int) -> list[int]:
        """1 for each sampled token of the response, 0 for each observation token."""
        mask = [1] * num_response
        for start, end in self.observations:
            mask[start:end] = [0] * (end - start)
        return mask

    def all_turns(self, num_response: int) -> list[tuple[int, int]]:
        """Every turn's range, the one under way (or cut by EOS, a stop token or a length limit) last."""
        if self.turn_start < num_response:
            return [*self.turns, (self.turn_start, num_response)]
        return list(self.turns)
