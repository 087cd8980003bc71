"""RewardScorer: streamed, chunked incremental prefill scores equal the HF reward model on whole sequences."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, Qwen2Config

from oppo_engine.cache import KVArena, KVCacheManager, KVSpec
from oppo_engine.model.runner import ModelRunner, SeqChunk
from oppo_engine.model.scorer import RewardScorer

ATOL = 1e-4
VOCAB = 101


def reward_config(**overrides) -> Qwen2Config:
    """A tiny one-label reward model: GQA 4 / 2 heads, head_dim 16, no pad token (unpadded scoring)."""
    kw = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1, num_labels=1,
        pad_token_id=None,
    )  # fmt: skip
    return Qwen2Config(**{**kw, **overrides})


def reward_model(device, **overrides) -> torch.nn.Module:
    return AutoModelForSequenceClassification.from_config(reward_config(**overrides)).to(device).eval()


def make_scorer(model, device, *, num_pages: int = 96) -> RewardScorer:
    arena = KVArena(
        {"reward": KVSpec.from_hf_config(model.config, torch.float32)}, page_size=8, num_pages=num_pages,
        device=device,
    )  # fmt: skip
    return RewardScorer(ModelRunner(model, KVCacheManager(arena, "reward")))


@torch.no_grad()
def hf_score(model, ids) -> torch.Tensor:
    """The HF reward model's score of the whole unpadded sequence."""
    return model(torch.tensor([ids], device=model.device)).logits[0, 0].float()


@torch.no_grad()
def hf_prefix_scores(model, ids) -> torch.Tensor:
    """``[len(ids)]``: entry ``t`` is the score of ``ids[: t + 1]`` (causal attention: one forward suffices).

    This is the HF forward before it pools the last token: its score head over every position.
    """
    hidden = model.base_model(torch.tensor([ids], device=model.device)).last_hidden_state
    return model.score(hidden)[0, :, 0].float()


def stream(scorer: RewardScorer, seqs: dict, chunk_sizes) -> dict[str, list[tuple[int, torch.Tensor]]]:
    """Feed every sequence to the scorer chunk by chunk, all unfinished sequences packed in each call.

    ``chunk_sizes(seq_id)`` gives the size of the sequence's next chunk. Returns, per sequence, the
    (prefix length, score) after each of its chunks.
    """
    cache = scorer.cache
    scores: dict[str, list[tuple[int, torch.Tensor]]] = {s: [] for s in seqs}
    while any(cache.num_tokens(s) < len(ids) for s, ids in seqs.items()):
        chunks = []
        for s, ids in seqs.items():
            done = cache.num_tokens(s)
            if done < len(ids):
                new = ids[done : done + chunk_sizes(s)]
                chunks.append(SeqChunk(s, new, cache.append_slots(s, len(new))))
        scorer.prefill(chunks)
        for c in chunks:
            score = torch.tensor(scorer.result(c.seq_id), dtype=torch.float32)
            scores[c.seq_id].append((cache.num_tokens(c.seq_id), score))
    return scores


