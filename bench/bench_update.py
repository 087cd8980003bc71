"""The PPO update alone, padded against packed, on one fixed batch: s/update, losses and peak memory.

    python -m bench.bench_update --workload demo --rounds 5
    python -m bench.bench_update --workload smollm2 --layers 4 --rounds 5
    python -m bench.bench_update --workload smollm2 --layers 8 --memory-only --budget 528 2048

Arms: ``padded`` (one padded forward per minibatch of random rows, ``group_by_length=False``),
``grouped`` (padded, rows of similar length together), ``packed`` (``max_tokens_per_microbatch``, each pack's
attention over transformers' dense ``T x T`` mask: ``pack_attention="dense"``) and ``packed-batched`` (the
same budget, each pack's attention one batched causal call over its sequences, packs of similar lengths:
``pack_attention="batched"``). Every
arm updates the same batch from the same weights and optimizer state (restored before each timed update,
outside the timing), so their losses must agree to rounding, and that is printed. The arms are
interleaved round by round and each figure is the minimum over the rounds, with ``os.getloadavg()``
beside it; the process's CPU time (``time.process_time()``, all its threads) is reported beside the wall
time, being less sensitive to other processes on a shared machine.
Peak memory: ``ru_maxrss`` of a fresh subprocess per arm that builds the same trainer and runs
one update (so it includes the models and the engine, the same for every arm); each subprocess also reports
its peak after the build, before the update, and the one update's (cold) time. ``--memory-only`` runs just
these subprocesses, one after another, the parent building nothing (so two processes never hold a model at
once). Several ``--budget`` values make one arm per budget of each packed arm (``packed@528``,
``packed-batched@528``, ``packed@2048``, ...).

Workloads (B=64 rollouts, minibatches of 8, one epoch):

- ``demo``: the demo's embedded task and models (``ppo/task.py``), one batch of real rollouts of its
  trained actor (up to 192 new tokens, its long-tailed lengths).
- ``smollm2``: a random model of SmolLM2-135M's shape (Llama layout, hidden 576, 9 heads, 3 KV heads,
  vocab 49152, tied embeddings; ``--layers`` of its 30), and a synthetic batch: prompts of 16 tokens,
  response lengths lognormal (sigma 1, mean ~110, capped at 512).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import resource
import subprocess
import sys
import time

import torch

# Every arm sets every option the arms vary: the arms share one trainer, so an option an arm left out
# would keep the previous arm's value (before 2026-12-05, `padded` and `grouped` after a `packed` run kept
# its budget and ran packed).
ARMS = {
    "padded": dict(group_by_length=False, max_tokens_per_microbatch=None, pack_attention="auto"),
    "grouped": dict(group_by_length=True, max_tokens_per_microbatch=None, pack_attention="auto"),
    # The packed arms' budget: per workload.
    "packed": dict(group_by_length=False, max_tokens_per_microbatch=None, pack_attention="dense"),
    "packed-batched": dict(group_by_length=False, max_tokens_per_microbatch=None, pack_attention="batched"),
}
BATCH, MINIBATCH = 64, 8


def layer_macs(batch, budgets: list[int], seed: int = 0) -> dict:
    """A model, not a measurement: multiply-adds of one SmolLM2-shape decoder layer over one update of
    ``batch`` per arm (actor and critic forward and backward, counted 3x a forward, plus the actor's no-grad
    agreement forward), ``padded`` (random minibatches of 8, as ``PPOTrainer`` draws them at step 0 with
    ``seed``; sdpa over each row's padded ``w x w``), ``packed`` at each budget (first-fit decreasing packs,
    each pack's dense ``T x T`` mask) and ``packed-batched`` (length-sorted packs, each bucket of a pack's
    sequences a padded batch ``n x L x L``, ``L`` its longest; ``pack_attention.bucket_lengths``). Squares
    are counted whole, causal or not. The projections and MLP cost 3,538,944 multiply-adds a position,
    attention 2 x 576 per (query, key) pair."""
    from oppo_engine.ppo.pack_attention import bucket_lengths
    from oppo_engine.ppo.packing import plan_packs, plan_sorted_packs

    gemm, pair = 576 * 576 * 2 + 576 * 192 * 2 + 3 * 576 * 1536, 2 * 576
    lengths = batch.attention_mask.sum(1)
    minibatches = list(
        torch.randperm(len(lengths), generator=torch.Generator().manual_seed(seed * 1_000_003)).split(8)
    )

    def squares(g) -> int:
        """(query, key) pairs of the padded batches of the buckets of the pack of rows ``g``."""
        lens = lengths[g].tolist()
        return sum(len(b) * max(lens[i] for i in b) ** 2 for b in bucket_lengths(lens))

    def cost(groups, packed: bool, batched: bool = False) -> float:
        """Multiply-adds of forwards over ``groups`` of rows: one pack each (its attention over the dense
        mask, or ``batched`` over its buckets' padded batches), or one padded batch each."""
        total = 0
        for g in groups:
            w = int(lengths[g].max())
            n = int(lengths[g].sum()) if packed else len(g) * w
            pairs = (squares(g) if batched else n * n) if packed else len(g) * w * w
            total += n * gemm + pairs * pair
        return total

    chunks = list(torch.argsort(lengths, stable=True).split(8))  # the padded agreement forward's chunks
    gmac = (6 * cost(minibatches, False) + cost(chunks, False)) / 1e9
    out = {"padded": dict(forwards=len(minibatches), gmac=gmac)}
    for b in budgets:
        packs = [mb[torch.tensor(p)] for mb in minibatches for p in plan_packs(lengths[mb].tolist(), b)]
        whole = [torch.tensor(p) for p in plan_packs(lengths.tolist(), b)]
        attention = sum(int(lengths[p].sum()) ** 2 * pair for p in packs) / cost(packs, True)
        gmac = (6 * cost(packs, True) + cost(whole, True)) / 1e9
        out[f"packed@{b}"] = dict(forwards=len(packs), gmac=gmac, attention=attention)
        plan = plan_sorted_packs
        packs = [mb[torch.tensor(p)] for mb in minibatches for p in plan(lengths[mb].tolist(), b)]
        whole = [torch.tensor(p) for p in plan(lengths.tolist(), b)]
        attention = sum(squares(p) * pair for p in packs) / cost(packs, True, True)
        gmac = (6 * cost(packs, True, True) + cost(whole, True, True)) / 1e9
        out[f"packed-batched@{b}"] = dict(forwards=len(packs), gmac=gmac, attention=attention)
    return out


def _tokenizer(vocab: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(64)}, unk_token="t1"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t2", pad_token="t0")


def smollm2_config(layers: int, num_labels: int | None = None):
    """SmolLM2-135M's shape (its config.json), with ``layers`` of its 30 decoder layers."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    if num_labels is not None:
        config.num_labels = num_labels
    return config


def synthetic_batch(n: int, seed: int, vocab: int, cap: int = 512, mean: float = 110.0, sigma: float = 1.0):
    """Rollouts with prompts of 16 tokens and lognormal response lengths (``mean``, ``sigma``, <= cap)."""
    from oppo_engine.sched.results import Rollout

    g = torch.Generator().manual_seed(seed)
    mu = math.log(mean) - sigma**2 / 2
    lengths = (torch.randn(n, generator=g) * sigma + mu).exp().round().clamp(1, cap).long().tolist()
    uniform = -math.log(vocab)
    rollouts = []
    for i, t in enumerate(lengths):
        response = torch.randint(3, vocab, (t,), generator=g).tolist()
        rollouts.append(
            Rollout(
                prompt_ids=torch.randint(3, vocab, (16,), generator=g).tolist(), response_ids=response,
                logprobs=[uniform] * t, reward=float(torch.randn(1, generator=g)), policy_versions=[0] * t,
                deferred_steps=0, ref_logprobs=[uniform] * t, values=[0.0] * t, group_id=i,
            )
        )  # fmt: skip
    return rollouts


def build(workload: str, layers: int, cache: str):
    """``(trainer, batch, budget)`` for ``workload``: the trainer built for the ``padded`` arm."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from oppo_engine.ppo import PPOConfig, PPOTrainer, engine_config_for
    from oppo_engine.ppo.batch import canonical_order, collate

    if workload == "demo":
        from pathlib import Path

        from oppo_engine.ppo.demo import _prompts
        from oppo_engine.ppo.models import load_models
        from oppo_engine.ppo.task import MAX_NEW_TOKENS, build_task

        task = build_task(Path(cache), log=lambda _: None)
        m = load_models(task / "actor", task / "reward")
        cfg = PPOConfig(
            batch_size=BATCH, minibatch_size=MINIBATCH, epochs=1, lr=2e-4, critic_lr=2e-4,
            max_new_tokens=MAX_NEW_TOKENS,
        )  # fmt: skip
        trainer = PPOTrainer(
            m.actor, m.critic, m.reference, m.reward, m.tokenizer, _prompts(m.tokenizer), cfg,
            engine_config_for(cfg, mode="sequential", max_model_len=512),
        )  # fmt: skip
        rollouts = trainer.engine.step().rollouts
        return trainer, collate(canonical_order(rollouts), m.tokenizer.pad_token_id, "cpu"), 512
    torch.manual_seed(0)
    dtype = torch.bfloat16
    actor = AutoModelForCausalLM.from_config(smollm2_config(layers), dtype=dtype).train()
    reference = copy.deepcopy(actor).eval().requires_grad_(False)
    critic = AutoModelForSequenceClassification.from_config(smollm2_config(layers, 1), dtype=dtype).train()
    cfg = PPOConfig(batch_size=BATCH, minibatch_size=MINIBATCH, epochs=1, max_new_tokens=512)
    trainer = PPOTrainer(
        actor, critic, reference, lambda p, r: 0.0, _tokenizer(49152), [[5] * 16], cfg,
        engine_config_for(cfg, mode="sequential", max_model_len=528, kv_cache_bytes=64 << 20),
    )  # fmt: skip
    batch = collate(canonical_order(synthetic_batch(BATCH, 0, 49152)), 0, "cpu")
    return trainer, batch, 528


def _configure(trainer, arm: str, budget: int) -> None:
    settings = dict(ARMS[arm])
    if arm.startswith("packed"):
        settings["max_tokens_per_microbatch"] = budget
    for name, value in settings.items():
        setattr(trainer.config, name, value)


def _snapshot(trainer) -> dict:
    parts = dict(actor=trainer.actor, critic=trainer.critic)
    parts.update(actor_optim=trainer.actor_optim, critic_optim=trainer.critic_optim)
    return copy.deepcopy({name: part.state_dict() for name, part in parts.items()})


def _restore(trainer, state: dict) -> None:
    trainer.actor.load_state_dict(state["actor"])
    trainer.critic.load_state_dict(state["critic"])
    trainer.actor_optim.load_state_dict(state["actor_optim"])
    trainer.critic_optim.load_state_dict(state["critic_optim"])


class PartTimer:
    """Wall time of an update's parts, by wrapping what ``PPOTrainer._update`` calls: the grad-enabled
    forwards (``_forward``), ``Tensor.backward``, the optimizer (both models' ``step`` and ``zero_grad``,
    and the gradient clipping). The agreement forward is ``_update``'s own ``agreement_s``; the rest
    (advantages, losses, bookkeeping) is what is left of the update's wall time."""

    PARTS = ("forward", "backward", "optimizer")

    def __init__(self, trainer) -> None:
        self.trainer = trainer
        self.s = dict.fromkeys(self.PARTS, 0.0)  # wall
        self.cpu_s = dict.fromkeys(self.PARTS, 0.0)  # process CPU time (all threads)
        self.forwards = 0

    def _timed(self, part: str, fn, only_with_grad: bool = False):
        def wrapper(*args, **kwargs):
            if only_with_grad and not torch.is_grad_enabled():
                return fn(*args, **kwargs)
            t, cpu = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.s[part] += time.perf_counter() - t
                self.cpu_s[part] += time.process_time() - cpu
                self.forwards += part == "forward"

        return wrapper

    def __enter__(self) -> PartTimer:
        t = self.trainer
        self._saved = [(torch.Tensor, "backward", torch.Tensor.backward),
                       (torch.nn.utils, "clip_grad_norm_", torch.nn.utils.clip_grad_norm_)]  # fmt: skip
        torch.Tensor.backward = self._timed("backward", torch.Tensor.backward)
        torch.nn.utils.clip_grad_norm_ = self._timed("optimizer", torch.nn.utils.clip_grad_norm_)
        vars(t)["_forward"] = self._timed("forward", t._forward, only_with_grad=True)
        for optim in (t.actor_optim, t.critic_optim):
            for name in ("step", "zero_grad"):
                vars(optim)[name] = self._timed("optimizer", getattr(optim, name))
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, fn in self._saved:
            setattr(owner, name, fn)
        vars(self.trainer).pop("_forward")
        for optim in (self.trainer.actor_optim, self.trainer.critic_optim):
            vars(optim).pop("step")
            vars(optim).pop("zero_grad")


def timed_update(trainer, batch) -> dict:
    with PartTimer(trainer) as parts:
        t, cpu = time.perf_counter(), time.process_time()
        stats = trainer._update(batch)
        wall = time.perf_counter() - t
    measured = sum(parts.s.values()) + stats["agreement_s"]
    return dict(
        update_s=wall, cpu_s=time.process_time() - cpu, agreement_s=stats["agreement_s"],
        **{f"{k}_s": v for k, v in parts.s.items()}, other_s=wall - measured, forwards=parts.forwards,
        **{f"{k}_cpu_s": v for k, v in parts.cpu_s.items()},
        policy_loss=stats["policy_loss"],
        value_loss=stats["value_loss"], grad_norm=stats["grad_norm"], load=os.getloadavg()[0],
    )  # fmt: skip


def _parts(run: dict) -> str:
    """An update's parts, as measured by ``PartTimer``."""
    names = ("agreement", *PartTimer.PARTS, "other")
    cpu = "/".join(f"{run[n + '_cpu_s']:.2f}" for n in PartTimer.PARTS)
    return (
        ", ".join(f"{n} {run[n + '_s']:.2f}" for n in names)
        + f" ({run['forwards']} forwards; CPU s of {'/'.join(PartTimer.PARTS)}: {cpu})"
    )


def expand_arms(names: list[str], budgets: list[int] | None) -> list[tuple[str, str, int | None]]:
    """``(label, arm, budget)`` of each arm to run: each packed arm once per budget (labelled ``packed@B``,
    ``packed-batched@B`` when there are several; ``None``: the workload's default), the others once."""
    budgets = budgets or [None]
    out = []
    for arm in names:
        if not arm.startswith("packed"):
            out.append((arm, arm, None))
            continue
        for b in budgets:
            out.append((f"{arm}@{b}" if len(budgets) > 1 else arm, arm, b))
    return out


def _rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def memory_of(arm: str, budget: int | None, args) -> dict:
    """A fresh process that builds the trainer and runs one ``arm`` update: its peak resident memory (GiB,
    ``ru_maxrss``) after the build and at the end, the update's wall and CPU time (cold: its first), the
    load after it."""
    cmd = [sys.executable, "-m", "bench.bench_update", "--workload", args.workload, "--layers",
           str(args.layers), "--cache", args.cache, "--memory-arm", arm,
           "--threads", str(args.threads or 0), "--budget", str(budget or 0)]  # fmt: skip
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=3600).stdout
    return json.loads(out.strip().splitlines()[-1])


