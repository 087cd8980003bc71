"""The state of one rollout as the scheduler sees it: token ids and counters, never tensors."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from oppo_engine.config import SamplingParams
from oppo_engine.sched.episode import Episode, EpisodeSnapshot

if TYPE_CHECKING:
    from oppo_engine.sched.side import SideWork


class SeqStatus(enum.Enum):
    """Where a sequence is in a step's pipeline."""

    WAITING = "waiting"  # no actor KV; tokens (prompt, and any response kept over a preemption) pending
    RUNNING = "running"  # in the actor's batch
    FINISHED = "finished"  # response complete, actor pages freed; scoring may still be in flight
    SCORED = "scored"
    ENV = "env"  # a turn ended: waiting for its environment's answer (actor pages kept)
    FAILED = "failed"  # ended by its environment (or a sample of its group): for StepResult.failed


@dataclass(frozen=True, slots=True)
class SeqSnapshot:
    """A sequence as a step found it, to roll a failed step back to (its KV is truncated to match)."""

    num_response: int
    status: SeqStatus
    num_computed: int
    finish_time: float | None
    episode: EpisodeSnapshot | None = None


@dataclass(slots=True, eq=False)
class Sequence:
    """A prompt and its growing response.

    ``num_computed`` counts the tokens whose actor KV is in the cache; the tokens after it are pending and
    go into the next forward (a prompt's prefill, possibly in chunks; then one token per decode step).
    ``num_handed_off`` counts the tokens handed to the scorers (each scorer's own progress is its
    scheduler's); ``reward``, ``ref_logprobs`` and ``values`` are the scorers' results.
    ``computed_high`` is the most tokens ever in the actor cache and ``prefilled_high`` the same per scorer:
    tokens below them that are prefilled again (preemption, a policy update, a rolled-back step) are
    counted as recomputed. ``deferred_steps`` counts the steps the sequence was carried over.

    A prompt sampled ``n > 1`` times is a group: its sequences share ``prompt_index`` (the group id) and
    differ in ``sample_index``; the KV of the first ``prefix_len`` prompt tokens is computed once per model
    and shared (each sample computes the last prompt token itself: its logits draw the sample's first token).
    Prompts sampled once may share a leading run of tokens with other prompts of their step
    (``EngineConfig.share_prompt_prefix``, ``sched/prefix.py``): ``share_id`` names the class of prompts
    whose first ``share_len`` tokens are identical, and those tokens are the sequence's ``prefix_len``,
    shared the same way. ``share_len`` is ``None`` until the step loop has looked (then 0 if nothing is
    shared); it is set once and never changes, so every scheduler sees the same class while it holds the
    sequence.
    ``prefix_key`` names the sequences that share a prefix: the group's id, or (negative) the class's.

    ``episode`` is the multi-turn state of a sequence with an environment (``None`` without one): the
    response then holds observation tokens too, each with log-prob 0.0 and policy version -1.

    ``side`` is the source of a side sequence (``sched/side.py``: decoded beside the step, never part of
    it), ``None`` for the step's own.
    """

    seq_id: int
    prompt_index: int
    prompt_ids: list[int]
    sampling: SamplingParams
    seed: int
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    policy_versions: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0
    num_handed_off: int = 0
    handed_final: bool = False  # its final hand-off was made (an episode may end with no new token)
    reward: float | None = None
    ref_logprobs: list[float] | None = None
    values: list[float] | None = None
    deferred_steps: int = 0
    num_preemptions: int = 0
    finish_time: float | None = None
    score_time: float | None = None
    computed_high: int = 0
    prefilled_high: dict[str, int] = field(default_factory=dict)
    sample_index: int = 0
    finish_reason: str | None = None  # set when the scheduler finishes it: "eos", "stop", "length", ...
    episode: Episode | None = None
    group_size: int = 0  # 0: sampling.n; else a group of one-sample sequences (agents on one task, add_group)
    side: SideWork | None = None
    share_id: int = -1  # the class of prompts sharing its first share_len tokens (n == 1; -1: none)
    share_len: int | None = None  # None: not looked at yet (sched/prefix.py)

    @property
    def group_n(self) -> int:
        """How many sequences its group holds: ``sampling.n`` samples of one prompt, or ``group_size``
        sequences of their own prompts (``PromptQueue.add_group``), which share no prefix."""
        return self.group_size or self.sampling.n

    @property
    def group_id(self) -> int:
        """The group's id: its prompt's index."""
        return self.prompt_index

    @property
    def prefix_len(self) -> int:
        """Leading tokens whose KV is shared: a group's samples share all of the prompt but its last token; a
        prompt sampled once shares ``share_len`` tokens with its class (0: none)."""
        return len(self.prompt_ids) - 1 if self.sampling.n > 1 else self.share_len or 0

    @property
    def prefix_key(self) -> int:
        """Who shares the prefix: the group's id (``n > 1``), else ``-1 - share_id`` (meaningful only while
        ``prefix_len > 0``)."""
        return self.prompt_index if self.sampling.n > 1 else -1 - self.share_id

    @property
    def num_tokens(self) -> int:
        """Prompt plus response tokens."""
        return len(self.prompt_ids) + len(self.response_ids)

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Token ids ``[start, stop)`` of prompt + response, without building the concatenation."""
        p = len(self.prompt_ids)
        if stop <= p:
            return self.prompt_ids[start:stop]
        if start >= p:
            return self.response_ids[start - p : stop - p]
        return self.prompt_ids[start:] + self.response_ids[: stop - p]

    @property
    def final_reward(self) -> float | None:
        """The episode's reward: a done observation's if it gave one, else the scorers'."""
        episode = self.episode
        if episode is not None and episode.reward is not None:
            return episode.reward
        return self.reward

    def snapshot(self) -> SeqSnapshot:
        """What ``restore`` brings the sequence back to."""
        episode = None if self.episode is None else self.episode.snapshot()
        return SeqSnapshot(len(self.response_ids), self.status, self.num_computed, self.finish_time, episode)

    def restore(self, snap: SeqSnapshot, num_cached: int) -> None:
        """Back to ``snap`` after a failed step: the tokens, log-probs and versions the step added are cut;
        ``num_cached`` is how many tokens the actor cache still holds (after truncation). The scorers start
        again from the first token, unless the sequence was already scored."""
        del self.response_ids[snap.num_response :]
        del self.logprobs[snap.num_response :]
        del self.policy_versions[snap.num_response :]
        self.status = snap.status
        self.num_computed = min(snap.num_computed, num_cached)
        self.finish_time = snap.finish_time
        self.num_handed_off = 0
        self.handed_final = False
        if snap.status not in (SeqStatus.FINISHED, SeqStatus.SCORED):
            self.finish_reason = None
        if snap.status is not SeqStatus.SCORED:
            self.reward = None
            self.ref_logprobs = self.values = None
        if self.episode is not None:
            self.episode.restore(snap.episode)

    def restart_from_prompt(self) -> None:
        """Drop the response, results and environment (the factory makes a fresh one): the sequence starts
        over from its prompt, with its seed, so a deterministic environment replays the same episode. Its
        KV is the caller's to free."""
        self.response_ids.clear()
        self.logprobs.clear()
        self.policy_versions.clear()
        self.status = SeqStatus.WAITING
        self.num_computed = self.num_handed_off = 0
        self.handed_final = False
        self.reward = self.ref_logprobs = self.values = None
        self.finish_time = self.score_time = self.finish_reason = None
        if self.episode is not None:
            self.episode.fresh()

    @property
    def num_pending(self) -> int:
        """Tokens not yet in the actor cache: the next forward feeds them."""
        return self.num_tokens - self.num_computed
