"""``oppo-engine plan`` and ``oppo-engine calibrate``, the twin's command lines (``cli.py`` dispatches)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from oppo_engine.config import MODES, EngineConfig
from oppo_engine.control import ChunkControl
from oppo_engine.sim.devices import DEVICES
from oppo_engine.sim.planner import SWEEP, plan

_DEFAULTS = argparse.ArgumentDefaultsHelpFormatter


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated ints, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("at least one int")
    return values


def _auto_int(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"an int or 'auto', got {text!r}") from None


def plan_main(argv: list[str], prog: str = "oppo-engine plan") -> int:
    """Predict a PPO run with the twin: the table, plan.json, and two PNGs (one step per mode; s/step against
    chunk size). Every number is a prediction."""
    p = argparse.ArgumentParser(prog=prog, description=plan_main.__doc__, formatter_class=_DEFAULTS)
    p.add_argument("--actor", default="7b", help="preset name or config.json of the actor")
    p.add_argument("--reward", default=None,
                   help="preset or config.json of the reward (default: the actor's), or 'rule'")  # fmt: skip
    p.add_argument("--critic", default=None, help="preset or config.json of the critic (a value head)")
    p.add_argument("--reference", default=None, help="preset or config.json of the reference")
    known = ", ".join(sorted(DEVICES))
    p.add_argument("--device", default="h200", help=f"one of {known}, or a calibrated profile (JSON)")
    p.add_argument("--gpus", type=int, default=8, help="GPUs of the job")
    p.add_argument("--placement", default="7+1", choices=["7+1", "colocated", "cpu"], help="where models run")
    p.add_argument("--batch-size", type=int, default=112, help="the global batch (B prompts)")
    p.add_argument("--group-size", type=int, default=1, help="samples per prompt (GRPO-style groups)")
    p.add_argument(
        "--lengths", default="lognormal:median=250,sigma=0.9,cap=1024",
        help="response lengths: an int, a file (one a line, or a records.json), or a law name:key=value,...",
    )  # fmt: skip
    p.add_argument("--prompt-lengths", default="128", help="prompt lengths, as --lengths")
    p.add_argument("--steps", type=int, default=200, help="PPO steps the plan covers")
    p.add_argument("--modes", default=",".join(MODES),
                   help="comma-separated engine modes, and the baseline arms trl and sync")  # fmt: skip
    p.add_argument("--chunk-size", type=_auto_int, default="auto", help="an int, or auto (the controller)")
    p.add_argument("--chunk-candidates", type=_ints, default=ChunkControl().candidates,
                   help="the controller's candidate chunk sizes")  # fmt: skip
    p.add_argument("--overcommit", type=_auto_int, default="auto", help="Δ per actor rank: an int, or auto")
    p.add_argument("--sweep", type=_ints, default=SWEEP, help="chunk sizes of the s/step sweep")
    p.add_argument("--reward-curve", default=None, help="JSON list of mean rewards per step (feeds Δ)")
    p.add_argument("--epochs", type=int, default=None, help="PPO epochs (default: the reference trainer's)")
    p.add_argument("--minibatch-size", type=int, default=None, help="rows per rank per minibatch")
    p.add_argument("--group-by-length", action="store_true", help="the trainer's group_by_length")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="a recomputed forward, only layer inputs kept (PPOTrainer has none)")  # fmt: skip
    p.add_argument("--max-tokens-per-microbatch", type=int, default=None,
                   help="packed micro-batches of the update (default: each rank's share padded)")  # fmt: skip
    p.add_argument("--no-measure-agreement", action="store_true",
                   help="PPOConfig.measure_agreement=False: no forward over every row")  # fmt: skip
    p.add_argument("--max-model-len", type=int, default=None,
                   help="the engine's max_model_len (default: prompt cap + response cap)")  # fmt: skip
    p.add_argument("--cpu-threads", type=int, default=1,
                   help="--placement cpu: the torch thread count of the engine's process")  # fmt: skip
    p.add_argument("--no-extrapolate", action="store_true", help="simulate every step of every mode (slow)")
    p.add_argument("--out", default="plan_out", help="folder for plan.json and the PNGs")
    args = p.parse_args(argv)
    from oppo_engine.sim.profile import Profile  # noqa: PLC0415

    try:
        device = args.device
        if device not in DEVICES and Path(device).exists():
            device = Profile.load(device)
        curve = json.loads(Path(args.reward_curve).read_text()) if args.reward_curve else None
        auto = args.chunk_size == "auto"
        chunk = dict(chunk=ChunkControl(candidates=args.chunk_candidates)) if auto else {}
        config = EngineConfig(chunk_size=args.chunk_size, overcommit=args.overcommit,
                              max_model_len=args.max_model_len, **chunk)  # fmt: skip
        bar = _progress()
        t0 = time.perf_counter()
        result = plan(
            args.actor, reward=args.reward, critic=args.critic, reference=args.reference, device=device,
            gpus=args.gpus, placement=args.placement, batch_size=args.batch_size, lengths=args.lengths,
            prompt_lengths=args.prompt_lengths, steps=args.steps,
            modes=tuple(m.strip() for m in args.modes.split(",") if m.strip()), config=config,
            reward_curve=curve, epochs=args.epochs, minibatch_size=args.minibatch_size,
            sweep=args.sweep, extrapolate=not args.no_extrapolate, progress=bar, group_size=args.group_size,
            group_by_length=args.group_by_length, max_tokens_per_microbatch=args.max_tokens_per_microbatch,
            activation_checkpointing=args.activation_checkpointing, cpu_threads=args.cpu_threads,
            measure_agreement=not args.no_measure_agreement,
        )  # fmt: skip
        bar.close()
    except (ValueError, OSError, json.JSONDecodeError) as e:
        p.exit(2, f"{prog}: {e}\n")
    from oppo_engine.sim.report import plot_chunks, plot_steps  # noqa: PLC0415

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(result.table())
    written = [result.save(out / "plan.json"), plot_steps(result, out / "plan_step.png")]
    if any(m.chunk_sweep for m in result.modes.values()):
        written.append(plot_chunks(result, out / "plan_chunks.png"))
    print(f"{prog}: {time.perf_counter() - t0:.1f}s; wrote " + ", ".join(str(w) for w in written))
    return 0


class _progress:
    """A tqdm bar over the plan's simulated worlds, shown once the plan has taken a few seconds."""

    def __init__(self) -> None:
        self.bar = None

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            from tqdm import tqdm  # noqa: PLC0415

            self.bar = tqdm(total=total, desc="simulating", unit="world", delay=3)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def calibrate_main(argv: list[str], prog: str = "oppo-engine calibrate") -> int:
    """Time the local device with the engine's own forwards and write its profile (JSON), which `oppo-engine
    plan --device PROFILE` and the chunk controller's prior (ChunkControl(prior="model")) read."""
    import torch  # noqa: PLC0415

    p = argparse.ArgumentParser(prog=prog, description=calibrate_main.__doc__, formatter_class=_DEFAULTS)
    p.add_argument("--actor", default="small", help="preset name or local checkpoint of the actor")
    p.add_argument("--reward", default=None, help="preset or checkpoint of the reward (default: the actor's)")
    p.add_argument("--critic", action="store_true", help="also time a critic of the actor's shape")
    p.add_argument("--reference", action="store_true", help="also time a reference of the actor's shape")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    p.add_argument("--threads", type=_ints, default=None, help="CPU thread counts (default: 1 and torch's)")
    p.add_argument("--out", default=None, help="the profile's path (default: where the engine looks for it)")
    args = p.parse_args(argv)
    from oppo_engine.presets import build_models  # noqa: PLC0415
    from oppo_engine.sim.calibration import calibrate  # noqa: PLC0415
    from oppo_engine.sim.profile import default_profile_path, local_device_id  # noqa: PLC0415

    dtype = torch.bfloat16 if torch.device(args.device).type == "cuda" else torch.float32
    try:
        actor, reward = build_models(args.actor, dtype, args.device, seed=0)
        if args.reward is not None:
            _, reward = build_models(args.reward, dtype, args.device, seed=1)
        critic = build_models(args.actor, dtype, args.device, seed=2)[1] if args.critic else None
        reference = build_models(args.actor, dtype, args.device, seed=3)[0] if args.reference else None
        path = Path(args.out) if args.out else default_profile_path(local_device_id(args.device))
        t0 = time.perf_counter()
        profile = calibrate(actor, reward, critic=critic, reference=reference, path=path,
                            threads=args.threads, progress=print)  # fmt: skip
    except (ValueError, OSError) as e:
        p.exit(2, f"{prog}: {e}\n")
    for count, c in sorted(profile.threads.items()):
        print(f"{count} thread(s): fit error {c.fit_error:.1%} (median over the timed forwards), bandwidth "
              f"{c.bandwidth / 1e9:.1f} GB/s, {c.forward_s * 1e3:.3f} ms per forward, {c.layer_s * 1e3:.3f} "
              "ms per layer")  # fmt: skip
    print(f"{prog}: {profile.device} in {time.perf_counter() - t0:.0f}s; wrote {path}")
    return 0
