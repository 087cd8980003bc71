"""The deterministic stand-in for the model arithmetic: everything else in a simulated step is the engine's.

Token ids, log-probs and scores are seeded functions of the sequence (``Oracle``), so every schedule of a
workload must give the same rollouts, which the checks compute directly. The stand-ins still go through
the real pages: each forward first reads back a fingerprint of every token already in the sequence's
cache (a function of the model, the position and the token id, in the first 4 bytes of the token's
layer-0 key slot) and fails if one is wrong -- a page freed while still in use, reused by another
sequence, swapped back wrong or forked wrong -- then writes its new tokens' fingerprints into the slots
the scheduler reserved. A forward's cost (virtual seconds) is drawn from a seeded distribution.

Multi-turn episodes: ``EnvSpec`` is a seeded environment -- how many turns an episode has, what each turn's
observation is, whether a call fails or hangs, and its latency, all functions of the prompt and the turn --
and ``StandInEnv`` runs it on the engine's environment workers, sleeping its latency in virtual time;
``Oracle.episode`` is the transcript the engine must then return.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from oppo_engine.cache import KVCacheManager
from oppo_engine.env.protocol import Observation
from oppo_engine.model.runner import SeqChunk
from oppo_engine.model.scorer import Scorer
from oppo_engine.sched.sequence import Sequence as Seq

from .executor import SimClock

_M = (1 << 64) - 1


class KVCorruption(BaseException):
    """A stand-in forward read a page that does not hold what the sequence wrote there."""


class InjectedFault(RuntimeError):
    """An exception injected into a model forward (one-shot) or raised by a poison prompt (always)."""


def mix(*values: int) -> int:
    """splitmix64 over ``values``: the stand-in's only source of numbers."""
    z = 0x9E3779B97F4A7C15
    for v in values:
        z = (z ^ (v & _M)) * 0xBF58476D1CE4E5B9 & _M
        z = (z ^ (z >> 31)) * 0x94D049BB133111EB & _M
        z ^= z >> 29
    return z


class Oracle:
    """The stand-in's functions of a sequence. A sequence's response stops at EOS after ``target_len``
    tokens (long-tailed: mostly short, a tail up to ``long_len``), unless the engine stops it first."""

    def __init__(self, *, vocab: int, eos: int, mean_len: float, long_len: int, p_long: float) -> None:
        self.vocab, self.eos = vocab, eos
        self.mean_len, self.long_len, self.p_long = mean_len, long_len, p_long

    def target_len(self, seed: int) -> int:
        u = (mix(seed, 1) >> 11) / (1 << 53)
        if u < self.p_long:
            return self.long_len
        v = ((mix(seed, 2) >> 11) + 1) / (1 << 53)
        return 1 + int(-self.mean_len * math.log(v))

    def token(self, seed: int, position: int, prompt_len: int, prev: int) -> int:
        if position - prompt_len + 1 >= self.target_len(seed):
            return self.eos
        t = 4 + mix(seed, position, prev) % (self.vocab - 4)  # never EOS or the low special ids
        return t

    def logprob(self, seed: int, position: int) -> float:
        return -((mix(seed, position, 7) % 4096) / 512.0)

    def reward(self, prompt_ids: Sequence[int], response_ids: Sequence[int]) -> float:
        return (mix(*prompt_ids, 0xABC, *response_ids) % 10_000) / 1000.0

    def per_token(self, field: str, prompt_ids: Sequence[int], response_ids: Sequence[int]) -> list[float]:
        salt = 0xF00 if field == "ref_logprobs" else 0xBEE
        p = len(prompt_ids)
        return [(mix(salt, p + i, t) % 1000) / -100.0 for i, t in enumerate(response_ids)]

    def rollout(self, prompt_ids: list[int], seed: int, max_new_tokens: int, max_model_len: int):
        """The response and log-probs the engine must return for this prompt and seed."""
        response: list[int] = []
        logprobs: list[float] = []
        prev = prompt_ids[-1]
        while True:
            pos = len(prompt_ids) + len(response)
            tok = self.token(seed, pos, len(prompt_ids), prev)
            response.append(tok)
            logprobs.append(self.logprob(seed, pos))
            prev = tok
            if len(response) >= max_new_tokens or pos + 1 >= max_model_len or tok == self.eos:
                return response, logprobs

    def episode(self, prompt_ids: list[int], seed: int, params, max_model_len: int, env: EnvSpec):
        """The transcript the engine must return for a multi-turn episode: ``(response, logprobs,
        action_mask, finish_reason)``, finish reason ``"error"`` when its environment fails or hangs.
        ``params`` are the sequence's ``SamplingParams`` (turns end after ``max_turn_tokens``)."""
        response: list[int] = []
        logprobs: list[float] = []
        mask: list[int] = []
        prev, p = prompt_ids[-1], len(prompt_ids)
        sampled = turn_start = turns = 0
        while True:
            pos = p + len(response)
            tok = self.token(seed, pos, p, prev)
            response.append(tok)
            logprobs.append(self.logprob(seed, pos))
            mask.append(1)
            prev, sampled = tok, sampled + 1
            if tok == self.eos:
                return response, logprobs, mask, "eos"
            if sampled >= params.max_new_tokens:
                return response, logprobs, mask, "length"
            if pos + 1 >= max_model_len:
                return response, logprobs, mask, "max_model_len"
            if len(response) - turn_start < params.max_turn_tokens:
                continue
            turns += 1
            if params.max_turns is not None and turns >= params.max_turns:
                return response, logprobs, mask, "max_turns"
            if env.fails(prompt_ids, turns) or env.hangs(prompt_ids, turns):
                return response, logprobs, mask, "error"
            obs = env.observation(prompt_ids, turns)
            if p + len(response) + len(obs.tokens) > max_model_len:
                return response, logprobs, mask, "max_model_len"
            response += obs.tokens
            logprobs += [0.0] * len(obs.tokens)
            mask += [0] * len(obs.tokens)
            if obs.done:
                return response, logprobs, mask, "env_done"
            if p + len(response) >= max_model_len:
                return response, logprobs, mask, "max_model_len"
            turn_start, prev = len(response), response[-1]


