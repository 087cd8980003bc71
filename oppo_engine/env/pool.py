"""The worker pool that runs environment calls off the actor lane.

The actor thread submits a call (a sequence's ``reset`` or ``step``) and goes on decoding the other
sequences; a worker runs it; the actor picks up what finished (``drain``) between its forwards, and waits
(``wait``) only when nothing else can run. A call whose ``step`` is a coroutine (or returns an awaitable)
is handed by its worker to one asyncio event loop, so slow async tools cost no thread each.

Workers are lane threads started through the ``LaneExecutor`` and wait on its conditions, and the time
comes from its ``Clock``: the deterministic simulator runs the calls in virtual time with no branch here.
A call that runs past ``timeout_s`` is abandoned (``expire``): its worker is replaced, and its result, if
it ever comes, is dropped. Nothing here knows sequences: calls carry an opaque ``key``.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any

from oppo_engine.sched.runtime import THREADS, Clock, LaneExecutor

QUEUED, RUNNING, DONE, ABANDONED = "queued", "running", "done", "abandoned"
IDLE_EXIT_S = 60.0  # a worker with no call for this long exits (an engine dropped unclosed keeps none)


class EnvTimeout(TimeoutError):
    """An environment call ran past ``EngineConfig.env_timeout_s``."""


class EnvCall:
    """One call of an environment: ``fn()`` run on a worker. ``state`` goes queued -> running -> done, or
    to abandoned (cancelled, timed out, or its sequence restarted); once done, ``result`` or ``error`` and
    ``latency_s`` (from the start of the run to its end) are set."""

    __slots__ = (
        "key", "fn", "kind", "state", "started_s", "latency_s", "result", "error", "future", "released",
        "detached",
    )  # fmt: skip

    def __init__(self, key: Hashable, fn: Callable[[], Any], kind: str) -> None:
        self.key, self.fn, self.kind = key, fn, kind
        self.state = QUEUED
        self.started_s: float | None = None
        self.latency_s: float | None = None
        self.result: Any = None
        self.error: BaseException | None = None
        self.future = None  # the event loop's future, for an async call
        self.released = False  # its worker has left it (done, or handed to the event loop)
        self.detached = False  # expired while its worker was in it: that worker no longer counts


class EnvPool:
    """Up to ``max_workers`` workers, started as calls need them; one idle for ``IDLE_EXIT_S`` exits, and
    ``close`` ends them all (``RolloutEngine`` also closes its pool when it is garbage-collected unclosed).

    Only the actor thread calls ``submit``, ``drain``, ``expire``, ``abandon``, ``wait`` and ``close``;
    workers only run calls and report them done. ``timeout_s=None``: no call is ever expired.
    """

    def __init__(self, max_workers: int, timeout_s: float | None) -> None:
        self.max_workers = max_workers
        self.timeout_s = timeout_s
        self.clock: Clock = time.perf_counter
        self.executor: LaneExecutor = THREADS
        self._cond = self.executor.condition()
        self._queue: deque[EnvCall] = deque()
        self._running: set[EnvCall] = set()
        self._finished: list[EnvCall] = []  # done since the last drain
        self._workers = 0  # counted workers (a worker stuck in an expired call is no longer counted)
        self._idle = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._own_loop = True  # the pool started its loop (and stops it); False: a serving thread's loop
        self._closed = False

    def use_runtime(self, clock: Clock, executor: LaneExecutor) -> None:
        """Read the time from ``clock`` and run workers on ``executor`` (before the first call only)."""
        if self._workers:
            raise RuntimeError("EnvPool.use_runtime: workers are already running")
        self.clock, self.executor = clock, executor
        self._cond = executor.condition()

    def use_loop(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """Run async calls on ``loop``, which another thread runs and owns (the serving loop of
        ``RolloutEngine.serve``); ``None`` gives the pool its own loop again (started on first use)."""
        with self._cond:
            old, own = self._loop, self._own_loop
            self._loop, self._own_loop = loop, loop is None
        if old is not None and own:
            old.call_soon_threadsafe(old.stop)

    # -- the actor thread's side -----------------------------------------------------------------------

    def submit(self, key: Hashable, fn: Callable[[], Any], kind: str) -> EnvCall:
        """Queue ``fn()`` for a worker (one is started if none is idle and fewer than ``max_workers``
        run); returns its call."""
        if self._closed:
            raise RuntimeError("EnvPool is closed")
        call = EnvCall(key, fn, kind)
        with self._cond:
            self._queue.append(call)
            # NOTE: idle workers woken by an earlier submit may not have taken their call yet: count the
            # queue, not whether one is idle.
            start = len(self._queue) > self._idle and self._workers < self.max_workers
            if start:
                self._workers += 1
            self._cond.notify_all()
        if start:
            self.executor.start(self._work, f"oppo-env-worker-{self._workers}")
        return call

    @property
    def in_flight(self) -> int:
        """Calls queued or running."""
        with self._cond:
            return len(self._queue) + len(self._running)

    def drain_into(self, out: list[EnvCall]) -> None:
        """Move the calls done since the last drain to the end of ``out``, in the order they finished."""
        with self._cond:
            # NOTE: extend, then clear: an interrupt between the two duplicates a call, never loses one.
            out.extend(self._finished)
            self._finished.clear()

    def expire(self) -> list[EnvCall]:
        """Abandon the calls running longer than ``timeout_s`` and return them, each with an
        ``EnvTimeout`` as its error; a replacement worker may start for each."""
        if self.timeout_s is None:
            return []
        now = self.clock()
        with self._cond:
            # NOTE: the deadline as next_deadline() computes it, compared inclusively: a wait that ends
            # exactly at it (a simulator's virtual clock) expires the call, with no rounding in between.
            late = [c for c in self._running if now >= c.started_s + self.timeout_s]
            for call in late:
                self._running.discard(call)
                call.state = ABANDONED
                call.latency_s = now - call.started_s
                call.error = EnvTimeout(
                    f"the environment's {call.kind}() ran past env_timeout_s={self.timeout_s:g} s"
                )
                if not call.released:  # its worker is stuck in the call: a replacement may start
                    call.detached = True
                    self._workers -= 1
                if call.future is not None:
                    call.future.cancel()
            restart = min(len(self._queue), len(late), self.max_workers - self._workers)
            self._workers += max(0, restart)
        for _ in range(max(0, restart)):
            self.executor.start(self._work, f"oppo-env-worker-{self._workers}")
        return late

    def next_deadline(self) -> float | None:
        """When the earliest running call expires (``None``: none can)."""
        if self.timeout_s is None:
            return None
        with self._cond:
            starts = [c.started_s for c in self._running]
        return min(starts) + self.timeout_s if starts else None

    def abandon(self, call: EnvCall) -> None:
        """Drop ``call``: cancelled if still queued; its result dropped if it runs (or ran) on."""
        with self._cond:
            if call.state == QUEUED:
                self._queue.remove(call)
            self._running.discard(call)
            if call in self._finished:
                self._finished.remove(call)
            call.state = ABANDONED
        if call.future is not None:
            call.future.cancel()

    def wait(self, timeout: float) -> None:
        """Wait until a call finishes (or ``timeout`` seconds; spurious wake-ups are allowed)."""
        with self._cond:
            if not self._finished:
                self._cond.wait(timeout)

    def close(self) -> None:
        """Cancel every queued call, abandon the running ones and let the workers (and the event loop) go.
        Idempotent; a worker stuck in an environment's code is left to finish it (daemon threads)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            calls = [*self._queue, *self._running]
            self._queue.clear()
            self._running.clear()
            self._finished.clear()
            for call in calls:
                call.state = ABANDONED
            loop, self._loop = self._loop, None
            own = self._own_loop
            self._cond.notify_all()
        for call in calls:
            if call.future is not None:
                call.future.cancel()
        if loop is not None and own:
            loop.call_soon_threadsafe(loop.stop)

    # -- the workers' side -----------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._idle += 1
                    woke = self._cond.wait(IDLE_EXIT_S)
                    self._idle -= 1
                    if not woke and not self._queue and not self._closed:
                        self._workers -= 1  # idle for a minute: gone (a later call starts another)
                        return
                if self._closed:
                    return
                call = self._queue.popleft()
                call.state = RUNNING
                call.started_s = self.clock()
                self._running.add(call)
            # NOTE: no unit boundary here (LaneExecutor.unit): a simulator may raise a KeyboardInterrupt at
            # one, which a worker thread never receives; workers yield to the other lanes in their waits.
            try:
                result = call.fn()
                if inspect.isawaitable(result):
                    self._on_loop(call, result)
                else:
                    self._complete(call, result, None)
            except Exception as e:  # the environment's own failure: the call's error
                self._complete(call, None, e)
            except BaseException as e:  # the worker itself is going (interpreter or greenlet exit)
                self._complete(call, None, e)
                with self._cond:
                    if not call.detached:
                        self._workers -= 1
                raise
            with self._cond:
                if call.detached or self._closed:
                    return  # detached: expired while this worker ran it, and a replacement took its place
                call.released = True

    def _complete(self, call: EnvCall, result: Any, error: BaseException | None) -> None:
        with self._cond:
            if call.state != RUNNING:
                return  # abandoned meanwhile: nobody reads it
            self._running.discard(call)
            call.state = DONE
            call.latency_s = self.clock() - call.started_s
            call.result, call.error = result, error
            self._finished.append(call)
            self._cond.notify_all()

    def _on_loop(self, call: EnvCall, awaitable) -> None:
        """Run ``awaitable`` on the pool's event loop (started on first use); it completes ``call``."""
        with self._cond:
            loop = self._loop
            if loop is None and not self._closed:
                loop = self._loop = asyncio.new_event_loop()
                start = True
            else:
                start = False
        if loop is None:
            return  # closed meanwhile
        if start:

            def run() -> None:
                asyncio.set_event_loop(loop)
                try:
                    loop.run_forever()
                finally:
                    loop.close()

            self.executor.start(run, "oppo-env-loop")
        future = asyncio.run_coroutine_threadsafe(_awaited(awaitable), loop)
        call.future = future

        def done(f) -> None:
            if f.cancelled():  # by its loop (a serving loop shutting down): an abandoned call is skipped
                self._complete(call, None, asyncio.CancelledError("its event loop cancelled it (it closed)"))
                return
            error = f.exception()
            self._complete(call, None if error is not None else f.result(), error)

        future.add_done_callback(done)


async def _awaited(awaitable):
    return await awaitable
