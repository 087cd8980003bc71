// CPU kernels of the cache ops, and the argument checks shared with the CUDA bindings.
#include <cstring>

#include "cache_ops.h"

namespace oppo {

void check_reshape_and_cache_args(const at::Tensor& key, const at::Tensor& value, const at::Tensor& kv_cache,
                                  const at::Tensor& slot_mapping, int64_t layer) {
  TORCH_CHECK_VALUE(kv_cache.dim() == 6, "reshape_and_cache: kv_cache must be [num_pages, L, 2, page_size, H, D], got ",
                    kv_cache.sizes());
  TORCH_CHECK_VALUE(kv_cache.size(2) == 2, "reshape_and_cache: kv_cache dim 2 must be 2 (K, V), got ",
                    kv_cache.size(2));
  TORCH_CHECK_VALUE(key.dim() == 3 && key.sizes() == value.sizes(),
                    "reshape_and_cache: key and value must both be [T, H, D], got ", key.sizes(), " and ",
                    value.sizes());
  TORCH_CHECK_VALUE(key.size(1) == kv_cache.size(4) && key.size(2) == kv_cache.size(5),
                    "reshape_and_cache: key heads/head_dim ", key.sizes(), " do not match kv_cache ",
                    kv_cache.sizes());
  TORCH_CHECK_VALUE(key.scalar_type() == kv_cache.scalar_type() && value.scalar_type() == kv_cache.scalar_type(),
                    "reshape_and_cache: key/value dtype must equal kv_cache dtype ", kv_cache.scalar_type());
  TORCH_CHECK_VALUE(slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0),
                    "reshape_and_cache: slot_mapping must be [T] with T = ", key.size(0), ", got ",
                    slot_mapping.sizes());
  TORCH_CHECK_VALUE(slot_mapping.scalar_type() == at::kLong, "reshape_and_cache: slot_mapping must be int64");
  TORCH_CHECK_VALUE(layer >= 0 && layer < kv_cache.size(1), "reshape_and_cache: layer ", layer,
                    " outside [0, ", kv_cache.size(1), ")");
  // NOTE: one token's [H, D] block is copied as rows of D contiguous elements.
  TORCH_CHECK_VALUE(key.stride(2) == 1 && value.stride(2) == 1, "reshape_and_cache: key/value last dim must be contiguous");
  TORCH_CHECK_VALUE(kv_cache.stride(5) == 1, "reshape_and_cache: kv_cache last dim must be contiguous");
  for (const auto* t : {&key, &value, &slot_mapping}) {
    TORCH_CHECK_VALUE(t->device() == kv_cache.device(), "reshape_and_cache: all tensors must be on ",
                      kv_cache.device(), ", got one on ", t->device());
  }
}

void check_copy_pages_args(const at::Tensor& src, const at::Tensor& dst, const at::Tensor& src_ids,
                           const at::Tensor& dst_ids) {
  TORCH_CHECK_VALUE(src.dim() == 2 && dst.dim() == 2 && src.size(1) == dst.size(1),
                    "copy_pages: src and dst must be [P, page_bytes] with equal page_bytes, got ", src.sizes(),
                    " and ", dst.sizes());
  TORCH_CHECK_VALUE(src.scalar_type() == at::kByte && dst.scalar_type() == at::kByte,
                    "copy_pages: src and dst must be uint8 page views");
  TORCH_CHECK_VALUE(src.stride(1) == 1 && dst.stride(1) == 1, "copy_pages: a page's bytes must be contiguous");
  TORCH_CHECK_VALUE(src_ids.dim() == 1 && dst_ids.dim() == 1 && src_ids.size(0) == dst_ids.size(0),
                    "copy_pages: src_ids and dst_ids must be [n] of equal length, got ", src_ids.sizes(), " and ",
                    dst_ids.sizes());
  TORCH_CHECK_VALUE(src_ids.scalar_type() == at::kLong && dst_ids.scalar_type() == at::kLong,
                    "copy_pages: page ids must be int64");
  TORCH_CHECK_VALUE(src_ids.device().is_cpu() && dst_ids.device().is_cpu(), "copy_pages: page ids must be on the CPU");
  const int64_t n = src_ids.size(0);
  // The contiguous copies are held: a pointer into a temporary freed at the end of its statement dangles.
  const auto src_c = src_ids.contiguous(), dst_c = dst_ids.contiguous();
  const int64_t* s = src_c.data_ptr<int64_t>();
  const int64_t* d = dst_c.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK_VALUE(s[i] >= 0 && s[i] < src.size(0), "copy_pages: src_ids[", i, "] = ", s[i], " outside [0, ",
                      src.size(0), ")");
    TORCH_CHECK_VALUE(d[i] >= 0 && d[i] < dst.size(0), "copy_pages: dst_ids[", i, "] = ", d[i], " outside [0, ",
                      dst.size(0), ")");
  }
}