@dataclass(frozen=True, slots=True)
class EnvSpec:
    """A seeded environment: an episode of ``turns`` (1 to ``max_turns``) turns, each answered with up to
    ``max_obs`` tokens (the last, done, possibly none) after a latency of mean ``latency`` virtual seconds
    (exponential, capped at ``max_latency``); a call fails with probability ``p_fail`` and hangs for
    ``hang_s`` with ``p_hang``. Every draw is a function of the seed, the prompt and the turn, never of the
    schedule. NOTE: the engine's ``env_timeout_s`` must lie far between ``max_latency`` and ``hang_s``:
    whether a call a little past the timeout expires depends on when the actor looks, a schedule's choice."""

    seed: int
    vocab: int
    max_turns: int
    max_obs: int
    latency: float
    p_fail: float
    p_hang: float
    max_latency: float = 1.0
    hang_s: float = 1e6

    def _u(self, prompt_ids, turn: int, salt: int) -> float:
        return (mix(self.seed, salt, turn, *prompt_ids) >> 11) / (1 << 53)

    def turns(self, prompt_ids) -> int:
        return 1 + int(self._u(prompt_ids, 0, 11) * self.max_turns)

    def fails(self, prompt_ids, turn: int) -> bool:
        return self._u(prompt_ids, turn, 12) < self.p_fail

    def hangs(self, prompt_ids, turn: int) -> bool:
        return not self.fails(prompt_ids, turn) and self._u(prompt_ids, turn, 13) < self.p_hang

    def delay(self, prompt_ids, turn: int) -> float:
        if self.hangs(prompt_ids, turn):
            return self.hang_s
        return min(self.max_latency, self.latency * -math.log(1.0 - self._u(prompt_ids, turn, 14)))

    def observation(self, prompt_ids, turn: int) -> Observation:
        done = turn >= self.turns(prompt_ids)
        n = int(self._u(prompt_ids, turn, 15) * (self.max_obs + 1))
        if not done:
            n = max(n, 1) if self.max_obs else 0
        tokens = [4 + mix(self.seed, 16, turn, i, *prompt_ids) % (self.vocab - 4) for i in range(n)]
        return Observation(tokens, done=done)


