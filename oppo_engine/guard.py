"""One call at a time: the public calls of ``RolloutEngine`` that change its state refuse to overlap.

``step()``, ``update_policy()``, ``release_memory()``, ``resume()``, ``load_state_dict()`` and ``close()``
each hold the engine's guard while they run. A second such call, from any thread (the serving thread's
owner, a trainer's callback, a second training thread), is refused at once with a ``RuntimeError`` naming
the call in progress: it never waits, and it touches nothing, so nothing is quarantined or lost. Waiting
would hide a bug (two trainers on one engine) behind a deadlock or a reordering of steps.

``add_prompts()`` (and the serve handle's methods) take no guard: they only append to queues that are safe
from any thread, and a prompt queued during a step is taken by a later one.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable


class CallGuard:
    """Who holds the engine now: the call's name and its thread, or nobody."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.holder: tuple[str, str] | None = None  # (call, thread name)

    def enter(self, call: str) -> None:
        """Hold the guard for ``call``, or ``RuntimeError`` naming the call that holds it."""
        if not self._lock.acquire(blocking=False):
            held, thread = self.holder or ("another call", "?")
            raise RuntimeError(
                f"RolloutEngine.{call} was called while RolloutEngine.{held} is in progress (thread "
                f"{thread!r}): step(), update_policy(), release_memory(), resume(), load_state_dict() and "
                "close() run one at a time; nothing was changed, call it again once that call has returned"
            )
        try:  # held from here: an interrupt before the caller's ``try`` must not leave it held
            self.holder = (call, threading.current_thread().name)
        except BaseException:
            self._lock.release()
            raise

    def exit(self) -> None:
        self.holder = None
        self._lock.release()


def exclusive(method: Callable) -> Callable:
    """Decorate a ``RolloutEngine`` method that must not overlap another such call (see the module)."""
    call = f"{method.__name__}()"

    @functools.wraps(method)
    def run(engine, *args, **kwargs):
        guard: CallGuard = engine._guard
        guard.enter(call)
        try:
            return method(engine, *args, **kwargs)
        finally:
            guard.exit()

    return run
