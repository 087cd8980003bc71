"""Where the step loop's time and lane threads come from.

The step loop and the scorer lane read the time through a ``Clock`` and start, wake and wait for the scorer
lane's worker through a ``LaneExecutor``. The defaults are the real thing: ``time.perf_counter`` and OS
threads. The deterministic simulator (``tests/sim/``, on the executor and stand-ins of ``oppo_engine/sim/``)
injects a virtual clock and an executor that runs one lane at a time and orders the lanes' units of work
from a seed, so every interleaving replays; the engine has no simulator-only branch, only these calls.

``unit(lane, what)`` marks the boundary of a unit of a lane's work (a forward, a hand-off, a score read):
with OS threads it does nothing; a simulator may switch to another lane there.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol

Clock = Callable[[], float]


class LaneThread(Protocol):
    """A started lane worker."""

    def join(self) -> None: ...


class LaneExecutor:
    """Runs lane workers on OS threads, with ``threading``'s synchronisation and the real ``sleep``.

    A simulator subclasses it; every method here is one the step loop and the lanes call.
    """

    def start(self, target: Callable[[], None], name: str) -> LaneThread:
        """Run ``target`` on a new worker (a daemon thread named ``name``) and return it."""
        return _OSLaneThread(target, name)

    def condition(self) -> threading.Condition:
        """A condition variable for a lane's inbox (``with``, ``wait(timeout)``, ``notify``)."""
        return threading.Condition()

    def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` (a lane polling for pages another lane holds)."""
        time.sleep(seconds)

    def unit(self, lane: str, what: str) -> None:
        """A unit of ``lane``'s work (``what``) is about to run; OS threads interleave on their own."""


# How long the caller sleeps at a time while it waits for a lane worker: the bound on how late a Ctrl-C
# that lands just before the wait is seen (see _OSLaneThread).
INTERRUPT_CHECK_S = 0.05


class _OSLaneThread:
    """A lane worker on an OS thread whose ``join`` waits for the worker's own exit signal.

    NOTE: a ``KeyboardInterrupt`` that lands in ``Thread.join()`` makes CPython 3.11 mark the thread
    stopped while it still runs (a later ``join()`` returns at once), so ``join`` waits on an Event the
    worker sets as it returns; an interrupt during the wait propagates and a later ``join`` waits again.

    NOTE: the wait is cut into slices of ``INTERRUPT_CHECK_S``. A signal whose C handler runs after the
    interpreter's last check and before the thread blocks in the lock's futex does not wake it, and a wait
    without a timeout would see the Ctrl-C only when the worker ends -- after the whole step's scoring.
    Each slice returns to the interpreter, which runs the handler then.
    """

    def __init__(self, target: Callable[[], None], name: str) -> None:
        self._exited = threading.Event()

        def run() -> None:
            try:
                target()
            finally:
                self._exited.set()

        self._thread = threading.Thread(target=run, name=name, daemon=True)
        self._thread.start()

    def join(self) -> None:
        while not self._exited.wait(INTERRUPT_CHECK_S):
            pass
        self._thread.join()  # the worker has returned: this ends at once


THREADS = LaneExecutor()
