"""A process group formed through a TCPStore beside torchrun's default one (as vLLM's weight-sync groups are):
how actor ranks of a running job meet a scorer service started on its own (``oppo-engine serve-scorers``).
A running torchrun world cannot grow; this group is not registered with ``torch.distributed`` and needs no
default group at all."""

from __future__ import annotations

import datetime
from urllib.parse import urlparse

import torch.distributed as dist

from oppo_engine.distributed.transport import register_store

DEFAULT_CONNECT_TIMEOUT_S = 300.0


def stateless_group(
    init: str,
    rank: int,
    world_size: int,
    *,
    host_store: bool | None = None,
    timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
) -> dist.ProcessGroup:
    """A gloo group of ``world_size`` ranks meeting at ``init`` (``tcp://HOST:PORT``); this process is
    ``rank``. ``host_store``: this process serves the TCPStore (None: the last rank does, which is where
    ``oppo-engine serve-scorers`` puts the service). Every rank must call it; it returns once all have, or
    raises after ``timeout_s``. ``RemoteScorers`` and ``ScorerService`` take the group as ``group=``."""
    url = urlparse(init)
    if url.scheme != "tcp" or not url.hostname or url.port is None:
        raise ValueError(f"init={init!r}: expected tcp://HOST:PORT")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is not a rank of a group of world_size={world_size}")
    if host_store is None:
        host_store = rank == world_size - 1
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(url.hostname, url.port, world_size, is_master=host_store, timeout=timeout)
    group = dist.ProcessGroupGloo(dist.PrefixStore("oppo-stateless/", store), rank, world_size, timeout)
    register_store(group, store)
    return group
