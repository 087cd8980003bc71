"""Thread-safe recorder of what each lane was doing when, exportable as a Chrome/Perfetto trace."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class Span:
    """One busy interval of a lane, in the seconds of its timeline's clock."""

    lane: str
    name: str
    start_s: float
    end_s: float
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def duration_s(self) -> float:
        """Seconds the lane was busy with it."""
        return self.end_s - self.start_s


class Timeline:
    """Intervals of work per lane (actor decode, scorer prefill, ...), recorded from any thread.

    Spans are kept in recording order. Times are ``clock()`` seconds -- ``time.perf_counter`` unless the
    step loop's runtime replaces it (``sched/runtime.py``) -- so spans recorded by different threads of one
    process share a clock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[Span] = []
        self.clock = time.perf_counter

    @contextmanager
    def span(self, lane: str, name: str, **args: Any) -> Iterator[None]:
        """Record the duration of the `with` body as a span of `lane`, also when the body raises."""
        start = self.clock()
        try:
            yield
        finally:
            self.record(lane, name, start, self.clock(), **args)

    def record(self, lane: str, name: str, start_s: float, end_s: float, **args: Any) -> None:
        """Record a span measured elsewhere (e.g. from CUDA events converted to perf_counter time)."""
        if end_s < start_s:
            raise ValueError(f"span {lane}/{name}: end_s={end_s} is before start_s={start_s}")
        s = Span(lane, name, start_s, end_s, dict(args))
        with self._lock:
            self._spans.append(s)

    def spans(self) -> list[Span]:
        """A snapshot of all spans recorded so far."""
        with self._lock:
            return list(self._spans)

    def lanes(self) -> list[str]:
        """Lane names in order of first appearance (the trace's row order)."""
        return list(dict.fromkeys(s.lane for s in self.spans()))

    def clear(self) -> None:
        """Forget all spans (e.g. at the start of a step)."""
        with self._lock:
            self._spans.clear()

    def busy_fraction(self, start_s: float, end_s: float) -> dict[str, float]:
        """Lane -> fraction of the window [start_s, end_s] covered by that lane's spans.

        Spans are clipped to the window and overlapping spans of one lane count once (their union),
        so a fraction never exceeds 1. Every lane ever recorded appears, with 0.0 if idle here.
        """
        if end_s <= start_s:
            raise ValueError(f"busy_fraction window is empty: start_s={start_s}, end_s={end_s}")
        by_lane: dict[str, list[tuple[float, float]]] = {}
        for s in self.spans():
            ivs = by_lane.setdefault(s.lane, [])
            lo, hi = max(s.start_s, start_s), min(s.end_s, end_s)
            if hi > lo:
                ivs.append((lo, hi))
        return {lane: _union_length(ivs) / (end_s - start_s) for lane, ivs in by_lane.items()}

    def chrome_trace(self) -> dict[str, Any]:
        """The spans as a Chrome trace-event JSON object (loadable in Perfetto and chrome://tracing).

        One complete event (ph "X") per span, ts/dur in microseconds from the earliest span, one
        thread (tid) per lane named by a thread_name metadata event.
        """
        spans = self.spans()
        origin = min((s.start_s for s in spans), default=0.0)
        tids = {lane: i for i, lane in enumerate(dict.fromkeys(s.lane for s in spans))}
        events: list[dict[str, Any]] = [
            {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "oppo_engine"}}
        ]
        for lane, tid in tids.items():
            events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": tid, "args": {"name": lane}})
            events.append(
                {"ph": "M", "name": "thread_sort_index", "pid": 0, "tid": tid, "args": {"sort_index": tid}}
            )
        for s in spans:
            events.append(
                {
                    "ph": "X",
                    "name": s.name,
                    "cat": s.lane,
                    "pid": 0,
                    "tid": tids[s.lane],
                    "ts": (s.start_s - origin) * 1e6,
                    "dur": (s.end_s - s.start_s) * 1e6,
                    "args": s.args,
                }
            )
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def to_chrome_trace(self, path: str | Path) -> Path:
        """Write `chrome_trace()` to `path` (parents created) and return the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        # NOTE: default=str so span args such as tensors' shapes or enums never make the export fail.
        path.write_text(json.dumps(self.chrome_trace(), default=str))
        return path


def _union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by possibly overlapping intervals."""
    total, reach = 0.0, float("-inf")
    for lo, hi in sorted(intervals):
        lo = max(lo, reach)  # skip the part an earlier interval already counted
        if hi > lo:
            total += hi - lo
            reach = hi
    return total
