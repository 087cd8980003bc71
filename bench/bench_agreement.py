"""The engine-trainer log-prob gap on the bundled SmolLM2-135M-Instruct, fp32 and bf16 (docs/agreement.md).

    python -m bench.bench_agreement --batch-size 8 --max-new-tokens 48

The engine samples ``--batch-size`` answers (``sequential``, temperature 1); the trainer's forward is HF's,
one padded batch as ``PPOTrainer`` runs it (``core.token_logprobs``); the gap ``delta = log pi_trainer - log
pi_behaviour`` over the sampled tokens is summarised by ``ppo.agreement.measure`` (every token is of the
``fresh`` class here: one step, nothing carried).

    python -m bench.bench_agreement --ppo-steps 4 --batch-size 8 --max-new-tokens 48

With ``--ppo-steps N`` it runs ``N`` steps of ``PPOTrainer`` instead (per dtype), engine mode ``oppo`` with
a fixed overcommit of ``batch_size / 2`` and ``retained_kv="reuse"``, so that carried sequences exist: the
table is ``PPOStepStats.agreement`` per step and per token class (``fresh``, ``carried_current``, ``stale``).
The actor and the frozen reference are SmolLM2 in the dtype; the critic is a small random value model of
its vocabulary (the critic plays no part in the gap) and the reward a rule (answers near 24 tokens).
"""

from __future__ import annotations

import argparse
import os

import torch

QUESTIONS = [
    "What is the capital of France?", "Name three colours of the rainbow.", "Why is the sky blue?",
    "Write a haiku about the sea.", "What is 12 times 7?", "Give one tip for learning to code.",
    "What do bees make?", "Describe a cat in one sentence.",
]  # fmt: skip


def measure_dtype(dtype: torch.dtype, batch_size: int, max_new_tokens: int) -> dict:
    from oppo_engine import EngineConfig, RolloutEngine, SamplingParams
    from oppo_engine.ppo import agreement, core
    from oppo_engine.pretrained import load_pretrained

    model, tok = load_pretrained("smollm2-135m-instruct", dtype=dtype)
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        for q in (QUESTIONS * batch_size)[:batch_size]
    ]
    engine = RolloutEngine(
        actor=model, reward=lambda p, r: 0.0,
        config=EngineConfig(batch_size=batch_size, mode="sequential", max_model_len=512),
        sampling=SamplingParams(max_new_tokens=max_new_tokens, seed=0), eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    engine.add_prompts(prompts)
    rollouts = engine.step().rollouts
    engine.close()
    n, width = len(rollouts), max(len(r.prompt_ids) + len(r.response_ids) for r in rollouts)
    ids = torch.full((n, width), tok.pad_token_id)
    attention = torch.zeros((n, width), dtype=torch.long)
    behaviour, mask = torch.zeros(n, width - 1), torch.zeros(n, width - 1)
    for i, r in enumerate(rollouts):
        p, t = len(r.prompt_ids), len(r.response_ids)
        ids[i, : p + t] = torch.tensor(r.prompt_ids + r.response_ids)
        attention[i, : p + t] = 1
        behaviour[i, p - 1 : p - 1 + t] = torch.tensor(r.logprobs)
        mask[i, p - 1 : p - 1 + t] = 1
    with torch.no_grad():
        trainer = core.token_logprobs(model, ids, attention, 1.0)
    none = torch.zeros_like(mask, dtype=torch.bool)
    return agreement.measure(trainer, behaviour, mask, none, torch.zeros(n, dtype=torch.bool))["fresh"]


def ppo_agreement(dtype: torch.dtype, batch_size: int, max_new_tokens: int, steps: int) -> list:
    """``[(step, stats)]`` of ``steps`` PPO steps on SmolLM2 in ``dtype`` under ``oppo`` (see the module)."""
    import copy

    from transformers import AutoModelForSequenceClassification, LlamaConfig

    from oppo_engine.ppo import PPOConfig, PPOTrainer, engine_config_for
    from oppo_engine.pretrained import load_pretrained

    actor, tok = load_pretrained("smollm2-135m-instruct", dtype=dtype)
    actor.train()
    reference = copy.deepcopy(actor).eval()
    torch.manual_seed(0)
    small = LlamaConfig(
        vocab_size=actor.config.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    critic = AutoModelForSequenceClassification.from_config(small, dtype=dtype).train()
    prompts = [
        list(
            tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)["input_ids"]
        )
        for q in QUESTIONS
    ]
    cfg = PPOConfig(
        batch_size=batch_size, minibatch_size=max(1, batch_size // 2), epochs=1, lr=1e-5,
        max_new_tokens=max_new_tokens, seed=0,
    )  # fmt: skip
    engine_config = engine_config_for(
        cfg, mode="oppo", overcommit=max(1, batch_size // 2), retained_kv="reuse", max_model_len=512
    )
    trainer = PPOTrainer(
        actor, critic, reference, lambda p, r: -abs(len(r) - 24) / 24, tok, prompts, cfg, engine_config
    )
    out = []
    try:
        for _ in range(steps):
            stats = trainer.step()
            out.append((stats.step, stats))
    finally:
        trainer.close()
    return out


def _ppo_table(args) -> None:
    print(
        "| dtype | step | class | tokens | mean abs delta | max abs delta | mean k3 | frac > 0.1 "
        "| std of seq sum |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for dtype in (torch.float32, torch.bfloat16):
        for step, stats in ppo_agreement(dtype, args.batch_size, args.max_new_tokens, args.ppo_steps):
            for name, a in stats.agreement.items():
                print(
                    f"| {str(dtype).removeprefix('torch.')} | {step} | {name} | {a.tokens} | "
                    f"{a.mean_abs:.2e} | {a.max_abs:.2e} | {a.mean_k3:.2e} | {a.frac_large:.3f} | "
                    f"{a.seq_sum_std:.2e} |",
                    flush=True,
                )
    print(f"load {os.getloadavg()[0]:.2f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--ppo-steps", type=int, default=0, help="PPO steps under oppo (0: one engine step)")
    args = parser.parse_args(argv)
    if args.ppo_steps:
        _ppo_table(args)
        return
    print("| dtype | tokens | mean abs delta | max abs delta | mean k3 | frac > 0.1 | std of seq sum |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for dtype in (torch.float32, torch.bfloat16):
        a = measure_dtype(dtype, args.batch_size, args.max_new_tokens)
        print(
            f"| {str(dtype).removeprefix('torch.')} | {a.tokens} | {a.mean_abs:.2e} | {a.max_abs:.2e} | "
            f"{a.mean_k3:.2e} | {a.frac_large:.3f} | {a.seq_sum_std:.2e} |"
        )
    print(f"load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
