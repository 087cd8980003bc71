"""Replica sync of an FSDP2-sharded actor: ``engine.update_policy()`` against a full state dict.

    python -m bench.bench_replica --preset 0.5b --rollout-dtype bf16    # one rank (FSDP2 shards nothing)
    torchrun --nproc-per-node 2 -m bench.bench_replica --preset small   # two ranks (gloo on the CPU)

The trainer's actor is a random-init preset in float32, ``fully_shard``-ed per decoder layer and at the
root. ``replica`` is ``RolloutEngine.update_policy()`` (the replica gathered one parameter at a time, cast
to ``--rollout-dtype`` before the all-gather); ``full_state_dict`` is what a user would otherwise do:
``get_model_state_dict(full_state_dict=True)`` and ``load_state_dict`` into an unsharded rollout copy.
The two alternate, ``--rounds`` times each, in one process. Peak memory is the extra over the memory
before the sync: CUDA, ``max_memory_allocated``; CPU, the process's peak RSS (``VmHWM``, reset through
``/proc/self/clear_refs``). After each replica sync the replica is checked bit for bit against the
gathered weights. The last lines are machine-readable: ``replica_sync_s=``, ``replica_peak_extra_mb=``,
``speedup_replica_vs_full_state_dict=``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from oppo_engine import EngineConfig, RolloutEngine, SamplingParams
from oppo_engine.presets import PRESETS, preset_config

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MB = 1 << 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; see --help."""
    p = argparse.ArgumentParser(prog="python -m bench.bench_replica", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small", help=f"one of {sorted(PRESETS)}")
    p.add_argument("--rollout-dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--rounds", type=int, default=3, help="measured syncs per side")
    p.add_argument("--no-baseline", action="store_true", help="time the replica sync only")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.preset not in PRESETS:
        p.error("--rounds must be >= 1 and --preset a named preset")
    return args


def _init_group(device: torch.device) -> None:
    """The torchrun group, or a group of one on a free local port."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=300))


class PeakMemory:
    """Extra memory at the peak of a block over the memory at its start (bytes)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.extra = 0

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
            self._start = _status("VmRSS")
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.extra = torch.cuda.max_memory_allocated(self.device) - self._start
        else:
            self.extra = _status("VmHWM") - self._start


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _sharded_actor(preset: str, device: torch.device) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    with torch.device(device):
        actor = AutoModelForCausalLM.from_config(preset_config(preset), dtype=torch.float32)
    for layer in actor.model.layers:
        fully_shard(layer)
    return fully_shard(actor)


def _replica_sync(engine: RolloutEngine) -> None:
    engine.update_policy()


def _baseline_sync(actor: torch.nn.Module, copy: torch.nn.Module) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(actor, options=StateDictOptions(full_state_dict=True))
    copy.load_state_dict(state)
    del state


def _timed(fn, device: torch.device) -> tuple[float, int]:
    with PeakMemory(device) as peak:
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t0
    return seconds, peak.extra


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    _init_group(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = DTYPES[args.rollout_dtype]
    actor = _sharded_actor(args.preset, device)
    t0 = time.perf_counter()
    engine = RolloutEngine(
        actor=actor,
        reward=lambda prompt, response: 0.0,
        config=EngineConfig(
            batch_size=1,
            mode="sequential",
            graph=False,
            rollout_dtype=dtype,
            kv_cache_bytes=64 * MB,
            max_model_len=256,
        ),  # fmt: skip
        sampling=SamplingParams(max_new_tokens=4, ignore_eos=True, seed=0),
    )
    build_s = time.perf_counter() - t0
    replica = engine._replicas.by_role["actor"]
    copy = None
    if not args.no_baseline:  # the unsharded rollout copy a user would keep (in the rollout dtype)
        with torch.device(device):
            copy = AutoModelForCausalLM.from_config(preset_config(args.preset), dtype=dtype).eval()
    sides = {"replica": [], "full_state_dict": []}
    peaks = {"replica": [], "full_state_dict": []}
    for _ in range(args.rounds):
        with torch.no_grad():  # the trainer's optimizer step: every weight changes
            for p in actor.parameters():
                p.add_(0.01)
        for side in sides if copy is not None else ("replica",):
            fn = (
                (lambda: _replica_sync(engine))
                if side == "replica"
                else (lambda: _baseline_sync(actor, copy))
            )
            seconds, extra = _timed(fn, device)
            sides[side].append(seconds)
            peaks[side].append(extra)
        full = {n: p.detach().to(dtype).full_tensor() for n, p in actor.named_parameters()}
        if any(not torch.equal(replica.params[n], t) for n, t in full.items()):
            raise AssertionError("the replica differs from the gathered weights after update_policy()")
        del full
    engine.add_prompts([[5, 6, 7, 8]])
    tokens = len(engine.step().rollouts[0].response_ids)
    if rank == 0:
        params = sum(p.numel() for p in replica.params.values())
        print(f"preset={args.preset} ranks={world} device={device.type} params={params / 1e6:.1f}M "
              f"trainer=fp32 replica={args.rollout_dtype} replica_bytes={replica.nbytes / MB:.0f}MB "
              f"build_s={build_s:.3f} step_tokens={tokens}")  # fmt: skip
        print(f"{'side':<16} {'median_s':>9} {'min_s':>8} {'peak_extra_mb':>14}")
        for side, times in sides.items():
            if times:
                print(f"{side:<16} {statistics.median(times):9.3f} {min(times):8.3f} "
                      f"{max(peaks[side]) / MB:14.1f}")  # fmt: skip
        print(f"replica_sync_s={statistics.median(sides['replica']):.4f}")
        print(f"replica_peak_extra_mb={max(peaks['replica']) / MB:.1f}")
        if sides["full_state_dict"]:
            ratio = statistics.median(sides["full_state_dict"]) / statistics.median(sides["replica"])
            print(f"full_state_dict_peak_extra_mb={max(peaks['full_state_dict']) / MB:.1f}")
            print(f"speedup_replica_vs_full_state_dict={ratio:.2f}")
    engine.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
