"""What the remote scorers' messages hold: the service's and the remote lane's shared encoding.

``HANDOFFS`` (client -> service), ``ints = [epoch, item, item, ...]``, ``floats`` = the temperature of each
``ADD`` item in order:

- ``[ADD, seq_id, group_id, n, prompt_len, *prompt_ids]``: a sequence to score (its group and sample count,
  so the service shares the group's prompt pages);
- ``[TOKENS, seq_id, upto, final, k, *token_ids]``: tokens ``[upto - k, upto)``, so ``[0, upto)`` are the
  service's to prefill; ``final``: they are all the sequence will have.

``RESULTS`` (service -> client), ``ints = [epoch, k, (seq_id, num_ref_logprobs) * k]``, ``floats`` = each
sequence's reward then its reference log-probs. ``ABORT`` ``[epoch]`` drops every sequence of the client on
the service (a failed step: the client's lane starts over, as the local lane's ``abort`` does); results of an
older epoch are dropped on arrival. ``HELLO`` ``[PROTOCOL, vocab_size, max_model_len]``; ``WELCOME``
``[vocab_size, max_model_len, has_reference]`` and the service's ``time.perf_counter()`` as it sends it (the
client's clock offset); ``REFUSE`` and ``ERROR`` carry text (``encode_text``).

``SPANS`` (service -> client), ``ints = [epoch, k, (model, tokens) * k]``, ``floats = (start_s, end_s) * k``
in the service's ``time.perf_counter()``: the round's forwards that held the client's chunks (``model`` an
index into :data:`MODELS`, ``tokens`` the forward's tokens, every client's), for the client's timeline.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

PROTOCOL = 2
ADD, TOKENS = 0, 1
MODELS = ("reward", "reference")  # SPANS' model indices (the roles' names)


@dataclass(slots=True)
class AddItem:
    """A sequence the client hands to the service."""

    seq_id: int
    group_id: int
    n: int
    prompt_ids: list[int]
    temperature: float


@dataclass(slots=True)
class TokensItem:
    """New tokens of a sequence: ``[0, upto)`` are available, ``tokens`` the last ``len(tokens)`` of them."""

    seq_id: int
    upto: int
    final: bool
    tokens: list[int]


def encode_add(ints: list[int], floats: list[float], item: AddItem) -> None:
    """Append ``item`` to a ``HANDOFFS`` message's ``ints`` and ``floats``."""
    ints += [ADD, item.seq_id, item.group_id, item.n, len(item.prompt_ids), *item.prompt_ids]
    floats.append(item.temperature)


def encode_tokens(ints: list[int], item: TokensItem) -> None:
    """Append ``item`` to a ``HANDOFFS`` message's ``ints``."""
    ints += [TOKENS, item.seq_id, item.upto, int(item.final), len(item.tokens), *item.tokens]


def decode_handoffs(ints: list[int], floats: list[float]) -> Iterator[AddItem | TokensItem]:
    """The items of a ``HANDOFFS`` message's ``ints[1:]`` (after the epoch), in order."""
    i, t = 1, 0
    while i < len(ints):
        op = ints[i]
        if op == ADD:
            seq_id, group_id, n, k = ints[i + 1 : i + 5]
            yield AddItem(seq_id, group_id, n, ints[i + 5 : i + 5 + k], floats[t])
            i, t = i + 5 + k, t + 1
        elif op == TOKENS:
            seq_id, upto, final, k = ints[i + 1 : i + 5]
            yield TokensItem(seq_id, upto, bool(final), ints[i + 5 : i + 5 + k])
            i += 5 + k
        else:
            raise ValueError(f"HANDOFFS: unknown item {op} at {i}")


def encode_results(epoch: int, results: list[tuple[int, float, list[float] | None]]) -> tuple[list, list]:
    """``(ints, floats)`` of a ``RESULTS`` message: ``(seq_id, reward, ref_logprobs or None)`` each."""
    ints, floats = [epoch, len(results)], []
    for seq_id, reward, ref in results:
        ref = ref or []
        ints += [seq_id, len(ref)]
        floats += [reward, *ref]
    return ints, floats


def decode_results(ints: list[int], floats: list[float]) -> Iterator[tuple[int, float, list[float]]]:
    """``(seq_id, reward, ref_logprobs)`` of a ``RESULTS`` message (after its epoch)."""
    k, f = ints[1], 0
    for j in range(k):
        seq_id, n_ref = ints[2 + 2 * j], ints[3 + 2 * j]
        yield seq_id, floats[f], floats[f + 1 : f + 1 + n_ref]
        f += 1 + n_ref


def encode_spans(epoch: int, spans: list[tuple[int, int, float, float]]) -> tuple[list, list]:
    """A ``SPANS`` message's ``ints`` and ``floats``; ``spans``: ``(model, tokens, start_s, end_s)``."""
    ints, floats = [epoch, len(spans)], []
    for model, tokens, start, end in spans:
        ints += [model, tokens]
        floats += [start, end]
    return ints, floats


def decode_spans(ints: list[int], floats: list[float]) -> Iterator[tuple[str, int, float, float]]:
    """``(model name, tokens, start_s, end_s)`` of each span :func:`encode_spans` encoded."""
    for i in range(ints[1]):
        yield MODELS[ints[2 + 2 * i]], ints[3 + 2 * i], floats[2 * i], floats[2 * i + 1]
