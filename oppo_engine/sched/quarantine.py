"""Quarantine: what one ``step()`` does when a model forward or a reward fails.

A forward packs many sequences, so a failure has no single culprit at first. The policy, inside one
``step()``:

1. An ``Exception`` raised by a model forward or a reward call (marked by ``model_call``) rolls the step
   back and retries it once: a failure that does not reproduce is absorbed.
2. If the retry fails the same way (the same exception type, whichever model raised it: a poison prompt
   fails in the first model that meets it, and under streaming that depends on the schedule), the culprit is
   isolated by probing halves of the step's groups (each probe runs its groups to the end, then is rolled
   back) until one group fails alone, twice (a single failure is never trusted: that is what the retry
   is for). That group leaves the step (quarantined, with its error) and the rest runs again; a further
   failure of the same kind is isolated the same way.
3. Anything else propagates after the rollback: a ``BaseException`` that is not an ``Exception``
   (``KeyboardInterrupt``), an out-of-memory error, an error the engine raised itself, an error whose
   ``retryable`` attribute is false (a model whose every output is non-finite, ``model/finite.py``), a
   retry failing with another type, or a reproducing failure that no single group explains.

Every call here runs before any collective of a process group: the step's result, once this returns, is
what the ranks would agree on.

The policy knows nothing of sequences or tensors: it drives two callables over opaque groups, so it is
tested on its own (``tests/test_quarantine.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

G = TypeVar("G")
T = TypeVar("T")

_FAILED_IN = "_oppo_failed_in"  # attribute naming the role whose forward or reward call raised


@contextlib.contextmanager
def model_call(role: str) -> Iterator[None]:
    """Mark an ``Exception`` raised inside as coming from ``role``'s forward or reward call (retryable);
    the exception itself propagates unchanged, with its traceback."""
    try:
        yield
    except Exception as e:
        if failed_in(e) is None:
            with contextlib.suppress(AttributeError, TypeError):  # an exception type without a __dict__
                setattr(e, _FAILED_IN, role)
        raise


def failed_in(error: BaseException) -> str | None:
    """The role whose forward or reward call raised ``error``, or None if it came from elsewhere."""
    return getattr(error, _FAILED_IN, None)


def is_out_of_memory(error: BaseException) -> bool:
    """Host or device memory ran out: retrying the same work would only fail again, or worse."""
    if isinstance(error, MemoryError) or type(error).__name__ == "OutOfMemoryError":
        return True
    return isinstance(error, RuntimeError) and "out of memory" in str(error).lower()


def is_retryable(error: BaseException) -> bool:
    """An ``Exception`` from a model forward or a reward call, not out of memory, not marked
    ``retryable = False``."""
    if not isinstance(error, Exception) or not getattr(error, "retryable", True):
        return False
    return failed_in(error) is not None and not is_out_of_memory(error)


def describe(error: BaseException) -> str:
    """``Rollout.error`` of a quarantined rollout: the role, the exception type and its message."""
    role = failed_in(error)
    prefix = f"{role}: " if role is not None else ""
    return f"{prefix}{type(error).__name__}: {error}"


@dataclass(slots=True)
class Quarantined(Generic[G]):
    """A group taken out of the step, and the error it raised alone."""

    group: G
    error: BaseException


@dataclass(slots=True)
class QuarantineOutcome(Generic[G, T]):
    """The result of the step over the groups left, the quarantined groups, and the runs after the first
    (retries, isolation probes, and the runs without a quarantined group)."""

    result: T
    failed: list[Quarantined[G]] = field(default_factory=list)
    retries: int = 0


def run_quarantined(
    groups: list[G],
    attempt: Callable[[list[G]], T],
    probe: Callable[[list[G]], None],
) -> QuarantineOutcome[G, T]:
    """Run ``attempt(groups)`` under the policy of the module docstring.

    ``attempt(gs)`` runs the step over ``gs`` and returns its result; ``probe(gs)`` runs ``gs`` to the end and
    discards what it did. ``attempt`` may append groups to ``gs`` (the step admitted them while it ran): they
    are the step's from then on, retried and probed with the others. Both must leave the state as they found
    it when they raise (roll back), and ``probe`` when it returns, too. Raises the error that could not be
    pinned on one group."""
    live = list(groups)
    failed: list[Quarantined[G]] = []
    retries = 0
    failing: _Kind | None = None
    while True:
        try:
            return QuarantineOutcome(attempt(live), failed, retries)
        except Exception as e:
            if not is_retryable(e) or (failing is not None and _kind(e) != failing):
                raise
            error = e
        retries += 1
        if failing is None:  # the first failure: retry once, as it may not reproduce
            failing = _kind(error)
            continue
        culprit, culprit_error, probes = _isolate(live, probe, failing)
        retries += probes
        if culprit is None:
            raise error
        failed.append(Quarantined(culprit, culprit_error or error))
        live = [g for g in live if g is not culprit]


_Kind = type  # the exception type: what "fails the same way" compares


def _kind(error: BaseException) -> _Kind:
    return type(error)


def _isolate(
    groups: list[G], probe: Callable[[list[G]], None], failing: _Kind
) -> tuple[G | None, BaseException | None, int]:
    """``(culprit, its error, probes run)``: the one group that fails alone the ``failing`` way, found by
    halving and confirmed by a second probe of it alone, or ``(None, None, probes)`` when neither half of
    a failing set fails alone. A step of one group has failed alone twice already (attempt and retry)."""
    if len(groups) == 1:
        return groups[0], None, 0
    candidates, probes = groups, 0
    while len(candidates) > 1:
        half = len(candidates) // 2
        for part in (candidates[:half], candidates[half:]):
            probes += 1
            if _probe_error(probe, part, failing) is not None:
                candidates = part
                break
        else:
            return None, None, probes
    probes += 1  # the confirmation
    error = _probe_error(probe, candidates, failing)
    return (candidates[0], error, probes) if error is not None else (None, None, probes)


def _probe_error(probe: Callable[[list[G]], None], groups: list[G], failing: _Kind) -> BaseException | None:
    """The error of ``probe(groups)`` if it fails the ``failing`` way; None if it passes or fails another
    way (out of memory and interrupts propagate).

    NOTE: another failure says nothing about these groups. (A probe runs a subset while the groups outside
    it keep the KV the step found them with; the probe gives those pages up if it runs short of them --
    ``StepLoop.run``'s ``left_out`` -- so it does not stall for pages where the whole step would not.) If
    no probe pins the failure, the step's own error propagates."""
    try:
        probe(groups)
    except Exception as e:
        if is_retryable(e) and _kind(e) == failing:
            return e
        if is_out_of_memory(e):
            raise
    return None
