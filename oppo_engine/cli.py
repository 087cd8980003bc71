"""``oppo-engine demo | bench | trace | serve | serve-scorers | plan | calibrate``: the command-line entry
points."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

# OpenMP threads that finish their share of a parallel region first wait at its barrier: libgomp's default
# spins ~300,000 times, then sleeps. On a machine busier than its cores the spinning threads take the cores
# the working ones wait for: on 2 shared cores at a load of 6-8, SmolLM2's first PPO step (B=4, 32 new
# tokens) took 226 s spinning and 35 s sleeping (OMP_WAIT_POLICY=PASSIVE; docs/ppo.md, "The first step").
# But sleeping at every barrier costs a quiet machine: the math demo's PPO steps took 1.15-1.18x as long
# with PASSIVE as with the default. A short spin (GOMP_SPINCOUNT=2000) keeps both: within 2-8% of the default
# quiet, and 46.9 / 48.4 s against PASSIVE's 43.3-46.9 / 36.3-40.3 s (and 88.9 s for a spin of 20,000) under
# a load of 7 (2026-12-06; docs/ppo.md). The OpenMP runtime reads these once, when torch loads it: set here,
# before torch is imported; a policy or spin count in the environment wins.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "2000")

import torch  # noqa: E402


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
    from oppo_engine.ppo.demo import MATH_DEFAULTS, DemoOptions, run_demo

    t0 = time.perf_counter()
    if args.rollout_dtype is not None and args.task != "math":
        raise ValueError(f"--rollout-dtype {args.rollout_dtype} applies to --task math only")
    # Options left out take the task's defaults (--task math, the default: a 135M model, B=32, 128 tokens,
    # 2 threads, 18 steps of sequential and oppo).
    defaults = MATH_DEFAULTS if args.task == "math" else {}
    given = {
        k: v
        for k, v in (("batch_size", args.batch_size), ("max_new_tokens", args.max_new_tokens))
        if v is not None
    }
    sizes = {**dict(batch_size=32, max_new_tokens=DemoOptions().max_new_tokens), **defaults, **given}
    modes = args.modes.split(",") if args.modes is not None else defaults.get("modes", DemoOptions().modes)
    opts = DemoOptions(
        steps=args.steps if args.steps is not None else defaults.get("steps", DemoOptions().steps),
        modes=tuple(m.strip() for m in modes if m.strip()),
        out=Path(args.out),
        cache=Path(args.cache or (".cache/demo_tools_task" if args.task == "tools" else ".cache/demo_task")),
        device=args.device,
        actor=Path(args.actor) if args.actor else None,
        reward=Path(args.reward) if args.reward else None,
        batch_size=sizes["batch_size"],
        max_new_tokens=sizes["max_new_tokens"],
        threads=args.threads or defaults.get("threads", DemoOptions().threads),
        seed=args.seed,
        overcommit=args.overcommit,
        max_deferrals=args.max_deferrals,
        fsdp=args.fsdp,
        max_policy_lag=args.max_policy_lag,
        task=args.task,
        heldout=args.heldout if args.heldout is not None else DemoOptions().heldout,
        rollout_dtype=args.rollout_dtype or DemoOptions().rollout_dtype,
    )
    if args.fsdp:
        return demo_on_ranks(opts, t0)
    runs = run_demo(opts)
    load = " (load {:.1f} {:.1f} {:.1f})".format(*os.getloadavg()) if hasattr(os, "getloadavg") else ""
    print(f"oppo-engine demo: {time.perf_counter() - t0:.0f}s in all{load}")
    return 0 if any(r.records for r in runs) else 1


def demo_on_ranks(opts, t0: float) -> int:
    """``demo --fsdp``: this process's rank of the demo under ``torchrun``. Each rank trains on its device
    (``cuda:LOCAL_RANK``, or the CPU) over its share of the prompts; only rank 0 builds the embedded task,
    prints and writes ``opts.out``."""
    import contextlib
    import dataclasses
    import os
    import tempfile

    import torch.distributed as dist

    from oppo_engine.ppo.demo import run_demo
    from oppo_engine.ppo.ranks import init_from_env
    from oppo_engine.ppo.task import build_task

    try:
        _, device = init_from_env(device_type=torch.device(opts.device).type)
        opts = dataclasses.replace(opts, fsdp=True, device=str(device))
        rank = dist.get_rank()
        if rank == 0 and opts.actor is None:
            build_task(opts.cache)  # once, before the other ranks read it
        dist.barrier()
        if rank == 0:
            runs = run_demo(opts)
            elapsed = time.perf_counter() - t0
            print(f"oppo-engine demo: {elapsed:.0f}s in all on {dist.get_world_size()} ranks")
        else:
            with tempfile.TemporaryDirectory() as out, open(os.devnull, "w") as devnull:
                with contextlib.redirect_stdout(devnull), contextlib.redirect_stderr(devnull):
                    runs = run_demo(dataclasses.replace(opts, out=Path(out)), log=lambda *_: None)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0 if any(r.records for r in runs) else 1


def launch_demo(nproc: int, argv: list[str]) -> int:
    """``demo --nproc N``: the demo on N data-parallel ranks of this host, started by torch's elastic
    launcher as ``torchrun --standalone --nproc-per-node N -m oppo_engine.cli demo --fsdp ...``."""
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    rest, skip = [], False
    for a in argv:  # the same arguments, less --nproc, plus --fsdp
        if skip or a == "--nproc" or a.startswith("--nproc="):
            skip = a == "--nproc"
            continue
        rest.append(a)
    try:
        torchrun(["--standalone", f"--nproc-per-node={nproc}", "-m", "oppo_engine.cli", *rest, "--fsdp"])
    except ChildFailedError:  # torchrun has printed which rank failed and its traceback
        return 1
    return 0


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


def serve_scorers(argv: list[str]) -> int:
    """Serve frozen scorers to the actor ranks of a job: the paper's 7+1 placement, as a process of its own
    (``oppo_engine.distributed.ScorerService`` on the last rank of a group formed at ``--init``)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from oppo_engine.distributed import ScorerService, stateless_group

    defaults = argparse.ArgumentDefaultsHelpFormatter
    p = argparse.ArgumentParser(prog="oppo-engine serve-scorers", description=serve_scorers.__doc__,
                                formatter_class=defaults)  # fmt: skip
    p.add_argument("--reward", required=True, help="local one-label HF reward model")
    p.add_argument("--reference", help="local HF causal LM: fills the clients' ref_logprobs")
    p.add_argument("--init", required=True, help="tcp://HOST:PORT where the group meets (hosted here)")
    p.add_argument("--world", type=int, required=True, help="ranks in the group: the N actor ranks + 1")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    p.add_argument("--kv-cache-bytes", type=int, default=None, help="the service's arena (None: default)")
    p.add_argument("--max-model-len", type=int, default=None, help="longest sequence (None: the models')")
    p.add_argument("--page-size", type=int, default=16, help="tokens per page of the largest model")
    args = p.parse_args(argv)
    if args.world < 2:
        p.exit(2, f"oppo-engine serve-scorers: --world {args.world}: needs at least one actor rank + 1\n")
    reward = AutoModelForSequenceClassification.from_pretrained(args.reward, dtype="auto")
    reward = reward.to(args.device).eval()
    reference = None
    if args.reference:
        reference = AutoModelForCausalLM.from_pretrained(args.reference, dtype="auto").to(args.device).eval()
    group = stateless_group(args.init, rank=args.world - 1, world_size=args.world, host_store=True)
    service = ScorerService(reward=reward, reference=reference, group=group, device=args.device,
                            kv_cache_bytes=args.kv_cache_bytes, max_model_len=args.max_model_len,
                            page_size=args.page_size)  # fmt: skip
    print(f"oppo-engine serve-scorers: rank {args.world - 1} of {args.world} at {args.init}", flush=True)
    stats = service.serve()
    print(f"oppo-engine serve-scorers: {stats}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``oppo-engine``: ``demo`` (default job), ``bench``, ``trace``, ``serve``,
    ``serve-scorers``, and the twin's ``plan`` and ``calibrate``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if argv and argv[0] == "serve-scorers":
        return serve_scorers(argv[1:])
    if argv and argv[0] == "serve":
        from oppo_engine.serve.command import serve_main

        return serve_main(argv[1:])
    if argv and argv[0] in ("plan", "calibrate"):
        from oppo_engine.sim import commands

        return (commands.plan_main if argv[0] == "plan" else commands.calibrate_main)(argv[1:])
    if argv and argv[0] in ("bench", "trace"):
        rest = argv[1:] + (["--trace"] if argv[0] == "trace" and "--trace" not in argv else [])
        return bench(rest, prog=f"oppo-engine {argv[0]}")
    from oppo_engine.ppo.demo import DEMO_MODES, MATH_DEFAULTS, ROLLOUT_DTYPES, DemoOptions

    defaults = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(prog="oppo-engine", description=__doc__, formatter_class=defaults)
    commands = "{demo,bench,trace,serve,serve-scorers,plan,calibrate}"
    sub = parser.add_subparsers(dest="command", metavar=commands)
    d = sub.add_parser(
        "demo",
        help="PPO on the embedded task in every mode, side by side (the ablation)",
        description=demo.__doc__,
        formatter_class=defaults,
    )
    d.add_argument(
        "--steps", type=int, default=None,
        help=f"PPO steps per mode (None: {DemoOptions().steps}; {MATH_DEFAULTS['steps']} with --task math)",
    )  # fmt: skip
    d.add_argument(
        "--task", default="math", choices=("polite", "tools", "math"),
        help="arithmetic word problems for a pretrained chat model (SmolLM2-135M-Instruct, or --actor) "
        "scored by a rule; or the embedded toy tasks: polite answers, sums with a calculator tool "
        "(multi-turn)",
    )  # fmt: skip
    d.add_argument(
        "--modes", default=None, help=f"comma-separated engine modes (None: {','.join(DEMO_MODES)}; "
        f"{','.join(MATH_DEFAULTS['modes'])} with --task math)",
    )  # fmt: skip
    d.add_argument("--out", default="demo_out", help="folder for table.txt, plots and traces")
    d.add_argument(
        "--cache", default=None, help="where the embedded task's models are built (.cache/demo_task, or "
        ".cache/demo_tools_task with --task tools)",
    )  # fmt: skip
    d.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device to run on"
    )
    d.add_argument(
        "--actor", help="local HF causal LM (with its tokenizer) instead of the embedded task; with --task "
        "math also a .gguf file or a bundled name (default smollm2-135m-instruct)",
    )  # fmt: skip
    d.add_argument("--reward", help="local one-label HF reward model (with --actor; not with --task math)")
    d.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="rollouts per PPO step, B (None: 32, also with --task math)",
    )
    d.add_argument(
        "--max-new-tokens", type=int, default=None,
        help=f"response length cap (None: {DemoOptions().max_new_tokens}; 128 with --task math)",
    )  # fmt: skip
    d.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (None: 1; 2 with --task math; one "
        "is faster on a loaded machine, where OpenMP threads contend with other processes)",
    )  # fmt: skip
    d.add_argument(
        "--heldout", type=int, default=None, help="--task math: held-out problems evaluated before and after "
        f"(default {DemoOptions().heldout}; 0: none)",
    )  # fmt: skip
    d.add_argument(
        "--rollout-dtype", choices=ROLLOUT_DTYPES, default=None,
        help=f"--task math: the engine's dtype (default {DemoOptions().rollout_dtype}; bf16: bf16 replicas "
        "of the fp32 actor and critic, refreshed every update, and a bf16 reference; the update unchanged)",
    )  # fmt: skip
    d.add_argument("--seed", type=int, default=0, help="seed of the task, the models and the sampling")
    d.add_argument("--overcommit", type=int, default=None, help="Δ of inter, oppo (None: B / 2)")
    d.add_argument(
        "--max-deferrals", type=int, default=DemoOptions().max_deferrals, help="deferral bound of inter, oppo"
    )
    d.add_argument("--fsdp", action="store_true", help="as one rank of a torchrun job: FSDP2 actor, critic")
    d.add_argument("--nproc", type=int, default=None, help="launch the demo on N local ranks (--fsdp)")
    d.add_argument(
        "--max-policy-lag",
        type=_policy_lag,
        default=DemoOptions().max_policy_lag,
        help="policy-lag bound of inter, oppo (none: max-deferrals only)",
    )
    sub.add_parser("bench", help="end-to-end benchmark (bench/bench_e2e.py; --help for its options)")
    sub.add_parser("trace", help="the benchmark with a Chrome/Perfetto lane trace")
    sub.add_parser("serve", help="an OpenAI-compatible endpoint over a pretrained actor (--help for options)")
    sub.add_parser("serve-scorers", help="frozen scorers for the actor ranks of a job (--help for options)")
    sub.add_parser("plan", help="predict a PPO run on N GPUs with the twin (--help for options)")
    sub.add_parser("calibrate", help="time this device into a profile for plan and the chunk prior")
    args = parser.parse_args(argv)
    if args.command is None:  # bare `oppo-engine`: what it can do, not an argparse complaint
        parser.print_help()
        return 0
    try:
        if args.nproc is not None:
            return launch_demo(args.nproc, argv)
        return demo(args)
    except (ValueError, NotImplementedError) as e:  # bad options: a message, not a traceback
        parser.exit(2, f"oppo-engine demo: {e}\n")


if __name__ == "__main__":
    raise SystemExit(main())
