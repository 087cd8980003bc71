"""Sampler: top-k / top-p truncation, temperature, behaviour log-probs, batch invariance."""

from __future__ import annotations

import pytest
import torch

from oppo_engine.model.sampler import Sampler, _truncate, _truncate_sorted

V = 64


def draw(logits, *, temperature, top_k=0, top_p=1.0, seeds, positions):
    n = logits.shape[0]
    return Sampler()(
        logits,
        temperatures=[temperature] * n,
        top_ks=[top_k] * n,
        top_ps=[top_p] * n,
        seeds=seeds,
        positions=positions,
    )


@pytest.fixture
def logits():
    return torch.randn(1, V, generator=torch.Generator().manual_seed(0)) * 3


def test_top_k_never_samples_outside_the_k_largest(logits):
    rows = logits.expand(2000, V).contiguous()
    tokens, _ = draw(rows, temperature=1.5, top_k=5, seeds=[7] * 2000, positions=list(range(2000)))
    allowed = set(logits[0].topk(5).indices.tolist())
    assert set(tokens.tolist()) == allowed  # all five drawn at least once, nothing else


def test_top_k_one_is_greedy_at_any_temperature(logits):
    tokens, _ = draw(
        logits.expand(50, V).contiguous(), temperature=2.0, top_k=1, seeds=[3] * 50, positions=list(range(50))
    )
    assert set(tokens.tolist()) == {int(logits.argmax())}


def test_top_p_keeps_the_smallest_nucleus(logits):
    temperature, top_p = 3.0, 0.7
    probs = (logits[0] / temperature).softmax(-1)
    order = probs.argsort(descending=True)
    mass_before = probs[order].cumsum(0) - probs[order]
    nucleus = set(order[mass_before < top_p].tolist())
    assert 3 <= len(nucleus) < V // 2  # the case is non-trivial on both sides
    rows = logits.expand(3000, V).contiguous()
    tokens, _ = draw(
        rows, temperature=temperature, top_p=top_p, seeds=[1] * 3000, positions=list(range(3000))
    )
    assert set(tokens.tolist()) <= nucleus
    assert len(set(tokens.tolist())) > 1


def test_logprob_is_that_of_the_truncated_tempered_distribution(logits):
    temperature, top_k = 0.7, 8
    tokens, logprobs = draw(
        logits.expand(20, V).contiguous(),
        temperature=temperature,
        top_k=top_k,
        seeds=[5] * 20,
        positions=list(range(20)),
    )
    kept = logits[0].topk(top_k).indices
    truncated = torch.full((V,), float("-inf")).scatter(0, kept, logits[0][kept])
    expected = (truncated / temperature).log_softmax(-1)
    torch.testing.assert_close(logprobs, expected[tokens], atol=1e-5, rtol=1e-5)


def test_greedy_logprob_is_of_the_unscaled_logits(logits):
    tokens, logprobs = draw(logits, temperature=0.0, top_k=3, top_p=0.5, seeds=[0], positions=[0])
    assert int(tokens[0]) == int(logits.argmax())
    assert float(logprobs[0]) == pytest.approx(float(logits[0].log_softmax(-1).max()), abs=1e-6)


def test_each_row_depends_only_on_its_logits_params_seed_and_position():
    g = torch.Generator().manual_seed(1)
    n = 12
    logits = torch.randn(n, V, generator=g) * 2
    params = dict(
        temperatures=[0.0, 0.5, 1.0, 1.3] * 3,
        top_ks=[0, 4, 0, 10] * 3,
        top_ps=[1.0, 1.0, 0.8, 0.95] * 3,
        seeds=list(range(100, 100 + n)),
        positions=list(range(7, 7 + n)),
    )
    tokens, logprobs = Sampler()(logits, **params)
    perm = torch.randperm(n, generator=g).tolist()
    shuffled = {k: [v[i] for i in perm] for k, v in params.items()}
    tokens_p, logprobs_p = Sampler()(logits[perm], **shuffled)
    assert tokens_p.tolist() == [tokens[i].item() for i in perm]
    assert logprobs_p.tolist() == [logprobs[i].item() for i in perm]
    for i in (0, 5, 11):  # and alone
        t, lp = Sampler()(logits[i : i + 1], **{k: [v[i]] for k, v in params.items()})
        assert (t.item(), lp.item()) == (tokens[i].item(), logprobs[i].item())


@pytest.mark.parametrize("vocab_size", [64, 4096, 9000, 151_936])
def test_truncate_by_prefix_equals_truncate_by_full_sort(vocab_size: int):
    """Every (top_k, top_p) regime: within the prefix, past it (full-sort fallback), untouched rows."""
    settings = [  # (top_k, top_p, temperature)
        (0, 0.9, 0.7),  # peaked: the nucleus closes inside the prefix
        (0, 0.9, 20.0),  # flat: the nucleus runs past the prefix at V = 152K
        (0, 0.999, 1.0),
        (0, 1.0, 1.0),  # untouched, in a batch that truncates
        (1, 1.0, 1.0),
        (5, 0.5, 1.3),
        (50, 1.0, 0.8),
        (4096, 0.95, 3.0),
        (4097, 0.95, 3.0),  # k just past the prefix: full sort
        (5000, 1.0, 1.0),
        (vocab_size + 7, 0.8, 1.0),  # k beyond the vocabulary keeps all of it
        (0, 0.3, 0.0),  # greedy rows truncate on logits / 1e-6
    ]
    gen = torch.Generator().manual_seed(vocab_size)
    logits = torch.randn(len(settings), vocab_size, generator=gen) * 4
    top_k = torch.tensor([s[0] for s in settings])
    top_p = torch.tensor([s[1] for s in settings])
    temperature = torch.tensor([s[2] for s in settings])
    fast = _truncate(logits, temperature, top_k, top_p)
    slow = _truncate_sorted(logits, temperature, top_k, top_p)
    assert torch.equal(fast, slow)
    assert torch.equal(fast[3], logits[3])  # top_k 0, top_p 1: nothing cut
    for i in range(len(settings)):  # and each row alone
        alone = _truncate(logits[i : i + 1], temperature[i : i + 1], top_k[i : i + 1], top_p[i : i + 1])
        assert torch.equal(alone[0], fast[i])
        # The normalisation decided from host values (as the engine does) picks the same path.
        hosted = _truncate(*(t[i : i + 1] for t in (logits, temperature, top_k, top_p)), [settings[i][0]])
        assert torch.equal(hosted[0], fast[i])


def test_untruncated_row_is_unchanged_by_truncated_rows_in_its_batch():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 5000, generator=g) * 2
    params = dict(temperatures=[1.0, 1.0], top_ks=[0, 20], top_ps=[1.0, 0.9], seeds=[1, 2], positions=[3, 4])
    tokens, logprobs = Sampler()(logits, **params)
    alone = Sampler()(logits[:1], **{k: v[:1] for k, v in params.items()})
    assert (tokens[0].item(), logprobs[0].item()) == (alone[0].item(), alone[1].item())
