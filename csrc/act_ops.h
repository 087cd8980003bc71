// Declaration of the fused SiLU-and-multiply's CPU implementation (registered in torch_bindings.cpp).
#pragma once

#include <ATen/ATen.h>

namespace oppo {

// gate, up: one shape [..., W], float32 or bfloat16, the last dim contiguous and the rows evenly spaced (the
// halves of a grouped gate|up product qualify); W a multiple of 16. Returns silu(gate) * up, contiguous, bit
// for bit what torch's vector loops give (see act_cpu.cpp). Needs AVX-512 (silu_mul_available).
at::Tensor silu_mul_cpu(const at::Tensor& gate, const at::Tensor& up);

// Whether this build and CPU run silu_mul (x86-64 with AVX-512 F, BW, DQ and VL).
bool silu_mul_available();

}  // namespace oppo
