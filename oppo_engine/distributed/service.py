"""ScorerService: frozen scorers (reward, optional reference) on a rank of their own, serving every other
rank of a group (the paper's 7+1 placement).

The service holds the models, an arena of its own on its own device, and one ``ScorerScheduler`` per model --
the classes a local scorer lane uses. Each client's hand-offs arrive as token ids
(``distributed/protocol.py``); the service mirrors each sequence (its group, sample count and temperature
travel with it) and prefills the chunks of all its clients together, one packed forward per model per round,
as one local scorer lane does for one actor. Its arena preempts and swaps exactly as a local lane's does;
groups share their prompt pages. A client that fails a step aborts: its sequences are dropped here and handed
off again from their first token. A client that closes or dies is dropped the same way; the others are served
on."""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from oppo_engine.cache import KVArena, KVCacheManager, KVSpec
from oppo_engine.cache.arena import fit_page_size, page_bytes_for
from oppo_engine.config import SamplingParams
from oppo_engine.distributed import protocol
from oppo_engine.distributed.transport import (
    ABORT,
    BYE,
    DEFAULT_HEARTBEAT_S,
    DEFAULT_LIVENESS_TIMEOUT_S,
    ERROR,
    HANDOFFS,
    HELLO,
    LOST,
    REFUSE,
    RESULTS,
    SPANS,
    WELCOME,
    GlooTransport,
    Message,
    PeerLost,
    encode_text,
)
from oppo_engine.model.attention import paged_attention_enabled
from oppo_engine.model.roles import REFERENCE, REWARD, device_of, dtype_of
from oppo_engine.model.runner import ModelRunner, SeqChunk, unwrap_model
from oppo_engine.model.scorer import ReferenceScorer, RewardScorer, Scorer
from oppo_engine.model.support import check_model, resolve_max_model_len, text_config
from oppo_engine.model.warmup import warm_up
from oppo_engine.sched.scorer import ScorerScheduler
from oppo_engine.sched.sequence import Sequence

logger = logging.getLogger(__name__)

DEFAULT_SEQUENCES = 256  # max_model_len sequences the default arena holds (capped by memory, as the engine's)
_CUDA_MEMORY_FRACTION = 0.4
_HOST_MEMORY_FRACTION = 0.25
_POLL_S = 0.005


@dataclass(slots=True)
class ServiceStats:
    """What ``serve()`` did: the clients that closed, were lost (rank -> why) or refused (rank -> why);
    forwards run, sequences scored, messages and bytes each way; the arena's pages at the end."""

    closed: list[int] = field(default_factory=list)
    lost: dict[int, str] = field(default_factory=dict)
    refused: dict[int, str] = field(default_factory=dict)
    forwards: int = 0
    sequences_scored: int = 0
    preemptions: int = 0
    recomputed_tokens: int = 0  # prefilled again below a sequence's high-water mark (a client's abort)
    swapped_tokens: int = 0  # brought back from host after a preemption
    messages_received: int = 0
    bytes_received: int = 0
    messages_sent: int = 0
    bytes_sent: int = 0
    total_pages: int = 0
    free_pages: int = 0


@dataclass(slots=True)
class _Client:
    rank: int
    state: str = "waiting"  # waiting (no HELLO yet) | open | refused (until its BYE) | done
    epoch: int = 0
    seqs: dict[int, Sequence] = field(default_factory=dict)  # the client's seq_id -> its mirror here
    groups: dict[int, int] = field(default_factory=dict)  # the client's group id -> the mirrors' group id
    results: list = field(default_factory=list)  # (seq_id, reward, ref_logprobs) to send this round
    spans: list = field(default_factory=list)  # (model, tokens, start_s, end_s) of this round's forwards


