"""Remote scorers vs colocated: 1 actor process + 1 scorer-service process, against the same work in one.

    python -m bench.bench_remote                      # CPU: small presets, B=16, 3 rounds of 2 blocks
    python -m bench.bench_remote --device cuda        # two processes sharing one GPU (bench/device_check.sh)

This process is the actor rank; a spawned process runs ``ScorerService`` (reward + reference) on the group's
other rank (a ``stateless_group`` on 127.0.0.1). The arms: colocated ``sequential`` at 1 and 2 torch threads
(the better of the two in each block is the baseline), colocated ``intra`` and ``oppo``, and ``intra`` and
``oppo`` with ``RemoteScorers``. Each arm is one engine with one warm-up step, on a seeded prompt source with
a long tail of response lengths (EOS ignored); the colocated engines live through the run. Each round has
two blocks, one per remote arm (the service has one client at a time): the block's remote engine is built,
then every arm of the block runs ``--steps`` measured steps in turns of ``--turn`` consecutive ones, the
arms' order rotating, so that the machine's drift hits them alike. Ratios are taken within a block and their
median over blocks is reported. Reported per arm: rollouts/s (median over blocks), exposed scoring per step,
the CPU seconds per step of both processes together and the cores that keeps busy (CPU over wall: an arm
near the machine's core count is bound by its arithmetic, and can only go faster by doing less of it), the
scoring share of a ``sequential@2`` step, and the messages and bytes per step each way. The last lines are
machine-readable ``key=value``.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
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
    p.add_argument("--steps", type=int, default=6, help="measured steps per arm and block")
    p.add_argument("--turn", type=int, default=3, help="consecutive steps of one arm before the next one's")
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


def _prompts(args, seed: int, steps: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Enough prompts for ``steps`` steps (and a spare), each with its own response length from a long tail
    (EOS ignored); the same sequence of prompts for every arm."""
    rng = random.Random(seed)
    vocab = PRESETS[args.actor]["vocab_size"]
    prompts, sampling = [], []
    for _ in range((steps + 1) * (args.batch_size + args.overcommit)):
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


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) process ``pid`` has used; NaN where ``/proc`` is absent."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _Arm:
    """One arm's engine, stepped in turn with the other arms of a block."""

    def __init__(self, args, name: str, actor, reward, extra: dict, steps: int, service_pid: int) -> None:
        self.name, self.service_pid = name, service_pid
        self.threads = int(name.split("@")[1]) if "@" in name else 1 if name in REMOTE else 2
        torch.set_num_threads(self.threads)
        mode = name.removeprefix("remote-").split("@")[0]
        self.engine = RolloutEngine(actor=actor, reward=reward, config=_config(args, mode),
                                    eos_token_id=EOS_TOKEN_ID, **extra)  # fmt: skip
        prompts, sampling = _prompts(args, seed=7, steps=steps + 1)
        self.engine.add_prompts(prompts, sampling=sampling)
        self.engine.step()  # warm-up

    def begin(self) -> None:
        """Start a block."""
        lane = self.engine._loop.scorer_lane
        self._sent0 = (getattr(lane, "messages_sent", 0), getattr(lane, "bytes_sent", 0))
        self._acc = dict(wall=0.0, rollouts=0, exposed=0.0, share=0.0, cpu=0.0, steps=0)

    def step(self) -> None:
        """One measured step, on the arm's thread count; CPU time is this process's and the service's."""
        torch.set_num_threads(self.threads)
        acc = self._acc
        cpu0 = time.process_time() + _cpu_s(self.service_pid)
        t0 = time.perf_counter()
        result = self.engine.step()
        acc["wall"] += time.perf_counter() - t0
        acc["cpu"] += time.process_time() + _cpu_s(self.service_pid) - cpu0
        acc["rollouts"] += len(result.rollouts)
        acc["exposed"] += result.metrics.exposed_scoring_s
        acc["share"] += (result.metrics.wall_s - result.metrics.generation_s) / result.metrics.wall_s
        acc["steps"] += 1

    def end(self) -> dict:
        """End the block; what it measured."""
        acc, lane = self._acc, self.engine._loop.scorer_lane
        n = acc["steps"]
        messages = getattr(lane, "messages_sent", 0) - self._sent0[0]
        sent = getattr(lane, "bytes_sent", 0) - self._sent0[1]
        wall = acc["wall"]
        return dict(rps=acc["rollouts"] / wall, exposed=acc["exposed"] / n, cpu=acc["cpu"] / n,
                    cores=acc["cpu"] / wall, share=acc["share"] / n, messages=messages / n,
                    bytes=sent / n)  # fmt: skip


