"""Batch-invariant sampling: top-k / top-p truncation per row, then Gumbel-max with counter-based noise."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from oppo_engine import ops

# Sorted candidates per row on the fast path: a row whose top-k / top-p set lies within its first
# _TRUNCATE_PREFIX tokens (top_k <= it, or a nucleus of the whole vocabulary that closes inside it) needs a
# top-k selection, not a sort of the whole vocabulary (~7x less work at V = 152K). The width is a constant,
# so which path a row takes depends on that row alone.
_TRUNCATE_PREFIX = 4096


def _truncate_sorted(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Mask to -inf the tokens outside each row's top-k and top-p set (computed on ``logits / T``).

    Every operation is row-local, so a row's result never depends on the other rows of the batch.
    """
    scaled = logits / temperature.clamp_min(1e-6).unsqueeze(1)
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    rank = torch.arange(vocab, device=logits.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, vocab).unsqueeze(1)
    drop = rank >= k
    # float64: the nucleus edge is then exact to ~1e-16 of mass, not to the ~1e-6 of an fp32 running sum,
    # so both truncation paths cut in the same place.
    probs = sorted_logits.double().masked_fill(drop, float("-inf")).softmax(dim=-1)
    # A token stays while the mass before it is < top_p: the smallest set reaching top_p, at least one token.
    # top_p >= 1 cuts nothing (the fp32 running mass can round up to 1 before the last token), as when
    # Sampler skips truncation for a batch without any.
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= (mass_before >= top_p.unsqueeze(1)) & (top_p < 1).unsqueeze(1)
    drop_by_token = torch.zeros_like(drop).scatter(1, order, drop)
    return logits.masked_fill(drop_by_token, float("-inf"))


def _truncate(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    host_top_ks: Sequence[int] | None = None,
) -> torch.Tensor:
    """:func:`_truncate_sorted`, sorting only each row's first ``_TRUNCATE_PREFIX`` tokens where they suffice.

    Same sets (up to float rounding of the nucleus mass, and which of several tokens tied at a cut-off is
    kept, which neither path specifies); rows the prefix cannot settle go through the full sort.
    ``host_top_ks``: ``top_k`` as host values, so that which normalisation a row needs is decided without
    waiting for the device (one sync fewer per forward).
    """
    vocab = logits.shape[-1]
    width = min(vocab, _TRUNCATE_PREFIX)
    scaled = logits / temperature.clamp_min(1e-6).unsqueeze(1)
    prefix, order = scaled.topk(width, dim=-1)  # sorted, descending
    rank = torch.arange(width, device=logits.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, vocab).clamp_max(vocab)
    drop = rank >= k.unsqueeze(1)
    # The top-p mass is relative to the top-k set: all of it lies in the prefix when k <= width; when k is
    # the whole vocabulary, normalise by the whole row. float64 as in _truncate_sorted.
    prefix = prefix.double()
    log_norm = prefix.masked_fill(drop, float("-inf")).logsumexp(dim=-1)
    if host_top_ks is not None:
        beyond = vocab > width and any(t <= 0 or t > width for t in host_top_ks)
    else:
        beyond = bool((k > width).any())
    if beyond:
        log_norm = torch.where(k <= width, log_norm, scaled.double().logsumexp(dim=-1))
    probs = (prefix - log_norm.unsqueeze(1)).exp().masked_fill(drop, 0.0)
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= (mass_before >= top_p.unsqueeze(1)) & (top_p < 1).unsqueeze(1)
    untouched = (k == vocab) & (top_p >= 1)  # rows that ask for no truncation, beside rows that do
    # NOTE: mass_before only grows along the row, so a dropped last prefix token closes the nucleus.
    settled = (k <= width) | untouched | ((k == vocab) & drop[:, -1])
    keep = torch.zeros_like(logits, dtype=torch.bool).scatter(1, order, ~drop) | untouched.unsqueeze(1)
    truncated = logits.masked_fill(~keep, float("-inf"))
    if not bool(settled.all()):
        rest = (~settled).nonzero().squeeze(1)
        truncated[rest] = _truncate_sorted(logits[rest], temperature[rest], top_k[rest], top_p[rest])
    return truncated


@dataclass(slots=True)
class SampleBatch:
    """What to draw after the rows of one forward that sample: one column per parameter, one entry per
    sampled row, as host values (built once per forward from the sequences, no object per row).

    ``packed()`` lays the columns out in one int64 host array, so they reach the device in the forward's own
    metadata copy (``ModelRunner.logits_last_with``) rather than in a copy each.
    """

    rows: list[int]  # the forward's chunk index of each sampled row
    temperatures: list[float]
    top_ks: list[int]
    top_ps: list[float]
    seeds: list[int]
    positions: list[int]  # absolute index of the token being drawn: keys the noise

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def truncates(self) -> bool:
        """Some row asks for top-k or top-p truncation."""
        return any(k > 0 for k in self.top_ks) or any(p < 1.0 for p in self.top_ps)

    def packed(self) -> np.ndarray:
        """int64 ``[5N]``: rows | seeds | positions | top_k | temperature and top_p as float32 bits."""
        n = len(self.rows)
        out = np.empty(5 * n, dtype=np.int64)
        out[: 4 * n] = self.rows + self.seeds + self.positions + self.top_ks
        floats = out[4 * n :].view(np.float32)
        floats[:n], floats[n:] = self.temperatures, self.top_ps
        return out


def unpack(packed: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    """Views of :meth:`SampleBatch.packed` on the device: (rows, seeds, positions, top_k) int64 ``[n]``,
    (temperature, top_p) float32 ``[n]``."""
    floats = packed[4 * n : 5 * n].view(torch.float32)
    return packed[:n], packed[n : 2 * n], packed[2 * n : 3 * n], packed[3 * n : 4 * n], floats[:n], floats[n:]


class Sampler:
    """Samples one token per row of ``logits [N, V]`` and returns its behaviour log-prob.

    ``temperature == 0`` is greedy (log-prob of the unscaled logits). Otherwise the token is drawn from
    ``softmax(truncated_logits / T)`` with noise keyed by (seed, position), and the log-prob is that of the
    truncated, tempered distribution -- the one PPO must see as the behaviour policy.
    """

    def __call__(
        self,
        logits: torch.Tensor,
        *,
        temperatures: Sequence[float],
        top_ks: Sequence[int],
        top_ps: Sequence[float],
        seeds: Sequence[int],
        positions: Sequence[int],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens ``[N]`` int64 and their log-probs ``[N]`` float32 for the rows of ``logits``."""
        batch = SampleBatch(
            list(range(logits.shape[0])), list(temperatures), list(top_ks), list(top_ps), list(seeds),
            list(positions),
        )  # fmt: skip
        return self.sample(logits, batch, torch.from_numpy(batch.packed()).to(logits.device))

    def sample(
        self, logits: torch.Tensor, batch: SampleBatch, packed: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens and log-probs for ``batch`` over the rows of ``logits [len(batch), V]``, its parameters read
        from ``packed`` (``batch.packed()`` already on the device: no host-to-device copy here)."""
        _, seeds, positions, top_k, temperature, top_p = unpack(packed, len(batch))
        if batch.truncates:
            truncated = _truncate(logits.float(), temperature, top_k, top_p, batch.top_ks)
            # Greedy rows keep their unscaled logits: argmax and its log-prob are unaffected by truncation.
            logits = torch.where((temperature > 0).unsqueeze(1), truncated, logits.float())
        return ops.sample(logits, temperature, seeds, positions)
