"""paged_attention (Triton) against paged_attention_ref, and the reference against dense attention.

Every cache is built the way the arena builds it: a uint8 byte buffer viewed through ``as_strided`` as
``[num_pages, L, 2, page_size, Hkv, D]``. Everything a correct kernel must not read is NaN -- padding
bytes between pages, pages no sequence owns, slots past a sequence's context, the other layer, and
block-table entries past a sequence's pages point at NaN pages -- and outputs start as NaN, so a stray
read or an unwritten element fails the comparison.
"""

from __future__ import annotations

import pytest
import torch
from paged_cases import DEVICE, LAYER, NUM_LAYERS, Case, dense_causal_attention_f64, make_case

from oppo_engine.kernels.paged_attention import (
    KV_PER_SPLIT,
    paged_attention,
    paged_attention_ref,
    plan_attention,
)

# (dtype, atol, rtol). Under the interpreter bf16 operands are upcast before tl.dot, on GPU they are not.
TOLERANCES = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (2e-2, 2e-2),
}


def assert_kernel_matches_reference(case: Case, kv_per_split: int | None = None, **kwargs) -> torch.Tensor:
    out = torch.full_like(case.q, float("nan"))
    result = paged_attention(*case.args(), out=out, kv_per_split=kv_per_split, **kwargs)
    assert result is out
    expected = paged_attention_ref(*case.args(), out=torch.full_like(case.q, float("nan")), **kwargs)
    assert not expected.isnan().any(), "the reference read a poisoned element"
    atol, rtol = TOLERANCES[case.q.dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)
    return out


def test_decode_matches_reference_for_one_token_contexts():
    assert_kernel_matches_reference(make_case([(1, 1), (1, 1), (1, 1)]))


def test_decode_matches_reference_when_context_exactly_fills_pages():
    assert_kernel_matches_reference(make_case([(1, 16), (1, 32), (1, 64)]))


def test_prefill_chunks_crossing_page_boundaries_match_reference():
    # A fresh prompt, a chunk starting mid-page, a chunk ending exactly on a page boundary.
    assert_kernel_matches_reference(make_case([(40, 40), (20, 37), (11, 48)]))


def test_mixed_decode_and_prefill_in_one_launch_match_reference():
    # (0, 20): a sequence with no new token this step owns no rows and must not disturb its neighbours.
    assert_kernel_matches_reference(make_case([(1, 70), (33, 33), (1, 5), (0, 20), (9, 100), (1, 17)]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_matches_reference_in_each_dtype(dtype: torch.dtype):
    assert_kernel_matches_reference(make_case([(1, 45), (19, 50)], dtype=dtype, seed=1))


@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(4, 4), (8, 2), (7, 1), (14, 2)])
def test_gqa_groups_match_reference(num_q_heads: int, num_kv_heads: int):
    # Group 7 is not a power of two: tokens x heads do not tile the 2^k rows of the dot evenly.
    case = make_case([(1, 30), (25, 41)], num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, seed=2)
    assert_kernel_matches_reference(case)


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_head_dims_match_reference(head_dim: int):
    case = make_case([(1, 20), (6, 23)], head_dim=head_dim, dtype=torch.float16, seed=3)
    assert_kernel_matches_reference(case)


@pytest.mark.parametrize("page_size", [8, 32, 128])
def test_page_sizes_smaller_and_larger_than_kv_block_match_reference(page_size: int):
    assert_kernel_matches_reference(make_case([(1, 130), (12, 75)], page_size=page_size, seed=4))


def test_page_stride_larger_than_page_matches_reference():
    # Pages are a fixed number of bytes shared by models: this model uses only part of each page.
    case = make_case([(1, 40), (10, 26)], dtype=torch.float16, page_pad_bytes=4096 + 6, seed=5)
    assert case.kv_cache.stride(0) > NUM_LAYERS * case.kv_cache[0, 0].numel()
    assert_kernel_matches_reference(case)


