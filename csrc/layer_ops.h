#pragma once

#include <ATen/ATen.h>

namespace oppo {

// One Llama-form decoder layer of a few bf16 rows (csrc/layer_cpu.cpp): bit for bit the fused Python layer's
// calls of the same ops. Returns the layer's output hidden states [1, T, H].
at::Tensor llama_decode_layer_cpu(const at::Tensor& hidden, const at::Tensor& input_norm, double input_eps,
                                  const at::Tensor& qkv, int64_t qkv_kblock, at::IntArrayRef qkv_widths,
                                  int64_t head_dim, const at::Tensor& cos, const at::Tensor& sin,
                                  at::Tensor& kv_cache, const at::Tensor& slot_mapping, int64_t layer,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens,
                                  const at::Tensor& cu_seqlens_q, double scale, const at::Tensor& o,
                                  int64_t o_kblock, const at::Tensor& post_norm, double post_eps,
                                  const at::Tensor& gate_up, int64_t gate_up_kblock, at::IntArrayRef gate_up_widths,
                                  const at::Tensor& down, int64_t down_kblock);

}  // namespace oppo
