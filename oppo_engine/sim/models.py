"""The twin's models: tiny HF models that shape the engine's caches like the real ones, and the stand-ins
that replace their forwards with the cost model's time.

The engine is built with tiny models whose KV per token keeps the real models' ratios, so every model gets
the page size (tokens per page) it would get with the real ones, in an arena of the target device's page
count (a few bytes per page here). Their weights never run: :class:`TwinActor` and :class:`TwinScorer`
take the forwards, price each with the cost model, run the price on the lane's device in virtual time, and
answer -- the actor with EOS once a sequence reaches the length its prompt draws, the scorers with zeros.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence

import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, Qwen2Config

from oppo_engine.cache.arena import KVSpec, fit_page_size, page_bytes_for
from oppo_engine.model.roles import ACTOR, CRITIC, REFERENCE, REWARD
from oppo_engine.model.runner import SeqChunk
from oppo_engine.model.scorer import Scorer
from oppo_engine.sim.cost import Batch, CostModel
from oppo_engine.sim.shapes import ModelShape

VOCAB = 64
EOS = 3
PAD = 0
TOKEN = 7  # every token the stand-in actor emits that is not EOS
FIELDS = {REWARD: "reward", REFERENCE: "ref_logprobs", CRITIC: "values"}


def _real_spec(shape: ModelShape) -> KVSpec:
    dtype = {2: torch.bfloat16, 4: torch.float32}.get(shape.dtype_bytes, torch.bfloat16)
    return KVSpec(shape.layers, shape.kv_heads, shape.head_dim, dtype)


def page_plan(shapes: dict[str, ModelShape], page_size: int) -> tuple[int, dict[str, int]]:
    """The real models' page bytes and tokens per page of each (what the engine would give them)."""
    specs = {role: _real_spec(s) for role, s in shapes.items()}
    page_bytes = page_bytes_for(specs, page_size)
    return page_bytes, {role: fit_page_size(spec, page_bytes) for role, spec in specs.items()}


