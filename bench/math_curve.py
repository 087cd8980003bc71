"""The learning curve of ``oppo-engine demo --task math`` (SmolLM2-135M-Instruct, the rule reward) in
``sequential`` mode: per-step accuracy, s/step and the update's share, and greedy held-out accuracy before and
after, for the demo's step count to be set from a measured curve (issue 35).

    python -m bench.math_curve --minutes 20 --lr 2e-6 --trainer fp32 --out bench/results/math_curve.jsonl

Each step is appended to ``--out`` as one JSON line as it ends (a killed run keeps its steps), with the
machine's load (``os.getloadavg()``) beside its times: on a shared machine the times are the load's as much as
the engine's. ``--trainer bf16`` runs the trainer's forward and backward (the update, not the engine's
rollout) under CPU bf16 autocast, the weights and AdamW staying fp32 (``demo.autocast_update``, as the demo
does). ``--heldout N`` evaluates the first N of the 200 fixed held-out problems (200: all of them); the
initial accuracy does not depend on the arm, so ``--initial`` can reuse a measured one. ``--max-ops N`` trains
and evaluates on problems of 1 to N operations (default ``math_task.OPERATIONS``, 1 to 3; the demo trains on
1); ``--eval-every K`` also evaluates after every K steps (outside the timed steps; ``--minutes`` counts the
steps only); ``--lr``, ``--critic-lr``, ``--lam``, ``--kl-coef``, ``--epochs``, ``--minibatch-size``,
``--temperature`` and ``--rollout-correction`` (``none`` turns it off) override the demo's ``PPOConfig``. The
critic's value head starts at zero, as in the demo (``demo.zero_value_head``).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path

# As the CLI does (oppo_engine/cli.py): a short OpenMP spin at barriers, set before torch loads its runtime;
# a wait policy or spin count in the environment wins.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "2000")

import torch  # noqa: E402

from oppo_engine.ppo import demo, math_task  # noqa: E402


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def main(argv: list[str] | None = None) -> dict:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=fmt)
    parser.add_argument("--minutes", type=float, default=20.0, help="stop starting steps after this long")
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=None, help="the actor's (default: the demo's)")
    parser.add_argument("--critic-lr", type=float, default=None)
    parser.add_argument("--lam", type=float, default=None, help="GAE's lambda (default: the demo's)")
    parser.add_argument("--kl-coef", type=float, default=None)
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--minibatch-size", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--max-ops", type=int, default=None, help="problems of 1..N operations")
    parser.add_argument("--rollout-correction", choices=("none", "tis", "mis"), default=None,
                        help="the PPO ratio against the trainer's own log-probs (PPOConfig; default: the "
                             "demo's, 'none': no correction)")  # fmt: skip
    parser.add_argument("--eval-every", type=int, default=0, help="held-out accuracy every N steps too")
    parser.add_argument("--trainer", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--heldout", type=int, default=math_task.HELDOUT)
    parser.add_argument("--initial", type=float, default=None, help="a measured initial held-out accuracy")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench/results/math_curve.jsonl")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    operations = (1, args.max_ops) if args.max_ops is not None else math_task.OPERATIONS
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def emit(record: dict) -> None:
        print(json.dumps(record), flush=True)
        with out.open("a") as f:
            f.write(json.dumps(record) + "\n")

    opts = replace(
        demo.DemoOptions(), task="math", modes=("sequential",), batch_size=args.batch_size,
        max_new_tokens=128, threads=args.threads, seed=args.seed, heldout=args.heldout,
        out=Path(tempfile.mkdtemp()), math_operations=operations, bf16_update=args.trainer == "bf16",
    )  # fmt: skip
    cfg = demo.ppo_config(opts)
    given = dict(lr=args.lr, critic_lr=args.critic_lr, lam=args.lam, kl_coef=args.kl_coef, epochs=args.epochs,
                 minibatch_size=args.minibatch_size,
                 temperature=args.temperature, rollout_correction=args.rollout_correction)  # fmt: skip
    if given["rollout_correction"] == "none":
        given["rollout_correction"] = None  # filtered out below, then turned off
    cfg = replace(cfg, **{k: v for k, v in given.items() if v is not None})
    if args.rollout_correction == "none":
        cfg = replace(cfg, rollout_correction=None)
    original = demo.ppo_config
    demo.ppo_config = lambda _opts: cfg
    t0 = time.perf_counter()
    try:
        trainer = demo.make_trainer("sequential", opts, demo.MATH_MODEL, demo.MATH_MODEL)
    finally:
        demo.ppo_config = original
    setup_s = time.perf_counter() - t0
    arm = dict(trainer=args.trainer, value_head="zero", lr=cfg.lr, critic_lr=cfg.critic_lr, lam=cfg.lam,
               kl_coef=cfg.kl_coef, minibatch_size=cfg.minibatch_size,
               epochs=cfg.epochs, rollout_correction=cfg.rollout_correction,
               operations=list(operations), batch_size=cfg.batch_size,
               temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens, heldout=args.heldout,
               threads=args.threads, seed=args.seed)  # fmt: skip
    emit(dict(event="start", setup_s=round(setup_s, 1), load=_load(),
              omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"), **arm))  # fmt: skip

    def heldout(label: str) -> float:
        t = time.perf_counter()
        acc, batch, rollouts = math_task.heldout_accuracy(
            trainer.actor,
            trainer.tokenizer,
            max_new_tokens=cfg.max_new_tokens,
            limit=args.heldout,
            operations=operations,
        )
        answers = [trainer.tokenizer.decode(r.response_ids, skip_special_tokens=True) for r in rollouts[:3]]
        emit(dict(event=f"heldout_{label}", accuracy=acc, steps=trainer.steps, unparsed=batch.unparsed,
                  cut_off=batch.cut_off, seconds=round(time.perf_counter() - t, 1), load=_load(),
                  answers=answers))  # fmt: skip
        return acc

    initial = args.initial if args.initial is not None else heldout("initial")
    elapsed = 0.0
    for _ in range(args.max_steps):
        if elapsed > args.minutes * 60:  # the steps only, not the held-out evaluations
            break
        s0 = time.perf_counter()
        stats = trainer.step()
        step_s = time.perf_counter() - s0
        elapsed += step_s
        score = math_task.score(trainer.reward, stats.rollout.rollouts)
        emit(dict(event="step", step=stats.step, accuracy=score.accuracy, reward=round(stats.reward, 4),
                  unparsed=score.unparsed, cut_off=score.cut_off, kl=round(stats.kl, 4),
                  clipfrac=round(stats.clipfrac, 4), response_len=round(stats.response_len, 1),
                  step_s=round(step_s, 2), rollout_s=round(stats.rollout_s, 2),
                  update_s=round(stats.update_s, 2), elapsed_s=round(elapsed, 1), load=_load()))  # fmt: skip
        if args.eval_every and stats.step % args.eval_every == 0:
            heldout(f"step_{stats.step}")  # outside the timed steps
    trainer.close()
    final = heldout("final")
    summary = dict(event="end", initial=initial, final=final, gain_points=round(100 * (final - initial), 1),
                   steps=trainer.steps, elapsed_s=round(elapsed, 1), **arm)  # fmt: skip
    emit(summary)
    return summary


if __name__ == "__main__":
    main()
