"""torch.ops.oppo.reshape_and_cache and copy_pages against Python-loop references, compared byte for byte.

Every test poisons the arena with random bytes first and compares the WHOLE arena afterwards, so a byte
written where it should not be (a skipped slot, another layer, another model's page, the gap at the end of a
page) fails as surely as a byte not written.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from oppo_engine import ops

# Model A, the largest, sets the page: page_bytes = L * 2 * 16 * H * D * 4 = 128 KiB.
BIG = dict(layers=2, heads=4, head_dim=128, dtype=torch.float32, page_size=16)
PAGE_BYTES = BIG["layers"] * 2 * BIG["page_size"] * BIG["heads"] * BIG["head_dim"] * 4
NUM_PAGES = 8
# Model B, smaller and with an awkward head_dim: its pages leave a gap at the end of every arena page.
SMALL = dict(layers=3, heads=3, head_dim=80)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def page_size_for(layers: int, heads: int, head_dim: int, dtype: torch.dtype, page_bytes: int) -> int:
    """Tokens per page as DESIGN.md derives them: the largest power of two >= 8 whose K/V fit in a page."""
    token_bytes = layers * 2 * heads * head_dim * dtype.itemsize
    page_size = 8
    while 2 * page_size * token_bytes <= page_bytes:
        page_size *= 2
    assert page_size * token_bytes <= page_bytes
    return page_size


def model_view(
    arena: torch.Tensor, layers: int, heads: int, head_dim: int, dtype: torch.dtype, page_size: int
) -> torch.Tensor:
    """One model's ``[num_pages, L, 2, page_size, H, D]`` view of a uint8 arena (page stride PAGE_BYTES)."""
    num_pages = arena.numel() // PAGE_BYTES
    return arena.view(dtype).as_strided(
        (num_pages, layers, 2, page_size, heads, head_dim),
        (
            PAGE_BYTES // dtype.itemsize,
            2 * page_size * heads * head_dim,
            page_size * heads * head_dim,
            heads * head_dim,
            head_dim,
            1,
        ),
    )


