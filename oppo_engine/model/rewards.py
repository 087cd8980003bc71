"""Reward callables: the per-sequence form ``reward(prompt_ids, response_ids) -> float``, the batched form
``BatchedReward(fn)``, and the checks that make a wrong one fail at build or at the call that went wrong,
naming the reward, instead of deep inside a step."""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Sequence

import torch


class BatchedReward:
    """A reward computed for many sequences at once: ``fn(prompts, responses) -> list[float]``, with
    ``prompts`` and ``responses`` lists of token-id lists of equal length.

    The engine calls ``fn`` once per scoring pass with every sequence that pass finishes (not streamed, like
    a per-sequence callable); each result is checked as a per-sequence reward's is.
    """

    def __init__(self, fn: Callable[[list[list[int]], list[list[int]]], Sequence[float]]) -> None:
        check_reward_arity(fn, "BatchedReward(fn)", "fn(prompts, responses)")
        self.fn = fn

    def __call__(self, prompts: list[list[int]], responses: list[list[int]]) -> list[float]:
        return self.check(self.fn(prompts, responses), len(prompts))

    def check(self, results: object, num_sequences: int) -> list[float]:
        """``fn``'s ``results`` for ``num_sequences`` sequences as floats, each checked (see the class)."""
        name = f"BatchedReward({reward_name(self.fn)})"
        if isinstance(results, str | bytes) or not hasattr(results, "__len__"):
            raise TypeError(f"{name} returned {type(results).__name__}; it must return a list of floats")
        if len(results) != num_sequences:
            raise ValueError(f"{name} returned {len(results)} rewards for {num_sequences} sequences")
        return [check_reward_value(r, name) for r in results]

    def __repr__(self) -> str:
        return f"BatchedReward({reward_name(self.fn)})"


def reward_name(fn: object) -> str:
    """How an error message names the reward callable."""
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def check_reward_arity(fn: object, what: str, call: str = "reward(prompt_ids, response_ids)") -> None:
    """``TypeError`` unless ``fn`` can be called with two positional arguments, as the engine calls it."""
    if not callable(fn):
        raise TypeError(f"{what} must be callable, got {type(fn).__name__}")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: trust it
        return
    try:
        signature.bind([], [])
    except TypeError:
        raise TypeError(
            f"{what}={reward_name(fn)}{signature} cannot be called as {call}: it must take two positional "
            "arguments"
        ) from None


def check_reward_value(value: object, name: str) -> float:
    """``value`` as a float if it is a finite real number (int, float, a numpy scalar, a 0-d tensor);
    ``TypeError`` for anything else (bool and None included), ``ValueError`` if not finite."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype not in (torch.bool,):
        if not value.dtype.is_complex:
            value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"reward {name} returned {type(value).__name__} ({value!r:.40}); it must return a number "
            "(int, float, a numpy scalar or a 0-d tensor)"
        )
    result = float(value)
    if not math.isfinite(result):
        raise ValueError(f"reward {name} returned {result}: rewards must be finite")
    return result