@pytest.mark.parametrize("chunk_size", [1, 7, 64])
def test_chunked_incremental_prefill_scores_equal_full_forward(chunk_size, device):
    torch.manual_seed(chunk_size)
    model = reward_model(device)
    scorer = make_scorer(model, device)
    seqs = {s: torch.randint(0, VOCAB, (n,)).tolist() for s, n in (("long", 70), ("short", 33))}

    scores = stream(scorer, seqs, lambda _: chunk_size)

    for s, ids in seqs.items():
        assert len(scores[s]) == -(-len(ids) // chunk_size)
        # Every intermediate score is the reward model's score of the prefix seen so far...
        prefix_scores = hf_prefix_scores(model, ids)
        for prefix_len, score in scores[s]:
            torch.testing.assert_close(score, prefix_scores[prefix_len - 1], atol=ATOL, rtol=0)
        # ...and the final chunk's score is the sequence's reward.
        prefix_len, reward = scores[s][-1]
        assert prefix_len == len(ids)
        torch.testing.assert_close(reward, hf_score(model, ids), atol=ATOL, rtol=0)


def test_mixed_chunk_sizes_in_one_batch_score_like_full_forward(device):
    torch.manual_seed(11)
    model = reward_model(device)
    scorer = make_scorer(model, device)
    lengths = {"one": 23, "seven": 45, "sixty_four": 130, "random": 58}
    seqs = {s: torch.randint(0, VOCAB, (n,)).tolist() for s, n in lengths.items()}
    fixed = {"one": 1, "seven": 7, "sixty_four": 64}
    rng = torch.Generator().manual_seed(12)

    def chunk_sizes(s: str) -> int:
        return fixed.get(s) or int(torch.randint(1, 20, (), generator=rng))

    scores = stream(scorer, seqs, chunk_sizes)

    for s, ids in seqs.items():
        prefix_len, reward = scores[s][-1]
        assert prefix_len == len(ids)
        torch.testing.assert_close(reward, hf_score(model, ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("chunk_size", [1, 3, 64])
def test_pad_equal_to_eos_scores_the_last_non_pad_token_like_hf(chunk_size, device):
    """With pad_token_id == EOS, HF scores the last token that is not pad: trailing EOS tokens (which may
    fill whole chunks) are skipped, and a sequence of pads alone is scored at position 0."""
    torch.manual_seed(20 + chunk_size)
    eos = 5
    model = reward_model(device, pad_token_id=eos, eos_token_id=eos)
    scorer = make_scorer(model, device)
    body = [t for t in torch.randint(0, VOCAB, (20,)).tolist() if t != eos]
    seqs = {
        "ends_in_eos": body + [eos],
        "eos_run": body[:9] + [eos] * 7,  # the scored token lies chunks before the end at small chunk sizes
        "eos_inside": body[:4] + [eos] + body[4:11],
        "only_pad": [eos] * 4,
    }
    scores = stream(scorer, seqs, lambda _: chunk_size)
    for s, ids in seqs.items():
        reward = scores[s][-1][1]
        torch.testing.assert_close(reward, hf_score(model, ids), atol=ATOL, rtol=0)
    # It holds because the convention is followed, not by accident: the last token scores differently.
    last_token = hf_prefix_scores(model, seqs["ends_in_eos"])[-1]
    assert not torch.allclose(last_token, hf_score(model, seqs["ends_in_eos"]), atol=1e-3)


def test_release_frees_every_page(device):
    torch.manual_seed(13)
    model = reward_model(device)
    scorer = make_scorer(model, device)
    allocator, num_pages = scorer.cache.arena.allocator, scorer.cache.arena.num_pages
    seqs = {s: torch.randint(0, VOCAB, (n,)).tolist() for s, n in (("a", 40), ("b", 17), ("c", 8))}
    stream(scorer, seqs, lambda _: 9)
    # A sequence dropped mid-stream (e.g. preempted) is released the same way.
    scorer.prefill([SeqChunk("d", [1, 2, 3], scorer.cache.append_slots("d", 3))])
    assert allocator.num_free() == num_pages - (5 + 3 + 1 + 1)

    for s in ("a", "b", "c", "d"):
        scorer.release(s)
    scorer.release("a")  # twice is harmless

    assert allocator.num_free() == num_pages
    assert scorer.cache.num_sequences == 0 and scorer.cache.num_pages_used == 0


def test_reward_model_with_several_labels_is_rejected():
    model = reward_model("cpu", num_labels=2)
    with pytest.raises(ValueError, match="reward.*num_labels"):
        make_scorer(model, "cpu")


def test_reward_model_without_score_head_is_rejected():
    model = reward_model("cpu")
    del model.score
    with pytest.raises(ValueError, match="reward.*score head"):
        make_scorer(model, "cpu")


def test_language_model_is_not_a_reward_scorer():
    lm = AutoModelForCausalLM.from_config(reward_config()).eval()
    arena = KVArena({"actor": KVSpec.from_hf_config(lm.config, torch.float32)}, page_size=8, num_pages=4)
    runner = ModelRunner(lm, KVCacheManager(arena, "actor"))
    with pytest.raises(ValueError, match="reward"):
        RewardScorer(runner)
    with pytest.raises(ValueError, match="actor: .*no score head"):  # named by the runner's role (its cache)
        runner.score_last([SeqChunk("s", [1], runner.cache.append_slots("s", 1))])
