"""The remote scorers' message transport: small messages between one service rank and its clients.

A message is a kind and two short lists, ``ints`` (token ids, ids, counts) and ``floats`` (scores,
log-probs); it travels as one int64 header ``[kind, len(ints), len(floats)]`` and, when not empty, one int64
payload (the floats as the bits of float64, so a score arrives exactly as it left). ``Transport`` is the
interface the service and the remote lane use (so a Ray transport can follow); ``GlooTransport`` carries it
on a gloo group of its own, whatever device the models run on.

Gloo's limits shape it: a posted receive completes only when waited on, and a wait that times out closes the
connection for good. So each peer gets one receiving thread that always has a receive posted for that
peer alone (never a receive from any source), the group's timeout is long (``GROUP_TIMEOUT_S``), and a
heartbeat every ``heartbeat_s`` keeps an idle connection (a client through a long training phase) alive.
A peer that closes its connection (its process died) or stays silent longer than ``liveness_timeout_s``
has failed: ``check(peer)`` raises :class:`PeerLost` naming its rank.
"""

from __future__ import annotations

import datetime
import re
import struct
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# Message kinds. The client speaks first (HELLO); the service answers WELCOME or REFUSE.
# LOST is never sent: a receiving thread delivers it when its peer's connection breaks.
HEARTBEAT, HELLO, WELCOME, REFUSE, HANDOFFS, RESULTS, ABORT, ERROR, BYE, LOST, SPANS = range(11)

GROUP_TIMEOUT_S = 24 * 3600.0  # the gloo group's own timeout: liveness is the heartbeats' job
DEFAULT_HEARTBEAT_S = 1.0
DEFAULT_LIVENESS_TIMEOUT_S = 60.0  # silence longer than this is a failure of the peer
_TAG = 7


