"""Overcommit control for the inter-step overlap: how many sequences Δ to keep in flight beyond B.

OPPO lets Δ follow the training dynamics: while the mean reward still improves, overcommit more
to hide the long tail (throughput at a small statistical cost); when the reward stalls near
convergence, shrink Δ towards ``Δ_min`` (usually 0), switching overcommit off so that no staleness
is added where it could hurt. Updates are bounded and gradual, so short reward oscillations are
filtered rather than followed.

Pure Python: no torch, no numpy.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, replace
from typing import NamedTuple

RULES = ("slope", "alg1")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class DeltaControl:
    """Settings of the Δ controller (``EngineConfig.delta``).

    Δ starts at ``init`` and stays in ``[min, max]``. ``init=None`` and ``max=None`` (the defaults) scale
    with the batch: the engine resolves them when it is built (``resolve``) to B/8 and B/4, rounded up to
    whole groups and at least one group (the paper's fixed 4 and 8 are for B=112). ``window``: how many
    steps of mean reward the
    slope is fitted over; Δ does not move before the window is full. ``rule="slope"`` steps by ``inc``
    up and ``dec`` down; ``rule="alg1"`` steps by ``max(1, Δ // 4)`` either way (the paper's Algorithm
    1). ``significance``: Δ grows only while the fitted slope exceeds ``significance`` standard errors
    of itself, i.e. while the rise stands out of the step-to-step noise; ``0`` is the paper's literal
    "slope > 0", under which a noisy plateau random-walks Δ across its range instead of switching
    overcommit off.
    """

    init: int | None = None
    min: int = 0
    max: int | None = None
    inc: int = 4
    dec: int = 4
    window: int = 5
    rule: str = "slope"
    significance: float = 1.0

    def __post_init__(self) -> None:
        for name in ("init", "min", "max", "inc", "dec"):
            value = getattr(self, name)
            if value is None and name in ("init", "max"):
                continue
            if not _is_int(value) or value < 0:
                raise ValueError(f"DeltaControl.{name} must be an int >= 0, got {value!r}")
        if self.max is not None and self.max < self.min:
            raise ValueError(f"DeltaControl.max ({self.max}) must be >= min ({self.min})")
        if self.init is not None and self.init < self.min:
            raise ValueError(f"DeltaControl.init must be >= min ({self.min}), got {self.init}")
        if None not in (self.init, self.max) and not self.min <= self.init <= self.max:
            raise ValueError(
                f"DeltaControl.init must be in [min, max] = [{self.min}, {self.max}], got {self.init}"
            )
        if self.rule not in RULES:
            raise ValueError(f"DeltaControl.rule must be one of {RULES}, got {self.rule!r}")
        sig = self.significance
        if isinstance(sig, bool) or not isinstance(sig, int | float) or not math.isfinite(sig) or sig < 0:
            raise ValueError(f"DeltaControl.significance must be a finite number >= 0, got {sig!r}")
        min_window = 3 if sig > 0 else 2
        if not _is_int(self.window) or self.window < min_window:
            raise ValueError(
                f"DeltaControl.window must be an int >= {min_window} (a slope needs two points, its standard "
                f"error three), got {self.window!r}"
            )

    def resolve(self, batch_size: int, group: int = 1) -> DeltaControl:
        """These settings with ``init=None`` and ``max=None`` resolved for batch size B and groups of
        ``group``: ``init`` = B/8 and ``max`` = B/4, rounded up to whole groups, at least one group, and
        kept within the explicit bounds (``max`` at least ``min`` and the explicit ``init``)."""
        max_ = self.max
        if max_ is None:
            max_ = max(_whole_groups(batch_size / 4, group), self.min, self.init or 0)
        init = self.init
        if init is None:
            init = min(max(_whole_groups(batch_size / 8, group), self.min), max_)
        return replace(self, init=init, max=max_)


def _whole_groups(num_sequences: float, group: int) -> int:
    """``num_sequences`` rounded up to whole groups of ``group``, and at least one group."""
    return max(1, math.ceil(num_sequences / group)) * group


def fit_slope(values: list[float]) -> tuple[float, float]:
    """Least-squares slope of ``values`` against 0, 1, ..., and its standard error (0 for two points).

    The paper writes the improvement as ``s_t = (1/w) Σ (R_i - R_{i-1})``, which telescopes to
    ``(R_t - R_{t-w}) / w``: two endpoints, so one noisy endpoint decides the sign. The least-squares
    slope weighs every reward in the window and has the same sign on a clean trend.
    """
    n = len(values)
    x_mean = (n - 1) / 2
    y_mean = math.fsum(values) / n
    sxx = math.fsum((i - x_mean) ** 2 for i in range(n))
    slope = math.fsum((i - x_mean) * (y - y_mean) for i, y in enumerate(values)) / sxx
    if n < 3:
        return slope, 0.0
    residuals = math.fsum((y - y_mean - slope * (i - x_mean)) ** 2 for i, y in enumerate(values))
    return slope, math.sqrt(residuals / (n - 2) / sxx)


class DeltaRecord(NamedTuple):
    """One observed step: its index, the reward fed, the fitted slope (``None`` before the window is full)
    and the Δ chosen for the next step."""

    step: int
    reward: float
    slope: float | None
    delta: int


class DeltaController:
    """Chooses Δ, the number of sequences in flight beyond the batch size B, once per step.

    Fed once per step with the mean reward of the returned batch (or the trainer's own signal, through
    ``engine.report_reward``) by :meth:`observe_reward`. When the last ``window`` rewards are in, it fits
    their least-squares slope ``s`` with standard error ``se``; the reward *rises* when
    ``s > significance · se`` (with no noise, ``se = 0`` and this is ``s > 0``). Then:

    - ``rule="slope"`` (the rule of the paper's text): ``Δ ← min(max, Δ + inc)`` while it rises, else
      ``Δ ← max(min, Δ - dec)``.
    - ``rule="alg1"`` (the paper's Algorithm 1): a step proportional to Δ, ``max(1, ⌊Δ/4⌋)``, up while
      the reward rises (same test), down otherwise. Interpretation: the paper summary we implement from
      gives this step and says Δ is adjusted "by sign(d), in reverse", flagging the exact form as
      unverified. We read ``d`` as the reward's decline (the negated slope), so ``Δ - sign(d)·step``
      moves with the reward trend like the text's rule. Where ``sign(d) = 0`` would hold Δ, we shrink it
      as the text's rule does for ``s ≤ 0``, so that overcommit switches itself off on a plateau under
      either rule.

    Each step moves Δ by at most one step (``inc``/``dec``, or ``max(1, ⌊Δ/4⌋)``) and Δ stays in
    ``[min, max]``. ``fixed=int`` always returns it; rewards are still recorded.
    """

    def __init__(self, control: DeltaControl | None = None, *, fixed: int | None = None) -> None:
        if fixed is not None and (not _is_int(fixed) or fixed < 0):
            raise ValueError(f"fixed overcommit must be an int >= 0 or None, got {fixed!r}")
        self.control = control if control is not None else DeltaControl()
        if fixed is None and (self.control.init is None or self.control.max is None):
            raise ValueError(
                "DeltaController needs DeltaControl.init and max: give them, or resolve the defaults for the "
                "batch size with DeltaControl.resolve(batch_size, group)"
            )
        self.fixed = fixed
        self.history: list[DeltaRecord] = []
        self._delta = self.control.init
        self._rewards: deque[float] = deque(maxlen=self.control.window)

    def delta(self) -> int:
        """Δ for the next step."""
        return self.fixed if self.fixed is not None else self._delta

    def state_dict(self) -> dict:
        """Δ, the rewards of the current window and the history, as plain data (engine checkpoints)."""
        history = [tuple(r) for r in self.history]
        return {"delta": self._delta, "rewards": list(self._rewards), "history": history}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state_dict``'s output."""
        self._delta = state["delta"]
        self._rewards = deque(state["rewards"], maxlen=self.control.window)
        self.history = [DeltaRecord(*r) for r in state["history"]]

    def observe_reward(self, reward: float) -> None:
        """Feed the mean reward of the step just returned (skip steps that returned nothing)."""
        if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
            raise ValueError(f"reward must be a finite number, got {reward!r}")
        self._rewards.append(float(reward))
        slope = None
        if len(self._rewards) == self.control.window:
            slope, stderr = fit_slope(list(self._rewards))
            self._delta = self._next_delta(rising=slope > self.control.significance * stderr)
        self.history.append(DeltaRecord(len(self.history), float(reward), slope, self.delta()))

    def _next_delta(self, *, rising: bool) -> int:
        c = self.control
        if c.rule == "alg1":
            up = down = max(1, self._delta // 4)
        else:
            up, down = c.inc, c.dec
        if rising:
            return min(c.max, self._delta + up)
        return max(c.min, self._delta - down)