def test_strided_query_view_matches_reference():
    # The model may hand a view into a fused qkv projection: rows are not contiguous.
    case = make_case([(1, 20), (7, 30)], seed=6)
    fused = torch.randn((case.q.shape[0], case.q.shape[1] + 4, case.q.shape[2]), device=DEVICE)
    fused[:, : case.q.shape[1]] = case.q
    case.q = fused[:, : case.q.shape[1]]
    assert not case.q.is_contiguous()
    assert_kernel_matches_reference(case)


@pytest.mark.parametrize("kv_per_split", [64, 128, 512])
def test_split_kv_matches_reference_for_decode_and_prefill(kv_per_split: int):
    # Shorter sequences leave some splits empty; the prefill chunk has rows whose causal end falls
    # before a split's start.
    case = make_case([(1, 150), (1, 3), (30, 130)], num_q_heads=8, num_kv_heads=2, seed=7)
    assert_kernel_matches_reference(case, kv_per_split=kv_per_split)


def test_split_kv_and_unsplit_paths_agree():
    case = make_case([(1, 200), (1, 64)], dtype=torch.float16, seed=8)
    split = paged_attention(*case.args(), kv_per_split=64)
    unsplit = paged_attention(*case.args(), kv_per_split=512)
    torch.testing.assert_close(split, unsplit, atol=2e-3, rtol=2e-3)


def test_host_maxima_give_the_same_output_as_computed_ones():
    case = make_case([(1, 50), (8, 20)], seed=9)
    computed = paged_attention(*case.args())
    given = paged_attention(*case.args(), max_q_len=8, max_context_len=50)
    torch.testing.assert_close(given, computed, atol=0, rtol=0)