class StandInEnv:
    """``EnvSpec`` as an engine environment, one per sequence: ``step`` sleeps the call's latency on the
    executor (virtual time, on the worker's own lane), then fails, or answers."""

    def __init__(self, spec: EnvSpec, executor) -> None:
        self.spec, self.executor = spec, executor
        self.prompt: list[int] | None = None
        self.turn = 0

    def reset(self, prompt_ids: list[int]) -> None:
        if self.prompt is not None:
            raise AssertionError("StandInEnv: reset twice (a fresh environment is made for a restart)")
        self.prompt = list(prompt_ids)

    def step(self, turn_ids: list[int]) -> Observation:
        if self.prompt is None:
            raise AssertionError("StandInEnv: step before reset")
        self.turn += 1
        self.executor.sleep(self.spec.delay(self.prompt, self.turn))
        if self.spec.fails(self.prompt, self.turn):
            raise InjectedFault(f"environment of prompt {self.prompt[:4]} failed on turn {self.turn}")
        return self.spec.observation(self.prompt, self.turn)


class PageIO:
    """Reads and writes the fingerprints of one model's tokens in the real arena."""

    def __init__(self, cache: KVCacheManager, tag: int) -> None:
        self.cache, self.tag = cache, tag
        spec = cache.arena.specs[cache.name]
        assert spec.dtype.itemsize == 4, "the stand-in writes int32 fingerprints into fp32 KV"
        self.token_ints = spec.num_kv_heads * spec.head_dim  # layer 0, key, one token
        self.ps = cache.page_size
        self._page_ints = cache.arena.page_bytes // 4
        self._salt = tag * 104_729

    def _ints(self) -> np.ndarray:
        return self.cache.arena.buffer.view(torch.int32).numpy()

    def _fp(self, positions: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """A nonzero int32 of (model, position, token)."""
        return ((positions * 1_000_003 + tokens * 7_919 + self._salt) % 2_147_483_629 + 1).astype(np.int32)

    def _index(self, slots: np.ndarray) -> np.ndarray:
        pages, offsets = np.divmod(slots, self.ps)
        return pages * self._page_ints + offsets * self.token_ints

    def check(self, seq: Seq, upto: int, who: str) -> None:
        """Tokens ``[0, upto)`` of ``seq`` hold their fingerprints in this model's pages."""
        if upto <= 0:
            return
        pages = self.cache.pages(seq.seq_id)
        if len(pages) * self.ps < upto:
            raise KVCorruption(f"{who}: seq {seq.seq_id} has {len(pages)} pages for {upto} cached tokens")
        t = np.arange(upto)
        slots = np.asarray(pages, dtype=np.int64)[t // self.ps] * self.ps + t % self.ps
        got = self._ints()[self._index(slots)]
        want = self._fp(t, np.asarray(seq.token_slice(0, upto), dtype=np.int64))
        bad = np.flatnonzero(got != want)
        if bad.size:
            raise KVCorruption(
                f"{who}: seq {seq.seq_id} token {int(bad[0])} of {upto}: page "
                f"{pages[int(bad[0]) // self.ps]} does not hold what the sequence wrote"
            )

    def write(self, chunk: SeqChunk, start: int) -> None:
        slots = np.asarray(chunk.slots, dtype=np.int64)
        keep = slots >= 0
        pos = np.arange(start, start + len(chunk.token_ids))[keep]
        toks = np.asarray(chunk.token_ids, dtype=np.int64)[keep]
        self._ints()[self._index(slots[keep])] = self._fp(pos, toks)


class Costs:
    """Seeded forward costs (virtual seconds): a fixed part plus a per-token part, log-normal noise."""

    def __init__(self, rng: random.Random, fixed: float, per_token: float) -> None:
        self.rng, self.fixed, self.per_token = rng, fixed, per_token

    def __call__(self, tokens: int) -> float:
        return (self.fixed + self.per_token * tokens) * self.rng.lognormvariate(0.0, 0.5)


class Faults:
    """Failures injected into model forwards: a one-shot ``InjectedFault`` at forward ``fail_at`` (counted
    over all models), and a poison prompt whose every forward fails in one model (``poison_role``) or in
    every model (``"every"``: with streamed scoring which model meets it first depends on the schedule; the
    quarantine compares the exception type only, so it is pinned all the same)."""

    def __init__(self) -> None:
        self.forwards = 0
        self.fail_at: int | None = None
        self.poison_prompt: int | None = None
        self.poison_role = "actor"
        self.injected = 0

    def forward(self, who: str, seqs: Sequence[Seq]) -> None:
        self.forwards += 1
        if self.forwards == self.fail_at:
            self.fail_at = None
            self.injected += 1
            raise InjectedFault(f"injected into {who} forward {self.forwards}")
        poisoned = self.poison_prompt is not None and self.poison_role in (who, "every")
        if poisoned and any(s.prompt_index == self.poison_prompt for s in seqs):
            raise InjectedFault(f"poison prompt {self.poison_prompt} in {who}")


def describe(chunks: Sequence[SeqChunk], cache: KVCacheManager) -> str:
    """``seq:start+n`` for each chunk of a forward."""
    parts = []
    for c in chunks:
        end = cache.num_tokens(c.seq_id)
        parts.append(f"{c.seq_id}:{end - len(c.token_ids)}+{len(c.token_ids)}")
    return "[" + " ".join(parts) + "]"


class StandInActor:
    """``ActorWorker.forward`` over the real actor pages, with the oracle's tokens."""

    def __init__(
        self,
        oracle: Oracle,
        cache: KVCacheManager,
        seqs: Callable[[], dict[Hashable, Seq]],
        clock: SimClock,
        costs: Costs,
        faults: Faults,
    ) -> None:
        self.oracle, self.io, self.seqs = oracle, PageIO(cache, 1), seqs
        self.note: Callable[[str], None] | None = None
        self.clock, self.costs, self.faults = clock, costs, faults

    def forward(self, chunks: Sequence[SeqChunk], samples) -> tuple[list[int], list[float]]:
        by_id = self.seqs()
        seqs = [by_id[c.seq_id] for c in chunks]
        if self.note is not None:
            self.note(describe(chunks, self.io.cache) + f" free={self.io.cache.num_available_pages()}")
        self.faults.forward("actor", seqs)
        for c, seq in zip(chunks, seqs, strict=True):
            start = self.io.cache.num_tokens(c.seq_id) - len(c.token_ids)
            self.io.check(seq, start, "actor")
            self.io.write(c, start)
        self.clock.advance(self.costs(sum(len(c.token_ids) for c in chunks)))
        tokens, logprobs = [], []
        for row, seed, position in zip(samples.rows, samples.seeds, samples.positions, strict=True):
            c, seq = chunks[row], seqs[row]
            tokens.append(self.oracle.token(seed, position, len(seq.prompt_ids), c.token_ids[-1]))
            logprobs.append(self.oracle.logprob(seed, position))
        return tokens, logprobs


class StandInScorer(Scorer):
    """A streamed scorer (reward, reference or critic) over its real pages, with the oracle's results.

    ``finish`` checks that every token of the sequence is in the scorer's pages, so a result read before
    the last chunk was prefilled fails."""

    def __init__(
        self,
        field: str,
        cache: KVCacheManager,
        tag: int,
        oracle: Oracle,
        seqs: Callable[[], dict[Hashable, Seq]],
        clock: SimClock,
        costs: Costs,
        faults: Faults,
    ) -> None:
        self.field, self.cache, self.io = field, cache, PageIO(cache, tag)
        self.fork_any_point = field != "reward"  # as the real scorers (model/scorer.py)
        self.oracle, self.seqs, self.clock, self.costs, self.faults = oracle, seqs, clock, costs, faults
        self.note: Callable[[str], None] | None = None

    def prefill(self, chunks: Sequence[SeqChunk]) -> None:
        by_id = self.seqs()
        seqs = [by_id[c.seq_id] for c in chunks]
        if self.note is not None:
            self.note(describe(chunks, self.cache))
        self.faults.forward(self.field, seqs)
        for c, seq in zip(chunks, seqs, strict=True):
            start = self.cache.num_tokens(c.seq_id) - len(c.token_ids)
            self.io.check(seq, start, self.field)
            self.io.write(c, start)
        self.clock.advance(self.costs(sum(len(c.token_ids) for c in chunks)))

    def finish(self, seq_id: Hashable, prompt_ids: list[int], response_ids: list[int]):
        seq = self.seqs()[seq_id]
        n = len(prompt_ids) + len(response_ids)
        if self.cache.num_tokens(seq_id) != n:
            raise KVCorruption(
                f"{self.field}: seq {seq_id} read with {self.cache.num_tokens(seq_id)} of {n} tokens "
                "prefilled"
            )
        self.io.check(seq, n, self.field)
        if self.field == "reward":
            return self.oracle.reward(prompt_ids, response_ids)
        return self.oracle.per_token(self.field, prompt_ids, response_ids)
