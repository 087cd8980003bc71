"""Prompts as users hold them, turned into lists of token ids before the engine queues them.

Accepted (``to_token_lists``): lists of int lists (numpy and torch integer scalars included); a 2-D tensor
or array (rows are prompts; ``attention_mask`` strips padding on either side, and without it every row is
taken whole); a tokenizer's ``BatchEncoding`` or a dict with ``input_ids`` (and its ``attention_mask``);
one 1-D sequence as one prompt; ``[]`` as no prompts. With a tokenizer, text (tokenized with its
defaults, special tokens added) and chat conversations (lists of ``{"role", "content"}`` messages, through
``apply_chat_template(..., add_generation_prompt=True)``, as TRL does). A wrong type raises ``TypeError``
naming what was passed and what to do; wrong values (ids outside the vocabulary, empty prompts) are the
prompt queue's ``ValueError``.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping
from typing import Any

_NOT_IDS = "prompts must be token ids; got {what}: {hint}"
_TOKENIZE = "tokenize first, or pass tokenizer= to the engine"


def _type_error(what: str, hint: str = _TOKENIZE) -> TypeError:
    return TypeError(_NOT_IDS.format(what=what, hint=hint))


def _is_token(value: Any) -> bool:
    """An integer token id: an int, a numpy integer or a 0-d integer tensor (never a bool)."""
    if isinstance(value, bool):  # numpy's bool is neither Integral nor an integer array
        return False
    if isinstance(value, numbers.Integral):
        return True
    return _is_array(value) and _ndim(value) == 0 and _is_integer_array(value)


def _is_array(value: Any) -> bool:
    """A torch tensor or numpy array (duck-typed: both have ``tolist``, ``shape`` and ``dtype``)."""
    return hasattr(value, "tolist") and hasattr(value, "shape") and hasattr(value, "dtype")


def _ndim(array: Any) -> int:
    return len(array.shape)


def _is_integer_array(array: Any) -> bool:
    dtype = array.dtype
    kind = getattr(dtype, "kind", None)  # numpy
    if kind is not None:
        return kind in "iu"
    return not (dtype.is_floating_point or dtype.is_complex) and str(dtype) != "torch.bool"


def _describe(value: Any) -> str:
    if _is_array(value):
        return f"{type(value).__name__} of dtype {value.dtype}"
    return type(value).__name__


def _is_message(value: Any) -> bool:
    return isinstance(value, Mapping) and "role" in value and "content" in value


def _is_conversation(value: Any) -> bool:
    return isinstance(value, list | tuple) and len(value) > 0 and all(_is_message(m) for m in value)


def to_token_lists(prompts: Any, attention_mask: Any = None, tokenizer: Any = None) -> list[list[int]]:
    """``prompts`` in any accepted form as lists of ints (see the module docstring)."""
    if isinstance(prompts, Mapping):
        if "input_ids" not in prompts:
            keys = ", ".join(map(str, prompts))
            raise _type_error(f"a mapping without input_ids (keys: {keys})", "pass a tokenizer's output")
        if attention_mask is not None and prompts.get("attention_mask") is not None:
            raise ValueError("attention_mask is given twice: as an argument and in the tokenizer output")
        if attention_mask is None:
            attention_mask = prompts.get("attention_mask")
        prompts = prompts["input_ids"]
        if isinstance(prompts, Mapping):
            raise _type_error("a nested mapping as input_ids", "pass token ids, or a tokenizer's output")
    if isinstance(prompts, str | bytes):
        if tokenizer is None:
            raise _type_error(type(prompts).__name__)
        return [one_prompt(prompts, tokenizer)]
    if _is_array(prompts):
        prompts = _array_rows(prompts)
    elif not isinstance(prompts, Iterable):
        raise _type_error(
            _describe(prompts), "pass a list of token-id lists, a 2-D tensor or a tokenizer's output"
        )
    prompts = list(prompts)
    if not prompts:
        return []
    if _is_token(prompts[0]) or _is_message(prompts[0]):
        prompts = [prompts]  # a single 1-D sequence (or one conversation) is one prompt
    rows = [one_prompt(p, tokenizer, where=f"prompts[{i}]") for i, p in enumerate(prompts)]
    if attention_mask is None:
        return rows
    if _is_array(attention_mask):
        masks = _array_rows(attention_mask)
    else:
        masks = list(attention_mask)
        masks = [masks] if masks and _is_token(masks[0]) else [list(m) for m in masks]
    if len(masks) != len(rows):
        raise ValueError(f"attention_mask has {len(masks)} rows for {len(rows)} prompts")
    return [
        _strip(row, [int(m) for m in mask], i) for i, (row, mask) in enumerate(zip(rows, masks, strict=True))
    ]


def one_prompt(prompt: Any, tokenizer: Any = None, where: str = "a prompt") -> list[int]:
    """One prompt (token ids, a 1-D tensor or array, text or a conversation with ``tokenizer``) as ints."""
    if isinstance(prompt, Mapping) and "input_ids" in prompt and not _is_message(prompt):
        rows = to_token_lists(prompt, tokenizer=tokenizer)  # its attention_mask strips its padding
        if len(rows) != 1:
            raise _type_error(f"a tokenizer output of {len(rows)} prompts in {where}", "one prompt per item")
        return rows[0]
    if isinstance(prompt, str | bytes):
        if tokenizer is None:
            raise _type_error(f"{type(prompt).__name__} in {where}")
        return list(tokenizer(prompt)["input_ids"])
    if _is_conversation(prompt):
        if tokenizer is None:
            raise _type_error(
                f"chat messages in {where}", "pass tokenizer= to the engine (its chat template)"
            )
        ids = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)
    if _is_array(prompt):
        if _ndim(prompt) != 1 or not _is_integer_array(prompt):
            raise _type_error(f"{_describe(prompt)} with {_ndim(prompt)} dimensions in {where}",
                              "each prompt is a 1-D integer sequence")  # fmt: skip
        return [int(t) for t in prompt.tolist()]
    if isinstance(prompt, Mapping):
        raise _type_error(
            f"a nested mapping in {where}", "pass token ids, or a tokenizer's output as a whole"
        )
    if _is_token(prompt) or not isinstance(prompt, Iterable):
        raise _type_error(f"{_describe(prompt)} in {where}", "each prompt is a sequence of token ids")
    ids = list(prompt)
    bad = next((t for t in ids if not _is_token(t)), None)
    if bad is not None:
        raise _type_error(f"{_describe(bad)} ({bad!r:.20}) in {where}", "token ids are integers")
    return [int(t) for t in ids]


def _array_rows(array: Any) -> list:
    """A 1-D array as one row, a 2-D array as its rows (lists)."""
    if not _is_integer_array(array):
        raise _type_error(_describe(array), "token ids are integers (cast the tensor with .long())")
    if _ndim(array) == 1:
        return [array.tolist()]
    if _ndim(array) == 2:
        return array.tolist()
    raise _type_error(f"{_describe(array)} with {_ndim(array)} dimensions", "pass a 1-D or 2-D tensor")


def _strip(row: list[int], mask: list[int], index: int) -> list[int]:
    """``row`` without the padding ``mask`` marks (0) on its left or right."""
    if len(mask) != len(row):
        raise ValueError(
            f"attention_mask row {index} has {len(mask)} entries for a prompt of {len(row)} tokens"
        )
    if any(m not in (0, 1) for m in mask):
        raise ValueError(f"attention_mask row {index} must hold 0 and 1 only")
    kept = [i for i, m in enumerate(mask) if m]
    if kept and kept[-1] - kept[0] + 1 != len(kept):
        raise ValueError(
            f"attention_mask row {index} masks tokens inside the prompt: only padding on the left or the "
            "right can be stripped"
        )
    return row[kept[0] : kept[-1] + 1] if kept else []
