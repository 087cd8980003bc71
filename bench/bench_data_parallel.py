"""Data-parallel engines: what the group's exchanges cost a step, side by side with engines alone.

    python -m bench.bench_data_parallel --preset tiny --nproc 2 --batch 8 --steps 6 --mode oppo

Each of ``--nproc`` spawned ranks (gloo on 127.0.0.1, one intra-op thread each) runs two engines over the
same prompts with the same explicit seeds: ``group`` with ``process_group=`` (the settings check, the
end-of-step exchange, rank 0's chunk size under ``--auto``) and ``alone`` without. Steps alternate between
the two, the order flipping every step, so machine drift hits both alike; both ranks step in lockstep
(the group's exchanges are collective). With a fixed chunk size and Δ (the default) both sides do the
same work and return the same rollouts, which is checked; ``--auto`` runs the online controllers (they may
then choose differently on the two sides). It also times one bare ``all_gather_object`` of a step report.
A data-parallel job steps at the pace of its slowest rank (a faster rank's group step includes its wait
for the slowest at the exchange), so the job's ratio compares the slowest rank's medians; the last line is
machine-readable: ``group_step_ratio=X.XXX`` (slowest median group step over slowest median alone step).
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from oppo_engine import EngineConfig, RolloutEngine, SamplingParams
from oppo_engine.distributed.group import StepReport
from oppo_engine.presets import EOS_TOKEN_ID, PRESETS, build_models
from oppo_engine.sched.prompts import derive_seed

SEED = 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; see --help."""
    description = __doc__.split("\n\n")[0]
    p = argparse.ArgumentParser(prog="python -m bench.bench_data_parallel", description=description)
    p.add_argument("--preset", default="tiny", help=f"one of {sorted(PRESETS)} or a checkpoint directory")
    p.add_argument("--nproc", type=int, default=2, help="ranks")
    p.add_argument("--batch", type=int, default=8, help="rollouts per rank per step")
    p.add_argument("--steps", type=int, default=6, help="measured steps per side (one more warms up)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--response-len", type=int, default=32, help="tokens per response (EOS ignored)")
    p.add_argument("--mode", default="oppo", choices=["sequential", "intra", "inter", "oppo"])
    p.add_argument("--auto", action="store_true", help="online chunk size and Δ (the sides may differ)")
    args = p.parse_args(argv)
    if min(args.nproc, args.batch, args.steps, args.response_len) < 1 or args.prompt_len < 2:
        p.error("--nproc, --batch, --steps, --response-len must be >= 1 and --prompt-len >= 2")
    return args


def _engine(models, args, group) -> RolloutEngine:
    cfg: dict = {}
    if args.mode in ("intra", "oppo"):
        cfg["chunk_size"] = "auto" if args.auto else 8
    if args.mode in ("inter", "oppo"):
        cfg["overcommit"] = "auto" if args.auto else max(1, args.batch // 4)
    config = EngineConfig(
        batch_size=args.batch, mode=args.mode, max_model_len=args.prompt_len + args.response_len + 1, **cfg
    )
    sampling = SamplingParams(max_new_tokens=args.response_len, ignore_eos=True, seed=SEED)
    return RolloutEngine(*models, config=config, sampling=sampling, eos_token_id=EOS_TOKEN_ID,
                         process_group=group)  # fmt: skip


def _rank(rank: int, args: argparse.Namespace, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.nproc, timeout=datetime.timedelta(seconds=300))
    try:
        models = build_models(args.preset, torch.float32, "cpu", seed=SEED)
        vocab = models[0].config.vocab_size
        g = torch.Generator().manual_seed(SEED + rank)
        # Enough prompts that every step is full (overcommit takes B + Δ).
        n = (args.steps + 3) * args.batch * 2
        prompts = [torch.randint(4, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(n)]
        sampling = [
            SamplingParams(max_new_tokens=args.response_len, ignore_eos=True, seed=derive_seed(rank, i))
            for i in range(n)
        ]
        sides = {"group": _engine(models, args, dist.group.WORLD), "alone": _engine(models, args, None)}
        times: dict[str, list[float]] = {name: [] for name in sides}
        responses: dict[str, list] = {name: [] for name in sides}
        for engine in sides.values():
            engine.add_prompts(prompts, sampling)
        for step in range(args.steps + 1):
            order = list(sides.items()) if step % 2 == 0 else list(sides.items())[::-1]
            for name, engine in order:
                dist.barrier()  # both ranks start each step together: neither waits for the other inside
                t0 = time.perf_counter()
                result = engine.step()
                dt = time.perf_counter() - t0
                responses[name] += sorted((r.prompt_ids, r.response_ids) for r in result.rollouts)
                if step:
                    times[name].append(dt)
        report = StepReport(tokens=100, wall_s=0.5, reward_sum=1.0, rewards=8)
        gathered: list = [None] * args.nproc
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(50):
            dist.all_gather_object(gathered, ("step()", report))
        exchange_ms = (time.perf_counter() - t0) / 50 * 1e3
        same = responses["group"] == responses["alone"]
        results.put((rank, {k: statistics.median(v) for k, v in times.items()}, exchange_ms, same))
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    """Spawn the ranks, collect each one's medians, print the table."""
    args = parse_args(argv)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # a free port, picked by the OS
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(_rank, args=(args, port, results), nprocs=args.nproc, start_method="spawn")
    rows = sorted(results.get() for _ in range(args.nproc))
    print(
        f"preset={args.preset} mode={args.mode} auto={args.auto} ranks={args.nproc} batch/rank={args.batch} "
        f"prompt={args.prompt_len} response={args.response_len} steps={args.steps} threads/rank=1"
    )
    print(f"{'rank':>4s} {'alone ms':>10s} {'group ms':>10s} {'group/alone':>12s} {'exchange ms':>12s} same")
    for rank, med, exchange_ms, same in rows:
        ratio = med["group"] / med["alone"]
        print(
            f"{rank:4d} {med['alone'] * 1e3:10.1f} {med['group'] * 1e3:10.1f} {ratio:12.3f} "
            f"{exchange_ms:12.2f} {same}"
        )
    if not args.auto and not all(same for *_, same in rows):
        raise SystemExit("the group's rollouts differ from the engines' alone")
    slowest = {side: max(med[side] for _, med, _, _ in rows) for side in ("alone", "group")}
    print(f"group_step_ratio={slowest['group'] / slowest['alone']:.3f}")


if __name__ == "__main__":
    main()
