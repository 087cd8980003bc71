"""``oppo-engine demo``: the same PPO run on the embedded task (or given models) in several engine modes,
side by side -- the paper's ablation: time to reward, s/step, the controllers' choices, reward curves and
one step's lane trace per mode.

The engine settings are explicit (not the engine's defaults, which other work may move): overcommit
``Δ = batch_size / 2`` sequences, chunk size chosen online (``"auto"``, the "off" arm included), and a
sequence deferred at most ``max_deferrals = 2`` times under ``max_policy_lag = 2`` (the engine's default),
so it spans at most 3 steps; ``max_policy_lag=None`` with more deferrals shows what the bound costs. Every
mode shares the prompts' common prefix across prompts (``share_prompt_prefix=True``, the engine's default:
the math prompts' first 102 tokens, a chat template's system turn and a worked example, are computed once
per model and step).

``--task tools`` runs the embedded tools task instead (``ppo/tools_task.py``): multi-turn episodes in which
the policy calls a calculator whose latency is long-tailed, rewarded for the right final answer. Its modes
run one after the other, not interleaved: an overcommitting engine's tool calls go on in the background, and
another mode's steps between its own would hand it free tool time.

``--task math`` trains a real pretrained chat model (``--actor``: a bundled name, a local folder or a
``.gguf`` file; the bundled SmolLM2-135M-Instruct by default) on arithmetic word problems scored by a rule
(``ppo/math_task.py``): no reward model (``--reward`` is refused), the critic a value head on the actor's
backbone, the reference a frozen copy. Each step records the batch's accuracy (right final number), the
unparsed answers and the share cut off; greedy held-out accuracy is measured before the run and after
each mode's (``heldout`` problems, outside the timed steps). Its modes run one after the other, as the tools
task's do, so that only one mode's models are in memory at a time (``run_modes``). It is the command line's
default task (``oppo-engine demo``, ``make demo``), with the settings of a measured learning curve
(``MATH_DEFAULTS``, ``ppo_config``; docs/benchmarks.md, "The math task's learning curve"): one-operation
problems, B=32 in minibatches of 8, actor lr 5e-6, GAE λ 1, truncated importance sampling against the
trainer's own log-probs, the update under bf16 autocast over fp32 weights, 18 steps of ``sequential`` and
``oppo``.
"""

from __future__ import annotations

import copy
import gc
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from oppo_engine.config import MODES
from oppo_engine.ppo import math_task, ranks, tools_task
from oppo_engine.ppo.config import PPOConfig
from oppo_engine.ppo.models import load_models
from oppo_engine.ppo.report import ModeRun, StepRecord, agreement_fields, format_table, plot, records_json
from oppo_engine.ppo.task import MAX_NEW_TOKENS, TOPICS, broken_rules, build_task, is_polite, prompts
from oppo_engine.ppo.trainer import PPOTrainer, engine_config_for

DEMO_MODES = ("sequential", "intra", "inter", "oppo")
MAX_DEFERRALS = 2  # a sequence spans at most 3 steps


@dataclass(slots=True)
class DemoOptions:
    steps: int = 30
    modes: tuple[str, ...] = DEMO_MODES
    out: Path = Path("demo_out")
    cache: Path = Path(".cache/demo_task")
    device: str = "cpu"
    actor: Path | None = None
    reward: Path | None = None
    batch_size: int = 32
    max_new_tokens: int = MAX_NEW_TOKENS
    seed: int = 0
    overcommit: int | None = None  # None: batch_size // 2
    max_deferrals: int = MAX_DEFERRALS
    max_policy_lag: int | None = 2  # the engine's default (the front-door issue); None: max_deferrals only
    max_model_len: int = 512
    # torch intra-op threads for the run: the tiny models gain nothing from more, and on a shared CPU two
    # threads collapse when a core is taken (a mode would be slowed by the load, not by its pipeline)
    threads: int = 1
    trace_step: int | None = None  # the step whose lanes are traced (default: the middle one)
    fsdp: bool = False  # one data-parallel rank of a torchrun job (cli.py: demo_on_ranks)
    task: str = "polite"  # "polite" (ppo/task.py), "tools" (ppo/tools_task.py) or "math" (ppo/math_task.py)
    heldout: int = math_task.HELDOUT  # --task math: held-out problems evaluated before and after (0: none)
    # --task math: the problems' operation counts (training and held-out alike), and whether the update
    # (the trainer's forward and backward) runs under bf16 autocast, its weights and AdamW staying fp32
    math_operations: tuple[int, int] = (1, 1)
    bf16_update: bool = True
    # --task math: the dtype the engine rolls out in. "bf16": bf16 replicas of the fp32 actor and critic
    # (``EngineConfig.rollout_dtype``, refreshed by ``update_policy()``) and the frozen reference cast to
    # bf16 (fp32 master weights, a bf16 rollout copy, as issue 35 asks); "fp32": the trainer's own weights.
    # Held-out evaluation stays fp32 either way; other tasks ignore it. Three runs of the defaults
    # (docs/benchmarks.md, "The math demo"): the whole run 23:46 in bf16 against 29:37 in fp32 on the same
    # quiet machine, and held-out gains of +27.0 / +13.5 points (sequential / oppo) in bf16 against
    # +5.5 / +24.0 and +24.5 / +27.0 in fp32: the spread of 12 PPO steps, not the dtype, decides the +20 goal.
    rollout_dtype: str = "bf16"


