"""``python -m tests.sim --seeds N [--start S]`` searches N schedules; ``--seed X`` replays one (with its
trace).
``make sim SEEDS=100000`` runs the long search."""

from __future__ import annotations

import argparse
import sys

from .harness import SimFailure, run_schedule
from .search import search


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m tests.sim")
    p.add_argument("--seeds", type=int, default=1000, help="how many schedules to run")
    p.add_argument("--start", type=int, default=0, help="the first seed")
    p.add_argument("--seed", type=int, default=None, help="replay this one seed")
    args = p.parse_args()
    if args.seed is not None:
        try:
            print(run_schedule(args.seed))
        except SimFailure as f:
            print(f)
            return 1
        return 0
    result = search(range(args.start, args.start + args.seeds), progress=True)
    print(result.summary())
    for f in result.failures[:20]:
        print("-" * 100)
        print(f)
    return 1 if result.failures else 0


if __name__ == "__main__":
    sys.exit(main())
