"""End-to-end rollout benchmark: the HF baseline and the engine's modes on one seeded workload.

    python -m bench.bench_e2e --preset tiny --workload longtail --batch-size 8 --steps 3 --out bench_out

All modes share the models, the prompts and the seeds, and run interleaved step by step in one
process, so drift of the machine (clocks, other load) hits every mode alike. A mode whose engine
is not implemented yet is reported as unavailable, with the reason, instead of failing the run.
The last lines are machine-readable: `speedup_oppo_vs_sequential=X.XX`, `speedup_oppo_vs_hf=X.XX`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from bench import e2e_report
from bench.e2e_report import ModeSummary, StepRecord
from bench.e2e_runners import ALL_MODES, EngineRunner, HfRunner, ModeUnavailable, split_mode
from bench.workloads import DISTRIBUTIONS, PRESETS, build_models, make_workload
from oppo_engine.obs.metrics import format_step_summary
from oppo_engine.obs.timeline import Timeline


def parse_args(argv: list[str] | None = None, prog: str = "python -m bench.bench_e2e") -> argparse.Namespace:
    """Command-line options; see --help."""
    p = argparse.ArgumentParser(
        prog=prog,
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--preset", default="tiny", help=f"one of {sorted(PRESETS)} or a local checkpoint directory"
    )
    p.add_argument(
        "--workload", default="longtail", choices=sorted(DISTRIBUTIONS), help="response-length distribution"
    )
    p.add_argument("--batch-size", type=int, default=8, help="rollouts per step (B)")
    p.add_argument("--num-prompts", type=int, default=None, help="default: B * (warmup + steps + 1)")
    p.add_argument("--steps", type=int, default=3, help="measured steps per mode")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured steps per mode first")
    p.add_argument(
        "--modes",
        default=",".join(ALL_MODES),
        help="comma-separated subset of " + ",".join(ALL_MODES) + "; MODE@N runs an engine mode on N torch "
        "threads (on the CPU the streamed modes use one per lane whatever N)",
    )
    p.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device to run on"
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="auto: bfloat16 on CUDA, float32 on CPU",
    )
    p.add_argument("--prompt-len-cap", type=int, default=128, help="longest prompt of the workload")
    p.add_argument("--response-len-cap", type=int, default=512, help="longest response of the workload")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    p.add_argument("--seed", type=int, default=0, help="seed of the models, the workload and the sampling")
    p.add_argument(
        "--overcommit",
        default="auto",
        type=lambda v: v if v == "auto" else int(v),
        help="Δ of the inter and oppo modes: an int >= 0, or auto (the reward-slope controller)",
    )
    p.add_argument(
        "--max-policy-lag",
        default=2,
        type=lambda v: None if v == "none" else int(v),
        help="the engine's bound on a returned token's policy lag (inter, oppo); none: max_deferrals only",
    )
    p.add_argument("--kv-cache-gb", type=float, default=None, help="KV arena per engine (default: engine's)")
    p.add_argument("--out", type=Path, default=Path("bench_out"), help="directory for CSV, PNG and traces")
    p.add_argument(
        "--trace", action="store_true", help="write a Chrome/Perfetto trace of each mode's last step"
    )
    p.add_argument(
        "--ppo-scorers",
        action="store_true",
        help="also score with a reference (actor-sized) and a critic (reward-sized), as full PPO does",
    )
    args = p.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if unknown := sorted(m for m in args.modes if split_mode(m) is None):
        p.error(
            f"--modes: unknown {unknown}; choose from {','.join(ALL_MODES)}, an engine mode may end in "
            "@N to run it with N torch threads (e.g. sequential@1)"
        )
    if args.batch_size < 1 or args.steps < 1 or args.warmup < 0:
        p.error("--batch-size and --steps must be >= 1, --warmup >= 0")
    needed = args.batch_size * (args.warmup + args.steps)
    if args.num_prompts is None:
        args.num_prompts = needed + args.batch_size  # headroom so overcommit never runs dry on the last step
    elif args.num_prompts < needed:
        p.error(f"--num-prompts={args.num_prompts} is below batch_size * (warmup + steps) = {needed}")
    return args


def main(argv: list[str] | None = None, prog: str = "python -m bench.bench_e2e") -> dict[str, ModeSummary]:
    """Run the benchmark; print the table and the speedup lines; return the per-mode summaries."""
    args = parse_args(argv, prog)
    device = torch.device(args.device)
    if args.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        dtype = getattr(torch, args.dtype)
    actor, reward = build_models(args.preset, dtype, device, args.seed)
    scorers = {}
    if args.ppo_scorers:  # frozen copies with other weights: the costs of full PPO's four models
        scorers["reference"], scorers["critic"] = build_models(args.preset, dtype, device, args.seed + 1)
    workload = make_workload(
        args.workload,
        args.num_prompts,
        args.prompt_len_cap,
        args.response_len_cap,
        actor.config.vocab_size,
        args.seed,
    )
    print(
        f"preset={args.preset} dtype={dtype} device={device} workload={args.workload} B={args.batch_size} "
        f"prompts={len(workload.prompts)} response tokens={workload.response_tokens}"
    )

    runners: dict[str, HfRunner | EngineRunner] = {}
    reasons: dict[str, str] = {}
    for mode in args.modes:
        try:
            runners[mode] = (
                HfRunner(actor, reward, workload, args, **scorers)
                if mode == "hf"
                else EngineRunner(mode, actor, reward, workload, args, **scorers)
            )
        except ModeUnavailable as e:
            reasons[mode] = str(e)
            print(f"[{mode}] unavailable: {e}")

    records: dict[str, list[StepRecord]] = {m: [] for m in args.modes}
    try:
        for k in range(args.warmup + args.steps):
            for mode, runner in list(runners.items()):
                try:
                    rec = runner.step(k)
                except ModeUnavailable as e:
                    reasons[mode] = str(e)
                    print(f"[{mode}] unavailable: {e}")
                    runners.pop(mode).close()
                    continue
                warm = k < args.warmup
                print(f"[{mode:>10}] {'warmup ' if warm else ''}{format_step_summary(k, rec.metrics)}")
                if not warm:
                    records[mode].append(rec)
    finally:
        for runner in runners.values():
            runner.close()

    summaries = [
        ModeSummary(m, reason=reasons[m])
        if m in reasons
        else e2e_report.summarize(m, records[m], paged=m != "hf")
        for m in args.modes
    ]
    print()
    print(e2e_report.format_table(summaries))
    for path in e2e_report.write_csvs(args.out, summaries, [r for m in args.modes for r in records[m]]):
        print(f"wrote {path}")
    last_spans = {m: records[m][-1].spans for m in args.modes if records[m]}
    print(e2e_report.plot(args.out / "bench_e2e.png", summaries, last_spans))
    if args.trace:
        for mode, spans in last_spans.items():
            tl = Timeline()
            for s in spans:
                tl.record(s.lane, s.name, s.start_s, s.end_s, **s.args)
            print(f"wrote {tl.to_chrome_trace(args.out / f'trace_{mode}.json')}")
    by_mode = {s.mode: s for s in summaries}
    # The baseline "sequential" is its best configuration among the thread counts run (sequential@N).
    seq = [s for s in summaries if split_mode(s.mode)[0] == "sequential" and s.available]
    if seq:
        by_mode["sequential"] = max(seq, key=lambda s: s.tokens_per_s)
    for line in e2e_report.spread_warnings(records):
        print(line)
    if args.steps < e2e_report.MIN_STEPS_FOR_SPEEDUP:
        print(e2e_report.too_few_steps_line(args.steps))
        return by_mode
    print(e2e_report.speedup_line(by_mode, "intra", "sequential"))
    print(e2e_report.speedup_line(by_mode, "oppo", "sequential"))
    print(e2e_report.speedup_line(by_mode, "oppo", "hf"))
    return by_mode


if __name__ == "__main__":
    main()
