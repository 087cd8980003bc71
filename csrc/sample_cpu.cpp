// CPU kernel of torch.ops.oppo.sample: Gumbel-max sampling with the counter-based noise of oppo_engine/kernels/sample.py
// (see its docstring for the hash), returning each row's token and its log-prob.
//
// A row is cut into fixed tiles of the vocabulary; each (row, tile) is one work item that reads its logits
// once into an L1-resident buffer and makes two passes over it: the tile max, then sum(exp(z - max)) and the
// running argmax of z + g. Per-tile partials are combined per row in tile order. The tiling depends on V
// alone, so a row's result never depends on the thread count or on the other rows of the batch.
//
// The noise g = -log(-log(u)) is exact where it decides the token: each log taken in double and rounded to
// float (the correctly rounded fp32 log but for a ~2^-29 chance), so it is the same on every machine. An
// accurate fp32 log -- torch's reference on the CPU uses MKL's -- returns the same float for all but ~0.1% of
// the 2^23 values u can take, by one ULP there, so tokens equal the reference's on random inputs. To keep
// the pass vectorised, g is first computed with at::vec's fp32 Sleef log (1 ULP; it differs from MKL's on
// 1.8% of u) and only the tokens within an error margin of the tile's best are recomputed exactly.
// On x86 this file is compiled for AVX2 (CMakeLists.txt).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "sample_ops.h"

