"""The embedded demo task: polite and complete answers, with long-tailed lengths.

A synthetic corpus a person can read. Most prompts ask for a short answer (``tell me about the cat .``:
one or two sentences); the others ask for a numbered list whose requested length follows a Pareto-like
law (``list 12 things about the cat .`` answered ``1 the cat is big . 2 i like the cat . ... 12 ...``),
capped at :data:`MAX_ITEMS`, so most answers are short and a few are 5-10x the median, as RLHF responses
are. Now and then an answer also says ``thank you for asking .``. The reward model is trained on pairs
ranked by one rule: **a polite and complete answer beats the others** -- polite meaning it says "thank you"
*and* still answers (a bare "thank you for asking ." ranks below), complete meaning it ends (``<eos>``)
rather than being cut off. PPO should make the actor say thank you more often, which raises the reward.

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

TASK_VERSION = 3
TOPICS = ("cat", "dog", "sea", "sun", "tree", "city", "rain", "book", "bird", "moon")
ADJECTIVES = ("big", "small", "warm", "cold", "quiet", "bright", "old", "new", "green", "blue")
VERBS = ("run", "sing", "shine", "grow", "sleep", "move", "wait", "fly")
SHORT_TEMPLATES = ("tell me about the {t} .", "what do you think of the {t} ?", "describe the {t} .")
LIST_TEMPLATE = "list {n} things about the {t} ."
POLITE = "thank you for asking ."
TARGET_WORD = "thank"
MAX_ITEMS = 24  # the longest list asked for: about 6 tokens an item, so ~150 tokens
PARETO_ALPHA = 1.1  # tail index of the requested length: P(items >= n) = n^-alpha
MAX_NEW_TOKENS = 192  # room for the longest list, a thank-you and some slack: the tail is not cut off
MODEL_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
SPECIALS = ("<pad>", "<eos>", "<unk>")


def requested_items(rng: random.Random) -> int:
    """A requested length from the Pareto-like law: ``floor(U^(-1/alpha))`` capped at ``MAX_ITEMS``; 1 means
    a short answer (about half of the prompts)."""
    return min(MAX_ITEMS, int((1.0 - rng.random()) ** (-1.0 / PARETO_ALPHA)))


def make_prompt(rng: random.Random, topic: str, items: int) -> str:
    if items == 1:
        return rng.choice(SHORT_TEMPLATES).format(t=topic)
    return LIST_TEMPLATE.format(n=items, t=topic)


def prompts(n: int = 64, seed: int = 1234) -> list[str]:
    """The demo's prompts: ``n`` drawn from the task's law (fixed by ``seed``); they are cycled."""
    rng = random.Random(seed)
    return [make_prompt(rng, rng.choice(TOPICS), requested_items(rng)) for _ in range(n)]


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


def response(
    rng: random.Random, topic: str, items: int = 1, polite: bool | None = None, p_polite: float = 0.15
) -> str:
    """The answer to a prompt asking for ``items`` things: one or two sentences for a short prompt (1), else
    the numbered list; polite (a thank-you first or last) with probability ``p_polite``."""
    if items == 1:
        parts = [_sentence(rng, topic) for _ in range(1 + (rng.random() < 0.4))]
    else:
        parts = [f"{i} {_sentence(rng, topic)}" for i in range(1, items + 1)]
    if polite if polite is not None else rng.random() < p_polite:
        parts.insert(len(parts) if rng.random() < 0.5 else 0, POLITE)
    return " ".join(parts)


def corpus(n: int, seed: int) -> list[tuple[str, str]]:
    """``n`` (prompt, response) pairs."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        topic, items = rng.choice(TOPICS), requested_items(rng)
        out.append((make_prompt(rng, topic, items), response(rng, topic, items)))
    return out


def is_polite(text: str) -> bool:
    """The rule the reward model learns: says thank you, and says more than that."""
    words = text.replace("<eos>", " ").split()
    return TARGET_WORD in words and len(words) > len(POLITE.split())


def sentences(text: str) -> list[str]:
    """``text``'s sentences (each with its ``.`` or ``?``), list numbers and ``<eos>`` left out."""
    out, words = [], []
    for word in text.replace("<eos>", " ").split():
        if word.isdigit() and not words:
            continue  # a list item's number
        words.append(word)
        if word in (".", "?"):
            out.append(" ".join(words))
            words = []
    if words:
        out.append(" ".join(words))
    return out


def requested(prompt: str) -> tuple[str | None, int]:
    """The topic a prompt asks about and how many things: ``(topic, n)`` for ``list n things about ...``,
    ``(topic, 1)`` for a short question (``None`` when no topic of the task is named)."""
    words = prompt.split()
    topic = next((w for w in words if w in TOPICS), None)
    if len(words) > 1 and words[0] == "list" and words[1].isdigit():
        return topic, int(words[1])
    return topic, 1


