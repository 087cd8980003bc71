// Torch side of the CUDA cache ops: checks, device guard, current stream, then the torch-free launchers.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include "cache_ops.h"
#include "cuda/cache_kernels.h"

namespace oppo {

void reshape_and_cache_cuda(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                            const at::Tensor& slot_mapping, int64_t layer) {
  check_reshape_and_cache_args(key, value, kv_cache, slot_mapping, layer);
  const c10::cuda::CUDAGuard guard(kv_cache.device());
  // NOTE: slots are not range-checked on the device (that would cost a sync); the cache manager only
  // hands out slots of pages it owns.
  const int64_t itemsize = kv_cache.element_size();
  // The kernel indexes slot_mapping[t] densely; a strided view (a column of a wider tensor) needs a copy.
  const auto slots = slot_mapping.contiguous();
  char* layer_base = static_cast<char*>(kv_cache.data_ptr()) + layer * kv_cache.stride(1) * itemsize;
  const auto err = cuda::launch_reshape_and_cache(
      key.data_ptr(), value.data_ptr(), layer_base, slots.data_ptr<int64_t>(), key.size(0), key.size(1),
      key.size(2), itemsize, key.stride(0), key.stride(1), value.stride(0), value.stride(1), kv_cache.stride(0),
      kv_cache.stride(2), kv_cache.stride(3), kv_cache.stride(4), kv_cache.size(3),
      c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "reshape_and_cache: CUDA launch failed: ", cudaGetErrorString(err));
}

void copy_pages_cuda(const at::Tensor& src, at::Tensor& dst, const at::Tensor& src_ids, const at::Tensor& dst_ids) {
  check_copy_pages_args(src, dst, src_ids, dst_ids);
  const at::Tensor& on_device = src.is_cuda() ? src : dst;
  const c10::cuda::CUDAGuard guard(on_device.device());
  const auto s = src_ids.contiguous(), d = dst_ids.contiguous();
  const auto err = cuda::launch_copy_pages(src.data_ptr<uint8_t>(), src.stride(0), dst.data_ptr<uint8_t>(),
                                           dst.stride(0), s.data_ptr<int64_t>(), d.data_ptr<int64_t>(), s.size(0),
                                           src.size(1), c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "copy_pages: cudaMemcpyAsync failed: ", cudaGetErrorString(err));
}

}  // namespace oppo
