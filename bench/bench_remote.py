"""Remote scorers vs colocated: 1 actor process + 1 scorer-service process, against the same work in one.

    python -m bench.bench_remote                      # CPU: small presets, B=16, 3 rounds
    python -m bench.bench_remote --device cuda        # two processes sharing one GPU (bench/device_check.sh)

This process is the actor rank; a spawned process runs ``ScorerService`` (reward + reference) on the group's
other rank (a ``stateless_group`` on 127.0.0.1). Each round runs every arm once, in an order that rotates
from round to round, so machine drift hits all alike: colocated ``sequential`` at 1 and 2 torch threads (the
best one is the baseline), colocated ``intra`` and ``oppo``, then ``intra`` and ``oppo`` with
``RemoteScorers``. Every arm is a fresh engine on an endless seeded prompt source with a long-tail of
response lengths (EOS ignored), one warm-up step, then ``--steps`` measured ones. Reported: rollouts/s
(median over rounds), exposed scoring per step, the scoring share of a sequential step, and the messages
and bytes per step each way. The last lines are machine-readable ``key=value``.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import random
import socket
import statistics
import time

import torch

from oppo_engine import EngineConfig, RolloutEngine, SamplingParams
from oppo_engine.presets import EOS_TOKEN_ID, PRESETS, build_models

SERVICE_RANK = 1
COLOCATED = ("sequential@1", "sequential@2", "intra", "oppo")
REMOTE = ("remote-intra", "remote-oppo")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; see --help."""
    p = argparse.ArgumentParser(prog="python -m bench.bench_remote", description=__doc__.split("\n\n")[0])
    p.add_argument("--actor", default="small", help=f"actor preset, one of {sorted(PRESETS)}")
    p.add_argument("--scorer", default="small", help="preset of the reward and the reference models")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=96)
    p.add_argument("--max-new-tokens", type=int, default=48, help="the long tail's cap")
    p.add_argument("--chunk-size", type=int, default=8)
    p.add_argument("--overcommit", type=int, default=4, help="Δ of oppo")
    p.add_argument("--steps", type=int, default=3, help="measured steps per arm and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="float32 on the CPU, bfloat16 on CUDA by default")
    return p.parse_args(argv)


def _dtype(args) -> torch.dtype:
    name = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    return getattr(torch, name)


def _scorers(args) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(reward, reference): the scorer preset's models, seeded alike in both processes."""
    reference, reward = build_models(args.scorer, _dtype(args), args.device, seed=1)
    return reward, reference


def _prompts(args, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Enough prompts for every step of an arm, each with its own response length from a long tail (EOS
    ignored); the same for every arm."""
    rng = random.Random(seed)
    vocab = PRESETS[args.actor]["vocab_size"]
    prompts, sampling = [], []
    for _ in range((args.steps + 2) * (args.batch_size + args.overcommit)):
        length = min(args.max_new_tokens, max(2, int(args.max_new_tokens * 0.25 * rng.paretovariate(1.5))))
        prompts.append([rng.randrange(2, vocab) for _ in range(args.prompt_len)])
        sampling.append(SamplingParams(max_new_tokens=length, ignore_eos=True, seed=seed))
    return prompts, sampling


def _config(args, mode: str) -> EngineConfig:
    cfg = dict(
        batch_size=args.batch_size,
        mode=mode,
        page_size=16,
        max_model_len=args.prompt_len + args.max_new_tokens,
    )
    if mode in ("intra", "oppo"):
        cfg["chunk_size"] = args.chunk_size
    if mode == "oppo":
        cfg["overcommit"] = args.overcommit
    return EngineConfig(**cfg)


def _run_arm(args, arm: str, actor, scorers, group) -> dict:
    """One arm: a fresh engine, a warm-up step, ``args.steps`` measured ones."""
    from oppo_engine.dist import RemoteScorers

    mode = arm.removeprefix("remote-").split("@")[0]
    torch.set_num_threads(int(arm.split("@")[1]) if "@" in arm else 1 if arm in REMOTE else 2)
    if arm in REMOTE:
        reward, extra = RemoteScorers(service_rank=SERVICE_RANK, group=group), {}
    else:
        reward, extra = scorers[0], {"reference": scorers[1]}
    engine = RolloutEngine(actor=actor, reward=reward, config=_config(args, mode), eos_token_id=EOS_TOKEN_ID,
                           **extra)  # fmt: skip
    prompts, sampling = _prompts(args, seed=7)
    engine.add_prompts(prompts, sampling=sampling)
    engine.step()  # warm-up
    lane = engine._loop.scorer_lane
    sent0 = (getattr(lane, "messages_sent", 0), getattr(lane, "bytes_sent", 0))
    wall = exposed = share = 0.0
    rollouts = 0
    for _ in range(args.steps):
        t0 = time.perf_counter()
        result = engine.step()
        wall += time.perf_counter() - t0
        rollouts += len(result.rollouts)
        exposed += result.metrics.exposed_scoring_s
        share += (result.metrics.wall_s - result.metrics.generation_s) / result.metrics.wall_s
    sent = (getattr(lane, "messages_sent", 0) - sent0[0], getattr(lane, "bytes_sent", 0) - sent0[1])
    engine.close()
    return dict(rps=rollouts / wall, exposed=exposed / args.steps, share=share / args.steps,
                messages=sent[0] / args.steps, bytes=sent[1] / args.steps)  # fmt: skip


def _service_main(args, init: str, serves: int, threads: int, out) -> None:
    from oppo_engine.dist import ScorerService, stateless_group

    torch.set_num_threads(threads)
    reward, reference = _scorers(args)
    group = stateless_group(init, rank=SERVICE_RANK, world_size=2, host_store=True)
    service = ScorerService(reward=reward, reference=reference, group=group, device=args.device, page_size=16,
                            max_model_len=args.prompt_len + args.max_new_tokens)  # fmt: skip
    stats = [service.serve() for _ in range(serves)]
    out.put([(s.messages_sent, s.bytes_sent, s.forwards) for s in stats])


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from oppo_engine.dist import stateless_group

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    service = ctx.Process(
        target=_service_main, args=(args, init, args.rounds * len(REMOTE), 1, out), daemon=True
    )
    service.start()
    group = stateless_group(init, rank=0, world_size=2, host_store=False,
                            timeout_s=datetime.timedelta(minutes=5).total_seconds())  # fmt: skip
    torch.manual_seed(0)
    actor, _ = build_models(args.actor, _dtype(args), args.device, seed=0)
    scorers = _scorers(args)
    arms = [*COLOCATED, *REMOTE]
    results: dict[str, list[dict]] = {arm: [] for arm in arms}
    for r in range(args.rounds):
        for arm in arms[r % len(arms) :] + arms[: r % len(arms)]:
            results[arm].append(_run_arm(args, arm, actor, scorers, group))
            print(f"round {r} {arm:>14}: {results[arm][-1]['rps']:.2f} rollouts/s", flush=True)
    service_stats = out.get(timeout=60)
    service.join(timeout=30)
    summary = {
        arm: {k: statistics.median(x[k] for x in runs) for k in runs[0]} for arm, runs in results.items()
    }
    best_seq = max(("sequential@1", "sequential@2"), key=lambda a: summary[a]["rps"])
    base = summary[best_seq]
    header = ("arm", "rollouts/s", "vs seq", "exposed s", "msgs/step", "bytes/step")
    print("\n{:>14} {:>11} {:>7} {:>10} {:>10} {:>11}".format(*header))
    for arm in arms:
        s = summary[arm]
        print(f"{arm:>14} {s['rps']:11.2f} {s['rps'] / base['rps']:7.2f} {s['exposed']:10.4f} "
              f"{s['messages']:10.1f} {s['bytes']:11.0f}")  # fmt: skip
    steps = args.rounds * (args.steps + 1)
    back = [
        sum(x[i] for x in service_stats[j :: len(REMOTE)]) / steps for j in range(len(REMOTE)) for i in (0, 1)
    ]
    print(f"\nbaseline: {best_seq}; scoring share of a sequential step: {base['share']:.2f}")
    print(f"service -> client per step: remote-intra {back[0]:.1f} msgs {back[1]:.0f} B, "
          f"remote-oppo {back[2]:.1f} msgs {back[3]:.0f} B")  # fmt: skip
    ratios = {
        "remote_intra_vs_sequential": summary["remote-intra"]["rps"] / base["rps"],
        "remote_intra_exposed_vs_sequential": summary["remote-intra"]["exposed"] / max(base["exposed"], 1e-9),
        "remote_oppo_vs_colocated_oppo": summary["remote-oppo"]["rps"] / summary["oppo"]["rps"],
        "sequential_scoring_share": base["share"],
    }
    for k, v in ratios.items():
        print(f"{k}={v:.2f}")
    return ratios


if __name__ == "__main__":
    main()
