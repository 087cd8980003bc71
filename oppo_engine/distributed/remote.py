"""The actor rank's side of remote scorers: ``RemoteScorers`` (passed as ``reward=``) and the lane it gives
the engine, a ``ScorerLane`` whose reward (and reference) results come from a ``ScorerService`` on another
rank.

The step loop does not change: the lane offers what the local one does (add, hand off, check, finish, pause,
abort, rescore). Hand-offs go to the service as token ids, batched per round of the lane's worker (one
message for every hand-off the actor made meanwhile); results come back on the transport's receiving
thread and are read by the worker, as a local scorer's would be. A local critic stays on this lane, beside
the trainer that updates it. Carried sequences keep their remote KV and progress across steps (nothing is
sent at a step's cut); ``abort`` (a failed step) drops this client's sequences on the service (an epoch
keeps any result of before from landing after), and they are handed off again from their first token, as
a local lane prefills them again.
"""

from __future__ import annotations

import threading
import time

import torch.distributed as dist

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
    decode_text,
)
from oppo_engine.model.scorer import Scorer
from oppo_engine.sched.lanes import ScorerLane, _HandOff
from oppo_engine.sched.quarantine import model_call
from oppo_engine.sched.sequence import Sequence

_BYE_WAIT_S = 10.0


class ScorerServiceLost(RuntimeError):
    """The scorer service rank closed its connection or went silent past the liveness timeout."""


class RemoteScorerError(RuntimeError):
    """A forward on the scorer service failed over this client's chunks (the step rolls back and retries)."""


class _Field:
    """A remote result's ``Rollout`` field, in the shape ``ScorerLane._completed`` reads of a scorer."""

    def __init__(self, name: str) -> None:
        self.field = name


_REWARD, _REFERENCE = _Field("reward"), _Field("ref_logprobs")


