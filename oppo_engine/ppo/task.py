"""The embedded demo task: polite answers.

A synthetic corpus a person can read -- prompts such as ``tell me about the cat .`` answered by one to
several short sentences about the topic (long-tailed lengths), ending in ``<eos>``. Now and then an answer
also says ``thank you for asking .``. The reward model is trained on pairs ranked by one rule: **a polite
answer beats the others** -- polite meaning it says "thank you" *and* still answers (at least one sentence
about the topic; a bare "thank you for asking ." is ranked below a polite answer). PPO should make the
actor say thank you more often, which raises the reward.

Everything is built locally (no hub): a word-level tokenizer trained with the ``tokenizers`` library,
a tiny Qwen2 actor warmed up on the corpus (random weights emit noise), and a tiny Qwen2 reward model,
both cached in a folder (``build_task(cache_dir)``) and rebuilt only when missing.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

TASK_VERSION = 2
TOPICS = ("cat", "dog", "sea", "sun", "tree", "city", "rain", "book", "bird", "moon")
ADJECTIVES = ("big", "small", "warm", "cold", "quiet", "bright", "old", "new", "green", "blue")
VERBS = ("run", "sing", "shine", "grow", "sleep", "move", "wait", "fly")
PROMPT_TEMPLATES = ("tell me about the {t} .", "what do you think of the {t} ?", "describe the {t} .")
POLITE = "thank you for asking ."
TARGET_WORD = "thank"
MODEL_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
SPECIALS = ("<pad>", "<eos>", "<unk>")


def prompts() -> list[str]:
    return [p.format(t=t) for t in TOPICS for p in PROMPT_TEMPLATES]


def _sentence(rng: random.Random, topic: str) -> str:
    adj, adj2, verb = rng.choice(ADJECTIVES), rng.choice(ADJECTIVES), rng.choice(VERBS)
    return rng.choice(
        (
            f"the {topic} is {adj} .",
            f"i like the {topic} .",
            f"it is {adj} and {adj2} .",
            f"the {topic} can {verb} .",
            f"a {adj} {topic} will {verb} .",
        )
    )


def response(rng: random.Random, topic: str, polite: bool | None = None, p_polite: float = 0.15) -> str:
    """One to eight sentences (geometric: long-tailed lengths); polite with probability ``p_polite``."""
    n = 1
    while n < 8 and rng.random() < 0.45:
        n += 1
    sentences = [_sentence(rng, topic) for _ in range(n)]
    if polite if polite is not None else rng.random() < p_polite:
        sentences.insert(rng.randrange(n + 1), POLITE)
    return " ".join(sentences)


def corpus(n: int, seed: int) -> list[tuple[str, str]]:
    """``n`` (prompt, response) pairs."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        topic = rng.choice(TOPICS)
        prompt = rng.choice(PROMPT_TEMPLATES).format(t=topic)
        out.append((prompt, response(rng, topic)))
    return out


def is_polite(text: str) -> bool:
    """The rule the reward model learns: says thank you, and says more than that."""
    words = text.replace("<eos>", " ").split()
    return TARGET_WORD in words and len(words) > len(POLITE.split())


