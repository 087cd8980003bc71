"""A tiny chat model for the serve tests (its ``tokenizer`` and ``actor`` fixtures are every test module's,
through conftest's ``pytest_plugins``): a byte-level BPE trained here on template-like text, with the
Qwen2-style tools template of the fixtures (its end of turn, ``<|im_end|>``, is also the tokenizer's and the
model's EOS, as in real chat models), and a random ``from_config`` Qwen2 actor over its vocabulary (no
hub)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

TEMPLATE = (Path(__file__).parent / "fixtures" / "chat_templates" / "qwen2_tools.jinja").read_text()
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def chat_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [
        TEMPLATE,
        '{"name": "add", "arguments": {"a": 12, "b": 30}}',
        "what is 12 + 30 ? the answer is 42 .",
    ] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf.chat_template = TEMPLATE
    return hf


def chat_actor(tokenizer, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=-(-len(tokenizer) // 16) * 16, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first addend
        b: the second addend
    """
    return a + b


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """The serve tests' tokenizer, built once per test module."""
    return chat_tokenizer()


@pytest.fixture(scope="module")
def actor(tokenizer) -> torch.nn.Module:
    """The serve tests' actor over ``tokenizer``'s vocabulary."""
    return chat_actor(tokenizer)


class RecordedServing:
    """The serving side an ``AgentEnv`` talks to, for tests that drive its hooks directly: a request that
    streams, and every call posted to it recorded as ``(name, *args)`` (the engine is not stood in for)."""

    def __init__(self) -> None:
        self.calls: list = []
        self.stream_queue = object()  # a request streams
        self.state = "generating"
        self.server = self

    def post(self, fn, *args) -> None:
        self.calls.append((fn.__name__, *args))

    def on_tokens(self, ids, logprobs) -> None: ...

    def fail(self, message) -> None: ...
