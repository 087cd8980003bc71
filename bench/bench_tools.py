"""Multi-turn rollouts with a long-tailed tool: the engine's four modes against the batch-synchronous loop
that TRL-style trainers run, side by side on one seeded workload.

    python -m bench.bench_tools --steps 4

The workload: B episodes per step, each of 2-4 turns (drawn per prompt from the seed) of ``--turn-tokens``
sampled tokens; after every turn but the last, a tool answers ``--obs-tokens`` tokens after a latency drawn
lognormal (median 50 ms, sigma 1.5, capped at 3 s) per (episode, turn) from the seed; the last turn's call
answers at once that the episode is done. The same episodes, token counts and latencies in every arm:

- ``sequential`` / ``intra`` / ``inter`` / ``oppo``: ``RolloutEngine`` with the tool as its environment
  (overcommit Δ = B/2 in inter and oppo, chunk size 8 in intra and oppo), a reward model streamed or not;
- ``batch-sync``: every sequence generates its turn with HF ``generate``, then every tool call of the turn
  runs at once (threads: the turn waits for the slowest), then the next turn prefills the whole transcript
  again (as TRL's tool loop does), then the reward model scores the batch;
- ``trl-grpo``: TRL's own ``GRPOTrainer`` tool loop, on CPU where it runs: see ``trl_tool_loop``.

``--tools-task DIR`` adds a second table on the demo's tools task (``ppo/tools_task.py``, built in DIR once):
a trained tiny actor that really calls a calculator tool (the same lognormal latency, drawn per call from
its arguments), the engine's four modes with ``ToolEnv`` against TRL's own ``GRPOTrainer`` tool loop
(its ``_generate``: generation, tool calls and regeneration, no training) on the same prompts and tool.

Reported per arm: episodes per second over the measured steps (after one warm-up step), the exposed tool
time per step (the actor idle because every sequence waits on a tool: ``StepMetrics.env_wait_s``; for the
batch-synchronous loop, its tool phases), and the ratios the issue asks for.
"""

from __future__ import annotations

import argparse
import math
import random
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from oppo_engine import EngineConfig, Observation, RolloutEngine, SamplingParams
from oppo_engine.ppo import tools_task
from oppo_engine.presets import build_models

MODES = ("sequential", "intra", "inter", "oppo")
PROMPT_LEN = 16


@dataclass(frozen=True)
class Workload:
    """Episodes keyed by their prompt: how many turns, each tool call's latency, the observations."""

    seed: int
    vocab: int
    obs_tokens: int
    median_s: float = 0.05
    sigma: float = 1.5
    cap_s: float = 3.0

    def _rng(self, prompt: tuple[int, ...], *parts) -> random.Random:
        return random.Random(zlib.crc32(repr((self.seed, prompt, *parts)).encode()))

    def turns(self, prompt: tuple[int, ...]) -> int:
        return 2 + self._rng(prompt, "turns").randrange(3)

    def latency_s(self, prompt: tuple[int, ...], turn: int) -> float:
        z = self._rng(prompt, "latency", turn).gauss(0.0, 1.0)
        return min(self.cap_s, self.median_s * math.exp(self.sigma * z))

    def observation(self, prompt: tuple[int, ...], turn: int) -> list[int]:
        rng = self._rng(prompt, "obs", turn)
        return [rng.randrange(2, self.vocab) for _ in range(self.obs_tokens)]

    def answer(self, prompt: tuple[int, ...], turn: int) -> Observation:
        """The tool's answer to turn ``turn`` (1-based) of an episode, after its latency."""
        if turn >= self.turns(prompt):
            return Observation([], done=True)  # the last turn calls no tool
        time.sleep(self.latency_s(prompt, turn))
        return Observation(self.observation(prompt, turn))


class ToolEnv:
    """The workload's tool as an engine environment (one per episode)."""

    def __init__(self, work: Workload) -> None:
        self.work, self.prompt, self.turn = work, (), 0

    def reset(self, prompt_ids: list[int]) -> None:
        self.prompt = tuple(prompt_ids)

    def step(self, turn_ids: list[int]) -> Observation:
        self.turn += 1
        return self.work.answer(self.prompt, self.turn)


def prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n, PROMPT_LEN), generator=g).tolist()