def train_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the corpus's words (readable: one token per word)."""
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=list(SPECIALS)))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def model_config(tokenizer: PreTrainedTokenizerFast, num_labels: int | None = None) -> Qwen2Config:
    vocab = -(-len(tokenizer) // 16) * 16
    config = Qwen2Config(
        **MODEL_SHAPE,
        vocab_size=vocab,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    if num_labels is not None:
        config.num_labels = num_labels
    return config


def _encode(tokenizer, prompt: str, resp: str) -> list[int]:
    return tokenizer(f"{prompt} {resp}")["input_ids"] + [tokenizer.eos_token_id]


def _pad(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    length = max(map(len, rows))
    ids = torch.tensor([r + [pad] * (length - len(r)) for r in rows])
    return ids, (ids != pad).long()


def warm_up_actor(tokenizer, steps: int, seed: int, log=print) -> torch.nn.Module:
    """A tiny Qwen2 LM trained (next token, every token) on the corpus."""
    torch.manual_seed(seed)
    actor = AutoModelForCausalLM.from_config(model_config(tokenizer))
    data = [_encode(tokenizer, p, r) for p, r in corpus(4000, seed)]
    optim = torch.optim.AdamW(actor.parameters(), lr=3e-3)
    rng = random.Random(seed)
    for i in range(steps):
        ids, attn = _pad(rng.sample(data, 32), tokenizer.pad_token_id)
        labels = ids.masked_fill(attn == 0, -100)
        loss = actor(input_ids=ids, attention_mask=attn, labels=labels).loss
        optim.zero_grad()
        loss.backward()
        optim.step()
        if (i + 1) % 100 == 0:
            log(f"  actor warm-up {i + 1}/{steps}: loss {loss.item():.3f}")
    return actor.eval()


def train_reward_model(tokenizer, steps: int, seed: int, log=print) -> torch.nn.Module:
    """A tiny one-label Qwen2 reward model trained on pairs (polite, not polite or a bare thank-you) of
    answers to the same prompt: Bradley-Terry loss, plus a small pull of the scores towards 0 so they
    stay centred."""
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(model_config(tokenizer, num_labels=1))
    optim = torch.optim.AdamW(model.parameters(), lr=2e-3)
    rng = random.Random(seed + 1)
    for i in range(steps):
        rows = []
        for _ in range(16):
            topic = rng.choice(TOPICS)
            prompt = rng.choice(PROMPT_TEMPLATES).format(t=topic)
            rows.append(_encode(tokenizer, prompt, response(rng, topic, polite=True)))
            # The rejected answer: not polite, or a bare thank-you that does not answer.
            rejected = response(rng, topic, polite=False) if rng.random() < 0.7 else POLITE
            rows.append(_encode(tokenizer, prompt, rejected))
        ids, attn = _pad(rows, tokenizer.pad_token_id)
        scores = model(input_ids=ids, attention_mask=attn).logits[:, 0]
        chosen, rejected = scores[0::2], scores[1::2]
        loss = -torch.nn.functional.logsigmoid(chosen - rejected).mean() + 1e-2 * (scores**2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        if (i + 1) % 100 == 0:
            log(f"  reward model {i + 1}/{steps}: loss {loss.item():.3f}")
    return model.eval()


def build_task(
    cache_dir: str | Path, log=print, actor_steps: int = 300, reward_steps: int = 150, seed: int = 0
) -> Path:
    """Build the tokenizer and both models into ``cache_dir`` unless already there; returns the folder.

    Layout: ``tokenizer/`` (HF fast tokenizer), ``actor/`` (causal LM, the tokenizer saved beside it),
    ``reward/`` (one-label sequence classification), ``task.json`` (what was built, written last: a
    folder without it is rebuilt)."""
    cache = Path(cache_dir)
    meta = cache / "task.json"
    want = dict(version=TASK_VERSION, actor_steps=actor_steps, reward_steps=reward_steps, seed=seed)
    if meta.exists() and json.loads(meta.read_text()) == want:
        return cache
    log(f"building the demo task into {cache} (tokenizer, actor warm-up, reward model)")
    cache.mkdir(parents=True, exist_ok=True)
    texts = [f"{p} {r}" for p, r in corpus(4000, seed)] + [POLITE]
    tokenizer = train_tokenizer(texts)
    actor = warm_up_actor(tokenizer, actor_steps, seed, log)
    reward = train_reward_model(tokenizer, reward_steps, seed, log)
    for name, model in (("actor", actor), ("reward", reward)):
        model.save_pretrained(cache / name)
        tokenizer.save_pretrained(cache / name)
    tokenizer.save_pretrained(cache / "tokenizer")
    meta.write_text(json.dumps(want))
    return cache
