"""The switch-cost profiler: what streaming to the scorers costs, timed on the lanes' own spans.

From one streamed step's timeline (each lane's forwards, with their token counts) it measures:

- the scorers' prefill cost as a line ``duration = handoff_s + tokens * prefill_s_per_token`` (least
  squares over their forwards): the intercept is the fixed cost of a hand-off (metadata, launches,
  synchronisation), whatever the chunk size. A line needs forwards of at least two token counts on one
  lane: a step that did not stream prefills the whole batch in one forward per scorer, which cannot
  split the time into a fixed and a per-token part, so it leaves the line as it was. Until a line was
  measured the profile attributes all of the scorers' busy time to their tokens
  (``prefill_s_per_token = scoring time / tokens scored``, ``handoff_s = 0``): an assumption, not a
  measurement, which prices "off" exactly as the step measured it;
- in a step that did not stream, the scorers' busy time (``scoring_s``, overlapping forwards counted
  once): all the time streaming could ever hide;
- the actor's decode iteration alone (``decode_iter_s``: the median forward no scorer work overlapped),
  and how much slower it runs while a scorer prefill runs beside it, for this step's chunk size;
- the workload: sequences per iteration, tokens per step, tokens each scorer prefilled, and the sequences
  whose last chunk was still unscored when the step's last token came out.

A step that did not stream (the chunk controller's "off" arm: the scorers ran after the actor) measures
everything but the slowdown and the tail, so the profile -- and with it the cost model's verdict on the
streaming arms -- follows the workload while streaming is off.

The spans are wall-clock times of the host: on the CPU that is the work itself; on CUDA each actor
iteration ends in a host sync of its sampled tokens, so an actor span covers its kernels too. The numbers
feed :class:`oppo_engine.control.ChunkSizeController`, which only ranks candidates with them: the step
times it measures decide.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Iterable

from oppo_engine.control import OFF, Arm, SwitchProfile
from oppo_engine.obs.timeline import Span

_EMA = 0.5  # weight of the newest step in the running estimates


class SwitchCostProfiler:
    """Accumulates a :class:`SwitchProfile` over streamed steps (``observe`` once per step)."""

    def __init__(self, actor_lane: str, scorer_lanes: Iterable[str]) -> None:
        self.actor_lane = actor_lane
        self.scorer_lanes = frozenset(scorer_lanes)
        self._slowdown: dict[int, float] = {}
        self._fields: dict[str, float] = {}
        self._line = False  # a line was fitted through two token counts or more (module docstring)

    def observe(
        self, spans: list[Span], chunk_size: Arm, tokens_generated: int, finish_times: list[float]
    ) -> SwitchProfile | None:
        """Fold one step in; returns the profile so far, or None while a field cannot be measured yet."""
        actor = [s for s in spans if s.lane == self.actor_lane]
        scorer = [s for s in spans if s.lane in self.scorer_lanes and s.name == "prefill"]
        if not actor or not scorer or tokens_generated == 0:
            return None
        busy = _merged(sorted((s.start_s, s.end_s) for s in scorer))
        overlapped = [_overlaps(s, busy) for s in actor]
        alone = [s.duration_s for s, o in zip(actor, overlapped, strict=True) if not o]
        beside = [s.duration_s for s, o in zip(actor, overlapped, strict=True) if o]
        decode_iter = statistics.median(alone or beside)
        streamed = chunk_size != OFF
        if streamed and alone and beside:
            self._slowdown[chunk_size] = self._blend(
                self._slowdown.get(chunk_size), max(0.0, statistics.median(beside) / decode_iter - 1.0)
            )
        scorers = len({s.lane for s in scorer})
        scored = sum(float(s.args["tokens"]) for s in scorer) / scorers
        busy_s = sum(end - start for start, end in busy)
        measured = {
            "decode_iter_s": decode_iter,
            "running_seqs": tokens_generated / len(actor),
            "tokens_per_step": float(tokens_generated),
            "scored_tokens_per_step": scored,
        }
        counts: dict[str, set[float]] = {}
        for s in scorer:
            counts.setdefault(s.lane, set()).add(float(s.args["tokens"]))
        if any(len(c) >= 2 for c in counts.values()):
            if not self._line:  # the first line measured replaces the assumed one, not blends into it
                self._fields.pop("handoff_s", None), self._fields.pop("prefill_s_per_token", None)
            self._line = True
            measured["handoff_s"], measured["prefill_s_per_token"] = _fit_line(
                [(float(s.args["tokens"]), s.duration_s) for s in scorer], per_lane=scorers
            )
        elif not self._line:  # NOTE: no line yet: all the busy time is per token (module docstring)
            measured["handoff_s"], measured["prefill_s_per_token"] = 0.0, busy_s / max(scored, 1.0)
        if not streamed:
            measured["scoring_s"] = busy_s
        if streamed:
            generation_end = max(s.end_s for s in actor)
            window = chunk_size * decode_iter
            measured["tail_seqs"] = float(sum(1 for t in finish_times if t >= generation_end - window))
        for name, value in measured.items():
            self._fields[name] = self._blend(self._fields.get(name), value)
        return self.profile()

    def profile(self) -> SwitchProfile | None:
        """The profile measured so far, or None before a step measured it."""
        if not self._fields:
            return None
        # NOTE: no tail measured before the first streamed step: the tail term is then 0.
        return SwitchProfile(slowdown=dict(self._slowdown), **{"tail_seqs": 0.0, **self._fields})

    @staticmethod
    def _blend(old: float | None, new: float) -> float:
        return new if old is None else (1 - _EMA) * old + _EMA * new


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted intervals joined where they overlap: disjoint, in order."""
    out: list[tuple[float, float]] = []
    for start, end in intervals:
        if out and start < out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _overlaps(span: Span, busy: list[tuple[float, float]]) -> bool:
    """``span`` overlaps one of the disjoint sorted ``busy`` intervals (a binary search: a step's actor spans
    against its scorer spans would be quadratic otherwise)."""
    i = bisect.bisect_right(busy, (span.start_s, math.inf))
    # The interval starting at or before the span's start, or the next one, is the only candidate pair.
    near = busy[max(0, i - 1) : i + 1]
    return any(start < span.end_s and span.start_s < end for start, end in near)


def _fit_line(points: list[tuple[float, float]], per_lane: int) -> tuple[float, float]:
    """Least-squares ``duration = a + b * tokens`` over forwards of ``per_lane`` scorers; returns the
    per-hand-off intercept and the per-token slope of all scorers together (both clamped at 0)."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / var if var > 0 else 0.0
    slope = max(0.0, slope)
    intercept = max(0.0, mean_y - slope * mean_x)
    # Each hand-off runs one forward per scorer: the fixed cost and the per-token cost add up over them.
    return intercept * per_lane, slope * per_lane
