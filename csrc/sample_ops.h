// Declaration of the sampler op's CPU implementation (registered in torch_bindings.cpp).
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace oppo {

// logits: [N, V] fp32/bf16/fp16, rows contiguous; temperature: [N] fp32 (<= 0 = greedy);
// seeds, positions: [N] int64. Returns tokens [N] int64 and logprobs [N] fp32. See sample_cpu.cpp.
std::tuple<at::Tensor, at::Tensor> sample_cpu(const at::Tensor& logits, const at::Tensor& temperature,
                                              const at::Tensor& seeds, const at::Tensor& positions);

}  // namespace oppo
