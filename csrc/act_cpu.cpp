// CPU SiLU-and-multiply of a Llama-form MLP (act_fn(gate_proj(x)) * up_proj(x), act_fn SiLU), bitwise equal
// to torch's two ops on contiguous operands,
//
//     s = torch.nn.functional.silu(gate); out = s * up
//
// wherever torch's SiLU loop takes its vector path for every element (the caller checks that: ops.py,
// ``silu_mul_exact``). That path, on a CPU where torch runs its AVX-512 kernels, computes in float32
// lanes: x = widen(gate); s = x / (1 + exp(-x)) with exp = Sleef_expf16_u10 (libtorch's own, called here);
// s rounded to the dtype (bf16: round to nearest even on the bits, NaN to 0xFFFF, as at::vec's cvtfp32_bf16);
// then the product widen(s) * widen(up), rounded once. Division, addition and multiplication are single
// IEEE operations (no FMA contraction: this file is built with -ffp-contract=off), so the same lanes give
// the same bits. Its scalar tail (std::exp) rounds otherwise, hence the caller's check. What the fusion saves:
// the two contiguous copies of the grouped product's halves, one op's dispatch and allocation, and a pass.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>

#include "act_ops.h"

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#include <immintrin.h>
extern "C" __m512 Sleef_expf16_u10(__m512);  // exported by libtorch_cpu (at::vec's Vectorized<float>::exp)
#define OPPO_SILU_AVX512 1
#endif

namespace oppo {

namespace {

constexpr int64_t kLanes = 16;

#ifdef OPPO_SILU_AVX512
#define OPPO_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))

OPPO_AVX512 inline __m512 silu16(__m512 x) {
  const __m512 e = Sleef_expf16_u10(_mm512_xor_ps(_mm512_set1_ps(-0.0f), x));  // at::vec's neg(), then exp()
  return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

OPPO_AVX512 inline __m512 widen16(const c10::BFloat16* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// at::vec's cvtfp32_bf16 for 16 lanes: round to nearest even on the bits, NaN to 0xFFFF.
OPPO_AVX512 inline __m256i narrow16(__m512 f) {
  const __m512i v = _mm512_castps_si512(f);
  const __mmask16 ordered = _mm512_cmp_ps_mask(f, f, _CMP_ORD_Q);
  __m512i t = _mm512_and_si512(_mm512_srli_epi32(v, 16), _mm512_set1_epi32(1));
  t = _mm512_add_epi32(t, _mm512_set1_epi32(0x7fff));
  t = _mm512_add_epi32(t, v);
  t = _mm512_srli_epi32(t, 16);
  t = _mm512_mask_blend_epi32(ordered, _mm512_set1_epi32(0xffff), t);
  return _mm512_cvtusepi32_epi16(t);
}

// The elements [begin, end) of the [rows, width] operands in row-major order (a range may start and end inside
// a row: at a multiple of 16 columns, as the caller's chunks are multiples of 64 elements and width of 16).
OPPO_AVX512 void range_bf16(const c10::BFloat16* gate, const c10::BFloat16* up, int64_t ld_gate, int64_t ld_up,
                            int64_t width, c10::BFloat16* out, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end;) {
    const int64_t r = i / width;
    const int64_t c = i - r * width;
    const int64_t n = std::min(width - c, end - i);
    const c10::BFloat16* g = gate + r * ld_gate + c;
    const c10::BFloat16* u = up + r * ld_up + c;
    c10::BFloat16* o = out + i;
    for (int64_t j = 0; j < n; j += kLanes) {
      // A range's end inside a 16-lane group (a split the caller's rule never makes) is masked, not overrun.
      const __mmask16 m = n - j >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << (n - j)) - 1);
      const __m256i s = narrow16(silu16(widen16(g + j, m)));  // silu's output, rounded to bf16
      const __m512 sw = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(s), 16));
      _mm256_mask_storeu_epi16(o + j, m, narrow16(_mm512_mul_ps(sw, widen16(u + j, m))));
    }
    i += n;
  }
}

