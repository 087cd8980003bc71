"""The C++ CPU paged attention op (``torch.ops.oppo.paged_attention``) against ``paged_attention_ref``.

Cases come from ``paged_cases``: caches are strided views of a byte arena in which everything the op must
not read is NaN, and outputs start as NaN, so a stray read or an unwritten element fails the comparison.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from paged_cases import LAYER, NUM_LAYERS, Case, dense_causal_attention_f64, make_case

from oppo_engine import ops
from oppo_engine.kernels.paged_attention import paged_attention_ref

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the cases are built on the CPU here")

# (atol, rtol). fp32: both accumulate in fp32 in different orders. Half precision: both round the same fp32
# result to q's dtype, so they differ by about one ulp of the output (bf16: 2^-8 relative).
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1e-2, 1.6e-2),
}

# Decode and chunked prefill together: a one-token sequence, pages exactly full, a chunk starting mid-page,
# a sequence with no new token this step, a chunk longer than one work item.
MIXED = [(1, 70), (33, 33), (1, 1), (0, 20), (9, 100), (1, 16), (12, 48), (1, 32)]


def run_op(case: Case, sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    out = torch.full_like(case.q, float("nan"))
    torch.ops.oppo.paged_attention(*case.args(), sliding_window or 0, softcap or 0.0, out)
    return out


def assert_op_matches_reference(case: Case, sliding_window: int | None = None, softcap: float | None = None):
    got = run_op(case, sliding_window, softcap)
    expected = paged_attention_ref(*case.args(), sliding_window=sliding_window, softcap=softcap)
    assert not expected.isnan().any(), "the reference read a poisoned element"
    atol, rtol = TOLERANCES[case.q.dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("head_dim", [16, 24, 64, 80])
@pytest.mark.parametrize("page_size", [8, 16, 32])
def test_matches_reference_for_head_dims_and_page_sizes(head_dim: int, page_size: int):
    case = make_case(MIXED, head_dim=head_dim, page_size=page_size, seed=head_dim + page_size)
    assert_op_matches_reference(case)


@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(4, 4), (8, 2), (6, 2), (7, 1), (14, 2), (16, 1)])
@pytest.mark.parametrize("head_dim", [24, 64])
def test_gqa_groups_match_reference(num_q_heads: int, num_kv_heads: int, head_dim: int):
    # Groups of 1, 3, 4, 7 and 16 heads: odd row counts, and decode rows both under and over the count at
    # which the op switches from per-key dot products to transposed key tiles (8).
    case = make_case(
        MIXED, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, seed=num_q_heads
    )
    assert_op_matches_reference(case)


def test_decode_batch_matches_reference_for_one_token_and_full_page_contexts():
    assert_op_matches_reference(make_case([(1, 1), (1, 16), (1, 32), (1, 17), (1, 1)], seed=1))


def test_long_prefill_chunk_split_into_work_items_matches_reference():
    # 130 new tokens x 4 heads per KV head = 520 rows: several work items per (sequence, KV head).
    assert_op_matches_reference(make_case([(130, 150), (1, 90)], num_q_heads=8, num_kv_heads=2, seed=2))


@pytest.mark.parametrize("window", [1, 3, 16, 40, 1000], ids=lambda w: f"window{w}")
@pytest.mark.parametrize("softcap", [None, 30.0], ids=["no_cap", "cap30"])
def test_sliding_window_and_softcap_match_reference(window: int, softcap: float | None):
    # 16 = the page size; 1000 > every context. Table entries before every window point at NaN pages.
    case = make_case(MIXED, num_q_heads=6, num_kv_heads=2, seed=3, window=window)
    case.q *= 4  # scores past the cap
    assert_op_matches_reference(case, window, softcap)


def test_softcap_without_window_matches_reference():
    case = make_case(MIXED, num_q_heads=8, num_kv_heads=2, head_dim=80, seed=4)
    case.q *= 4
    assert_op_matches_reference(case, softcap=2.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 10])
def test_half_precision_matches_reference(dtype: torch.dtype, window: int | None):
    case = make_case(MIXED, num_q_heads=6, num_kv_heads=2, head_dim=80, dtype=dtype, seed=5, window=window)
    assert_op_matches_reference(case, window, softcap=30.0 if window else None)


@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads", "head_dim", "window", "softcap"),
    [
        (9, 3, 64, None, None),
        (6, 2, 80, 10, 30.0),
        (16, 1, 24, None, 3.0),
        (4, 2, 8, 5, None),
        (10, 2, 128, 9, 30.0),
    ],
    ids=["smollm2_gqa", "d80_window_cap", "d24_16_rows", "d8_window", "d128_gqa5_window_cap"],
)
def test_bf16_equals_fp32_over_the_same_values_bit_for_bit(
    num_q_heads: int, num_kv_heads: int, head_dim: int, window: int | None, softcap: float | None
):
    # bf16 K/V are widened to fp32 exactly and go through the fp32 path's arithmetic in its order, so the
    # bf16 output is the fp32 output over the bf16 values, rounded once to bf16. Decode rows and prefill
    # chunks (transposed key tiles past 8 rows), head dims with and without a partial vector.
    case = make_case(
        MIXED,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=torch.bfloat16,
        seed=head_dim,
        window=window,
    )
    as_fp32 = Case(
        case.q.float(),
        case.kv_cache.float(),
        case.block_tables,
        case.context_lens,
        case.cu_seqlens_q,
        case.scale,
    )
    got = run_op(case, window, softcap)
    expected = run_op(as_fp32, window, softcap)
    assert not expected.isnan().any()
    assert torch.equal(got, expected.to(torch.bfloat16))


# A decode batch: contexts of one key, under and over a tile (32) and the prefetch distance (8), not a
# multiple of four keys, across pages.
DECODE = [(1, 1), (1, 3), (1, 8), (1, 9), (1, 33), (1, 70), (1, 257)]


@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads"), [(3, 3), (9, 3), (8, 1), (10, 2), (16, 4)], ids=lambda v: str(v)
)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("window", "softcap"), [(None, None), (7, 30.0), (40, None)], ids=["plain", "w7cap", "w40"]
)
def test_decode_items_over_every_kv_head_match_reference(
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    window: int | None,
    softcap: float | None,
):
    # One-token sequences whose head_dim fills whole vectors are one work item over every KV head (rows of
    # 1 to 8 query heads per KV head, in register blocks of up to four), reading K and V in place; with
    # more threads than such sequences, one item per KV head. Both shapes, whatever this machine's threads.
    case = make_case(
        DECODE,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        seed=num_q_heads + head_dim,
        window=window,
    )
    case.q *= 3
    expected = dense_causal_attention_f64(case, window=window, softcap=softcap)
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    threads = torch.get_num_threads()
    try:
        for n in (1, len(DECODE) + 1):
            torch.set_num_threads(n)
            assert_op_matches_reference(case, window, softcap)
            torch.testing.assert_close(run_op(case, window, softcap).double(), expected, atol=atol, rtol=atol)
    finally:
        torch.set_num_threads(threads)


def test_decode_items_read_a_padded_page_stride():
    # Pages of a fixed byte size (page_pad_bytes), the heads of a key's row read at the cache's own strides.
    case = make_case(
        DECODE, num_q_heads=9, num_kv_heads=3, dtype=torch.bfloat16, page_pad_bytes=4096 + 6, seed=13
    )
    assert_op_matches_reference(case, 12)


@pytest.mark.parametrize(("window", "softcap"), [(None, None), (1, None), (7, 20.0), (None, 3.0)])
def test_matches_dense_attention_in_float64(window: int | None, softcap: float | None):
    case = make_case([(1, 1), (1, 33), (12, 12), (7, 40)], num_q_heads=6, num_kv_heads=2, head_dim=80, seed=6)
    case.q *= 3
    expected = dense_causal_attention_f64(case, window=window, softcap=softcap)
    torch.testing.assert_close(run_op(case, window, softcap).double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", range(12))
def test_random_batches_match_reference(seed: int):
    # Random mixes of everything above: batch, lengths, heads, head_dim, page size, dtype, window, softcap.
    gen = torch.Generator().manual_seed(100 + seed)

    def pick(options: list):
        return options[int(torch.randint(len(options), (), generator=gen))]

    seqs = []
    for _ in range(int(torch.randint(1, 7, (), generator=gen))):
        ctx = int(torch.randint(1, 90, (), generator=gen))
        q_len = pick([1, 1, ctx, int(torch.randint(0, ctx + 1, (), generator=gen))])
        seqs.append((q_len, ctx))
    num_kv_heads, group = pick([1, 2, 3]), pick([1, 2, 3, 4, 7, 9])
    dtype = pick([torch.float32, torch.float32, torch.bfloat16, torch.float16])
    window = pick([None, 1, 2, 5, 17, 64])
    case = make_case(
        seqs,
        num_q_heads=num_kv_heads * group,
        num_kv_heads=num_kv_heads,
        head_dim=pick([8, 16, 24, 40, 64, 80, 96, 128]),
        dtype=dtype,
        page_size=pick([8, 16, 32]),
        seed=seed,
        window=window,
    )
    assert_op_matches_reference(case, window, pick([None, 5.0, 50.0]))


def test_wrong_window_is_detected():
    # Against the oracle, window 11 is not window 10: the comparison above can fail.
    case = make_case([(1, 40), (8, 30)], seed=7)
    assert (run_op(case, 11).double() - dense_causal_attention_f64(case, window=10)).abs().max() > 1e-2


def test_pages_before_every_window_may_be_recycled():
    # The engine may free pages a window has left behind: their table entries are -1 and never read.
    case = make_case([(1, 70), (9, 100)], page_size=8, seed=8, window=20)
    expected = paged_attention_ref(*case.args(), sliding_window=20)
    case.block_tables[0, : (70 - 20) // 8] = -1
    case.block_tables[1, : (100 - 9 - 20 + 1) // 8] = -1
    torch.testing.assert_close(run_op(case, 20), expected, atol=1e-5, rtol=1e-5)


def test_page_stride_larger_than_page_and_strided_query_match_reference():
    # Pages are a fixed number of bytes shared by models; q is a view of HF's [1, H, T, D] layout.
    case = make_case(MIXED, dtype=torch.bfloat16, page_pad_bytes=4096 + 6, seed=9)
    case.q = case.q.transpose(0, 1).contiguous().transpose(0, 1)
    assert not case.q.is_contiguous()
    assert_op_matches_reference(case, 12)


@pytest.mark.parametrize("softcap", [None, 30.0])
# q_len 1: 2 rows per item (scores as dot products), or at head_dim 64 one item over both KV heads;
# q_len 12: 24 rows (keys transposed).
@pytest.mark.parametrize(("q_len", "head_dim"), [(1, 24), (1, 64), (12, 24)])
def test_a_nan_key_reaches_exactly_the_outputs_that_see_it(q_len: int, head_dim: int, softcap: float | None):
    # A wrong number must not come out finite: a NaN key (a corrupt page) makes NaN every output that
    # attends to it, and nothing else; the masking of invisible keys must not swallow it.
    ctx, nan_pos = 70, 63  # inside the 12-token chunk: its first 5 tokens do not see it
    case = make_case([(q_len, ctx), (1, 40)], num_q_heads=4, num_kv_heads=2, head_dim=head_dim, seed=11)
    page = int(case.block_tables[0, nan_pos // 16])
    case.kv_cache[page, LAYER, 0, nan_pos % 16, 1, 5] = float("nan")  # a key of KV head 1
    out = run_op(case, None, softcap)
    positions = torch.arange(ctx - q_len, ctx)
    sees = positions >= nan_pos
    assert out[:q_len][sees][:, 2:].isnan().all(), "a head of KV head 1 that sees the NaN key came out finite"
    assert not out[:q_len][~sees].isnan().any() and not out[:q_len][:, :2].isnan().any()
    assert not out[q_len:].isnan().any(), "another sequence read the NaN"


def test_a_nan_query_makes_its_own_rows_nan_only():
    case = make_case([(1, 70), (1, 40), (5, 33)], num_q_heads=4, num_kv_heads=2, head_dim=24, seed=12)
    case.q[1, 3, 7] = float("nan")
    out = run_op(case)
    assert out[1, 3].isnan().all()
    out[1, 3] = 0.0
    assert not out.isnan().any()


def test_output_is_the_same_on_one_and_two_threads():
    # Each work item runs the same arithmetic whichever thread takes it: results are bitwise equal.
    case = make_case([(64, 200), (1, 300), (1, 5), (30, 60)], num_q_heads=8, num_kv_heads=2, seed=10)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = run_op(case, 50, 10.0)
        torch.set_num_threads(2)
        parallel = run_op(case, 50, 10.0)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(serial, parallel)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_decode_row_does_not_depend_on_its_batch_mates_or_the_threads(dtype: torch.dtype):
    # A batch of decodes runs an item per sequence over all its KV heads; a lone decode on two threads an
    # item per KV head. A row's arithmetic is the same in both: its output is bitwise the same alone and
    # in a batch, on one thread and on two.
    case = make_case(DECODE, num_q_heads=9, num_kv_heads=3, dtype=dtype, seed=14, window=40)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batched = run_op(case, 40, 30.0)
        for i in range(len(DECODE)):
            alone = Case(
                case.q[i : i + 1],
                case.kv_cache,
                case.block_tables[i : i + 1],
                case.context_lens[i : i + 1],
                torch.tensor([0, 1], dtype=torch.int32),
                case.scale,
            )
            for n in (1, 2):
                torch.set_num_threads(n)
                assert torch.equal(run_op(alone, 40, 30.0), batched[i : i + 1]), (i, n)
    finally:
        torch.set_num_threads(threads)


def test_the_cpu_ops_are_built_to_run_on_torchs_intra_op_threads():
    # at::parallel_for is inline: in an extension compiled without OpenMP it runs every item on the calling
    # thread, and the thread tests here and in test_sample_cpu.py compare a serial run with itself.
    assert ops.CPU_OPS_PARALLEL


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads the loaded libraries from /proc")
def test_the_extension_shares_torchs_openmp_runtime():
    # Two OpenMP runtimes in one process keep two thread pools, each spinning on the cores the other needs.
    maps = Path("/proc/self/maps").read_text().splitlines()
    loaded = {line.split()[-1] for line in maps if "libgomp" in line}
    assert len(loaded) == 1, loaded


def test_ops_routes_cpu_tensors_to_the_cpp_op():
    case = make_case(MIXED, seed=11)
    with torch.profiler.profile() as prof:
        got = ops.paged_attention(*case.args(), sliding_window=9, softcap=5.0)
    assert "oppo::paged_attention" in {e.name for e in prof.events()}
    expected = paged_attention_ref(*case.args(), sliding_window=9, softcap=5.0)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_ops_refuses_a_zero_window_instead_of_reading_it_as_none():
    case = make_case([(1, 5)], seed=12)
    with pytest.raises(ValueError, match="^sliding_window "):
        ops.paged_attention(*case.args(), sliding_window=0)


def test_opcheck():
    case = make_case([(1, 20), (5, 12)], num_q_heads=4, num_kv_heads=2, head_dim=16, seed=13)
    args = (*case.args(), 4, 20.0, torch.empty_like(case.q))
    torch.library.opcheck(torch.ops.oppo.paged_attention.default, args)


def _bad_inputs(case: Case) -> list[tuple[str, dict]]:
    good = dict(
        q=case.q,
        kv_cache=case.kv_cache,
        layer=LAYER,
        block_tables=case.block_tables,
        context_lens=case.context_lens,
        cu_seqlens_q=case.cu_seqlens_q,
    )
    recycled = case.block_tables.clone()
    recycled[1, 0] = -1
    too_long = case.context_lens.clone()
    too_long[0] = 16 * case.block_tables.shape[1] + 1
    return [
        ("q must be", dict(good, q=case.q[0])),
        ("q must be", dict(good, q=case.q.double())),
        ("q must be contiguous", dict(good, q=case.q.transpose(1, 2).contiguous().transpose(1, 2))),
        ("kv_cache dtype", dict(good, kv_cache=case.kv_cache.to(torch.float16))),
        ("kv_cache must be", dict(good, kv_cache=case.kv_cache[:, :, :1])),
        ("kv_cache head_dim", dict(good, kv_cache=case.kv_cache[..., :8])),
        ("q heads", dict(good, q=case.q[:, :3])),
        ("layer", dict(good, layer=NUM_LAYERS)),
        ("block_tables must be", dict(good, block_tables=case.block_tables.long())),
        ("block_tables\\[1, 0\\] = -1", dict(good, block_tables=recycled)),
        ("context_lens must be", dict(good, context_lens=case.context_lens.long())),
        ("cu_seqlens_q must be", dict(good, cu_seqlens_q=case.cu_seqlens_q[:-1])),
        ("cu_seqlens_q must run", dict(good, cu_seqlens_q=case.cu_seqlens_q - 1)),
        ("sequence 1 has 3 new tokens", dict(good, context_lens=torch.tensor([5, 2], dtype=torch.int32))),
        ("sequence 0 needs", dict(good, context_lens=too_long)),
    ]


def test_bad_arguments_raise_value_error_and_write_nothing():
    case = make_case([(1, 5), (3, 20)], seed=14)
    arena = torch.empty(0, dtype=torch.uint8).set_(case.kv_cache.untyped_storage())  # the bytes, NaNs and all
    before = arena.clone()
    for message, kwargs in _bad_inputs(case):
        out = torch.full(kwargs["q"].shape, float("nan"), dtype=kwargs["q"].dtype)
        with pytest.raises(ValueError, match=f"^paged_attention: {message}"):
            torch.ops.oppo.paged_attention(*kwargs.values(), 0.125, 0, 0.0, out)
        assert out.isnan().all(), message
    wrong_out = torch.empty_like(case.q[:, :, :8])
    with pytest.raises(ValueError, match="^paged_attention: out must match q"):
        torch.ops.oppo.paged_attention(*case.args(), 0, 0.0, wrong_out)
    assert torch.equal(arena, before), "the cache was written"
