// CPU linear of up to a few dozen bf16 rows (a decode batch of up to 64 sequences), bitwise oneDNN's product.
//
// oneDNN (torch's mkldnn linear over a packed weight) multiplies bf16 rows with vdpbf16ps: per output, the
// inputs' pairs (2i, 2i+1) in order into a float32 sum, one sum per run of K (512 or 1024 inputs, by shape and
// rows: measured, see ops.small_linear_kblock), the runs' sums added in order, the total rounded to bf16
// (round to nearest even). Below a few dozen rows its kernels stream the weights at a fraction of the
// bandwidth; this one reads each 16-column panel of the weight once, contiguous and prefetched, for all the
// rows (up to 16 a pass, further passes from cache), and does the same arithmetic in the same order: the
// caller uses it only where a probe against oneDNN's product found every bit equal (ops.small_linear_kblock),
// and oneDNN's own product elsewhere.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "linear_ops.h"

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#include <immintrin.h>
#define OPPO_LINEAR_AVX512 1
#define OPPO_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#endif

namespace oppo {

namespace {

#ifdef OPPO_LINEAR_AVX512
// How far ahead of its reads a pass asks for the weight, in 64-byte lines (pairs of 16 columns): 8 KB, the next
// panel's head near a panel's end. The hardware prefetchers alone left a pass of 16 rows over a weight out of
// cache at ~22 GB/s on Zen 5; 16 lines ahead 0.9x oneDNN at 16 rows, 64-256 lines 1.3-1.6x (bench/results/
// small_linear_zen5_2026-12-06f.txt). A prefetch past the weight's end is a hint, never a fault.
constexpr uintptr_t kAhead = 128;

OPPO_BF16 inline void ahead(const __m512bh* line) {
  _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(line) + kAhead * 64), _MM_HINT_T0);
}

// R rows of x ([R, K] as K/2 pairs each, row stride P pairs) against one 16-column panel w ([K/2] pairs x 16
// columns); out: the R rows' 16 outputs, row stride ldo.
template <int R>
OPPO_BF16 void panel_rows(const uint32_t* x, int64_t P, const __m512bh* w, int64_t run, uint16_t* out,
                          int64_t ldo) {
  if (run >= P) {  // one run: its sum is the total
    __m512 sum[R];
    for (int r = 0; r < R; ++r) sum[r] = _mm512_setzero_ps();
    for (int64_t p = 0; p < P; ++p) {
      ahead(w + p);
      const __m512bh wp = (__m512bh)_mm512_loadu_si512(w + p);  // any 2-byte aligned tensor
      for (int r = 0; r < R; ++r) sum[r] = _mm512_dpbf16_ps(sum[r], (__m512bh)_mm512_set1_epi32(x[r * P + p]), wp);
    }
    for (int r = 0; r < R; ++r)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo), (__m256i)_mm512_cvtneps_pbh(sum[r]));
    return;
  }
  alignas(64) float total[R][16];
  for (int64_t p0 = 0; p0 < P; p0 += run) {
    __m512 sum[R];
    for (int r = 0; r < R; ++r) sum[r] = _mm512_setzero_ps();
    const int64_t p1 = std::min(P, p0 + run);
    for (int64_t p = p0; p < p1; ++p) {
      ahead(w + p);
      const __m512bh wp = (__m512bh)_mm512_loadu_si512(w + p);  // any 2-byte aligned tensor
      for (int r = 0; r < R; ++r) sum[r] = _mm512_dpbf16_ps(sum[r], (__m512bh)_mm512_set1_epi32(x[r * P + p]), wp);
    }
    for (int r = 0; r < R; ++r)
      _mm512_store_ps(total[r], p0 == 0 ? sum[r] : _mm512_add_ps(_mm512_load_ps(total[r]), sum[r]));
  }
  for (int r = 0; r < R; ++r)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(total[r])));
}

// A pass of R rows over a panel, by R (up to 16: 16 float32 chains in flight hide the dot product's latency,
// and one load of the weight serves 16 products).
using PassFn = void (*)(const uint32_t*, int64_t, const __m512bh*, int64_t, uint16_t*, int64_t);
constexpr PassFn kPasses[17] = {nullptr,          panel_rows<1>,  panel_rows<2>,  panel_rows<3>,  panel_rows<4>,
                                panel_rows<5>,    panel_rows<6>,  panel_rows<7>,  panel_rows<8>,  panel_rows<9>,
                                panel_rows<10>,   panel_rows<11>, panel_rows<12>, panel_rows<13>, panel_rows<14>,
                                panel_rows<15>,   panel_rows<16>};

OPPO_BF16 void panels(const uint32_t* x, int64_t M, int64_t P, const __m512bh* w, int64_t run, uint16_t* out,
                      int64_t N, int64_t begin, int64_t end) {
  // As few passes as 16 rows a pass allow, their rows as even as can be (24 rows: 12 and 12, not 16 and 8).
  const int64_t passes = (M + 15) / 16;
  for (int64_t b = begin; b < end; ++b) {
    const __m512bh* wb = w + b * P;
    for (int64_t i = 0, m = 0; i < passes; ++i) {
      const int64_t r = (M - m) / (passes - i);
      kPasses[r](x + m * P, P, wb, run, out + m * N + b * 16, N);
      m += r;
    }
  }
}
#endif

}  // namespace

bool small_linear_available() {
#ifdef OPPO_LINEAR_AVX512
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

at::Tensor small_linear_cpu(const at::Tensor& x, const at::Tensor& blocked, int64_t kblock) {
  TORCH_CHECK_VALUE(small_linear_available(), "small_linear: needs an x86-64 CPU with AVX-512 BF16");
  TORCH_CHECK_VALUE(x.device().is_cpu() && blocked.device().is_cpu(), "small_linear: CPU tensors only");
  TORCH_CHECK_VALUE(x.scalar_type() == at::kBFloat16 && blocked.scalar_type() == at::kBFloat16,
                    "small_linear: x and the blocked weight must be bfloat16");
  TORCH_CHECK_VALUE(x.dim() == 2 && x.is_contiguous(), "small_linear: x must be a contiguous [M, K] tensor");
  TORCH_CHECK_VALUE(blocked.dim() == 4 && blocked.size(2) == 16 && blocked.size(3) == 2 && blocked.is_contiguous(),
                    "small_linear: the weight must be blocked as [N / 16, K / 2, 16, 2], contiguous "
                    "(ops.block_linear_weight)");
  const int64_t M = x.size(0), K = x.size(1), P = blocked.size(1), N = blocked.size(0) * 16;
  TORCH_CHECK_VALUE(K == 2 * P, "small_linear: x has ", K, " inputs, the weight ", 2 * P);
  TORCH_CHECK_VALUE(kblock > 0 && kblock % 2 == 0, "small_linear: kblock must be a positive even number");
  auto out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
#ifdef OPPO_LINEAR_AVX512
  const auto* xp = static_cast<const uint32_t*>(x.const_data_ptr());
  const auto* wp = static_cast<const __m512bh*>(blocked.const_data_ptr());
  auto* op = static_cast<uint16_t*>(out.mutable_data_ptr());
  const int64_t run = kblock / 2;
  // Panels split evenly over the threads; one panel is K * 32 bytes of weight (18 KB at K = 576).
  at::parallel_for(0, N / 16, 1, [&](int64_t b, int64_t e) { panels(xp, M, P, wp, run, op, N, b, e); });
#endif
  return out;
}

}  // namespace oppo
