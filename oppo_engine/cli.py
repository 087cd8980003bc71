"""``oppo-engine demo | bench | trace``: the command-line entry points."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch


def _bench_module():
    """Import the benchmark harness, which lives in the repository's bench/ folder (not in the wheel)."""
    root = Path(__file__).resolve().parent.parent
    if not (root / "bench" / "bench_e2e.py").exists():
        raise SystemExit("oppo-engine bench: needs a source checkout (bench/ beside oppo_engine/)")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from bench import bench_e2e

    return bench_e2e


def demo(args: argparse.Namespace) -> int:
    """PPO on the embedded task (or ``--actor``/``--reward``) in each mode of ``--modes``, side by side."""
    from oppo_engine.ppo.demo import DemoOptions, run_demo

    t0 = time.perf_counter()
    opts = DemoOptions(
        steps=args.steps,
        modes=tuple(m.strip() for m in args.modes.split(",") if m.strip()),
        out=Path(args.out),
        cache=Path(args.cache),
        device=args.device,
        actor=Path(args.actor) if args.actor else None,
        reward=Path(args.reward) if args.reward else None,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        overcommit=args.overcommit,
        max_deferrals=args.max_deferrals,
        max_policy_lag=args.max_policy_lag,
    )
    runs = run_demo(opts)
    print(f"oppo-engine demo: {time.perf_counter() - t0:.0f}s in all")
    return 0 if any(r.records for r in runs) else 1


def _policy_lag(text: str) -> int | None:
    """``--max-policy-lag``: an int, or ``none`` (no lag bound)."""
    if text.lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"an int >= 1 or 'none', got {text!r}") from None


def bench(argv: list[str], prog: str = "oppo-engine bench") -> int:
    """Run the end-to-end benchmark (bench/bench_e2e.py) with ``argv``; ``--help`` names ``prog``."""
    _bench_module().main(argv, prog=prog)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``oppo-engine``: ``demo`` (default job), ``bench`` and ``trace``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if argv and argv[0] in ("bench", "trace"):
        rest = argv[1:] + (["--trace"] if argv[0] == "trace" and "--trace" not in argv else [])
        return bench(rest, prog=f"oppo-engine {argv[0]}")
    from oppo_engine.ppo.demo import DEMO_MODES, DemoOptions

    defaults = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(prog="oppo-engine", description=__doc__, formatter_class=defaults)
    sub = parser.add_subparsers(dest="command", metavar="{demo,bench,trace}")
    d = sub.add_parser(
        "demo",
        help="PPO on the embedded task in every mode, side by side (the ablation)",
        description=demo.__doc__,
        formatter_class=defaults,
    )
    d.add_argument("--steps", type=int, default=DemoOptions().steps, help="PPO steps per mode")
    d.add_argument("--modes", default=",".join(DEMO_MODES), help="comma-separated engine modes")
    d.add_argument("--out", default="demo_out", help="folder for table.txt, plots and traces")
    d.add_argument("--cache", default=".cache/demo_task", help="where the embedded task's models are built")
    d.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device to run on"
    )
    d.add_argument("--actor", help="local HF causal LM (with its tokenizer) instead of the embedded task")
    d.add_argument("--reward", help="local one-label HF reward model (with --actor)")
    d.add_argument("--batch-size", type=int, default=32, help="rollouts per PPO step (B)")
    d.add_argument(
        "--max-new-tokens", type=int, default=DemoOptions().max_new_tokens, help="response length cap"
    )
    d.add_argument("--seed", type=int, default=0, help="seed of the task, the models and the sampling")
    d.add_argument("--overcommit", type=int, default=None, help="Δ of inter, oppo (None: B / 2)")
    d.add_argument(
        "--max-deferrals", type=int, default=DemoOptions().max_deferrals, help="deferral bound of inter, oppo"
    )
    d.add_argument(
        "--max-policy-lag",
        type=_policy_lag,
        default=DemoOptions().max_policy_lag,
        help="policy-lag bound of inter, oppo (none: max-deferrals only)",
    )
    sub.add_parser("bench", help="end-to-end benchmark (bench/bench_e2e.py; --help for its options)")
    sub.add_parser("trace", help="the benchmark with a Chrome/Perfetto lane trace")
    args = parser.parse_args(argv)
    if args.command is None:  # bare `oppo-engine`: what it can do, not an argparse complaint
        parser.print_help()
        return 0
    try:
        return demo(args)
    except (ValueError, NotImplementedError) as e:  # bad options: a message, not a traceback
        parser.exit(2, f"oppo-engine demo: {e}\n")


if __name__ == "__main__":
    raise SystemExit(main())
