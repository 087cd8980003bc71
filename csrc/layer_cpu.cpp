// One Llama-form decoder layer of a few bf16 rows in one op: the calls the fused Python layer makes
// (oppo_engine/model/fused.py: the norms, the grouped q|k|v product, the rotary embedding and cache write,
// paged attention, the output projection, the residual adds, the grouped gate|up product, SiLU-and-product,
// the down projection), made here in the same order on the same operands by the same functions. So the
// result is bit for bit the Python path's; what the op saves is the Python between them (the packs' and
// fused modules' per-call checks, module calls, closures) and the dispatch of ~30 small ops a layer.
//
// The caller (fused.py's ``_decode_layer``) decides that every part would have taken these ops (each product
// ops.small_linear with its probed run, SiLU-and-product exact, the attention's C++ path) and passes each
// product's blocked weight and run; anything else runs the Python path.
#include <ATen/ATen.h>

#include "act_ops.h"
#include "attention.h"
#include "layer_ops.h"
#include "linear_ops.h"
#include "norm_ops.h"
#include "rope_ops.h"

namespace oppo {

namespace {

// packed.small_product: ops.small_linear(x.reshape(rows, k).contiguous(), blocked, kblock).view(*x.shape[:-1], -1)
at::Tensor product(const at::Tensor& x, const at::Tensor& blocked, int64_t kblock) {
  const int64_t k = x.size(-1);
  const int64_t rows = k == 0 ? 0 : x.numel() / k;
  auto lead = x.sizes().vec();
  lead.back() = -1;
  return small_linear_cpu(x.reshape({rows, k}).contiguous(), blocked, kblock).view(lead);
}

}  // namespace

at::Tensor llama_decode_layer_cpu(const at::Tensor& hidden, const at::Tensor& input_norm, double input_eps,
                                  const at::Tensor& qkv, int64_t qkv_kblock, at::IntArrayRef qkv_widths,
                                  int64_t head_dim, const at::Tensor& cos, const at::Tensor& sin,
                                  at::Tensor& kv_cache, const at::Tensor& slot_mapping, int64_t layer,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens,
                                  const at::Tensor& cu_seqlens_q, double scale, const at::Tensor& o,
                                  int64_t o_kblock, const at::Tensor& post_norm, double post_eps,
                                  const at::Tensor& gate_up, int64_t gate_up_kblock, at::IntArrayRef gate_up_widths,
                                  const at::Tensor& down, int64_t down_kblock) {
  TORCH_CHECK_VALUE(hidden.dim() == 3 && hidden.size(0) == 1 && hidden.is_contiguous(),
                    "llama_decode_layer: hidden must be a contiguous [1, T, H], got ", hidden.sizes());
  TORCH_CHECK_VALUE(qkv_widths.size() == 3 && gate_up_widths.size() == 2,
                    "llama_decode_layer: three q|k|v widths and two gate|up widths, got ", qkv_widths.size(), " and ",
                    gate_up_widths.size());
  TORCH_CHECK_VALUE(head_dim > 0, "llama_decode_layer: head_dim must be positive");
  const int64_t tokens = hidden.size(1);
  // The attention (fused.py's _fused_attention_forward).
  const at::Tensor residual = hidden;
  at::Tensor h = rms_norm_cpu(hidden, input_norm, input_eps);
  const auto qkv_parts = product(h, qkv, qkv_kblock).split_with_sizes(qkv_widths, -1);
  const auto q = qkv_parts[0].view({tokens, -1, head_dim});  // split views: the last dim is contiguous
  const auto k = qkv_parts[1].view({tokens, -1, head_dim});
  const auto v = qkv_parts[2].view({tokens, -1, head_dim});
  const at::Tensor rotated = rotary_and_cache_cpu(q, k, v, cos, sin, kv_cache, slot_mapping, layer);
  at::Tensor attended = at::empty_like(rotated);
  paged_attention_cpu(rotated, kv_cache, layer, block_tables, context_lens, cu_seqlens_q, scale, 0, 0.0, attended);
  h = at::add(residual, product(attended.view({1, tokens, -1}), o, o_kblock));
  // The MLP (fused.py's _fused_mlp_forward, its SiLU-and-product branch).
  const at::Tensor residual2 = h;
  const auto halves = product(rms_norm_cpu(h, post_norm, post_eps), gate_up, gate_up_kblock)
                          .split_with_sizes(gate_up_widths, -1);
  return at::add(residual2, product(silu_mul_cpu(halves[0], halves[1]), down, down_kblock));
}

at::Tensor llama_decode_layers_cpu(const at::Tensor& hidden, at::TensorList weights, at::IntArrayRef ints,
                                   at::ArrayRef<double> floats, const at::Tensor& cos, const at::Tensor& sin,
                                   at::Tensor& kv_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                   const at::Tensor& context_lens, const at::Tensor& cu_seqlens_q) {
  const int64_t layers = static_cast<int64_t>(weights.size()) / kLayerWeights;
  TORCH_CHECK_VALUE(static_cast<int64_t>(weights.size()) == layers * kLayerWeights &&
                        static_cast<int64_t>(ints.size()) == layers * kLayerInts &&
                        static_cast<int64_t>(floats.size()) == layers * kLayerFloats,
                    "llama_decode_layers: ", kLayerWeights, " tensors, ", kLayerInts, " ints and ", kLayerFloats,
                    " floats a layer, got ", weights.size(), ", ", ints.size(), " and ", floats.size());
  if (layers == 0) {
    return hidden.clone();  // the schema's result is a new tensor, not an alias of hidden
  }
  at::Tensor h = hidden;
  for (int64_t n = 0; n < layers; ++n) {
    const at::Tensor* w = weights.data() + n * kLayerWeights;
    const int64_t* i = ints.data() + n * kLayerInts;
    const double* f = floats.data() + n * kLayerFloats;
    // The layer's operands, in ops.llama_decode_layers' order (oppo_engine/ops.py).
    h = llama_decode_layer_cpu(h, w[0], f[0], w[1], i[0], at::IntArrayRef(i + 1, 3), i[4], cos, sin, kv_cache,
                               slot_mapping, i[5], block_tables, context_lens, cu_seqlens_q, f[1], w[2], i[6], w[3],
                               f[2], w[4], i[7], at::IntArrayRef(i + 8, 2), w[5], i[10]);
  }
  return h;
}

}  // namespace oppo
