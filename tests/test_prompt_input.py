"""Prompts as users hold them: every accepted form queues exactly the token ids it holds (checked on the
rollouts' prompt_ids), padding is stripped only where a mask says so, and wrong types fail with a TypeError
that says what to do, before anything is queued."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_models import EOS, VOCAB, actor_config, make_actor
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, BatchEncoding

from oppo_engine import EngineConfig, RolloutEngine, SamplingParams
from oppo_engine.ppo.task import train_tokenizer

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<assistant> {% endif %}"
)


@pytest.fixture(scope="module")
def actor():
    return make_actor()


@pytest.fixture(scope="module")
def tokenizer():
    tok = train_tokenizer(["hello world how are you the a of user assistant < >"])
    tok.chat_template = CHAT_TEMPLATE
    return tok


def make_engine(actor, **kw) -> RolloutEngine:
    return RolloutEngine(
        actor=actor,
        reward=lambda p, r: 0.0,
        config=EngineConfig(batch_size=1, mode="sequential", max_model_len=32, page_size=8),
        sampling=SamplingParams(temperature=0.0, max_new_tokens=1),
        eos_token_id=EOS,
        **kw,
    )


def queued(engine: RolloutEngine, *args, **kwargs) -> list[list[int]]:
    """The prompt ids the engine runs, read back from its rollouts."""
    engine.add_prompts(*args, **kwargs)
    out = []
    while (result := engine.step()).rollouts:
        out += [r.prompt_ids for r in result.rollouts]
    return out


@pytest.mark.parametrize(
    ("prompts", "kwargs", "want"),
    [
        ([[5, 6], [7]], {}, [[5, 6], [7]]),
        ([[np.int64(5), torch.tensor(6)], (np.int32(7),)], {}, [[5, 6], [7]]),
        ([5, 6, 7], {}, [[5, 6, 7]]),  # one 1-D sequence is one prompt
        (torch.tensor([5, 6, 7]), {}, [[5, 6, 7]]),
        (np.array([5, 6, 7]), {}, [[5, 6, 7]]),
        (torch.tensor([[5, 6], [7, 8]]), {}, [[5, 6], [7, 8]]),
        (np.array([[5, 6], [7, 8]], dtype=np.int32), {}, [[5, 6], [7, 8]]),
        ([torch.tensor([5, 6]), np.array([7])], {}, [[5, 6], [7]]),
        # Left and right padding stripped by the mask; without a mask a row is taken whole.
        (torch.tensor([[0, 0, 5, 6], [7, 8, 9, 0]]),
         {"attention_mask": torch.tensor([[0, 0, 1, 1], [1, 1, 1, 0]])}, [[5, 6], [7, 8, 9]]),
        (torch.tensor([[0, 0, 5, 6]]), {}, [[0, 0, 5, 6]]),
        ([[0, 5, 6]], {"attention_mask": [[0, 1, 1]]}, [[5, 6]]),
        ({"input_ids": [[0, 5, 6], [7, 8, 9]], "attention_mask": [[0, 1, 1], [1, 1, 1]]}, {},
         [[5, 6], [7, 8, 9]]),
        (BatchEncoding({"input_ids": torch.tensor([[0, 5], [6, 7]]),
                        "attention_mask": torch.tensor([[0, 1], [1, 1]])}), {}, [[5], [6, 7]]),
        ([], {}, []),
    ],
)  # fmt: skip
def test_every_accepted_form_queues_exactly_its_token_ids(actor, prompts, kwargs, want):
    assert queued(make_engine(actor), prompts, **kwargs) == want


def test_one_sampling_params_applies_to_every_prompt(actor):
    engine = make_engine(actor)
    engine.add_prompts(
        [[5, 6], [7, 8]], sampling=SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True)
    )
    lengths = [len(r.response_ids) for _ in range(2) for r in engine.step().rollouts]
    assert lengths == [3, 3]


@pytest.mark.parametrize(
    ("prompts", "what"),
    [
        (["hello"], "got str in prompts[0]: tokenize first, or pass tokenizer= to the engine"),
        ("hello", "got str: tokenize first, or pass tokenizer= to the engine"),
        ([[5.7, 6.0]], "got float"),
        ([[True, 5]], "got bool"),
        ([[np.bool_(True), 5]], "got bool"),
        (torch.tensor([[5.0, 6.0]]), "dtype torch.float32"),
        (np.array([[0.5]]), "dtype float64"),
        ([[{"a": 1}]], "got dict"),
        ([{"input_ids": {"x": [1]}}], "nested mapping"),
        ({"ids": [[5]]}, "a mapping without input_ids"),
        (5, "got int"),
        ([[[5, 6]]], "got list"),
        ([[{"role": "user", "content": "hi"}]], "chat messages in prompts[0]"),
    ],
)
def test_wrong_types_raise_type_error_saying_what_to_do(actor, prompts, what):
    engine = make_engine(actor)
    with pytest.raises(TypeError, match="prompts must be token ids; got") as info:
        engine.add_prompts(prompts)
    assert what in str(info.value)
    assert queued(engine, []) == []  # nothing was queued


@pytest.mark.parametrize("sampling", ["greedy", [None], [SamplingParams(), "x"], 1.0])
def test_sampling_that_is_not_sampling_params_raises_type_error(actor, sampling):
    """docs/reliability.md: TypeError, whatever its length (a str is iterable: it was a ValueError)."""
    engine = make_engine(actor)
    with pytest.raises(TypeError, match="sampling must be a SamplingParams or a list of them"):
        engine.add_prompts([[5, 6]], sampling)
    assert queued(engine, []) == []


@pytest.mark.parametrize(
    ("prompts", "kwargs", "match"),
    [
        ([[5, VOCAB]], {}, "outside the vocabulary"),
        ([[]], {}, "is empty"),
        ([[0, 0]], {"attention_mask": [[0, 0]]}, "is empty"),
        ([[5, 6, 7]], {"attention_mask": [[1, 0, 1]]}, "masks tokens inside the prompt"),
        ([[5, 6]], {"attention_mask": [[1, 1], [1, 1]]}, "2 rows for 1 prompts"),
        ([[5, 6]], {"attention_mask": [[1]]}, "1 entries for a prompt of 2 tokens"),
        ([[5], [6]], {"sampling": [SamplingParams()]}, "1 entries for 2 prompts"),
        ([[5]], {"sampling": SamplingParams(stop_token_ids=(VOCAB,))}, "stop_token_ids holds"),
    ],
)
def test_wrong_values_raise_value_error_and_queue_nothing(actor, prompts, kwargs, match):
    engine = make_engine(actor)
    engine.add_prompts([[9, 9]])
    with pytest.raises(ValueError, match=match):
        engine.add_prompts(prompts, **kwargs)
    assert queued(engine, []) == [[9, 9]]


def test_prompt_source_items_get_the_same_treatment(actor):
    engine = make_engine(actor)
    padded = {"input_ids": [0, 8, 9], "attention_mask": [0, 1, 1]}  # one text's tokenizer output
    items = [torch.tensor([5, 6]), [np.int64(7)], "text", padded]
    engine.set_prompt_source(iter([*items, [10]]))
    assert [r.prompt_ids for _ in range(2) for r in engine.step().rollouts] == [[5, 6], [7]]
    with pytest.raises(TypeError, match="got str in a prompt from the prompt source"):
        engine.step()
    assert queued(engine, []) == [[8, 9], [10]]  # the source goes on after the bad item


def _token_actor(tokenizer):
    cfg = actor_config(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def test_text_and_chat_are_tokenized_with_the_tokenizers_defaults(tokenizer):
    engine = make_engine(_token_actor(tokenizer), tokenizer=tokenizer)
    chat = [{"role": "user", "content": "how are you"}]
    got = queued(engine, ["hello world", chat])
    want_chat = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    want_chat = want_chat["input_ids"] if isinstance(want_chat, dict | BatchEncoding) else want_chat
    assert got == [tokenizer("hello world")["input_ids"], list(want_chat)]
    assert queued(engine, "how are you") == [tokenizer("how are you")["input_ids"]]  # one text, one prompt
    assert queued(engine, chat) == [list(want_chat)]  # one conversation, one prompt


def test_tokenizer_alone_needs_no_reward_tokenizer(tokenizer):
    actor = _token_actor(tokenizer)
    torch.manual_seed(1)
    cfg = actor_config(vocab_size=len(tokenizer), num_hidden_layers=1, num_labels=1)
    reward = AutoModelForSequenceClassification.from_config(cfg, dtype=torch.float32).eval()
    engine = RolloutEngine(
        actor=actor, reward=reward, tokenizer=tokenizer,
        config=EngineConfig(batch_size=1, mode="sequential", max_model_len=32, page_size=8),
    )  # fmt: skip
    assert engine.reward_is_model  # the same vocabulary: streamed, not re-tokenized
    with pytest.raises(ValueError, match="reward_tokenizer needs tokenizer="):
        RolloutEngine(actor=actor, reward=reward, reward_tokenizer=tokenizer)
