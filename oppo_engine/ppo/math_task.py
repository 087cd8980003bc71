"""The arithmetic task of ``oppo-engine demo --task math``: word problems with a verifiable answer, scored by
a rule (the paper's GSM8K setting in miniature), for a real chat model (the bundled SmolLM2-135M-Instruct).

A problem is templated from a seed: a person, an object, a starting count, then one to three operations
(buys more, gives some away, the count doubles or triples), and "How many ... now?". Small integers, never
below zero: ``Sam has 7 pens. Sam buys 5 more pens. Sam gives 3 pens to a friend. How many pens does Sam
have now?`` (9). ``OPERATIONS`` sets how many operations the task's training and held-out problems have.
The prompt goes through the model's own chat template and states the answer's format, ``The answer is
N.``, after one worked example (an earlier user turn and the assistant's answer to it: ``EXAMPLE_QUESTION``,
``EXAMPLE_ANSWER``), which neither problem set ever contains.

The reward is a rule (``grade``), 0 for anything it cannot read:

- the **final number** is the number right after the last "the answer is" (any case; a colon or ``$``
  may come between) when the response has the asked format, so the format term and the grade read the
  same number (``The answer is 9 (12 - 3).`` and ``The answer is 9, not 10.`` both give 9); else the
  last number of the sentence after the last "answer is" when the response has one, else the last number
  of the whole response: with several numbers the last one counts (``3 + 4 = 7`` gives 7); units and
  currency around it are ignored (``12 apples``, ``$12``); a trailing period ends the sentence, not a
  decimal (``12.`` is 12, ``12.5`` is 12.5, a wrong answer); thousands separators are read (``1,000``),
  a comma in a list is not (``3,4`` is 3 then 4);
- ``CORRECT_REWARD`` (1) when the final number is the problem's answer, plus ``FORMAT_REWARD`` (0.1) when
  the response has the asked format ``The answer is N`` -- whether N is right or not: a small shaping term
  for the format that makes the answer readable;
- a response with no number at all scores 0 and is counted as ``unparsed``.

**Accuracy** (``accuracy``) is the share of responses whose final number is right: not the reward, which
includes the format term. **Held-out accuracy** (``heldout_accuracy``) is greedy, over ``HELDOUT`` (200)
fixed problems (seed ``HELDOUT_SEED``) that the training prompts never contain.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

import torch

CORRECT_REWARD = 1.0
FORMAT_REWARD = 0.1
HELDOUT, HELDOUT_SEED = 200, 20_261_204
TRAIN_SEED = 1
MAX_START, MAX_STEP = 20, 9  # the starting count, and each operation's operand (small integers)

PEOPLE = ("Sam", "Mia", "Tom", "Ana", "Leo", "Zoe", "Ben", "Ivy", "Max", "Eva")
OBJECTS = ("apples", "pens", "books", "marbles", "cards", "shells", "stickers", "coins")
INSTRUCTION = 'Solve the problem. End your reply with "The answer is N." where N is the number.'
# One worked example, as an earlier turn of the chat (a one-shot prompt, as GSM8K's evaluations use few-shot
# ones). Without it SmolLM2-135M-Instruct mostly answers first with the problem's first number ("The answer
# is 13.") and then rambles past the token limit; with it, it reasons in one line, keeps the format and
# stops (measured on 48 one-operation problems, greedy: accuracy 8% -> 42%, cut off 40% -> 0%, 83 -> 31
# tokens).
EXAMPLE_QUESTION = "Tom has 5 pens. Tom buys 4 more pens. How many pens does Tom have now?"
EXAMPLE_ANSWER = "Tom has 5 pens and buys 4 more: 5 + 4 = 9. The answer is 9."
# The operations per problem of the task's training and held-out problems (``train_problems``,
# ``heldout_problems``), both ends included.
OPERATIONS = (1, 3)

# A number: thousands separators in groups of three, or digits with an optional decimal part. A period
# followed by no digit is the end of a sentence.
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?!\d)|-?\d+(?:\.\d+)?")
_ANSWER_IS = re.compile(r"answer is", re.IGNORECASE)
_FORMAT = re.compile(r"the answer is:?\s*\$?\s*(-?\d{1,3}(?:,\d{3})+(?!\d)|-?\d+(?:\.\d+)?)", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class Problem:
    """A word problem and its answer."""

    question: str
    answer: int
    operations: int


def make_problem(rng: random.Random, min_ops: int = 1, max_ops: int = 3) -> Problem:
    """One problem drawn from ``rng``: ``min_ops`` to ``max_ops`` operations on a small count."""
    person, things = rng.choice(PEOPLE), rng.choice(OBJECTS)
    count = rng.randint(2, MAX_START)
    sentences = [f"{person} has {count} {things}."]
    ops = rng.randint(min_ops, max_ops)
    for _ in range(ops):
        kind = rng.choice(("buys", "gives", "times") if count <= 30 else ("buys", "gives"))
        if kind == "gives" and count < 2:
            kind = "buys"
        if kind == "buys":
            k = rng.randint(1, MAX_STEP)
            sentences.append(f"{person} buys {k} more {things}.")
            count += k
        elif kind == "gives":
            k = rng.randint(1, min(MAX_STEP, count - 1))
            sentences.append(f"{person} gives {k} {things} to a friend.")
            count -= k
        else:
            k = rng.choice((2, 3))
            sentences.append(f"Then the number of {things} {person} has {('doubles', 'triples')[k - 2]}.")
            count *= k
    sentences.append(f"How many {things} does {person} have now?")
    return Problem(" ".join(sentences), count, ops)


def problems(n: int, seed: int, min_ops: int = 1, max_ops: int = 3, exclude: frozenset[str] = frozenset()):
    """``n`` distinct problems from ``seed`` (the same list for the same arguments), none of whose questions
    is in ``exclude``."""
    rng, seen, out = random.Random(seed), set(exclude), []
    while len(out) < n:
        p = make_problem(rng, min_ops, max_ops)
        if p.question not in seen:
            seen.add(p.question)
            out.append(p)
    return out


def heldout_problems(operations: tuple[int, int] | None = None) -> list[Problem]:
    """The ``HELDOUT`` fixed evaluation problems of ``operations`` (default ``OPERATIONS``) operations (never
    the worked example's)."""
    min_ops, max_ops = operations or OPERATIONS
    return problems(HELDOUT, HELDOUT_SEED, min_ops, max_ops, exclude=frozenset({EXAMPLE_QUESTION}))


def train_problems(
    n: int, seed: int = TRAIN_SEED, operations: tuple[int, int] | None = None
) -> list[Problem]:
    """``n`` training problems of ``operations`` (default ``OPERATIONS``) operations, disjoint from the
    held-out ones of the same operations and from the worked example."""
    operations = operations or OPERATIONS
    held = frozenset(p.question for p in heldout_problems(operations))
    return problems(n, seed, *operations, exclude=held | {EXAMPLE_QUESTION})


def messages(problem: Problem) -> list[dict]:
    """The chat of a problem: the worked example (a user turn and the assistant's answer), then one user
    turn with the question and the answer's format."""
    return [
        {"role": "user", "content": f"{EXAMPLE_QUESTION} {INSTRUCTION}"},
        {"role": "assistant", "content": EXAMPLE_ANSWER},
        {"role": "user", "content": f"{problem.question} {INSTRUCTION}"},
    ]


def prompt_ids(tokenizer, problem: Problem) -> list[int]:
    """The problem rendered by the tokenizer's chat template, with the assistant's generation prompt."""
    rendered = tokenizer.apply_chat_template(messages(problem), add_generation_prompt=True, return_dict=True)
    return list(rendered["input_ids"])


@dataclass(frozen=True, slots=True)
class Grade:
    """What the rule read in a response: its final number (None: no number), whether it is right and
    whether the response has the asked format."""

    final: float | None
    correct: bool
    formatted: bool

    @property
    def reward(self) -> float:
        return CORRECT_REWARD * self.correct + FORMAT_REWARD * self.formatted


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def final_number(text: str) -> float | None:
    """The response's final number by the rule of the module docstring (None: no number)."""
    formatted = list(_FORMAT.finditer(text))
    if formatted:
        return _number(formatted[-1].group(1))
    said = list(_ANSWER_IS.finditer(text))
    if said:
        tail = text[said[-1].end() :]
        sentence = re.split(r"\n|\.(?!\d)", tail, maxsplit=1)[0]
        found = _NUMBER.findall(sentence)
        if found:
            return _number(found[-1])
    found = _NUMBER.findall(text)
    return _number(found[-1]) if found else None


def grade(text: str, answer: int) -> Grade:
    """The rule on one response ``text`` to a problem whose answer is ``answer``."""
    final = final_number(text)
    return Grade(final, final is not None and final == answer, _FORMAT.search(text) is not None)


class MathReward:
    """The rule reward of the task for the engine (``reward(prompt_ids, response_ids) -> float``): the
    answer of each prompt is looked up by its token ids (``answers``, as ``prompt_ids`` rendered them)."""

    def __init__(self, tokenizer, answers: dict[tuple[int, ...], int]) -> None:
        self.tokenizer = tokenizer
        self.answers = answers

    def grade(self, prompt: list[int], response: list[int]) -> Grade:
        text = self.tokenizer.decode(response, skip_special_tokens=True)
        return grade(text, self.answers[tuple(prompt)])

    def __call__(self, prompt: list[int], response: list[int]) -> float:
        return self.grade(prompt, response).reward


def task_prompts(tokenizer, problems_: list[Problem]) -> tuple[list[list[int]], MathReward]:
    """The problems' prompts and the reward that knows their answers."""
    ids = [prompt_ids(tokenizer, p) for p in problems_]
    return ids, MathReward(tokenizer, {tuple(i): p.answer for i, p in zip(ids, problems_, strict=True)})


@dataclass(frozen=True, slots=True)
class BatchScore:
    """A batch's accuracy (share with the right final number), the rollouts the rule could not read, and
    the share cut off at the token limit."""

    accuracy: float
    unparsed: int
    cut_off: float


def score(reward: MathReward, rollouts) -> BatchScore:
    """``BatchScore`` of ``rollouts`` (the engine's ``Rollout`` objects) under ``reward``'s rule."""
    if not rollouts:
        return BatchScore(0.0, 0, 0.0)
    grades = [reward.grade(r.prompt_ids, r.response_ids) for r in rollouts]
    n = len(rollouts)
    return BatchScore(
        sum(g.correct for g in grades) / n,
        sum(g.final is None for g in grades),
        sum(r.finish_reason in ("length", "max_model_len") for r in rollouts) / n,
    )


@torch.no_grad()
def heldout_accuracy(
    model,
    tokenizer,
    *,
    max_new_tokens: int = 128,
    batch_size: int = 50,
    rollout_dtype=None,
    limit=None,
    operations: tuple[int, int] | None = None,
) -> tuple[float, BatchScore, list]:
    """Greedy accuracy of ``model`` over the held-out problems of ``operations`` (default ``OPERATIONS``;
    ``limit``: the first ones only), through the engine: ``(accuracy, BatchScore, rollouts in problem
    order)``. The model's weights are only read."""
    from oppo_engine import EngineConfig, RolloutEngine, SamplingParams

    held = heldout_problems(operations)[:limit]
    ids, reward = task_prompts(tokenizer, held)
    # The arena is sized for what these prompts can reach, not the model's own context (8192 for SmolLM2).
    config = EngineConfig(
        batch_size=min(batch_size, len(ids)), mode="sequential", rollout_dtype=rollout_dtype,
        max_model_len=max(len(p) for p in ids) + max_new_tokens,
    )  # fmt: skip
    engine = RolloutEngine(
        model, reward, tokenizer=tokenizer, config=config,
        sampling=SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens),
    )  # fmt: skip
    try:
        engine.add_prompts(ids)
        rollouts = []
        while result := engine.step().rollouts:
            rollouts.extend(result)
    finally:
        engine.close()
    rollouts.sort(key=lambda r: r.group_id)
    batch = score(reward, rollouts)
    return batch.accuracy, batch, rollouts
