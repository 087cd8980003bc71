"""Real multi-process torch.distributed runs for the tests: spawned processes joined in a gloo group.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` processes (the ``spawn`` start method, so no
state leaks from the test process), joins them in a process group on 127.0.0.1 at a free port, calls
``fn(rank, world_size, *args)`` in each and returns the ranks' return values in rank order. ``fn`` must be
a module-level function (it is pickled by name) and its return value picklable.

Nothing can hang: the whole run has a deadline (``timeout_s``), after which every process still alive is
killed and :class:`RanksFailed` names the ranks that did not finish. A rank that raises reports its
traceback; a rank that dies without a word (``os._exit``, a signal) reports its exit code. With
``check=False`` the outcomes are returned instead of raised, for tests of faults that expect a rank to die.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from dataclasses import dataclass
from typing import Any

__all__ = ["RankOutcome", "RanksFailed", "free_port", "run_ranks"]


@dataclass
class RankOutcome:
    """What one rank did: ``ok`` with its ``value``, or the ``error`` (a traceback or why it ended)."""

    rank: int
    ok: bool
    value: Any = None
    error: str | None = None
    exitcode: int | None = None


class RanksFailed(AssertionError):
    """Some rank raised, died or ran past the deadline; the message holds each one's traceback."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn, rank, world_size, port, backend, pg_timeout_s, env, threads, args, results, dump_after_s):
    # A rank still running shortly before the deadline prints every thread's stack (to the test's captured
    # stderr), so a hang shows where it is before the parent kills it.
    faulthandler.dump_traceback_later(dump_after_s, exit=False)
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        if backend is not None:
            dist.init_process_group(
                backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=pg_timeout_s)
            )
        try:
            value = fn(rank, world_size, *args)
        except BaseException:
            if backend is not None and dist.is_initialized():
                dist.destroy_process_group()
            raise
        # Reported before the teardown: the value is the test's, and a teardown that blocks (a peer gone) is
        # cut short by the parent, which kills what is left once every rank has reported.
        results.put(RankOutcome(rank, True, value=value))
        if backend is not None and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        return
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        results.put(RankOutcome(rank, False, error=traceback.format_exc()))


def run_ranks(
    fn,
    world_size: int,
    *args,
    timeout_s: float = 180.0,
    backend: str | None = "gloo",
    pg_timeout_s: float = 60.0,
    env: dict[str, str] | None = None,
    threads: int = 1,
    check: bool = True,
) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; their values in rank order.

    ``backend=None`` starts the processes without a default process group (for tests that form their own,
    say through a TCPStore). ``pg_timeout_s`` is the default group's collective timeout; ``threads`` the
    intra-op threads of each rank (2 cores here: keep it at 1). With ``check=False`` returns a
    :class:`RankOutcome` per rank instead of raising :class:`RanksFailed`.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_child,
            daemon=True,
            args=(
                fn,
                r,
                world_size,
                port,
                backend,
                pg_timeout_s,
                dict(env or {}),
                threads,
                args,
                results,
                max(1.0, timeout_s - 15.0),
            ),
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outcomes: dict[int, RankOutcome] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(outcomes) < world_size and time.monotonic() < deadline:
            try:
                out = results.get(timeout=0.2)
                outcomes[out.rank] = out
                continue
            except queue.Empty:
                pass
            for r, p in enumerate(procs):
                if r not in outcomes and not p.is_alive():
                    # A last report may still be in the pipe: give it a moment before calling the rank dead.
                    try:
                        out = results.get(timeout=1.0)
                        outcomes[out.rank] = out
                    except queue.Empty:
                        why = f"rank {r} died with exit code {p.exitcode}"
                        outcomes[r] = RankOutcome(r, False, error=why, exitcode=p.exitcode)
    finally:
        for p in procs:
            p.join(timeout=max(0.0, min(10.0, deadline - time.monotonic())))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        results.close()
    for r, p in enumerate(procs):
        if r not in outcomes:
            outcomes[r] = RankOutcome(
                r,
                False,
                error=f"rank {r} did not finish within {timeout_s:.0f} s (killed)",
                exitcode=p.exitcode,
            )
        else:
            outcomes[r].exitcode = p.exitcode
    ordered = [outcomes[r] for r in range(world_size)]
    if not check:
        return ordered
    failed = [o for o in ordered if not o.ok]
    if failed:
        raise RanksFailed("\n".join(f"--- rank {o.rank} ---\n{o.error}" for o in failed))
    return [o.value for o in ordered]
