"""Non-finite model outputs fail the sequences they belong to, never pass silently.

A NaN in an actor's logits samples token 0 with a NaN log-prob; a NaN score or value trains PPO on NaN.
Each model worker checks the host values it already reads back (the sampled rows' log-probs, the scores,
values and reference log-probs), so the check costs no device sync, and raises:

- :class:`NonFiniteOutput` when some sequences of a forward are affected: a retryable failure of the model
  call, so the quarantine (``sched/quarantine.py``) retries the step, isolates the group by halving and
  fails it with this message;
- :class:`NonFiniteModel` when every sequence of a forward of at least two is affected (NaN weights, say):
  no group explains it, so it is not retried and ``step()`` raises it, naming the model, after the rollback.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence


class NonFiniteOutput(FloatingPointError):
    """A model produced non-finite numbers for some sequences of a forward (the quarantine isolates them)."""


class NonFiniteModel(FloatingPointError):
    """A model produced non-finite numbers for every sequence of a forward: never retried or isolated."""

    retryable = False  # read by sched.quarantine.is_retryable


def check_finite(
    role: str, what: str, values: Sequence[float], owners: Sequence[Hashable], positions: Sequence[int]
) -> None:
    """Raise unless every value is finite. ``values[i]`` is ``what`` (e.g. "logits") of sequence
    ``owners[i]`` at token position ``positions[i]``; the error names ``role``, the first bad sequence and
    position, and how many sequences are affected."""
    if all(map(math.isfinite, values)):
        return
    bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
    affected = {owners[i] for i in bad}
    everyone = set(owners)
    first = bad[0]
    where = f"sequence {owners[first]!r} at position {positions[first]} ({values[first]!r})"
    if affected == everyone and len(everyone) > 1:
        raise NonFiniteModel(
            f"{role}: non-finite {what} for every one of the {len(everyone)} sequences of a forward, first "
            f"{where}: the {role}'s weights or activations are not finite (a diverged update?)"
        )
    raise NonFiniteOutput(
        f"{role}: non-finite {what} for {len(affected)} of {len(everyone)} sequences of a forward, first "
        f"{where}"
    )
