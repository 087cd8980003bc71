"""``oppo-engine demo | bench | trace``: the command-line entry points."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch

DEMO_PRESET = "tiny"


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
    """Roll out a few PPO-sized steps on the embedded tiny models and print what each step measured."""
    from oppo_engine import EngineConfig, RolloutEngine, SamplingParams
    from oppo_engine.obs import format_step_summary
    from oppo_engine.presets import EOS_TOKEN_ID, build_models

    device = torch.device(args.device)
    actor, reward = build_models(
        args.preset, torch.float32 if device.type == "cpu" else torch.bfloat16, device, 0
    )
    g = torch.Generator().manual_seed(0)
    vocab = actor.config.vocab_size
    prompts = [
        torch.randint(16, vocab, (int(n),), generator=g).tolist()
        for n in torch.randint(4, 32, (args.prompts,))
    ]
    engine = RolloutEngine(
        actor=actor,
        reward=reward,
        config=EngineConfig(batch_size=args.batch_size, mode=args.mode, max_model_len=512),
        sampling=SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, seed=0),
        eos_token_id=EOS_TOKEN_ID,
    )
    engine.add_prompts(prompts)
    print(f"oppo-engine demo: preset={args.preset} mode={args.mode} B={args.batch_size} on {device}")
    step, t0 = 0, time.perf_counter()
    total = 0
    while True:
        result = engine.step()
        if not result.rollouts:
            break
        step += 1
        total += len(result.rollouts)
        print(format_step_summary(step, result.metrics))
        engine.update_policy()
    stats = engine.cache_stats()
    print(
        f"{total} rollouts in {step} steps, {time.perf_counter() - t0:.2f}s; "
        f"pages free after draining: {stats.free_pages}/{stats.total_pages}"
    )
    engine.close()
    return 0 if stats.free_pages == stats.total_pages and total == args.prompts else 1


def bench(argv: list[str]) -> int:
    """Run the end-to-end benchmark (bench/bench_e2e.py) with ``argv``."""
    _bench_module().main(argv)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``oppo-engine``: ``demo`` (default job), ``bench`` and ``trace``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if argv and argv[0] in ("bench", "trace"):
        rest = argv[1:] + (["--trace"] if argv[0] == "trace" and "--trace" not in argv else [])
        return bench(rest)
    parser = argparse.ArgumentParser(prog="oppo-engine", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="roll out a few steps on tiny random-init models")
    d.add_argument("--preset", default=DEMO_PRESET)
    d.add_argument("--mode", default="oppo", help="sequential | intra | inter | oppo")
    d.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    d.add_argument("--batch-size", type=int, default=8)
    d.add_argument("--prompts", type=int, default=20)
    d.add_argument("--max-new-tokens", type=int, default=48)
    sub.add_parser("bench", help="end-to-end benchmark (bench/bench_e2e.py; --help for its options)")
    sub.add_parser("trace", help="the benchmark with a Chrome/Perfetto lane trace")
    args = parser.parse_args(argv)
    try:
        return demo(args)
    except (ValueError, NotImplementedError) as e:  # bad options: a message, not a traceback
        parser.exit(2, f"oppo-engine demo: {e}\n")


if __name__ == "__main__":
    raise SystemExit(main())
