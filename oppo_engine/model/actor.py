"""The actor's half of a decode iteration: one packed forward, then sampling of the rows that need it."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from oppo_engine.model.finite import check_finite
from oppo_engine.model.runner import ModelRunner, SeqChunk
from oppo_engine.model.sampler import SampleBatch, Sampler


class ActorWorker:
    """Runs the actor over packed chunks and samples; hands back Python ints and floats.

    This is where tensor contents become host values (one device sync per iteration), so the schedulers
    above work on token ids alone. A row whose logits are not finite has a non-finite log-prob: it fails its
    sequence (``model/finite.py``). Per forward, the sampling parameters reach the device with the forward's
    metadata (one host-to-device copy for both), and tokens and log-probs come back in one copy.
    """

    def __init__(self, runner: ModelRunner, sampler: Sampler | None = None) -> None:
        self.runner = runner
        self.sampler = sampler or Sampler()
        self._host_out: torch.Tensor | None = None  # pinned float64 staging of the results (CUDA), flat

    def forward(self, chunks: Sequence[SeqChunk], batch: SampleBatch) -> tuple[list[int], list[float]]:
        """Prefill/decode ``chunks``; the token and its log-prob for each row of ``batch``, in order."""
        if not len(batch):
            self.runner.logits_last(chunks)
            return [], []
        # Logits in the model's dtype: ops.sample reads fp32, bf16 and fp16, widening each logit exactly.
        logits, packed = self.runner.logits_last_with(chunks, batch.packed(), float32=False)
        if len(batch) != len(chunks):
            logits = logits.index_select(0, packed[: len(batch)])
        tokens, logprobs = self.sampler.sample(logits, batch, packed)
        if not tokens.is_cuda:
            return tokens.tolist(), self._checked(logprobs.tolist(), chunks, batch)
        # One non-blocking device-to-host copy of both into pinned memory, then one wait for it.
        out = torch.stack((tokens.double(), logprobs.double()))
        host = self._host_out
        if host is None or host.numel() < out.numel():
            host = self._host_out = torch.empty(max(out.numel(), 128), dtype=torch.float64, pin_memory=True)
        # A contiguous prefix of the pinned buffer: a strided destination would make copy_ stage it through
        # pageable memory (a synchronous copy).
        staged = host[: out.numel()].view(out.shape)
        staged.copy_(out, non_blocking=True)
        torch.cuda.current_stream(out.device).synchronize()
        packed_host = staged.tolist()
        return [int(t) for t in packed_host[0]], self._checked(packed_host[1], chunks, batch)

    @staticmethod
    def _checked(logprobs: list[float], chunks: Sequence[SeqChunk], batch: SampleBatch) -> list[float]:
        check_finite("actor", "logits", logprobs, [chunks[r].seq_id for r in batch.rows], batch.positions)
        return logprobs
