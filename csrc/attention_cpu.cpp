// CPU paged attention: decode and chunked prefill straight from the pages, fp32 online softmax.
//
// A work item is (sequence, KV head, block of up to kRowsPerItem / G query tokens), or for a decode (one new
// token) the sequence over its KV heads (attend_one_token, below). The KV head's G query heads ride
// together as rows, so every K/V row read from a page serves the whole group (GQA). Keys are
// walked in tiles of kKeyTile: the tile's K is converted to fp32 transposed (one row's scores are then a
// loop over keys, which vectorises without horizontal sums) and its V converted, and each row updates its
// running max, sum and accumulator once per tile. Items are pulled from a shared counter by at most one
// task per thread, largest first, so a long prefill chunk does not leave a thread idle behind it.
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "attention.h"

namespace oppo {
namespace {

constexpr int64_t kKeyTile = 32;      // keys per tile: its scores, K and V stay in L1 up to D = 128
constexpr int64_t kRowsPerItem = 64;  // query rows (tokens x group heads) per work item
constexpr int64_t kDotRows = 8;       // up to this many rows, scores are dot products off the key rows
constexpr int64_t kPrefetchKeys = 8;  // a decode asks for a key's page row this many keys before its scores
// Below this many multiply-adds a call stays on the calling thread: waking the pool would cost more.
constexpr int64_t kSerialWork = 1 << 15;

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
// The extension is not built with -march=native (the wheel may run elsewhere): the tile routine is
// compiled for AVX-512, AVX2+FMA and the baseline, and the loader picks one for this CPU (ifunc).
#define OPPO_ISA_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define OPPO_ISA_CLONES
#endif

// 16 fp32 lanes as a GCC/Clang vector: one zmm in the AVX-512 clone, two ymm or four xmm in the others.
// Written out because the compiler keeps neither the scores of a row across the head_dim loop nor an
// accumulator row across the key loop in registers on its own (a store-to-load chain per step instead).
typedef float vf __attribute__((vector_size(64), aligned(4)));
typedef int32_t vi __attribute__((vector_size(64), aligned(4)));
constexpr int64_t kLanes = 16;

// The helpers below are always inlined: a call from an ISA clone (attend_tile's) into code built for the
// baseline passes through legacy SSE, whose transition from dirty AVX-512 state cost a fifth of a decode.
inline __attribute__((always_inline)) float at_least(float x, float bound) { return x < bound ? bound : x; }
inline __attribute__((always_inline)) vf at_least(vf x, float bound) {
  const vf b = vf{} + bound;
  return x < b ? b : x;  // NaN stays NaN in both: it compares false
}
inline __attribute__((always_inline)) float zero_below(float x, float bound, float y) { return x < bound ? 0.0f : y; }
inline __attribute__((always_inline)) vf zero_below(vf x, float bound, vf y) { return x < vf{} + bound ? vf{} : y; }
inline __attribute__((always_inline)) float pow2(float n) {
  return std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
}
inline __attribute__((always_inline)) vf pow2(vf n) {
  return reinterpret_cast<vf>((__builtin_convertvector(n, vi) + 127) << 23);
}

// exp(x) for x <= 0 without a library call, for a float or 16 of them at once (the same formula; the
// compiler may contract the two into FMAs differently): Cody-Waite reduction to r in [-ln2/2, ln2/2], Cephes' degree-6 polynomial (~1 ulp),
// 2^n through the exponent bits; 0 below -87 (where exp < 1.7e-38, nothing beside a softmax's max).
template <typename F>
inline __attribute__((always_inline)) F exp_nonpositive(F x) {
  const F input = x;
  x = at_least(x, -87.0f);  // keeps 2^n a normal float
  const F n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  const F r = x - n * 0.693359375f + n * 2.12194440e-4f;
  F p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return zero_below(input, -87.0f, p * pow2(n));  // exp(-inf) is 0, the weight of a masked key
}

// tanh of 16 floats through exp(-2|x|), which never overflows; for small |x| the cancellation in 1 - e
// costs ~1e-7 absolute, i.e. ~softcap * 1e-7 on a capped score.
inline __attribute__((always_inline)) vf tanh_vec(vf x) {
  const vf e = exp_nonpositive(x < vf{} ? x * 2.0f : x * -2.0f);
  const vf t = (1.0f - e) / (1.0f + e);
  return x < vf{} ? -t : t;
}

constexpr int64_t kScoreRows = 4;  // rows whose scores are computed together (8 accumulators)

inline __attribute__((always_inline)) vf load(const float* p) { return *reinterpret_cast<const vf*>(p); }
inline __attribute__((always_inline)) void store(float* p, vf v) { *reinterpret_cast<vf*>(p) = v; }
typedef float vf8 __attribute__((vector_size(32), aligned(4)));
typedef float vf4 __attribute__((vector_size(16), aligned(4)));
inline __attribute__((always_inline)) float hsum(vf v) {  // by halves: a lane-by-lane sum is 15 dependent adds
  const vf8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const vf4 c = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (c[0] + c[2]) + (c[1] + c[3]);
}

inline __attribute__((always_inline)) float hmax(vf v) {
  const vf8 a0 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  const vf8 a1 = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const vf8 a = a0 > a1 ? a0 : a1;
  const vf4 c0 = __builtin_shufflevector(a, a, 0, 1, 2, 3), c1 = __builtin_shufflevector(a, a, 4, 5, 6, 7);
  const vf4 c = c0 > c1 ? c0 : c1;
  return std::max(std::max(c[0], c[1]), std::max(c[2], c[3]));
}

// The four sums of a, b, c, d's lanes, in that order: folded pairwise (512 -> 256 -> 128 bits across the
// four, then within each 128-bit group): 14 shuffles and adds for four scores, against 4 x 7 for hsum.
inline __attribute__((always_inline)) vf4 hsum4(vf a, vf b, vf c, vf d) {
  const vf ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const vf cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                __builtin_shufflevector(c, d, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  // [a4 b4 c4 d4]: four lanes left per input
  const vf x = __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  const vf y = x + __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  const vf z = y + __builtin_shufflevector(y, y, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return __builtin_shufflevector(z, z, 0, 4, 8, 12);
}

// acc rows a0, a1 [NV * 16] += sum_j p0[j] / p1[j] * v_rows[j][c0 .. c0 + NV * 16).
template <int NV>
inline __attribute__((always_inline)) void pv_block(float* a0, float* a1, const float* p0, const float* p1,
                                                    const float* const* v_rows, int64_t c0, int64_t nk) {
  vf x0[NV], x1[NV];
  for (int i = 0; i < NV; ++i) {
    x0[i] = load(a0 + i * kLanes);
    x1[i] = load(a1 + i * kLanes);
  }
  for (int64_t j = 0; j < nk; ++j) {
    const float* vj = v_rows[j] + c0;
    for (int i = 0; i < NV; ++i) {
      const vf v = load(vj + i * kLanes);
      x0[i] += p0[j] * v;
      x1[i] += p1[j] * v;
    }
  }
  for (int i = 0; i < NV; ++i) {
    store(a0 + i * kLanes, x0[i]);
    store(a1 + i * kLanes, x1[i]);
  }
}

// The online-softmax update of one key tile, a row at a time in whole vectors: s holds each row's scores on
// entry and its probabilities on return. The scores outside the row's visible keys (not computed, or
// masked) are set to -inf, whose exp is zero, so P @ V can run over the whole tile; padding rows get zero
// probabilities. (Scalar stores set them: GCC turns a select between vectors on a lane-index mask into a
// branch per lane.) Inlined into each ISA clone that calls it.
inline __attribute__((always_inline)) void softmax_tile(const int64_t* jlo, const int64_t* jhi, int64_t rows,
                                                        int64_t rows_pad, int64_t dim_pad, float softcap,
                                                        float* __restrict s, float* __restrict m,
                                                        float* __restrict l, float* __restrict acc) {
  static_assert(kKeyTile == 2 * kLanes, "a tile's scores are two vectors");
  for (int64_t r = 0; r < rows_pad; ++r) {
    float* sr = s + r * kKeyTile;
    const int64_t lo = r < rows ? jlo[r] : 0, hi = r < rows ? jhi[r] : 0;
    if (lo >= hi) {  // no visible key (before the row's window or past its position), or a padding row
      store(sr, vf{});
      store(sr + kLanes, vf{});
      continue;
    }
    if (softcap > 0.0f) {
      store(sr, softcap * tanh_vec(load(sr)));
      store(sr + kLanes, softcap * tanh_vec(load(sr + kLanes)));
    }
    for (int64_t j = 0; j < lo; ++j) sr[j] = -std::numeric_limits<float>::infinity();
    for (int64_t j = hi; j < kKeyTile; ++j) sr[j] = -std::numeric_limits<float>::infinity();
    const vf x0 = load(sr), x1 = load(sr + kLanes);
    // A NaN score makes the row's output NaN, through the max or else through the sum.
    const float m_old = m[r], m_new = std::max(m_old, hmax(x0 > x1 ? x0 : x1));
    const vf p0 = exp_nonpositive(x0 - m_new), p1 = exp_nonpositive(x1 - m_new);
    store(sr, p0);
    store(sr + kLanes, p1);
    const vf sum = p0 + p1;
    if (m_old != m_new) {  // the first tile of a row, or a new max: rescale what came before
      const float alpha = m_old == -std::numeric_limits<float>::infinity() ? 0.0f : exp_nonpositive(m_old - m_new);
      l[r] *= alpha;
      float* ar = acc + r * dim_pad;
      for (int64_t c = 0; c < dim_pad; c += kLanes) store(ar + c, alpha * load(ar + c));
    }
    l[r] += hsum(sum);
    m[r] = m_new;
  }
}

// One key tile for every row of a work item: scores, softcap, online-softmax update, P @ V.
// Row buffers are padded: R_pad = R rounded up to kScoreRows, D_pad = D rounded up to 16, padding zero.
OPPO_ISA_CLONES
void attend_tile(const float* __restrict q,   // [R_pad, D_pad] query rows, pre-scaled (by scale, or scale / softcap)
                 const float* __restrict kt,  // [D, kKeyTile] the tile's keys transposed, or null: use k_rows
                 const float* const* k_rows,  // [kKeyTile] -> [D_pad] each key (a page row, or a padded copy)
                 const float* const* v_rows,  // [kKeyTile] -> [D_pad] each value
                 int64_t num_keys,            // keys in this tile
                 const int64_t* jlo,          // [R] first visible key of each row in the tile
                 const int64_t* jhi,          // [R] one past its last visible key
                 int64_t rows, int64_t head_dim, int64_t dim_pad, float softcap,
                 float* __restrict s,    // [R_pad, kKeyTile] scratch scores, then probabilities
                 float* __restrict m,    // [R] running max
                 float* __restrict l,    // [R] running sum of exp(score - max)
                 float* __restrict acc)  // [R_pad, D_pad] running sum of exp(score - max) * V
{
  const int64_t rows_pad = (rows + kScoreRows - 1) / kScoreRows * kScoreRows;
  if (kt != nullptr) {
    // Many rows: four rows x 32 keys of scores stay in eight registers over the head_dim loop.
    for (int64_t r0 = 0; r0 < rows_pad; r0 += kScoreRows) {
      vf x[kScoreRows][2] = {};
      for (int64_t d = 0; d < head_dim; ++d) {
        const vf k0 = load(kt + d * kKeyTile), k1 = load(kt + d * kKeyTile + kLanes);
        for (int i = 0; i < kScoreRows; ++i) {
          const float qd = q[(r0 + i) * dim_pad + d];
          x[i][0] += qd * k0;
          x[i][1] += qd * k1;
        }
      }
      for (int i = 0; i < kScoreRows; ++i) {
        store(s + (r0 + i) * kKeyTile, x[i][0]);
        store(s + (r0 + i) * kKeyTile + kLanes, x[i][1]);
      }
    }
  } else {
    // Few rows: a dot product per (row, key) straight off the key row, four keys at a time (four
    // independent accumulators, one reduction for the four).
    for (int64_t r = 0; r < rows; ++r) {
      const float* qr = q + r * dim_pad;
      float* sr = s + r * kKeyTile;
      int64_t j = jlo[r];
      for (; j + 4 <= jhi[r]; j += 4) {
        const float *k0 = k_rows[j], *k1 = k_rows[j + 1], *k2 = k_rows[j + 2], *k3 = k_rows[j + 3];
        vf x0 = {}, x1 = {}, x2 = {}, x3 = {};
        for (int64_t c = 0; c < dim_pad; c += kLanes) {
          const vf qc = load(qr + c);
          x0 += qc * load(k0 + c);
          x1 += qc * load(k1 + c);
          x2 += qc * load(k2 + c);
          x3 += qc * load(k3 + c);
        }
        const vf4 four = hsum4(x0, x1, x2, x3);
        for (int i = 0; i < 4; ++i) sr[j + i] = four[i];
      }
      for (; j < jhi[r]; ++j) {
        vf x = {};
        for (int64_t c = 0; c < dim_pad; c += kLanes) x += load(qr + c) * load(k_rows[j] + c);
        sr[j] = hsum(x);
      }
    }
  }

  // Online softmax over the tile, then P @ V.
  softmax_tile(jlo, jhi, rows, rows_pad, dim_pad, softcap, s, m, l, acc);

  // P @ V two rows at a time, in chunks of up to four vectors of head_dim held in registers.
  for (int64_t r0 = 0; r0 < rows; r0 += 2) {
    float* a0 = acc + r0 * dim_pad;
    float* a1 = a0 + dim_pad;  // a padding row when rows is odd: its probabilities are zero
    const float* p0 = s + r0 * kKeyTile;
    const float* p1 = p0 + kKeyTile;
    for (int64_t c0 = 0; c0 < dim_pad; c0 += 4 * kLanes) {
      switch (std::min<int64_t>(4, (dim_pad - c0) / kLanes)) {
        case 4:
          pv_block<4>(a0 + c0, a1 + c0, p0, p1, v_rows, c0, num_keys);
          break;
        case 3:
          pv_block<3>(a0 + c0, a1 + c0, p0, p1, v_rows, c0, num_keys);
          break;
        case 2:
          pv_block<2>(a0 + c0, a1 + c0, p0, p1, v_rows, c0, num_keys);
          break;
        default:
          pv_block<1>(a0 + c0, a1 + c0, p0, p1, v_rows, c0, num_keys);
          break;
      }
    }
  }
}

// bf16 is the upper half of an fp32, so widening is a 16-bit shift into 32-bit lanes: exact, 16 at a time.
typedef uint16_t vh __attribute__((vector_size(32), aligned(2)));
typedef uint32_t vu __attribute__((vector_size(64), aligned(4)));
inline __attribute__((always_inline)) float widen(uint16_t h) {
  return std::bit_cast<float>(static_cast<uint32_t>(h) << 16);
}
inline __attribute__((always_inline)) vf widen(const uint16_t* p) {
  vh h;
  std::memcpy(&h, p, sizeof(h));  // an unaligned load; page rows are only 2-byte aligned
  return reinterpret_cast<vf>(__builtin_convertvector(h, vu) << 16);
}
inline __attribute__((always_inline)) void widen_row(const uint16_t* __restrict src, int64_t n, float* __restrict dst) {
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes) store(dst + d, widen(src + d));
  for (; d < n; ++d) dst[d] = widen(src[d]);
}

// A bf16 tile's K and V rows widened to fp32 (the values the fp32 path reads, bit for bit), in one call per
// tile: built per ISA like attend_tile, where the element-wise conversion in attend_item ran 4 lanes wide.
OPPO_ISA_CLONES
void widen_bf16_tile(const uint16_t* const* k_src,  // [kKeyTile] -> [D] each key's page row
                     const uint16_t* const* v_src,  // [kKeyTile] -> [D] each value's page row
                     int64_t num_keys, int64_t head_dim, int64_t dim_pad,
                     float* __restrict k,   // [kKeyTile, D_pad] keys, or unused when kt is given
                     float* __restrict v,   // [kKeyTile, D_pad] values
                     float* __restrict kt)  // [D, kKeyTile] keys transposed, or null
{
  for (int64_t j = 0; j < num_keys; ++j) {
    if (kt != nullptr) {
      for (int64_t d = 0; d < head_dim; ++d) kt[d * kKeyTile + j] = widen(k_src[j][d]);
    } else {
      widen_row(k_src[j], head_dim, k + j * dim_pad);
    }
    widen_row(v_src[j], head_dim, v + j * dim_pad);
  }
}

// -- one query token of a sequence (decode) -------------------------------------------------------------------
// A single-token item covers the KV heads [kv_head, kv_head + heads) of its sequence, all of them unless the
// batch has fewer such sequences than threads: row r is query head kv_head * G + r. A key's page row holds
// every head (Hkv x D contiguous), so the scores walk the tile's keys in order and, for each key, the
// item's heads: the page is read front to back. The G rows of a head are served by one load of
// each key and value vector (up to four rows at a time, in registers), straight from the page: a bf16 row is
// widened as it is loaded, not copied into scratch. Each (row, key) score and each row's P @ V run the same
// arithmetic in the same order as attend_tile's dot-product path, and bf16 reads the values fp32 reads.
inline __attribute__((always_inline)) vf load_row(const float* p) { return load(p); }
inline __attribute__((always_inline)) vf load_row(const uint16_t* p) { return widen(p); }

// Scores of NR rows (q, s at the block's first row) against the four keys k0..k3, into columns j..j+3.
template <int NR, typename Src>
inline __attribute__((always_inline)) void score_four(const float* __restrict q, int64_t dim_pad, const Src* k0,
                                                      const Src* k1, const Src* k2, const Src* k3, int64_t j,
                                                      float* __restrict s) {
  vf x[NR][4] = {};
  for (int64_t c = 0; c < dim_pad; c += kLanes) {
    const vf y0 = load_row(k0 + c), y1 = load_row(k1 + c), y2 = load_row(k2 + c), y3 = load_row(k3 + c);
    for (int i = 0; i < NR; ++i) {
      const vf qc = load(q + i * dim_pad + c);
      x[i][0] += qc * y0;
      x[i][1] += qc * y1;
      x[i][2] += qc * y2;
      x[i][3] += qc * y3;
    }
  }
  for (int i = 0; i < NR; ++i) {
    const vf4 four = hsum4(x[i][0], x[i][1], x[i][2], x[i][3]);
    for (int t = 0; t < 4; ++t) s[i * kKeyTile + j + t] = four[t];
  }
}

template <int NR, typename Src>
inline __attribute__((always_inline)) void score_one(const float* __restrict q, int64_t dim_pad, const Src* k,
                                                     int64_t j, float* __restrict s) {
  vf x[NR] = {};
  for (int64_t c = 0; c < dim_pad; c += kLanes) {
    const vf y = load_row(k + c);
    for (int i = 0; i < NR; ++i) x[i] += load(q + i * dim_pad + c) * y;
  }
  for (int i = 0; i < NR; ++i) s[i * kKeyTile + j] = hsum(x[i]);
}

// acc[NR rows][c0 .. c0 + NV * 16) += sum_j p[row][j] * v_rows[j][off + c0 ..]: each value vector loaded once
// for the NR rows.
template <int NR, int NV, typename Src>
inline __attribute__((always_inline)) void pv_rows(float* __restrict acc, int64_t dim_pad, const float* __restrict p,
                                                   const Src* const* v_rows, int64_t off, int64_t nk) {
  vf x[NR][NV];
  for (int r = 0; r < NR; ++r) {
    for (int i = 0; i < NV; ++i) x[r][i] = load(acc + r * dim_pad + i * kLanes);
  }
  for (int64_t j = 0; j < nk; ++j) {
    const Src* vj = v_rows[j] + off;
    vf v[NV];
    for (int i = 0; i < NV; ++i) v[i] = load_row(vj + i * kLanes);
    for (int r = 0; r < NR; ++r) {
      const float pr = p[r * kKeyTile + j];
      for (int i = 0; i < NV; ++i) x[r][i] += pr * v[i];
    }
  }
  for (int r = 0; r < NR; ++r) {
    for (int i = 0; i < NV; ++i) store(acc + r * dim_pad + i * kLanes, x[r][i]);
  }
}

template <int NR, typename Src>
inline __attribute__((always_inline)) void pv_rows_all(float* acc, int64_t dim_pad, const float* p,
                                                       const Src* const* v_rows, int64_t off, int64_t nk) {
  for (int64_t c0 = 0; c0 < dim_pad; c0 += 4 * kLanes) {
    switch (std::min<int64_t>(4, (dim_pad - c0) / kLanes)) {
      case 4:
        pv_rows<NR, 4>(acc + c0, dim_pad, p, v_rows, off + c0, nk);
        break;
      case 3:
        pv_rows<NR, 3>(acc + c0, dim_pad, p, v_rows, off + c0, nk);
        break;
      case 2:
        pv_rows<NR, 2>(acc + c0, dim_pad, p, v_rows, off + c0, nk);
        break;
      default:
        pv_rows<NR, 1>(acc + c0, dim_pad, p, v_rows, off + c0, nk);
        break;
    }
  }
}

// CALL(NR) for NR = min(4, n): a block of up to four rows, held in registers.
#define OPPO_ROW_BLOCK(n, CALL)   \
  switch (std::min<int64_t>(4, n)) { \
    case 4:                       \
      CALL(4);                    \
      break;                      \
    case 3:                       \
      CALL(3);                    \
      break;                      \
    case 2:                       \
      CALL(2);                    \
      break;                      \
    default:                      \
      CALL(1);                    \
      break;                      \
  }

// One key tile of a single-token item: its heads x group rows all see keys [lo, hi) of the tile. head_dim
// fills whole vectors (dim_pad == head_dim), so the page rows are read in place; head h's K and V start
// h * head_stride elements into each page row.
template <typename Src>
inline __attribute__((always_inline)) void attend_one_token_body(const float* q, const Src* const* k_rows,
                                                                 const Src* const* v_rows, int64_t num_keys,
                                                                 int64_t ahead, int64_t heads, int64_t head_stride,
                                                                 int64_t group, const int64_t* jlo, const int64_t* jhi,
                                                                 int64_t dim_pad, float softcap, float* s, float* m,
                                                                 float* l, float* acc) {
  const int64_t lo = jlo[0], hi = jhi[0], rows = heads * group;
  // Bytes of a key's page row that the heads read (the rows of all heads are contiguous in a page).
  const int64_t row_bytes = ((heads - 1) * head_stride + dim_pad) * static_cast<int64_t>(sizeof(Src));
  int64_t j = lo;
  for (; j + 4 <= hi; j += 4) {
    // The out-of-order window spans about one group of four keys, so the page rows are asked for ahead:
    // the keys kPrefetchKeys on (the pointer arrays run ahead keys past this tile's start), and this
    // group's values, which P @ V reads after the tile's scores.
    for (int64_t t = 0; t < 4; ++t) {
      const char* v = reinterpret_cast<const char*>(v_rows[j + t]);
      for (int64_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(v + o, 0, 3);
      if (j + t + kPrefetchKeys < ahead) {
        const char* k = reinterpret_cast<const char*>(k_rows[j + t + kPrefetchKeys]);
        for (int64_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(k + o, 0, 3);
      }
    }
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t off = h * head_stride;
      const Src *k0 = k_rows[j] + off, *k1 = k_rows[j + 1] + off, *k2 = k_rows[j + 2] + off, *k3 = k_rows[j + 3] + off;
      for (int64_t r0 = h * group; r0 < (h + 1) * group; r0 += 4) {
#define OPPO_SCORE_FOUR(NR) score_four<NR>(q + r0 * dim_pad, dim_pad, k0, k1, k2, k3, j, s + r0 * kKeyTile)
        OPPO_ROW_BLOCK((h + 1) * group - r0, OPPO_SCORE_FOUR)
#undef OPPO_SCORE_FOUR
      }
    }
  }
  for (; j < hi; ++j) {
    for (int64_t h = 0; h < heads; ++h) {
      const Src* k = k_rows[j] + h * head_stride;
      for (int64_t r0 = h * group; r0 < (h + 1) * group; r0 += 4) {
#define OPPO_SCORE_ONE(NR) score_one<NR>(q + r0 * dim_pad, dim_pad, k, j, s + r0 * kKeyTile)
        OPPO_ROW_BLOCK((h + 1) * group - r0, OPPO_SCORE_ONE)
#undef OPPO_SCORE_ONE
      }
    }
  }
  softmax_tile(jlo, jhi, rows, rows, dim_pad, softcap, s, m, l, acc);
  for (int64_t h = 0; h < heads; ++h) {
    const int64_t off = h * head_stride;
    for (int64_t r0 = h * group; r0 < (h + 1) * group; r0 += 4) {
#define OPPO_PV(NR) pv_rows_all<NR>(acc + r0 * dim_pad, dim_pad, s + r0 * kKeyTile, v_rows, off, num_keys)
      OPPO_ROW_BLOCK((h + 1) * group - r0, OPPO_PV)
#undef OPPO_PV
    }
  }
}
#undef OPPO_ROW_BLOCK

OPPO_ISA_CLONES
void attend_one_token(const float* q, const float* const* k_rows, const float* const* v_rows, int64_t num_keys,
                      int64_t ahead, int64_t heads, int64_t head_stride, int64_t group, const int64_t* jlo,
                      const int64_t* jhi, int64_t dim_pad, float softcap, float* s, float* m, float* l, float* acc) {
  attend_one_token_body(q, k_rows, v_rows, num_keys, ahead, heads, head_stride, group, jlo, jhi, dim_pad, softcap, s,
                        m, l, acc);
}

OPPO_ISA_CLONES
void attend_one_token(const float* q, const uint16_t* const* k_rows, const uint16_t* const* v_rows, int64_t num_keys,
                      int64_t ahead, int64_t heads, int64_t head_stride, int64_t group, const int64_t* jlo,
                      const int64_t* jhi, int64_t dim_pad, float softcap, float* s, float* m, float* l, float* acc) {
  attend_one_token_body(q, k_rows, v_rows, num_keys, ahead, heads, head_stride, group, jlo, jhi, dim_pad, softcap, s,
                        m, l, acc);
}

// Everything a work item reads about the call: pointers into the int32 metadata and element strides.
struct Batch {
  const int32_t* block_tables;  // [N, max_pages]
  const int32_t* context_lens;  // [N]
  const int32_t* cu_seqlens_q;  // [N + 1]
  int64_t bt_stride_seq, bt_stride_page;
  int64_t page_size, group, head_dim;
  int64_t kv_stride_page, kv_stride_kv, kv_stride_tok, kv_stride_head;  // of kv_cache[:, layer]
  int64_t q_stride_tok, q_stride_head, o_stride_tok, o_stride_head;
  float q_scale, softcap;
  int64_t window;  // 0 = none
  bool one_token;  // items of one token take attend_one_token (fp32 and bf16 only)
};

struct Item {
  int32_t seq, kv_head, tok_lo, tok_hi;  // query tokens [tok_lo, tok_hi) of the sequence's new tokens
  int64_t cost;                          // rows x keys walked, for scheduling the largest first
  int32_t heads;                         // KV heads from kv_head: 1, or all of a one-token item's
};

// Per-thread buffers, sized once per call for the largest item; row buffers padded as attend_tile wants.
struct Scratch {
  int64_t dim_pad;
  std::vector<float> q, acc, m, l, s, kt, k, v;
  std::vector<const float*> k_rows, v_rows;
  std::vector<const uint16_t*> k_src, v_src;  // [kKeyTile] a bf16 tile's page rows, before widening
  std::vector<int64_t> pos, jlo, jhi;  // [R] each row's position, and its visible keys in the current tile
  Scratch(int64_t rows, int64_t head_dim)
      : dim_pad((head_dim + kLanes - 1) / kLanes * kLanes),
        q(pad_rows(rows) * dim_pad, 0.0f),
        acc(pad_rows(rows) * dim_pad),
        m(rows),
        l(rows),
        s(pad_rows(rows) * kKeyTile),
        kt(head_dim * kKeyTile, 0.0f),
        k(kKeyTile * dim_pad, 0.0f),  // the padding stays zero: only [0, head_dim) of a row is written
        v(kKeyTile * dim_pad, 0.0f),
        k_rows(kKeyTile),
        v_rows(kKeyTile),
        k_src(kKeyTile),
        v_src(kKeyTile),
        pos(rows),
        jlo(rows),
        jhi(rows) {}
  static int64_t pad_rows(int64_t rows) { return (rows + kScoreRows - 1) / kScoreRows * kScoreRows; }
};

template <typename T>
void attend_item(const Batch& b,
                 const T* q,    // [T, Hq, D]
                 const T* kv,   // kv_cache[:, layer]: [num_pages, 2, page_size, Hkv, D]
                 T* out,        // [T, Hq, D]
                 const Item& it, Scratch& w) {
  const int64_t group = b.group, head_dim = b.head_dim;
  const int64_t q_start = b.cu_seqlens_q[it.seq], q_len = b.cu_seqlens_q[it.seq + 1] - q_start;
  const int64_t first_pos = b.context_lens[it.seq] - q_len + it.tok_lo;  // position of the item's first token
  // A one-token item (Batch::one_token) covers its heads: row r is q head kv_head * G + r. Otherwise row r is token
  // tok_lo + r / G, q head kv_head * G + r % G. Padding rows and columns are zero.
  const bool one_token = b.one_token && it.tok_hi - it.tok_lo == 1;
  const int64_t rows = (it.tok_hi - it.tok_lo) * group * it.heads, rows_pad = Scratch::pad_rows(rows);
  const int64_t dim_pad = w.dim_pad;
  const int64_t row_tok = one_token ? rows : group;  // rows per token
  std::fill_n(w.q.begin(), rows_pad * dim_pad, 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = q + (q_start + it.tok_lo + r / row_tok) * b.q_stride_tok + (it.kv_head * group + r % row_tok) * b.q_stride_head;
    float* dst = w.q.data() + r * dim_pad;
    for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<float>(src[d]) * b.q_scale;
  }
  std::fill_n(w.m.begin(), rows, -std::numeric_limits<float>::infinity());
  std::fill_n(w.l.begin(), rows, 0.0f);
  std::fill_n(w.acc.begin(), rows_pad * dim_pad, 0.0f);

  // Keys from the first token's window start (nothing earlier is read, not even its page id) to the
  // last token's position.
  const int64_t key_lo = b.window > 0 ? std::max<int64_t>(0, first_pos - b.window + 1) : 0;
  const int64_t key_hi = first_pos + (it.tok_hi - it.tok_lo);
  const int32_t* table = b.block_tables + it.seq * b.bt_stride_seq;
  const T* kv_head = kv + it.kv_head * b.kv_stride_head;
  for (int64_t r = 0; r < rows; ++r) w.pos[r] = first_pos + r / row_tok;
  // Few rows (decode): each score is a dot product straight off the key's row. Many rows (prefill): the
  // tile's keys are transposed once so the scores vectorise over keys, which pays back the copy when it
  // serves many rows. fp32 rows whose head_dim fills whole vectors are read in place from the page.
  const bool transpose = !one_token && rows > kDotRows;
  constexpr bool is_float = std::is_same_v<T, float>;
  constexpr bool is_bf16 = std::is_same_v<T, at::BFloat16>;
  const bool in_place = is_float && dim_pad == head_dim;
  // The page walk advances by increments: a 64-bit division per key would cost more than its dot products.
  int64_t page_idx = key_lo / b.page_size, offset = key_lo % b.page_size;
  if (one_token) {
    // Every key's page row first, the item's whole context, so that a tile can ask for rows ahead of it.
    const int64_t keys = key_hi - key_lo;
    if constexpr (is_bf16 || is_float) {
      using Src = std::conditional_t<is_bf16, uint16_t, float>;
      std::vector<const Src*>& k_ptrs = [&]() -> std::vector<const Src*>& {
        if constexpr (is_bf16) return w.k_src; else return w.k_rows;
      }();
      std::vector<const Src*>& v_ptrs = [&]() -> std::vector<const Src*>& {
        if constexpr (is_bf16) return w.v_src; else return w.v_rows;
      }();
      if (static_cast<int64_t>(k_ptrs.size()) < keys) {
        k_ptrs.resize(keys);
        v_ptrs.resize(keys);
      }
      for (int64_t j = 0; j < keys; ++j) {
        const T* k_row = kv_head + table[page_idx * b.bt_stride_page] * b.kv_stride_page + offset * b.kv_stride_tok;
        k_ptrs[j] = reinterpret_cast<const Src*>(k_row);
        v_ptrs[j] = reinterpret_cast<const Src*>(k_row + b.kv_stride_kv);
        if (++offset == b.page_size) {
          offset = 0;
          ++page_idx;
        }
      }
      for (int64_t k0 = key_lo; k0 < key_hi; k0 += kKeyTile) {
        const int64_t nk = std::min(kKeyTile, key_hi - k0);
        // One token: every row sees the same keys of the tile.
        const int64_t visible_lo = b.window > 0 ? w.pos[0] - b.window + 1 : 0;
        std::fill_n(w.jlo.begin(), rows, std::clamp<int64_t>(visible_lo - k0, 0, nk));
        std::fill_n(w.jhi.begin(), rows, std::clamp<int64_t>(w.pos[0] + 1 - k0, 0, nk));
        attend_one_token(w.q.data(), k_ptrs.data() + (k0 - key_lo), v_ptrs.data() + (k0 - key_lo), nk, key_hi - k0,
                         it.heads, b.kv_stride_head, group, w.jlo.data(), w.jhi.data(), dim_pad, b.softcap,
                         w.s.data(), w.m.data(), w.l.data(), w.acc.data());
      }
    } else {
      TORCH_INTERNAL_ASSERT(false, "paged_attention: a one-token item of a dtype without that path");
    }
  }
  for (int64_t k0 = key_lo; k0 < key_hi && !one_token; k0 += kKeyTile) {
    const int64_t nk = std::min(kKeyTile, key_hi - k0);
    for (int64_t j = 0; j < nk; ++j) {
      const T* k_row = kv_head + table[page_idx * b.bt_stride_page] * b.kv_stride_page + offset * b.kv_stride_tok;
      const T* v_row = k_row + b.kv_stride_kv;
      if constexpr (is_bf16) {  // widened below, the whole tile in one call
        w.k_src[j] = reinterpret_cast<const uint16_t*>(k_row);
        w.v_src[j] = reinterpret_cast<const uint16_t*>(v_row);
        w.k_rows[j] = w.k.data() + j * dim_pad;
        w.v_rows[j] = w.v.data() + j * dim_pad;
      } else {
        if (transpose) {
          for (int64_t d = 0; d < head_dim; ++d) w.kt[d * kKeyTile + j] = static_cast<float>(k_row[d]);
        }
        if (in_place) {
          w.k_rows[j] = reinterpret_cast<const float*>(k_row);
          w.v_rows[j] = reinterpret_cast<const float*>(v_row);
        } else {
          float* k_dst = w.k.data() + j * dim_pad;
          float* v_dst = w.v.data() + j * dim_pad;
          if (!transpose) {
            for (int64_t d = 0; d < head_dim; ++d) k_dst[d] = static_cast<float>(k_row[d]);
          }
          for (int64_t d = 0; d < head_dim; ++d) v_dst[d] = static_cast<float>(v_row[d]);
          w.k_rows[j] = k_dst;
          w.v_rows[j] = v_dst;
        }
      }
      if (++offset == b.page_size) {
        offset = 0;
        ++page_idx;
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t visible_lo = b.window > 0 ? w.pos[r] - b.window + 1 : 0;
      w.jlo[r] = std::clamp<int64_t>(visible_lo - k0, 0, nk);
      w.jhi[r] = std::clamp<int64_t>(w.pos[r] + 1 - k0, 0, nk);
    }
    if constexpr (is_bf16) {
      widen_bf16_tile(w.k_src.data(), w.v_src.data(), nk, head_dim, dim_pad, w.k.data(), w.v.data(),
                      transpose ? w.kt.data() : nullptr);
    }
    attend_tile(w.q.data(), transpose ? w.kt.data() : nullptr, w.k_rows.data(), w.v_rows.data(), nk, w.jlo.data(),
                w.jhi.data(), rows, head_dim, dim_pad, b.softcap, w.s.data(), w.m.data(), w.l.data(), w.acc.data());
  }

  for (int64_t r = 0; r < rows; ++r) {
    // NOTE: every row sees at least its own key, so l > 0.
    const float inv = 1.0f / w.l[r];
    const float* a = w.acc.data() + r * dim_pad;
    T* dst = out + (q_start + it.tok_lo + r / row_tok) * b.o_stride_tok + (it.kv_head * group + r % row_tok) * b.o_stride_head;
    for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<T>(a[d] * inv);
  }
}

template <typename T>
void run_items(const Batch& b, const at::Tensor& q, const at::Tensor& kv_cache, int64_t layer, at::Tensor& out,
               const std::vector<Item>& items, int64_t max_rows, int64_t total_cost) {
  const T* q_ptr = q.const_data_ptr<T>();
  const T* kv_ptr = kv_cache.const_data_ptr<T>() + layer * kv_cache.stride(1);  // kv_cache[:, layer]
  T* out_ptr = out.mutable_data_ptr<T>();
  const int64_t tasks = total_cost * b.head_dim < kSerialWork
                            ? 1
                            : std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(items.size()));
  std::atomic<size_t> next{0};
  auto worker = [&]() {
    Scratch w(max_rows, b.head_dim);
    for (size_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < items.size();) {
      attend_item<T>(b, q_ptr, kv_ptr, out_ptr, items[i], w);
    }
  };
  if (tasks <= 1) {
    worker();
    return;
  }
  // One task per thread; each drains the shared counter (dynamic scheduling over uneven items).
  at::parallel_for(0, tasks, 1, [&](int64_t, int64_t) { worker(); });
}

void check_args(const at::Tensor& q, const at::Tensor& kv_cache, int64_t layer, const at::Tensor& block_tables,
                const at::Tensor& context_lens, const at::Tensor& cu_seqlens_q, double scale, const at::Tensor& out) {
  TORCH_CHECK_VALUE(q.dim() == 3, "paged_attention: q must be [T, Hq, D], got ", q.sizes());
  const auto dtype = q.scalar_type();
  TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
                    "paged_attention: q must be float32, bfloat16 or float16, got ", dtype);
  TORCH_CHECK_VALUE(q.stride(2) == 1, "paged_attention: q must be contiguous in head_dim, got strides ", q.strides());
  TORCH_CHECK_VALUE(kv_cache.dim() == 6 && kv_cache.size(2) == 2,
                    "paged_attention: kv_cache must be [num_pages, L, 2, page_size, Hkv, D], got ", kv_cache.sizes());
  TORCH_CHECK_VALUE(kv_cache.scalar_type() == dtype, "paged_attention: kv_cache dtype ", kv_cache.scalar_type(),
                    " must equal q dtype ", dtype);
  TORCH_CHECK_VALUE(kv_cache.size(5) == q.size(2), "paged_attention: kv_cache head_dim ", kv_cache.size(5),
                    " must equal q head_dim ", q.size(2));
  TORCH_CHECK_VALUE(kv_cache.stride(5) == 1, "paged_attention: kv_cache must be contiguous in head_dim, got strides ",
                    kv_cache.strides());
  TORCH_CHECK_VALUE(kv_cache.size(3) > 0 && kv_cache.size(4) > 0 && q.size(1) % kv_cache.size(4) == 0,
                    "paged_attention: q heads (", q.size(1), ") must be a multiple of kv_cache heads (",
                    kv_cache.size(4), ")");
  TORCH_CHECK_VALUE(layer >= 0 && layer < kv_cache.size(1), "paged_attention: layer ", layer, " outside [0, ",
                    kv_cache.size(1), ")");
  TORCH_CHECK_VALUE(context_lens.dim() == 1 && context_lens.scalar_type() == at::kInt,
                    "paged_attention: context_lens must be a 1-D int32 tensor, got ", context_lens.scalar_type(), " ",
                    context_lens.sizes());
  const int64_t num_seqs = context_lens.size(0);
  TORCH_CHECK_VALUE(cu_seqlens_q.dim() == 1 && cu_seqlens_q.scalar_type() == at::kInt &&
                        cu_seqlens_q.size(0) == num_seqs + 1,
                    "paged_attention: cu_seqlens_q must be int32 [N + 1] = [", num_seqs + 1, "], got ",
                    cu_seqlens_q.scalar_type(), " ", cu_seqlens_q.sizes());
  TORCH_CHECK_VALUE(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt &&
                        block_tables.size(0) == num_seqs,
                    "paged_attention: block_tables must be int32 [N, max_pages] with N = ", num_seqs, ", got ",
                    block_tables.scalar_type(), " ", block_tables.sizes());
  TORCH_CHECK_VALUE(context_lens.is_contiguous() && cu_seqlens_q.is_contiguous(),
                    "paged_attention: context_lens and cu_seqlens_q must be contiguous");
  TORCH_CHECK_VALUE(out.sizes() == q.sizes() && out.scalar_type() == dtype,
                    "paged_attention: out must match q (", dtype, " ", q.sizes(), "), got ", out.scalar_type(), " ",
                    out.sizes());
  TORCH_CHECK_VALUE(out.stride(2) == 1, "paged_attention: out must be contiguous in head_dim, got strides ",
                    out.strides());
  for (const auto* t : {&kv_cache, &block_tables, &context_lens, &cu_seqlens_q, &out}) {
    TORCH_CHECK_VALUE(t->device().is_cpu(), "paged_attention: every tensor must be on the CPU, got one on ",
                      t->device());
  }
  TORCH_CHECK_VALUE(std::isfinite(scale), "paged_attention: scale must be finite, got ", scale);
}

}  // namespace

void paged_attention_cpu(const at::Tensor& q, const at::Tensor& kv_cache, int64_t layer,
                         const at::Tensor& block_tables, const at::Tensor& context_lens,
                         const at::Tensor& cu_seqlens_q, double scale, int64_t sliding_window, double softcap,
                         at::Tensor& out) {
  check_args(q, kv_cache, layer, block_tables, context_lens, cu_seqlens_q, scale, out);
  const int64_t num_tokens = q.size(0), num_seqs = context_lens.size(0);
  const int64_t page_size = kv_cache.size(3), num_kv_heads = kv_cache.size(4), num_pages = kv_cache.size(0);
  const int64_t group = q.size(1) / num_kv_heads, max_pages = block_tables.size(1);
  const int32_t* ctx = context_lens.const_data_ptr<int32_t>();
  const int32_t* cu = cu_seqlens_q.const_data_ptr<int32_t>();
  const int32_t* table = block_tables.const_data_ptr<int32_t>();
  const int64_t bt_s0 = block_tables.stride(0), bt_s1 = block_tables.stride(1);
  const int64_t window = sliding_window > 0 ? sliding_window : 0;

  // Validate every value the items will read before anything is written; O(N + pages read), no more.
  TORCH_CHECK_VALUE(cu[0] == 0 && cu[num_seqs] == num_tokens, "paged_attention: cu_seqlens_q must run from 0 to T = ",
                    num_tokens, ", got ", cu[0], " .. ", cu[num_seqs]);
  const int64_t tok_per_item = std::max<int64_t>(1, kRowsPerItem / group);
  // A sequence with one new token (a decode) is one item over all KV heads (attend_one_token) where its
  // per-head rows are few, head_dim fills whole vectors and the dtype is fp32 or bf16.
  const int64_t head_dim = q.size(2);
  const bool one_token = group <= kDotRows && head_dim % kLanes == 0 &&
                         (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16);
  bool any_one_token = false;
  // Fewer such sequences than threads (a lone decode): an item per KV head instead, so the threads share
  // the heads. A row's arithmetic is the same either way (a head's rows read only that head's keys).
  int64_t one_token_seqs = 0;
  for (int64_t n = 0; n < num_seqs && one_token; ++n) one_token_seqs += cu[n + 1] - cu[n] == 1;
  const int64_t heads_per_item = one_token_seqs >= at::get_num_threads() ? num_kv_heads : 1;
  std::vector<Item> items;
  int64_t total_cost = 0;
  bool uneven = false;
  for (int64_t n = 0; n < num_seqs; ++n) {
    const int64_t q_len = cu[n + 1] - cu[n];
    TORCH_CHECK_VALUE(q_len >= 0 && ctx[n] >= q_len, "paged_attention: sequence ", n, " has ", q_len,
                      " new tokens and context_lens ", ctx[n], " (cu_seqlens_q must not decrease, and the "
                      "context includes the new tokens)");
    if (q_len == 0) continue;
    const int64_t pages = (ctx[n] + page_size - 1) / page_size;
    TORCH_CHECK_VALUE(pages <= max_pages, "paged_attention: sequence ", n, " needs ", pages,
                      " pages for context_lens ", ctx[n], " but block_tables has ", max_pages, " columns");
    const int64_t first_key = window > 0 ? std::max<int64_t>(0, ctx[n] - q_len - window + 1) : 0;
    for (int64_t p = first_key / page_size; p < pages; ++p) {
      const int64_t id = table[n * bt_s0 + p * bt_s1];
      TORCH_CHECK_VALUE(id >= 0 && id < num_pages, "paged_attention: block_tables[", n, ", ", p, "] = ", id,
                        " outside [0, ", num_pages, ")");
    }
    uneven |= q_len > 1;
    any_one_token |= one_token && q_len == 1;
    for (int64_t t0 = 0; t0 < q_len; t0 += tok_per_item) {
      const int64_t t1 = std::min(q_len, t0 + tok_per_item);
      const int64_t first_pos = ctx[n] - q_len + t0;
      const int64_t keys = first_pos + (t1 - t0) - (window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0);
      const int64_t cost = (t1 - t0) * group * keys;
      total_cost += cost;
      if (one_token && q_len == 1) {  // an item for its heads: each page row is read once, front to back
        for (int64_t h = 0; h < num_kv_heads; h += heads_per_item) {
          items.push_back({static_cast<int32_t>(n), static_cast<int32_t>(h), 0, 1, cost * heads_per_item,
                           static_cast<int32_t>(heads_per_item)});
        }
        continue;
      }
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        items.push_back({static_cast<int32_t>(n), static_cast<int32_t>(h), static_cast<int32_t>(t0),
                         static_cast<int32_t>(t1), cost, 1});
      }
    }
  }
  if (items.empty()) return;
  if (uneven) {
    std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  }

  const bool capped = softcap > 0.0;
  const Batch b{table,
                ctx,
                cu,
                bt_s0,
                bt_s1,
                page_size,
                group,
                q.size(2),
                kv_cache.stride(0),
                kv_cache.stride(2),
                kv_cache.stride(3),
                kv_cache.stride(4),
                q.stride(0),
                q.stride(1),
                out.stride(0),
                out.stride(1),
                static_cast<float>(capped ? scale / softcap : scale),
                static_cast<float>(capped ? softcap : 0.0),
                window,
                one_token};
  const int64_t max_rows = std::max<int64_t>(std::min<int64_t>(tok_per_item, cu[num_seqs]) * group,
                                             any_one_token ? heads_per_item * group : 0);
  switch (q.scalar_type()) {
    case at::kFloat:
      run_items<float>(b, q, kv_cache, layer, out, items, max_rows, total_cost);
      break;
    case at::kBFloat16:
      run_items<at::BFloat16>(b, q, kv_cache, layer, out, items, max_rows, total_cost);
      break;
    default:
      run_items<at::Half>(b, q, kv_cache, layer, out, items, max_rows, total_cost);
      break;
  }
}

}  // namespace oppo