TASKS = ("polite", "tools", "math")
ROLLOUT_DTYPES = ("fp32", "bf16")  # --rollout-dtype (--task math)
MATH_MODEL = "smollm2-135m-instruct"  # --task math without --actor
# --task math's defaults where the command line gives none (the CLI's default task). Measured on 2 CPU cores
# (bench/math_curve.py, run D in docs/benchmarks.md): at B=32 greedy held-out accuracy rose 41% -> 64% in 12
# steps (B=16 plateaued near 55%); at T=1.0 a third of SmolLM2's answers run past 128 tokens, at T=0.7 with
# the worked example at most 1 of 32. Two modes, one after the other: the ablation's base and the engine's.
# 18 steps, not 12: with the update's autocast fixed (2026-12-06: its later minibatches had run on the
# update's start weights), 12 steps took held-out accuracy +18.5 / +9.5 (sequential / oppo) in 9 min 36 s,
# 18 steps +23.5 / +23.0 in 13 min 12 s (docs/benchmarks.md, "The math demo"; the budget: 10
# minutes, up to 15 when +20 points needs more steps).
MATH_DEFAULTS = dict(batch_size=32, max_new_tokens=128, threads=2, steps=18, modes=("sequential", "oppo"))
MATH_TEMPERATURE = 0.7
MATH_TRAIN_PROBLEMS = 1024


