"""The actor's half of a decode iteration: one packed forward, then sampling of the rows that need it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from oppo_engine.model.runner import ModelRunner, SeqChunk
from oppo_engine.model.sampler import Sampler


@dataclass(frozen=True, slots=True)
class SampleSpec:
    """How to draw the next token after chunk ``row`` of a forward."""

    row: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    position: int  # absolute index of the token being drawn: keys the noise


class ActorWorker:
    """Runs the actor over packed chunks and samples; hands back Python ints and floats.

    This is where tensor contents become host values (one device sync per iteration), so the schedulers
    above work on token ids alone.
    """

    def __init__(self, runner: ModelRunner, sampler: Sampler | None = None) -> None:
        self.runner = runner
        self.sampler = sampler or Sampler()

    def forward(
        self, chunks: Sequence[SeqChunk], specs: Sequence[SampleSpec]
    ) -> tuple[list[int], list[float]]:
        """Prefill/decode ``chunks``; return the token and its log-prob for each of ``specs`` (in order)."""
        logits = self.runner.logits_last(chunks)
        if not specs:
            return [], []
        if len(specs) != len(chunks):
            logits = logits[torch.tensor([s.row for s in specs], device=logits.device)]
        tokens, logprobs = self.sampler(
            logits,
            temperatures=[s.temperature for s in specs],
            top_ks=[s.top_k for s in specs],
            top_ps=[s.top_p for s in specs],
            seeds=[s.seed for s in specs],
            positions=[s.position for s in specs],
        )
        if tokens.is_cuda:  # one device-to-host copy (and sync), not one per tensor
            packed = torch.stack((tokens.double(), logprobs.double())).tolist()
            return [int(t) for t in packed[0]], packed[1]
        return tokens.tolist(), logprobs.tolist()
