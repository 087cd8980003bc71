"""Published GPU measurements the twin is checked against, each with where it was read.

Every row quotes a figure read on its page (``url``), the exact GPU as the page gives it, the software and
the settings. ``role``: ``"source"`` (a constant of ``oppo_engine/sim`` may be derived from it, and the
constant cites it) or ``"check"`` (counted by the goals; no constant comes from a check row's page). A row
whose setting the twin cannot express (a GPU the device table lacks, a power cap it does not model, two
nodes, FP8, tensor parallelism) carries ``refused``: the twin names why and never approximates it.

    python -m bench.bench_twin --published     # setting, published figure, prediction, ratio, source

Nothing here is fitted at import; :func:`predict` prices each row with the same cost model ``plan()`` uses.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace

from oppo_engine.sim.cost import (
    ELEMENTWISE_KERNELS,
    Batch,
    CostModel,
    elementwise_bytes,
    roofline,
    training_flops,
)
from oppo_engine.sim.devices import device
from oppo_engine.sim.shapes import ModelShape

# Shapes as their configs give them (Llama 2's and Llama 3's config.json on the Hub; the twin's Qwen2
# layout adds q/k/v biases, 12k parameters a layer). Llama 2 7B: 32 layers, 4096 wide, 32 heads, MLP 11008,
# vocabulary 32000, untied. Llama 3 8B: 32 layers, 4096, 32 heads over 8 KV heads, MLP 14336, 128256.
LLAMA2_7B = ModelShape("Llama-2-7B", 32, 4096, 32, 32, 128, 11008, 32000, False, 2, "lm")
LLAMA3_8B = ModelShape("Llama-3-8B", 32, 4096, 32, 8, 128, 14336, 128256, False, 2, "lm")
QWEN25_7B = ModelShape("Qwen2.5-7B", 28, 3584, 28, 4, 128, 18944, 152064, False, 2, "lm")

TRTLLM = (
    "github.com/NVIDIA/TensorRT-LLM docs/source/performance.md @77d24b5 (also @138f96d): 'Peak Throughput', "
    "data for v0.6.1; 'Low Latency' (1st token), data from v0.5"
)
TORCHTITAN_A100 = (
    "github.com/pytorch/torchtitan docs/performance.md @0413364 (2024-04-24), 'Llama 3 performance'"
)
TORCHTITAN_H100 = "github.com/pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md @b5bcd76"
NEMO_RL = "github.com/NVIDIA-NeMo/RL docs/about/performance-summary.md @cff17f8 (v0.4) and @9dbd9ad (v0.5)"
HF_EAGER = (
    "arxiv.org/html/2605.30571 (J. Chen, 'Memory-Bound but Not Bandwidth-Limited', May 2026), abstract, "
    "read at cdn-avatars.qwak.ai/papers/2605.30571.md"
)
NEMO_FW = (
    "docs.nvidia.com/nemo-framework/user-guide/latest/performance/llama.html, 'Llama-2 Results', "
    "'Inference Performance', Configuration 1 (Chatbot Conversation: input 128, output 20)"
)
VERL_ONE_STEP = (
    "github.com/volcengine/verl recipe/one_step_off_policy/README.md @606ed93 (last updated 07/17/2025), "
    "'Experimental Results'"
)
OPPO_SEED = "/work/shared/seeds/000_0e21a575d220e76b.txt (the OPPO paper, arXiv:2509.25762, as summarised)"
VIDUR = "github.com/microsoft/vidur data/profiling/compute/{gpu}/meta-llama/{model}/mlp.csv @7d47513"


@dataclass(frozen=True)
class Published:
    """One published figure: ``kind`` says how :func:`predict` prices it."""

    key: str
    kind: str  # static_batch | first_token | fixed_batch_latency | hf_eager_floor | train_mfu | rl_step | ...
    role: str  # source | check
    figure: float
    unit: str
    gpu: str  # as the page gives it: SKU, memory, power cap
    device: str | None  # the roofline table's key, when the twin can price it
    software: str
    settings: dict
    url: str
    quote: str
    refused: str | None = None
    constant: str | None = None  # the constant a source row fixes, if any
    extra: dict = field(default_factory=dict)


ROWS: tuple[Published, ...] = (
    # -- decode and prefill: fixed-batch runs (static batching: every row of the batch runs to the end) ---
    Published(
        "trtllm-a100-7b-384x128x128",
        "static_batch",
        "check",
        5586,
        "out tok/s",
        "A100 (page: 'A100 GPUs (FP16)'; 80 GB: the batch's KV, 384 x 256 tokens x 0.5 MB, is 52 GB, over "
        "a 40 GB card's memory; power cap not stated)",
        "a100-80gb",
        "TensorRT-LLM v0.6.1 gptSessionBenchmark, FP16, static batch",
        dict(model=LLAMA2_7B, batch=384, input=128, output=128),
        TRTLLM,
        "| LLaMA 7B | 384 | 1 | 128 | 128 | 5,586 |",
    ),
    Published(
        "trtllm-a100-7b-60x128x2048",
        "static_batch",
        "check",
        1928,
        "out tok/s",
        "A100 80 GB (as above)",
        "a100-80gb",
        "TensorRT-LLM v0.6.1 gptSessionBenchmark, FP16, static batch",
        dict(model=LLAMA2_7B, batch=60, input=128, output=2048),
        TRTLLM,
        "| LLaMA 7B | 60 | 1 | 128 | 2048 | 1,928 |",
    ),
    Published(
        "trtllm-a100-7b-52x2048x128",
        "static_batch",
        "check",
        591,
        "out tok/s",
        "A100 80 GB (as above)",
        "a100-80gb",
        "TensorRT-LLM v0.6.1 gptSessionBenchmark, FP16, static batch",
        dict(model=LLAMA2_7B, batch=52, input=2048, output=128),
        TRTLLM,
        "| LLaMA 7B | 52 | 1 | 2048 | 128 | 591 |",
    ),
    Published(
        "trtllm-a100-7b-tp2",
        "static_batch",
        "check",
        782,
        "out tok/s",
        "2x A100 (TP 2)",
        None,
        "TensorRT-LLM v0.6.1, FP16, tensor parallel 2",
        dict(model=LLAMA2_7B, batch=64, input=2048, output=2048),
        TRTLLM,
        "| LLaMA 7B | 64 | 2 | 2048 | 2048 | 782 |",
        refused="tensor parallelism (TP 2): the twin runs one model on one GPU",
    ),
    Published(
        "trtllm-a100-7b-ftl-128",
        "first_token",
        "check",
        16e-3,
        "s",
        "A100 80 GB (as above)",
        "a100-80gb",
        "TensorRT-LLM v0.5, FP16 (the page: 'The following data is from TensorRT-LLM v0.5')",
        dict(model=LLAMA2_7B, batch=1, input=128),
        TRTLLM,
        "| LLaMA 7B | 1 | 1 | 128 | 16 |",
    ),
    Published(
        "trtllm-a100-7b-ftl-2048",
        "first_token",
        "check",
        133e-3,
        "s",
        "A100 80 GB (as above)",
        "a100-80gb",
        "TensorRT-LLM v0.5, FP16",
        dict(model=LLAMA2_7B, batch=1, input=2048),
        TRTLLM,
        "| LLaMA 7B | 1 | 1 | 2048 | 133 |",
    ),
    Published(
        "trtllm-h100-7b-fp8",
        "static_batch",
        "check",
        6818,
        "out tok/s/GPU",
        "H100 (FP8), 'H100-HBM3-80GB'",
        None,
        "TensorRT-LLM v0.6.1, FP8 weights and FP8 KV cache",
        dict(model=LLAMA2_7B, batch=112, input=128, output=2048),
        TRTLLM,
        "| LLaMA 7B | 112 | 1 | 128 | 2048 | 6,818 |",
        refused="FP8 weights and KV cache: the twin prices 16-bit models only",
    ),
    Published(
        "hf-eager-h100-qwen7b-b1",
        "hf_eager_floor",
        "source",
        0.27,
        "of the memory floor",
        "H100 SXM5 (80 GB; power cap not stated)",
        "h100",
        "HF transformers, bf16, SDPA, eager (no CUDA graphs), batch 1",
        dict(model=QWEN25_7B, context=2048),
        HF_EAGER,
        "'On the headline Qwen-2.5-7B ctx=2048 cell, an L4 reaches roughly 81% of its analytic "
        "memory floor, while an H100 reaches only 27%.'",
        constant="sim/baselines.py: HF_STEP_HOST_S",
    ),
    Published(
        "hf-eager-l4",
        "hf_eager_floor",
        "source",
        0.81,
        "of the memory floor",
        "NVIDIA L4",
        None,
        "HF transformers, bf16, SDPA, eager, batch 1",
        dict(model=QWEN25_7B, context=2048),
        HF_EAGER,
        "'an L4 reaches roughly 81% of its analytic memory floor'",
        refused="NVIDIA L4: not in the device table",
    ),
    # -- fixed-batch latency (batch 1-8, 128 in, 20 out): the decode fit's source rows (decode_fit) ----
    Published(
        "nemo-fw-a100-llama2-7b-b1",
        "fixed_batch_latency",
        "source",
        0.234,
        "s",
        "A100 80GB SXM4 (the page's words; 1 GPU, TP 1, PP 1; power cap not stated)",
        "a100-80gb",
        "NeMo Framework inference (its Llama-2 performance page), FP16/BF16 as the page's container ran it",
        dict(model=LLAMA2_7B, batch=1, input=128, output=20),
        NEMO_FW,
        "Llama-2-7B, batch 1, TP 1, PP 1, 1 GPU: average latency 234.0 ms (A100 80GB SXM4)",
    ),
    Published(
        "nemo-fw-a100-llama2-7b-b2",
        "fixed_batch_latency",
        "source",
        0.2496,
        "s",
        "A100 80GB SXM4 (the page's words; 1 GPU, TP 1, PP 1; power cap not stated)",
        "a100-80gb",
        "NeMo Framework inference (its Llama-2 performance page), FP16/BF16 as the page's container ran it",
        dict(model=LLAMA2_7B, batch=2, input=128, output=20),
        NEMO_FW,
        "Llama-2-7B, batch 2, TP 1, PP 1, 1 GPU: average latency 249.6 ms (A100 80GB SXM4)",
    ),
    Published(
        "nemo-fw-a100-llama2-7b-b4",
        "fixed_batch_latency",
        "source",
        0.2726,
        "s",
        "A100 80GB SXM4 (the page's words; 1 GPU, TP 1, PP 1; power cap not stated)",
        "a100-80gb",
        "NeMo Framework inference (its Llama-2 performance page), FP16/BF16 as the page's container ran it",
        dict(model=LLAMA2_7B, batch=4, input=128, output=20),
        NEMO_FW,
        "Llama-2-7B, batch 4, TP 1, PP 1, 1 GPU: average latency 272.6 ms (A100 80GB SXM4)",
    ),
    Published(
        "nemo-fw-a100-llama2-7b-b8",
        "fixed_batch_latency",
        "source",
        0.3295,
        "s",
        "A100 80GB SXM4 (the page's words; 1 GPU, TP 1, PP 1; power cap not stated)",
        "a100-80gb",
        "NeMo Framework inference (its Llama-2 performance page), FP16/BF16 as the page's container ran it",
        dict(model=LLAMA2_7B, batch=8, input=128, output=20),
        NEMO_FW,
        "Llama-2-7B, batch 8, TP 1, PP 1, 1 GPU: average latency 329.5 ms (A100 80GB SXM4)",
    ),
    Published(
        "nemo-fw-h100-llama2-7b-b1",
        "fixed_batch_latency",
        "source",
        0.15380000000000002,
        "s",
        "H100 80GB HBM3 (the page's words; 1 GPU, TP 1, PP 1; power cap not stated)",
        "h100",
        "NeMo Framework inference (its Llama-2 performance page), FP16/BF16 as the page's container ran it",
        dict(model=LLAMA2_7B, batch=1, input=128, output=20),
        NEMO_FW,
        "Llama-2-7B, batch 1, TP 1, PP 1, 1 GPU: average latency 153.8 ms (H100 80GB HBM3)",
    ),
    Published(
        "nemo-fw-h100-llama2-7b-b2",
        "fixed_batch_latency",
        "source",
        0.1608,
        "s",
        "H100 80GB HBM3 (the page's words; 1 GPU, TP 1, PP 1; power cap not stated)",
        "h100",
        "NeMo Framework inference (its Llama-2 performance page), FP16/BF16 as the page's container ran it",
        dict(model=LLAMA2_7B, batch=2, input=128, output=20),
        NEMO_FW,
        "Llama-2-7B, batch 2, TP 1, PP 1, 1 GPU: average latency 160.8 ms (H100 80GB HBM3)",
    ),
    Published(
        "nemo-fw-h100-llama2-7b-b4",
        "fixed_batch_latency",
        "source",
        0.1748,
        "s",
        "H100 80GB HBM3 (the page's words; 1 GPU, TP 1, PP 1; power cap not stated)",
        "h100",
        "NeMo Framework inference (its Llama-2 performance page), FP16/BF16 as the page's container ran it",
        dict(model=LLAMA2_7B, batch=4, input=128, output=20),
        NEMO_FW,
        "Llama-2-7B, batch 4, TP 1, PP 1, 1 GPU: average latency 174.8 ms (H100 80GB HBM3)",
    ),
    Published(
        "nemo-fw-h100-llama2-7b-b8",
        "fixed_batch_latency",
        "source",
        0.1992,
        "s",
        "H100 80GB HBM3 (the page's words; 1 GPU, TP 1, PP 1; power cap not stated)",
        "h100",
        "NeMo Framework inference (its Llama-2 performance page), FP16/BF16 as the page's container ran it",
        dict(model=LLAMA2_7B, batch=8, input=128, output=20),
        NEMO_FW,
        "Llama-2-7B, batch 8, TP 1, PP 1, 1 GPU: average latency 199.2 ms (H100 80GB HBM3)",
    ),
    # -- training ------------------------------------------------------------------------------------------
    Published(
        "torchtitan-a100-8b-sel-op",
        "train_mfu",
        "source",
        0.582,
        "MFU",
        "64x A100 80 GB (power cap not stated)",
        "a100-80gb",
        "torchtitan (2024-04), FSDP2, bf16, selective op activation checkpointing",
        dict(model=LLAMA3_8B, gpus=64, local_batch=1, seq=8192, wps=2973),
        TORCHTITAN_A100,
        "| 8B | 1 | selective op | 2973 | 58.2% |",
        constant="devices.py: AMPERE.training_mfu",
        refused="64 GPUs are 8 nodes: the twin has no inter-node term (the MFU, a per-GPU figure, is taken)",
    ),
    Published(
        "torchtitan-h100-96gb-8b",
        "train_mfu",
        "check",
        5762,
        "tok/s/GPU",
        "8x H100 96 GB HBM2e, 2.4 TB/s, default 500 W power limit (Grand Teton)",
        None,
        "torchtitan (2024-12), FSDP, bf16, selective AC, local batch 2",
        dict(model=LLAMA3_8B, gpus=8),
        TORCHTITAN_H100,
        "| FSDP | 5,762 | 82.4 |",
        refused="H100 96 GB HBM2e at 500 W (Grand Teton): not in the device table (h100 is the 80 GB SXM5)",
    ),
    Published(
        "torchtitan-h100-96gb-8b-memory",
        "train_mfu",
        "check",
        82.4,
        "GiB peak",
        "as above",
        None,
        "torchtitan (2024-12), FSDP, bf16, selective AC, local batch 2",
        dict(model=LLAMA3_8B, gpus=8),
        TORCHTITAN_H100,
        "| FSDP | 5,762 | 82.4 |",
        refused="H100 96 GB HBM2e at 500 W: not in the device table",
    ),
    # -- RL steps ------------------------------------------------------------------------------------------
    Published(
        "nemo-rl-grpo-llama8b-16xh100",
        "rl_step",
        "check",
        97.7,
        "s/step",
        "16x H100 (DGX-H100: two nodes)",
        None,
        "NeMo RL v0.4, Megatron-core training, vLLM generation, BF16",
        dict(model=LLAMA3_8B, gpus=16, prompts_x_samples=2048, train_gbs=512, max_seq=4096, mean_seq=1060),
        NEMO_RL,
        "|LLAMA3.1_8B|On policy |4,096 |1,060 |16 |2,048|512 |[1,1] |[1,1,1,1,1,2,n/a] |1,562 | 97.7|",
        refused="16 GPUs are two DGX-H100 nodes: the twin has no inter-node term; the page gives no phases",
    ),
    Published(
        "nemo-rl-grpo-llama8b-8xgb200",
        "rl_step",
        "check",
        91.0,
        "s/step",
        "8x GB200 (GB200-NVL72)",
        None,
        "NeMo RL v0.5, BF16",
        dict(model=LLAMA3_8B, gpus=8),
        NEMO_RL,
        "| GRPO |LLAMA3.1_8B|On policy |4,096 |1,066 |8 |2,048|512 |[1,1] |[1,1,1,1,1,1,n/a] |3,359 | 91.0|",
        refused="GB200: not in the device table",
    ),
    Published(
        "verl-dapo-qwen-math-7b-2x16xh20",
        "rl_step",
        "check",
        749,
        "s/step",
        "32x H20 (page: '2 nodes with 16 H20 GPUs each'; memory and power cap not stated)",
        None,
        "verl, colocated and synchronous (hybrid engine), vLLM rollout, FSDP2 training, DAPO",
        dict(model=QWEN25_7B, gpus=32, max_response=20480),  # Qwen2.5-Math-7B: Qwen2.5-7B's layout
        VERL_ONE_STEP,
        "| colocate sync | VLLM+FSDP2 | 749 | 321 | - | 247 | 88 | 286 | 19h18m | 0.5948 | 0.417 |",
        refused="H20: not in the device table; 2 nodes: the twin has no inter-node term (the page gives "
        "phases -- gen 321 s, old_log_prob 88 s, update_actor 286 s -- but not the batch size)",
        extra=dict(phases={"gen": 321, "old_log_prob": 88, "update_actor": 286}),
    ),
    Published(
        "oppo-paper-2node",
        "paper_step",
        "check",
        498.30,
        "s/step (TRL)",
        "2x4 A100",
        None,
        "the OPPO paper's TRL baseline and OPPO",
        dict(oppo=111.08),
        OPPO_SEED,
        "'Stack-Exchange / Qwen2.5-7B-Instruct（双节点 2×4×A100）平均每步延迟 111.08 s 498.30 s 4.49×'",
        refused="two nodes (2x4 A100): the twin has no inter-node network term; the A100's memory is not "
        "given either",
    ),
)


# -- fixed-shape GEMMs: the projections of a decoder layer, fp16, one GPU (gemm_fit's source rows) ----------
# Vidur's operator profiles (its README: "A100 80GB DGX", "H100 DGX"; docs/profiling.md: one compute profile
# per SKU serves both its DGX and its Azure nodes): sarathi-serve's parallel linears at tensor parallelism 1,
# a 20-layer model traced once after a warm-up forward, each call's kernel time from the profiler, the median
# over the layers. Quoted: the ``time_stats.<op>.median`` column (ms) at ``num_tokens`` = 16, 32, ..., 1024
# (the powers of two of the profiled sizes: the ridge, ~130 rows on an A100 and ~290 on an H100 in the
# twin's terms, lies inside; the profile samples every 8 tokens, whose other sizes are not quoted here).
GEMM_TOKENS = (16, 32, 64, 128, 256, 512, 1024)
# op: (K, N) of the weight as the profile fuses it: q, k and v in one (attn_pre_proj), gate and up in one.
VIDUR_OPS = {
    "Llama-2-7b-hf": dict(attn_pre_proj=(4096, 12288), attn_post_proj=(4096, 4096),
                          mlp_up_proj=(4096, 22016), mlp_down_proj=(11008, 4096)),
    "Meta-Llama-3-8B": dict(attn_pre_proj=(4096, 6144), attn_post_proj=(4096, 4096),
                            mlp_up_proj=(4096, 28672), mlp_down_proj=(14336, 4096)),
}  # fmt: skip
VIDUR_MS = {
    ("a100", "Llama-2-7b-hf"): dict(
        attn_pre_proj=(0.064, 0.066, 0.067, 0.0745, 0.112, 0.234, 0.475),
        attn_post_proj=(0.026, 0.027, 0.027, 0.032, 0.052, 0.088, 0.176),
        mlp_up_proj=(0.111, 0.115, 0.116, 0.157, 0.229, 0.402, 0.877),
        mlp_down_proj=(0.062, 0.065, 0.068, 0.088, 0.1095, 0.229, 0.431),
    ),
    ("a100", "Meta-Llama-3-8B"): dict(
        attn_pre_proj=(0.034, 0.039, 0.036, 0.043, 0.075, 0.13, 0.246),
        attn_post_proj=(0.026, 0.027, 0.027, 0.032, 0.053, 0.085, 0.181),
        mlp_up_proj=(0.1515, 0.163, 0.173, 0.191, 0.291, 0.516, 1.172),
        mlp_down_proj=(0.079, 0.086, 0.088, 0.111, 0.135, 0.263, 0.576),
    ),
    ("h100", "Llama-2-7b-hf"): dict(
        attn_pre_proj=(0.041, 0.038, 0.04, 0.041, 0.052, 0.09, 0.151),
        attn_post_proj=(0.016, 0.016, 0.016, 0.02, 0.022, 0.029, 0.049),
        mlp_up_proj=(0.0665, 0.066, 0.066, 0.071, 0.13, 0.134, 0.256),
        mlp_down_proj=(0.037, 0.039, 0.04, 0.048, 0.056, 0.0755, 0.109),
    ),
}
VIDUR_GPU = {
    "a100": (
        "a100-80gb",
        "A100 80GB (Vidur's 'a100' compute profile, which serves its A100 DGX of 8 80GB A100s (SXM4) and its "
        "Azure Standard_NC96ads_A100_v4 of 80GB A100 PCIe GPUs: which of the two ran it is not stated; "
        "power cap not stated)",
        "devices.py: AMPERE.gemm_unhidden",
    ),
    "h100": (
        "h100",
        "H100 80GB (Vidur's 'h100' compute profile; its README lists the model under 'H100 DGX', an H100 "
        "SXM5 80GB node; power cap not stated)",
        "devices.py: HOPPER.gemm_unhidden",
    ),
}
VIDUR_SHORT = {"Llama-2-7b-hf": "llama2-7b", "Meta-Llama-3-8B": "llama3-8b", "attn_pre_proj": "qkv",
               "attn_post_proj": "o", "mlp_up_proj": "gateup", "mlp_down_proj": "down"}  # fmt: skip
VIDUR_SOFTWARE = (
    "sarathi-serve's Column/RowParallelLinear at TP 1, fp16 (F.linear: cuBLAS); kernel time per call from "
    "the profiler's trace (record_function), median over 20 layers"
)


def _gemm_rows() -> tuple[Published, ...]:
    """The gemm source rows: one per quoted cell of VIDUR_MS."""
    rows = []
    for (gpu, model), ops in VIDUR_MS.items():
        key, name, constant = VIDUR_GPU[gpu]
        for op, times in ops.items():
            k, n = VIDUR_OPS[model][op]
            for m, ms in zip(GEMM_TOKENS, times, strict=True):
                short = f"{VIDUR_SHORT[model]}-{VIDUR_SHORT[op]}"
                rows.append(Published(
                    f"vidur-{gpu}-{short}-m{m}", "gemm", "source", ms * 1e-3, "s", name, key, VIDUR_SOFTWARE,
                    dict(m=m, k=k, n=n, op=op, model=model),
                    VIDUR.format(gpu=gpu, model=model),
                    f"num_tokens {m}, num_tensor_parallel_workers 1: time_stats.{op}.median {ms} (ms)",
                    constant=constant,
                ))  # fmt: skip
    return tuple(rows)


ROWS = ROWS + _gemm_rows()


# -- elementwise kernels: a decoder layer's norms, rotary embedding, activation and add (elementwise_fit) ----
# The same Vidur profiles (the same mlp.csv files): sarathi's RMSNorm (vLLM's fused ``rms_norm``, one kernel),
# its rotary embedding (one kernel, q and k in place), SiluAndMul (one kernel) and a torch add, fp16, each
# call's kernel durations summed from the profiler's trace (record_function_tracer.py): device time, no
# launch. ``add`` is one add: the Llama block (vidur/profiling/mlp/mlp_impl.py::GPTBlock.
# _forward_with_post_attn_norm) times only the residual add after the MLP. Quoted: ``time_stats.<op>.median``
# (ms) at ``num_tokens`` = 1, 2, 4, ..., 4096 (log-spaced over the Llama-2 profiles' whole range: the small
# sizes fix the floor, the large ones the bandwidth); where a file has two rows of one size (2048 and 4096),
# the first.
ELEMENTWISE_TOKENS = tuple(2**i for i in range(13))
ELEMENTWISE_OPS = ("input_layernorm", "attn_rope", "post_attention_layernorm", "mlp_act", "add")
VIDUR_ELEMENTWISE_MS = {
    ("a100", "Llama-2-7b-hf"): dict(
        input_layernorm=(0.005, 0.004, 0.004, 0.004, 0.004, 0.004, 0.004, 0.005, 0.008, 0.012, 0.022, 0.053,
                         0.105),
        attn_rope=(0.005, 0.005, 0.005, 0.005, 0.006, 0.006, 0.006, 0.007, 0.011, 0.022, 0.038, 0.076, 0.149),
        post_attention_layernorm=(0.005, 0.004, 0.004, 0.004, 0.004, 0.005, 0.005, 0.005, 0.009, 0.012, 0.022,
                                  0.055, 0.104),
        mlp_act=(0.007, 0.007, 0.008, 0.008, 0.008, 0.008, 0.008, 0.011, 0.022, 0.0365, 0.07, 0.135, 0.266),
        add=(0.002, 0.002, 0.002, 0.002, 0.002, 0.002, 0.002, 0.003, 0.004, 0.007, 0.012, 0.028, 0.055),
    ),
    ("a100", "Meta-Llama-3-8B"): dict(
        input_layernorm=(0.005, 0.004, 0.004, 0.004, 0.004, 0.004, 0.004, 0.005, 0.008, 0.012, 0.023, 0.0545,
                         0.107),
        attn_rope=(0.004, 0.004, 0.004, 0.004, 0.004, 0.004, 0.004, 0.005, 0.007, 0.012, 0.023, 0.048, 0.099),
        post_attention_layernorm=(0.005, 0.004, 0.004, 0.004, 0.004, 0.005, 0.005, 0.005, 0.009, 0.012, 0.023,
                                  0.056, 0.107),
        mlp_act=(0.011, 0.012, 0.012, 0.012, 0.012, 0.011, 0.011, 0.017, 0.027, 0.046, 0.091, 0.174, 0.343),
        add=(0.002, 0.002, 0.002, 0.002, 0.002, 0.002, 0.003, 0.003, 0.004, 0.0065, 0.013, 0.026, 0.056),
    ),
    ("h100", "Llama-2-7b-hf"): dict(
        input_layernorm=(0.004, 0.004, 0.004, 0.004, 0.004, 0.004, 0.004, 0.004, 0.004, 0.007, 0.013, 0.026,
                         0.0665),
        attn_rope=(0.004, 0.004, 0.004, 0.004, 0.004, 0.005, 0.004, 0.004, 0.007, 0.011, 0.021, 0.041,
                   0.0835),
        post_attention_layernorm=(0.004, 0.004, 0.004, 0.004, 0.004, 0.004, 0.004, 0.004, 0.004, 0.007, 0.014,
                                  0.028, 0.067),
        mlp_act=(0.006, 0.007, 0.007, 0.007, 0.007, 0.007, 0.007, 0.005, 0.008, 0.017, 0.037, 0.07, 0.139),
        add=(0.001, 0.001, 0.001, 0.001, 0.0015, 0.002, 0.002, 0.002, 0.003, 0.004, 0.007, 0.0145, 0.031),
    ),
}  # fmt: skip
VIDUR_SHAPES = {"Llama-2-7b-hf": LLAMA2_7B, "Meta-Llama-3-8B": LLAMA3_8B}
ELEMENTWISE_SHORT = {"input_layernorm": "norm1", "attn_rope": "rope", "post_attention_layernorm": "norm2",
                     "mlp_act": "act", "add": "add"}  # fmt: skip
ELEMENTWISE_SOFTWARE = (
    "sarathi-serve's RMSNorm (vLLM's fused rms_norm), rotary embedding (in place on q and k), SiluAndMul "
    "and a torch add at TP 1, fp16; kernel time per call from the profiler's trace (record_function), median "
    "over 20 layers"
)


def elementwise_op_bytes(shape: ModelShape, op: str) -> int:
    """Bytes one of Vidur's elementwise kernels reads and writes per token, in the twin's count
    (:func:`~oppo_engine.sim.cost.elementwise_bytes`: a layer's two norms, rotary embedding, activation and
    two adds)."""
    h, q, kv, i = shape.hidden, shape.q_width, shape.kv_width, shape.intermediate
    elements = {"input_layernorm": 2 * h, "post_attention_layernorm": 2 * h, "attn_rope": 2 * (q + kv),
                "mlp_act": 3 * i, "add": 3 * h}  # fmt: skip
    try:
        return elements[op] * shape.dtype_bytes
    except KeyError:
        raise ValueError(f"no byte count for elementwise op {op!r}: one of {', '.join(elements)}") from None


def _cell_bytes(row: Published) -> int:
    """Bytes the kernel of an ``elementwise`` row moves over its tokens."""
    s = row.settings
    return s["tokens"] * elementwise_op_bytes(VIDUR_SHAPES[s["model"]], s["op"])


def _elementwise_rows() -> tuple[Published, ...]:
    """The elementwise source rows: one per quoted cell of VIDUR_ELEMENTWISE_MS."""
    rows = []
    for (gpu, model), ops in VIDUR_ELEMENTWISE_MS.items():
        key, name, _ = VIDUR_GPU[gpu]
        field_ = "HOPPER" if key == "h100" else "AMPERE"
        for op in ELEMENTWISE_OPS:
            for t, ms in zip(ELEMENTWISE_TOKENS, ops[op], strict=True):
                rows.append(Published(
                    f"vidur-{gpu}-{VIDUR_SHORT[model]}-{ELEMENTWISE_SHORT[op]}-t{t}", "elementwise", "source",
                    ms * 1e-3, "s", name, key, ELEMENTWISE_SOFTWARE, dict(tokens=t, op=op, model=model),
                    VIDUR.format(gpu=gpu, model=model),
                    f"num_tokens {t}, num_tensor_parallel_workers 1: time_stats.{op}.median {ms} (ms)",
                    constant=f"devices.py: {field_}.elementwise, {field_}.elementwise_floor_s",
                ))  # fmt: skip
    return tuple(rows)


ROWS = ROWS + _elementwise_rows()


class Refused(ValueError):
    """A published setting the twin cannot express, named."""


def predict(row: Published) -> float:
    """The twin's prediction of ``row``'s figure, in its unit; :class:`Refused` naming why it cannot."""
    if row.refused is not None:
        raise Refused(f"{row.key}: {row.refused}")
    dev = device(row.device)
    cost = roofline(dev)
    s = row.settings
    if row.kind == "static_batch":
        return _static_batch(cost, s["model"], s["batch"], s["input"], s["output"])
    if row.kind == "gemm":  # one GEMM of m rows by a (k, n) fp16 weight, alone
        return max(cost.source.gemm(s["m"], s["k"], s["n"], 2))
    if row.kind == "elementwise":  # one elementwise kernel of ``tokens`` tokens alone: a floor, its bytes
        return cost.source.elementwise_kernels_s(1, _cell_bytes(row))
    if row.kind == "first_token":
        return _prefill(cost, s["model"], s["batch"], s["input"])
    if row.kind == "fixed_batch_latency":
        prefill, decode = _latency_parts(cost, s["model"], s["batch"], s["input"], s["output"])
        return prefill + decode
    if row.kind == "hf_eager_floor":
        from oppo_engine.sim.baselines import hf_decode_s  # noqa: PLC0415

        shape, ctx = s["model"], s["context"]
        floor = (shape.weight_bytes + shape.kv_bytes_per_token * ctx) / dev.hbm_bandwidth
        return floor / hf_decode_s(cost, shape, [ctx])
    if row.kind == "train_mfu":  # one FSDP step of one node: the model FLOPs over its time, of the peak
        shape, rows = s["model"], [s["seq"]] * s["local_batch"]
        step = cost.update([shape], [[rows] * 8], gpus=8, epochs=1)
        return training_flops(shape, rows, 3.0) / step / dev.bf16_flops
    raise Refused(f"{row.key}: no pricing for kind {row.kind!r}")


def _static_batch(cost: CostModel, shape: ModelShape, batch: int, inp: int, out: int) -> float:
    """Output tokens per second of a static batch: one prefill of every prompt (it samples the first
    token), then ``out - 1`` decode steps of the whole batch, captured."""
    t = cost.forward(
        shape, Batch(tuple((inp, inp) for _ in range(batch)), batch, batch), captured=True
    ).alone_s
    for step in range(1, out):
        rows = tuple((1, inp + step) for _ in range(batch))
        t += cost.forward(shape, Batch(rows, batch, batch), captured=True).alone_s
    return batch * out / t


def _latency_parts(cost: CostModel, shape: ModelShape, batch: int, inp: int, out: int) -> tuple[float, float]:
    """A fixed batch's latency, split: its prefill (which samples the first token), and its ``out - 1``
    decode steps, captured."""
    prefill = _prefill(cost, shape, batch, inp)
    decode = sum(
        cost.forward(
            shape, Batch(tuple((1, inp + i) for _ in range(batch)), batch, batch), captured=True
        ).alone_s
        for i in range(1, out)
    )
    return prefill, decode


def decode_fit(rows=None) -> dict[str, dict]:
    """What the ``fixed_batch_latency`` source rows say of the decode, per GPU, fitted together.

    Per row, the twin's prefill and decode (at today's fractions) leave ``extra = published - prefill -
    decode`` over ``steps`` decode steps. Two fits: (1) the bandwidth fraction and a per-step overhead
    together, ``published - prefill = steps * overhead + slope * decode`` (``slope`` > 1: the decode is
    slower than priced, the fraction that fits is today's over ``slope``); it is separable only if the
    rows' decode terms differ enough (``spread``, their max over min: the weights read every step dominate
    at small batches, so they do not); (2) with the fraction held, the per-step overhead as a line against
    batch size, ``extra / steps = overhead_s + per_row_s * batch``. Returns per device key both fits,
    ``spread`` and the rows used."""
    rows = [
        r for r in (rows or ROWS) if r.kind == "fixed_batch_latency" and r.role == "source" and not r.refused
    ]
    out = {}
    for key in sorted({r.device for r in rows}):
        mine = [r for r in rows if r.device == key]
        dev = device(key)
        cost = roofline(dev)
        xs, ys, steps, batch = [], [], [], []
        for r in mine:
            s = r.settings
            prefill, decode = _latency_parts(cost, s["model"], s["batch"], s["input"], s["output"])
            xs.append(decode)
            ys.append(r.figure - prefill)
            steps.append(s["output"] - 1)
            batch.append(s["batch"])
        h, slope = _lstsq(steps, xs, ys)
        per_step = [(y - x) / n for x, y, n in zip(xs, ys, steps, strict=True)]
        h0, h1 = _lstsq([1.0] * len(batch), batch, per_step)
        out[key] = dict(
            joint_overhead_s=h, joint_slope=slope, joint_stream=dev.fractions.stream / slope,
            spread=max(xs) / min(xs), overhead_s=h0, per_row_s=h1, rows=[r.key for r in mine],
        )  # fmt: skip
    return out


def gemm_fit(rows=None) -> dict[str, dict]:
    """``gemm_unhidden`` per GPU from the ``gemm`` source rows: the share ``a`` of a GEMM's shorter roof
    term that, added to the longer, makes the twin's GEMM the published one, ``t = max(c, m) + a min(c, m)``
    with ``c`` and ``m`` the twin's terms at its cited fractions. Least squares of the relative error, in
    closed form: ``a = sum(x r) / sum(x x)`` with ``x = min / t`` and ``r = (t - max) / t``. Returns per
    device key ``unhidden``, the median and the extremes of the rows' ratios (twin over published) with the
    bare ``max`` and with the fit, and the rows used."""
    rows = [r for r in (rows or ROWS) if r.kind == "gemm" and r.role == "source" and not r.refused]
    out = {}
    for key in sorted({r.device for r in rows}):
        mine = [r for r in rows if r.device == key]
        bare = roofline(replace(device(key), fractions=replace(device(key).fractions, gemm_unhidden=0.0)))
        terms = [(bare.source.gemm(*(r.settings[d] for d in "mkn"), 2), r.figure) for r in mine]
        xr = [(min(cm) / t, (t - max(cm)) / t) for cm, t in terms]
        a = sum(x * r for x, r in xr) / sum(x * x for x, _ in xr)
        before = sorted(max(cm) / t for cm, t in terms)
        after = sorted((max(cm) + a * min(cm)) / t for cm, t in terms)
        out[key] = dict(
            unhidden=a, rows=[r.key for r in mine],
            bare=(statistics.median(before), before[0], before[-1]),
            fitted=(statistics.median(after), after[0], after[-1]),
        )  # fmt: skip
    return out


def elementwise_fit(rows=None) -> dict[str, dict]:
    """``elementwise_floor_s`` and ``elementwise`` per GPU from the ``elementwise`` source rows, fitted
    together to each profile's layer at each size: the sum of its five cells with the add counted twice (the
    profile times one of a layer's two adds), against the twin's ``k f + b / B`` of a layer's ``k`` =
    ``ELEMENTWISE_KERNELS`` kernels moving ``b`` bytes (``oppo_engine/sim/cost.py::elementwise_bytes``), ``f``
    the floor and ``B`` the bandwidth. Least squares of the relative error, in closed form (the error
    ``(k f + b s) / t - 1`` is linear in ``f`` and ``s = 1 / B``). A layer missing one of its cells is a
    ``ValueError``. Returns per device key ``floor_s``, ``fraction`` (``B`` over the device's HBM bandwidth),
    the median and the extremes of the layers' ratios (twin over profile) with the bytes at ``stream`` alone
    (the rule before) and with the fit, the cells' ratios with the fit, and the rows used."""
    rows = [r for r in (rows or ROWS) if r.kind == "elementwise" and r.role == "source" and not r.refused]
    out = {}
    for key in sorted({r.device for r in rows}):
        mine = [r for r in rows if r.device == key]
        dev = device(key)
        layers: dict[tuple, dict[str, float]] = {}
        for r in mine:
            cells = layers.setdefault((r.settings["model"], r.settings["tokens"]), {})
            if r.settings["op"] in cells:
                raise ValueError(f"{r.key}: two rows of one cell ({r.settings})")
            cells[r.settings["op"]] = r.figure
        terms = []  # (kernels, bytes, published seconds) per layer
        for (model, tokens), cells in sorted(layers.items()):
            missing = [op for op in ELEMENTWISE_OPS if op not in cells]
            if missing:
                lacks = ", ".join(missing)
                raise ValueError(f"elementwise_fit: {key} {model} at {tokens} tokens lacks {lacks}")
            t = sum(cells.values()) + cells["add"]  # two residual adds a layer; the profile times one
            terms.append((ELEMENTWISE_KERNELS, tokens * elementwise_bytes(VIDUR_SHAPES[model]), t))
        floor, s = _lstsq([k / t for k, _, t in terms], [b / t for _, b, t in terms], [1.0] * len(terms))
        if floor < 0 or s <= 0:
            raise ValueError(f"elementwise_fit: {key}: no positive floor and bandwidth fit its rows")
        stream = dev.hbm_bandwidth * dev.fractions.stream
        before = sorted(b / stream / t for _, b, t in terms)
        after = sorted((k * floor + b * s) / t for k, b, t in terms)
        cells_after = sorted((floor + _cell_bytes(r) * s) / r.figure for r in mine)
        out[key] = dict(
            floor_s=floor, fraction=1.0 / (s * dev.hbm_bandwidth), layers=len(terms),
            rows=[r.key for r in mine],
            bare=(statistics.median(before), before[0], before[-1]),
            fitted=(statistics.median(after), after[0], after[-1]),
            cells=(statistics.median(cells_after), cells_after[0], cells_after[-1]),
        )  # fmt: skip
    return out


def _lstsq(a: list[float], b: list[float], y: list[float]) -> tuple[float, float]:
    """Least squares of ``y = p * a + q * b``: ``(p, q)``."""
    a11 = sum(v * v for v in a)
    a12 = sum(u * v for u, v in zip(a, b, strict=True))
    a22 = sum(v * v for v in b)
    b1 = sum(u * v for u, v in zip(a, y, strict=True))
    b2 = sum(u * v for u, v in zip(b, y, strict=True))
    det = a11 * a22 - a12 * a12
    return (b1 * a22 - b2 * a12) / det, (a11 * b2 - a12 * b1) / det


def _prefill(cost: CostModel, shape: ModelShape, batch: int, inp: int) -> float:
    return cost.forward(
        shape, Batch(tuple((inp, inp) for _ in range(batch)), batch, batch), captured=True
    ).alone_s


def table() -> list[dict]:
    """Every row with its prediction (or refusal) and ratio."""
    out = []
    for row in ROWS:
        try:
            pred, why = predict(row), None
        except Refused as e:
            pred, why = None, str(e).split(": ", 1)[1]
        out.append(
            dict(row=row, prediction=pred, ratio=None if pred is None else pred / row.figure, refused=why)
        )
    return out


__all__ = ["ROWS", "Published", "Refused", "decode_fit", "elementwise_fit", "gemm_fit", "predict", "table"]
