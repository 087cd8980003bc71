"""Compile every Triton kernel variant the engine launches for an H100/H200 (sm_90), with no GPU here.

The kernel tests run the kernels under Triton's interpreter on the CPU, which never runs Triton's compiler:
a kernel can pass every interpreted test and still fail to compile for the GPU (a type the compiler
rejects, a tile over the shared memory). This compiles them, ahead of time, through the kernels' own
Python wrappers (``kernels/paged_attention.py``, ``sample.py``, ``cache_ops.py``) called on CPU tensors of
the shapes the engine's models give: a stand-in driver reports an sm_90 device, every launch is turned
into Triton's ``warmup`` (specialise, compile, never launch), and each variant's cubin is checked against
the H200's per-block shared memory and, with the registers ``ptxas -v`` reports (the ptxas Triton uses),
against the register file; spills are reported.

The one setting changed from what a CPU call passes: ``DOT_FP32`` (the interpreter's bf16 ``tl.dot``
workaround) is off, as on CUDA. Variants are specialised on alignment and on ints equal to 1 as Triton's
JIT does (the CPU tensors' addresses stand in for the device's).

    python -m tests.kernels.sm90_compile            # the CI subset: every flag, dtype and tile shape once
    python -m tests.kernels.sm90_compile --full     # every preset-like shape x flag x dtype (minutes)

Run without ``TRITON_INTERPRET=1`` (it must not be set before triton is imported). Prints one line per
variant and a summary; exits 1 if any variant fails to compile or exceeds the shared memory.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

SHARED_LIMIT = 232448  # bytes of shared memory one block may use on sm_90 (227 KB, opted in)
REGISTER_FILE = 65536  # 32-bit registers one block may use on sm_90: registers per thread x threads

# (name, q heads, kv heads, head dim): the attention shapes of the presets and of the families the engine
# runs (Qwen2-0.5B, Llama-3-8B, Qwen2-7B, a head_dim-80 GQA Llama, Gemma2's 256).
SHAPES = {
    "qwen2-0.5b": (14, 2, 64),
    "llama-8b": (32, 8, 128),
    "qwen2-7b": (28, 4, 128),
    "llama-hd80": (32, 8, 80),
    "gemma2": (8, 4, 256),
}
VOCABS = (151936, 32000, 128)  # Qwen2's, Llama-2's, the tests' tiny one (several rows per program)
CALL = [""]  # the wrapper call being made (labels the variants it compiles)


@dataclass
class Variant:
    kernel: str
    call: str  # the wrapper call that first launched it
    constexprs: dict
    options: dict
    seconds: float
    shared: int
    registers: int | None = None
    spill_bytes: int | None = None
    error: str | None = None


def _install_sm90_driver():
    """A driver that reports one sm_90 device, and ``JITFunction.run`` turned into a compile-only warm-up
    that records each variant it compiles (a cached variant is not recorded twice)."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    class Sm90Driver:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    driver.set_active(Sm90Driver())
    variants: list[Variant] = []
    seen: set[int] = set()

    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        if "DOT_FP32" in kwargs:
            kwargs["DOT_FP32"] = False  # the interpreter's workaround; CUDA launches pass False
        constexprs = {k: v for k, v in kwargs.items() if k.isupper()}
        t0 = time.perf_counter()
        try:
            kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        except Exception as e:  # noqa: BLE001 -- a compile error is this check's finding
            error = f"{type(e).__name__}: {str(e)[:300]}"
            variants.append(Variant(self.fn.__name__, CALL[0], constexprs, {}, 0.0, 0, error=error))
            return None
        if id(kernel) in seen:
            return None
        seen.add(id(kernel))
        meta = kernel.metadata
        options = {"num_warps": meta.num_warps, "num_stages": meta.num_stages}
        v = Variant(self.fn.__name__, CALL[0], constexprs, options, time.perf_counter() - t0, meta.shared)
        v.registers, v.spill_bytes = _ptxas_usage(kernel.asm["ptx"])
        variants.append(v)
        return None

    JITFunction.run = compile_only
    return variants


def _ptxas_usage(ptx: str) -> tuple[int | None, int | None]:
    """Registers per thread and spill bytes (stores + loads) of ``ptx``, by ``ptxas -v`` of the ptxas that
    Triton itself assembles sm_90 with."""
    from triton.backends.nvidia.compiler import get_ptxas

    arch = re.search(r"^\.target\s+(\w+)", ptx, re.M)
    if arch is None:
        return None, None
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        out = subprocess.run(
            [get_ptxas(90).path, "-v", f"--gpu-name={arch.group(1)}", f.name, "-o", os.devnull],
            capture_output=True,
            text=True,
            timeout=120,
        )
    text = out.stdout + out.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", text)]
    return (int(regs.group(1)) if regs else None), (sum(spills) if spills else None)


