"""``ToolEnv``: tool calls parsed from a turn's text, results rendered through the chat template, only the
suffix a tool message adds appended. The property: the tokens of prompt, turns and observations equal a fresh
render of the whole conversation, for a Qwen2-style and a Llama-3.1-style template (fixtures, no hub); a
template that rewrites earlier turns is refused."""

from __future__ import annotations

import asyncio
import inspect
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from oppo_engine import Observation, ToolEnv
from oppo_engine.env.tools import parse_tool_calls

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
SPECIALS = {
    "qwen2": dict(eos="<|im_end|>", bos=None),
    "llama3": dict(eos="<|eot_id|>", bos="<|begin_of_text|>"),
}
ALL_SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
    "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
]  # fmt: skip


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first addend
        b: the second addend
    """
    return a + b


def divide(a: float, b: float) -> float:
    """Divide a by b.

    Args:
        a: the dividend
        b: the divisor
    """
    return a / b


async def slow_add(a: int, b: int) -> int:
    """Add two integers, eventually.

    Args:
        a: the first addend
        b: the second addend
    """
    await asyncio.sleep(0.001)
    return a + b


def tokenizer_for(family: str) -> PreTrainedTokenizerFast:
    """A small byte-level BPE (trained here on template-like text) with every special token of both
    families, and the family's chat template from the fixtures."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = (TEMPLATES / f"{family}_tools.jinja").read_text()
    corpus = [text, '{"name": "add", "arguments": {"a": 12, "b": 30}}', "0123456789 the answer is 42 ."] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=700, special_tokens=ALL_SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    specials = SPECIALS[family]
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=specials["eos"], bos_token=specials["bos"], pad_token="<|endoftext|>"
    )
    hf.chat_template = text
    return hf


def call(name: str, **arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def conversation(family: str) -> list[dict]:
    """A user question, two tool-calling turns (two calls at once where the template renders several) and
    the final answer."""
    first = (
        [call("add", a=12, b=30), call("add", a=1, b=2)] if family == "qwen2" else [call("add", a=12, b=30)]
    )
    return [
        {"role": "user", "content": "what is 12 + 30, then divided by 2?"},
        {"role": "assistant", "content": "", "tool_calls": first},
        *[{"role": "tool", "name": "add", "content": str(add(**c["function"]["arguments"]))} for c in first],
        {"role": "assistant", "content": "", "tool_calls": [call("divide", a=42, b=2)]},
        {"role": "tool", "name": "divide", "content": str(42 / 2)},
        {"role": "assistant", "content": "the answer is 21.0"},
    ]


@pytest.mark.parametrize("family", ["qwen2", "llama3"])
def test_prompt_turns_and_observations_equal_a_fresh_render_of_the_whole_conversation(family):
    tokenizer = tokenizer_for(family)
    env = ToolEnv(tokenizer, tools=[add, divide])
    messages = conversation(family)
    render = env._render
    transcript = env.prompt_ids(messages[:1])
    env.reset(transcript)
    history = messages[:1]
    observations = 0
    for i, message in enumerate(messages[1:], start=1):
        if message["role"] != "assistant":
            history.append(message)
            continue
        history.append(message)
        # What the model samples for this turn: its message as the template renders it, up to the turn end.
        rendered = render(history, add_generation_prompt=False)
        assert rendered[: len(transcript)] == transcript, "the template is not append-only here"
        rest = rendered[len(transcript) :]
        turn = rest[: rest.index(env.turn_end_token_id) + 1]
        obs = env.step(turn)
        assert isinstance(obs, Observation)
        transcript = transcript + turn + obs.tokens
        if i == len(messages) - 1:
            assert obs.done and obs.tokens == []  # no tool call: the episode ends
        else:
            assert not obs.done and obs.tokens
            observations += 1
    assert observations == 2
    full = render(messages, add_generation_prompt=False)
    assert full[: len(transcript)] == transcript
    # After the last turn's end token the template adds only whitespace.
    assert tokenizer.decode(full[len(transcript) :]).strip() == ""


@pytest.mark.parametrize("family", ["qwen2", "llama3"])
def test_the_tool_results_are_what_the_functions_return(family):
    tokenizer = tokenizer_for(family)
    env = ToolEnv(tokenizer, tools=[add, divide])
    text = tokenizer.decode(env.tool_suffix_ids([("add", "42")]))
    assert "42" in text
    assert text.rstrip().endswith(
        "assistant<|end_header_id|>" if family == "llama3" else "<|im_start|>assistant"
    )


def qwen_turn(tokenizer, body: str) -> list[int]:
    return tokenizer(body + "<|im_end|>")["input_ids"]


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ('<tool_call>\n{"name": "multiply", "arguments": {"a": 2}}\n</tool_call>', "unknown tool 'multiply'"),
        ('<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>', "bad arguments for tool 'add'"),
        (
            '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3, "c": 4}}\n</tool_call>',
            "bad arguments",
        ),
        ('<tool_call>\n{"name": "divide", "arguments": {"a": 1, "b": 0}}\n</tool_call>', "ZeroDivisionError"),
        ('<tool_call>\n{"name": "add", "arguments": {"a": 2,\n</tool_call>', "not valid JSON"),
    ],
)
def test_an_unknown_tool_or_bad_arguments_go_back_to_the_model_as_the_tools_output(body, expected):
    tokenizer = tokenizer_for("qwen2")
    env = ToolEnv(tokenizer, tools=[add, divide])
    obs = env.step(qwen_turn(tokenizer, body))
    assert not obs.done
    text = tokenizer.decode(obs.tokens)
    assert "<tool_response>" in text and expected in text


def test_several_calls_in_one_turn_answer_in_order():
    tokenizer = tokenizer_for("qwen2")
    env = ToolEnv(tokenizer, tools=[add])
    body = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 30, "b": 4}}\n</tool_call>'  # noqa: E501
    text = tokenizer.decode(env.step(qwen_turn(tokenizer, body)).tokens)
    assert text.index("\n3\n") < text.index("\n34\n")


def test_a_template_that_rewrites_earlier_turns_is_refused():
    tokenizer = tokenizer_for("qwen2")
    with pytest.raises(ValueError, match="rewrites the assistant turn"):
        ToolEnv(
            tokenizer, tools=[add], chat_template=(TEMPLATES / "rewrites_earlier_turns.jinja").read_text()
        )


def test_a_tool_without_type_hints_or_docstring_is_refused():
    def bare(a, b):
        return a

    with pytest.raises(ValueError, match="tool 'bare' needs type hints"):
        ToolEnv(tokenizer_for("qwen2"), tools=[bare])


def test_async_tools_make_step_a_coroutine():
    tokenizer = tokenizer_for("qwen2")
    env = ToolEnv(tokenizer, tools=[slow_add])
    pending = env.step(
        qwen_turn(tokenizer, '<tool_call>\n{"name": "slow_add", "arguments": {"a": 5, "b": 6}}\n</tool_call>')
    )
    assert inspect.iscoroutine(pending)
    assert "\n11\n" in tokenizer.decode(asyncio.run(pending).tokens)


def test_parse_tool_calls_reads_both_syntaxes():
    assert parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>') == [
        ("add", {"a": 1, "b": 2}, None)
    ]
    assert parse_tool_calls('{"name": "add", "parameters": {"a": 1, "b": 2}}<|eot_id|>') == [
        ("add", {"a": 1, "b": 2}, None)
    ]
    assert parse_tool_calls("the answer is 3<|im_end|>") == []
