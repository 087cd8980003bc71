"""The modes bench_e2e compares, each behind one `step(k) -> StepRecord`: the HF baseline and one
`RolloutEngine` per engine mode, driven only through the public API of DESIGN.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import torch

from bench.baselines import hf_rollout_step
from bench.e2e_report import StepRecord
from bench.workloads import Workload
from oppo_engine.obs.gpu import GpuUtilSampler
from oppo_engine.obs.metrics import StepMetrics
from oppo_engine.obs.timeline import Timeline

ENGINE_MODES = ("sequential", "intra", "inter", "oppo")
ALL_MODES = ("hf", *ENGINE_MODES)


def split_mode(mode: str) -> tuple[str, int | None] | None:
    """``"sequential@1"`` -> ``("sequential", 1)``; ``"intra"`` -> ``("intra", None)``; None if unknown."""
    name, _, threads = mode.partition("@")
    if name not in ALL_MODES or (threads and (name == "hf" or not threads.isdigit() or int(threads) < 1)):
        return None
    return name, int(threads) if threads else None


class ModeUnavailable(Exception):
    """The mode cannot run in this build (engine missing or not implemented); the message says why."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gpu_sampler(device: torch.device) -> GpuUtilSampler | None:
    """A sampler for the run's GPU; None on CPU runs, so an idle GPU's reading is never reported."""
    # NOTE: NVML numbers GPUs ignoring CUDA_VISIBLE_DEVICES; run the bench on one visible GPU.
    return GpuUtilSampler.for_device(device) if device.type == "cuda" else None


@contextlib.contextmanager
def _unavailable_if_not_implemented(what: str) -> Iterator[None]:
    """Turn the engine's NotImplementedError (a part not landed yet) into ModeUnavailable."""
    try:
        yield
    except NotImplementedError as e:
        raise ModeUnavailable(f"{what} not implemented: {e}".rstrip(": ")) from e


class HfRunner:
    """The `hf` baseline: step k generates and scores prompts [k*B, (k+1)*B) of the workload."""

    def __init__(
        self, actor: Any, reward: Any, workload: Workload, args: argparse.Namespace, **scorers: Any
    ) -> None:
        self.actor, self.reward, self.workload, self.args = actor, reward, workload, args
        self.scorers = scorers  # reference=, critic= (--ppo-scorers)
        self.pad_token_id = reward.config.pad_token_id
        self.gpu = _gpu_sampler(actor.device)

    def step(self, k: int) -> StepRecord:
        """Generate, then score, batch k; lanes: actor during generate, reward during scoring."""
        rows = slice(k * self.args.batch_size, (k + 1) * self.args.batch_size)
        prompts, lens = self.workload.prompts[rows], self.workload.max_new_tokens[rows]
        if not prompts:
            raise ModeUnavailable(f"workload exhausted at step {k}: raise --num-prompts")
        if self.gpu:
            self.gpu.start()
        t0 = time.perf_counter()
        out = hf_rollout_step(
            self.actor,
            self.reward,
            prompts,
            lens,
            self.args.temperature,
            self.args.seed + k,
            self.pad_token_id,
            **self.scorers,
        )
        wall = time.perf_counter() - t0
        sample = self.gpu.stop() if self.gpu else None
        tl = Timeline()
        tl.record("actor", "generate", t0, t0 + out.generation_s, rollouts=len(prompts))
        tl.record("reward", "score", t0 + out.generation_s, t0 + out.generation_s + out.scoring_s)
        metrics = StepMetrics(
            wall_s=wall,
            generation_s=out.generation_s,
            exposed_scoring_s=out.scoring_s,
            tokens_generated=sum(lens),
            rollouts=len(prompts),
            chunk_size=None,
            overcommit=0,
            deferred=0,
            pages_used=0,
            lane_busy=tl.busy_fraction(t0, t0 + wall),
            gpu_util=sample.mean_util_pct if sample else None,
        )
        return StepRecord("hf", k, metrics, tl.spans())

    def close(self) -> None:
        """Stop the GPU sampler (nothing else is held)."""
        if self.gpu:
            self.gpu.stop()


