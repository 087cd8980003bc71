// Declaration of the fused RMSNorm's CPU implementation (registered in torch_bindings.cpp).
#pragma once

#include <ATen/ATen.h>

namespace oppo {

// x: [..., H] contiguous, float32 or bfloat16; weight: [H], x's dtype. Returns HF's Llama-form RMSNorm of
// x, bit for bit (see norm_cpu.cpp).
at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps);

}  // namespace oppo