def _attention_calls(full: bool):
    """(label, make_case kwargs, paged_attention kwargs) per call. Each call's batch decides which launches
    it makes: decode-only (one token per sequence) or mixed (a decode launch and a prefill launch); a
    context past ``KV_PER_SPLIT`` turns on split-KV and its reduce kernel."""
    import torch

    flags = {"plain": {}, "window": {"sliding_window": 48}, "softcap": {"softcap": 30.0},
             "window+softcap": {"sliding_window": 48, "softcap": 30.0}}  # fmt: skip
    batches = {"decode": [(1, 40), (1, 9)], "decode-long": [(1, 700), (1, 40)],
               "mixed": [(1, 40), (9, 30), (1, 5)], "mixed-long": [(1, 700), (20, 600)]}  # fmt: skip
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if full:
        grid = itertools.product(SHAPES, flags, batches, dtypes)
    else:
        # Every shape, flag, batch kind and dtype at least once; bf16 (the GPU's) for most.
        grid = [
            ("qwen2-0.5b", "plain", b, "bf16") for b in batches
        ] + [
            ("llama-8b", "plain", "decode", "bf16"), ("llama-8b", "window", "mixed-long", "bf16"),
            ("qwen2-7b", "plain", "decode-long", "bf16"),
            ("llama-hd80", "window", "mixed", "bf16"),
            ("gemma2", "window+softcap", "decode-long", "bf16"),
            ("gemma2", "window+softcap", "mixed", "bf16"),
            ("llama-8b", "softcap", "mixed", "fp16"),
            ("qwen2-0.5b", "plain", "mixed-long", "fp32"), ("qwen2-0.5b", "window", "decode", "fp32"),
        ]  # fmt: skip
    for shape, flag, batch, dtype in grid:
        hq, hkv, d = SHAPES[shape]
        case = dict(seqs=batches[batch], num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=dtypes[dtype])
        if "sliding_window" in flags[flag]:
            case["window"] = flags[flag]["sliding_window"]
        kwargs = dict(flags[flag])
        if batch.startswith("decode"):
            kwargs["max_q_len"] = 1  # as the engine's decode-only forwards: one launch, no work list
        yield f"{shape} {dtype} {flag} {batch}", case, kwargs


def compile_all(full: bool = False) -> list[Variant]:
    """Compile every variant of the selection; returns them (``error`` set on a failure)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("sm90_compile: unset TRITON_INTERPRET: the interpreter never runs Triton's compiler")
    variants = _install_sm90_driver()
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from paged_cases import make_case

    from oppo_engine.kernels import cache_ops, paged_attention, sample

    # The wrappers refuse CPU tensors unless interpreting; the kernels, already decorated, stay compiled.
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        for label, case, kwargs in _attention_calls(full):
            CALL[0] = f"attention {label}"
            c = make_case(**case)
            paged_attention.paged_attention(*c.args(), **kwargs)
        for vocab, dtype in itertools.product(VOCABS, (torch.float32, torch.bfloat16)):
            CALL[0] = f"sample V={vocab} {dtype}"
            logits = torch.randn(3, vocab).to(dtype)
            zeros = torch.zeros(3, dtype=torch.int64)
            sample.sample(logits, torch.ones(3), zeros, zeros)
        # The engine's sampled rows: their parameters are views of one packed int64 buffer
        # (SampleBatch.packed, in the forward's metadata copy) at offsets that follow the batch's sizes, so
        # their alignment changes from forward to forward. The variant compiled above must serve them all:
        # a "sample-rows" variant would be compiled in the middle of a step on the GPU.
        from oppo_engine.model.sampler import unpack

        for offset, n in itertools.product(range(4), (1, 2, 3, 5)):
            CALL[0] = f"sample-rows offset={offset} n={n}"
            packed = torch.zeros(offset + 5 * n, dtype=torch.int64)[offset:]
            _, seeds, positions, _, temperature, _ = unpack(packed, n)
            temperature.fill_(1.0)
            sample.sample(torch.randn(n, VOCABS[-1]), temperature, seeds, positions)
        for (shape, (_, hkv, d)), dtype in itertools.product(SHAPES.items(), (torch.bfloat16, torch.float32)):
            CALL[0] = f"reshape_and_cache {shape} {dtype}"
            kv_cache = torch.zeros(4, 2, 2, 16, hkv, d, dtype=dtype)
            key = torch.zeros(3, hkv, d, dtype=dtype)
            slots = torch.tensor([0, 17, -1])
            cache_ops.reshape_and_cache(key, key.clone(), kv_cache, slots, 1)
    finally:
        os.environ.pop("TRITON_INTERPRET")
    return variants


def fits(v: Variant) -> bool:
    """Whether a block of ``v`` can launch on sm_90: its shared memory and its registers."""
    threads = 32 * v.options.get("num_warps", 4)
    return v.shared <= SHARED_LIMIT and (v.registers or 0) * threads <= REGISTER_FILE


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--full", action="store_true", help="every shape x flag x batch kind x dtype")
    p.add_argument("--json", type=Path, help="write every variant's record here")
    args = p.parse_args(argv)
    import triton

    t0 = time.perf_counter()
    variants = compile_all(args.full)
    bad = [v for v in variants if v.error or not fits(v)]
    for v in variants:
        flags = " ".join(f"{k}={v.constexprs[k]}" for k in sorted(v.constexprs))
        usage = f"shared {v.shared:>6} B  regs {v.registers}  spill {v.spill_bytes} B  {v.seconds:4.1f} s"
        print(f"{'FAIL' if v in bad else 'ok  '} {v.kernel:<26} {v.error or usage}  [{v.call}]  {flags}")
    spilling = sum(1 for v in variants if v.spill_bytes)
    print(
        f"sm90_compile: triton {triton.__version__}, {len(variants)} variants, {len(bad)} failed, "
        f"{spilling} with register spills, max shared {max((v.shared for v in variants), default=0)} B "
        f"(limit {SHARED_LIMIT}), {time.perf_counter() - t0:.0f} s"
    )
    if args.json:
        args.json.write_text(json.dumps([asdict(v) for v in variants], indent=1, default=str))
    return 1 if bad or not variants else 0


if __name__ == "__main__":
    sys.exit(main())
