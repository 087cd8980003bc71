"""Which prompts share a leading run of tokens, and how long: pure Python over token id lists.

A step's new prompts (``SamplingParams.n == 1``) often begin alike -- a chat template's system turn, a
few-shot example -- and differ after it. ``shared_prefixes`` splits them into classes whose members share
their first ``length`` tokens; the schedulers (``sched/scheduler.py``, ``sched/scorer.py``) then compute that
prefix once per model and let the other members fork its pages, as a group's samples share their prompt.

Each member computes at least its last prompt token itself (its logits draw its first token), so a class's
length is at most each member's prompt length minus one. The classes come from the prompts sorted
lexicographically: any set of prompts sharing a prefix is a run of neighbours there, and the longest
common prefix of a run is the smallest of its neighbours' common prefixes. A run is split where that
saves more tokens (the shared length times the members after the first), so a class never drags a long
shared prefix down to a short one. Cost: the sort (list comparisons in C) and one common-prefix scan per
neighbour pair, ``O(B log B)`` comparisons of up to ``L`` tokens -- never ``O(B^2 L)``; then the splits,
each a minimum over its run of neighbour prefixes: ``O(B x depth)`` integer comparisons, ``O(B^2)`` for a
degenerate staircase of prefixes (noticed, not needed at the hundreds of prompts a step holds).
"""

from __future__ import annotations

from collections.abc import Sequence

_BLOCK = 16  # tokens compared per slice while scanning a common prefix


def common_prefix_len(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """Length of the common prefix of ``a`` and ``b``, at most ``limit``."""
    n = min(len(a), len(b), limit)
    i = 0
    while i + _BLOCK <= n and a[i : i + _BLOCK] == b[i : i + _BLOCK]:
        i += _BLOCK
    while i < n and a[i] == b[i]:
        i += 1
    return i


def shared_prefixes(prompts: Sequence[Sequence[int]], min_len: int) -> list[tuple[int, int]]:
    """``(class, length)`` per prompt: prompts of one class (a number from 0) share their first ``length``
    tokens, ``min_len <= length <= len(prompt) - 1``; ``(-1, 0)`` for a prompt that shares nothing. Every
    class has at least two members."""
    if min_len < 1:
        raise ValueError(f"shared_prefixes: min_len must be >= 1, got {min_len}")
    out = [(-1, 0)] * len(prompts)
    order = sorted(range(len(prompts)), key=lambda i: prompts[i])
    # lcp[k]: tokens prompts order[k] and order[k + 1] may share (each keeps its last prompt token).
    lcp = []
    for k in range(len(order) - 1):
        a, b = prompts[order[k]], prompts[order[k + 1]]
        lcp.append(common_prefix_len(a, b, min(len(a), len(b)) - 1))
    num_classes = 0
    start = 0
    for end in range(len(order)):  # maximal runs of neighbours sharing at least min_len
        if end < len(lcp) and lcp[end] >= min_len:
            continue
        for lo, hi, length in _split(lcp, start, end, min_len):
            for k in range(lo, hi + 1):
                out[order[k]] = (num_classes, length)
            num_classes += 1
        start = end + 1
    return out


def _split(lcp: list[int], lo: int, hi: int, min_len: int) -> list[tuple[int, int, int]]:
    """The classes ``(first, last, length)`` of sorted prompts ``lo..hi`` (neighbours sharing ``lcp``): the
    run whole, or split at its smallest neighbour prefix, whichever shares more tokens (recursively; an
    explicit stack, since runs can be long)."""
    # Post-order over the run's splits, each split at its weakest link (its smallest neighbour prefix).
    best: dict[tuple[int, int], tuple[int, list[tuple[int, int, int]]]] = {}
    stack: list[tuple[int, int, int | None]] = [(lo, hi, None)]
    while stack:
        a, b, m = stack.pop()
        if a == b:
            best[a, b] = (0, [])
            continue
        if m is None:
            m = min(range(a, b), key=lcp.__getitem__)
            stack += [(a, b, m), (a, m, None), (m + 1, b, None)]
            continue
        left, right = best.pop((a, m)), best.pop((m + 1, b))
        split = (left[0] + right[0], left[1] + right[1])
        length = lcp[m]
        whole = (b - a) * length if length >= min_len else -1
        best[a, b] = (whole, [(a, b, length)]) if whole >= split[0] else split
    return best[lo, hi][1]
