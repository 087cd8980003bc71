// Declarations of the cache ops' per-device implementations (registered in torch_bindings.cpp).
#pragma once

#include <ATen/ATen.h>

namespace oppo {

// Shared argument checks; device-independent. See torch_bindings.cpp for the op contracts.
void check_reshape_and_cache_args(const at::Tensor& key, const at::Tensor& value, const at::Tensor& kv_cache,
                                  const at::Tensor& slot_mapping, int64_t layer);
void check_copy_pages_args(const at::Tensor& src, const at::Tensor& dst, const at::Tensor& src_ids,
                           const at::Tensor& dst_ids);

void reshape_and_cache_cpu(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                           const at::Tensor& slot_mapping, int64_t layer);
void copy_pages_cpu(const at::Tensor& src, at::Tensor& dst, const at::Tensor& src_ids, const at::Tensor& dst_ids);

#ifdef OPPO_WITH_CUDA
void reshape_and_cache_cuda(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                            const at::Tensor& slot_mapping, int64_t layer);
void copy_pages_cuda(const at::Tensor& src, at::Tensor& dst, const at::Tensor& src_ids,
                     const at::Tensor& dst_ids);
#endif

}  // namespace oppo
