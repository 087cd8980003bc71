"""``triton.jit`` across Triton releases (the kernels' one decorator with options)."""

from __future__ import annotations

import inspect

import triton


def jit(**options):
    """``triton.jit`` with the options this Triton knows (``do_not_specialize_on_alignment`` is recent)."""
    known = inspect.signature(triton.jit).parameters
    return triton.jit(**{k: v for k, v in options.items() if k in known})
