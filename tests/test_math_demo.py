"""``oppo-engine demo``'s default job, the math task, on a tiny random chat model saved as a local folder (the
real model's run: tests/test_math_task.py, marked ``real_model``): the command line's defaults are the math
task's, the records' accuracy fields agree with the rule and with each other, and the update runs under bf16
autocast over fp32 weights."""

from __future__ import annotations

import json
from statistics import mean

import pytest
import torch
import torch.nn.functional as F
from serve_models import chat_actor, chat_tokenizer

from oppo_engine.ppo import demo, math_task, report


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory):
    """A tiny random Qwen2 chat model and its tokenizer (a chat template, ``<|im_end|>`` its EOS), saved as
    the local folder ``--actor`` takes."""
    folder = tmp_path_factory.mktemp("chat_model")
    tokenizer = chat_tokenizer()
    chat_actor(tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _first_crossing(accuracy: list[float], threshold: float) -> int | None:
    """The 1-based step of the trailing ``report.TRAILING``-step mean's first value at or above
    ``threshold`` (the module docstring of report.py, computed here again from the records)."""
    k = report.TRAILING
    if len(accuracy) < k:
        return len(accuracy) if mean(accuracy) >= threshold else None
    return next((i for i in range(k, len(accuracy) + 1) if mean(accuracy[i - k : i]) >= threshold), None)


def test_the_default_demo_is_the_math_task_with_consistent_accuracy_records(chat_folder, tmp_path):
    from oppo_engine.cli import main

    out = tmp_path / "out"
    steps, heldout = 6, 4
    # No --task, no --modes: the command line's defaults (the math task, its two modes, its trainer).
    rc = main(["demo", "--actor", str(chat_folder), "--steps", str(steps), "--batch-size", "2",
               "--max-new-tokens", "6", "--heldout", str(heldout), "--out", str(out),
               "--device", "cpu"])  # fmt: skip
    assert rc == 0
    records = json.loads((out / "records.json").read_text())
    assert tuple(records) == demo.MATH_DEFAULTS["modes"] == ("sequential", "oppo")
    # The untrained model's greedy held-out accuracy, evaluated again here: every mode starts from it.
    model, tokenizer = demo._pretrained(str(chat_folder), 0)
    initial, _, _ = math_task.heldout_accuracy(
        model, tokenizer, max_new_tokens=6, limit=heldout, operations=demo.DemoOptions().math_operations
    )
    base = records["sequential"]["records"]
    accuracy = [r["accuracy"] for r in base]
    first, last = mean(accuracy[: report.TRAILING]), mean(accuracy[-report.TRAILING :])
    threshold = first + report.THRESHOLD_FRACTION * (last - first)
    for rec in records.values():
        assert rec["eval_accuracy_initial"] == initial
        assert rec["eval_accuracy_final"] * heldout == int(rec["eval_accuracy_final"] * heldout)  # k of 4
        steps_ = rec["records"]
        assert len(steps_) == steps
        for r in steps_:  # accuracy is a share of the batch's rollouts, not the reward
            assert r["accuracy"] * r["rollouts"] == pytest.approx(round(r["accuracy"] * r["rollouts"]))
            assert 0 <= r["cut_off"] <= 1 and r["unparsed"] <= r["rollouts"]
        # Time to accuracy: the base mode's threshold, this mode's own summed step time at its crossing.
        crossing = _first_crossing([r["accuracy"] for r in steps_], threshold)
        expected = steps_[crossing - 1]["elapsed_s"] if crossing is not None else None
        assert rec["time_to_accuracy_s"] == expected
        assert steps_[-1]["elapsed_s"] == pytest.approx(sum(r["step_s"] for r in steps_))
    assert records["sequential"]["time_to_accuracy_s"] is not None  # its own threshold: always reached
    table = (out / "table.txt").read_text()
    assert "time to accuracy (s)" in table and "time to reward (s)" not in table
    assert "held-out accuracy: before -> after" in table
    for png in ("accuracy.png", "reward.png", "control.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_math_trainer_updates_under_bf16_autocast_over_fp32_weights(chat_folder, tmp_path):
    opts = demo.DemoOptions(task="math", modes=("sequential",), batch_size=2, max_new_tokens=6, heldout=0,
                            out=tmp_path, threads=1)  # fmt: skip
    trainer = demo.make_trainer("sequential", opts, chat_folder, chat_folder)
    try:
        before = [p.detach().clone() for p in trainer.actor.parameters()]
        seen = []  # the dtype of the actor's logits in each forward that builds a graph (the update's)

        def hook(_module, _inputs, output):
            if torch.is_grad_enabled():
                seen.append(output.dtype)

        handle = trainer.actor.lm_head.register_forward_hook(hook)
        trainer.step()
        handle.remove()
        assert seen and set(seen) == {torch.bfloat16}
        params = list(trainer.actor.parameters())
        assert {p.dtype for p in params} == {torch.float32}  # master weights and AdamW stay fp32
        assert any(not torch.equal(a, b) for a, b in zip(before, params, strict=True))  # and they moved
        assert all(s.dtype == torch.float32 for st in trainer.actor_optim.state.values() for s in st.values()
                   if torch.is_tensor(s) and s.dim() > 0)  # fmt: skip
    finally:
        trainer.close()


@pytest.mark.parametrize(("rollout_dtype", "expected"), [("bf16", torch.bfloat16), ("fp32", torch.float32)])
def test_the_math_demo_rolls_out_from_bf16_copies_by_default(chat_folder, tmp_path, rollout_dtype, expected):
    """``DemoOptions.rollout_dtype`` (default "bf16"): the engine's actor, critic and reference run in that
    dtype, and the trainer's actor and critic stay fp32 (the master weights)."""
    assert demo.DemoOptions().rollout_dtype == "bf16"
    opts = demo.DemoOptions(task="math", modes=("sequential",), batch_size=2, max_new_tokens=6, heldout=0,
                            out=tmp_path, threads=1, rollout_dtype=rollout_dtype)  # fmt: skip
    trainer = demo.make_trainer("sequential", opts, chat_folder, chat_folder)
    try:
        engine = trainer.engine
        assert engine.config.rollout_dtype == (torch.bfloat16 if rollout_dtype == "bf16" else None)
        assert next(engine.actor.parameters()).dtype == expected
        assert next(trainer.reference.parameters()).dtype == expected
        for model in (trainer.actor, trainer.critic):
            assert {p.dtype for p in model.parameters()} == {torch.float32}
        assert trainer.step().rollout.rollouts  # it runs
    finally:
        trainer.close()


def test_the_math_demos_problems_have_one_operation(chat_folder):
    # The demo trains and evaluates on one-operation problems (DemoOptions.math_operations): the 135M model
    # gets 10% of one to three operations right greedily, and made up steps (docs/benchmarks.md).
    assert demo.DemoOptions().math_operations == (1, 1)
    cfg = demo.ppo_config(demo.DemoOptions(task="math", batch_size=32))
    assert (cfg.batch_size, cfg.minibatch_size, cfg.lr, cfg.lam, cfg.rollout_correction) == (
        32, 8, 5e-6, 1.0, "tis",
    )  # fmt: skip


def test_the_math_demos_modes_sample_the_same_tokens_for_a_prompt_at_its_first_step(chat_folder, tmp_path):
    # Every mode starts from the same weights and gives each prompt the seed of its position in the stream:
    # what the modes differ in is which prompts finish in which step (oppo overcommits B + Δ), never a
    # prompt's tokens. So a prompt that two modes both return at step 1 has the same response and
    # behaviour log-probs in both; and so the modes' final accuracies differ by what they trained on, not
    # by how they sampled.
    opts = demo.DemoOptions(task="math", batch_size=4, max_new_tokens=6, heldout=0, out=tmp_path, threads=1)
    responses = {}
    for mode in ("sequential", "oppo"):
        trainer = demo.make_trainer(mode, opts, chat_folder, chat_folder)
        try:
            rollouts = trainer.step().rollout.rollouts
        finally:
            trainer.close()
        assert len(rollouts) == opts.batch_size
        responses[mode] = {tuple(r.prompt_ids): (r.response_ids, r.logprobs) for r in rollouts}
    both = responses["sequential"].keys() & responses["oppo"].keys()
    assert both  # the first prompts of the stream are in both batches
    for prompt in both:
        (seq_ids, seq_lp), (oppo_ids, oppo_lp) = responses["sequential"][prompt], responses["oppo"][prompt]
        assert seq_ids == oppo_ids
        assert torch.allclose(torch.tensor(seq_lp), torch.tensor(oppo_lp), atol=1e-5, rtol=0)


def test_the_math_demos_printed_batch_counts_right_answers_by_the_rule_not_the_polite_tasks_rules():
    # SmolLM2's vocabulary has the polite task's words ("thank", "list", ...): the printed batch must not
    # judge math answers by the polite task's rules (nor name reward hacking: the reward is the rule).
    from oppo_engine.sched.results import Rollout

    tokenizer = chat_tokenizer()
    problems = math_task.problems(3, seed=5, max_ops=1)
    prompts, rule = math_task.task_prompts(tokenizer, problems)
    answers = [
        f"The answer is {problems[0].answer}.",  # right, formatted
        f"so {problems[1].answer}",  # right, no format
        f"The answer is {problems[2].answer + 1}.",  # wrong, formatted
    ]
    rollouts = []
    for ids, text in zip(prompts, answers, strict=True):
        response = tokenizer(text)["input_ids"]
        rollouts.append(Rollout(prompt_ids=ids, response_ids=response, logprobs=[0.0] * len(response),
                                reward=rule(ids, response), policy_versions=[0] * len(response),
                                deferred_steps=0, finish_reason="eos"))  # fmt: skip
    lines = demo.batch_examples(tokenizer, rollouts, embedded=True, rule=rule)
    assert lines[0].startswith("2/3 answers have the right final number; 2/3 end in the asked format")
    assert lines[1] == f"best  (reward +1.10): {problems[0].question}  ->  {answers[0]}"
    assert lines[2] == f"worst (reward +0.10): {problems[2].question}  ->  {answers[2]}"  # the question alone
    assert not any("reward hacking" in line for line in lines)


def test_every_forward_of_an_autocast_update_reads_the_weights_as_they_are_then(chat_folder, tmp_path):
    """The demo's update runs under one bf16 autocast over several minibatches. Autocast caches each fp32
    weight's bf16 cast until the outermost context exits, and the cache does not see the optimizer's
    in-place steps: without ``torch.clear_autocast_cache()`` after them, every minibatch after the first ran
    on the weights of the update's start. Each forward's LM-head output must be the bf16 product with the
    weight as it is at that forward."""
    opts = demo.DemoOptions(task="math", modes=("sequential",), batch_size=8, max_new_tokens=6, heldout=0,
                            out=tmp_path, threads=1)  # fmt: skip
    trainer = demo.make_trainer("sequential", opts, chat_folder, chat_folder)
    try:
        for group in trainer.actor_optim.param_groups:
            group["lr"] = 1e-2  # steps large enough that a stale bf16 cast cannot round to the fresh one
        head = trainer.actor.lm_head
        checks = []  # max |output - bf16 product| with the weight now, and with the start's
        start = head.weight.detach().clone()

        def hook(_module, inputs, output):
            if not torch.is_grad_enabled():
                return
            with torch.autocast("cpu", enabled=False), torch.no_grad():
                x = inputs[0].detach().to(torch.bfloat16)
                now = F.linear(x, head.weight.detach().to(torch.bfloat16))
                then = F.linear(x, start.to(torch.bfloat16))
            out = output.detach()
            checks.append((float((out - now).abs().max()), float((out - then).abs().max())))

        handle = head.register_forward_hook(hook)
        trainer.step()
        handle.remove()
        assert len(checks) >= 4  # one graph-building forward per minibatch at least
        assert all(now == 0.0 for now, _ in checks), checks
        assert any(then > 0.0 for _, then in checks[1:]), checks  # the weights did move between minibatches
    finally:
        trainer.close()
