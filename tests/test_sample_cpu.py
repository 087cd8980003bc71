"""torch.ops.oppo.sample (the C++ CPU sampler) against sample_ref: exact tokens, accurate log-probs, batch
and thread-count invariance, masking, its distribution, and its argument checks."""

from __future__ import annotations

import math

import pytest
import torch

from oppo_engine import ops
from oppo_engine.kernels.sample import _KEY2_SALT, _KEY_SALT, _MASK32, _mix32_ref, sample_ref

sample_cpu = torch.ops.oppo.sample

# (dtype, atol, rtol) of the log-prob against float64 log_softmax of the same (upcast, tempered) logits.
# The op adds per-tile float sums in double; torch's fp32 log_softmax (sample_ref) drifts further on a
# 152K vocabulary (~1.6e-5 at log-prob -10), so the comparison with sample_ref allows that drift.
LOGPROB_TOL = {torch.float32: (1e-6, 1e-6), torch.bfloat16: (1e-6, 1e-6), torch.float16: (1e-6, 1e-6)}
REF_LOGPROB_TOL = dict(atol=1e-6, rtol=4e-6)


def make_rows(num_rows: int, vocab_size: int, dtype: torch.dtype = torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn((num_rows, vocab_size), generator=gen)).to(dtype)
    temperature = torch.rand(num_rows, generator=gen) * 1.5 + 0.25
    temperature[::3] = 0.0  # every third row greedy
    # Seeds and positions with the high 32 bits set (and negative seeds): both halves feed the row key.
    seeds = torch.randint(-(2**62), 2**62, (num_rows,), generator=gen)
    positions = torch.randint(0, 2**40, (num_rows,), generator=gen)
    return logits, temperature, seeds, positions


