"""Triton kernels of oppo_engine, each beside its pure-torch reference.

- ``paged_attention``: varlen attention of packed queries over the paged KV cache (decode and chunked
  prefill in one launch), with ``paged_attention_ref``.
- ``sample``: Gumbel-max sampling with counter-based noise and the token's log-prob in one pass, with
  ``sample_ref``.

Only ``oppo_engine.ops`` should import these modules; it picks kernel or reference per device. On a machine
without CUDA the kernels still run under ``TRITON_INTERPRET=1`` (tests only).
"""
