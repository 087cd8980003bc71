"""The embedded tools task of ``oppo-engine demo --task tools``: sums the policy works out with a calculator.

A prompt asks for the sum of 2 to 4 numbers (``what is 12 + 7 + 30 ?``). The policy calls the ``add`` tool
once per ``+`` -- ``<tool_call> {"name": "add", "arguments": {"a": 12, "b": 7}} </tool_call>`` -- reads its
answer (``<tool_response> 19 </tool_response>``), calls it again on that and the next number, and ends
with ``the answer is 49 .``: 2 to 4 turns. The tool's latency follows a long-tailed law (lognormal, median
50 ms, sigma 1.5, capped at 3 s, drawn from a seed per call), as a sandbox or a search does. The reward is
1 for the right final answer, 0 otherwise: the policy must copy the numbers into its calls and the last
answer into its reply.

Everything is built locally (no hub): a byte-level BPE tokenizer with a Qwen2-style chat template (its
tool-call syntax, ``<|im_end|>`` ending a turn), and a tiny Qwen2 actor warmed up on rendered
conversations, cached in a folder (``build_tools_task``) and rebuilt only when missing.
"""

from __future__ import annotations

import json
import math
import random
import re
import time
import zlib
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

from oppo_engine.env.tools import ToolEnv

TASK_VERSION = 1
TURN_END, PAD = "<|im_end|>", "<|endoftext|>"
SPECIALS = (PAD, "<|im_start|>", TURN_END)
MAX_OPERAND = 30
MODEL_SHAPE = dict(
    hidden_size=96,
    intermediate_size=192,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
# Qwen2's tool-call syntax, with spaces around the tool's answer so that a number reads as the same token
# in the prompt, in a call's arguments and in a tool response (a byte-level BPE splits "\n19" from " 19").
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant' }}{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    '{{- \'\\n<tool_call> {"name": "\' + tool_call.function.name + \'", "arguments": \' '
    "+ tool_call.function.arguments | tojson + '} </tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response> ' + message.content + ' </tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SYSTEM = "you add numbers with the add tool , two at a time ."
_ANSWER = re.compile(r"the answer is (-?\d+)")


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def operands(rng: random.Random) -> list[int]:
    return [rng.randint(1, MAX_OPERAND) for _ in range(rng.randint(2, 4))]


def question(numbers: list[int]) -> str:
    return "what is " + " + ".join(map(str, numbers)) + " ?"


def prompt_messages(numbers: list[int]) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question(numbers)}]


def conversation(numbers: list[int]) -> list[dict]:
    """The episode a perfect policy has: one ``add`` per ``+``, then the answer."""
    messages = prompt_messages(numbers)
    total = numbers[0]
    for n in numbers[1:]:
        call = {"type": "function", "function": {"name": "add", "arguments": {"a": total, "b": n}}}
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        total = add(total, n)
        messages.append({"role": "tool", "name": "add", "content": str(total)})
    messages.append({"role": "assistant", "content": f"the answer is {total} ."})
    return messages


def prompts(tokenizer, n: int = 64, seed: int = 4321) -> list[list[int]]:
    """The demo's prompts: ``n`` sums (fixed by ``seed``), rendered with the generation prompt."""
    rng = random.Random(seed)
    return [
        tokenizer.apply_chat_template(
            prompt_messages(operands(rng)), add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for _ in range(n)
    ]


def tool_latency_s(seed: int, a: int, b: int) -> float:
    """The long-tailed latency of the call ``add(a, b)``: lognormal, median 50 ms, sigma 1.5, capped at 3 s,
    drawn from ``seed`` and the arguments (so every loop that makes the same call waits the same)."""
    z = random.Random(zlib.crc32(repr((seed, a, b)).encode())).gauss(0.0, 1.0)
    return min(3.0, 0.05 * math.exp(1.5 * z))


def slow_add(seed: int = 0):
    """The task's tool: ``add`` behind :func:`tool_latency_s` (what the demo, the bench and TRL's own tool
    loop all call)."""

    def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first number
            b: the second number
        """
        time.sleep(tool_latency_s(seed, a, b))
        return a + b

    return add


class CalculatorEnv(ToolEnv):
    """The task's slow ``add`` tool, one ``ToolEnv`` per episode."""

    def __init__(self, tokenizer, seed: int = 0) -> None:
        turn_end = tokenizer.convert_tokens_to_ids(TURN_END)
        super().__init__(tokenizer, tools=[slow_add(seed)], turn_end_token_id=turn_end)


class AnswerReward:
    """1.0 when the last ``the answer is N`` of the response is the prompt's sum, else 0.0."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def expected(self, prompt_ids: list[int]) -> int:
        text = self.tokenizer.decode(prompt_ids)
        asked = text[text.rindex("what is") :]
        return sum(int(n) for n in re.findall(r"\d+", asked))

    def __call__(self, prompt_ids: list[int], response_ids: list[int]) -> float:
        found = _ANSWER.findall(self.tokenizer.decode(response_ids))
        return float(bool(found) and int(found[-1]) == self.expected(prompt_ids))


def train_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    """A byte-level BPE over the rendered conversations, with the template's special tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=640, special_tokens=list(SPECIALS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=PAD, pad_token=PAD)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def model_config(tokenizer, num_labels: int | None = None) -> Qwen2Config:
    config = Qwen2Config(
        **MODEL_SHAPE,
        vocab_size=-(-len(tokenizer) // 16) * 16,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    if num_labels is not None:
        config.num_labels = num_labels
    return config


def warm_up_actor(tokenizer, steps: int, seed: int, log=print) -> torch.nn.Module:
    """A tiny Qwen2 trained (next token, every token) on perfect episodes, in batches of 32."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    actor = AutoModelForCausalLM.from_config(model_config(tokenizer))
    render = lambda m: tokenizer.apply_chat_template(m, tokenize=True, return_dict=False)  # noqa: E731
    data = [render(conversation(operands(rng))) for _ in range(3000)]
    optim = torch.optim.AdamW(actor.parameters(), lr=3e-3)
    pad = tokenizer.pad_token_id
    for i in range(steps):
        rows = rng.sample(data, 32)
        width = max(map(len, rows))
        ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
        attn = (torch.arange(width)[None] < torch.tensor([len(r) for r in rows])[:, None]).long()
        loss = actor(input_ids=ids, attention_mask=attn, labels=ids.masked_fill(attn == 0, -100)).loss
        optim.zero_grad()
        loss.backward()
        optim.step()
        if (i + 1) % 100 == 0:
            log(f"  tools actor warm-up {i + 1}/{steps}: loss {loss.item():.3f}")
    return actor.eval()


def build_tools_task(cache: Path, steps: int = 600, seed: int = 0, log=print) -> Path:
    """The tokenizer and warmed-up actor in ``cache`` (built once; rebuilt when the task version changed)."""
    cache = Path(cache)
    stamp = cache / "task.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("version") == TASK_VERSION:
        return cache
    log(f"building the embedded tools task in {cache} (once) ...")
    rng = random.Random(seed + 1)
    texts = [CHAT_TEMPLATE, SYSTEM] + [json.dumps(conversation(operands(rng))) for _ in range(500)]
    probe = train_tokenizer(texts)  # the conversations rendered with a first tokenizer train the final one
    rendered = [probe.apply_chat_template(conversation(operands(rng)), tokenize=False) for _ in range(2000)]
    tokenizer = train_tokenizer(rendered)
    actor = warm_up_actor(tokenizer, steps, seed, log)
    cache.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(cache / "actor")
    actor.save_pretrained(cache / "actor")
    stamp.write_text(json.dumps({"version": TASK_VERSION, "steps": steps, "seed": seed}))
    return cache


def load_tools_models(cache: Path, device: str = "cpu"):
    """``(actor, critic, reference, tokenizer)``: the warmed-up actor, a fresh one-label critic of its shape,
    and a frozen copy of the actor as the reference."""
    import copy

    tokenizer = PreTrainedTokenizerFast.from_pretrained(cache / "actor", local_files_only=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    actor = AutoModelForCausalLM.from_pretrained(cache / "actor", dtype=torch.float32, local_files_only=True)
    critic = AutoModelForSequenceClassification.from_config(model_config(tokenizer, num_labels=1))
    reference = copy.deepcopy(actor).eval().requires_grad_(False)
    return actor.to(device).train(), critic.to(device).train(), reference.to(device), tokenizer


def examples(tokenizer, rollouts, width: int = 300) -> list[str]:
    """What the demo prints of a batch: how many answers are right, how many tool calls the episodes made,
    and the best and worst episodes' transcripts (tool answers included)."""
    if not rollouts:
        return ["no rollouts"]
    right = sum(r.reward == 1.0 for r in rollouts)
    turns = sum(len(r.turns) for r in rollouts) / len(rollouts)
    lines = [f"{right}/{len(rollouts)} final answers right; {turns:.1f} turns an episode on average"]
    for label, r in (
        ("best ", max(rollouts, key=lambda r: r.reward)),
        ("worst", min(rollouts, key=lambda r: r.reward)),
    ):
        question_text = tokenizer.decode(r.prompt_ids).split("<|im_start|>user\n")[-1].split("<|im_end|>")[0]
        text = tokenizer.decode(r.response_ids).replace("\n", " ")
        if len(text) > width:
            text = text[:width] + " ..."
        lines.append(f"{label} (reward {r.reward:+.0f}, {r.finish_reason}): {question_text} -> {text}")
    return lines