@functools.cache
def _tiny(role: str, head_dim: int, max_len: int) -> torch.nn.Module:
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=head_dim, intermediate_size=4, num_hidden_layers=1,
        num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=max_len,
        tie_word_embeddings=False, eos_token_id=EOS, pad_token_id=PAD,
    )  # fmt: skip
    torch.manual_seed(0)
    if role in (REWARD, CRITIC):
        config.num_labels = 1
        return AutoModelForSequenceClassification.from_config(config, dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def tiny_models(shapes: dict[str, ModelShape], page_size: int, max_len: int) -> dict[str, torch.nn.Module]:
    """Tiny models by role whose pages hold as many tokens as the real ``shapes``' would (fp32, one layer,
    one KV head of a power-of-two width: a token's KV is the real one's over a common power of two)."""
    _, tokens = page_plan(shapes, page_size)
    spread = max(t.bit_length() - page_size.bit_length() for t in tokens.values())
    # The widest model's page (page_size tokens of 8 bytes per unit of width) must be a whole number of
    # the arena's 256-byte alignment, or every page would hold more tokens than the real one.
    base = max(2, 32 // page_size)
    models = {}
    for role, t in tokens.items():
        doublings = t.bit_length() - page_size.bit_length()
        models[role] = _tiny(role, base << (spread - doublings), max_len)
    tiny_specs = {role: KVSpec.from_hf_config(m.config, m.dtype) for role, m in models.items()}
    tiny_bytes = page_bytes_for(tiny_specs, page_size)
    got = {role: fit_page_size(spec, tiny_bytes) for role, spec in tiny_specs.items()}
    assert got == tokens, f"tiny models' pages {got} differ from the real ones' {tokens}"
    return models


def tiny_page_bytes(models: dict[str, torch.nn.Module], page_size: int) -> int:
    return page_bytes_for({r: KVSpec.from_hf_config(m.config, m.dtype) for r, m in models.items()}, page_size)


def response_rows(chunk: SeqChunk, end: int, prompt_len: int) -> int:
    """Rows of ``chunk`` (ending at token ``end``) from position ``prompt_len - 1`` on: the rows a per-token
    scorer reads."""
    return max(0, end - max(end - len(chunk.token_ids), prompt_len - 1))


class TwinActor:
    """``ActorWorker.forward`` in virtual time: the forward's price runs on the lane's device; each sampled
    row gets EOS once its sequence's response reaches ``target(seq)`` tokens. With a ``stride``
    (:class:`~oppo_engine.sim.stride.DecodeStride`), a decode forward is followed by as many more as can run
    before the engine's loop would do anything else (``sim/stride.py``). ``switched(work, threads,
    charge=True)``: the forward's price given the other models' forwards on its device since its last (the
    world's ``_switch``, which the stride's forwards go through too); the repacking is passed with
    ``charge=False``: the actor's start, not priced so."""

    def __init__(
        self,
        shape: ModelShape,
        cost: CostModel,
        cache,
        seqs: Callable[[], dict[Hashable, object]],
        target: Callable[[object], int],
        run: Callable,
        *,
        captured: bool,
        threads: Callable[[], int],
        stride=None,
        packed: bool = False,
        switched: Callable | None = None,
    ) -> None:
        self.shape, self.cost, self.cache, self.seqs = shape, cost, cache, seqs
        self.target, self.run, self.captured, self.threads = target, run, captured, threads
        self.stride, self.packed, self.switched = stride, packed, switched
        self.stale = packed  # the packs are made at the first forward, and again after each weight update

    def weights_updated(self) -> None:
        """The policy's weights changed (``update_policy()``): the engine drops the actor's packs, and its
        next forward packs them again (``CostModel.repack``)."""
        self.stale = self.packed

    def price(self, batch: Batch, captured: bool, threads: int):
        """A forward's :class:`~oppo_engine.sim.cost.Work` over ``batch`` (with the actor's weights packed
        where the engine packs them: ``packed``)."""
        return self.cost.forward(
            self.shape, batch, captured=captured, threads=threads, packed=self.packed, actor=True
        )

    def forward(self, chunks: Sequence[SeqChunk], samples) -> tuple[list[int], list[float]]:
        counts = self.cache.token_counts([c.seq_id for c in chunks])
        batch = Batch(tuple((len(c.token_ids), n) for c, n in zip(chunks, counts, strict=True)),
                      len(chunks), len(samples))  # fmt: skip
        decode = all(len(c.token_ids) == 1 for c in chunks)
        captured, threads = self.captured and decode, self.threads()
        stride = self.stride
        if self.stale:
            self.stale = False
            repack = self.cost.repack(self.shape, threads)
            self.run(repack if self.switched is None else self.switched(repack, threads, charge=False))
        work = self.price(batch, captured, threads)
        self.run(work if self.switched is None else self.switched(work, threads))
        by_id = self.seqs()
        extra = 0
        if stride is not None and decode and len(samples.rows) == len(chunks):
            seqs = [by_id[c.seq_id] for c in chunks]
            targets = [self.target(seq) for seq in seqs]
            extra = stride.extend(seqs, counts, samples.positions, targets, captured, threads)
        tokens = []
        for row, position in zip(samples.rows, samples.positions, strict=True):
            seq = by_id[chunks[row].seq_id]
            done = position + extra - len(seq.prompt_ids) + 1 >= self.target(seq)
            tokens.append(EOS if done else TOKEN)
        return tokens, [-1.0] * len(tokens)


class TwinScorer(Scorer):
    """A streamed scorer in virtual time: ``run(role, batch)`` runs each prefill's price on its device (or
    the scorer service); the results are zeros of the right length."""

    def __init__(self, role: str, cache, run: Callable[[str, Batch], None]) -> None:
        self.role, self.field, self.cache, self.run = role, FIELDS[role], cache, run
        self._prompt_lens: dict[Hashable, int] = {}

    def begin(self, seq_id: Hashable, prompt_len: int, temperature: float) -> None:
        self._prompt_lens[seq_id] = prompt_len

    def batch(self, chunks: Sequence[SeqChunk]) -> Batch:
        """The forward's composition: its chunks, and the rows its head reads (the reward's one per chunk,
        the per-token scorers' response rows)."""
        ends = self.cache.token_counts([c.seq_id for c in chunks])
        pairs = tuple((len(c.token_ids), e) for c, e in zip(chunks, ends, strict=True))
        if self.role == REWARD:
            rows = len(chunks)
        else:
            prompt = self._prompt_lens
            rows = sum(
                response_rows(c, e, prompt.get(c.seq_id, 1)) for c, e in zip(chunks, ends, strict=True)
            )
        return Batch(pairs, rows)

    def prefill(self, chunks: Sequence[SeqChunk]) -> None:
        self.run(self.role, self.batch(chunks))

    def finish(self, seq_id: Hashable, prompt_ids: list[int], response_ids: list[int]):
        return 0.0 if self.role == REWARD else [0.0] * len(response_ids)

    def release(self, seq_id: Hashable) -> None:
        super().release(seq_id)
        self._prompt_lens.pop(seq_id, None)


ROLES = (ACTOR, REWARD, REFERENCE, CRITIC)
