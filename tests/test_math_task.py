"""The math task's rule and problems: the final number is read as documented (several numbers, units, a
trailing period, separators), unparseable answers score 0 and are counted, accuracy is not the reward, and
the problems are deterministic, small, answered correctly by their own arithmetic and disjoint from the
held-out set."""

from __future__ import annotations

import random
import re
from types import SimpleNamespace

import pytest

from oppo_engine.ppo import math_task
from oppo_engine.ppo.math_task import (
    CORRECT_REWARD,
    FORMAT_REWARD,
    HELDOUT,
    MathReward,
    final_number,
    grade,
    heldout_problems,
    make_problem,
    problems,
    score,
    train_problems,
)


@pytest.mark.parametrize(
    ("text", "final"),
    [
        ("The answer is 12.", 12),  # a trailing period ends the sentence
        ("The answer is 12", 12),
        ("the answer is: 12 apples.", 12),  # units after the number, any case, a colon
        ("The answer is $12.", 12),
        ("7 + 5 = 12. The answer is 12.", 12),
        ("First 3 + 4 = 7, then 7 * 2 = 14.", 14),  # no "answer is": the last number of the response
        ("So answer is 5 + 3 = 8. Then 2 more problems.", 8),  # the answer's sentence, not what follows
        ("The answer is 5 + 3 = 8.", 5),  # the asked format: the number right after it
        ("The answer is 9 (12 - 3).", 9),  # not the last number of the sentence
        ("The answer is 9, not 10.", 9),
        ("The answer is 9. Then 2 more problems.", 9),
        ("The answer is 12.5.", 12.5),  # a decimal is read as one (and is wrong for an integer answer)
        ("The answer is 1,000.", 1000),  # thousands separators
        ("Counts: 3,4 and 5", 5),  # a comma in a list is no separator
        ("I think the answer is 9.\nThe answer is 11.", 11),  # the last "answer is" wins
        ("The answer is eleven. She had 11", 11),  # no number in the answer's sentence: the last one
        ("She had -3 pens", -3),
        ("I cannot tell how many.", None),
        ("", None),
    ],
)
def test_the_final_number_is_read_by_the_documented_rule(text, final):
    assert final_number(text) == final


def test_the_reward_is_one_for_the_right_number_plus_a_small_format_term():
    assert grade("The answer is 12.", 12).reward == CORRECT_REWARD + FORMAT_REWARD
    assert grade("12 pens.", 12).reward == CORRECT_REWARD  # right, without the format
    assert grade("The answer is 13.", 12).reward == FORMAT_REWARD  # the format, a wrong number
    assert grade("13 pens.", 12).reward == 0.0
    assert grade("The answer is 12.5.", 12).reward == FORMAT_REWARD
    # the grade reads the number the format term saw: right and formatted, or wrong and formatted
    assert grade("The answer is 9 (12 - 3).", 9).reward == CORRECT_REWARD + FORMAT_REWARD
    assert grade("The answer is 9, not 10.", 9).reward == CORRECT_REWARD + FORMAT_REWARD
    assert grade("The answer is 10, not 9.", 9).reward == FORMAT_REWARD
    unreadable = grade("I do not know.", 12)
    assert unreadable.reward == 0.0 and unreadable.final is None and not unreadable.correct


def test_accuracy_counts_right_numbers_and_unparsed_answers_not_the_reward():
    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: ids[0])
    reward = MathReward(tokenizer, {(1,): 12, (2,): 5})

    def rollout(prompt, text, finish="eos"):
        return SimpleNamespace(prompt_ids=[prompt], response_ids=[text], finish_reason=finish)

    batch = [
        rollout(1, "The answer is 12."),  # 1.1
        rollout(1, "12"),  # 1.0
        rollout(2, "The answer is 6."),  # 0.1
        rollout(2, "no idea", "length"),  # 0, unparsed, cut off
    ]
    got = score(reward, batch)
    assert got.accuracy == 0.5 and got.unparsed == 1 and got.cut_off == 0.25
    assert [reward(r.prompt_ids, r.response_ids) for r in batch] == [1.1, 1.0, 0.1, 0.0]


def _solve(question: str) -> int:
    """The problem's arithmetic, read back from its words."""
    count = int(re.search(r"has (\d+)", question).group(1))
    for sentence in question.split(". ")[1:]:
        if m := re.search(r"buys (\d+) more", sentence):
            count += int(m.group(1))
        elif m := re.search(r"gives (\d+)", sentence):
            count -= int(m.group(1))
        elif "doubles" in sentence:
            count *= 2
        elif "triples" in sentence:
            count *= 3
    return count


