"""Stacks the lane executors switch between: greenlets where the ``greenlet`` package is installed (the
``sim`` extra), else OS threads that hand one baton around (slower, same semantics: one runs at a time,
``switch`` runs the target until it switches back, a finished one returns to its parent).

Only what ``sim/executor.py`` uses is provided: ``greenlet(run, parent)``, ``.switch()``, ``getcurrent()``
and ``GreenletExit``.
"""

from __future__ import annotations

import threading

try:
    from greenlet import GreenletExit, getcurrent, greenlet
except ImportError:  # the GPU test machine has no greenlet: a baton over threads

    class GreenletExit(BaseException):  # noqa: N818  (greenlet's name)
        """Raised in a stack that is being closed."""

    _local = threading.local()

    class greenlet:  # noqa: N801  (greenlet's name)
        """One stack on an OS thread of its own; ``switch`` passes the baton to it and waits for it back."""

        def __init__(self, run=None, parent: greenlet | None = None) -> None:
            self.run, self.parent = run, parent
            self._baton = threading.Semaphore(0)
            self._thread: threading.Thread | None = None
            self._error: BaseException | None = None
            self.dead = False

        def switch(self) -> None:
            me = getcurrent()
            if self._thread is None and self.run is not None:
                self._thread = threading.Thread(target=self._main, daemon=True, name="sim-stack")
                self._thread.start()
            self._baton.release()
            me._baton.acquire()
            error, me._error = me._error, None
            if error is not None:
                raise error

        def _main(self) -> None:
            self._baton.acquire()
            _local.current = self
            try:
                self.run()
            except BaseException as e:  # noqa: BLE001  (raised in the parent, as greenlet does)
                self.parent._error = e
            finally:
                self.dead = True
                self.parent._baton.release()

    def getcurrent() -> greenlet:
        current = getattr(_local, "current", None)
        if current is None:
            current = _local.current = greenlet()
        return current


__all__ = ["GreenletExit", "getcurrent", "greenlet"]