class ScorerService:
    """Frozen scorers for every other rank of ``group``: ``reward`` (a one-label HF sequence-classification
    model) and optionally ``reference`` (a causal LM of the same vocabulary), on ``device`` (None: where
    ``reward`` is; the models are moved there otherwise).

    ``kv_cache_bytes`` sizes the service's arena (None: room for ``DEFAULT_SEQUENCES`` sequences of
    ``max_model_len``, capped at the engine's share of memory); ``max_model_len=None`` resolves as in
    ``EngineConfig`` (a client whose resolved value exceeds it is refused at connection, as is one of
    another vocabulary); ``page_size`` as in ``EngineConfig``. ``liveness_timeout_s``: a client silent longer
    than this (heartbeats every ``heartbeat_s``) has died. Bad models raise ``ValueError`` here, before any
    collective.
    """

    def __init__(
        self,
        reward: nn.Module,
        reference: nn.Module | None = None,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        kv_cache_bytes: int | None = None,
        max_model_len: int | None = None,
        page_size: int = 16,
        *,
        max_num_batched_tokens: int = 4096,
        heartbeat_s: float = DEFAULT_HEARTBEAT_S,
        liveness_timeout_s: float = DEFAULT_LIVENESS_TIMEOUT_S,
    ) -> None:
        if group is None:
            raise ValueError(
                "ScorerService: group= is required (the process group of the service and clients)"
            )
        if group.size() < 2:
            raise ValueError(
                f"ScorerService: group has {group.size()} rank; it needs the service and a client"
            )
        if not isinstance(reward, nn.Module):
            raise ValueError(
                f"reward must be an HF sequence-classification model, got {type(reward).__name__}"
            )
        self.device = torch.device(device) if device is not None else device_of(reward)
        models = {REWARD: reward, **({REFERENCE: reference} if reference is not None else {})}
        self.vocab_size = int(text_config(reward).vocab_size)
        for role, model in models.items():
            if not isinstance(model, nn.Module):
                raise ValueError(f"{role} must be an HF model, got {type(model).__name__}")
            vocab = getattr(text_config(model), "vocab_size", None)
            if vocab != self.vocab_size:
                raise ValueError(
                    f"{role}: its vocabulary has {vocab} tokens, the reward model's {self.vocab_size}: both "
                    "read the clients' token ids"
                )
            if device_of(model) != self.device:
                model.to(self.device)
        self.max_model_len = resolve_max_model_len(max_model_len, models)
        for role, model in models.items():
            check_model(model, role=role, max_model_len=self.max_model_len)
        self.models = models
        self.group = group
        self.has_reference = reference is not None
        self.max_num_batched_tokens = max_num_batched_tokens
        self.heartbeat_s, self.liveness_timeout_s = heartbeat_s, liveness_timeout_s
        specs = {name: KVSpec.from_hf_config(m.config, dtype_of(m)) for name, m in models.items()}
        page_bytes = page_bytes_for(specs, page_size)
        per_seq = {n: -(-self.max_model_len // fit_page_size(s, page_bytes)) for n, s in specs.items()}
        if kv_cache_bytes is not None:
            num_pages = kv_cache_bytes // page_bytes
        else:
            num_pages = min(
                DEFAULT_SEQUENCES * sum(per_seq.values()), _memory_budget(self.device) // page_bytes
            )
        if num_pages < sum(per_seq.values()):
            raise ValueError(
                f"kv_cache_bytes={kv_cache_bytes} gives {num_pages} pages of {page_bytes} bytes, but one "
                f"sequence of max_model_len={self.max_model_len} tokens needs {sum(per_seq.values())} pages "
                f"in the caches of {', '.join(specs)} together; raise kv_cache_bytes or lower max_model_len"
            )
        self.arena = KVArena(specs, page_size=page_size, num_pages=num_pages, device=self.device)
        for name, pages in per_seq.items():
            self.arena.set_reserve(name, pages)
        scorer_classes: dict[str, type[Scorer]] = {REWARD: RewardScorer, REFERENCE: ReferenceScorer}
        self.scheds: dict[str, ScorerScheduler] = {}
        for name, model in models.items():
            runner = ModelRunner(model, KVCacheManager(self.arena, name))
            self.scheds[name] = ScorerScheduler(
                scorer_classes[name](runner), max_num_batched_tokens=max_num_batched_tokens
            )
        if self.device.type == "cuda":  # compile the Triton variants here, not inside serve()'s first rounds
            with torch.cuda.device(self.device):  # (a client counts a long silence as a stall)
                for sched in self.scheds.values():
                    warm_up(sched.scorer.runner, self.max_model_len)
        self.stats = ServiceStats()
        self._clients: dict[int, _Client] = {}
        self._owner: dict[int, tuple[_Client, int]] = {}  # mirror seq_id -> (client, its seq_id)
        self._partial: dict[int, dict[str, object]] = {}  # mirror seq_id -> results read so far
        self._ids = itertools.count()
        self._cond = threading.Condition()
        self._inbox: list[tuple[int, Message]] = []
        self.transport: GlooTransport | None = None

    # ------------------------------------------------------------------ the loop

    def serve(self) -> ServiceStats:
        """Serve every other rank of the group until each has closed its engine, died, or been refused;
        returns what was done. It may be called again, for a new round of clients (a new ``RemoteScorers``
        on each). Collective: every rank of the group forms the transport's gloo group with
        this call (the clients in ``RemoteScorers``)."""
        group = self.group
        peers = [r for r in range(group.size()) if r != group.rank()]
        self.transport = transport = GlooTransport(
            group, peers, heartbeat_s=self.heartbeat_s, liveness_timeout_s=self.liveness_timeout_s
        )
        self._clients = {r: _Client(r) for r in peers}
        self.stats = ServiceStats()
        scheds = self.scheds.values()
        self._counted = [sum(s.num_preemptions for s in scheds), sum(s.recomputed_tokens for s in scheds),
                         sum(s.swapped_tokens for s in scheds)]  # fmt: skip
        with self._cond:
            self._inbox = []
        transport.start(functools.partial(self._on_message, transport))
        try:
            with contextlib.ExitStack() as stack:
                if self.device.type == "cuda":  # Triton launches on the current device, not the tensors'
                    stack.enter_context(torch.cuda.device(self.device))
                for model in self.models.values():
                    stack.enter_context(paged_attention_enabled(unwrap_model(model)))
                stack.enter_context(torch.inference_mode())
                while any(c.state != "done" for c in self._clients.values()):
                    with self._cond:
                        inbox, self._inbox = self._inbox, []
                    for peer, message in inbox:
                        self._handle(self._clients[peer], message)
                    for client in self._clients.values():
                        if client.state != "done" and not transport.alive(client.rank):
                            self._lose(client)
                    if self._round():
                        continue
                    busy = any(s.has_work for s in self.scheds.values())
                    with self._cond:
                        if not self._inbox:
                            self._cond.wait(timeout=_POLL_S if busy else self.heartbeat_s)
        finally:
            transport.shutdown()
        self.arena.reclaim(wait=True)
        self.stats.total_pages = self.arena.num_pages
        self.stats.free_pages = self.arena.num_free_pages()
        self.stats.preemptions = sum(s.num_preemptions for s in self.scheds.values()) - self._counted[0]
        self.stats.recomputed_tokens = (
            sum(s.recomputed_tokens for s in self.scheds.values()) - self._counted[1]
        )
        self.stats.swapped_tokens = sum(s.swapped_tokens for s in self.scheds.values()) - self._counted[2]
        self.stats.messages_sent, self.stats.bytes_sent = transport.messages_sent, transport.bytes_sent
        return self.stats

    def _on_message(self, transport: GlooTransport, peer: int, message: Message) -> None:
        """On a receiving thread: queue the message for the loop (a message of an earlier ``serve()``'s
        transport, say a connection it gave up on breaking now, is dropped)."""
        if transport is not self.transport:
            return
        if message.kind != LOST:
            self.stats.messages_received += 1
            self.stats.bytes_received += message.nbytes
        with self._cond:
            self._inbox.append((peer, message))
            self._cond.notify()

    def _round(self) -> bool:
        """One packed forward per model over every client's available chunks; True if any ran."""
        worked = False
        for sched in self.scheds.values():
            chunks = sched.schedule()
            if not chunks:
                continue
            worked = True
            start = time.perf_counter()
            try:
                sched.scorer.prefill([SeqChunk(c.seq.seq_id, c.token_ids, c.slots) for c in chunks])
            except Exception as e:  # noqa: BLE001 - the clients in this forward are told; the others served on
                logger.exception("scorer service: %s forward failed", sched.scorer.name)
                for client in {
                    id(o[0]): o[0] for c in chunks if (o := self._owner.get(c.seq.seq_id))
                }.values():
                    self._fail(
                        client,
                        f"{sched.scorer.name} forward on the scorer service failed: {type(e).__name__}: {e}",
                    )
                continue
            self.stats.forwards += 1
            span = (protocol.MODELS.index(sched.scorer.name), sum(len(c.token_ids) for c in chunks), start,
                    time.perf_counter())  # fmt: skip
            for client in {id(o[0]): o[0] for c in chunks if (o := self._owner.get(c.seq.seq_id))}.values():
                client.spans.append(span)
            for c in chunks:
                if c.samples:
                    self._completed(c.seq, sched.scorer.name, sched.complete(c.seq))
        for client in self._clients.values():
            if client.spans:  # the forwards beside the client's decode, for its timeline (its profiler)
                ints, floats = protocol.encode_spans(client.epoch, client.spans)
                client.spans = []
                self._send(client, Message(SPANS, ints, floats))
            if client.results:
                ints, floats = protocol.encode_results(client.epoch, client.results)
                client.results = []
                self._send(client, Message(RESULTS, ints, floats))
        return worked

    def _completed(self, mirror: Sequence, name: str, result) -> None:
        partial = self._partial.setdefault(mirror.seq_id, {})
        partial[name] = result
        if len(partial) < len(self.scheds):
            return
        del self._partial[mirror.seq_id]
        client, seq_id = self._owner.pop(mirror.seq_id)
        del client.seqs[seq_id]
        client.results.append((seq_id, float(partial[REWARD]), partial.get(REFERENCE)))
        self.stats.sequences_scored += 1

    # ------------------------------------------------------------------ messages

    def _handle(self, client: _Client, message: Message) -> None:
        if client.state == "done":
            return
        kind = message.kind
        if kind == HELLO:
            self._hello(client, message.ints)
        elif kind == HANDOFFS:
            if message.ints[0] == client.epoch:
                try:
                    self._handoffs(client, message)
                except (KeyError, ValueError, RuntimeError) as e:  # a client out of step: it fails, not us
                    self._fail(client, f"scorer service: bad hand-off from rank {client.rank}: {e!r}")
        elif kind == ABORT:
            self._drop_all(client)
            client.epoch = message.ints[0]
        elif kind == BYE:
            self._drop_all(client)
            if client.state != "refused":
                self.stats.closed.append(client.rank)
            client.state = "done"
            with contextlib.suppress(PeerLost):
                self.transport.send_last(client.rank, Message(BYE))
            self.transport.close(client.rank)
        elif kind == LOST:
            self._lose(client)

    def _hello(self, client: _Client, ints: list[int]) -> None:
        version, vocab, max_len = ints
        reason = None
        if version != protocol.PROTOCOL:
            reason = f"protocol {version}, the scorer service speaks {protocol.PROTOCOL}"
        elif vocab != self.vocab_size:
            reason = (
                f"vocabulary mismatch: the actor's has {vocab} tokens, the scorer service's models "
                f"{self.vocab_size}; they read the actor's token ids"
            )
        elif max_len > self.max_model_len:
            reason = (
                f"max_model_len={max_len} exceeds the scorer service's max_model_len={self.max_model_len}; "
                f"set EngineConfig.max_model_len <= {self.max_model_len} or raise the service's"
            )
        if reason is not None:  # the client answers with BYE, which ends it here
            client.state = "refused"
            self.stats.refused[client.rank] = reason
            self._send(client, Message(REFUSE, encode_text(reason)))
            return
        client.state = "open"
        welcome = [self.vocab_size, self.max_model_len, int(self.has_reference)]
        self._send(client, Message(WELCOME, welcome, [time.perf_counter()]))

    def _handoffs(self, client: _Client, message: Message) -> None:
        for item in protocol.decode_handoffs(message.ints, message.floats):
            if isinstance(item, protocol.AddItem):
                group = client.groups.setdefault(item.group_id, next(self._ids))
                sampling = SamplingParams(temperature=item.temperature, n=item.n)
                mirror = Sequence(next(self._ids), group, item.prompt_ids, sampling, seed=0)
                client.seqs[item.seq_id] = mirror
                self._owner[mirror.seq_id] = (client, item.seq_id)
                for sched in self.scheds.values():
                    sched.add(mirror)
                    sched.hand_off(mirror, mirror.num_tokens, False)  # the prompt: prefilled at once
                continue
            mirror = client.seqs[item.seq_id]
            mirror.response_ids.extend(item.tokens)
            if mirror.num_tokens != item.upto:
                raise RuntimeError(
                    f"scorer service: rank {client.rank} handed off tokens up to {item.upto} of sequence "
                    f"{item.seq_id}, which has {mirror.num_tokens} here"
                )
            for sched in self.scheds.values():
                sched.hand_off(mirror, item.upto, item.final)

    def _send(self, client: _Client, message: Message) -> None:
        try:
            self.transport.send(client.rank, message)
        except PeerLost:
            self._lose(client)

    def _fail(self, client: _Client, why: str) -> None:
        """A forward with ``client``'s chunks failed: its sequences go (it rolls its step back and aborts)."""
        self._drop_all(client)
        self._send(client, Message(ERROR, [client.epoch, *encode_text(why)]))

    def _lose(self, client: _Client) -> None:
        if client.state == "done":
            return
        self._drop_all(client)
        client.state = "done"
        try:
            self.transport.check(client.rank)
            why = "closed its connection"
        except PeerLost as e:
            why = str(e)
        self.stats.lost[client.rank] = why
        logger.warning("scorer service: client %s", why)
        self.transport.close(client.rank)

    def _drop_all(self, client: _Client) -> None:
        """Free every page and state of ``client``'s sequences."""
        for mirror in client.seqs.values():
            for sched in self.scheds.values():
                sched.drop(mirror)
            self._owner.pop(mirror.seq_id, None)
            self._partial.pop(mirror.seq_id, None)
        client.seqs.clear()
        client.groups.clear()
        client.results.clear()
        client.spans.clear()


def _memory_budget(device: torch.device) -> int:
    """Bytes the default arena may take, as the engine's default: of free device memory, or of host memory."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * _CUDA_MEMORY_FRACTION)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * _HOST_MEMORY_FRACTION)
