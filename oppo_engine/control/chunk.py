"""Chunk-size control for the intra-step overlap (streamed scoring).

The actor decodes ``C`` tokens per running sequence, then hands the new tokens to the scorers, which
prefill them on a lower-priority lane while the actor decodes the next chunk. ``C`` trades two costs
(OPPO, intra-step overlap): a small chunk means many hand-offs and a scorer prefill beside almost every decode
iteration (context switches and contention); a large chunk overlaps little, so more prefill is left
exposed after the last token. The paper observes that this trade-off is monotone and predictable, and that
PPO runs for hundreds of steps, so it tries a few candidates every so often and keeps the fastest; here a
cost model built from a measured :class:`SwitchProfile` chooses which candidates are worth a step.

Streaming is itself a choice: the arm :data:`OFF` runs no scorer work while the actor decodes (the step is
then exactly the non-streamed one: ``intra`` is ``sequential``, ``oppo`` is ``inter``). Where the actor's
slowdown beside a prefill costs more than the scoring streaming hides (a CPU, where the two lanes share
the cores), "off" wins and is kept; streaming has to beat it by more than the noise band.

Pure Python: no torch, no numpy. The scheduler measures; this module decides.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

OFF = "off"  # the arm that does not stream: the scorers run after the actor's last token
Arm = int | str  # a chunk size, or OFF
PRIORS = ("model", "list")  # where the first exploration starts (ChunkControl.prior)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True, slots=True)
class ChunkControl:
    """Settings of the online chunk-size search (``EngineConfig.chunk``).

    ``candidates``: chunk sizes to choose from, strictly increasing. ``explore_period``: steps on the
    incumbent between two explorations. ``explore_top``: how many of the best-ranked candidates an
    exploration covers, the incumbent included (it is not re-run: its recent steps are its measurement).
    ``min_samples``: steps of the incumbent needed before its noise is trusted (an exploration waits for
    them), and the length of the recent window in the drift test. ``noise_sigmas`` and ``noise_floor``
    set the noise band (see ``ChunkSizeController``); ``noise_window`` is how many recent steps of
    the incumbent the band is estimated from.

    ``off``: also consider the arm "do not stream" (``OFF``); it wins ties within the noise band.
    ``hopeless_margin`` and ``hopeless_every``: an arm the cost model predicts slower than the best arm by
    more than ``hopeless_margin`` (relative) is hopeless; an exploration skips hopeless arms, except every
    ``hopeless_every``-th exploration, which also tries the most promising hopeless one (measurements can
    overrule the model). When the profile changes, the prediction does too, and the arm comes back.
    ``warmup_steps``: the first steps of a run carry one-time costs (first forwards, allocations); they are
    recorded but measure no arm (the planned arm runs again).

    ``explore_budget``: the most an exploration may cost, as a fraction of the run's time so far (``None``:
    no limit). Before an exploration step the controller estimates what it will cost against the
    incumbent -- the arm's own last measured excess, else the cost model's prediction under a prior or
    once a streamed step measured a slowdown, else ``hopeless_margin`` of a step (an assumption: the most
    an arm worth exploring may cost) -- and runs it only if the excess time its exploration steps cost
    so far plus that estimate stays within ``explore_budget`` of the time of all steps so far (0.03: a
    policy choice, not a measurement -- it keeps an 8-step drain on a CPU where streaming costs "off" and
    still lets a long run explore; its price: on a GPU where streaming pays and nothing predicts it, the
    first streamed step is the 10th instead of the 2nd). Otherwise
    the incumbent ("off" before there is one) runs and the exploration waits. So whatever the run's
    length, exploration costs at most that fraction of it plus one step's misestimate: a short run on a
    machine where streaming costs (a CPU) explores little or not at all, a long one still explores, and an
    arm predicted to pay is explored at once (see ``ChunkSizeController``).

    ``prior``: ``"model"`` -- the engine predicts the switch costs of every arm from a cost model before the
    first step (``sched/online.py``: the twin's cost model of the engine's device, where one exists:
    a GPU of the roofline table, or a profile calibrated on this machine by ``oppo-engine calibrate``) and
    the first exploration tries the predicted best chunk size and its neighbours; where no cost model
    exists it starts from the candidate list, and after the first step (which runs "off" and times a decode
    and the scorers' prefill) leaves out every chunk size if that step's scoring is too short to hide
    (``ChunkSizeController.futile``: no chunk size can save more than the scorers' busy time, and that
    is within the noise floor of the step).
    ``"list"``: the first exploration starts from "off" and the middle candidate, and nothing is futile.
    Either way measured step times decide, and the rules above stay.
    """

    candidates: tuple[int, ...] = (4, 8, 16, 32, 64)
    explore_period: int = 10
    explore_top: int = 3
    min_samples: int = 3
    noise_sigmas: float = 2.0
    noise_floor: float = 0.02
    noise_window: int = 20
    off: bool = True
    hopeless_margin: float = 0.25
    hopeless_every: int = 4
    warmup_steps: int = 1
    prior: str = "model"
    explore_budget: float | None = 0.03  # a policy choice: see the docstring's explore_budget

    def __post_init__(self) -> None:
        candidates = tuple(self.candidates)
        if not candidates or not all(_is_int(c) and c >= 1 for c in candidates):
            raise ValueError(
                f"ChunkControl.candidates must be a non-empty tuple of ints >= 1, got {candidates!r}"
            )
        if any(a >= b for a, b in zip(candidates, candidates[1:], strict=False)):
            raise ValueError(f"ChunkControl.candidates must be strictly increasing, got {candidates!r}")
        object.__setattr__(self, "candidates", candidates)
        if not _is_int(self.explore_period) or self.explore_period < 1:
            raise ValueError(f"ChunkControl.explore_period must be an int >= 1, got {self.explore_period!r}")
        if not isinstance(self.off, bool):
            raise ValueError(f"ChunkControl.off must be a bool, got {self.off!r}")
        arms = len(candidates) + self.off
        if not _is_int(self.explore_top) or not 1 <= self.explore_top <= arms:
            raise ValueError(
                f"ChunkControl.explore_top must be an int in [1, {arms}] (the number of candidates, and "
                f"'off' if allowed), got {self.explore_top!r}"
            )
        if not _is_int(self.min_samples) or self.min_samples < 2:
            raise ValueError(f"ChunkControl.min_samples must be an int >= 2, got {self.min_samples!r}")
        if not _is_real(self.noise_sigmas) or self.noise_sigmas < 0:
            raise ValueError(
                f"ChunkControl.noise_sigmas must be a finite number >= 0, got {self.noise_sigmas!r}"
            )
        if not _is_real(self.noise_floor) or not 0 <= self.noise_floor < 1:
            raise ValueError(f"ChunkControl.noise_floor must be in [0, 1), got {self.noise_floor!r}")
        if not _is_int(self.noise_window) or self.noise_window < 2 * self.min_samples:
            raise ValueError(
                f"ChunkControl.noise_window must be an int >= 2 * min_samples ({2 * self.min_samples}), "
                f"got {self.noise_window!r}"
            )
        if not _is_real(self.hopeless_margin) or self.hopeless_margin < 0:
            raise ValueError(
                f"ChunkControl.hopeless_margin must be a finite number >= 0, got {self.hopeless_margin!r}"
            )
        if not _is_int(self.warmup_steps) or self.warmup_steps < 0:
            raise ValueError(f"ChunkControl.warmup_steps must be an int >= 0, got {self.warmup_steps!r}")
        if not _is_int(self.hopeless_every) or self.hopeless_every < 1:
            raise ValueError(f"ChunkControl.hopeless_every must be an int >= 1, got {self.hopeless_every!r}")
        budget = self.explore_budget
        if budget is not None and (not _is_real(budget) or not 0 <= budget <= 1):
            raise ValueError(f"ChunkControl.explore_budget must be None or in [0, 1], got {budget!r}")
        if self.prior not in PRIORS:
            raise ValueError(f"ChunkControl.prior must be one of {PRIORS}, got {self.prior!r}")


@dataclass(frozen=True, slots=True)
class SwitchProfile:
    """What the switch-cost profiler (``sched/``) measured; the input of the cost model.

    Switch costs: ``handoff_s``, the fixed cost of one hand-off of a chunk from the actor to the scorers
    (metadata, launches, synchronisation), whatever its size; ``prefill_s_per_token``, the scorers' prefill
    time per token (all scorers together); ``decode_iter_s``, one actor decode iteration with nothing
    beside it; ``slowdown``, chunk size -> the mean fractional slowdown of the actor's decode iterations
    during a chunk period in which the scorers prefill a chunk of that size beside them (0.25 = 25%
    slower; sizes not measured are interpolated linearly in log2 of the size, held flat outside).
    Workload, from recent steps: ``running_seqs``, mean sequences per decode iteration; ``tail_seqs``,
    sequences whose last chunk is still unscored when the step's last token is produced;
    ``tokens_per_step``, tokens generated per step; ``scored_tokens_per_step``, tokens each scorer prefills
    per step (prompts and responses: the scoring that streaming can hide behind the actor's decode);
    ``scoring_s``, the scorers' busy time (wall time, overlapping forwards counted once) in a step that
    did not stream -- all that streaming could hide -- or None before such a step was measured.
    """

    handoff_s: float
    prefill_s_per_token: float
    decode_iter_s: float
    slowdown: Mapping[int, float]
    running_seqs: float
    tail_seqs: float
    tokens_per_step: float
    scored_tokens_per_step: float = 0.0
    scoring_s: float | None = None

    def __post_init__(self) -> None:
        nonnegative = (
            "handoff_s",
            "prefill_s_per_token",
            "decode_iter_s",
            "tail_seqs",
            "scored_tokens_per_step",
        )
        for name in nonnegative:
            value = getattr(self, name)
            if not _is_real(value) or value < 0:
                raise ValueError(f"SwitchProfile.{name} must be a finite number >= 0, got {value!r}")
        if self.scoring_s is not None and (not _is_real(self.scoring_s) or self.scoring_s < 0):
            raise ValueError(
                f"SwitchProfile.scoring_s must be None or a finite number >= 0, got {self.scoring_s!r}"
            )
        for name in ("running_seqs", "tokens_per_step"):
            value = getattr(self, name)
            if not _is_real(value) or value <= 0:
                raise ValueError(f"SwitchProfile.{name} must be a finite number > 0, got {value!r}")
        slowdown = dict(self.slowdown)
        for size, value in slowdown.items():
            if not _is_int(size) or size < 1 or not _is_real(value) or value < 0:
                raise ValueError(
                    "SwitchProfile.slowdown maps chunk sizes (ints >= 1) to slowdowns (finite, >= 0; clamp "
                    f"measurement noise at 0), got {size!r}: {value!r}"
                )
        object.__setattr__(self, "slowdown", slowdown)

    def slowdown_at(self, chunk_size: int) -> float:
        """The decode slowdown beside a prefill of ``chunk_size``, interpolated in log2 of the size."""
        if not self.slowdown:
            return 0.0
        sizes = sorted(self.slowdown)
        if chunk_size <= sizes[0]:
            return self.slowdown[sizes[0]]
        if chunk_size >= sizes[-1]:
            return self.slowdown[sizes[-1]]
        hi = next(i for i, s in enumerate(sizes) if s >= chunk_size)
        a, b = sizes[hi - 1], sizes[hi]
        w = (math.log2(chunk_size) - math.log2(a)) / (math.log2(b) - math.log2(a))
        return self.slowdown[a] + w * (self.slowdown[b] - self.slowdown[a])


def predicted_seconds_per_token(profile: SwitchProfile, chunk_size: Arm) -> float:
    """The cost model: predicted step time per generated token with chunk size ``C`` (or :data:`OFF`).

    With ``N = tokens_per_step / running_seqs`` decode iterations per step, per-iteration decode time
    ``d``, slowdown ``σ(C)``, hand-off cost ``h``, ``k`` tail sequences, prefill time per token ``p`` and
    ``S`` tokens scored per step::

        step(C) = N·d·(1 + σ(C))     actor decode, slowed by the scorers' prefill beside it
                + (N / C)·h          one hand-off every C iterations
                + C·k·p              exposed tail: after the last token, the last chunk (up to C tokens
                                     of each of the k tail sequences) is prefilled with nothing to hide
                                     behind
        step(off) = N·d + S·p        decode alone, then all the scoring exposed
        per_token(C) = step(C) / tokens_per_step

    The hand-off term falls as ``1/C`` and the tail grows as ``C`` (the paper's "too small: context
    switches and contention; too large: little overlap"), so without interference the optimum is
    ``C* = sqrt(N·h / (k·p))``; ``σ(C)`` moves it (on a GPU a larger prefill steals more of the SMs; on a
    CPU any concurrent prefill oversubscribes the cores). Streaming pays only where the scoring it hides,
    ``S·p - C·k·p``, exceeds what it costs the actor, ``N·d·σ(C) + (N / C)·h``: otherwise "off" wins. The
    model only ranks arms: measured step times decide, so what it leaves out (scorer backlog, scheduling)
    costs at most a wasted exploration.
    """
    iterations = profile.tokens_per_step / profile.running_seqs
    if chunk_size == OFF:
        scoring = profile.scored_tokens_per_step * profile.prefill_s_per_token
        return (iterations * profile.decode_iter_s + scoring) / profile.tokens_per_step
    actor = iterations * profile.decode_iter_s * (1.0 + profile.slowdown_at(chunk_size))
    handoffs = iterations / chunk_size * profile.handoff_s
    tail = chunk_size * profile.tail_seqs * profile.prefill_s_per_token
    return (actor + handoffs + tail) / profile.tokens_per_step


class ChunkRecord(NamedTuple):
    """One observed step: its index, the chunk size it ran (or :data:`OFF`), and its wall time per generated
    token."""

    step: int
    chunk_size: Arm
    seconds_per_token: float


class ChunkSizeController:
    """Chooses the chunk size ``C`` of each step -- or :data:`OFF`, no streaming -- from measured step times.

    The arms are ``control.candidates`` and, with ``control.off``, :data:`OFF`. Cycle: an *exploration*
    runs each of the ``explore_top`` best-ranked arms for one step (the incumbent, if among them, is
    skipped: its recent steps are its measurement); then the incumbent runs for ``explore_period`` steps;
    repeat. The first exploration has no incumbent and adopts the fastest arm it measured. Ranking: the
    cost model (:func:`predicted_seconds_per_token`) once a profile is set; without one, "off" first, then
    closeness in the candidate list to the incumbent (to the middle candidate at first), which makes the
    search a local descent that moves to a better neighbour one exploration at a time. With a profile,
    arms the model predicts hopeless (see :class:`ChunkControl`) are left out of all but every
    ``hopeless_every``-th exploration.

    A prior (:meth:`set_prior`: a profile predicted before any step) ranks the arms until a measured
    profile arrives, and then fills in what the steps have not measured yet: the slowdown beside chunk
    sizes not run, and the exposed tail before the first streamed step. Under a prior the first
    exploration covers the predicted best chunk size and its neighbours in the candidate list (and "off"
    when it ranks among them), the hopeless ones left out.

    Noise rule (a band in seconds per token, estimated from the incumbent's own repeated steps): with
    ``m`` and ``s`` the mean and sample standard deviation of the incumbent's recent per-token times (up to
    ``noise_window`` steps, at least ``min_samples``), ``band = max(noise_sigmas · s, noise_floor · m)``.
    While the incumbent has fewer than ``2 · min_samples`` steps (just after a switch or a drift), ``s`` is
    at least the relative noise ``s / m`` last measured over ``2 · min_samples`` or more steps, times
    ``m``: timing noise is roughly multiplicative, and three steps alone estimate it poorly. A challenger
    replaces the incumbent only if its mean stays below ``m - band`` over ``min_samples`` steps: its
    exploration step, then confirming steps, each re-checking the mean so far (the first that lifts it
    above the band ends the challenge). One lucky step never switches; a false switch needs
    ``min_samples`` lucky steps in a row. The relative floor keeps a deterministic or lucky-quiet
    incumbent from switching on rounding-level differences. "Off" is favoured by the band: a streaming
    arm must beat it by more than the band, and "off" replaces a streaming incumbent when it is not slower
    by more than the band (confirmed the same way).

    Drift: on every step of the incumbent with at least ``2 · min_samples`` recent steps, the mean of its
    last ``min_samples`` is compared with the mean of the earlier ones; a difference beyond the band of the
    earlier ones means the landscape moved (longer responses, another Δ, another machine load). The
    incumbent's steps are then dropped (those that revealed the drift were selected for being extreme),
    and an exploration starts as soon as ``min_samples`` fresh steps measure the new level.

    Budget (``ChunkControl.explore_budget``, ``None``: none): each exploration step is charged what it took
    beyond the incumbent's mean time per token (:attr:`spent`; before the first decision, beyond "off" or
    the arm adopted). A step of an arm runs only if the charges so far plus its :meth:`expected_excess`
    times the mean step stay within ``explore_budget`` of the time of all steps so far (:attr:`elapsed`);
    otherwise the incumbent runs ("off" before there is one) and the plan waits (:attr:`exploring` is then
    false). The charges thus exceed the budget by at most one step's misestimate, whatever the run's length.
    An arm expected to pay has no expected cost, but waits while the account is overdrawn. Once "off" is
    measured the first exploration's earlier steps are charged against it; if the rest of the first
    exploration is then unaffordable, what was measured decides (an arm measured to beat "off" is confirmed
    at once, the rest waits for the next exploration). Measured excesses follow the incumbent: a switch
    rescales them to the new one. Where the model
    ties the arms (nothing measured tells the sizes apart) they rank as without a model.

    Only arms it has measured become the incumbent, so :meth:`chunk_size` returns an unmeasured arm only
    in an exploration step. ``fixed=int`` always returns that size; :meth:`observe` still records.
    """

    def __init__(self, control: ChunkControl | None = None, *, fixed: int | None = None) -> None:
        if fixed is not None and (not _is_int(fixed) or fixed < 1):
            raise ValueError(f"fixed chunk size must be an int >= 1 or None, got {fixed!r}")
        self.control = control if control is not None else ChunkControl()
        self.fixed = fixed
        self.history: list[ChunkRecord] = []
        self._profile: SwitchProfile | None = None
        self._prior: SwitchProfile | None = None
        self._incumbent: Arm | None = None
        # NOTE: recent per-token times of the incumbent only; challengers are measured afresh in each
        # exploration (_trial), so stale numbers never decide.
        self._recent: deque[float] = deque(maxlen=self.control.noise_window)
        self._relative_noise: float | None = None
        self._plan: deque[Arm] = deque()
        self._trial: dict[Arm, list[float]] = {}
        self._since_exploration = 0
        self._exploration_due = False
        self._explorations = 0
        # The exploration budget (ChunkControl.explore_budget): the run's time so far, its steps, the excess
        # time exploration steps cost against the incumbent, each arm's last measured relative excess.
        self._elapsed = 0.0
        self._steps = 0
        self._spent = 0.0
        self._excess: dict[Arm, float] = {}
        self._unpriced: list[tuple[float, int]] = []  # first-exploration steps run before any reference
        self._deferred = False  # the plan waits for the budget: the incumbent runs
        if fixed is None:
            self._start_exploration()
            self._settle()

    @property
    def arms(self) -> tuple[Arm, ...]:
        """Every arm: the candidate chunk sizes, then :data:`OFF` if the control allows it."""
        return (*self.control.candidates, OFF) if self.control.off else self.control.candidates

    @property
    def incumbent(self) -> Arm | None:
        """The arm in use between explorations (``None`` until the first exploration ends)."""
        return self.fixed if self.fixed is not None else self._incumbent

    @property
    def exploring(self) -> bool:
        """Whether the next step is an exploration (or confirming) step."""
        return bool(self._plan) and not self._deferred

    @property
    def spent(self) -> float:
        """Seconds the exploration steps so far cost beyond the incumbent's time per token (the budget's
        account, ``ChunkControl.explore_budget``)."""
        return self._spent

    @property
    def elapsed(self) -> float:
        """Seconds of all the steps observed so far (warm-up included)."""
        return self._elapsed

    def set_profile(self, profile: SwitchProfile | None) -> None:
        """Rank arms with the cost model on ``profile`` from the next exploration on (from the first, if no
        step has been measured yet)."""
        self._profile = profile
        if self.fixed is not None:
            return
        if self._incumbent is None and not self._trial:
            self._explorations -= 1  # NOTE: the first exploration is planned again, not a new one
            self._start_exploration()
        elif self._plan and not any(a in self._trial for a in self._plan):
            self._replan()
        self._settle()

    def set_prior(self, prior: SwitchProfile | None) -> None:
        """Rank arms with ``prior`` (predicted, not measured) until a measured profile arrives, and fill in
        what that one lacks (class docstring); before the first measured step, the first exploration is
        planned again around the prior's best."""
        self._prior = prior
        if self.fixed is None and self._incumbent is None and not self._trial:
            self._explorations -= 1  # NOTE: the first exploration is planned again, not a new one
            self._start_exploration()
            self._settle()

    @property
    def prior(self) -> SwitchProfile | None:
        """The predicted profile set by :meth:`set_prior`, if any."""
        return self._prior

    def model(self) -> SwitchProfile | None:
        """The profile the cost model ranks with: the measured one, filled in from the prior (class
        docstring), or the prior alone, or None."""
        measured, prior = self._profile, self._prior
        if measured is None or prior is None:
            return measured or prior
        streamed = bool(measured.slowdown)
        return SwitchProfile(
            handoff_s=measured.handoff_s,
            prefill_s_per_token=measured.prefill_s_per_token,
            decode_iter_s=measured.decode_iter_s,
            slowdown={**prior.slowdown, **measured.slowdown},
            running_seqs=measured.running_seqs,
            tail_seqs=measured.tail_seqs if streamed else prior.tail_seqs,
            tokens_per_step=measured.tokens_per_step,
            scored_tokens_per_step=measured.scored_tokens_per_step,
            scoring_s=measured.scoring_s,
        )

    def ranking(self) -> list[Arm]:
        """The arms, most promising first (see the class docstring)."""
        listed = self._listed()
        profile = self.model()
        if profile is None:
            return listed
        # NOTE: ties -- a model that cannot tell the sizes apart (no hand-off, tail or slowdown known yet:
        # every size costs the decode alone) -- rank as without a model, not smallest first.
        order = {a: i for i, a in enumerate(listed)}
        return sorted(self.arms, key=lambda a: (predicted_seconds_per_token(profile, a), order[a]))

    def _listed(self) -> list[Arm]:
        """The ranking without a cost model: "off", then closeness in the candidate list to the incumbent
        (to the middle candidate before there is one)."""
        candidates = self.control.candidates
        middle = candidates[(len(candidates) - 1) // 2]
        anchor = candidates.index(self._incumbent if _is_int(self._incumbent) else middle)
        sizes = sorted(candidates, key=lambda c: (abs(candidates.index(c) - anchor), c))
        return [OFF, *sizes] if self.control.off else sizes

    def hopeless(self) -> list[Arm]:
        """The arms the cost model predicts slower than the best arm that is not futile by more than
        ``hopeless_margin``, and the futile ones (:meth:`futile`), most promising first (none without a
        profile). A futile arm is never the best: where the bound calls every chunk size futile, "off" is
        not hopeless however much faster the model (which does not know the bound) prices them."""
        profile = self.model()
        if profile is None:
            return []
        costs = {a: predicted_seconds_per_token(profile, a) for a in self.arms}
        futile = self.futile()
        limit = min(c for a, c in costs.items() if a not in futile) * (1.0 + self.control.hopeless_margin)
        return [a for a in self.ranking() if costs[a] > limit or a in futile]

    def futile(self) -> list[Arm]:
        """The chunk sizes that cannot replace "off", under ``prior="model"``: all of them or none.

        A bound from what a step that did not stream measures (a fresh machine's first step runs "off"):
        the actor's decode, ``N·d`` (``N = tokens_per_step / running_seqs`` iterations of ``d``), then the
        scorers' busy time ``T`` (``SwitchProfile.scoring_s``), one after the other. Streaming can at most
        hide all of ``T`` behind the decode (a slowdown, hand-offs and a tail only add to it), so no chunk
        size can make a step faster than ``N·d``. When ``T <= noise_floor · (N·d + T)`` no chunk size
        could beat "off" by the noise band (at least that floor): every one is futile, and explored only
        as a hopeless arm (every ``hopeless_every``-th exploration). Otherwise none is (the bound says
        nothing about which size pays; the measured steps decide). Empty while no such step was measured,
        once a slowdown is known (a streamed step measured one, or the prior predicted one:
        ``hopeless_margin`` then rules), without the arm "off", and under ``prior="list"``."""
        measured, model = self._profile, self.model()
        if measured is None or measured.scoring_s is None or model is None or model.slowdown:
            return []
        if not self.control.off or self.control.prior != "model":
            return []
        decode = measured.tokens_per_step / measured.running_seqs * measured.decode_iter_s
        hidden = measured.scoring_s
        return list(self.control.candidates) if hidden <= self.control.noise_floor * (decode + hidden) else []

    def chunk_size(self) -> Arm:
        """The arm for the next step: a chunk size, or :data:`OFF` (do not stream)."""
        if self.fixed is not None:
            return self.fixed
        if self._plan and not self._deferred:
            return self._plan[0]
        assert self._incumbent is not None  # NOTE: the plan runs, undeferred, until the first decision
        return self._incumbent

    def observe(self, chunk_size: Arm, step_seconds: float, tokens_generated: int) -> None:
        """Record a finished step that ran ``chunk_size`` (or :data:`OFF`) for ``step_seconds`` and generated
        tokens.

        A step that generated no tokens carries no per-token information and is ignored. An arm other than
        the one planned (the scheduler clipped it, say) is recorded in ``history`` only: it measures
        neither the planned arm nor the one it ran.
        """
        if chunk_size != OFF and (not _is_int(chunk_size) or chunk_size < 1):
            raise ValueError(f"chunk_size must be an int >= 1 or {OFF!r}, got {chunk_size!r}")
        if not _is_real(step_seconds) or step_seconds < 0:
            raise ValueError(f"step_seconds must be a finite number >= 0, got {step_seconds!r}")
        if not _is_int(tokens_generated) or tokens_generated < 0:
            raise ValueError(f"tokens_generated must be an int >= 0, got {tokens_generated!r}")
        if tokens_generated == 0:
            return
        per_token = step_seconds / tokens_generated
        self.history.append(ChunkRecord(len(self.history), chunk_size, per_token))
        self._elapsed += step_seconds
        self._steps += 1
        if (
            self.fixed is not None
            or chunk_size != self.chunk_size()
            or len(self.history) <= self.control.warmup_steps
        ):
            self._settle()
            return
        if self.exploring:
            self._plan.popleft()
            reference = self._reference()
            self._trial.setdefault(chunk_size, []).append(per_token)
            if reference is not None:
                self._spent += max(0.0, per_token - reference) * tokens_generated
            elif chunk_size != OFF:  # NOTE: "off" is the reference before there is an incumbent
                self._unpriced.append((per_token, tokens_generated))
            if not self._plan:
                self._decide()
            self._settle()
            return
        self._recent.append(per_token)
        if not self._plan:  # NOTE: a deferred exploration is still this period's
            self._since_exploration += 1
        if self._drifted():
            self._recent.clear()
            self._exploration_due = True
            self._plan.clear()  # NOTE: a deferred plan and the excesses measured the old landscape
            self._trial = {}
            self._excess.clear()
        else:
            self._update_relative_noise()
            if self._since_exploration >= self.control.explore_period:
                self._exploration_due = True
        if self._exploration_due and not self._plan and len(self._recent) >= self.control.min_samples:
            self._start_exploration()
        self._settle()

    def _settle(self) -> None:
        """Apply the exploration budget (``ChunkControl.explore_budget``) to the plan: bring forward the
        first arm it affords, or defer the plan and run the incumbent. Before there is an incumbent "off"
        runs first unless the budget affords a planned arm without it (one the cost model predicts to pay)."""
        self._deferred = False
        if self.fixed is not None or not self._plan or self.control.explore_budget is None:
            return
        if self._incumbent is None:
            if not self.control.off:
                return  # NOTE: nothing to fall back on: the first exploration runs as planned
            if OFF not in self._trial and not any(self._affordable(a) for a in self._plan if a != OFF):
                if OFF in self._plan:
                    self._plan.remove(OFF)
                self._plan.appendleft(OFF)
                return
            if OFF in self._trial and self._unpriced:  # NOTE: "off" measured: the earlier steps are priced
                self._charge({}, statistics.fmean(self._trial[OFF]))
        if self._affordable_first():
            return
        if self._incumbent is None:
            # "Off" was measured and the rest of the first exploration is unaffordable: decide on what was
            # measured. An arm measured to beat "off" gets its confirming steps at once and the rest waits
            # for the next exploration; if none did, "off" runs and the rest is deferred.
            rest = [a for a in self._plan if a != OFF]
            self._plan.clear()
            self._decide()
            if not self._plan:
                self._plan.extend(rest)
            if self._affordable_first():
                return
        self._deferred = bool(self._plan)

    def _affordable_first(self) -> bool:
        """Move the plan's first affordable arm to its front; False if no arm of the plan is affordable."""
        for i, arm in enumerate(self._plan):
            if self._affordable(arm):
                if i:
                    del self._plan[i]
                    self._plan.appendleft(arm)
                return True
        return False

    def expected_excess(self, arm: Arm) -> float:
        """What one step of ``arm`` is expected to cost beyond the incumbent ("off" before there is one), as
        a fraction of a step: its last measured excess; else the cost model's, under a prior or once a
        streamed step measured a slowdown; else ``hopeless_margin`` (an assumption: an arm whose cost
        nothing predicts is taken at the most an arm worth exploring may cost)."""
        if arm in self._excess:
            return self._excess[arm]
        model = self.model()
        reference = self._incumbent if self._incumbent is not None else OFF
        informed = model is not None and (self._prior is not None or bool(model.slowdown))
        if informed and reference in self.arms:
            base = predicted_seconds_per_token(model, reference)
            if base > 0:
                return predicted_seconds_per_token(model, arm) / base - 1.0
        return self.control.hopeless_margin

    def _reference(self) -> float | None:
        """The time per token exploration steps are charged against: the incumbent's recent mean, or before
        there is an incumbent the first exploration's "off" step (None before either is measured)."""
        if self._incumbent is not None and self._recent:
            return statistics.fmean(self._recent)
        if self._incumbent is None and OFF in self._trial:
            return statistics.fmean(self._trial[OFF])
        return None

    def _affordable(self, arm: Arm) -> bool:
        """Whether the budget affords a step of ``arm`` now (``ChunkControl.explore_budget``): the charges so
        far plus its expected excess (none if it is expected to pay) within the budget of the time so far.
        An arm expected to pay still waits while the account is overdrawn: an expectation is no payment."""
        if self._unpriced and self.expected_excess(arm) > 0:
            return False  # NOTE: steps not charged yet (no reference before the first decision)
        if self._recent and len(self._recent) < self.control.min_samples and arm not in self._trial:
            return False  # NOTE: the incumbent's level is not measured yet (a new incumbent, or a drift)
        excess = max(0.0, self.expected_excess(arm))
        if excess > 0 and not self._steps:
            return False
        step = self._elapsed / self._steps if self._steps else 0.0
        return self._spent + excess * step <= self.control.explore_budget * self._elapsed

    def _band(self, samples: list[float]) -> float:
        c = self.control
        mean = statistics.fmean(samples)
        sd = statistics.stdev(samples) if len(samples) > 1 else 0.0
        if len(samples) < 2 * c.min_samples and self._relative_noise is not None:
            sd = max(sd, self._relative_noise * mean)
        return max(c.noise_sigmas * sd, c.noise_floor * mean)

    def _update_relative_noise(self) -> None:
        if len(self._recent) >= 2 * self.control.min_samples:
            mean = statistics.fmean(self._recent)
            if mean > 0:
                self._relative_noise = statistics.stdev(self._recent) / mean

    def _drifted(self) -> bool:
        m = self.control.min_samples
        if len(self._recent) < 2 * m:
            return False
        samples = list(self._recent)
        earlier, recent = samples[:-m], samples[-m:]
        return abs(statistics.fmean(recent) - statistics.fmean(earlier)) > self._band(earlier)

    def _start_exploration(self) -> None:
        self._explorations += 1
        self._plan = deque(a for a in self._exploration_arms() if a != self._incumbent)
        self._trial = {}
        self._since_exploration = 0
        self._exploration_due = False

    def _exploration_arms(self) -> list[Arm]:
        """The arms this exploration covers: the best ``explore_top`` that are not hopeless, and on every
        ``hopeless_every``-th exploration the most promising hopeless one."""
        hopeless = self.hopeless()
        hopeful = [a for a in self.ranking() if a not in hopeless]
        if self._prior is not None and self._incumbent is None:
            hopeful = [a for a in hopeful if a in self._neighbourhood(hopeful)]
        top = hopeful[: self.control.explore_top]
        if self._explorations % self.control.hopeless_every == 0:
            top += [a for a in hopeless if a != self._incumbent][:1]
        return top

    def _neighbourhood(self, ranked: list[Arm]) -> set[Arm]:
        """The best-ranked chunk size of ``ranked``, its neighbours in the candidate list, and "off"."""
        sizes = [a for a in ranked if a != OFF]
        if not sizes:
            return {OFF}
        candidates = self.control.candidates
        i = candidates.index(sizes[0])
        return {OFF, *candidates[max(0, i - 1) : i + 2]}

    def _replan(self) -> None:
        """A profile came in during an exploration (its own steps measured it): the arms not tried yet are
        ranked again, so a step measured to make streaming hopeless spares the exploration the other chunk
        sizes (each a slow step), and brings in "off" if it is now among the best."""
        # NOTE: called between exploration steps only (no confirming step pending), after observe().
        self._plan = deque(
            a for a in self._exploration_arms() if a != self._incumbent and a not in self._trial
        )
        if not self._plan and (self._trial or self._incumbent is not None):
            self._decide()

    def _decide(self) -> None:
        # NOTE: a winner's trial steps were selected for being fast, so they are biased low; an incumbent's
        # noise and drift are estimated from its own later steps only.
        if self._incumbent is not None and not self._trial:
            return  # NOTE: nothing was measured (a replan left no arm): the incumbent stays
        if self._incumbent is None:
            if OFF not in self._trial:
                means = {a: statistics.fmean(xs) for a, xs in self._trial.items()}
                self._incumbent = self._preferred(means, 0.0)
                self._charge(means, means[self._incumbent])
                return
            # "Off" is the first incumbent: a streaming arm must beat it over min_samples steps, as any
            # challenger (one step each is no comparison: the steps' workloads differ).
            self._incumbent = OFF
            self._recent.extend(self._trial.pop(OFF))
        means = {a: statistics.fmean(xs) for a, xs in self._trial.items()}
        samples = list(self._recent)
        self._charge(means, statistics.fmean(samples))
        band = self._band(samples)
        target = self._preferred({**means, self._incumbent: statistics.fmean(samples)}, band)
        if target != self._incumbent:
            if len(self._trial[target]) < self.control.min_samples:
                self._plan.append(target)  # NOTE: a confirming step; at most min_samples per challenger
                return
            # The measured excesses were relative to the old incumbent: made relative to the new one.
            scale = 1.0 + self._excess.get(target, 0.0)
            if scale > 0:
                self._excess = {a: (1.0 + x) / scale - 1.0 for a, x in self._excess.items()}
                self._excess[self._incumbent] = 1.0 / scale - 1.0
            else:
                self._excess.clear()
            self._incumbent = target
            self._recent.clear()

    def _charge(self, means: dict[Arm, float], reference: float) -> None:
        """An exploration's measurements against the incumbent's time per token ``reference``: each arm's
        relative excess (for the budget's next estimates), and the charge of steps run before there was a
        reference."""
        if reference > 0:
            self._excess.update({a: m / reference - 1.0 for a, m in means.items()})
        self._spent += sum(max(0.0, x - reference) * n for x, n in self._unpriced)
        self._unpriced = []

    def _preferred(self, means: dict[Arm, float], band: float) -> Arm:
        """The arm to run given mean per-token times: a streaming arm replaces a streaming incumbent only
        if faster by more than ``band``, and streaming is chosen over "off" only if faster by more than it."""
        streamed = {a: v for a, v in means.items() if a != OFF}
        best = min(streamed, key=lambda a: (streamed[a], a)) if streamed else None
        inc = self._incumbent
        if best is not None and inc in streamed and inc != best and streamed[best] >= streamed[inc] - band:
            best = inc
        if OFF in means and (best is None or streamed[best] >= means[OFF] - band):
            return OFF
        return best
