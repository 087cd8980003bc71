"""TRL's GRPOTrainer with the engine as its rollout_func against TRL's own generation, side by side.

Two trainers on identical copies of the same tiny models (a word-level Qwen2 actor and a one-label reward
model built from configs), the same prompts and GRPO settings: ``engine`` takes its groups from a
``RolloutEngine`` (prompt prefilled once per group, reward streamed) through
``oppo_engine.integrations.trl``; ``trl`` generates with HF ``generate`` and scores with the same reward
model as a TRL reward function. They alternate for ``--rounds`` rounds of ``--steps`` optimizer steps (one
generation each), so a burst of load on a shared machine slows both alike; the first step of each is a
warm-up and not counted. Medians per step: the whole optimizer step, and its rollout (generation and
reward: ``_generate_and_score_completions``); means per step: completion tokens (the two sample different
tokens) and the actor's prompt tokens prefilled (TRL's ``generate`` prefills each of a prompt's
``num_generations`` copies, the engine each prompt once).

    python -m bench.bench_trl --rounds 3 --steps 3 --num-generations 8 --prompt-len 96

On a CPU shared with another busy process, run it with ``OMP_NUM_THREADS=1``: with one core taken, HF
``generate`` on two intra-op threads slowed down 10-25x in our runs (the engine hardly at all), which
measures the contention, not the generation.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import os
import random
import statistics
import tempfile
import time

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in trl 1.16

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    Qwen2Config,
    TrainerCallback,
)
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from oppo_engine import EngineConfig, RolloutEngine  # noqa: E402
from oppo_engine.integrations.trl import engine_reward, engine_rollout_func, sampling_params_for  # noqa: E402
from oppo_engine.ppo.task import train_tokenizer  # noqa: E402

WORDS = [f"w{i}" for i in range(200)]


class TimedGRPOTrainer(GRPOTrainer):
    """The real GRPOTrainer; records each rollout's seconds, completion tokens and actor prompt tokens
    prefilled (the engine's ``shared_tokens`` were not), and each step's seconds."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rollout_s: list[float] = []
        self.step_s: list[float] = []
        self.completion_tokens: list[int] = []
        self.prefilled_tokens: list[int] = []
        self.add_callback(_StepClock(self))

    def _generate_and_score_completions(self, inputs):
        t0 = time.perf_counter()
        batch = super()._generate_and_score_completions(inputs)
        self.rollout_s.append(time.perf_counter() - t0)
        self.completion_tokens.append(int(batch["completion_mask"].sum()))
        steps = getattr(self.rollout_func, "step_metrics", [])
        shared = sum(m.shared_tokens.get("actor", 0) for m in steps)
        self.prefilled_tokens.append(int(batch["prompt_mask"].sum()) - shared)
        return batch


class _StepClock(TrainerCallback):
    def __init__(self, trainer: TimedGRPOTrainer) -> None:
        self.trainer = trainer
        self.t0 = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer.step_s.append(time.perf_counter() - self.t0)


def build(args: argparse.Namespace):
    """Tokenizer, actor and reward model (fp32, random weights), and the prompt dataset."""
    tokenizer = train_tokenizer([" ".join(WORDS)])
    vocab = -(-len(tokenizer) // 16) * 16

    def config(**overrides) -> Qwen2Config:
        shape = dict(hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=2)
        shape.update(overrides)
        return Qwen2Config(
            vocab_size=vocab, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, **shape,
        )  # fmt: skip

    torch.manual_seed(0)
    actor = AutoModelForCausalLM.from_config(config(), dtype=torch.float32)
    reward = AutoModelForSequenceClassification.from_config(
        config(num_hidden_layers=1, num_labels=1), dtype=torch.float32
    ).eval()
    rng = random.Random(0)
    prompts = [" ".join(rng.choices(WORDS, k=args.prompt_len)) for _ in range(256)]
    return tokenizer, actor, reward, Dataset.from_dict({"prompt": prompts})


def trainers(args: argparse.Namespace, out_dir: str) -> dict[str, TimedGRPOTrainer]:
    tokenizer, actor, reward, dataset = build(args)
    grpo = GRPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=args.prompts_per_step * args.num_generations,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        max_steps=args.steps,
        report_to="none",
        use_cpu=not torch.cuda.is_available(),
        bf16=False,
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    engine_actor, trl_actor = actor, copy.deepcopy(actor)
    engine = RolloutEngine(
        actor=engine_actor,
        reward=reward,
        config=EngineConfig(
            batch_size=grpo.generation_batch_size, mode=args.mode, max_model_len=args.prompt_len + 128
        ),
        sampling=sampling_params_for(grpo, seed=0),
        eos_token_id=tokenizer.eos_token_id,
    )
    common = dict(args=grpo, train_dataset=dataset, processing_class=tokenizer)
    return {
        f"engine ({args.mode})": TimedGRPOTrainer(
            model=engine_actor,
            reward_funcs=engine_reward,
            rollout_func=engine_rollout_func(engine, grpo),
            **common,
        ),
        "trl generate": TimedGRPOTrainer(
            model=trl_actor, reward_funcs=reward, reward_processing_classes=tokenizer, **common
        ),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per trainer per round")
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--prompts-per-step", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=96, help="words (= tokens) per prompt")
    parser.add_argument("--max-completion-length", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--mode", default="intra", choices=["sequential", "intra"])
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as out_dir:
        runs = trainers(args, out_dir)
        for _ in range(args.rounds):
            for trainer in runs.values():
                with contextlib.redirect_stdout(io.StringIO()):  # the Trainer's end-of-train summary
                    trainer.train()

    print(
        f"GRPO, {args.prompts_per_step} prompts x {args.num_generations} generations per step, prompts of "
        f"{args.prompt_len} tokens, completions up to {args.max_completion_length}; "
        f"{args.rounds} rounds x {args.steps} steps, first step of each trainer not counted"
    )
    header = (
        f"{'generation':<18} {'step s':>8} {'rollout s':>10} {'completion tok':>15} {'rollout tok/s':>14} "
        f"{'prompt tok prefilled':>21}"
    )
    print(header)
    print("-" * len(header))
    for name, trainer in runs.items():
        step_s = statistics.median(trainer.step_s[1:])
        rollout_s = statistics.median(trainer.rollout_s[1:])
        tokens = statistics.mean(trainer.completion_tokens[1:])
        prefilled = statistics.mean(trainer.prefilled_tokens[1:])
        print(
            f"{name:<18} {step_s:>8.3f} {rollout_s:>10.3f} {tokens:>15.0f} {tokens / rollout_s:>14.0f} "
            f"{prefilled:>21.0f}"
        )


if __name__ == "__main__":
    main()