def test_problems_are_deterministic_small_and_answered_by_their_own_words():
    first, again = problems(300, seed=5), problems(300, seed=5)
    assert first == again and first != problems(300, seed=6)
    assert len({p.question for p in first}) == 300
    for p in first:
        assert 1 <= p.operations <= 3 and p.question.endswith("have now?")
        assert p.question.count(".") == p.operations + 1  # the start, one sentence per operation
        assert 0 < p.answer <= 300 and p.answer == _solve(p.question)
    assert {p.operations for p in first} == {1, 2, 3}
    one = problems(50, seed=5, min_ops=1, max_ops=1)
    assert all(p.operations == 1 for p in one)
    assert make_problem(random.Random(3)) == make_problem(random.Random(3))


def test_the_heldout_set_is_fixed_and_never_trained_on():
    held = heldout_problems()
    assert len(held) == HELDOUT and held == heldout_problems()
    train = train_problems(1000)
    assert not {p.question for p in held} & {p.question for p in train}
    assert math_task.EXAMPLE_QUESTION not in {p.question for p in held + train}
    lo, hi = math_task.OPERATIONS
    assert all(lo <= p.operations <= hi for p in held + train)


@pytest.mark.parametrize("operations", [(1, 1), (2, 3)])
def test_the_operations_setting_picks_both_sets_problems(operations):
    held = heldout_problems(operations)
    train = train_problems(300, operations=operations)
    assert len(held) == HELDOUT and held == heldout_problems(operations)
    assert all(operations[0] <= p.operations <= operations[1] for p in held + train)
    assert not {p.question for p in held} & {p.question for p in train}
    assert math_task.EXAMPLE_QUESTION not in {p.question for p in held + train}


def test_the_worked_example_is_right_by_its_own_rule():
    # The example turn teaches the format: the rule must read it as a correct, formatted answer.
    answer = _solve(math_task.EXAMPLE_QUESTION)
    assert grade(math_task.EXAMPLE_ANSWER, answer) == math_task.Grade(answer, True, True)
    assert math_task.EXAMPLE_QUESTION.endswith("have now?")


def test_the_prompt_is_the_chat_template_with_the_answer_format(smollm2):
    _, tokenizer = smollm2
    problem = problems(1, seed=0)[0]
    ids = math_task.prompt_ids(tokenizer, problem)
    text = tokenizer.decode(ids)
    assert text.endswith("<|im_start|>assistant\n")
    assert f"<|im_start|>user\n{problem.question} " in text and '"The answer is N."' in text
    # The worked example comes first, as an earlier user turn and the assistant's answer to it.
    example = text.index(f"<|im_start|>user\n{math_task.EXAMPLE_QUESTION} ")
    assert example < text.index(f"<|im_start|>assistant\n{math_task.EXAMPLE_ANSWER}<|im_end|>")
    assert text.index(f"{math_task.EXAMPLE_ANSWER}<|im_end|>") < text.index(problem.question)


@pytest.mark.real_model  # minutes of CPU: one PPO step of SmolLM2 and two held-out evaluations
def test_the_math_demo_trains_the_pretrained_model_and_records_accuracy(smollm2, tmp_path):
    import json

    from oppo_engine.ppo.demo import DemoOptions, run_demo

    lines = []
    opts = DemoOptions(task="math", modes=("oppo",), steps=1, batch_size=2, max_new_tokens=8, heldout=2,
                       out=tmp_path, threads=2)  # fmt: skip
    runs = run_demo(opts, log=lines.append)
    assert runs[0].records and runs[0].records[0].accuracy is not None
    out = json.loads((tmp_path / "records.json").read_text())["oppo"]
    assert 0 <= out["eval_accuracy_initial"] <= 1 and 0 <= out["eval_accuracy_final"] <= 1
    assert out["time_to_accuracy_s"] is None or out["time_to_accuracy_s"] > 0
    assert any(line.startswith("held-out accuracy before training") for line in lines)


def test_the_math_demos_critic_starts_from_a_zero_value_head():
    # A fresh head's values spread between the tokens of an answer as much as the reward itself: the demo
    # zeroes it, so the first step's advantages are the returns minus the batch mean. Its backbone stays.
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from oppo_engine.ppo.demo import zero_value_head

    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_labels=1, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    critic = LlamaForSequenceClassification(config)
    backbone = {k: v.clone() for k, v in critic.model.state_dict().items()}
    ids = torch.randint(1, 64, (3, 9))
    hidden = critic.model(ids).last_hidden_state
    assert critic.score(hidden).abs().amax() > 0  # random before
    zero_value_head(critic)
    assert torch.equal(critic.score(hidden), torch.zeros(3, 9, 1))
    assert all(torch.equal(v, backbone[k]) for k, v in critic.model.state_dict().items())
    assert critic.score.weight.requires_grad  # still trained
