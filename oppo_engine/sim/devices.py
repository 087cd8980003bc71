"""The roofline device table: public datasheet numbers and achieved fractions, each beside its source.

Datasheet numbers are the vendor's dense (no sparsity) peaks. Achieved fractions go per class of work and
each cites a public measurement; where none was found for a device, the comment says so and which
measurement stands in. Three are fitted, each only to published measurements of its own class of work (the
GEMMs' unhidden share, ``gemm_unhidden``, to profiled projection timings; the elementwise kernels' floor
and bandwidth, ``elementwise_floor_s`` and ``elementwise``, to profiled norm, rotary, activation and add
timings: ``bench/published.py``'s source rows); none to an end-to-end figure, least of all to the OPPO
paper's results, which the twin is compared
against (``bench/bench_twin.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

TB = 1e12
GB = 1e9


@dataclass(frozen=True, slots=True)
class Fractions:
    """Achieved fractions of the datasheet peaks, per class of work.

    ``gemm``: dense BF16 GEMM of the weights (compute-bound); ``stream``: bandwidth of reading weights and
    activations (memory-bound GEMMs: decode); ``decode_attention``: bandwidth of paged KV reads;
    ``prefill_attention``: arithmetic of prefill attention; ``training_mfu``: model FLOPs utilisation of an
    FSDP training step; ``collective_busbw``: NCCL bus bandwidth (bytes/s, not a fraction) of a
    collective over the node's GPUs; ``gemm_unhidden``: the share of a GEMM's shorter roof (its arithmetic
    or its reads, whichever takes less) that its kernel does not hide behind the longer one
    (:func:`~oppo_engine.sim.cost.ridge_gemm`: 0 is the bare roofline's ``max``, 1 their sum);
    ``elementwise``: bandwidth of a layer's elementwise kernels (norms, rotary embedding, gated activation,
    residual adds) beyond their ``elementwise_floor_s``, the device time (seconds, not a fraction) each such
    kernel takes however few its tokens (:meth:`~oppo_engine.sim.cost.Roofline.elementwise`).
    """

    gemm: float
    stream: float
    decode_attention: float
    prefill_attention: float
    training_mfu: float
    collective_busbw: float
    gemm_unhidden: float
    elementwise: float
    elementwise_floor_s: float


@dataclass(frozen=True, slots=True)
class Device:
    """One GPU: ``bf16_flops`` dense peak, ``hbm_bandwidth`` bytes/s, ``memory`` bytes, ``nvlink`` bytes/s
    (both directions together, per GPU), the achieved ``fractions`` and ``launch_s``, the host cost of
    launching one kernel (what an eager forward of many small kernels cannot hide)."""

    key: str
    name: str
    bf16_flops: float
    hbm_bandwidth: float
    memory: float
    nvlink: float
    fractions: Fractions
    launch_s: float
    sources: dict[str, str] = field(default_factory=dict)


# -- achieved fractions, by architecture -----------------------------------------------------------------
# Hopper (H100, H200, GH200: one GH100 die).
HOPPER = Fractions(
    # cuBLAS FP16 tensor-core GEMM 8192^3 on an H100 SXM5: 761.7 TFLOPS, 77% of peak.
    # github.com/waynehacking8/blackwell-tensorcore-kernels, results/reference/summary.md
    gemm=0.77,
    # "MLP weight load 2.6 TB/s, 78%" of 3.35 TB/s, Nsight Compute on an H100 SXM5 serving a 70B model.
    # mikamirai.com/blog/gpu-memory-bandwidth/
    stream=0.78,
    # vLLM PagedAttention v2 / FlashInfer batch decode "reach ~70-85% of peak HBM bandwidth on H100"
    # (huggingface.co/datasets/Infatoshi/kernelbench-hard-problems, 03_paged_attention/problem.yaml); the low
    # end is taken. The same Nsight study above measured 42% for KV reads in a TP=8 production run.
    decode_attention=0.70,
    # FlashAttention-2 forward, FP16, on an H100 SXM5: 388 TFLOPS, 39% (the repository above); the
    # FlashAttention-3 paper gives FA2 35% on H100. The engine's Triton kernel is FA2-class.
    prefill_attention=0.39,
    # Llama 3 405B pretraining: 38-43% BF16 MFU on 16K H100s (The Llama 3 Herd of Models, Table 4;
    # ai.meta.com/research/publications/the-llama-3-herd-of-models; quoted at
    # news.barelyhuman.xyz/item/43598691). The low end is taken. An MFU counts model FLOPs (6 per parameter
    # and token and the attention), never recomputation: CostModel.update charges the same. torchtitan's
    # 33-39% for Llama 3.1 8B FSDP is on 96 GB H100s at 500 W, a GPU the table lacks (bench/published.py).
    training_mfu=0.38,
    # nccl-tests all_reduce_perf on 8x H100 SXM5, NVLink-4: bus bandwidth 460-480 GB/s at large sizes
    # (docs.alayanew.com/en/docs/tech-blog/2026-05-06-nccl-tests). The low end is taken.
    collective_busbw=460 * GB,
    # Fitted (bench/published.py::gemm_fit, printed by `bench_twin --published`) to Vidur's profiled fp16
    # projections of Llama-2-7B on an H100 at 16-1024 tokens (github.com/microsoft/vidur
    # data/profiling/compute/h100/meta-llama/Llama-2-7b-hf/mlp.csv @7d47513; source rows of published.py).
    # 0.371 (28 rows; the bare max, 0 here before, puts the twin's GEMMs at 0.90 of the rows at their median,
    # 0.57 at the worst; 0.37 at 0.99, 0.74-1.27).
    gemm_unhidden=0.37,
    # Fitted together (bench/published.py::elementwise_fit, printed by `bench_twin --published`) to Vidur's
    # profiled fp16 RMSNorm, rotary embedding, SiluAndMul and residual add of Llama-2-7B on an H100 at 1-4096
    # tokens (github.com/microsoft/vidur data/profiling/compute/h100/meta-llama/Llama-2-7b-hf/mlp.csv
    # @7d47513; source rows of published.py): a layer's 6 kernels take 6 floors plus its bytes at this
    # fraction of the HBM. 3.13 us and 0.765 (13 layers of 65 rows; the bytes at `stream` alone, no floor, as
    # before, put the twin's layers at 0.19 of the profile's at their median, 0.003-0.73; the fit at 0.92,
    # 0.74-1.32).
    elementwise=0.77,
    elementwise_floor_s=3.1e-6,
)

# Ampere (A100).
AMPERE = Fractions(
    # No public A100 GEMM measurement with a citable source was found: the Hopper cuBLAS fraction stands in.
    gemm=0.77,
    # A read kernel on an A100 80GB SXM: 1.80 TB/s of 2.04, 88% (Nsight Compute agrees).
    # forums.developer.nvidia.com/t/trouble-to-reach-peak-bandwidth-of-a100/339083
    stream=0.88,
    # No A100 decode-attention measurement was found: the Hopper figure stands in.
    decode_attention=0.70,
    # FlashAttention-2 reaches 50-73% of the A100's peak (FA2 paper, arXiv:2307.08691, as summarised at
    # pristren.com/blog/flashattention-3-algorithm-guide). The low end is taken.
    prefill_attention=0.50,
    # Llama 3 8B, FSDP2 on 64x A100 80GB, bf16, local batch 1 x 8192 tokens, selective (op) activation
    # checkpointing: 2973 tokens/s/GPU, MFU 58.2% (github.com/pytorch/torchtitan docs/performance.md
    # @0413364; bench/published.py, a source row). Its convention, which CostModel.update charges: 6 FLOPs
    # per parameter and token plus 12 L H q T of attention over the whole row, recomputation not counted
    # (torchtitan/utils.py::get_num_flop_per_token at that commit). Was 0.50 (lmms-engine, Qwen2.5-7B on
    # A800s: a GPU the table lacks).
    training_mfu=0.582,
    # nccl-tests all_reduce_perf on 8x A100 SXM4, NVLink-3: 230-250 GB/s (the nccl-tests page above).
    collective_busbw=230 * GB,
    # Fitted (bench/published.py::gemm_fit) to Vidur's profiled fp16 projections of Llama-2-7B and
    # Llama-3-8B on an A100 80GB at 16-1024 tokens (github.com/microsoft/vidur data/profiling/compute/a100/
    # meta-llama/{Llama-2-7b-hf,Meta-Llama-3-8B}/mlp.csv @7d47513; source rows of published.py; which A100
    # 80GB, SXM4 or PCIe, ran the profile is not stated). 0.539 (56 rows; the bare max, 0 here before, puts
    # the twin's GEMMs at 0.81 of the rows at their median, 0.60 at the worst; 0.54 at 0.95, 0.77-1.25).
    gemm_unhidden=0.54,
    # Fitted together (bench/published.py::elementwise_fit) to Vidur's profiled fp16 RMSNorm, rotary
    # embedding, SiluAndMul and residual add of Llama-2-7B and Llama-3-8B on an A100 80GB at 1-4096 tokens
    # (github.com/microsoft/vidur data/profiling/compute/a100/meta-llama/{Llama-2-7b-hf,Meta-Llama-3-8B}/
    # mlp.csv @7d47513; source rows of published.py; SXM4 or PCIe not stated, as above): a layer's 6 kernels
    # take 6 floors plus its bytes at this fraction of the HBM. 3.94 us and 0.602 (26 layers of 130 rows; the
    # bytes at `stream` alone, no floor, as before, put the twin's layers at 0.23 of the profile's at their
    # median, 0.004-0.59; the fit at 0.99, 0.82-1.25).
    elementwise=0.60,
    elementwise_floor_s=3.9e-6,
)

# "Each cudaLaunchKernel costs roughly 5 to 20 microseconds" (factryze.ai/scale-atlas/compute/
# tensor-core-throughput); the low end is taken. Captured (CUDA-graph) decode pays it once per forward.
LAUNCH_S = 5e-6

DEVICES: dict[str, Device] = {
    "h200": Device(
        key="h200",
        name="NVIDIA H200 SXM",
        # The GH100 die of the H100: FP16/BF16 tensor 989 TFLOPS dense (anandtech.com/show/21136, "NVIDIA
        # at SC23: H200 accelerator with HBM3e"; glennklockwood.com/garden/processors/h100: 989.4).
        bf16_flops=989.4 * TB,
        # 4.8 TB/s of HBM3e, 141 GB (anandtech.com/show/21136).
        hbm_bandwidth=4.8 * TB,
        memory=141 * GB,
        # NVLink 4: 900 GB/s (geektopia.es, 2023-11-13, "NVIDIA anuncia la aceleradora H200").
        nvlink=900 * GB,
        fractions=HOPPER,
        launch_s=LAUNCH_S,
        sources={
            "bf16_flops": "anandtech.com/show/21136; glennklockwood.com/garden/processors/h100",
            "hbm_bandwidth": "anandtech.com/show/21136",
            "memory": "anandtech.com/show/21136",
            "nvlink": "geektopia.es/es/technology/2023/11/13/noticias/nvidia-anuncia-la-aceleradora-h200",
        },
    ),
    "h100": Device(
        key="h100",
        name="NVIDIA H100 SXM",
        # NVIDIA's H100 SXM datasheet, reproduced at archive-lib.hpctech.co.jp/gpuproduct/nvidia-h100.html:
        # BF16 tensor 1,979 TFLOPS "with sparsity; specifications 1/2 lower without", 3,350 GB/s, 80 GB,
        # NVLink 900 GB/s. Dense peak 989.4: glennklockwood.com/garden/processors/h100.
        bf16_flops=989.4 * TB,
        hbm_bandwidth=3.35 * TB,
        memory=80 * GB,
        nvlink=900 * GB,
        fractions=HOPPER,
        launch_s=LAUNCH_S,
        sources={
            "bf16_flops": "glennklockwood.com/garden/processors/h100",
            "hbm_bandwidth": "archive-lib.hpctech.co.jp/gpuproduct/nvidia-h100.html",
            "memory": "archive-lib.hpctech.co.jp/gpuproduct/nvidia-h100.html",
            "nvlink": "archive-lib.hpctech.co.jp/gpuproduct/nvidia-h100.html",
        },
    ),
    "gh200": Device(
        key="gh200",
        name="NVIDIA GH200 (96 GB HBM3)",
        # The superchip's GPU is an H100 Hopper GPU (spheron.network/blog/nvidia-gh200-guide): its dense
        # BF16 peak is the H100's (glennklockwood.com/garden/processors/h100).
        bf16_flops=989.4 * TB,
        # 96 GB of HBM3 at 4 TB/s (NVIDIA's announcement, reported at nishikiout.net/entry/2023/08/09/143040).
        hbm_bandwidth=4.0 * TB,
        memory=96 * GB,
        # NVLink-C2C, 900 GB/s both directions (spheron.network/blog/nvidia-gh200-guide), is the CPU-GPU link;
        # no public figure for the GPU-to-GPU links of a multi-GH200 node was found: the Hopper NVLink-4
        # figure stands in, and so does the H100 collective measurement.
        nvlink=900 * GB,
        fractions=HOPPER,
        launch_s=LAUNCH_S,
        sources={
            "bf16_flops": "spheron.network/blog/nvidia-gh200-guide (an H100 GPU); glennklockwood.com",
            "hbm_bandwidth": "nishikiout.net/entry/2023/08/09/143040",
            "memory": "spheron.network/blog/nvidia-gh200-guide",
            "nvlink": "spheron.network/blog/nvidia-gh200-guide (NVLink-C2C; GPU-GPU: not found)",
        },
    ),
    "a100-80gb": Device(
        key="a100-80gb",
        name="NVIDIA A100 80GB SXM",
        # BF16 312 TFLOPS dense, 80 GB HBM2e at 2,039 GB/s (glennklockwood.com/garden/processors/A100, citing
        # NVIDIA's A100 datasheet); NVLink 600 GB/s (NVIDIA's A100 page, reproduced at xynio.com/
        # nvidia-a100-tensor-core-gpu/).
        bf16_flops=312 * TB,
        hbm_bandwidth=2.039 * TB,
        memory=80 * GB,
        nvlink=600 * GB,
        fractions=AMPERE,
        launch_s=LAUNCH_S,
        sources={
            "bf16_flops": "glennklockwood.com/garden/processors/A100",
            "hbm_bandwidth": "glennklockwood.com/garden/processors/A100",
            "memory": "glennklockwood.com/garden/processors/A100",
            "nvlink": "xynio.com/nvidia-a100-tensor-core-gpu/",
        },
    ),
}


def device(key: str) -> Device:
    """The table's device ``key``; ``ValueError`` listing the known ones otherwise."""
    try:
        return DEVICES[key.lower()]
    except (KeyError, AttributeError):
        raise ValueError(
            f"unknown device {key!r}: the roofline table knows {', '.join(sorted(DEVICES))} (or pass a "
            "calibrated Profile: oppo-engine calibrate)"
        ) from None
