"""The overcommit buffer of the inter-step overlap: B + Δ sequences in flight, the first B to finish (and be
scored) are the step's batch, the rest are carried -- tokens, log-probs and KV pages -- into the next step.

Staleness bound. A sequence carried ``max_deferrals`` (k) times is *due*: it must be in the next batch, so
the step waits for it, and the actor preempts it only when nothing else holds pages (so the engine cannot
deadlock; its tokens are kept either way). Due sequences take batch places oldest first, at most B per
step. Every step carries at most Δ sequences, so with Δ ≤ B all due sequences fit and no sequence is
returned with more than k deferrals: the bound is exact. With Δ > B, up to Δ may be due at once; a due
sequence has fewer than Δ_max carried sequences ahead of it in FIFO order and B of them leave per step, so
it is returned with at most ``k + ceil(Δ_max / B) - 1`` deferrals (``deferral_bound``).

Policy lag. With ``max_policy_lag`` (L) set, a carried sequence whose oldest token was sampled L or more
policy versions ago is due as well (``lag_due``): deferred once more, it could be returned after another
policy update with a lag above L. So no returned token lags more than L versions behind the policy that
returns it (with one update per step, a sequence waits at most L steps). Δ ≤ B is then required, so
that every due sequence fits in one batch.

Groups (a prompt sampled n times) are cut whole: a group joins the batch once all its samples have
finished, and is carried as a unit; B and Δ are then multiples of n, and the bound holds group by group.
"""

from __future__ import annotations

from collections.abc import Callable

from oppo_engine.cache import KVCacheManager
from oppo_engine.cache.swap import HostPages
from oppo_engine.control import DeltaController
from oppo_engine.model.roles import ACTOR, CRITIC
from oppo_engine.sched.sequence import SeqStatus, Sequence


def lag_due(policy_version: int, max_policy_lag: int | None) -> Callable[[Sequence], bool] | None:
    """The test "due by its policy lag" for a step run at ``policy_version`` (None without a bound)."""
    if max_policy_lag is None:
        return None

    def due(seq: Sequence) -> bool:
        return bool(seq.policy_versions) and policy_version - seq.policy_versions[0] >= max_policy_lag

    return due


def batch_cut(config, policy_version: int, delta: int | None) -> Callable[[list[Sequence]], BatchCut]:
    """How a step run at ``policy_version`` chooses its batch from its sequences: with overcommit (``delta``
    not ``None``) the first B finished, due sequences first (``BatchCut``); without, every sequence. Either
    admits sequences in the middle of the step up to B + Δ in all (``BatchCut.capacity``)."""
    if delta is None:
        return lambda live: BatchCut(live, None, None, capacity=config.batch_size)
    due = lag_due(policy_version, config.max_policy_lag)
    capacity = config.batch_size + delta
    return lambda live: BatchCut(
        live, config.batch_size, config.max_deferrals, lag_due=due, capacity=capacity
    )