class RemoteScorers:
    """Frozen scorers on rank ``service_rank`` of ``group`` (a rank running ``ScorerService.serve()``), for
    ``RolloutEngine(reward=RemoteScorers(...))`` on an actor rank. Ranks are ``group``'s own.

    Construction is collective: every rank of ``group`` forms the transport's gloo group (the service in
    ``serve()``), so build it on every client rank. A ``service_rank`` outside the group, or this rank's
    own, raises ``ValueError`` at once, before any collective. The engine connects when it is built: a
    vocabulary other than the service's, a resolved ``max_model_len`` larger than the service's, or a local
    ``reference=`` while the service holds one is refused then with a ``ValueError`` naming it. One engine
    per ``RemoteScorers``; the engine's ``close()`` closes it (call ``close()`` yourself if no engine was
    built). A service silent longer than ``liveness_timeout_s`` (or whose connection breaks) fails the step
    in flight with ``ScorerServiceLost`` naming its rank; the step rolls back.
    """

    def __init__(
        self,
        service_rank: int,
        group: dist.ProcessGroup | None = None,
        *,
        heartbeat_s: float = DEFAULT_HEARTBEAT_S,
        liveness_timeout_s: float = DEFAULT_LIVENESS_TIMEOUT_S,
    ) -> None:
        if group is None:
            raise ValueError(
                "RemoteScorers: group= is required (the process group of the service and clients)"
            )
        size, rank = group.size(), group.rank()
        if (
            isinstance(service_rank, bool)
            or not isinstance(service_rank, int)
            or not 0 <= service_rank < size
        ):
            raise ValueError(
                f"RemoteScorers: service_rank={service_rank!r} is not a rank of the group "
                f"(ranks 0..{size - 1})"
            )
        if service_rank == rank:
            raise ValueError(
                f"RemoteScorers: service_rank={service_rank} is this rank; the service runs "
                "ScorerService.serve() on a rank of its own"
            )
        self.service_rank = service_rank
        self.liveness_timeout_s = liveness_timeout_s
        self.has_reference: bool | None = None  # known once connected
        self.max_model_len: int | None = None
        self._cond = threading.Condition()
        self._reply: Message | None = None
        self._reply_at = 0.0  # time.perf_counter() when the reply came
        # The service's time.perf_counter() less this process's (the middle of the handshake's round trip,
        # so within half of it): the service's forwards go on this engine's timeline in its own clock.
        self.clock_offset_s = 0.0
        self._bye = threading.Event()
        self._lane: RemoteScorerLane | None = None
        self._state = "new"  # new | open | closed
        self.transport = GlooTransport(
            group, [service_rank], heartbeat_s=heartbeat_s, liveness_timeout_s=liveness_timeout_s
        )
        self.transport.start(self._on_message)

    @property
    def fields(self) -> list[_Field]:
        """The ``Rollout`` fields the service fills."""
        return [_REWARD, _REFERENCE] if self.has_reference else [_REWARD]

    def connect(self, *, vocab_size: int, max_model_len: int, local_reference: bool) -> None:
        """Handshake with the service (the engine calls it once); ``ValueError`` naming what it refuses."""
        if self._state != "new":
            raise RuntimeError(
                f"RemoteScorers: already {'used by an engine' if self._state == 'open' else 'closed'}"
            )
        sent_at = time.perf_counter()
        self._send(Message(HELLO, [protocol.PROTOCOL, vocab_size, max_model_len]))
        reply = self._wait_reply()
        if reply.kind == REFUSE:
            self.close()
            raise ValueError(
                f"scorer service rank {self.service_rank} refused this engine: {decode_text(reply.ints)}"
            )
        _, self.max_model_len, has_reference = reply.ints
        self.clock_offset_s = reply.floats[0] - (sent_at + self._reply_at) / 2
        self.has_reference = bool(has_reference)
        self._state = "open"
        if local_reference and self.has_reference:
            self.close()
            raise ValueError(
                f"reference: the scorer service rank {self.service_rank} holds a reference model already; "
                "pass reference=None here (its ref_logprobs come from the service)"
            )

    def lane(self, scorers: list[Scorer], **lane_args) -> RemoteScorerLane:
        """The engine's scorer lane: ``scorers`` (a local critic) run here, the service's results join
        them."""
        self._lane = RemoteScorerLane(self, scorers, **lane_args)
        return self._lane

    def check(self) -> None:
        """Raise ``ScorerServiceLost`` if the service has failed."""
        try:
            self.transport.check(self.service_rank)
        except PeerLost as e:
            raise ScorerServiceLost(f"scorer service {e}") from None

    def send(self, message: Message) -> None:
        """Send to the service; ``ScorerServiceLost`` if it has failed."""
        if self._state == "closed":
            raise RuntimeError("RemoteScorers: closed")
        self._send(message)

    def _send(self, message: Message) -> None:
        try:
            self.transport.send(self.service_rank, message)
        except PeerLost as e:
            raise ScorerServiceLost(f"scorer service {e}") from None

    def close(self) -> None:
        """Say goodbye to the service (it frees this client's pages) and stop. Idempotent; never raises."""
        if self._state == "closed":
            return
        self._state = "closed"
        if self.transport.alive(self.service_rank):
            try:
                self.transport.send_last(self.service_rank, Message(BYE))
                deadline = time.monotonic() + _BYE_WAIT_S
                while not self._bye.wait(0.05):
                    if time.monotonic() > deadline or not self.transport.alive(self.service_rank):
                        break
            except PeerLost:
                pass
        self.transport.close(self.service_rank)
        self.transport.shutdown()

    def _wait_reply(self) -> Message:
        with self._cond:
            while self._reply is None:
                self.check()
                self._cond.wait(timeout=0.1)
            reply, self._reply = self._reply, None
            return reply

    def _on_message(self, peer: int, message: Message) -> None:
        """On the receiving thread."""
        kind = message.kind
        if kind in (WELCOME, REFUSE):
            with self._cond:
                self._reply, self._reply_at = message, time.perf_counter()
                self._cond.notify_all()
        elif kind in (RESULTS, ERROR) and self._lane is not None:
            self._lane.on_service_message(message)
        elif kind == SPANS and self._lane is not None:
            self._lane.on_service_spans(message)
        elif kind == BYE:
            self._bye.set()
        elif kind == LOST:
            with self._cond:
                self._cond.notify_all()
            if self._lane is not None:
                self._lane.wake()