def _engine_api() -> tuple[Any, Any, Any]:
    """(RolloutEngine, EngineConfig, SamplingParams) from the public package, or ModeUnavailable."""
    try:
        from oppo_engine import EngineConfig, RolloutEngine, SamplingParams
    except Exception as e:  # noqa: BLE001 - any import failure means "engine not built yet"
        raise ModeUnavailable(f"oppo_engine import failed: {type(e).__name__}: {e}") from e
    return RolloutEngine, EngineConfig, SamplingParams


class EngineRunner:
    """One `RolloutEngine` in `mode`, driven exactly through the public API of DESIGN.md."""

    def __init__(
        self,
        mode: str,
        actor: Any,
        reward: Any,
        workload: Workload,
        args: argparse.Namespace,
        **scorers: Any,
    ) -> None:
        rollout_engine, engine_config, sampling_params = _engine_api()
        self.mode, self.device = mode, actor.device
        mode, self.threads = split_mode(mode)
        self.gpu = _gpu_sampler(actor.device)
        self.engine = None
        kv_bytes = None if args.kv_cache_gb is None else int(args.kv_cache_gb * 2**30)
        overcommit = getattr(args, "overcommit", "auto")
        # Δ applies to the overcommitting modes only (the knob rule refuses it elsewhere).
        knobs = dict(overcommit=overcommit) if mode in ("inter", "oppo") and overcommit != "auto" else {}
        if mode in ("inter", "oppo") and hasattr(args, "max_policy_lag"):
            knobs["max_policy_lag"] = args.max_policy_lag
        try:
            with _unavailable_if_not_implemented(f"{mode}: RolloutEngine"):
                self.engine = rollout_engine(
                    actor=actor,
                    reward=reward,
                    **scorers,
                    config=engine_config(
                        batch_size=args.batch_size,
                        mode=mode,
                        kv_cache_bytes=kv_bytes,
                        max_model_len=args.prompt_len_cap + args.response_len_cap,
                        **knobs,
                    ),
                    sampling=sampling_params(
                        temperature=args.temperature,
                        max_new_tokens=args.response_len_cap,
                        ignore_eos=True,
                        seed=args.seed,
                    ),
                    eos_token_id=actor.config.eos_token_id,
                )
                # seed=None: each sequence's seed derives from the default seed and its prompt index.
                per_prompt = [
                    sampling_params(
                        temperature=args.temperature, max_new_tokens=n, ignore_eos=True, seed=None
                    )
                    for n in workload.max_new_tokens
                ]
                self.engine.add_prompts(workload.prompts, sampling=per_prompt)
                # NOTE: every engine lives for the whole run; released between its steps (as for a PPO
                # update), so the arenas of several modes never hold device memory at once.
                self.engine.release_memory()
        except ModeUnavailable:
            self.close()
            raise

    def step(self, k: int) -> StepRecord:
        """One timed `engine.step()`, with the PPO loop's update and memory release outside the clock."""
        with _unavailable_if_not_implemented(f"{self.mode}: RolloutEngine"):
            t_swap = time.perf_counter()
            self.engine.resume()
            swap = time.perf_counter() - t_swap
            if self.gpu:
                self.gpu.start()
            saved_threads = torch.get_num_threads()
            if self.threads is not None:
                torch.set_num_threads(self.threads)
            try:
                _sync(self.device)
                t0 = time.perf_counter()
                result = self.engine.step()
                _sync(self.device)
                t1 = time.perf_counter()
            finally:
                torch.set_num_threads(saved_threads)
            sample = self.gpu.stop() if self.gpu else None
            total_pages = self.engine.cache_stats().total_pages
            # A PPO loop updates the policy here; retained KV is then recomputed or reused per config.
            t_swap = time.perf_counter()
            self.engine.update_policy()
            self.engine.release_memory()
            swap += time.perf_counter() - t_swap
        m = result.metrics
        metrics = dataclasses.replace(
            m, wall_s=t1 - t0, gpu_util=sample.mean_util_pct if sample else m.gpu_util
        )
        spans = [s for s in self.engine.timeline.spans() if s.end_s >= t0 and s.start_s <= t1]
        return StepRecord(self.mode, k, metrics, spans, swap, total_pages)

    def close(self) -> None:
        """Stop the GPU sampler and close the engine; safe to call twice."""
        if self.gpu:
            self.gpu.stop()
        if self.engine is not None:
            self.engine.close()
            self.engine = None
