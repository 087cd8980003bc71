// Declaration of the paged attention op's CPU implementation (registered in torch_bindings.cpp).
#pragma once

#include <ATen/ATen.h>

namespace oppo {

// Varlen attention of packed new tokens over their sequences' pages, straight from the cache (no gather).
// New token i of sequence n sits at position context_lens[n] - q_len_n + i and sees key position k iff
// k <= that position and, when sliding_window > 0, k > position - sliding_window (Hugging Face's window).
// softcap > 0 caps the scaled scores to softcap * tanh(s / softcap) before masking. Writes out.
void paged_attention_cpu(const at::Tensor& q,             // [T, Hq, D] fp32/bf16/fp16, contiguous in D
                         const at::Tensor& kv_cache,      // [num_pages, L, 2, page_size, Hkv, D], any page stride
                         int64_t layer,                   //
                         const at::Tensor& block_tables,  // [N, max_pages] int32
                         const at::Tensor& context_lens,  // [N] int32, cached tokens including the new ones
                         const at::Tensor& cu_seqlens_q,  // [N + 1] int32, rows of each sequence in q
                         double scale, int64_t sliding_window, double softcap,
                         at::Tensor& out);                // [T, Hq, D], q's dtype, contiguous in D

}  // namespace oppo
