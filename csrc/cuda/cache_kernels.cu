// CUDA kernels of the cache ops. No torch headers: see cache_kernels.h.
#include "cache_kernels.h"

namespace oppo::cuda {
namespace {

// One block per token; threads stride over the token's H * D elements of K and of V.
// Word = an unsigned type of the element's size: the copy moves bits, whatever the dtype.
template <typename Word>
__global__ void reshape_and_cache_kernel(const Word* __restrict__ key,    // [T, H, D]
                                         const Word* __restrict__ value,  // [T, H, D]
                                         Word* __restrict__ cache,        // layer view [P, 2, page_size, H, D]
                                         const int64_t* __restrict__ slot_mapping,  // [T]
                                         int64_t num_heads, int64_t head_dim, int64_t key_stride_t,
                                         int64_t key_stride_h, int64_t value_stride_t, int64_t value_stride_h,
                                         int64_t cache_stride_page, int64_t cache_stride_kv,
                                         int64_t cache_stride_slot, int64_t cache_stride_head,
                                         int64_t page_size) {
  const int64_t t = blockIdx.x;
  const int64_t slot = slot_mapping[t];
  if (slot < 0) return;  // padding
  const int64_t page = slot / page_size, offset = slot % page_size;
  Word* k_dst = cache + page * cache_stride_page + offset * cache_stride_slot;
  Word* v_dst = k_dst + cache_stride_kv;
  const int64_t n = num_heads * head_dim;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const int64_t h = i / head_dim, d = i % head_dim;
    k_dst[h * cache_stride_head + d] = key[t * key_stride_t + h * key_stride_h + d];
    v_dst[h * cache_stride_head + d] = value[t * value_stride_t + h * value_stride_h + d];
  }
}

}  // namespace

cudaError_t launch_reshape_and_cache(const void* key, const void* value, void* cache_layer,
                                     const int64_t* slot_mapping, int64_t num_tokens, int64_t num_heads,
                                     int64_t head_dim, int64_t itemsize, int64_t key_stride_t,
                                     int64_t key_stride_h, int64_t value_stride_t, int64_t value_stride_h,
                                     int64_t cache_stride_page, int64_t cache_stride_kv,
                                     int64_t cache_stride_slot, int64_t cache_stride_head, int64_t page_size,
                                     cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(num_tokens));
  const int64_t work = num_heads * head_dim;
  const dim3 block(static_cast<unsigned>(work < 512 ? ((work + 31) / 32) * 32 : 512));
#define OPPO_LAUNCH(WORD)                                                                                     \
  reshape_and_cache_kernel<WORD><<<grid, block, 0, stream>>>(                                                \
      static_cast<const WORD*>(key), static_cast<const WORD*>(value), static_cast<WORD*>(cache_layer),       \
      slot_mapping, num_heads, head_dim, key_stride_t, key_stride_h, value_stride_t, value_stride_h,         \
      cache_stride_page, cache_stride_kv, cache_stride_slot, cache_stride_head, page_size)
  switch (itemsize) {
    case 1: OPPO_LAUNCH(uint8_t); break;
    case 2: OPPO_LAUNCH(uint16_t); break;
    case 4: OPPO_LAUNCH(uint32_t); break;
    case 8: OPPO_LAUNCH(uint64_t); break;
    default: return cudaErrorInvalidValue;
  }
#undef OPPO_LAUNCH
  return cudaGetLastError();
}

cudaError_t launch_copy_pages(const uint8_t* src, int64_t src_stride, uint8_t* dst, int64_t dst_stride,
                              const int64_t* src_ids, const int64_t* dst_ids, int64_t n, int64_t page_bytes,
                              cudaStream_t stream) {
  // cudaMemcpyDefault: UVA tells device from pinned host, so one path serves swap-out, swap-in and fork.
  for (int64_t i = 0; i < n; ++i) {
    const cudaError_t err = cudaMemcpyAsync(dst + dst_ids[i] * dst_stride, src + src_ids[i] * src_stride,
                                            static_cast<size_t>(page_bytes), cudaMemcpyDefault, stream);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace oppo::cuda