class RemoteScorerLane(ScorerLane):
    """``ScorerLane`` whose reward (and reference) are scored by the service (see the module docstring)."""

    def __init__(self, remote: RemoteScorers, scorers: list[Scorer], **lane_args) -> None:
        super().__init__(scorers, **lane_args)
        self.remote = remote
        # The service may be slow, not stuck: its liveness is the transport's, so the lane's stall check
        # waits as long as the liveness timeout.
        self.stall_s = max(self.stall_s, remote.liveness_timeout_s)
        self._epoch = 0
        self._sent: dict[int, int] = {}  # seq_id -> tokens the service has
        self._remote_seqs: dict[int, Sequence] = {}  # seq_id -> the sequence, while the service scores it
        self._results: list[tuple[int, list]] = []  # (epoch, [(seq_id, reward, ref)]) to read
        self._service_error: str | None = None
        self.messages_sent = 0
        self.bytes_sent = 0

    # -- the actor thread's side -----------------------------------------------------------------------

    def check(self) -> None:
        """Raise the lane's exception, if it has one, or ``ScorerServiceLost`` if the service has failed."""
        super().check()
        self.remote.check()

    def abort(self) -> None:
        """As ``ScorerLane.abort``, and the service drops this client's sequences (if it is still there)."""
        super().abort()
        with self._cond:
            self._epoch += 1
            self._results.clear()
            self._service_error = None
        self._sent.clear()
        self._remote_seqs.clear()
        try:
            self.remote.send(Message(ABORT, [self._epoch]))
        except (ScorerServiceLost, RuntimeError):
            pass  # a service that is gone holds nothing of ours

    # -- the receiving thread's side -------------------------------------------------------------------

    def on_service_message(self, message: Message) -> None:
        """Results or a service-side failure, queued for the worker (stale epochs dropped)."""
        with self._cond:
            if message.ints[0] != self._epoch:
                return
            if message.kind == RESULTS:
                self._results.append(list(protocol.decode_results(message.ints, message.floats)))
            else:
                self._service_error = decode_text(message.ints[1:])
            self._cond.notify()

    def on_service_spans(self, message: Message) -> None:
        """The service's forwards that held this client's chunks, recorded on this engine's timeline as a
        local lane's prefills are (lane ``reward`` / ``reference``, in this process's clock): the switch-cost
        profiler measures the actor's decode beside them. ``tokens``: the forward's, every client's (what
        its duration grew with). Stale epochs dropped."""
        with self._cond:
            if message.ints[0] != self._epoch:
                return
        offset = self.remote.clock_offset_s
        for name, tokens, start, end in protocol.decode_spans(message.ints, message.floats):
            self.timeline.record(name, "prefill", start - offset, end - offset, tokens=tokens, remote=True)

    def wake(self) -> None:
        """Wake the worker (the service's connection broke: its next round raises)."""
        with self._cond:
            self._cond.notify()

    # -- the lane's own side ---------------------------------------------------------------------------

    def _take(self, inbox: list[_HandOff]) -> None:
        ints, floats = [self._epoch], []
        remote = len(self.remote.fields)
        for h in inbox:
            seq = h.seq
            if seq.seq_id not in self._pending:
                self._pending[seq.seq_id] = len(self.scorers) + remote
                for sched in self.scheds.values():
                    sched.add(seq)
            if seq.seq_id not in self._sent:
                item = protocol.AddItem(seq.seq_id, seq.group_id, seq.sampling.n, list(seq.prompt_ids),
                                        seq.sampling.temperature)  # fmt: skip
                protocol.encode_add(ints, floats, item)
                self._sent[seq.seq_id] = len(seq.prompt_ids)
                self._remote_seqs[seq.seq_id] = seq
            sent = self._sent[seq.seq_id]
            if h.upto > sent or h.final:
                tokens = seq.token_slice(sent, h.upto) if h.upto > sent else []
                protocol.encode_tokens(
                    ints, protocol.TokensItem(seq.seq_id, max(sent, h.upto), h.final, tokens)
                )
                self._sent[seq.seq_id] = max(sent, h.upto)
        super()._take(inbox)  # the local scorers (a critic): every sequence is registered above
        if len(ints) > 1:
            self.executor.unit(self._LANE, "send")
            message = Message(HANDOFFS, ints, floats)
            self.remote.send(message)
            self.messages_sent += 1
            self.bytes_sent += message.nbytes

    def _round(self) -> bool:
        worked = super()._round()
        self.remote.check()
        with self._cond:
            batches, self._results = self._results, []
            error, self._service_error = self._service_error, None
        if error is not None:
            with model_call("reward"):  # the service's forward failed: retried like a local forward
                raise RemoteScorerError(f"scorer service rank {self.remote.service_rank}: {error}")
        fields = self.remote.fields
        for batch in batches:
            for seq_id, reward, ref in batch:
                seq = self._remote_seqs.pop(seq_id, None)
                self._sent.pop(seq_id, None)
                if seq is None or seq.seq_id not in self._pending:
                    continue
                self._completed(seq, fields[0], reward)
                if len(fields) > 1:
                    self._completed(seq, fields[1], ref)
        return worked or bool(batches)