def deferral_bound(batch_size: int, max_deferrals: int, max_overcommit: int) -> int:
    """The most deferrals a returned rollout can have (see the module docstring)."""
    return max_deferrals + max(0, -(-max_overcommit // batch_size) - 1)


class BatchCut:
    """Chooses a step's batch as its groups finish: every due group (at the deferral limit, or by
    ``lag_due``; oldest first, at most ``batch_size`` sequences), then the first others to finish,
    ``min(batch_size, len(seqs))`` sequences in all. A group is a prompt's ``n`` samples (one sequence when
    ``n = 1``); ``seqs`` holds whole groups, and ``batch_size`` is a multiple of ``n``.

    ``finished(seq)`` is called in finish order (carried sequences that had already finished first);
    ``batch`` lists the chosen groups in the order they completed, each in sample order. ``determined``
    once the batch is complete; ``scored`` once, in addition, every member is scored. ``batch_size=None``
    takes every sequence (no overcommit).

    A group of ``PromptQueue.add_group`` (agents on one task) is cut the same way, ``group_n`` sequences.

    ``capacity`` (``None``: none) is how many sequences the step may hold, failed ones not counted: the step
    loop admits new sequences (``admit``) while it holds fewer and the batch is not determined -- first
    requests of served episodes that came after the step started, and refills of groups that failed.
    """

    def __init__(
        self,
        seqs: list[Sequence],
        batch_size: int | None,
        max_deferrals: int | None,
        lag_due: Callable[[Sequence], bool] | None = None,
        capacity: int | None = None,
    ) -> None:
        self.size = len(seqs) if batch_size is None else min(batch_size, len(seqs))
        self.batch_size, self.capacity = batch_size, capacity
        self._seqs = list(seqs)
        self.due: set[int] = set()  # group ids
        lagging = {s.group_id for s in seqs if lag_due(s)} if lag_due is not None else set()
        taken = 0
        for seq in seqs:
            if seq.group_id in self.due:
                continue
            deferred_out = max_deferrals is not None and seq.deferred_steps >= max_deferrals
            if not (deferred_out or seq.group_id in lagging):
                continue
            if taken + seq.group_n > self.size:
                break
            self.due.add(seq.group_id)
            taken += seq.group_n
        self._open = self.size - taken  # places for sequences of groups that are not due
        self._done: dict[int, list[Sequence]] = {}  # group id -> its finished samples
        self.batch: list[Sequence] = []

    def finished(self, seq: Sequence) -> None:
        """``seq`` has its last token: once its whole group has, the group joins the batch if it is due or
        places are left."""
        done = self._done.setdefault(seq.group_id, [])
        done.append(seq)
        if len(done) < seq.group_n:
            return
        group = sorted(self._done.pop(seq.group_id), key=lambda s: s.sample_index)
        if seq.group_id in self.due:
            self.batch.extend(group)
        elif self._open >= len(group):
            self._open -= len(group)
            self.batch.extend(group)

    def admit(self, seqs: list[Sequence]) -> None:
        """``seqs`` (whole groups, none due) joined the step: the batch grows by them, to ``batch_size``."""
        self._seqs.extend(seqs)
        grow = len(seqs) if self.batch_size is None else min(len(seqs), self.batch_size - self.size)
        self.size += grow
        self._open += grow

    def drop_group(self, group_id: int) -> None:
        """The group left the step (its environment failed): its samples never join the batch, and a due
        group's places go back to the others."""
        self._done.pop(group_id, None)
        if group_id in self.due:
            self.due.discard(group_id)
            self._open += next(s.group_n for s in self._members(group_id))

    def _members(self, group_id: int):
        return (s for s in self._seqs if s.group_id == group_id)

    @property
    def determined(self) -> bool:
        """Every member of the batch has finished."""
        return len(self.batch) == self.size

    def scored(self) -> bool:
        """The batch is determined and every member is scored."""
        return self.determined and all(s.status is SeqStatus.SCORED for s in self.batch)


class OvercommitBuffer:
    """The sequences carried between steps, oldest first (FIFO).

    ``fill`` makes a step's sequences: the carried ones first, then new prompts up to ``B + Δ``;
    ``carry`` keeps what the step did not return, counting one more deferral for each.
    """

    def __init__(self) -> None:
        self.carried: list[Sequence] = []

    def fill(self, take: Callable[[int], list[Sequence]], in_flight: int) -> list[Sequence]:
        """Fill the buffer to ``in_flight`` (B + Δ) sequences: deferred ones first, then ``take(n)`` new."""
        seqs = list(self.carried)
        self.carried = []
        if len(seqs) < in_flight:
            try:
                seqs += take(in_flight - len(seqs))
            except BaseException:
                self.carried = seqs
                raise
        return seqs

    def carry(self, seqs: list[Sequence], batch: list[Sequence]) -> None:
        """Keep ``seqs`` not in ``batch`` (in their order) for the next step; each was deferred once more."""
        returned = {s.seq_id for s in batch}
        self.carried = [s for s in seqs if s.seq_id not in returned]
        for seq in self.carried:
            seq.deferred_steps += 1

    def put_back(self, seqs: list[Sequence]) -> None:
        """A failed step's carried sequences go back first, in their order (new ones are requeued apart)."""
        self.carried = list(seqs) + self.carried

    def __len__(self) -> int:
        return len(self.carried)


def delta_controller(config, group: int) -> tuple[DeltaController | None, int]:
    """The Δ controller of an ``EngineConfig`` whose samples come in groups of ``group`` (``None`` outside
    ``inter`` and ``oppo``), and Δ_max in whole groups (0 without overcommit): a fixed ``overcommit``, or
    the online control of ``config.delta`` (whose ``None`` defaults resolve to B/8 and B/4)."""
    if config.batch_size % group:
        raise ValueError(
            f"batch_size={config.batch_size} is not a multiple of SamplingParams.n={group}: a step returns "
            "whole groups (batch_size counts rollouts)"
        )
    if config.mode not in ("inter", "oppo"):
        return None, 0
    fixed = config.overcommit if isinstance(config.overcommit, int) else None
    if fixed is not None and fixed % group:
        raise ValueError(
            f"overcommit={fixed} is not a multiple of SamplingParams.n={group}: groups are carried whole"
        )
    delta = config.delta.resolve(config.batch_size, group)
    max_overcommit = -(-(fixed if fixed is not None else delta.max) // group) * group
    return DeltaController(delta, fixed=fixed), max_overcommit


# Trained scorers: their KV and results of a carried-over sequence are recomputed after a policy update.
TRAINED_SCORERS = [CRITIC]


def drop_kv(seq: Sequence, name: str, caches: dict[str, KVCacheManager], host: HostPages | None) -> None:
    """Drop ``seq``'s KV in model ``name``: in the arena, or on host while the arena is released."""
    if host is not None:
        host.drop(name, seq.seq_id)
    else:
        caches[name].free(seq.seq_id)
    if name == ACTOR:
        seq.num_computed = 0


def refresh_carried(
    carried: list[Sequence], retained_kv: str, *, caches: dict[str, KVCacheManager], host: HostPages | None,
    lane,
) -> None:  # fmt: skip
    """After a policy update (DESIGN.md, "Retained sequences"): an unfinished carried sequence's actor KV
    is dropped under ``retained_kv="recompute"`` (its tokens kept, its KV prefilled again with the new
    weights) and kept under ``"reuse"``; the trained scorers' KV and results are dropped, and ``lane``
    scores them again; the frozen scorers' are kept."""
    for seq in carried:
        finished = seq.status in (SeqStatus.FINISHED, SeqStatus.SCORED)
        if retained_kv == "recompute" and not finished:
            drop_kv(seq, ACTOR, caches, host)
        for name in TRAINED_SCORERS:
            if name in caches:
                drop_kv(seq, name, caches, host)
        lane.rescore(seq, TRAINED_SCORERS)