def small_model(arena: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    page_size = page_size_for(**SMALL, dtype=dtype, page_bytes=PAGE_BYTES)
    return model_view(arena, **SMALL, dtype=dtype, page_size=page_size)


def poisoned_arena(gen: torch.Generator, num_pages: int = NUM_PAGES, device: str = "cpu") -> torch.Tensor:
    arena = torch.randint(0, 256, (num_pages * PAGE_BYTES,), dtype=torch.uint8, generator=gen)
    return arena.to(device)


def non_contiguous_kv(
    gen: torch.Generator, num_tokens: int, heads: int, head_dim: int, dtype: torch.dtype, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """key as a transposed ``[H, T, D]`` buffer with padded rows, value as the V slice of a packed QKV."""
    key_base = torch.randn(heads, num_tokens, head_dim + 16, generator=gen).to(dtype)
    qkv = torch.randn(num_tokens, 3, heads, head_dim, generator=gen).to(dtype)
    key = key_base.to(device)[..., :head_dim].transpose(0, 1)
    value = qkv.to(device)[:, 2]
    assert not key.is_contiguous() and key.stride(2) == 1
    return key, value


def on_cuda(
    gen: torch.Generator, *args
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]:
    """The same ``non_contiguous_kv`` draw, with the same strides, on the CPU and on CUDA."""
    state = gen.get_state()
    cpu = non_contiguous_kv(gen, *args)
    gen.set_state(state)
    cuda = non_contiguous_kv(gen, *args, device="cuda")
    assert cuda[0].stride() == cpu[0].stride() and cuda[1].stride() == cpu[1].stride()
    return cpu, cuda


def make_slots(pattern: str, page_size: int, num_pages: int, gen: torch.Generator) -> torch.Tensor:
    """Distinct slots of a scattered page table (a sequence's pages are not adjacent in the arena)."""
    page_table = torch.randperm(num_pages, generator=gen)
    if pattern == "one_token":
        positions = torch.tensor([page_size + 3])
    elif pattern == "exactly_one_full_page":
        positions = torch.arange(page_size)
    elif pattern == "crossing_pages":
        positions = torch.arange(page_size - 2, 3 * page_size + 1)
    elif pattern == "padded":
        positions = torch.arange(2 * page_size + 5)
    else:
        raise AssertionError(pattern)
    slots = page_table[positions // page_size] * page_size + positions % page_size
    if pattern == "padded":
        slots[torch.rand(len(slots), generator=gen) < 0.3] = -1
        slots[0] = slots[-1] = -1
    return slots.to(torch.int64)


def reshape_and_cache_ref(key, value, kv_cache, slot_mapping, layer: int) -> None:
    page_size = kv_cache.shape[3]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        kv_cache[slot // page_size, layer, 0, slot % page_size] = key[t]
        kv_cache[slot // page_size, layer, 1, slot % page_size] = value[t]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("pattern", ["one_token", "exactly_one_full_page", "crossing_pages", "padded"])
@pytest.mark.parametrize("layer", [0, 2])
def test_reshape_and_cache_writes_exactly_the_reference_bytes(dtype, pattern, layer):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{dtype}{pattern}{layer}".encode()))
    arena = poisoned_arena(gen)
    expected = arena.clone()
    cache = small_model(arena, dtype)
    assert cache.stride(0) * dtype.itemsize == PAGE_BYTES > cache[0].numel() * dtype.itemsize
    slots = make_slots(pattern, cache.shape[3], NUM_PAGES, gen)
    key, value = non_contiguous_kv(gen, len(slots), SMALL["heads"], SMALL["head_dim"], dtype)

    ops.reshape_and_cache(key, value, cache, slots, layer)
    reshape_and_cache_ref(key, value, small_model(expected, dtype), slots, layer)

    assert torch.equal(arena, expected)


def test_strided_slot_mapping_is_read_element_by_element():
    gen = torch.Generator().manual_seed(1)
    arena = poisoned_arena(gen)
    expected = arena.clone()
    cache = small_model(arena, torch.float16)
    slots = make_slots("crossing_pages", cache.shape[3], NUM_PAGES, gen)
    strided = torch.stack([slots, torch.full_like(slots, -5)], dim=1)[:, 0]
    assert strided.stride(0) == 2
    key, value = non_contiguous_kv(gen, len(slots), SMALL["heads"], SMALL["head_dim"], torch.float16)
    ops.reshape_and_cache(key, value, cache, strided, 1)
    reshape_and_cache_ref(key, value, small_model(expected, torch.float16), slots, 1)
    assert torch.equal(arena, expected)


def test_two_models_on_one_arena_write_only_their_own_pages():
    gen = torch.Generator().manual_seed(2)
    arena = poisoned_arena(gen)
    expected = arena.clone()
    big, small = model_view(arena, **BIG), small_model(arena, torch.bfloat16)
    big_slots = torch.arange(2 * BIG["page_size"]) + 4 * BIG["page_size"]  # pages 4 and 5
    small_slots = torch.arange(small.shape[3] + 1) + 6 * small.shape[3]  # page 6 and the first slot of 7
    big_kv = non_contiguous_kv(gen, len(big_slots), BIG["heads"], BIG["head_dim"], BIG["dtype"])
    small_kv = non_contiguous_kv(gen, len(small_slots), SMALL["heads"], SMALL["head_dim"], torch.bfloat16)

    ops.reshape_and_cache(*big_kv, big, big_slots, 1)
    ops.reshape_and_cache(*small_kv, small, small_slots, 2)
    reshape_and_cache_ref(*big_kv, model_view(expected, **BIG), big_slots, 1)
    reshape_and_cache_ref(*small_kv, small_model(expected, torch.bfloat16), small_slots, 2)

    assert torch.equal(arena, expected)


def test_all_padding_and_zero_tokens_write_nothing():
    gen = torch.Generator().manual_seed(3)
    arena = poisoned_arena(gen)
    before = arena.clone()
    cache = small_model(arena, torch.float32)
    key, value = non_contiguous_kv(gen, 5, SMALL["heads"], SMALL["head_dim"], torch.float32)
    ops.reshape_and_cache(key, value, cache, torch.full((5,), -1, dtype=torch.int64), 0)
    ops.reshape_and_cache(key[:0], value[:0], cache, torch.empty(0, dtype=torch.int64), 0)
    assert torch.equal(arena, before)


def _bad_reshape_and_cache_calls(key, value, cache, slots):
    """(name, args, message fragment naming the bad argument) for each malformed call."""
    num_slots = cache.shape[0] * cache.shape[3]
    layers = cache.shape[1]
    heads = key.shape[1]
    # A valid slot first: a bad slot later in the batch must not let the earlier ones through.
    bad_slot_high = slots.clone()
    bad_slot_high[-1] = num_slots
    bad_slot_low = slots.clone()
    bad_slot_low[-1] = -2
    return [
        ("key_dtype", (key.half(), value, cache, slots, 0), "key/value dtype"),
        ("value_dtype", (key, value.double(), cache, slots, 0), "key/value dtype"),
        ("slot_mapping_dtype", (key, value, cache, slots.int(), 0), "slot_mapping must be int64"),
        ("key_heads", (key[:, : heads - 1], value[:, : heads - 1], cache, slots, 0), "key heads"),
        ("value_shape", (key, value[:-1], cache, slots, 0), "key and value"),
        ("key_rank", (key[0], value[0], cache, slots[:1], 0), "key and value"),
        ("slot_mapping_length", (key, value, cache, slots[:-1], 0), "slot_mapping must be"),
        ("kv_cache_rank", (key, value, cache[:, 0], slots, 0), "kv_cache must be"),
        ("kv_cache_kv_dim", (key, value, cache[:, :, :1], slots, 0), "kv_cache dim 2"),
        ("layer_too_large", (key, value, cache, slots, layers), "layer"),
        ("layer_negative", (key, value, cache, slots, -1), "layer"),
        ("key_last_dim_strided", (key[..., ::2], value[..., ::2], cache[..., ::2], slots, 0), "contiguous"),
        ("slot_past_the_end", (key, value, cache, bad_slot_high, 0), "slot_mapping\\[.*outside"),
        ("slot_below_minus_one", (key, value, cache, bad_slot_low, 0), "slot_mapping\\[.*outside"),
    ]


@pytest.mark.parametrize("case", range(14))
def test_bad_reshape_and_cache_call_raises_value_error_naming_the_argument_and_writes_nothing(case):
    gen = torch.Generator().manual_seed(4)
    arena = poisoned_arena(gen)
    before = arena.clone()
    cache = small_model(arena, torch.float32)
    slots = make_slots("crossing_pages", cache.shape[3], NUM_PAGES, gen)
    key, value = non_contiguous_kv(gen, len(slots), SMALL["heads"], SMALL["head_dim"], torch.float32)
    calls = _bad_reshape_and_cache_calls(key, value, cache, slots)
    assert len(calls) == 14
    name, args, message = calls[case]
    with pytest.raises(ValueError, match=message):
        ops.reshape_and_cache(*args)
    assert torch.equal(arena, before), name


def copy_pages_ref(src: torch.Tensor, dst: torch.Tensor, src_ids: list[int], dst_ids: list[int]) -> None:
    for s, d in zip(src_ids, dst_ids, strict=True):
        dst[d] = src[s].clone()


@pytest.mark.parametrize(
    "src_ids,dst_ids", [([3, 0, 5], [1, 7, 2]), ([0], [0]), ([4, 4, 1], [0, 6, 5]), ([], [])]
)
def test_copy_pages_copies_exact_bytes_between_arenas(src_ids, dst_ids):
    gen = torch.Generator().manual_seed(5)
    src = poisoned_arena(gen).view(NUM_PAGES, PAGE_BYTES)
    src_before = src.clone()
    dst = poisoned_arena(gen).view(NUM_PAGES, PAGE_BYTES)
    expected = dst.clone()
    ops.copy_pages(
        src, dst, torch.tensor(src_ids, dtype=torch.int64), torch.tensor(dst_ids, dtype=torch.int64)
    )
    copy_pages_ref(src, expected, src_ids, dst_ids)
    assert torch.equal(dst, expected)
    assert torch.equal(src, src_before)


def test_copy_pages_takes_strided_page_ids():
    """Ids that are a strided view (every other element) are checked and copied as their values say."""
    gen = torch.Generator().manual_seed(8)
    src = poisoned_arena(gen).view(NUM_PAGES, PAGE_BYTES)
    dst = poisoned_arena(gen).view(NUM_PAGES, PAGE_BYTES)
    expected = dst.clone()
    src_ids, dst_ids = torch.tensor([3, 99, 0, 99, 5])[::2], torch.tensor([1, 99, 7, 99, 2])[::2]
    assert not src_ids.is_contiguous()
    ops.copy_pages(src, dst, src_ids, dst_ids)
    copy_pages_ref(src, expected, [3, 0, 5], [1, 7, 2])
    assert torch.equal(dst, expected)


def test_copy_pages_within_one_arena_forks_pages_exactly():
    gen = torch.Generator().manual_seed(6)
    arena = poisoned_arena(gen).view(NUM_PAGES, PAGE_BYTES)
    expected = arena.clone()
    src_ids, dst_ids = [0, 1, 2], [5, 3, 4]
    ops.copy_pages(arena, arena, torch.tensor(src_ids), torch.tensor(dst_ids))
    copy_pages_ref(expected.clone(), expected, src_ids, dst_ids)
    assert torch.equal(arena, expected)


def test_copy_pages_follows_row_strides_of_padded_buffers():
    gen = torch.Generator().manual_seed(7)
    pad = 64
    wide_src = torch.randint(0, 256, (NUM_PAGES, PAGE_BYTES + pad), dtype=torch.uint8, generator=gen)
    wide_dst = torch.randint(0, 256, (3, PAGE_BYTES + 3 * pad), dtype=torch.uint8, generator=gen)
    expected = wide_dst.clone()
    src, dst = wide_src[:, :PAGE_BYTES], wide_dst[:, pad : pad + PAGE_BYTES]
    ops.copy_pages(src, dst, torch.tensor([7, 2, 5]), torch.tensor([0, 2, 1]))
    copy_pages_ref(src, expected[:, pad : pad + PAGE_BYTES], [7, 2, 5], [0, 2, 1])
    assert torch.equal(wide_dst, expected)


def _bad_copy_pages_calls(src, dst):
    ids = torch.tensor([1, 2])
    return [
        ("src_id_past_the_end", (src, dst, torch.tensor([1, NUM_PAGES]), ids), "src_ids\\[1\\]"),
        ("src_id_negative", (src, dst, torch.tensor([-1, 0]), ids), "src_ids\\[0\\]"),
        ("dst_id_past_the_end", (src, dst, ids, torch.tensor([0, NUM_PAGES])), "dst_ids\\[1\\]"),
        ("dst_id_negative", (src, dst, ids, torch.tensor([3, -4])), "dst_ids\\[1\\]"),
        ("ids_length_mismatch", (src, dst, ids, ids[:1]), "equal length"),
        ("ids_int32", (src, dst, ids.int(), ids.int()), "int64"),
        ("ids_rank", (src, dst, ids[None], ids[None]), "src_ids and dst_ids"),
        ("page_bytes_mismatch", (src[:, :-1], dst, ids, ids), "equal page_bytes"),
        ("src_not_uint8", (src.view(torch.float32), dst.view(torch.float32), ids, ids), "uint8"),
        ("page_not_contiguous", (src[:, ::2], dst[:, ::2], ids, ids), "contiguous"),
    ]


@pytest.mark.parametrize("case", range(10))
def test_bad_copy_pages_call_raises_value_error_and_copies_nothing(case):
    gen = torch.Generator().manual_seed(8)
    src = poisoned_arena(gen).view(NUM_PAGES, PAGE_BYTES)
    dst = poisoned_arena(gen).view(NUM_PAGES, PAGE_BYTES)
    before = dst.clone()
    calls = _bad_copy_pages_calls(src, dst)
    assert len(calls) == 10
    name, args, message = calls[case]
    with pytest.raises(ValueError, match=message):
        ops.copy_pages(*args)
    assert torch.equal(dst, before), name


def test_reshape_and_cache_passes_opcheck():
    gen = torch.Generator().manual_seed(9)
    num_pages, layers, page_size, heads, head_dim = 4, 2, 8, 2, 16
    cache = torch.randn(num_pages, layers, 2, page_size, heads, head_dim, generator=gen)
    key = torch.randn(5, heads, head_dim, generator=gen)
    value = torch.randn(5, heads, head_dim, generator=gen)
    slots = torch.tensor([3, 9, -1, 17, 31])
    torch.library.opcheck(torch.ops.oppo.reshape_and_cache.default, (key, value, cache, slots, 1))


def test_copy_pages_passes_opcheck():
    gen = torch.Generator().manual_seed(10)
    src = torch.randint(0, 256, (4, 256), dtype=torch.uint8, generator=gen)
    dst = torch.randint(0, 256, (6, 256), dtype=torch.uint8, generator=gen)
    torch.library.opcheck(
        torch.ops.oppo.copy_pages.default, (src, dst, torch.tensor([0, 3]), torch.tensor([5, 1]))
    )


# --- CUDA: the same exactness, the CPU op as the reference ------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("pattern", ["one_token", "crossing_pages", "padded"])
def test_cuda_reshape_and_cache_writes_the_same_bytes_as_the_cpu_op(dtype, pattern):
    gen = torch.Generator().manual_seed(11)
    arena = poisoned_arena(gen)
    cache = small_model(arena, dtype)
    slots = make_slots(pattern, cache.shape[3], NUM_PAGES, gen)
    (key, value), (key_gpu, value_gpu) = on_cuda(gen, len(slots), SMALL["heads"], SMALL["head_dim"], dtype)
    arena_gpu = arena.cuda()

    ops.reshape_and_cache(key_gpu, value_gpu, small_model(arena_gpu, dtype), slots.cuda(), 1)
    ops.reshape_and_cache(key, value, cache, slots, 1)

    assert torch.equal(arena_gpu.cpu(), arena)


@pytest.mark.cuda
def test_cuda_strided_slot_mapping_is_read_element_by_element():
    gen = torch.Generator().manual_seed(12)
    arena = poisoned_arena(gen)
    cache = small_model(arena, torch.bfloat16)
    slots = make_slots("crossing_pages", cache.shape[3], NUM_PAGES, gen)
    (key, value), kv_gpu = on_cuda(gen, len(slots), SMALL["heads"], SMALL["head_dim"], torch.bfloat16)
    arena_gpu = arena.cuda()
    strided = torch.stack([slots, torch.full_like(slots, -1)], dim=1).cuda()[:, 0]
    ops.reshape_and_cache(*kv_gpu, small_model(arena_gpu, torch.bfloat16), strided, 0)
    ops.reshape_and_cache(key, value, cache, slots, 0)
    assert torch.equal(arena_gpu.cpu(), arena)


@pytest.mark.cuda
def test_cuda_copy_pages_round_trip_through_pinned_host_is_exact():
    gen = torch.Generator().manual_seed(13)
    arena = poisoned_arena(gen).view(NUM_PAGES, PAGE_BYTES)
    expected = arena.clone()
    arena_gpu = arena.cuda()
    host = torch.empty(3, PAGE_BYTES, dtype=torch.uint8, pin_memory=True)
    out_ids, slot_ids, in_ids = torch.tensor([6, 1, 3]), torch.tensor([2, 0, 1]), torch.tensor([0, 7, 4])

    ops.copy_pages(arena_gpu, host, out_ids, slot_ids)  # swap out
    ops.copy_pages(host, arena_gpu, slot_ids, in_ids)  # swap in elsewhere
    torch.cuda.synchronize()

    copy_pages_ref(arena, expected, [6, 1, 3], [0, 7, 4])
    assert torch.equal(host, arena[[6, 1, 3]])
    assert torch.equal(arena_gpu.cpu(), expected)


@pytest.mark.cuda
def test_cuda_copy_pages_within_the_device_arena_is_exact():
    gen = torch.Generator().manual_seed(14)
    arena = poisoned_arena(gen).view(NUM_PAGES, PAGE_BYTES)
    arena_gpu = arena.cuda()
    ops.copy_pages(arena_gpu, arena_gpu, torch.tensor([0, 1, 2]), torch.tensor([5, 3, 4]))
    copy_pages_ref(arena.clone(), arena, [0, 1, 2], [5, 3, 4])
    assert torch.equal(arena_gpu.cpu(), arena)


@pytest.mark.cuda
def test_cuda_ops_run_on_the_callers_stream():
    gen = torch.Generator().manual_seed(15)
    arena = poisoned_arena(gen)
    host = torch.empty(2, PAGE_BYTES, dtype=torch.uint8, pin_memory=True)
    cache = small_model(arena, torch.float16)
    slots = make_slots("padded", cache.shape[3], NUM_PAGES, gen)
    (key, value), (key_gpu, value_gpu) = on_cuda(
        gen, len(slots), SMALL["heads"], SMALL["head_dim"], torch.float16
    )
    arena_gpu, slots_gpu = arena.cuda(), slots.cuda()
    original = arena.clone()
    ops.reshape_and_cache(key, value, cache, slots, 0)  # the CPU op gives the expected bytes

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(2_000_000_000)  # ~1 s of spinning: the ops queue behind it on `side` only
        ops.reshape_and_cache(key_gpu, value_gpu, small_model(arena_gpu, torch.float16), slots_gpu, 0)
        ops.copy_pages(
            arena_gpu.view(NUM_PAGES, PAGE_BYTES), host, torch.tensor([0, 5]), torch.tensor([0, 1])
        )
    # Read on the default stream while `side` is still spinning: an op launched on the default stream
    # instead of `side` would already show here.
    snapshot = arena_gpu.cpu()
    side_still_busy = not side.query()
    side.synchronize()

    assert side_still_busy, "the sleep ended before the snapshot; the check proved nothing"
    assert torch.equal(snapshot, original)
    assert torch.equal(arena_gpu.cpu(), arena)
    assert torch.equal(host, arena.view(NUM_PAGES, PAGE_BYTES)[[0, 5]])


@pytest.mark.cuda
def test_cuda_copy_pages_rejects_page_ids_on_the_device():
    arena_gpu = torch.zeros(NUM_PAGES, PAGE_BYTES, dtype=torch.uint8, device="cuda")
    ids = torch.tensor([0, 1], device="cuda")
    with pytest.raises(ValueError, match="on the CPU"):
        ops.copy_pages(arena_gpu, arena_gpu, ids, ids)
