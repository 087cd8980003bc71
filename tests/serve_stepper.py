"""A thread that calls ``engine.step()`` until stopped, for the serving tests (one copy, imported by
test_serve_http and test_serve_eval)."""

from __future__ import annotations

import threading
import time

DEADLINE_S = 60.0


class Stepper:
    """Calls ``engine.step()`` on a thread until stopped, keeping each step's result that returned
    something (``results``), and what they returned (``rollouts``, ``failed``)."""

    def __init__(self, engine) -> None:
        self.engine, self.results, self.errors = engine, [], []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="test-stepper", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                result = self.engine.step()
                if result.rollouts or result.failed:
                    self.results.append(result)
                else:
                    time.sleep(0.01)
        except BaseException as e:
            self.errors.append(e)

    @property
    def rollouts(self) -> list:
        return [r for result in list(self.results) for r in result.rollouts]

    @property
    def failed(self) -> list:
        return [r for result in list(self.results) for r in result.failed]

    def count(self) -> int:
        """Episodes returned so far, finished or failed."""
        return sum(len(r.rollouts) + len(r.failed) for r in list(self.results))

    def wait_for(self, n: int) -> None:
        """Until ``n`` episodes came back (finished or failed)."""
        deadline = time.monotonic() + DEADLINE_S
        while self.count() < n:
            assert not self.errors, self.errors
            assert time.monotonic() < deadline, "the episodes did not come back"
            time.sleep(0.01)

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(DEADLINE_S)
        assert not self.thread.is_alive() and not self.errors, self.errors
