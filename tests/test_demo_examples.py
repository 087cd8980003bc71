"""The demo's printed examples tell the truth: the best- and the worst-scored answers with their rewards,
and reward hacking named when the top-scored answer breaks the task's rules or repeats a sentence."""

from __future__ import annotations

import pytest

from oppo_engine.ppo.demo import batch_examples
from oppo_engine.ppo.task import POLITE, broken_rules, corpus, sentences, train_tokenizer
from oppo_engine.sched.results import Rollout


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer([f"{p} {r}" for p, r in corpus(400, seed=3)] + [POLITE])


def rollout(tokenizer, prompt: str, answer: str, reward: float, finish_reason: str = "eos") -> Rollout:
    ids = tokenizer(answer)["input_ids"]
    return Rollout(
        prompt_ids=tokenizer(prompt)["input_ids"], response_ids=ids, logprobs=[0.0] * len(ids),
        reward=reward, policy_versions=[0] * len(ids), deferred_steps=0, finish_reason=finish_reason,
    )  # fmt: skip


GOOD = "the cat is big . thank you for asking ."
HACK = "1 the dog is big . 2 i like the dog . " + "thank you for asking . " * 9


def test_an_answer_that_keeps_the_rules_breaks_none():
    assert broken_rules("tell me about the cat .", GOOD, finished=True) == []
    two = "1 the sun is old . 2 the sun can shine . thank you for asking ."
    assert broken_rules("list 2 things about the sun .", two, finished=True) == []


@pytest.mark.parametrize(
    ("prompt", "answer", "finished", "rule"),
    [
        ("tell me about the cat .", "the cat is big .", True, "never says thank you"),
        ("tell me about the cat .", POLITE, True, "says only thank you"),
        ("tell me about the cat .", GOOD, False, "cut off"),
        ("list 3 things about the dog .", "1 the dog is big . thank you for asking .", True,
         "lists 1 thing, 3 were asked for"),
        ("tell me about the cat .", "1 the cat is big . 2 the cat is old . thank you for asking .", True,
         "short answer was asked for, it gives 2"),
        ("tell me about the cat .", "the moon is big . thank you for asking .", True, "talks about the moon"),
        ("list 2 things about the dog .", HACK, True, 'repeats "thank you for asking ." 9 times'),
    ],
)  # fmt: skip
def test_each_broken_rule_is_named(prompt, answer, finished, rule):
    broken = broken_rules(prompt, answer, finished)
    assert any(rule in b for b in broken), broken


def test_sentences_leave_out_list_numbers_and_eos():
    assert sentences("1 the cat is big . 2 i like it . <eos>") == ["the cat is big .", "i like it ."]


def test_the_examples_show_the_best_and_the_worst_answer_with_their_scores(tokenizer):
    batch = [
        rollout(tokenizer, "tell me about the cat .", GOOD, -1.84),
        rollout(tokenizer, "list 2 things about the dog .", HACK, 1.77),
        rollout(tokenizer, "tell me about the sun .", "the sun is warm . thank you for asking .", 0.3),
    ]
    lines = batch_examples(tokenizer, batch)
    assert lines[0].startswith("3/3 answers say thank you and answer; 2/3 keep every rule")
    assert lines[1].startswith("best  (reward +1.77): list 2 things about the dog .")
    assert lines[2].startswith("worst (reward -1.84): tell me about the cat .")
    assert lines[3].startswith("reward hacking: the top-scored answer (+1.77)")
    assert 'repeats "thank you for asking ." 9 times' in lines[3]


def test_no_reward_hacking_is_named_when_the_best_answer_keeps_the_rules(tokenizer):
    batch = [
        rollout(tokenizer, "tell me about the cat .", GOOD, 1.5),
        rollout(tokenizer, "tell me about the cat .", "the cat is old .", -0.5),
    ]
    lines = batch_examples(tokenizer, batch)
    assert len(lines) == 3 and not any("reward hacking" in line for line in lines)


def test_examples_of_another_task_show_scores_without_the_embedded_rules(tokenizer):
    batch = [rollout(tokenizer, "tell me about the cat .", HACK, 2.0)]
    lines = batch_examples(tokenizer, batch, embedded=False)
    assert lines[0] == "1 rollouts" and "reward +2.00" in lines[1]
    assert not any("reward hacking" in line for line in lines)