def ppo_config(opts: DemoOptions) -> PPOConfig:
    if opts.task == "math":
        # A pretrained 135M model, full fine-tuning at a small learning rate (run D: 1e-5 ran away, KL 4.1
        # nats in 4 steps; 2e-6 barely moved). GAE's λ = 1: the advantage is the return minus the value, not
        # a chain of a young critic's differences. The engine's bf16-replica and the trainer's log-probs
        # differ (docs/agreement.md): the loss is reweighted by their ratio, truncated (TIS).
        # The update runs on padded minibatches of rows of like length (``group_by_length``), not on packs:
        # on this task's own batch (a 149-156-token prompt, ~33 sampled tokens a row) one update took 41 s
        # grouped against 66 s packed at 2,048 tokens (bf16 autocast, 2 threads, load 2; docs/benchmarks.md,
        # "The math demo"). Either way the LM head and its log-softmax over the 49,152-token vocabulary run
        # on the sampled tokens alone, not on the prompt's.
        return PPOConfig(
            batch_size=opts.batch_size, minibatch_size=max(1, opts.batch_size // 4), epochs=1,
            group_by_length=True, lr=5e-6, critic_lr=2e-5, kl_coef=0.02, lam=1.0,
            rollout_correction="tis", temperature=MATH_TEMPERATURE, max_new_tokens=opts.max_new_tokens,
            seed=opts.seed,
        )  # fmt: skip
    return PPOConfig(
        batch_size=opts.batch_size,
        # Four optimizer steps per PPO step, on minibatches of similar lengths: under the long tail a random
        # minibatch is mostly padding, and the update would dwarf the rollout the engine speeds up.
        minibatch_size=max(1, opts.batch_size // 4),
        epochs=1,
        group_by_length=True,
        lr=2e-4,
        critic_lr=2e-4,
        kl_coef=0.05,
        max_new_tokens=opts.max_new_tokens,
        seed=opts.seed,
    )


def _prompts(tokenizer) -> list[list[int]]:
    return [tokenizer(p)["input_ids"] for p in prompts()]


def engine_overrides(mode: str, opts: DemoOptions) -> dict:
    """The demo's engine settings for ``mode`` (explicit, see the module docstring)."""
    overrides: dict = {"mode": mode, "max_model_len": opts.max_model_len, "share_prompt_prefix": True}
    if mode in ("inter", "oppo"):
        delta = opts.overcommit if opts.overcommit is not None else opts.batch_size // 2
        overrides.update(
            overcommit=delta, max_deferrals=opts.max_deferrals, max_policy_lag=opts.max_policy_lag
        )
    return overrides


TOOLS_MAX_TURNS = 6  # a sum of 4 numbers takes 4 turns: room for a detour, not for a loop


def make_trainer(mode: str, opts: DemoOptions, actor_path: Path, reward_path: Path) -> PPOTrainer:
    """A trainer on fresh copies of the models, its engine in ``mode`` (NotImplementedError if the engine
    does not have that mode)."""
    torch.manual_seed(opts.seed)
    if opts.task == "tools":
        return _tools_trainer(mode, opts, actor_path)
    if opts.task == "math":
        return _math_trainer(mode, opts, actor_path)
    models = load_models(actor_path, reward_path, opts.device)
    group = ranks.shard_trainer_models(models) if opts.fsdp else None
    cfg = ppo_config(opts)
    return PPOTrainer(
        models.actor,
        models.critic,
        models.reference,
        models.reward,
        models.tokenizer,
        _prompts(models.tokenizer),
        cfg,
        engine_config_for(cfg, **engine_overrides(mode, opts)),
        process_group=group,
    )


def _tools_trainer(mode: str, opts: DemoOptions, cache: Path) -> PPOTrainer:
    """PPO on the tools task: the answer reward, one calculator environment per episode."""
    actor, critic, reference, tokenizer = tools_task.load_tools_models(cache, opts.device)
    cfg = ppo_config(opts)
    turn_end = tokenizer.convert_tokens_to_ids(tools_task.TURN_END)
    return PPOTrainer(
        actor, critic, reference, tools_task.AnswerReward(tokenizer), tokenizer,
        tools_task.prompts(tokenizer), cfg, engine_config_for(cfg, **engine_overrides(mode, opts)),
        env=lambda: tools_task.CalculatorEnv(tokenizer, seed=opts.seed), turn_stop_token_ids=(turn_end,),
        max_turns=TOOLS_MAX_TURNS,
    )  # fmt: skip


_PRETRAINED: dict[tuple, tuple] = {}


def _pretrained(source: str, seed: int):
    """``(actor, tokenizer)`` of ``source``, loaded once per process (fp32); each trainer deep-copies the
    actor (its critic is loaded per trainer: ``_critic``, one fp32 copy of the model fewer held all run)."""
    from oppo_engine.pretrained import load_pretrained

    key = (source, seed)
    if key not in _PRETRAINED:
        _PRETRAINED[key] = load_pretrained(source, dtype=torch.float32)
    return _PRETRAINED[key]


def _critic(source: str, seed: int):
    """A fresh value-head model on ``source``'s backbone (fp32; a GGUF source reads its dequantized cache)."""
    from oppo_engine.pretrained import load_pretrained

    return load_pretrained(source, head="value", dtype=torch.float32, seed=seed)[0]


def zero_value_head(critic) -> None:
    """Zero the critic's value head (``score``), so that every value starts at 0.

    A freshly initialised head (``load_pretrained(head="value")``: normal, std 0.02) gives SmolLM2's values
    a spread of about 0.7 between the tokens of one answer (measured over 30-token answers), as large as the
    rule's reward (0 or 1, plus 0.1): GAE's advantages are then mostly that noise, and PPO moves the policy
    without learning. From a zero head every value is 0 at the first step, so the whitened advantages are
    the returns minus the batch's mean (REINFORCE with a batch-mean baseline), and the critic learns its
    values from there."""
    with torch.no_grad():
        critic.score.weight.zero_()
        if critic.score.bias is not None:
            critic.score.bias.zero_()


def _math_trainer(mode: str, opts: DemoOptions, source) -> PPOTrainer:
    """PPO on the math task: the pretrained actor, a value-head critic on its backbone, a frozen reference
    copy, the rule reward."""
    actor, tokenizer = _pretrained(str(source), opts.seed)
    actor = copy.deepcopy(actor).to(opts.device).train()
    critic = _critic(str(source), opts.seed).to(opts.device).train()
    zero_value_head(critic)
    if torch.device(opts.device).type == "cpu":
        # The trainer's attention (the engine runs its own paged attention whatever this is): on these
        # rows (149-156-token prompts, a shared prefix, ~33 sampled tokens) HF's eager attention took the
        # update from 14.6 to 12.4 s against sdpa (1.18x; bench/bench_demo_update.py, 2 rounds, load
        # 3.2-4.2, 2026-12-06).
        for model in (actor, critic):
            model.set_attn_implementation("eager")
    reference = copy.deepcopy(actor).eval().requires_grad_(False)
    if opts.rollout_dtype == "bf16":
        reference = reference.to(torch.bfloat16)  # frozen, and only the engine runs it
    prompts, reward = math_task.task_prompts(
        tokenizer, math_task.train_problems(MATH_TRAIN_PROBLEMS, opts.seed, operations=opts.math_operations)
    )
    cfg = ppo_config(opts)
    # The KV arena is sized for what these prompts can reach, not max_model_len's 512 (its pages are B + Δ
    # sequences of that length in each of actor, reference and critic: about 0.7 GB per 100 tokens in fp32).
    overrides = engine_overrides(mode, opts)
    overrides["max_model_len"] = min(opts.max_model_len, max(map(len, prompts)) + opts.max_new_tokens)
    if opts.rollout_dtype == "bf16":
        overrides["rollout_dtype"] = torch.bfloat16
    trainer = PPOTrainer(
        actor, critic, reference, reward, tokenizer, prompts, cfg, engine_config_for(cfg, **overrides)
    )  # fmt: skip
    if opts.bf16_update:
        autocast_update(trainer, torch.device(opts.device).type)
    return trainer


def autocast_update(trainer: PPOTrainer, device_type: str = "cpu", dtype=torch.bfloat16) -> None:
    """Run ``trainer``'s update (its forwards and backwards of actor and critic) under ``dtype`` autocast:
    the weights, their gradients and AdamW's states stay in the models' dtype (fp32), only the matmuls round.
    Pure-bf16 AdamW drops small updates (issue 35: five steps at lr 1e-5 changed 7.6% of bf16 weights); under
    autocast the update of SmolLM2 at B=16 took 13 s against 32 s in fp32 on 2 CPU cores, and it learned
    (docs/benchmarks.md, "The math task's learning curve"). The rollout is untouched (the engine's own
    dtype)."""
    update = trainer._update

    def update_under_autocast(batch):
        with torch.autocast(device_type, dtype=dtype):
            return update(batch)

    trainer._update = update_under_autocast


def _heldout(model, tokenizer, opts: DemoOptions, label: str, log) -> float:
    """Greedy held-out accuracy of ``model`` (``opts.heldout`` problems), with two of its answers logged."""
    t0 = time.perf_counter()
    acc, batch, rollouts = math_task.heldout_accuracy(
        model, tokenizer, max_new_tokens=opts.max_new_tokens, limit=opts.heldout,
        operations=opts.math_operations,
    )  # fmt: skip
    log(
        f"held-out accuracy {label}: {acc:.1%} of {len(rollouts)} (greedy; {batch.unparsed} unparsed, "
        f"{batch.cut_off:.0%} cut off; {time.perf_counter() - t0:.0f}s)"
    )
    for r in rollouts[:2]:
        question = _question(tokenizer, r.prompt_ids)
        answer = tokenizer.decode(r.response_ids, skip_special_tokens=True).replace("\n", " ")[:200]
        log(f"    {question} -> {answer}")
    return acc


def _question(tokenizer, prompt_ids) -> str:
    """A math prompt's problem, without the chat around it: the line of its last user turn, before the
    instruction."""
    text = tokenizer.decode(prompt_ids, skip_special_tokens=True)
    return text.rsplit(math_task.INSTRUCTION, 1)[0].rstrip().rsplit("\n", 1)[-1]


ONE_MODE_AT_A_TIME = ("tools", "math")  # tasks whose modes run one after the other (run_modes)


def run_modes(opts: DemoOptions, actor_path: Path, reward_path: Path, log=print) -> list[ModeRun]:
    """``opts.steps`` PPO steps per mode, the modes interleaved step by step (whatever else loads the
    machine then slows every mode alike), their order rotated each round (no mode always runs right after
    another, which would bias the ratios by its position); one step's lane trace per mode.

    ``--task tools`` and ``--task math`` run their modes one after the other instead
    (``ONE_MODE_AT_A_TIME``): a tools mode's calls go on in the background (the module docstring), and a
    real model's trainer holds gigabytes (SmolLM2 in fp32: actor, critic, reference and AdamW states), so
    each mode's trainer is built when the mode starts and freed -- its engine closed, its models dropped --
    when it ends, after its samples and held-out evaluation: one mode's models in memory at a time."""
    runs = [ModeRun(mode) for mode in opts.modes]
    trace_step = opts.trace_step or max(1, opts.steps // 2)
    if opts.task == "math" and opts.heldout > 0:  # every mode starts from these weights: evaluated once
        actor, tokenizer = _pretrained(str(actor_path), opts.seed)
        initial = _heldout(actor, tokenizer, opts, "before training", log)
        for run in runs:
            run.eval_accuracy_initial = initial
    groups = [[run] for run in runs] if opts.task in ONE_MODE_AT_A_TIME else [runs]
    bar = tqdm(total=opts.steps * len(runs), desc="PPO steps", unit="step")
    try:
        for group in groups:
            _run_group(group, opts, actor_path, reward_path, trace_step, bar, log)
    finally:
        bar.close()
    return runs


def _run_group(group: list[ModeRun], opts: DemoOptions, actor_path, reward_path, trace_step, bar, log):
    """The modes of ``group`` interleaved (``run_modes``), then their samples and held-out accuracy; their
    trainers are closed and dropped on the way out, whatever happens."""
    trainers: dict[str, PPOTrainer] = {}
    try:
        for run in group:
            try:
                trainers[run.mode] = make_trainer(run.mode, opts, actor_path, reward_path)
            except NotImplementedError as e:
                run.unavailable = str(e)
                bar.total -= opts.steps
                bar.refresh()
                log(f"{run.mode}: unavailable ({e})")
        ready = [run for run in group if run.mode in trainers]
        last = {}
        for i in range(opts.steps):
            for run in ready[i % len(ready) :] + ready[: i % len(ready)]:
                last[run.mode] = _one_step(trainers[run.mode], run, opts.out, trace_step)
                bar.update()
                bar.set_postfix({run.mode: f"{run.records[-1].reward:+.2f}"})
        for run in ready:
            trainer = trainers[run.mode]
            _show_samples(run.mode, trainer, last[run.mode], log)
            if opts.task == "math" and opts.heldout > 0:
                run.eval_accuracy_final = _heldout(
                    trainer.actor, trainer.tokenizer, opts, f"after {run.mode}", log
                )
    finally:
        for trainer in trainers.values():
            trainer.close()
        trainers.clear()
        gc.collect()  # the engine's threads and the trainer's closures form cycles: free their tensors now


def release_heap() -> bool:
    """Hand the C heap's free memory back to the system (glibc's ``malloc_trim(0)``; False where there is
    none). PyTorch's CPU tensors come from ``malloc``: a PPO step of SmolLM2 frees gigabytes of activations
    and logits whose shapes change from step to step, and glibc kept them, so the math demo's resident
    memory grew by about 1 GB a step (11.5 -> 14.3 GB over four steps); one ``malloc_trim(0)`` at that point
    took it to 8.0 GB (docs/benchmarks.md, "The math demo")."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        trim = None
    if trim is None:
        return False
    trim(0)
    return True


def _one_step(trainer: PPOTrainer, run: ModeRun, out: Path, trace_step: int):
    s0, c0 = time.perf_counter(), time.process_time()
    stats = trainer.step()
    step_s, cpu_s = time.perf_counter() - s0, time.process_time() - c0
    if isinstance(trainer.reward, math_task.MathReward):  # a real model's steps: outside the timed step
        release_heap()
    m = stats.rollout.metrics
    run.records.append(
        StepRecord(
            step=stats.step,
            reward=stats.reward,
            kl=stats.kl,
            step_s=step_s,
            rollout_s=stats.rollout_s,
            elapsed_s=(run.records[-1].elapsed_s if run.records else 0.0) + step_s,
            rollouts=m.rollouts,
            tokens=m.tokens_generated,
            exposed_scoring_s=m.exposed_scoring_s,
            length_bias=getattr(m, "length_bias", None),
            chunk_size=m.chunk_size,
            overcommit=m.overcommit,
            stale_tokens=stats.stale_tokens,
            response_len=stats.response_len,
            env_calls=m.env_calls,
            exposed_env_s=m.env_wait_s,
            cpu_s=cpu_s,
            load=os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
            **_rule_scores(trainer, stats.rollout.rollouts),
            **agreement_fields(stats.agreement, stats.truncated_sampling),
        )
    )
    if stats.step == trace_step:
        trainer.engine.timeline.to_chrome_trace(out / f"trace_{run.mode}.json")
    return stats


def _rule_scores(trainer: PPOTrainer, rollouts) -> dict:
    """The math task's accuracy, unparsed answers and cut-off share of a batch (nothing for other tasks)."""
    if not isinstance(trainer.reward, math_task.MathReward):
        return {}
    batch = math_task.score(trainer.reward, rollouts)
    return dict(accuracy=batch.accuracy, unparsed=batch.unparsed, cut_off=batch.cut_off)


def _show_samples(mode: str, trainer: PPOTrainer, stats, log) -> None:
    rollouts = stats.rollout.rollouts
    if trainer.engine.env is not None:
        lines = tools_task.examples(trainer.tokenizer, rollouts)
    elif isinstance(trainer.reward, math_task.MathReward):  # its rule, not the polite task's
        lines = batch_examples(trainer.tokenizer, rollouts, embedded=False, rule=trainer.reward)
    else:
        lines = batch_examples(trainer.tokenizer, rollouts, embedded=trainer_is_embedded(trainer))
    log(f"{mode}, last batch: {lines[0]}")
    for line in lines[1:]:
        log(f"    {line}")


def trainer_is_embedded(trainer: PPOTrainer) -> bool:
    """Whether the trainer's tokenizer is the embedded task's (its rules apply to the answers)."""
    vocab = trainer.tokenizer.get_vocab()
    return all(word in vocab for word in ("thank", "list", *TOPICS))


def batch_examples(
    tokenizer, rollouts, *, embedded: bool = True, width: int = 240, rule: math_task.MathReward | None = None
) -> list[str]:
    """What the demo prints of a batch: the best- and the worst-scored answers with their rewards and, on the
    embedded task, how many answers keep its rules (``task.broken_rules``) and whether the reward model is
    being gamed -- named as reward hacking when the top-scored answer breaks a rule or repeats a sentence
    three times or more. That is what RLHF looks like when the reward model is the weak link: shown, never
    hidden. On the math task (``rule``, its ``MathReward``) the first line counts the answers whose final
    number is right and those in the asked format instead: the rule is the task, there is nothing to game."""
    if not rollouts:
        return ["no rollouts"]
    texts = [(tokenizer.decode(r.prompt_ids), tokenizer.decode(r.response_ids)) for r in rollouts]
    order = sorted(range(len(rollouts)), key=lambda i: rollouts[i].reward)
    best, worst = order[-1], order[0]
    n = len(rollouts)
    if rule is not None:
        grades = [rule.grade(r.prompt_ids, r.response_ids) for r in rollouts]
        lines = [
            f"{sum(g.correct for g in grades)}/{n} answers have the right final number; "
            f'{sum(g.formatted for g in grades)}/{n} end in the asked format ("The answer is N.")'
        ]
        embedded = False
    elif embedded:
        finished = [r.finish_reason == "eos" for r in rollouts]
        broken = [broken_rules(p, a, done) for (p, a), done in zip(texts, finished, strict=True)]
        polite = sum(is_polite(a) for _, a in texts)
        kept = sum(not b for b in broken)
        lines = [
            f"{polite}/{n} answers say thank you and answer; {kept}/{n} keep every rule of the task (polite, "
            "complete, the number of things asked for, on topic, no sentence three times)"
        ]
    else:
        lines = [f"{n} rollouts"]
    if rule is not None:  # the question alone, not the chat template and the worked example around it
        texts = [
            (_question(tokenizer, r.prompt_ids), tokenizer.decode(r.response_ids, skip_special_tokens=True))
            for r in rollouts
        ]
    for label, i in (("best ", best), ("worst", worst)):
        prompt, answer = texts[i]
        if len(answer) > width:
            answer = answer[:width] + f" ... ({len(rollouts[i].response_ids)} tokens in all)"
        lines.append(f"{label} (reward {rollouts[i].reward:+.2f}): {prompt}  ->  {answer}")
    if embedded and broken[best]:
        lines.append(
            f"reward hacking: the top-scored answer ({rollouts[best].reward:+.2f}) breaks the task's rules: "
            f"{'; '.join(broken[best])}. The reward model is being gamed: PPO found what it scores high, "
            "not what the task asks."
        )
    return lines


def run_demo(opts: DemoOptions, log=print) -> list[ModeRun]:
    """Every mode of ``opts``, side by side; writes table.txt, records.json, reward.png, control.png (and
    accuracy.png, agreement.png: ``report.plot``) and one trace per mode into ``opts.out``."""
    if opts.task not in TASKS:
        raise ValueError(f"--task {opts.task!r}: choose {', '.join(TASKS)}")
    if opts.task == "math" and (opts.reward is not None or opts.fsdp):
        raise ValueError(
            "--task math is scored by a rule: no --reward (and no --fsdp); --actor picks the model"
        )
    if opts.task != "math" and (opts.actor is None) != (opts.reward is None):
        raise ValueError("--actor and --reward go together (or neither: the embedded task)")
    if opts.rollout_dtype not in ROLLOUT_DTYPES:
        raise ValueError(f"--rollout-dtype {opts.rollout_dtype!r}: choose {', '.join(ROLLOUT_DTYPES)}")
    if opts.task == "tools" and (opts.actor is not None or opts.fsdp):
        raise ValueError("--task tools runs the embedded tools task: no --actor / --reward / --fsdp")
    if opts.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {opts.steps}")
    unknown = [m for m in opts.modes if m not in MODES]
    if unknown or not opts.modes:
        raise ValueError(f"--modes: {unknown or 'none given'}; choose among {', '.join(MODES)}")
    for mode in opts.modes:  # bad sizes and engine settings fail here, before anything is built
        engine_config_for(ppo_config(opts), **engine_overrides(mode, opts))
    opts.out.mkdir(parents=True, exist_ok=True)
    if opts.task == "tools":
        actor_path = reward_path = tools_task.build_tools_task(opts.cache, seed=opts.seed, log=log)
    elif opts.task == "math":
        actor_path = reward_path = opts.actor if opts.actor is not None else MATH_MODEL
    elif opts.actor is None:
        cache = build_task(opts.cache, log=log)
        actor_path, reward_path = cache / "actor", cache / "reward"
    else:
        actor_path, reward_path = opts.actor, opts.reward
    t0 = time.perf_counter()
    saved = torch.get_num_threads()
    torch.set_num_threads(opts.threads)
    try:
        runs = run_modes(opts, actor_path, reward_path, log)
    finally:
        torch.set_num_threads(saved)
    table = format_table(runs)
    (opts.out / "table.txt").write_text(table + "\n")
    (opts.out / "records.json").write_text(json.dumps(records_json(runs), indent=1))
    paths = plot(opts.out, runs) if any(r.records for r in runs) else []
    log("\n" + table)
    log(
        f"\nPPO runs took {time.perf_counter() - t0:.0f}s; wrote {opts.out}/table.txt, records.json, "
        + ", ".join(p.name for p in paths)
        + ", "
        + ", ".join(f"trace_{r.mode}.json" for r in runs if r.records)
        + " (open the traces in https://ui.perfetto.dev)"
    )
    return runs