def _run_block(args, arms: list[_Arm]) -> dict[str, dict]:
    """``args.steps`` measured steps of every arm, in turns of ``args.turn`` consecutive steps (an arm's
    weights and KV stay warm in cache within its turn, as in a run of one engine), the order of the arms
    rotating from one cycle of turns to the next: the machine's drift, seconds long here, hits every arm
    of the block alike."""
    for arm in arms:
        arm.begin()
    done = 0
    for c in range(-(-args.steps // args.turn)):
        n = min(args.turn, args.steps - done)
        for arm in arms[c % len(arms) :] + arms[: c % len(arms)]:
            for _ in range(n):
                arm.step()
        done += n
    return {arm.name: arm.end() for arm in arms}


def _service_main(args, init: str, serves: int, threads: int, out) -> None:
    from oppo_engine.distributed import ScorerService, stateless_group

    torch.set_num_threads(threads)
    reward, reference = _scorers(args)
    group = stateless_group(init, rank=SERVICE_RANK, world_size=2, host_store=True)
    service = ScorerService(reward=reward, reference=reference, group=group, device=args.device, page_size=16,
                            max_model_len=args.prompt_len + args.max_new_tokens)  # fmt: skip
    stats = [service.serve() for _ in range(serves)]
    out.put([(s.messages_sent, s.bytes_sent, s.forwards) for s in stats])


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from oppo_engine.distributed import stateless_group

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
    from oppo_engine.distributed import RemoteScorers

    # The colocated arms live through the whole run; each block adds one remote arm (one client of the
    # service at a time), built, warmed up and closed with its block.
    extra, steps = {"reference": scorers[1]}, 2 * args.rounds * args.steps
    colocated = [_Arm(args, name, actor, scorers[0], extra, steps, service.pid) for name in COLOCATED]
    blocks: list[tuple[str, dict[str, dict]]] = []
    for r in range(args.rounds):
        for remote in REMOTE if r % 2 == 0 else REMOTE[::-1]:
            reward = RemoteScorers(service_rank=SERVICE_RANK, group=group)
            arm = _Arm(args, remote, actor, reward, {}, args.steps, service.pid)
            block = _run_block(args, [*colocated, arm])
            arm.engine.close()
            blocks.append((remote, block))
            rates = ", ".join(f"{name} {m['rps']:.2f}" for name, m in block.items())
            print(f"round {r} block {remote}: {rates} rollouts/s", flush=True)
    for arm in colocated:
        arm.engine.close()
    service_stats = out.get(timeout=60)
    service.join(timeout=30)
    arms = [*COLOCATED, *REMOTE]
    median = statistics.median

    def best_seq(block: dict[str, dict]) -> str:
        return max(("sequential@1", "sequential@2"), key=lambda a: block[a]["rps"])

    def baseline(block: dict[str, dict]) -> dict:
        return block[best_seq(block)]

    summary = {
        arm: {k: median(b[arm][k] for _, b in blocks if arm in b) for k in blocks[0][1]["sequential@1"]}
        for arm in arms
    }
    vs_seq = {arm: median(b[arm]["rps"] / baseline(b)["rps"] for _, b in blocks if arm in b) for arm in arms}
    seq_wins = [best_seq(b) for _, b in blocks]
    header = ("arm", "rollouts/s", "vs seq", "exposed s", "cpu s/step", "cores", "msgs/step", "bytes/step")
    print("\n{:>14} {:>11} {:>7} {:>10} {:>10} {:>6} {:>10} {:>11}".format(*header))
    for arm in arms:
        s = summary[arm]
        print(f"{arm:>14} {s['rps']:11.2f} {vs_seq[arm]:7.2f} {s['exposed']:10.4f} "
              f"{s['cpu']:10.3f} {s['cores']:6.2f} {s['messages']:10.1f} {s['bytes']:11.0f}")  # fmt: skip
    served = list(zip(service_stats, [remote for remote, _ in blocks], strict=True))  # in serve() order
    per_step = args.rounds * (args.steps + 1)
    back = {r: [sum(st[i] for st, o in served if o == r) / per_step for i in (0, 1)] for r in REMOTE}
    print(f"\nbaseline: the better sequential arm of each block ({', '.join(seq_wins)}); 'vs seq' and the "
          "ratios below are medians over blocks of ratios within a block")  # fmt: skip
    print(f"scoring share of a sequential@2 step: {summary['sequential@2']['share']:.2f}")
    print(f"service -> client per step: remote-intra {back['remote-intra'][0]:.1f} msgs "
          f"{back['remote-intra'][1]:.0f} B, remote-oppo {back['remote-oppo'][0]:.1f} msgs "
          f"{back['remote-oppo'][1]:.0f} B")  # fmt: skip
    intra = [b for remote, b in blocks if remote == "remote-intra"]
    oppo = [b for remote, b in blocks if remote == "remote-oppo"]
    ratios = {
        "remote_intra_vs_sequential": vs_seq["remote-intra"],
        "remote_intra_exposed_vs_sequential": median(
            b["remote-intra"]["exposed"] / max(baseline(b)["exposed"], 1e-9) for b in intra
        ),
        "remote_oppo_vs_colocated_oppo": median(b["remote-oppo"]["rps"] / b["oppo"]["rps"] for b in oppo),
        "remote_oppo_cpu_vs_colocated_oppo": median(b["remote-oppo"]["cpu"] / b["oppo"]["cpu"] for b in oppo),
        "remote_intra_cores": summary["remote-intra"]["cores"],
        "sequential_scoring_share": summary["sequential@2"]["share"],
    }
    for k, v in ratios.items():
        print(f"{k}={v:.2f}")
    return ratios


if __name__ == "__main__":
    main()