namespace oppo {
namespace {

using Vec = at::vec::Vectorized<float>;

constexpr uint32_t kKeySalt = 0x9E3779B9u;
constexpr uint32_t kKey2Salt = 0x85EBCA6Bu;
// Vocabulary elements per work item: its z and y buffers (2 x 16 KiB) stay in L1 between the passes.
constexpr int64_t kTile = 4096;
// Indices inside a tile travel in float lanes next to the values they index; exact below 2^24.
static_assert(kTile <= (int64_t{1} << 24));
constexpr int64_t kMaxVocab = int64_t{1} << 31;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Aim for ~32K logits per parallel chunk so small batches with small vocabularies stay on one thread.
constexpr int64_t kElementsPerChunk = 32768;

// Chris Wellons' lowbias32, exactly as _mix32 in oppo_engine/kernels/sample.py.
inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

struct RowKey {
  uint32_t k, k2;
};

inline RowKey row_key(int64_t seed, int64_t position) {
  const auto s = static_cast<uint64_t>(seed), p = static_cast<uint64_t>(position);
  uint32_t k = mix32(static_cast<uint32_t>(s) ^ kKeySalt);
  k = mix32(k ^ static_cast<uint32_t>(s >> 32));
  k = mix32(k ^ static_cast<uint32_t>(p));
  k = mix32(k ^ static_cast<uint32_t>(p >> 32));
  return {k, mix32(k ^ kKey2Salt)};
}

// One tile's share of a row: enough to combine tiles into the row's log-sum-exp and argmax.
struct Partial {
  float max;         // max of z over the tile; -inf when every logit is masked
  float sum_exp;     // sum of exp(z - max); 0 when every logit is masked
  float best_y;      // max of z + g (of z for a greedy row)
  int64_t best_idx;  // the lowest vocab index attaining best_y
};

inline float uniform(RowKey key, uint32_t v) {
  const uint32_t h = mix32(mix32(key.k ^ v) ^ key.k2);
  return (static_cast<float>(h >> 9) + 0.5f) * 0x1p-23f;  // 23 random bits, exact, strictly inside (0, 1)
}

// The exact noise at one vocab index: each log in double, rounded to float as an fp32 log would return it.
inline float gumbel_exact(RowKey key, uint32_t v) {
  const float neg_log_u = -static_cast<float>(std::log(static_cast<double>(uniform(key, v))));
  return -static_cast<float>(std::log(static_cast<double>(neg_log_u)));
}

// An upper bound on |fp32 Sleef g - exact g| (each Sleef log is within 1 ULP, g within [-2.8, 16.7]: the
// error is a few 1e-6), with a wide safety factor, plus 8 ULPs of y for the rounding of z + g.
inline float fast_noise_margin(float y) { return 1e-4f + 1e-6f * std::abs(y); }

template <typename scalar_t, bool kGreedy>
Partial sample_tile(const scalar_t* logits,  // [len]: vocab indices [start, start + len) of one row
                    int64_t start, int64_t len, float inv_t, RowKey key) {
  constexpr int64_t W = Vec::size();
  alignas(64) float z[kTile];
  alignas(64) float y[kTile];  // z + g with the fast noise (sampled rows)
  const int64_t padded = (len + W - 1) / W * W;
  // fp32 multiply by 1 / T, as the reference does, so z carries the same bits.
  for (int64_t j = 0; j < len; ++j) z[j] = static_cast<float>(logits[j]) * inv_t;
  for (int64_t j = len; j < padded; ++j) z[j] = kNegInf;  // padding never wins and adds exp(-inf) = 0

  Vec vmax(kNegInf);
  for (int64_t j = 0; j < padded; j += W) vmax = at::vec::maximum(vmax, Vec::loadu(z + j));
  const float tile_max = vmax.reduce_max();
  // A fully masked tile (common under top-k) has nothing to add and nothing that can win.
  if (tile_max == kNegInf) return {kNegInf, 0.0f, kNegInf, start};
  const Vec shift(tile_max);

  const uint32_t base = static_cast<uint32_t>(start);
  if constexpr (!kGreedy) {
    // Plain uint32 arithmetic: the compiler vectorises this loop.
    for (int64_t j = 0; j < padded; ++j) y[j] = uniform(key, base + static_cast<uint32_t>(j));
  }
  Vec sum_exp(0.0f), best_y(kNegInf), best_idx(0.0f);
  Vec idx = Vec::arange(0.0f, 1.0f);
  const Vec step(static_cast<float>(W));
  for (int64_t j = 0; j < padded; j += W) {
    const Vec zj = Vec::loadu(z + j);
    sum_exp = sum_exp + (zj - shift).exp();
    if constexpr (kGreedy) {
      // Strict > keeps each lane's earliest index on ties.
      const Vec better = zj > best_y;
      best_y = Vec::blendv(best_y, zj, better);
      best_idx = Vec::blendv(best_idx, idx, better);
      idx = idx + step;
    } else {
      const Vec yj = zj + Vec::loadu(y + j).log().neg().log().neg();
      yj.store(y + j);
      best_y = at::vec::maximum(best_y, yj);
    }
  }

  const float y_max = best_y.reduce_max();
  if constexpr (kGreedy) {
    alignas(64) float lane_y[W];
    alignas(64) float lane_idx[W];
    best_y.store(lane_y);
    best_idx.store(lane_idx);
    float first = static_cast<float>(kTile);
    for (int64_t l = 0; l < W; ++l) {
      if (lane_y[l] == y_max && lane_idx[l] < first) first = lane_idx[l];
    }
    return {tile_max, sum_exp.reduce_add(), y_max, start + static_cast<int64_t>(first)};
  }
  // The fast (fp32 Sleef) noise only shortlists: any token whose exact z + g could reach the exact maximum
  // lies within the margin of the fast maximum. Those few get the exact noise; ascending order and strict >
  // keep the lowest index on ties.
  const float cutoff = y_max - fast_noise_margin(y_max);
  float exact_best = kNegInf;
  int64_t exact_idx = 0;
  for (int64_t j = 0; j < len; ++j) {
    if (y[j] < cutoff) continue;
    const float yj = z[j] + gumbel_exact(key, base + static_cast<uint32_t>(j));
    if (yj > exact_best) {
      exact_best = yj;
      exact_idx = j;
    }
  }
  return {tile_max, sum_exp.reduce_add(), exact_best, start + exact_idx};
}

void check_sample_args(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& seeds,
                       const at::Tensor& positions) {
  TORCH_CHECK_VALUE(logits.dim() == 2 && logits.size(1) >= 1,
                    "sample: logits must be [N, V] with V >= 1, got ", logits.sizes());
  TORCH_CHECK_VALUE(logits.size(1) < kMaxVocab, "sample: logits vocabulary of ", logits.size(1),
                    " exceeds 2^31 - 1");
  const auto dtype = logits.scalar_type();
  TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
                    "sample: logits must be float32, bfloat16 or float16, got ", dtype);
  TORCH_CHECK_VALUE(logits.stride(1) == 1 || logits.size(1) == 1,
                    "sample: logits must be contiguous along the vocabulary, got strides ", logits.strides());
  const int64_t num_rows = logits.size(0);
  for (const auto& [name, t, want] : {std::tuple{"temperature", &temperature, at::kFloat},
                                      std::tuple{"seeds", &seeds, at::kLong},
                                      std::tuple{"positions", &positions, at::kLong}}) {
    TORCH_CHECK_VALUE(t->dim() == 1 && t->size(0) == num_rows && t->scalar_type() == want, "sample: ", name,
                      " must be ", want, " [N] = [", num_rows, "], got ", t->scalar_type(), " ", t->sizes());
    TORCH_CHECK_VALUE(t->device() == logits.device(), "sample: ", name, " is on ", t->device(),
                      " but logits is on ", logits.device());
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> sample_cpu(const at::Tensor& logits,       // [N, V]
                                              const at::Tensor& temperature,  // [N] fp32
                                              const at::Tensor& seeds,        // [N] int64
                                              const at::Tensor& positions) {  // [N] int64
  check_sample_args(logits, temperature, seeds, positions);
  const int64_t num_rows = logits.size(0), vocab = logits.size(1), row_stride = logits.stride(0);
  auto tokens = at::empty({num_rows}, logits.options().dtype(at::kLong));      // [N]
  auto logprobs = at::empty({num_rows}, logits.options().dtype(at::kFloat));   // [N]
  if (num_rows == 0) return {tokens, logprobs};

  const auto temp = temperature.accessor<float, 1>();
  const auto seed = seeds.accessor<int64_t, 1>();
  const auto pos = positions.accessor<int64_t, 1>();
  std::vector<float> inv_t(num_rows);
  std::vector<RowKey> keys(num_rows);
  for (int64_t r = 0; r < num_rows; ++r) {
    // Same fp32 division as the reference; a nan temperature is not > 0, so greedy there too.
    inv_t[r] = temp[r] > 0.0f ? 1.0f / temp[r] : 1.0f;
    keys[r] = row_key(seed[r], pos[r]);
  }

  const int64_t tiles = (vocab + kTile - 1) / kTile;
  std::vector<Partial> partials(num_rows * tiles);
  int64_t* token_out = tokens.data_ptr<int64_t>();
  float* logprob_out = logprobs.data_ptr<float>();

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "oppo_sample_cpu", [&] {
    const scalar_t* base = logits.const_data_ptr<scalar_t>();
    // NOTE: a work item's result depends only on (row, tile), never on how items are split among threads.
    const int64_t grain = std::max<int64_t>(1, kElementsPerChunk / std::min(vocab, kTile));
    at::parallel_for(0, num_rows * tiles, grain, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t r = item / tiles, start = (item % tiles) * kTile;
        const int64_t len = std::min(kTile, vocab - start);
        const scalar_t* row = base + r * row_stride + start;
        partials[item] = temp[r] > 0.0f ? sample_tile<scalar_t, false>(row, start, len, inv_t[r], keys[r])
                                        : sample_tile<scalar_t, true>(row, start, len, inv_t[r], keys[r]);
      }
    });
    for (int64_t r = 0; r < num_rows; ++r) {
      const Partial* p = partials.data() + r * tiles;
      float row_max = kNegInf, best_y = kNegInf;
      int64_t best_idx = p[0].best_idx;
      for (int64_t t = 0; t < tiles; ++t) {
        row_max = std::max(row_max, p[t].max);
        if (p[t].best_y > best_y) {  // strict: an earlier tile keeps a tie
          best_y = p[t].best_y;
          best_idx = p[t].best_idx;
        }
      }
      // Tiles' sums rescaled to the row max and added in double: the float error stays that of one tile.
      const double shift = row_max == kNegInf ? 0.0 : row_max;
      double sum_exp = 0.0;
      for (int64_t t = 0; t < tiles; ++t) {
        const double tile_shift = p[t].max == kNegInf ? 0.0 : p[t].max;
        sum_exp += static_cast<double>(p[t].sum_exp) * std::exp(tile_shift - shift);
      }
      const float z_token = static_cast<float>(base[r * row_stride + best_idx]) * inv_t[r];
      token_out[r] = best_idx;
      logprob_out[r] = static_cast<float>(static_cast<double>(z_token) - shift - std::log(sum_exp));
    }
  });
  return {tokens, logprobs};
}

}  // namespace oppo
