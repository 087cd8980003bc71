// torch.ops.oppo.*: schemas declared once, implemented per dispatch key. Fake (meta) kernels are
// registered in Python (oppo_engine/ops.py) so torch.compile and opcheck can trace the ops.
#include <torch/library.h>

#include "act_ops.h"
#include "attention.h"
#include "cache_ops.h"
#include "layer_ops.h"
#include "linear_ops.h"
#include "norm_ops.h"
#include "rope_ops.h"
#include "sample_ops.h"

TORCH_LIBRARY(oppo, m) {
  // key/value: [T, H, D]; kv_cache: one model's view [num_pages, L, 2, page_size, H, D];
  // slot_mapping: [T] int64, -1 = skip. Writes K to kv_cache[p, layer, 0, o] and V to [p, layer, 1, o]
  // with p = slot // page_size, o = slot % page_size.
  m.def("reshape_and_cache(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping, int layer) -> ()");
  // src/dst: [P, page_bytes] uint8 (the arena, or a pinned host buffer); src_ids/dst_ids: [n] int64 on the
  // CPU. Copies page src_ids[i] of src onto page dst_ids[i] of dst.
  m.def("copy_pages(Tensor src, Tensor(a!) dst, Tensor src_ids, Tensor dst_ids) -> ()");
  // q/out: [T, Hq, D]; kv_cache: one model's view as above; block_tables: [N, max_pages] int32;
  // context_lens: [N] int32 (cached tokens including the new ones); cu_seqlens_q: [N + 1] int32. Writes the
  // attention of each new token over its sequence's cache into out. sliding_window <= 0 and softcap <= 0
  // mean none (HF semantics otherwise; see attention.h).
  m.def(
      "paged_attention(Tensor q, Tensor kv_cache, int layer, Tensor block_tables, Tensor context_lens, "
      "Tensor cu_seqlens_q, float scale, int sliding_window, float softcap, Tensor(a!) out) -> ()");
  // logits: [N, V] fp32/bf16/fp16 (may hold -inf); temperature: [N] fp32, <= 0 = greedy; seeds, positions:
  // [N] int64. Gumbel-max with noise keyed by (seed, position), as oppo_engine/kernels/sample.py (the CUDA path);
  // returns tokens [N] int64 and logprobs [N] fp32 (log_softmax(logits / T) at the token). CPU only: CUDA
  // samples with the Triton kernel.
  m.def("sample(Tensor logits, Tensor temperature, Tensor seeds, Tensor positions) -> (Tensor, Tensor)");
  // x: [..., H] contiguous fp32/bf16; weight: [H], x's dtype. HF's Llama-form RMSNorm of x, bit for bit:
  // weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype) (norm_cpu.cpp). CPU only.
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  // q: [T, Hq, D], k/v: [T, Hkv, D] (each with its last dim contiguous; tokens and heads may be strided, as
  // views of a grouped q|k|v product are), cos/sin: [T, D] contiguous, one dtype (fp32/bf16). HF's rotary embedding of q and
  // k, bit for bit (q * cos + rotate_half(q) * sin, each op rounded); writes the rotated k and v into the
  // cache as reshape_and_cache does and returns the rotated q (rope_cpu.cpp). CPU only.
  m.def(
      "rotary_and_cache(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) kv_cache, "
      "Tensor slot_mapping, int layer) -> Tensor");
  // gate/up: [..., W] fp32/bf16, last dim contiguous, rows evenly spaced (a grouped product's halves), W % 16
  // == 0. silu(gate) * up, bit for bit what torch's vector loops give (act_cpu.cpp); the caller checks that
  // torch's own loop would take its vector path for every element (ops.silu_mul_exact). CPU with AVX-512.
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor");
  // Whether this build and CPU run silu_mul.
  m.def("silu_mul_available() -> bool", &oppo::silu_mul_available);
  // x: [M, K] bf16 contiguous; blocked: [N / 16, K / 2, 16, 2] bf16 (ops.block_linear_weight). x @ weight.T
  // as oneDNN orders it for a few rows: float32 sums over runs of kblock inputs, added in order, rounded once
  // (linear_cpu.cpp); the caller uses it where a probe found it bitwise oneDNN's (ops.small_linear_kblock).
  m.def("small_linear(Tensor x, Tensor blocked, int kblock) -> Tensor");
  // Whether this build and CPU run small_linear (AVX-512 BF16).
  m.def("small_linear_available() -> bool", &oppo::small_linear_available);
  // One Llama-form decoder layer of a few bf16 rows (layer_cpu.cpp): rms_norm, small_linear of the grouped
  // q|k|v (blocked weight, run), rotary_and_cache, paged_attention (no window, no softcap), small_linear of
  // o, the residual add, rms_norm, small_linear of the grouped gate|up, silu_mul, small_linear of down, the
  // residual add: bit for bit those ops called one by one as oppo_engine/model/fused.py calls them.
  m.def(
      "llama_decode_layer(Tensor hidden, Tensor input_norm, float input_eps, Tensor qkv, int qkv_kblock, "
      "int[] qkv_widths, int head_dim, Tensor cos, Tensor sin, Tensor(a!) kv_cache, Tensor slot_mapping, "
      "int layer, Tensor block_tables, Tensor context_lens, Tensor cu_seqlens_q, float scale, Tensor o, "
      "int o_kblock, Tensor post_norm, float post_eps, Tensor gate_up, int gate_up_kblock, "
      "int[] gate_up_widths, Tensor down, int down_kblock) -> Tensor");
  // Llama-form decoder layers in order, each as llama_decode_layer (layer_cpu.cpp): per layer 6 tensors, 11
  // ints and 3 floats (layer_ops.h), concatenated; one op for a model's layers.
  m.def(
      "llama_decode_layers(Tensor hidden, Tensor[] weights, int[] ints, float[] floats, Tensor cos, Tensor sin, "
      "Tensor(a!) kv_cache, Tensor slot_mapping, Tensor block_tables, Tensor context_lens, Tensor cu_seqlens_q) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(oppo, CPU, m) {
  m.impl("reshape_and_cache", &oppo::reshape_and_cache_cpu);
  m.impl("copy_pages", &oppo::copy_pages_cpu);
  m.impl("paged_attention", &oppo::paged_attention_cpu);
  m.impl("sample", &oppo::sample_cpu);
  m.impl("rms_norm", &oppo::rms_norm_cpu);
  m.impl("rotary_and_cache", &oppo::rotary_and_cache_cpu);
  m.impl("silu_mul", &oppo::silu_mul_cpu);
  m.impl("small_linear", &oppo::small_linear_cpu);
  m.impl("llama_decode_layer", &oppo::llama_decode_layer_cpu);
  m.impl("llama_decode_layers", &oppo::llama_decode_layers_cpu);
}

#ifdef OPPO_WITH_CUDA
TORCH_LIBRARY_IMPL(oppo, CUDA, m) {
  m.impl("reshape_and_cache", &oppo::reshape_and_cache_cuda);
  m.impl("copy_pages", &oppo::copy_pages_cuda);
}
#endif