OPPO_AVX512 void range_f32(const float* gate, const float* up, int64_t ld_gate, int64_t ld_up, int64_t width,
                           float* out, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end;) {
    const int64_t r = i / width;
    const int64_t c = i - r * width;
    const int64_t n = std::min(width - c, end - i);
    const float* g = gate + r * ld_gate + c;
    const float* u = up + r * ld_up + c;
    float* o = out + i;
    for (int64_t j = 0; j < n; j += kLanes) {
      const __mmask16 m = n - j >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << (n - j)) - 1);
      const __m512 s = silu16(_mm512_maskz_loadu_ps(m, g + j));
      _mm512_mask_storeu_ps(o + j, m, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(m, u + j)));
    }
    i += n;
  }
}
#endif

// The row stride of a [..., W] operand whose last dim is contiguous and whose rows are evenly spaced.
int64_t row_stride(const at::Tensor& t, const char* name) {
  const int64_t width = t.size(-1);
  TORCH_CHECK_VALUE(width <= 1 || t.stride(-1) == 1, "silu_mul: ", name, "'s last dim must be contiguous");
  int64_t ld = width;
  int64_t expected = -1;  // the stride the next outer dim must have for the rows to be evenly spaced
  for (int64_t d = t.dim() - 2; d >= 0; --d) {
    if (t.size(d) == 1) {
      continue;
    }
    if (expected < 0) {
      ld = t.stride(d);
    } else {
      TORCH_CHECK_VALUE(t.stride(d) == expected, "silu_mul: ", name, "'s rows must be evenly spaced, got strides ",
                        t.strides());
    }
    expected = t.stride(d) * t.size(d);
  }
  return ld;
}

}  // namespace

bool silu_mul_available() {
#ifdef OPPO_SILU_AVX512
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
#else
  return false;
#endif
}

at::Tensor silu_mul_cpu(const at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK_VALUE(silu_mul_available(), "silu_mul: needs an x86-64 CPU with AVX-512 (F, BW, DQ, VL)");
  TORCH_CHECK_VALUE(gate.sizes() == up.sizes() && gate.dim() >= 1, "silu_mul: gate and up must have one shape, got ",
                    gate.sizes(), " and ", up.sizes());
  TORCH_CHECK_VALUE(gate.scalar_type() == up.scalar_type() &&
                        (gate.scalar_type() == at::kFloat || gate.scalar_type() == at::kBFloat16),
                    "silu_mul: gate and up must both be float32 or both bfloat16");
  TORCH_CHECK_VALUE(gate.device().is_cpu() && up.device().is_cpu(), "silu_mul: CPU tensors only");
  const int64_t width = gate.size(-1);
  TORCH_CHECK_VALUE(width % kLanes == 0, "silu_mul: the last dim must be a multiple of ", kLanes, ", got ", width);
  const int64_t ld_gate = row_stride(gate, "gate");
  const int64_t ld_up = row_stride(up, "up");
  auto out = at::empty(gate.sizes(), gate.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t rows = width == 0 ? 0 : gate.numel() / width;
  if (rows == 0) {
    return out;
  }
#ifdef OPPO_SILU_AVX512
  // Split as torch's elementwise loops split the same [rows, width] elements (TensorIterator's for_each:
  // at::parallel_for over the flat range with its grain), so each element is computed on the thread that
  // computes it in torch's two ops: a thread's floating-point state (flush-to-zero, set per thread by
  // torch.set_flush_denormal) then rounds it alike.
  const int64_t numel = rows * width;
  TORCH_CHECK_VALUE(at::internal::GRAIN_SIZE % 64 == 0, "silu_mul: unexpected at::internal::GRAIN_SIZE");
  if (gate.scalar_type() == at::kBFloat16) {
    const auto* g = gate.const_data_ptr<c10::BFloat16>();
    const auto* u = up.const_data_ptr<c10::BFloat16>();
    auto* o = out.mutable_data_ptr<c10::BFloat16>();
    at::parallel_for(0, numel, at::internal::GRAIN_SIZE,
                     [&](int64_t b, int64_t e) { range_bf16(g, u, ld_gate, ld_up, width, o, b, e); });
  } else {
    const auto* g = gate.const_data_ptr<float>();
    const auto* u = up.const_data_ptr<float>();
    auto* o = out.mutable_data_ptr<float>();
    at::parallel_for(0, numel, at::internal::GRAIN_SIZE,
                     [&](int64_t b, int64_t e) { range_f32(g, u, ld_gate, ld_up, width, o, b, e); });
  }
#endif
  return out;
}

}  // namespace oppo