class EngineArm:
    """The engine in ``mode`` on the workload; ``step()`` returns (episodes, exposed tool seconds)."""

    def __init__(self, mode, actor, reward, work, supply, args) -> None:
        knobs = {}
        if mode in ("inter", "oppo"):
            knobs.update(overcommit=args.batch_size // 2, max_policy_lag=None)
        if mode in ("intra", "oppo"):
            knobs.update(chunk_size=8)
        max_len = PROMPT_LEN + 4 * (args.turn_tokens + args.obs_tokens) + 8
        sampling = SamplingParams(
            temperature=1.0, seed=args.seed, ignore_eos=True, max_new_tokens=4 * args.turn_tokens,
            max_turn_tokens=args.turn_tokens,
        )  # fmt: skip
        self.engine = RolloutEngine(
            actor=actor, reward=reward, env=lambda: ToolEnv(work), eos_token_id=(), sampling=sampling,
            config=EngineConfig(batch_size=args.batch_size, mode=mode, max_model_len=max_len, **knobs),
        )  # fmt: skip
        self.engine.set_prompt_source(iter(supply))

    def step(self) -> tuple[int, float]:
        result = self.engine.step()
        if result.failed:
            raise RuntimeError(result.failed[0].error)
        return len(result.rollouts), result.metrics.env_wait_s

    def close(self) -> None:
        self.engine.close()


class BatchSyncArm:
    """The batch-synchronous loop: each turn of the whole batch with HF ``generate``, then its tool calls at
    once (the turn waits for the slowest), then the next turn over the whole transcript (prefilled again, as
    TRL's tool loop does); the reward model last. The exposed tool time is its tool phases."""

    def __init__(self, actor, reward, work, supply, args) -> None:
        self.actor, self.reward, self.work, self.args = actor, reward, work, args
        self.supply = iter(supply)
        self.pool = ThreadPoolExecutor(max_workers=args.batch_size)

    def step(self) -> tuple[int, float]:
        work, args = self.work, self.args
        keys = [tuple(next(self.supply)) for _ in range(args.batch_size)]
        seqs = [list(k) for k in keys]
        exposed = 0.0
        for turn in range(1, 5):
            live = [i for i, k in enumerate(keys) if work.turns(k) >= turn]
            if not live:
                break
            ids = torch.tensor([seqs[i] for i in live])  # every transcript has the same length: no padding
            with torch.inference_mode():
                out = self.actor.generate(
                    ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                    max_new_tokens=args.turn_tokens, min_new_tokens=args.turn_tokens, pad_token_id=0,
                )  # fmt: skip
            for row, i in enumerate(live):
                seqs[i] = out[row].tolist()
            t = time.perf_counter()
            answers = list(self.pool.map(lambda i: work.answer(keys[i], turn), live))  # noqa: B023
            exposed += time.perf_counter() - t
            for i, obs in zip(live, answers, strict=True):
                seqs[i] += obs.tokens
        with torch.inference_mode():
            for seq in seqs:
                self.reward(torch.tensor([seq])).logits[0, 0].item()
        return len(keys), exposed

    def close(self) -> None:
        self.pool.shutdown()


class TaskEngineArm(EngineArm):
    """The engine in ``mode`` on the tools task: ``ToolEnv`` with the task's slow calculator."""

    def __init__(self, mode, actor, tokenizer, supply, args) -> None:
        knobs = {}
        if mode in ("inter", "oppo"):
            knobs.update(overcommit=args.batch_size // 2, max_policy_lag=None)
        if mode in ("intra", "oppo"):
            knobs.update(chunk_size=8)
        turn_end = tokenizer.convert_tokens_to_ids(tools_task.TURN_END)
        self.engine = RolloutEngine(
            actor=actor, reward=tools_task.AnswerReward(tokenizer), eos_token_id=tokenizer.eos_token_id,
            env=lambda: tools_task.CalculatorEnv(tokenizer, seed=args.seed),
            config=EngineConfig(batch_size=args.batch_size, mode=mode, max_model_len=512, **knobs),
            sampling=SamplingParams(temperature=1.0, seed=args.seed, max_new_tokens=160,
                                    turn_stop_token_ids=(turn_end,), max_turns=6),
        )  # fmt: skip
        self.engine.set_prompt_source(iter(supply))


class TRLToolLoopArm:
    """TRL's own ``GRPOTrainer`` tool loop (trl 1.16, its transformers backend): ``_generate`` over the next
    B prompts generates every completion, calls every tool, regenerates with the results, until no call
    is left; the exposed tool time is its tool calls' (they run one after another)."""

    def __init__(self, actor, tokenizer, messages, args) -> None:
        import copy
        import os
        import tempfile

        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer
        from trl.chat_template_utils import qwen3_template

        tokenizer = copy.deepcopy(tokenizer)
        tokenizer.eos_token = tools_task.TURN_END  # TRL ends a turn at EOS and parses it
        tokenizer.response_template = qwen3_template  # the Qwen tool-call syntax the task's template uses
        actor = copy.deepcopy(actor)
        actor.generation_config.eos_token_id = actor.config.eos_token_id = tokenizer.eos_token_id
        self.tool_s = 0.0
        add = tools_task.slow_add(args.seed)

        def timed_add(a: int, b: int) -> int:
            """Add two integers.

            Args:
                a: the first number
                b: the second number
            """
            t = time.perf_counter()
            try:
                return add(a, b)
            finally:
                self.tool_s += time.perf_counter() - t

        timed_add.__name__ = "add"
        self._out = tempfile.TemporaryDirectory()
        grpo = GRPOConfig(
            output_dir=self._out.name, per_device_train_batch_size=args.batch_size, num_generations=4,
            max_completion_length=160, max_tool_calling_iterations=5, use_cpu=True, report_to="none",
            save_strategy="no", bf16=False, seed=args.seed, temperature=1.0,
        )  # fmt: skip
        self.trainer = GRPOTrainer(
            model=actor, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=grpo,
            train_dataset=Dataset.from_dict({"prompt": messages[: args.batch_size]}),
            processing_class=tokenizer, tools=[timed_add],
        )  # fmt: skip
        self.trainer.model.eval()
        self.messages, self.batch, self.next = messages, args.batch_size, 0

    def step(self) -> tuple[int, float]:
        import copy

        prompts = copy.deepcopy(self.messages[self.next : self.next + self.batch])
        self.next += self.batch
        # What GRPOTrainer._generate_and_score_completions sets up before it generates: each rollout's tools.
        tools = {t.__name__: t for t in self.trainer._standalone_tools}
        self.trainer._sync_tool_dicts = [dict(tools) for _ in prompts]
        self.trainer._async_tool_dicts = [{} for _ in prompts]
        before = self.tool_s
        self.trainer._generate(prompts)
        return len(prompts), self.tool_s - before

    def close(self) -> None:
        self._out.cleanup()


def tools_task_table(args) -> dict[str, dict]:
    """The engine's four modes and TRL's own tool loop on the demo's tools task (module docstring)."""
    cache = tools_task.build_tools_task(args.tools_task, seed=0)
    actor, _, _, tokenizer = tools_task.load_tools_models(cache)
    actor.eval()
    rng = random.Random(args.seed + 7)
    count = args.batch_size * (args.steps + 4)
    messages = [tools_task.prompt_messages(tools_task.operands(rng)) for _ in range(count)]
    supply = [
        tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False)
        for m in messages
    ]
    results = {m: run_arm(TaskEngineArm(m, actor, tokenizer, supply, args), args.steps) for m in MODES}
    results["trl-grpo"] = run_arm(TRLToolLoopArm(actor, tokenizer, messages, args), args.steps)
    return results


def print_table(results: dict[str, dict], base: str) -> None:
    seq = results["sequential"]
    print("| arm | episodes/s | exposed tool s/step | vs " + base + " | vs sequential |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        vs_base, vs_seq = r["episodes_s"] / results[base]["episodes_s"], r["episodes_s"] / seq["episodes_s"]
        print(f"| {name} | {r['episodes_s']:.2f} | {r['exposed_s']:.3f} | {vs_base:.2f}x | {vs_seq:.2f}x |")


def run_arm(arm, steps: int) -> dict:
    """One warm-up step, then ``steps`` measured steps back to back.

    NOTE: arms run one after the other, never interleaved: an overcommitting engine's carried tool calls go
    on in the background, and steps of another arm between its own would hand it free tool time."""
    arm.step()
    episodes, exposed = 0, 0.0
    t0 = time.perf_counter()
    for _ in range(steps):
        n, waited = arm.step()
        episodes += n
        exposed += waited
    seconds = time.perf_counter() - t0
    arm.close()
    return dict(episodes_s=episodes / seconds, exposed_s=exposed / steps, episodes=episodes, seconds=seconds)


def trl_tool_loop(args) -> str:
    """Whether TRL's own GRPOTrainer tool loop runs here, and what it does: one generation batch of a tiny
    random Qwen2 with TRL's Qwen2.5 chat template and one tool. A line for the report."""
    try:
        return _trl_tool_loop(args)
    except Exception as e:  # an optional arm: report why it did not run
        return f"did not run: {type(e).__name__}: {str(e).splitlines()[0][:200]}"


def _trl_tool_loop(args) -> str:
    import importlib.resources
    import os
    import tempfile

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import add_response_schema

    template = (importlib.resources.files("trl") / "chat_templates" / "qwen2_5.jinja").read_text()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer_bpe = trainers.BpeTrainer(
        vocab_size=600, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([template] * 10, trainer_bpe)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tokenizer.chat_template = template
    tokenizer = add_response_schema(tokenizer)
    calls = []

    def calculator(a: int, b: int) -> int:
        """Add two numbers.

        Args:
            a: the first
            b: the second
        """
        calls.append((a, b))
        time.sleep(0.05)
        return a + b

    torch.manual_seed(args.seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = AutoModelForCausalLM.from_config(config)
    with tempfile.TemporaryDirectory() as out:
        grpo = GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=args.batch_size,
            num_generations=4,
            max_completion_length=args.turn_tokens,
            max_steps=1,
            use_cpu=True,
            report_to="none",
            save_strategy="no",
            bf16=False,
            seed=args.seed,
        )
        data = Dataset.from_dict(
            {"prompt": [[{"role": "user", "content": f"what is {i} + {i}?"}] for i in range(args.batch_size)]}
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=lambda completions, **_: [0.0] * len(completions),
            args=grpo,
            train_dataset=data,
            processing_class=tokenizer,
            tools=[calculator],
        )
        t0 = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - t0
    return (
        f"ran on CPU: one GRPO step of {args.batch_size} completions in {seconds:.1f} s; a random model "
        f"made {len(calls)} tool calls (TRL calls tools only for completions that parse as tool calls, so "
        "a model must be trained to call them first; its loop generates every completion, then calls every "
        "tool, then regenerates: the batch-sync arm above)"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.bench_tools",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--batch-size", type=int, default=16, help="episodes per step (B)")
    p.add_argument("--steps", type=int, default=4, help="measured steps per arm (after one warm-up step)")
    p.add_argument("--turn-tokens", type=int, default=24, help="sampled tokens per turn")
    p.add_argument("--obs-tokens", type=int, default=12, help="tokens of each tool answer")
    p.add_argument("--preset", default="small", help="model preset (oppo_engine.presets)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads for every arm")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-trl", action="store_true", help="skip TRL's own tool loop")
    p.add_argument(
        "--tools-task", type=Path, default=None,
        help="also run the demo's tools task (built in this folder once) with TRL's own tool loop beside",
    )  # fmt: skip
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, dict]:
    """Run every arm side by side; print the table and the ratios the issue asks for."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    actor, reward = build_models(args.preset, torch.float32, torch.device("cpu"), args.seed)
    vocab = actor.config.vocab_size
    work = Workload(args.seed, vocab, args.obs_tokens)
    # Every arm draws the same episodes, in the same order (with overcommit, some return a step later).
    supply = prompts(args.batch_size * (args.steps + 4), vocab, args.seed + 1)
    results = {}
    for mode in MODES:
        results[mode] = run_arm(EngineArm(mode, actor, reward, work, supply, args), args.steps)
    results["batch-sync"] = run_arm(BatchSyncArm(actor, reward, work, supply, args), args.steps)
    lat = sorted(work.latency_s(tuple(p), k) for p in supply for k in range(1, work.turns(tuple(p))))
    print(
        f"B={args.batch_size}, {args.steps} measured steps per arm (after one warm-up step; arms one after "
        f"the other), preset {args.preset}, {args.turn_tokens} tokens a turn, {args.obs_tokens} a tool "
        "answer, torch threads "
        f"{args.threads}; tool latency p50 {lat[len(lat) // 2] * 1e3:.0f} ms, p90 "
        f"{lat[int(len(lat) * 0.9)] * 1e3:.0f} ms, max {lat[-1]:.2f} s\n"
    )
    sync, seq, oppo = results["batch-sync"], results["sequential"], results["oppo"]
    print_table(results, "batch-sync")
    exposed = oppo["exposed_s"] / seq["exposed_s"] if seq["exposed_s"] > 0 else float("nan")
    print(
        f"\noppo / batch-sync {oppo['episodes_s'] / sync['episodes_s']:.2f}x (goal >= 2.5x); oppo / "
        f"sequential {oppo['episodes_s'] / seq['episodes_s']:.2f}x (goal >= 1.5x); oppo's exposed tool time "
        f"{exposed:.0%} of sequential's (goal <= 25%)"
    )
    if args.tools_task is not None:
        task = tools_task_table(args)
        print(
            f"\nThe tools task (the demo's trained actor calling its calculator; {args.steps} measured steps "
            f"per arm, B={args.batch_size}):\n"
        )
        print_table(task, "trl-grpo")
        results["tools-task"] = task
    elif not args.no_trl:
        results["trl-grpo"] = trl_tool_loop(args)
        print(f"\nTRL's own GRPOTrainer tool loop: {results['trl-grpo']}")
    return results


if __name__ == "__main__":
    main()