void reshape_and_cache_cpu(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                           const at::Tensor& slot_mapping, int64_t layer) {
  check_reshape_and_cache_args(key, value, kv_cache, slot_mapping, layer);
  const int64_t num_tokens = key.size(0), num_heads = key.size(1), head_dim = key.size(2);
  const int64_t page_size = kv_cache.size(3), num_slots = kv_cache.size(0) * page_size;
  const int64_t itemsize = kv_cache.element_size();
  const size_t row_bytes = head_dim * itemsize;
  const auto slots = slot_mapping.contiguous();
  const int64_t* slot = slots.data_ptr<int64_t>();
  // Byte pointers and byte strides: the copy is dtype-agnostic.
  const char* k = static_cast<const char*>(key.data_ptr());
  const char* v = static_cast<const char*>(value.data_ptr());
  char* cache = static_cast<char*>(kv_cache.data_ptr());
  const int64_t cs0 = kv_cache.stride(0) * itemsize, cs1 = kv_cache.stride(1) * itemsize;
  const int64_t cs2 = kv_cache.stride(2) * itemsize, cs3 = kv_cache.stride(3) * itemsize;
  const int64_t cs4 = kv_cache.stride(4) * itemsize;
  // Validate every slot before writing any, so a bad call leaves the cache untouched.
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK_VALUE(slot[t] >= -1 && slot[t] < num_slots, "reshape_and_cache: slot_mapping[", t, "] = ", slot[t],
                      " outside [-1, ", num_slots, ")");
  }
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t s = slot[t];
    if (s < 0) continue;
    char* k_dst = cache + (s / page_size) * cs0 + layer * cs1 + (s % page_size) * cs3;
    char* v_dst = k_dst + cs2;
    for (int64_t h = 0; h < num_heads; ++h) {
      std::memcpy(k_dst + h * cs4, k + (t * key.stride(0) + h * key.stride(1)) * itemsize, row_bytes);
      std::memcpy(v_dst + h * cs4, v + (t * value.stride(0) + h * value.stride(1)) * itemsize, row_bytes);
    }
  }
}

void copy_pages_cpu(const at::Tensor& src, at::Tensor& dst, const at::Tensor& src_ids, const at::Tensor& dst_ids) {
  check_copy_pages_args(src, dst, src_ids, dst_ids);
  const auto s = src_ids.contiguous(), d = dst_ids.contiguous();
  const int64_t* sp = s.data_ptr<int64_t>();
  const int64_t* dp = d.data_ptr<int64_t>();
  const uint8_t* src_base = src.data_ptr<uint8_t>();
  uint8_t* dst_base = dst.data_ptr<uint8_t>();
  for (int64_t i = 0; i < s.size(0); ++i) {
    std::memmove(dst_base + dp[i] * dst.stride(0), src_base + sp[i] * src.stride(0), src.size(1));
  }
}

}  // namespace oppo
