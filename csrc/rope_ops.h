// Declaration of the fused rotary embedding + cache write's CPU implementation (registered in
// torch_bindings.cpp).
#pragma once

#include <ATen/ATen.h>

namespace oppo {

// q: [T, Hq, D], k/v: [T, Hkv, D], cos/sin: [T, D], all contiguous (v: last dim contiguous), one dtype
// (float32 or bfloat16). Writes HF's rotated k and v into kv_cache at slot_mapping (as reshape_and_cache) and
// returns HF's rotated q, bit for bit (see rope_cpu.cpp).
at::Tensor rotary_and_cache_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                                const at::Tensor& sin, at::Tensor& kv_cache, const at::Tensor& slot_mapping,
                                int64_t layer);

}  // namespace oppo