def test_splits_follow_each_sequences_own_context_not_the_batch():
    # A fixed number of keys per split: the split count of a launch is ceil(max context / KV_PER_SPLIT),
    # whatever the number of sequences; a decode-only plan needs no work list.
    for num_seqs in (1, 7, 256):
        case = make_case([(1, 1 + 9 * n % 1200) for n in range(num_seqs)], seed=12)
        plan = plan_attention(
            case.kv_cache, case.block_tables, case.context_lens, case.cu_seqlens_q, case.q.shape[1],
            max_q_len=1, max_context_len=1200,
        )  # fmt: skip
        assert plan.launch.num_splits == -(-1200 // KV_PER_SPLIT) and plan.work is None
        assert [launch.num_items for launch in plan.launch.launches] == [num_seqs]


def test_reference_matches_dense_causal_attention_in_float64():
    case = make_case(
        [(1, 1), (1, 33), (12, 12), (7, 40)], num_q_heads=6, num_kv_heads=2, head_dim=80, seed=10
    )
    expected = dense_causal_attention_f64(case)
    torch.testing.assert_close(
        paged_attention_ref(*case.args()).double().cpu(), expected, atol=1e-5, rtol=1e-5
    )


def test_batched_decode_reference_matches_dense_attention_with_poisoned_padding():
    # All-decode batches take the reference's batched path (one SDPA over padded contexts); the padding
    # pages and table entries are NaN/arbitrary, so a missing mask-before-matmul would show up as NaN.
    case = make_case(
        [(1, 1), (1, 47), (1, 16), (1, 33)], num_q_heads=6, num_kv_heads=2, head_dim=80, page_size=8, seed=11
    )
    expected = dense_causal_attention_f64(case)
    torch.testing.assert_close(
        paged_attention_ref(*case.args()).double().cpu(), expected, atol=1e-5, rtol=1e-5
    )


# Decode and chunked prefill at once: contexts shorter and longer than the windows, a chunk starting
# mid-page, a page exactly full, a one-token sequence, a sequence without new tokens.
WINDOW_SEQS = [(1, 70), (33, 33), (1, 1), (0, 20), (9, 100), (1, 16), (12, 48)]


@pytest.mark.parametrize("window", [1, 3, 16, 40, 1000], ids=lambda w: f"window{w}")
def test_sliding_window_matches_reference_for_decode_and_prefill(window: int):
    # 16 = the page size; 1000 > every context (the window changes nothing).
    case = make_case(WINDOW_SEQS, num_q_heads=8, num_kv_heads=2, seed=20, window=window)
    assert_kernel_matches_reference(case, sliding_window=window)


@pytest.mark.parametrize("window", [None, 5, 64], ids=lambda w: f"window{w}")
def test_softcap_matches_reference_with_and_without_window(window: int | None):
    case = make_case(WINDOW_SEQS, num_q_heads=6, num_kv_heads=2, seed=21, window=window)
    case.q *= 4  # scores well past the cap, so tanh saturates
    assert_kernel_matches_reference(case, sliding_window=window, softcap=5.0)


@pytest.mark.parametrize("kv_per_split", [64, 128])
def test_sliding_window_with_split_kv_matches_reference(kv_per_split: int):
    # Splits wholly before a window see no key and must drop out of the reduction.
    case = make_case([(1, 150), (1, 3), (30, 130)], num_q_heads=8, num_kv_heads=2, seed=22, window=37)
    assert_kernel_matches_reference(case, kv_per_split=kv_per_split, sliding_window=37, softcap=20.0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sliding_window_and_softcap_match_reference_in_half_precision(dtype: torch.dtype):
    case = make_case([(1, 45), (19, 50)], dtype=dtype, page_size=8, seed=23, window=10)
    assert_kernel_matches_reference(case, sliding_window=10, softcap=30.0)


@pytest.mark.parametrize(("window", "softcap"), [(1, None), (3, None), (16, 50.0), (40, None), (None, 2.0)])
@pytest.mark.parametrize("decode_only", [True, False], ids=["batched_decode", "per_sequence"])
def test_reference_window_and_softcap_match_dense_attention_in_float64(
    window: int | None, softcap: float | None, decode_only: bool
):
    seqs = [(1, 1), (1, 47), (1, 16), (1, 33)] if decode_only else [(1, 1), (1, 33), (12, 12), (7, 40)]
    case = make_case(seqs, num_q_heads=6, num_kv_heads=2, head_dim=80, seed=24, window=window)
    case.q *= 3
    expected = dense_causal_attention_f64(case, window=window, softcap=softcap)
    got = paged_attention_ref(*case.args(), sliding_window=window, softcap=softcap)
    torch.testing.assert_close(got.double().cpu(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("decode_only", [True, False], ids=["batched_decode", "per_sequence"])
def test_pages_before_every_window_may_be_recycled(decode_only: bool):
    # The engine may free pages a window has left behind: their table entries become -1, never read.
    seqs = [(1, 70), (1, 100)] if decode_only else [(1, 70), (9, 100)]
    case = make_case(seqs, page_size=8, seed=28)
    expected = dense_causal_attention_f64(case, window=20)
    for n, (q_len, ctx) in enumerate(seqs):
        case.block_tables[n, : (ctx - q_len - 20 + 1) // 8] = -1
    for fn in (paged_attention, paged_attention_ref):
        got = fn(*case.args(), sliding_window=20)
        torch.testing.assert_close(got.double().cpu(), expected, atol=2e-5, rtol=2e-5)


def test_window_off_by_one_is_detected():
    # The oracle tells windows w and w + 1 apart: a test built on it can fail.
    case = make_case([(1, 40), (8, 30)], seed=25)
    wrong = paged_attention_ref(*case.args(), sliding_window=11).double().cpu()
    assert (wrong - dense_causal_attention_f64(case, window=10)).abs().max() > 1e-2


def test_plan_reused_across_layers_gives_the_same_output():
    case = make_case([(1, 50), (8, 20)], seed=26)
    plan = plan_attention(
        case.kv_cache, case.block_tables, case.context_lens, case.cu_seqlens_q, case.q.shape[1]
    )
    assert (plan.max_q_len, plan.max_context_len) == (8, 50)
    for fn in (paged_attention, paged_attention_ref):
        for window in (None, 7):
            planned = fn(*case.args(), sliding_window=window, plan=plan)
            torch.testing.assert_close(planned, fn(*case.args(), sliding_window=window), atol=0, rtol=0)


def test_plans_sharing_one_scratch_give_their_own_outputs_bit_for_bit():
    """CUDA-graph buckets share one split-KV scratch (they replay one at a time): two decode plans of 3 and
    5 sequences over it, run in turn, each equal the plan with scratch of its own; a scratch too small for a
    plan, or not flat float32, is refused."""
    from oppo_engine.kernels.paged_attention import scratch_numel

    lengths = [(200, 9, 130), (5, 190, 64, 1, 150)]
    cases = [make_case([(1, c) for c in lens], seed=40 + i) for i, lens in enumerate(lengths)]

    def plan(case, **kw):
        return plan_attention(
            case.kv_cache, case.block_tables, case.context_lens, case.cu_seqlens_q, case.q.shape[1],
            max_q_len=1, max_context_len=208, kv_per_split=64, **kw,
        )  # fmt: skip

    own = [paged_attention(*c.args(), plan=plan(c)) for c in cases]
    sizes = scratch_numel(plan(cases[1]), 5)
    assert sizes[0] == 4 * 5 * cases[1].q.shape[1] * cases[1].q.shape[2]  # 4 splits of 64 keys, 5 tokens
    # NaN: no plan may read what it did not write
    scratch = tuple(torch.full((n,), float("nan"), device=DEVICE) for n in sizes)
    shared = [plan(c, scratch=scratch) for c in cases]
    assert shared[0].partial.data_ptr() == shared[1].partial.data_ptr() == scratch[0].data_ptr()
    for i in (0, 1, 0):
        torch.testing.assert_close(paged_attention(*cases[i].args(), plan=shared[i]), own[i], atol=0, rtol=0)
    with pytest.raises(ValueError, match="^scratch: its partial buffer holds"):
        plan(cases[1], scratch=tuple(t[: n // 2] for t, n in zip(scratch, sizes, strict=True)))
    with pytest.raises(ValueError, match="^scratch: its lse buffer must be flat float32"):
        plan(cases[1], scratch=(scratch[0], scratch[1].double()))


def test_an_empty_split_writes_only_its_log_sum_exp():
    """A split past a sequence's context (or before its window) writes no output row: the reduce reads its
    -inf log-sum-exp alone. A captured bucket's split count follows max_model_len, so at short contexts
    nearly every split is empty, and writing [BLOCK_M, D] zeros for each was most of the traffic."""
    from oppo_engine.kernels.paged_attention import scratch_numel

    lens = (200, 9, 130)
    case = make_case([(1, c) for c in lens], seed=43)

    def plan(**kw):
        return plan_attention(
            case.kv_cache, case.block_tables, case.context_lens, case.cu_seqlens_q, case.q.shape[1],
            max_q_len=1, max_context_len=1024, kv_per_split=64, **kw,
        )  # fmt: skip

    sizes = scratch_numel(plan(), len(lens))
    scratch = tuple(torch.full((n,), float("nan"), device=DEVICE) for n in sizes)
    p = plan(scratch=scratch)
    out = paged_attention(*case.args(), plan=p)
    torch.testing.assert_close(out, paged_attention(*case.args(), kv_per_split=64), atol=0, rtol=0)
    splits = p.launch.num_splits
    assert splits == 16
    partial = scratch[0][: sizes[0]].view(splits, len(lens), case.q.shape[1], case.q.shape[2])
    lse = scratch[1][: sizes[1]].view(splits, len(lens), case.q.shape[1])
    for n, ctx in enumerate(lens):
        used = -(-ctx // 64)
        assert not partial[:used, n].isnan().any()
        assert partial[used:, n].isnan().all(), f"sequence {n}: an empty split wrote its output rows"
        assert (lse[used:, n] == float("-inf")).all()


def test_plan_for_other_tensors_is_refused():
    case = make_case([(1, 50), (8, 20)], seed=27)
    plan = plan_attention(
        case.kv_cache, case.block_tables, case.context_lens, case.cu_seqlens_q, case.q.shape[1]
    )
    with pytest.raises(ValueError, match="^plan "):
        paged_attention(
            case.q,
            case.kv_cache,
            LAYER,
            case.block_tables.clone(),
            case.context_lens,
            case.cu_seqlens_q,
            case.scale,
            plan=plan,
        )
    other_heads = plan_attention(
        case.kv_cache, case.block_tables, case.context_lens, case.cu_seqlens_q, 2 * case.q.shape[1]
    )
    with pytest.raises(ValueError, match="^q heads "):
        paged_attention(*case.args(), plan=other_heads)


def _bad_inputs():
    case = make_case([(1, 5), (3, 20)], seed=11)
    good = dict(
        q=case.q,
        kv_cache=case.kv_cache,
        layer=LAYER,
        block_tables=case.block_tables,
        context_lens=case.context_lens,
        cu_seqlens_q=case.cu_seqlens_q,
    )
    return [
        ("q", dict(good, q=case.q[0])),
        ("q", dict(good, q=case.q.to(torch.int32))),
        ("q", dict(good, q=case.q.transpose(1, 2).contiguous().transpose(1, 2))),
        ("kv_cache", dict(good, kv_cache=case.kv_cache.to(torch.float16))),
        ("kv_cache", dict(good, kv_cache=case.kv_cache[:, :, :1])),
        ("q heads", dict(good, q=case.q[:, :3])),
        ("layer", dict(good, layer=NUM_LAYERS)),
        ("block_tables", dict(good, block_tables=case.block_tables.long())),
        ("context_lens", dict(good, context_lens=case.context_lens.long())),
        ("cu_seqlens_q", dict(good, cu_seqlens_q=case.cu_seqlens_q[:-1])),
        ("out", dict(good, out=torch.empty_like(case.q[:, :, :8]))),
        ("sliding_window", dict(good, sliding_window=0)),
        ("sliding_window", dict(good, sliding_window=2.5)),
        ("softcap", dict(good, softcap=0.0)),
        ("softcap", dict(good, softcap=float("inf"))),
    ]


@pytest.mark.parametrize("fn", [paged_attention, paged_attention_ref], ids=["kernel", "reference"])
def test_bad_arguments_raise_value_error_naming_the_argument(fn):
    for name, kwargs in _bad_inputs():
        out = kwargs.pop("out", None)
        with pytest.raises(ValueError, match=f"^{name} "):
            fn(**kwargs, scale=0.125, out=out)


@pytest.mark.cuda
@pytest.mark.parametrize(("batch", "q_len", "ctx"), [(8, 1, 4096), (2, 512, 2048), (1, 1, 16384)])
def test_7b_shapes_match_reference_on_gpu(batch: int, q_len: int, ctx: int):
    case = make_case(
        [(q_len, ctx)] * batch, num_q_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, seed=12
    )
    assert_kernel_matches_reference(case)


@pytest.mark.cuda
def test_split_offsets_past_two_to_the_31_elements_stay_exact_on_gpu():
    """The split-KV scratch holds (num_splits - 1) * T * Hq * D >= 2**31 elements here (8.9 GB): the reduce's
    split offsets must be int64. 8448 decodes of one shared 4096-token context (every block table points at
    the same pages) in 64 splits; the last rows, whose split offsets pass 2**31, equal the same rows alone."""
    hq, hkv, d, ctx, n = 32, 8, 128, 4096, 8448
    small = make_case([(1, ctx)], num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=torch.bfloat16, seed=3)
    gen = torch.Generator(device=DEVICE).manual_seed(4)
    q = torch.randn(n, hq, d, generator=gen, device=DEVICE, dtype=torch.bfloat16)
    tables = small.block_tables.expand(n, -1).contiguous()
    lens = small.context_lens.expand(n).contiguous()
    cu = torch.arange(n + 1, dtype=torch.int32, device=DEVICE)
    args = (small.kv_cache, LAYER, tables, lens, cu, small.scale)
    big = paged_attention(q, *args, kv_per_split=64, max_q_len=1)
    assert (63 * n * hq * d) >= 2**31
    tail = slice(n - 4, n)
    alone = paged_attention(q[tail].clone(), small.kv_cache, LAYER, tables[tail].clone(), lens[tail].clone(),
                            cu[:5].clone(), small.scale, kv_per_split=64, max_q_len=1)  # fmt: skip
    assert torch.equal(big[tail], alone)


def _alone(case: Case, n: int) -> Case:
    """Sequence ``n`` of ``case`` as a batch of its own: the same queries, cache, pages and context."""
    lo, hi = case.cu_seqlens_q[n].item(), case.cu_seqlens_q[n + 1].item()
    return Case(
        case.q[lo:hi].clone(),
        case.kv_cache,
        case.block_tables[n : n + 1].clone(),
        case.context_lens[n : n + 1].clone(),
        torch.tensor([0, hi - lo], dtype=torch.int32, device=case.q.device),
        case.scale,
    )


# A long decode (split several ways), a short one, a prefill chunk over a long context, a fresh prompt.
MIXED = [(1, 700), (1, 9), (40, 610), (1, 1300), (17, 17), (1, 260)]


def assert_batch_invariant(dtype: torch.dtype, kv_per_split: int | None, **kwargs) -> None:
    case = make_case(MIXED, num_q_heads=8, num_kv_heads=2, dtype=dtype, seed=40)
    batched = paged_attention(*case.args(), kv_per_split=kv_per_split, **kwargs)
    decodes_only = [n for n, (q_len, _) in enumerate(MIXED) if q_len == 1]
    for n in range(len(MIXED)):
        lo, hi = case.cu_seqlens_q[n].item(), case.cu_seqlens_q[n + 1].item()
        alone = paged_attention(*_alone(case, n).args(), kv_per_split=kv_per_split, **kwargs)
        assert torch.equal(alone, batched[lo:hi]), f"sequence {n} {MIXED[n]} depends on its batch"
    # And a decode-only batch (its own launch shape) gives each decode the same bits again.
    rows = torch.tensor([case.cu_seqlens_q[n].item() for n in decodes_only])
    decode_case = Case(
        case.q[rows].clone(),
        case.kv_cache,
        case.block_tables[decodes_only].clone(),
        case.context_lens[decodes_only].clone(),
        torch.arange(len(decodes_only) + 1, dtype=torch.int32, device=case.q.device),
        case.scale,
    )
    decoded = paged_attention(*decode_case.args(), kv_per_split=kv_per_split, max_q_len=1, **kwargs)
    assert torch.equal(decoded, batched[rows])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kv_per_split", [None, 128])
def test_a_sequence_alone_and_in_a_mixed_batch_gets_bit_identical_attention(dtype, kv_per_split):
    assert_batch_invariant(dtype, kv_per_split)


def test_batch_invariance_holds_with_window_and_softcap():
    assert_batch_invariant(torch.float32, 128, sliding_window=200, softcap=30.0)


@pytest.mark.cuda
@pytest.mark.parametrize("kv_per_split", [None, 128])
def test_a_sequence_alone_and_in_a_mixed_batch_gets_bit_identical_attention_in_bf16_on_gpu(kv_per_split):
    assert_batch_invariant(torch.bfloat16, kv_per_split)


def test_a_decode_bucket_plan_made_once_serves_its_static_buffers_rewritten_in_place():
    # What a captured decode graph relies on: a plan from host sizes only (bucket, max_model_len), over
    # static metadata buffers whose contents change between replays; its scratch is the plan's own.
    bucket, max_model_len = 4, 700
    case = make_case([(1, 650), (1, 3), (1, 129), (1, 1), (1, 20), (1, 600), (1, 64), (1, 2)], seed=41)
    q = torch.empty_like(case.q[:bucket])
    tables = torch.zeros_like(case.block_tables[:bucket])
    lens = torch.empty_like(case.context_lens[:bucket])
    cu = case.cu_seqlens_q[: bucket + 1].clone()
    plan = plan_attention(
        case.kv_cache, tables, lens, cu, q.shape[1], max_q_len=1, max_context_len=max_model_len,
        num_tokens=bucket, decode_only=True, kv_per_split=128,
    )  # fmt: skip
    assert plan.work is None and plan.launch.num_splits == -(-max_model_len // 128)
    scratch = plan.partial
    for rows in (slice(0, 4), slice(4, 8), slice(0, 4)):
        q.copy_(case.q[rows])
        tables.copy_(case.block_tables[rows])
        lens.copy_(case.context_lens[rows])
        got = paged_attention(q, case.kv_cache, LAYER, tables, lens, cu, case.scale, plan=plan)
        want = paged_attention_ref(q, case.kv_cache, LAYER, tables, lens, cu, case.scale)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
        assert plan.partial is scratch