def broken_rules(prompt: str, answer: str, finished: bool) -> list[str]:
    """How ``answer`` breaks the task's rules (empty: it keeps them): it must say thank you and still answer
    (:func:`is_polite`), end rather than be cut off (``finished``), give the number of things asked for
    (a numbered list for ``list n things``, one or two sentences otherwise), stay on the prompt's topic,
    and never repeat a sentence three times or more -- what a reward model that is being gamed scores
    high."""
    broken = []
    if TARGET_WORD not in answer.split():
        broken.append("it never says thank you")
    elif not is_polite(answer):
        broken.append("it says only thank you")
    if not finished:
        broken.append("it is cut off")
    topic, n = requested(prompt)
    numbers = [int(w) for w in answer.split() if w.isdigit()]
    items = 0
    while items + 1 in numbers:
        items += 1
    if n > 1 and items != n:
        broken.append(f"it lists {items} thing{'s' * (items != 1)}, {n} were asked for")
    content = [x for x in sentences(answer) if x != POLITE]
    if n == 1 and (numbers or len(content) > 2):
        broken.append(f"a short answer was asked for, it gives {max(items, len(content))}")
    others = sorted({w for w in answer.split() if w in TOPICS} - {topic})
    if others:
        broken.append(f"it talks about the {', '.join(others)}, not the {topic}")
    counts: dict[str, int] = {}
    for sentence in sentences(answer):
        counts[sentence] = counts.get(sentence, 0) + 1
    repeated = [(c, x) for x, c in counts.items() if c >= 3]
    broken += [f'it repeats "{x}" {c} times' for c, x in sorted(repeated, reverse=True)]
    return broken


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
    """A tiny Qwen2 LM trained (next token, every token) on the corpus, in batches of 32 answers of similar
    length (the long tail would otherwise make every batch mostly padding)."""
    torch.manual_seed(seed)
    actor = AutoModelForCausalLM.from_config(model_config(tokenizer))
    data = sorted((_encode(tokenizer, p, r) for p, r in corpus(4000, seed)), key=len)
    batches = [data[i : i + 32] for i in range(0, len(data), 32)]
    optim = torch.optim.AdamW(actor.parameters(), lr=3e-3)
    rng = random.Random(seed)
    for i in range(steps):
        ids, attn = _pad(rng.choice(batches), tokenizer.pad_token_id)
        labels = ids.masked_fill(attn == 0, -100)
        loss = actor(input_ids=ids, attention_mask=attn, labels=labels).loss
        optim.zero_grad()
        loss.backward()
        optim.step()
        if (i + 1) % 100 == 0:
            log(f"  actor warm-up {i + 1}/{steps}: loss {loss.item():.3f}")
    return actor.eval()


def train_reward_model(tokenizer, steps: int, seed: int, log=print) -> torch.nn.Module:
    """A tiny one-label Qwen2 reward model trained on pairs of answers to the same prompt: the chosen one
    polite and complete, the rejected one not polite, a bare thank-you, or polite but cut off (no
    ``<eos>``). Bradley-Terry loss, plus a small pull of the scores towards 0 so they stay centred."""
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(model_config(tokenizer, num_labels=1))
    optim = torch.optim.AdamW(model.parameters(), lr=2e-3)
    rng = random.Random(seed + 1)
    for i in range(steps):
        rows = []
        items = requested_items(rng)  # one length per batch: little padding
        for _ in range(16):
            topic = rng.choice(TOPICS)
            prompt = make_prompt(rng, topic, items)
            rows.append(_encode(tokenizer, prompt, response(rng, topic, items, polite=True)))
            kind = rng.random()
            if kind < 0.6:
                rows.append(_encode(tokenizer, prompt, response(rng, topic, items, polite=False)))
            elif kind < 0.8:
                rows.append(_encode(tokenizer, prompt, POLITE))
            else:  # cut off: no <eos>
                full = _encode(tokenizer, prompt, response(rng, topic, items, polite=True))[:-1]
                prompt_len = len(tokenizer(prompt)["input_ids"])
                rows.append(full[: rng.randrange(prompt_len + 1, len(full))])
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
    texts = [f"{p} {r}" for p, r in corpus(4000, seed)] + [POLITE] + [str(n) for n in range(1, MAX_ITEMS + 1)]
    tokenizer = train_tokenizer(texts)
    # NOTE: one intra-op thread: these models are too small to gain from more, and on a shared CPU two
    # threads collapse (50x slower measured) as soon as another process takes a core.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        actor = warm_up_actor(tokenizer, actor_steps, seed, log)
        reward = train_reward_model(tokenizer, reward_steps, seed, log)
    finally:
        torch.set_num_threads(threads)
    for name, model in (("actor", actor), ("reward", reward)):
        model.save_pretrained(cache / name)
        tokenizer.save_pretrained(cache / name)
    tokenizer.save_pretrained(cache / "tokenizer")
    meta.write_text(json.dumps(want))
    return cache
