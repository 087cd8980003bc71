// Torch-free CUDA launchers of the cache ops: raw pointers, element strides and a cudaStream_t, so that
// `nvcc -c` compiles them on a machine without torch (CI does, for sm_90).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace oppo::cuda {

// key/value: [T, H, D] with element strides (t, h) and contiguous D;
// cache_layer: the model view already offset to one layer, strides (page, kv, slot, head) in elements;
// slot_mapping: [T] int64 on the device, -1 = skip. itemsize: 2 or 4 bytes.
cudaError_t launch_reshape_and_cache(const void* key, const void* value, void* cache_layer,
                                     const int64_t* slot_mapping, int64_t num_tokens, int64_t num_heads,
                                     int64_t head_dim, int64_t itemsize, int64_t key_stride_t,
                                     int64_t key_stride_h, int64_t value_stride_t, int64_t value_stride_h,
                                     int64_t cache_stride_page, int64_t cache_stride_kv,
                                     int64_t cache_stride_slot, int64_t cache_stride_head, int64_t page_size,
                                     cudaStream_t stream);

// src/dst: page rows of page_bytes bytes at byte strides src_stride/dst_stride (device or pinned host);
// ids: host arrays [n]. One async copy per page on `stream`.
cudaError_t launch_copy_pages(const uint8_t* src, int64_t src_stride, uint8_t* dst, int64_t dst_stride,
                              const int64_t* src_ids, const int64_t* dst_ids, int64_t n, int64_t page_bytes,
                              cudaStream_t stream);

}  // namespace oppo::cuda