def exact_logprobs(logits: torch.Tensor, temperature: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """float64 log_softmax of the fp32-tempered logits (the op's z) at ``tokens``."""
    inv_t = torch.where(temperature > 0, 1.0 / temperature, torch.ones_like(temperature))
    z = (logits.float() * inv_t[:, None]).double()
    return torch.log_softmax(z, dim=-1).gather(1, tokens[:, None]).squeeze(1)


def assert_matches_reference(logits, temperature, seeds, positions) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, logprobs = sample_cpu(logits, temperature, seeds, positions)
    ref_tokens, ref_logprobs = sample_ref(logits, temperature, seeds, positions)
    assert torch.equal(tokens, ref_tokens)
    atol, rtol = LOGPROB_TOL[logits.dtype]
    torch.testing.assert_close(
        logprobs.double(), exact_logprobs(logits, temperature, tokens), atol=atol, rtol=rtol
    )
    torch.testing.assert_close(logprobs, ref_logprobs, **REF_LOGPROB_TOL)
    return tokens, logprobs


@pytest.mark.parametrize(("num_rows", "vocab_size"), [(24, 1), (24, 7), (24, 513), (24, 4097), (3, 151_936)])
def test_tokens_equal_reference_and_logprobs_are_accurate(num_rows: int, vocab_size: int):
    assert_matches_reference(*make_rows(num_rows, vocab_size, seed=vocab_size))


def exact_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The noise ``g [N, V]`` as the op defines it: each log taken in float64 and rounded to fp32."""
    key = _mix32_ref((seeds & _MASK32) ^ _KEY_SALT)
    key = _mix32_ref(key ^ ((seeds >> 32) & _MASK32))
    key = _mix32_ref(key ^ (positions & _MASK32))
    key = _mix32_ref(key ^ ((positions >> 32) & _MASK32))
    key2 = _mix32_ref(key ^ _KEY2_SALT)
    idx = torch.arange(vocab_size, dtype=torch.int64)
    h = _mix32_ref(_mix32_ref(key[:, None] ^ idx[None, :]) ^ key2[:, None])
    u = ((h >> 9).to(torch.float32) + 0.5) * 2.0**-23
    return -torch.log((-torch.log(u.double()).float()).double()).float()


def exact_noise_tokens(logits, temperature, seeds, positions) -> torch.Tensor:
    inv_t = torch.where(temperature > 0, 1.0 / temperature, torch.ones_like(temperature))
    z = logits.float() * inv_t[:, None]
    y = z + exact_noise(seeds, positions, logits.shape[1])
    return torch.where((temperature > 0)[:, None], y, z).argmax(dim=-1)


@pytest.mark.parametrize(("num_rows", "vocab_size", "scale"), [(512, 3000, 3.0), (4, 151_936, 3.0)])
def test_tokens_are_the_argmax_under_the_exactly_rounded_noise(num_rows: int, vocab_size: int, scale: float):
    logits, temperature, seeds, positions = make_rows(num_rows, vocab_size, seed=int(100 * scale))
    tokens, _ = sample_cpu(logits, temperature, seeds, positions)
    assert torch.equal(tokens, exact_noise_tokens(logits, temperature, seeds, positions))


@pytest.mark.parametrize("jitter", [0.0, 1e-7])
def test_near_ties_under_the_noise_are_decided_by_the_exact_noise(jitter: float):
    """Logits of -g (+ a jitter below g's ULP) make every z + g tie, or nearly, under the exact noise; the
    fast fp32 noise, which only shortlists candidates, is one ULP off on ~2% of tokens and would pick one
    of those. The exact noise decides, and exact ties go to the lowest index."""
    num_rows, vocab_size = 64, 5000
    _, _, seeds, positions = make_rows(num_rows, vocab_size, seed=22)
    gen = torch.Generator().manual_seed(5)
    noise = exact_noise(seeds, positions, vocab_size)
    logits = -noise + jitter * torch.randn(num_rows, vocab_size, generator=gen)
    temperature = torch.ones(num_rows)
    tokens, _ = sample_cpu(logits, temperature, seeds, positions)
    assert torch.equal(tokens, exact_noise_tokens(logits, temperature, seeds, positions))
    if jitter == 0.0:
        assert tokens.tolist() == [0] * num_rows


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab_size", [513, 151_936])
def test_half_precision_logits_match_reference(dtype: torch.dtype, vocab_size: int):
    assert_matches_reference(*make_rows(3 if vocab_size > 10_000 else 24, vocab_size, dtype, seed=11))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab_size", [513, 49_152])
def test_half_precision_logits_give_the_float32_results_bit_for_bit(dtype: torch.dtype, vocab_size: int):
    # The actor hands the sampler its logits in the model's dtype (no [N, V] float32 copy): widening is
    # exact, so tokens and log-probs are those of the same logits in float32, bit for bit.
    logits, temperature, seeds, positions = make_rows(16, vocab_size, dtype, seed=12)
    tokens, logprobs = ops.sample(logits, temperature, seeds, positions)
    tokens32, logprobs32 = ops.sample(logits.float(), temperature, seeds, positions)
    assert torch.equal(tokens, tokens32)
    assert torch.equal(logprobs, logprobs32)


@pytest.mark.parametrize("temperature", [1e-3, 0.1, 1.0, 7.5])
def test_extreme_temperatures_match_reference(temperature: float):
    logits, _, seeds, positions = make_rows(16, 9000, seed=12)
    assert_matches_reference(logits, torch.full((16,), temperature), seeds, positions)


def test_masked_logits_are_never_sampled_and_match_reference():
    num_rows, vocab_size = 32, 9000  # three tiles: some rows have a whole tile masked
    logits, temperature, seeds, positions = make_rows(num_rows, vocab_size, seed=13)
    gen = torch.Generator().manual_seed(1)
    allowed = torch.rand((num_rows, vocab_size), generator=gen) < 0.02
    allowed[:8, 4096:] = False  # tiles 1 and 2 fully masked
    allowed[8:12, :8192] = False  # only the last, partial tile has finite logits
    allowed[:, 5] = True
    # Rows with a single finite logit, in the first, a middle and the last tile.
    for row, only in ((12, 0), (13, 4100), (14, vocab_size - 1), (15, 7)):
        allowed[row] = False
        allowed[row, only] = True
    logits = logits.masked_fill(~allowed, float("-inf"))
    temperature[::2] = 5.0  # flat distributions: the noise decides
    tokens, logprobs = assert_matches_reference(logits, temperature, seeds, positions)
    assert allowed.gather(1, tokens[:, None]).all()
    assert torch.isfinite(logprobs).all()
    assert tokens[12:16].tolist() == [0, 4100, vocab_size - 1, 7]
    assert logprobs[12:16].tolist() == [0.0, 0.0, 0.0, 0.0]


def test_greedy_rows_take_the_lowest_index_on_ties_within_and_across_tiles():
    logits, _, seeds, positions = make_rows(4, 9000, seed=14)
    top = float(logits.max()) + 1.0
    logits[0, [7, 3, 40]] = top  # same tile, different vector lanes
    logits[1, [4096 + 5, 8200, 5 + 8]] = top  # across tiles, first one in the first tile
    logits[2, [8999, 4097]] = top
    tokens, _ = assert_matches_reference(logits, torch.zeros(4), seeds, positions)
    assert tokens.tolist()[:3] == [3, 13, 4097]
    assert torch.equal(tokens, logits.argmax(dim=-1))


def test_all_greedy_batch_is_argmax_with_unscaled_logprob():
    logits, _, seeds, positions = make_rows(16, 151_936, seed=15)
    tokens, logprobs = sample_cpu(logits, torch.zeros(16), seeds, positions)
    assert torch.equal(tokens, logits.argmax(dim=-1))
    expected = torch.log_softmax(logits.double(), dim=-1).gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(logprobs.double(), expected, atol=1e-6, rtol=1e-6)


def test_row_result_is_bitwise_independent_of_batch_and_position():
    logits, temperature, seeds, positions = make_rows(64, 5000, seed=16)
    tokens, logprobs = sample_cpu(logits, temperature, seeds, positions)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    p_tokens, p_logprobs = sample_cpu(logits[perm], temperature[perm], seeds[perm], positions[perm])
    assert torch.equal(p_tokens, tokens[perm])
    assert torch.equal(p_logprobs, logprobs[perm])
    for rows in ([5], [63], [30, 2, 11], list(range(20, 37))):
        idx = torch.tensor(rows)
        s_tokens, s_logprobs = sample_cpu(logits[idx], temperature[idx], seeds[idx], positions[idx])
        assert torch.equal(s_tokens, tokens[idx])
        assert torch.equal(s_logprobs, logprobs[idx])


@pytest.mark.parametrize(("num_rows", "vocab_size"), [(1, 151_936), (16, 151_936), (64, 513)])
def test_result_is_bitwise_independent_of_thread_count(num_rows: int, vocab_size: int):
    args = make_rows(num_rows, vocab_size, seed=17)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = sample_cpu(*args)
        torch.set_num_threads(max(2, saved))
        many = sample_cpu(*args)
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(one[0], many[0])
    assert torch.equal(one[1], many[1])


def test_seed_and_position_high_halves_change_the_draw():
    num_rows, vocab_size = 256, 64
    logits = torch.zeros((num_rows, vocab_size))  # uniform: the draw is the noise alone
    temperature = torch.ones(num_rows)
    seeds = torch.full((num_rows,), 7, dtype=torch.int64)
    positions = torch.arange(num_rows, dtype=torch.int64)
    first, _ = sample_cpu(logits, temperature, seeds, positions)
    # Independent draws from 64 tokens agree 4 times in 256 on average; 20 is > 8 sigma away.
    for s, p in ((seeds + 2**32, positions), (seeds, positions + 2**32), (seeds - 2**63, positions)):
        other, _ = sample_cpu(logits, temperature, s, p)
        assert (other == first).sum() < 20
        assert torch.equal(other, sample_ref(logits, temperature, s, p)[0])


def _chi_square_sf_even_df(stat: float, df: int) -> float:
    """P(X >= stat) for X ~ chi-square with an even number of degrees of freedom (closed form)."""
    half = stat / 2
    return math.exp(-half) * sum(half**k / math.factorial(k) for k in range(df // 2))


@pytest.mark.parametrize("vocab_size", [9, 8500])
def test_token_frequencies_match_softmax_by_chi_square(vocab_size: int):
    """20,000 draws at T = 0.7 fit softmax(logits / T), counted in 9 bins: chi-square, 8 degrees of freedom.

    With 8,500 tokens the bins are contiguous index ranges spanning all three vocabulary tiles, so the
    per-tile partials must combine right. The test fails when the p-value is below 1e-4: a perfect sampler
    fails it for one seed in 10,000. The RNG is deterministic, so for these seeds the outcome is fixed.
    """
    num_draws, num_bins, temp = 20_000, 9, 0.7
    row = torch.randn(vocab_size, generator=torch.Generator().manual_seed(3))
    logits = row.expand(num_draws, vocab_size)  # row stride 0: every draw reads the same row
    temperature = torch.full((num_draws,), temp)
    seeds = torch.full((num_draws,), 1234, dtype=torch.int64)
    positions = torch.arange(num_draws, dtype=torch.int64) + 2**33
    tokens, _ = sample_cpu(logits, temperature, seeds, positions)
    bin_of = torch.arange(vocab_size) * num_bins // vocab_size
    counts = torch.bincount(bin_of[tokens], minlength=num_bins).double()
    probs = torch.softmax(row.double() / temp, dim=0)
    expected = torch.zeros(num_bins, dtype=torch.float64).index_add_(0, bin_of, probs) * num_draws
    assert expected.min() > 5  # the chi-square approximation holds
    stat = float(((counts - expected) ** 2 / expected).sum())
    assert _chi_square_sf_even_df(stat, num_bins - 1) > 1e-4, (
        f"chi-square {stat:.1f}, counts {counts.tolist()}"
    )


def test_bad_arguments_raise_value_error_naming_the_argument():
    logits, temperature, seeds, positions = make_rows(4, 10)
    bad = [
        ("logits", (logits[0], temperature, seeds, positions)),
        ("logits", (logits[:, :0], temperature, seeds, positions)),
        ("logits", (logits.double(), temperature, seeds, positions)),
        ("logits", (logits.long(), temperature, seeds, positions)),
        ("logits", (logits.t().contiguous().t(), temperature, seeds, positions)),
        ("temperature", (logits, temperature.double(), seeds, positions)),
        ("temperature", (logits, temperature[:, None], seeds, positions)),
        ("seeds", (logits, temperature, seeds.int(), positions)),
        ("positions", (logits, temperature, seeds, positions[:3])),
    ]
    for name, args in bad:
        with pytest.raises(ValueError, match=f"sample: {name} "):
            sample_cpu(*args)


def test_empty_batch_returns_empty_outputs():
    tokens, logprobs = sample_cpu(*make_rows(0, 50))
    assert tokens.shape == (0,) and tokens.dtype == torch.int64
    assert logprobs.shape == (0,) and logprobs.dtype == torch.float32


def test_strided_rows_are_read_in_place():
    logits, temperature, seeds, positions = make_rows(8, 700, seed=18)
    padded = torch.randn(8, 1024)
    padded[:, :700] = logits
    tokens, logprobs = sample_cpu(padded[:, :700], temperature, seeds, positions)
    expected = sample_cpu(logits, temperature, seeds, positions)
    assert torch.equal(tokens, expected[0])
    assert torch.equal(logprobs, expected[1])


def test_ops_sample_runs_the_cpp_op_on_cpu():
    args = make_rows(8, 300, seed=19)
    tokens, logprobs = ops.sample(*args)
    expected = sample_cpu(*args)
    assert torch.equal(tokens, expected[0])
    assert torch.equal(logprobs, expected[1])


def test_opcheck():
    for args in (make_rows(5, 300, seed=20), make_rows(2, 5000, torch.bfloat16, seed=21)):
        torch.library.opcheck(torch.ops.oppo.sample.default, args)
