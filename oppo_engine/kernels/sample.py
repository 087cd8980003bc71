"""Gumbel-max sampling with counter-based noise, returning the token and its log-prob in one pass.

``token = argmax(logits / T + g)`` with ``g = -log(-log(u))`` and ``u`` a pure function of
(seed, position, vocab index), so a sequence's token depends only on its own logits, seed and position --
never on which rows share the batch or where its row sits. ``T == 0`` (or below) is greedy: ``argmax``
of the raw logits, ties to the lowest index.

The RNG (identical in Triton and torch, all arithmetic on uint32 -- int64 masked with 0xFFFFFFFF in
torch):

- ``mix32`` is Chris Wellons' "lowbias32" integer finaliser: ``x ^= x >> 16; x *= 0x7FEB352D;
  x ^= x >> 15; x *= 0x846CA68B; x ^= x >> 16`` (a bijection on uint32 with near-ideal avalanche).
- Row key: ``k = mix32(seed_lo ^ 0x9E3779B9); k = mix32(k ^ seed_hi); k = mix32(k ^ pos_lo);
  k = mix32(k ^ pos_hi)`` over the 32-bit halves of the int64 seed and position; ``k2 = mix32(k ^
  0x85EBCA6B)``.
- Element: ``h = mix32(mix32(k ^ v) ^ k2)`` for vocab index ``v``. The second round keys the output on
  ``k2`` as well, so two rows whose keys differ by a small XOR do not reuse each other's noise.
- ``u = ((h >> 9) + 0.5) * 2**-23`` in float32: 23 random bits, exactly representable, strictly inside
  (0, 1), so ``g`` is always finite (in [-2.8, 16.6]).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ._jit import jit as _jit

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MASK32 = 0xFFFFFFFF
_KEY_SALT = 0x9E3779B9
_KEY2_SALT = 0x85EBCA6B
_MIX_MUL1 = 0x7FEB352D
_MIX_MUL2 = 0x846CA68B
# Elements per program tile: a whole row-chunk of a large vocabulary, or many rows of a small one.
_TILE_ELEMENTS = 4096


@triton.jit
def _mix32(x):
    x ^= x >> 16
    x *= tl.full(x.shape, 0x7FEB352D, tl.uint32)
    x ^= x >> 15
    x *= tl.full(x.shape, 0x846CA68B, tl.uint32)
    x ^= x >> 16
    return x


# NOTE: one variant for every batch (the build-time warm-up compiles it): the row count is not specialised
# on, nor the per-row parameters' 16-byte alignment -- they are views of the forward's packed int64
# metadata (SampleBatch.packed) at offsets that follow the batch's sizes. Their loads are one per row.
@_jit(
    do_not_specialize=["num_rows"],
    do_not_specialize_on_alignment=[
        "temperature_ptr", "inv_temperature_ptr", "seeds_ptr", "positions_ptr", "tokens_ptr", "logprobs_ptr"
    ],
)  # fmt: skip
def _sample_kernel(
    logits_ptr,  # [N, V]
    temperature_ptr,  # [N] fp32
    inv_temperature_ptr,  # [N] fp32, 1 / T (1 for greedy), computed by torch so both paths share its bits
    seeds_ptr,  # [N] int64
    positions_ptr,  # [N] int64
    tokens_ptr,  # [N] int64
    logprobs_ptr,  # [N] fp32
    num_rows,
    vocab_size,
    stride_row,
    BLOCK_R: tl.constexpr,  # rows per program: > 1 only for small vocabularies
    BLOCK_V: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < num_rows
    logits_rows = logits_ptr + rows.to(tl.int64)[:, None] * stride_row
    greedy = tl.load(temperature_ptr + rows, mask=row_mask, other=0.0) <= 0.0
    inv_t = tl.load(inv_temperature_ptr + rows, mask=row_mask, other=1.0)
    seed = tl.load(seeds_ptr + rows, mask=row_mask, other=0)
    pos = tl.load(positions_ptr + rows, mask=row_mask, other=0)
    key = _mix32(seed.to(tl.uint32) ^ tl.full([BLOCK_R], 0x9E3779B9, tl.uint32))
    key = _mix32(key ^ (seed >> 32).to(tl.uint32))
    key = _mix32(key ^ pos.to(tl.uint32))
    key = _mix32(key ^ (pos >> 32).to(tl.uint32))
    key2 = _mix32(key ^ tl.full([BLOCK_R], 0x85EBCA6B, tl.uint32))

    # Per-lane running state, reduced across lanes once at the end: lane j of a row sees vocab indices
    # j, j + BLOCK_V, ... Every row runs the same per-lane arithmetic whatever its place in the tile.
    offs = tl.arange(0, BLOCK_V)
    m_vec = tl.full([BLOCK_R, BLOCK_V], float("-inf"), tl.float32)
    s_vec = tl.zeros([BLOCK_R, BLOCK_V], tl.float32)
    best_y = tl.full([BLOCK_R, BLOCK_V], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK_R, BLOCK_V], tl.int32)
    for start in range(0, vocab_size, BLOCK_V):
        idx = start + offs
        mask = row_mask[:, None] & (idx < vocab_size)[None, :]
        z = (
            tl.load(logits_rows + idx[None, :], mask=mask, other=float("-inf")).to(tl.float32)
            * inv_t[:, None]
        )
        m_new = tl.maximum(m_vec, z)
        # -inf logits (top-k/top-p masking) can leave a lane at -inf: avoid (-inf) - (-inf).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s_vec = s_vec * tl.exp(m_vec - m_safe) + tl.exp(z - m_safe)
        m_vec = m_new

        h = _mix32(_mix32(key[:, None] ^ idx.to(tl.uint32)[None, :]) ^ key2[:, None])
        u = ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2**-23
        g = -tl.log(-tl.log(u))
        y = tl.where(greedy[:, None], z, z + g)
        # Strict > keeps each lane's earliest index on ties.
        better = y > best_y
        best_y = tl.where(better, y, best_y)
        best_i = tl.where(better, idx[None, :], best_i)

    m = tl.max(m_vec, 1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    sum_exp = tl.sum(s_vec * tl.exp(m_vec - m_safe[:, None]), 1)
    lse = m_safe + tl.log(tl.where(row_mask, sum_exp, 1.0))
    y_max = tl.max(best_y, 1)
    token = tl.min(tl.where(best_y == y_max[:, None], best_i, vocab_size), 1)
    token = tl.minimum(token, vocab_size - 1)  # all -inf rows (invalid input) still index in bounds
    z_token = tl.load(logits_ptr + rows.to(tl.int64) * stride_row + token, mask=row_mask, other=0.0)
    tl.store(tokens_ptr + rows, token.to(tl.int64), mask=row_mask)
    tl.store(logprobs_ptr + rows, z_token.to(tl.float32) * inv_t - lse, mask=row_mask)


def _check_inputs(
    logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor
) -> None:
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"logits must be [N, V] with V >= 1, got shape {tuple(logits.shape)}")
    if logits.dtype not in _DTYPES:
        raise ValueError(f"logits must be float16, bfloat16 or float32, got {logits.dtype}")
    if logits.stride(-1) != 1:
        raise ValueError(f"logits must be contiguous along the vocabulary, got strides {logits.stride()}")
    num_rows = logits.shape[0]
    for name, t, dtype in (
        ("temperature", temperature, torch.float32),
        ("seeds", seeds, torch.int64),
        ("positions", positions, torch.int64),
    ):
        if t.dim() != 1 or t.shape[0] != num_rows or t.dtype != dtype:
            raise ValueError(f"{name} must be {dtype} [N] = [{num_rows}], got {t.dtype} {tuple(t.shape)}")
        if t.device != logits.device:
            raise ValueError(f"{name} is on {t.device} but logits is on {logits.device}")


def _inverse_temperature(temperature: torch.Tensor) -> torch.Tensor:
    return torch.where(temperature > 0, 1.0 / temperature, torch.ones_like(temperature))


def sample(
    logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row by Gumbel-max and return it with its log-prob (Triton).

    Args:
        logits: ``[N, V]`` fp32/bf16/fp16, may hold -inf (masked by top-k/top-p); contiguous rows.
        temperature: ``[N]`` float32; ``<= 0`` means greedy.
        seeds: ``[N]`` int64 per-sequence RNG seeds.
        positions: ``[N]`` int64 position of the token being drawn (the RNG counter).

    Returns:
        ``tokens [N]`` int64 and ``logprobs [N]`` float32: ``log_softmax(logits / T)[token]``, or
        ``log_softmax(logits)[token]`` for greedy rows.
    """
    _check_inputs(logits, temperature, seeds, positions)
    if logits.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"sample runs on CUDA tensors (logits are on {logits.device}); use sample_ref on CPU "
            "or set TRITON_INTERPRET=1 before importing triton"
        )
    num_rows, vocab_size = logits.shape
    tokens = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    if num_rows == 0:
        return tokens, logprobs
    # NOTE: the tiling depends on V only, never on N, so a row's result is the same in any batch.
    block_v = min(_TILE_ELEMENTS, max(16, 1 << (vocab_size - 1).bit_length()))
    block_r = _TILE_ELEMENTS // block_v
    _sample_kernel[(-(-num_rows // block_r),)](
        logits,
        temperature,
        _inverse_temperature(temperature),
        seeds,
        positions,
        tokens,
        logprobs,
        num_rows,
        vocab_size,
        logits.stride(0),
        BLOCK_R=block_r,
        BLOCK_V=block_v,
        num_warps=8,
    )
    return tokens, logprobs


def _mix32_ref(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = (x * _MIX_MUL1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MIX_MUL2) & _MASK32
    return x ^ (x >> 16)


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The kernel's noise ``g [N, V]`` float32 for rows keyed by int64 ``seeds [N]``, ``positions [N]``."""
    key = _mix32_ref((seeds & _MASK32) ^ _KEY_SALT)
    key = _mix32_ref(key ^ ((seeds >> 32) & _MASK32))
    key = _mix32_ref(key ^ (positions & _MASK32))
    key = _mix32_ref(key ^ ((positions >> 32) & _MASK32))
    key2 = _mix32_ref(key ^ _KEY2_SALT)
    idx = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)
    h = _mix32_ref(_mix32_ref(key[:, None] ^ idx[None, :]) ^ key2[:, None])
    u = ((h >> 9).to(torch.float32) + 0.5) * 2.0**-23
    return -torch.log(-torch.log(u))


def sample_ref(
    logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch :func:`sample` with the same noise (same signature; the oracle of both kernels' tests)."""
    _check_inputs(logits, temperature, seeds, positions)
    z = logits.float() * _inverse_temperature(temperature)[:, None]
    greedy = temperature <= 0
    if bool(greedy.all()):  # an all-greedy batch needs no noise (the CPU engine's greedy decode)
        tokens = z.argmax(dim=-1)
    else:
        y = torch.where(greedy[:, None], z, z + gumbel_noise(seeds, positions, logits.shape[1]))
        tokens = y.argmax(dim=-1)
    logprobs = torch.log_softmax(z, dim=-1).gather(1, tokens[:, None]).squeeze(1)
    return tokens, logprobs
