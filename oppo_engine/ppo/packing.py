"""Padding-free micro-batches ("packs") for the PPO update.

A pack is several sequences laid end to end in one row, ``input_ids [1, T]``, run with
``attention_mask=None``, ``position_ids`` that restart at 0 at every sequence and ``use_cache=False``.
transformers (5.x, ``masking_utils.find_packed_sequence_indices``) then reads the sequence boundaries off
the position ids and builds a block-diagonal causal mask for sdpa and eager attention, so no token attends
across a boundary and no arithmetic is spent on padding. The mask is dense ``T x T``: attention grows with
the pack's length squared, which is why packs are bounded by a token budget.

A model that ignores ``position_ids`` for masking (or an attention that takes no mask) would let a
sequence see its neighbour: :func:`check_packing` probes that once, when the trainer is built.

``PPOConfig.pack_attention`` replaces the dense mask by batched causal calls over the pack's sequences
(``pack_attention.py``: about ``sum(len_i^2)`` instead of ``T^2``); :func:`check_batched_packing` probes
it, and :func:`plan_sorted_packs` makes packs of sequences of similar length, so those calls' padded
batches are tight and few.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from oppo_engine.model.support import text_config
from oppo_engine.ppo import core
from oppo_engine.ppo.pack_attention import batched_attention, refusal


def plan_packs(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Positions into ``lengths`` grouped into packs of at most ``budget`` tokens each (first-fit
    decreasing: longest first, each into the first pack with room). Every length must be ``<= budget``."""
    packs: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        if n > budget:
            raise ValueError(f"a sequence of {n} tokens exceeds max_tokens_per_microbatch={budget}")
        slot = next((k for k, r in enumerate(room) if r >= n), None)
        if slot is None:
            packs.append([])
            room.append(budget)
            slot = len(packs) - 1
        packs[slot].append(i)
        room[slot] -= n
    return packs


def plan_sorted_packs(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Positions into ``lengths`` grouped into packs of at most ``budget`` tokens each, pack-mates of similar
    length: the positions sorted by length (longest first, ties by position), each pack a run of them as
    long as the budget allows (next fit). Batched attention pads a pack's sequences to their bucket's longest,
    one call per bucket of similar lengths, so mixing a long sequence with short ones (first-fit decreasing
    fills gaps that way) costs it more calls. Every length must be ``<= budget``."""
    packs: list[list[int]] = []
    room = 0
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        if n > budget:
            raise ValueError(f"a sequence of {n} tokens exceeds max_tokens_per_microbatch={budget}")
        if n > room:
            packs.append([])
            room = budget
        packs[-1].append(i)
        room -= n
    return packs


@dataclass(slots=True)
class Pack:
    """``n`` sequences in one row, and where each one's per-token columns lie in it."""

    input_ids: torch.Tensor  # [1, T] the sequences end to end
    position_ids: torch.Tensor  # [1, T] 0, 1, ... restarting at every sequence
    index: torch.Tensor  # [n, w-1] int64: column p of sequence k is packed prediction position index[k, p]
    valid: torch.Tensor  # [n, w-1] bool: p < length_k - 1 (w: the longest sequence)
    lengths: list[int]  # [n] each sequence's tokens, in packed order
    keep: torch.Tensor | None = None  # [1, T-1] bool: the packed positions whose log-probs are needed

    def unpack(self, flat: torch.Tensor) -> torch.Tensor:
        """``[n, w-1]`` per-sequence columns (0 beyond each sequence) of a ``[T-1]`` packed per-token
        tensor whose position ``t`` predicts token ``t + 1``: the padded batch layout of ``batch.py``."""
        return torch.where(self.valid, flat[self.index], 0.0)


def pack_rows(input_ids: torch.Tensor, lengths: Sequence[int], keep: torch.Tensor | None = None) -> Pack:
    """Pack the first ``lengths[k]`` tokens of each row ``k`` of ``input_ids [n, L]`` (right-padded).
    ``keep`` (bool ``[n, >= w-1]``, per-token columns): the only columns :func:`pack_logprobs` computes."""
    device = input_ids.device
    ids = torch.cat([input_ids[k, :n] for k, n in enumerate(lengths)])[None]
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])[None]
    lens = torch.tensor(list(lengths), device=device)
    offsets = torch.cumsum(lens, 0) - lens
    cols = torch.arange(max(lengths) - 1, device=device)
    valid = cols[None] < (lens - 1)[:, None]
    index = torch.where(valid, offsets[:, None] + cols[None], 0)
    flat = None
    if keep is not None:
        flat = torch.zeros(1, ids.shape[1] - 1, dtype=torch.bool, device=device)
        flat[0, index[valid & keep[:, : len(cols)]]] = True
    return Pack(ids, positions, index, valid, list(lengths), flat)


def pack_logprobs(actor: nn.Module, pack: Pack, temperature: float) -> torch.Tensor:
    """``[n, w-1]`` ``core.token_logprobs`` of every sequence of ``pack`` (with ``pack.keep``: of its kept
    columns, 0 elsewhere), from one padding-free forward."""
    flat = core.token_logprobs(actor, pack.input_ids, None, temperature, pack.position_ids, pack.keep)
    return pack.unpack(flat[0])