def memory_only(args) -> dict:
    """``--memory-only``: one fresh process per arm (one after another), a table of their peaks."""
    print(
        f"{args.workload}: peak memory per arm, one fresh process each (build + one update)"
        + (f", {args.layers} layers (bf16)" if args.workload == "smollm2" else " (fp32)")
        + f"; load before {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    print(
        "| arm | peak RSS GiB (ru_maxrss) | after build GiB | update's increase GiB | update s (cold) "
        "| CPU s | load |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |", flush=True)
    out = {}
    for label, arm, budget in expand_arms(args.arms, args.budget):
        m = out[label] = memory_of(arm, budget, args)
        print(
            f"| {label} | {m['maxrss_gib']:.2f} | {m['build_maxrss_gib']:.2f} | "
            f"{m['maxrss_gib'] - m['build_maxrss_gib']:.2f} | {m['update_s']:.1f} | {m['cpu_s']:.1f} | "
            f"{m['load']:.2f} |",
            flush=True,
        )
    return out


def main(argv: list[str] | None = None) -> dict:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=fmt)
    parser.add_argument("--workload", choices=("demo", "smollm2"), default="demo")
    parser.add_argument("--layers", type=int, default=30, help="smollm2: decoder layers (of 30)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cache", default=".cache/demo_task")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--no-memory", action="store_true", help="skip the per-arm memory subprocesses")
    parser.add_argument("--no-warmup", action="store_true", help="skip the untimed update of each arm")
    parser.add_argument("--budget", type=int, nargs="+", default=None, help="packed arms: "
                        "max_tokens_per_microbatch, one arm per value and packed arm (default: the longest "
                        "sequence the workload allows)")  # fmt: skip
    parser.add_argument("--arms", nargs="+", choices=tuple(ARMS), default=list(ARMS))
    parser.add_argument("--memory-only", action="store_true", help="only the per-arm memory subprocesses")
    parser.add_argument("--macs", action="store_true", help="smollm2: only the per-layer multiply-add model")
    parser.add_argument("--memory-arm", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_only:
        return memory_only(args)
    if args.macs:
        from oppo_engine.ppo.batch import canonical_order, collate

        batch = collate(canonical_order(synthetic_batch(BATCH, 0, 49152)), 0, "cpu")
        macs = layer_macs(batch, args.budget or [528, 1024, 2048])
        for arm, m in macs.items():
            print(f"{arm}: {m['forwards']} forwards, {m['gmac']:.1f} GMAC per decoder layer per update, "
                  f"padded/this {macs['padded']['gmac'] / m['gmac']:.2f}x"
                  + (f", attention {m['attention']:.1%}" if "attention" in m else ""))  # fmt: skip
        return macs
    trainer, batch, default_budget = build(args.workload, args.layers, args.cache)
    if args.memory_arm:
        build_peak = _rss_gib()
        _configure(trainer, args.memory_arm, (args.budget or [0])[0] or default_budget)
        t, cpu = time.perf_counter(), time.process_time()
        trainer._update(batch)
        wall, cpu = time.perf_counter() - t, time.process_time() - cpu
        print(json.dumps(dict(maxrss_gib=_rss_gib(), build_maxrss_gib=build_peak, update_s=wall, cpu_s=cpu,
                              load=os.getloadavg()[0])))  # fmt: skip
        return {}
    arms = {label: (arm, b or default_budget) for label, arm, b in expand_arms(args.arms, args.budget)}
    budget = ", ".join(sorted({str(b) for a, b in arms.values() if a.startswith("packed")})) or "-"
    lengths = batch.attention_mask.sum(1)
    print(
        f"{args.workload}: B={len(batch)}, minibatch {MINIBATCH}, {int(lengths.sum())} tokens, lengths "
        f"mean {lengths.float().mean():.1f} max {int(lengths.max())}, packs of <= {budget} tokens"
        + (f", {args.layers} layers (bf16)" if args.workload == "smollm2" else " (fp32)")
        + f", {torch.get_num_threads()} threads"
    )
    state = _snapshot(trainer)
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    for arm, b in [] if args.no_warmup else arms.values():  # warm-up, untimed
        _configure(trainer, arm, b)
        _restore(trainer, state)
        trainer._update(batch)
    for r in range(args.rounds):
        for arm, (kind, b) in arms.items():
            _configure(trainer, kind, b)
            _restore(trainer, state)
            runs[arm].append(timed_update(trainer, batch))
            last = runs[arm][-1]
            print(
                f"  round {r}: {arm:14s} {last['update_s']:.3f} s, CPU {last['cpu_s']:.3f} s "
                f"(load {last['load']:.2f}); " + _parts(last),
                flush=True,
            )
    trainer.close()
    del trainer, state  # the memory subprocesses below must not run beside this process's models
    gc.collect()
    memory = {
        arm: math.nan if args.no_memory else memory_of(kind, b, args)["maxrss_gib"]
        for arm, (kind, b) in arms.items()
    }
    best = {arm: min(rs, key=lambda x: x["update_s"]) for arm, rs in runs.items()}
    cpu = {arm: min(r["cpu_s"] for r in rs) for arm, rs in runs.items()}
    print(
        f"| arm | update s (min of {args.rounds}) | load | agreement forward s | vs padded "
        "| process CPU s (min) | vs padded (CPU) | peak RSS GiB |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    base = best.get("padded", {}).get("update_s", math.nan)
    for arm, b in best.items():
        print(
            f"| {arm} | {b['update_s']:.3f} | {b['load']:.2f} | {b['agreement_s']:.3f} | "
            f"{base / b['update_s']:.2f}x | {cpu[arm]:.3f} | {cpu.get('padded', math.nan) / cpu[arm]:.2f}x "
            f"| {memory[arm]:.2f} |"
        )
    print("parts of each arm's fastest update (wall s):")
    for arm, b in best.items():
        print(f"  {arm:14s} " + _parts(b))
    losses = {
        arm: (rs[0]["policy_loss"], rs[0]["value_loss"], rs[0]["grad_norm"]) for arm, rs in runs.items()
    }
    diffs = {
        arm: max(abs(a - b) for a, b in zip(losses[arm], losses["padded"], strict=True))
        for arm in losses
        if arm.startswith("packed") and "padded" in losses
    }
    print(
        f"policy loss, value loss, grad norm per arm: {losses}; max |difference| against padded: "
        + (", ".join(f"{arm} {d:.2e}" for arm, d in diffs.items()) or "-")
    )
    # With one arm (--arms), this process is a fresh process of that arm: its peak is that arm's.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"this process's peak RSS (ru_maxrss): {peak:.2f} GiB; load {os.getloadavg()}")
    return {"best": best, "memory": memory, "losses": losses}


if __name__ == "__main__":
    main()
