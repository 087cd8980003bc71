"""Run many schedules: ``search(seeds)`` returns the reports and the failures (each with its seed)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .harness import Report, SimFailure, run_schedule


@dataclass
class SearchResult:
    reports: list[Report] = field(default_factory=list)
    failures: list[SimFailure] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def per_minute(self) -> float:
        return 60.0 * (len(self.reports) + len(self.failures)) / max(self.seconds, 1e-9)

    def summary(self) -> str:
        r = self.reports
        return (
            f"{len(r) + len(self.failures)} schedules in {self.seconds:.1f} s ({self.per_minute:.0f}/min): "
            f"{len(self.failures)} failed; {sum(x.steps for x in r)} steps, "
            f"{sum(x.failed_steps for x in r)} failed steps rolled back, {sum(x.units for x in r)} units, "
            f"{sum(x.forwards for x in r)} forwards, {sum(x.rollouts for x in r)} rollouts, "
            f"{sum(x.quarantined for x in r)} quarantined; worst step: "
            f"{max((x.max_forward_ratio for x in r), default=0):.3f} x (1+m)*S*L forwards"
        )


def search(seeds, *, stop_at_first: bool = False, progress: bool = False) -> SearchResult:
    out = SearchResult()
    t0 = time.perf_counter()
    for i, seed in enumerate(seeds):
        try:
            out.reports.append(run_schedule(seed))
        except SimFailure as f:
            out.failures.append(f)
            if stop_at_first:
                break
        if progress and (i + 1) % 1000 == 0:
            out.seconds = time.perf_counter() - t0
            print(out.summary(), flush=True)
    out.seconds = time.perf_counter() - t0
    return out
