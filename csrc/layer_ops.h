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

// Several such layers in order, each one llama_decode_layer_cpu call (so bit for bit the layers called one by
// one): per layer kLayerWeights tensors (input norm, q|k|v blocked, o blocked, post norm, gate|up blocked, down
// blocked), kLayerInts ints (q|k|v run, the three widths, head_dim, layer, o run, gate|up run, the two widths,
// down run) and kLayerFloats floats (input eps, scale, post eps), concatenated layer after layer.
constexpr int64_t kLayerWeights = 6, kLayerInts = 11, kLayerFloats = 3;
at::Tensor llama_decode_layers_cpu(const at::Tensor& hidden, at::TensorList weights, at::IntArrayRef ints,
                                   at::ArrayRef<double> floats, const at::Tensor& cos, const at::Tensor& sin,
                                   at::Tensor& kv_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                   const at::Tensor& context_lens, const at::Tensor& cu_seqlens_q);

}  // namespace oppo
