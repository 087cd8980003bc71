"""Every Triton kernel variant the engine launches compiles for sm_90 (H100/H200), checked with no GPU.

The interpreted kernel tests never run Triton's compiler; ``sm90_compile`` does, in a process of its own
(``TRITON_INTERPRET`` must be unset before triton is imported, and this suite sets it). The checker itself
is shown to catch both failures it looks for: a kernel that does not compile and one over the shared
memory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_every_kernel_variant_compiles_for_sm90_within_its_shared_memory(tmp_path):
    out = tmp_path / "variants.json"
    proc = _run(["-m", "tests.kernels.sm90_compile", "--json", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    variants = json.loads(out.read_text())
    assert all(v["error"] is None and 0 <= v["shared"] <= 232448 for v in variants)
    kernels = {v["kernel"] for v in variants}
    assert kernels == {
        "_paged_attention_kernel",
        "_split_kv_reduce_kernel",
        "_sample_kernel",
        "_reshape_and_cache_kernel",
    }
    # The sampler's per-row parameters at every alignment the engine's packed metadata gives them: no
    # variant beyond the one compiled for plain tensors.
    assert [v["call"] for v in variants if v["call"].startswith("sample-rows")] == []
    attention = [v for v in variants if v["kernel"] == "_paged_attention_kernel"]
    # Every switch of the attention kernel compiled both ways, and never the interpreter's bf16 workaround.
    for flag in ("DECODE", "SPLIT_KV", "HAS_WINDOW", "SOFTCAP"):
        assert {v["constexprs"][flag] for v in attention} == {True, False}, flag
    assert {v["constexprs"]["DOT_FP32"] for v in attention} == {False}
    assert {v["constexprs"]["HEAD_DIM"] for v in attention} == {64, 80, 128, 256}
    assert {v["call"].split()[2] for v in attention} == {"bf16", "fp16", "fp32"}
    assert all(v["registers"] and v["spill_bytes"] is not None for v in variants)  # ptxas -v was read
    assert all(v["registers"] * 32 * v["options"]["num_warps"] <= 65536 for v in variants)


def test_the_checker_reports_a_kernel_that_does_not_compile_and_one_over_shared_memory(tmp_path):
    script = textwrap.dedent(
        """
        import sys
        sys.path.insert(0, {root!r})
        import torch, triton, triton.language as tl
        from tests.kernels.sm90_compile import SHARED_LIMIT, _install_sm90_driver

        variants = _install_sm90_driver()

        @triton.jit
        def broken(x_ptr):
            tl.store(x_ptr + tl.arange(0, 3), 1.0)  # a range must be a power of two

        @triton.jit
        def big(a_ptr, b_ptr, c_ptr, BLOCK: tl.constexpr):
            offs = tl.arange(0, BLOCK)
            acc = tl.zeros((BLOCK, BLOCK), tl.float32)
            for k in range(0, 4096, BLOCK):  # pipelined: a stage of both tiles per num_stages
                a = tl.load(a_ptr + offs[:, None] * 4096 + k + offs[None, :])
                b = tl.load(b_ptr + (k + offs[:, None]) * 4096 + offs[None, :])
                acc += tl.dot(a, b)
            tl.store(c_ptr + offs[:, None] * 4096 + offs[None, :], acc)

        x = torch.zeros(16)
        broken[(1,)](x)
        m = torch.zeros(16, dtype=torch.float16)
        big[(1,)](m, m, torch.zeros(16), BLOCK=128, num_warps=4, num_stages=8)
        (bad,) = [v for v in variants if v.kernel == "broken"]
        (over,) = [v for v in variants if v.kernel == "big"]
        assert bad.error and "arange" in bad.error.lower(), bad.error
        assert over.error is None and over.shared > SHARED_LIMIT, over.shared
        print("ok", over.shared)
        """
    ).format(root=str(ROOT))
    path = tmp_path / "checker.py"  # Triton reads a kernel's source from its file
    path.write_text(script)
    proc = _run([str(path)], timeout=300)
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stdout[-2000:] + proc.stderr[-3000:]