def pack_values(critic: nn.Module, pack: Pack) -> torch.Tensor:
    """``[n, w-1]`` ``core.token_values`` of every sequence of ``pack``, from one padding-free forward."""
    return pack.unpack(core.token_values(critic, pack.input_ids, None, pack.position_ids)[0])


def check_packing(model: nn.Module, role: str, probe: Sequence[int], forward) -> None:
    """``ValueError`` naming ``role`` unless ``model``'s attention stays inside each sequence of a pack.

    Two sequences built from ``probe`` (token ids) are packed; changing every token of the first must leave
    the second's outputs (``forward(model, pack)``, ``[n, w-1]``) bitwise equal, and the second's outputs
    must match its own unpacked forward (its positions restart at 0). Runs in eval mode, without gradients;
    collective for an FSDP2 model.
    """
    packed, other, alone = _probe(model, probe, forward, forward)
    if not _holds(model, packed, other, alone):
        raise ValueError(
            f"max_tokens_per_microbatch: the {role}'s attention crosses the boundary between packed "
            f"sequences or ignores their restarting position_ids ({type(model).__name__}, attention "
            f"{getattr(getattr(model, 'config', None), '_attn_implementation', '?')!r}): packing needs sdpa "
            "or eager attention that honours position_ids; use max_tokens_per_microbatch=None"
        )


def check_batched_packing(model: nn.Module, role: str, probe: Sequence[int], forward, longest: int) -> None:
    """``ValueError`` naming ``role`` and the reason unless ``model``'s packs of sequences of up to
    ``longest`` tokens can run their attention as batched calls (``pack_attention.py``) exactly.

    :func:`check_packing`'s probe with the packed forwards inside ``batched_attention`` and the lone
    sequence's forward on the model's own attention: the second sequence's outputs must not move when the
    first changes, and must match the model's own (a feature the batched call would drop shows there). A
    model that refuses it (:func:`pack_attention.refusal`, a feature its attention is given), whose
    attention never reaches it, or with a sliding window shorter than ``longest``, is refused."""
    reason = refusal(model)
    calls, windows = [], []

    def batched(m: nn.Module, pack: Pack) -> torch.Tensor:
        with batched_attention(m, pack.lengths) as layout:
            out = forward(m, pack)
        calls.append(layout.calls)
        windows.append(layout.window)
        return out

    if reason is None:
        try:
            packed, other, alone = _probe(model, probe, batched, forward)
        except ValueError as e:
            reason = str(e)
    if reason is None and not all(calls):
        reason = (
            f"{type(model).__name__} does not dispatch its attention through transformers.AttentionInterface"
        )
    window = min((w for w in windows if w is not None), default=None)
    if reason is None and window is not None and window < longest:
        reason = (
            f"{type(model).__name__} has a sliding attention window of {window} tokens, shorter than a "
            f"pack's longest sequence can be ({longest})"
        )
    if reason is None and not _holds(model, packed, other, alone):
        reason = (
            f"{type(model).__name__}'s outputs over the batched attention differ from its own attention's "
            "(or cross the boundary between packed sequences)"
        )
    if reason is not None:
        raise ValueError(f"pack_attention='batched' cannot run the {role}: {reason}")


def _probe(model: nn.Module, probe: Sequence[int], forward, alone_forward):
    """``(packed, other, alone)``: the second of two probe sequences' outputs packed after the first, packed
    after the first changed, and alone (``alone_forward``)."""
    vocab = int(text_config(model).vocab_size)
    first = [int(t) for t in probe][:8]
    first = (first * 8)[:8] if first else list(range(min(8, vocab)))
    second = first[::-1][:6]
    changed = [(t + 1) % vocab for t in first]
    device = next(model.parameters()).device

    def run(fn, *seqs: list[int]) -> torch.Tensor:
        ids = torch.tensor([t for s in seqs for t in s], device=device)[None]
        starts = [sum(map(len, seqs[:k])) for k in range(len(seqs))]
        rows = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long, device=device)
        for k, s in enumerate(seqs):
            rows[k, : len(s)] = ids[0, starts[k] : starts[k] + len(s)]
        return fn(model, pack_rows(rows, [len(s) for s in seqs]))[-1, : len(seqs[-1]) - 1]

    try:
        with torch.no_grad(), core.eval_semantics(model):
            return run(forward, first, second), run(forward, changed, second), run(alone_forward, second)
    finally:
        # NOTE: an FSDP2 root keeps its parameters unsharded after a forward (the backward would need them):
        # resharded here, else an optimizer built next would hold the unsharded tensors, not the shards.
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


def _holds(model: nn.Module, packed: torch.Tensor, other: torch.Tensor, alone: torch.Tensor) -> bool:
    """The probe's verdict: the second sequence untouched by the first, and its own forward's outputs."""
    tol = 1e-4 if next(model.parameters()).dtype == torch.float32 else 5e-2
    return torch.equal(packed, other) and torch.allclose(packed, alone, rtol=tol, atol=tol)