@dataclass(slots=True)
class Message:
    """One message: its ``kind`` (a constant of this module), ``ints`` and ``floats``."""

    kind: int
    ints: list[int] = field(default_factory=list)
    floats: list[float] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: the header and the payload."""
        return 8 * (3 + len(self.ints) + len(self.floats))


class PeerLost(RuntimeError):
    """A peer closed its connection, or was silent longer than the liveness timeout."""

    def __init__(self, rank: int, why: str) -> None:
        super().__init__(f"rank {rank} {why}")
        self.rank = rank


def encode_text(text: str) -> list[int]:
    """``text`` as ints (its UTF-8 bytes), for a message."""
    return list(text.encode())


def decode_text(ints: Sequence[int]) -> str:
    """The text :func:`encode_text` made."""
    return bytes(ints).decode(errors="replace")


class Transport(ABC):
    """Messages between this rank and its ``peers`` (ranks of the group), each delivered in order.

    ``start(on_message)`` begins receiving: ``on_message(peer, message)`` is called on a receiving thread,
    in the order the peer sent them (heartbeats are not delivered; ``LOST`` when its connection breaks).
    ``send`` may be called from any thread.
    """

    rank: int
    peers: tuple[int, ...]

    @abstractmethod
    def start(self, on_message: Callable[[int, Message], None]) -> None:
        """Begin receiving from every peer (and sending heartbeats)."""

    @abstractmethod
    def send(self, peer: int, message: Message) -> None:
        """Send ``message`` to ``peer``; raises :class:`PeerLost` if it has failed."""

    @abstractmethod
    def send_last(self, peer: int, message: Message) -> None:
        """Send ``message`` as the last one to ``peer`` (a BYE: it receives nothing after it), then close
        ``peer``; nothing, heartbeats included, follows it. Raises :class:`PeerLost` if it has failed."""

    @abstractmethod
    def check(self, peer: int) -> None:
        """Raise :class:`PeerLost` if ``peer`` has failed (closed, or silent past the liveness timeout)."""

    @abstractmethod
    def close(self, peer: int) -> None:
        """Stop talking to ``peer`` (after the last message either side sends: BYE)."""

    def alive(self, peer: int) -> bool:
        """``check(peer)`` would not raise."""
        try:
            self.check(peer)
        except PeerLost:
            return False
        return True


# Stateless groups (formed through a TCPStore beside torchrun's default group) and their stores, so a
# transport can form a gloo group of its own from the same store.
# NOTE: keyed by id() with the group held: process groups are pybind objects, which take no weak references.
_STORES: dict[int, tuple[dist.ProcessGroup, dist.Store]] = {}
# Transports formed so far on a group (by id() for a stateless group, by name for a registered one): each
# gets its own store prefix.
_FORMED: dict[int | str, int] = {}


def register_store(group: dist.ProcessGroup, store: dist.Store) -> None:
    """Remember that ``group`` (not registered with torch.distributed) was formed on ``store``."""
    _STORES[id(group)] = (group, store)


def _own_gloo_group(group: dist.ProcessGroup, timeout: datetime.timedelta) -> dist.ProcessGroupGloo:
    """A gloo group of the same ranks as ``group``, formed on ``group``'s own store under a prefix of its own,
    collectively on every rank of ``group`` (every rank forms its transports in the same order, so the n-th
    one's store keys agree).

    Not ``dist.new_group``: without a barrier on every rank of the world (``use_local_synchronization``) it
    names the group from the number of groups this rank knows, which differs on a rank outside a subgroup
    it was asked to create (the service, beside the clients' data-parallel group), so the ranks would meet
    at different keys and wait for ever."""
    stateless = _STORES.get(id(group))
    if stateless is not None:
        key, store = id(group), stateless[1]
    else:
        key, store = group.group_name, dist.distributed_c10d._get_process_group_store(group)
    n = _FORMED[key] = _FORMED.get(key, 0) + 1
    prefixed = dist.PrefixStore(f"oppo-transport/{n}/", store)
    return dist.ProcessGroupGloo(prefixed, group.rank(), group.size(), timeout)


class GlooTransport(Transport):
    """:class:`Transport` on a gloo group of its own, made collectively on every rank of ``group`` (ranks
    are ``group``'s). ``peers``: the ranks this one talks to (the service: every client; a client: the
    service)."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        peers: Iterable[int],
        *,
        heartbeat_s: float = DEFAULT_HEARTBEAT_S,
        liveness_timeout_s: float = DEFAULT_LIVENESS_TIMEOUT_S,
    ) -> None:
        if not liveness_timeout_s > heartbeat_s > 0:
            raise ValueError(
                f"liveness_timeout_s={liveness_timeout_s} must exceed heartbeat_s={heartbeat_s} > 0"
            )
        self.rank = group.rank()
        self.peers = tuple(peers)
        self.heartbeat_s = heartbeat_s
        self.liveness_timeout_s = liveness_timeout_s
        self._group = _own_gloo_group(group, datetime.timedelta(seconds=GROUP_TIMEOUT_S))
        self._send_locks = {p: threading.Lock() for p in self.peers}
        self._last_seen = {p: time.monotonic() for p in self.peers}
        self._failure: dict[int, str] = {}
        self._closed: set[int] = set()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.messages_sent = 0
        self.bytes_sent = 0

    def start(self, on_message: Callable[[int, Message], None]) -> None:
        now = time.monotonic()
        for peer in self.peers:
            self._last_seen[peer] = now
            t = threading.Thread(
                target=self._receive, args=(peer, on_message), name=f"oppo-recv-{peer}", daemon=True
            )
            t.start()
            self._threads.append(t)
        beat = threading.Thread(target=self._heartbeat, name="oppo-heartbeat", daemon=True)
        beat.start()
        self._threads.append(beat)

    def send(self, peer: int, message: Message) -> None:
        self.check(peer)
        if peer in self._closed:
            raise PeerLost(peer, "is closed: nothing more can be sent to it")
        self._send(peer, message)

    def _send(self, peer: int, message: Message) -> None:
        header = torch.tensor([message.kind, len(message.ints), len(message.floats)], dtype=torch.int64)
        payload = None
        if message.ints or message.floats:
            bits = list(
                struct.unpack(
                    f"<{len(message.floats)}q", struct.pack(f"<{len(message.floats)}d", *message.floats)
                )
            )
            payload = torch.tensor([*message.ints, *bits], dtype=torch.int64)
        try:
            with self._send_locks[peer]:  # a message's two tensors are never interleaved with another's
                if message.kind == HEARTBEAT and peer in self._closed:
                    # NOTE: checked under the lock that send_last holds: a send completes only once the
                    # peer posts its receive, and a peer stops receiving at the last message (BYE).
                    return
                self._group.send([header], peer, _TAG).wait()
                if payload is not None:
                    self._group.send([payload], peer, _TAG).wait()
        except RuntimeError as e:
            self._fail(peer, f"is unreachable ({_first_line(e)})")
            raise PeerLost(peer, self._failure[peer]) from e
        if message.kind != HEARTBEAT:
            self.messages_sent += 1
            self.bytes_sent += message.nbytes

    def send_last(self, peer: int, message: Message) -> None:
        """Send ``message`` as the last one to ``peer`` (its BYE, after which it receives nothing more): no
        heartbeat follows it, and ``peer`` is closed. Raises :class:`PeerLost` if it has failed."""
        self.check(peer)
        if peer in self._closed:
            raise PeerLost(peer, "is closed: nothing more can be sent to it")
        with self._send_locks[peer]:
            self.close(peer)
        self._send(peer, message)

    def check(self, peer: int) -> None:
        why = self._failure.get(peer)
        if why is None and peer not in self._closed:
            silent = time.monotonic() - self._last_seen[peer]
            if silent > self.liveness_timeout_s:
                why = f"was silent for {silent:.0f} s (liveness_timeout_s={self.liveness_timeout_s:g})"
                self._fail(peer, why)
        if why is not None:
            raise PeerLost(peer, why)

    def close(self, peer: int) -> None:
        self._closed.add(peer)
        if self._closed.issuperset(self.peers):
            self._stop.set()

    def shutdown(self) -> None:
        """Stop the heartbeats (the receiving threads end at each peer's BYE or failure)."""
        self._stop.set()

    def _fail(self, peer: int, why: str) -> None:
        self._failure.setdefault(peer, why)

    def _receive(self, peer: int, on_message: Callable[[int, Message], None]) -> None:
        header = torch.empty(3, dtype=torch.int64)
        while True:
            try:
                self._group.recv([header], peer, _TAG).wait()
                kind, n_ints, n_floats = header.tolist()
                payload = torch.empty(n_ints + n_floats, dtype=torch.int64)
                if n_ints + n_floats:
                    self._group.recv([payload], peer, _TAG).wait()
            except RuntimeError as e:
                if peer not in self._closed:
                    self._fail(peer, f"closed its connection ({_first_line(e)})")
                on_message(peer, Message(LOST))
                return
            self._last_seen[peer] = time.monotonic()
            if kind == HEARTBEAT:
                continue
            values = payload.tolist()
            bits = values[n_ints:]
            floats = list(struct.unpack(f"<{n_floats}d", struct.pack(f"<{n_floats}q", *bits)))
            on_message(peer, Message(kind, values[:n_ints], floats))
            if kind == BYE:
                return

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            for peer in self.peers:
                if peer in self._closed or peer in self._failure:
                    continue
                try:
                    self._send(peer, Message(HEARTBEAT))
                except PeerLost:
                    pass  # recorded: check(peer) raises it


def _first_line(e: BaseException) -> str:
    """The gist of a gloo error: "Connection reset by peer" rather than its source location and advice."""
    text = str(e).strip().splitlines()
    line = text[0] if text else type(e).__name__
    gist = re.search(r"(Connection [a-z ]+|Socket [a-zA-Z ]+|Timed out[^.]*)", line)
    return gist.group(1).strip() if gist else line[:120]
