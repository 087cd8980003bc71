// Declaration of the small-batch bf16 linear's CPU implementation (registered in torch_bindings.cpp).
#pragma once

#include <ATen/ATen.h>

namespace oppo {

// x: [M, K] bfloat16, contiguous; blocked: [N / 16, K / 2, 16, 2] bfloat16, contiguous (the weight [N, K]
// in 16-column blocks, each a column-pair-interleaved panel: ops.block_linear_weight). Returns x @ weight.T
// [M, N] bf16: per output, one float32 sum per run of kblock inputs (pairs in order, as vdpbf16ps adds them),
// the sums added in order and rounded to bf16 once. That is oneDNN's order for the shapes the caller probed
// (ops.small_linear_kblock), so the result is bit for bit its product there. Needs AVX512-BF16.
at::Tensor small_linear_cpu(const at::Tensor& x, const at::Tensor& blocked, int64_t kblock);

// Whether this build and CPU run small_linear (x86-64 with AVX-512 F, BW, VL and BF16).
bool small_linear_available();

}  // namespace oppo
