"""A lane executor that runs one lane at a time and orders their units of work from a seed.

Each lane runs the engine's code unchanged, on a greenlet of its own (a stack switched within one OS
thread: no OS scheduling, so a switch costs microseconds): a lane runs until its next unit boundary
(``unit``), a wait on a condition, a sleep or a join, and there the executor's policy picks the next lane
to run from the runnable ones. Time is a virtual ``SimClock``:
the stand-in models advance it by their costs, and when every lane waits it jumps to the earliest
deadline. Since only one thread ever runs and every choice comes from the seeded policy, a schedule
replays exactly from its seed. A state where every lane waits with no deadline is a hang
(``SimDeadlock``).
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable

from oppo_engine.sched.runtime import LaneExecutor
from oppo_engine.sim import _switch as greenlet

RUN, WAIT, DONE = "run", "wait", "done"


class SimDeadlock(BaseException):
    """Every lane waits and none has a deadline: with real threads, a hang."""


class SimClock:
    """Virtual seconds: advanced by the stand-in models' costs and by waits that time out."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class SimEvent:
    """A completion event of a lane's kernels: complete once the clock passes ``done_at`` (late events are
    events with a long latency)."""

    __slots__ = ("clock", "done_at")

    def __init__(self, clock: SimClock, done_at: float) -> None:
        self.clock, self.done_at = clock, done_at

    def query(self) -> bool:
        return self.clock.now >= self.done_at


class _Lane:
    __slots__ = ("name", "glet", "state", "deadline", "cond", "joiners")

    def __init__(self, name: str, glet: greenlet.greenlet) -> None:
        self.name = name
        self.glet = glet
        self.state = RUN
        self.deadline: float | None = None
        self.cond: SimCondition | None = None
        self.joiners: list[_Lane] = []


class Policy:
    """How the next lane is picked among the runnable ones: ``random`` (the actor with probability
    ``p_actor``), ``sticky`` (the running lane keeps going with probability ``p_stay``), ``scorer_starved``
    (the actor whenever it can run), ``actor_starved`` (the scorer lane whenever it can run)."""

    KINDS = ("random", "sticky", "scorer_starved", "actor_starved")

    def __init__(self, kind: str, rng: random.Random) -> None:
        if kind not in self.KINDS:
            raise ValueError(f"policy {kind!r}: one of {self.KINDS}")
        self.kind, self.rng = kind, rng
        self.p_actor = rng.uniform(0.05, 0.95)
        self.p_stay = rng.uniform(0.5, 0.98)

    def pick(self, runnable: list[_Lane], current: _Lane) -> _Lane:
        if len(runnable) == 1:
            return runnable[0]
        actor = [ln for ln in runnable if ln.name == "actor"]
        others = [ln for ln in runnable if ln.name != "actor"]
        if self.kind == "scorer_starved" and actor:
            return actor[0]
        if self.kind == "actor_starved" and others:
            return others[0]
        if self.kind == "sticky" and current in runnable and self.rng.random() < self.p_stay:
            return current
        if actor and others:
            return actor[0] if self.rng.random() < self.p_actor else self.rng.choice(others)
        return self.rng.choice(runnable)


class SimCondition:
    """``threading.Condition`` for lanes of one OS thread: only the running lane holds it."""

    def __init__(self, ex: SimExecutor) -> None:
        self.ex = ex
        self.waiters: list[_Lane] = []

    def __enter__(self) -> SimCondition:
        return self

    def __exit__(self, *exc) -> bool:
        return False

    def wait(self, timeout: float | None = None) -> bool:
        ex = self.ex
        lane = ex.current
        lane.state, lane.cond = WAIT, self
        lane.deadline = None if timeout is None else ex.clock.now + timeout
        self.waiters.append(lane)
        ex._block(lane, "wait")
        return True

    def notify(self, n: int = 1) -> None:  # noqa: ARG002  (waking every waiter is a legal spurious wake-up)
        for lane in self.waiters:
            lane.state, lane.deadline, lane.cond = RUN, None, None
        self.waiters.clear()

    notify_all = notify


class _SimThread:
    def __init__(self, ex: SimExecutor, lane: _Lane) -> None:
        self.ex, self.lane = ex, lane

    def join(self) -> None:
        ex = self.ex
        while self.lane.state != DONE:
            me = ex.current
            me.state, me.deadline = WAIT, None
            self.lane.joiners.append(me)
            ex._block(me, f"join {self.lane.name}")


class SimExecutor(LaneExecutor):
    """Runs the lanes one at a time, in an order its ``Policy`` draws from ``rng``.

    The thread that creates it is the actor lane. ``on_unit`` runs after every unit boundary (the
    invariants), then ``interrupt_at`` (a global unit number) raises ``KeyboardInterrupt`` in whichever lane
    reaches that unit. ``trace`` keeps the last units: ``(unit, virtual time, lane, what)``.
    """

    def __init__(
        self,
        rng: random.Random,
        clock: SimClock,
        policy: Policy,
        on_unit: Callable[[], None] | None = None,
        trace_len: int = 40,
    ) -> None:
        self.rng, self.clock, self.policy, self.on_unit = rng, clock, policy, on_unit
        self.current = _Lane("actor", greenlet.getcurrent())
        self.lanes: list[_Lane] = [self.current]
        self.closed = False  # set when the schedule ends: a lane left suspended is not resumed
        self.units = 0
        self.forwards = 0  # units that are model forwards
        self.interrupt_at: int | None = None
        self.trace: deque[tuple[int, float, str, str]] = deque(maxlen=trace_len)

    # -- LaneExecutor ----------------------------------------------------------------------------------

    def start(self, target: Callable[[], None], name: str) -> _SimThread:
        main = self.lanes[0].glet

        def body() -> None:
            try:
                target()
            except greenlet.GreenletExit:
                return
            if self.closed:
                return
            lane.state = DONE
            self.lanes.remove(lane)
            for j in lane.joiners:
                j.state = RUN
            lane.joiners.clear()
            try:
                self.current = self._next(lane, "exit")
            except SimDeadlock:  # nothing left to run: the actor takes over and finds out
                self.current = self.lanes[0]
                self.current.state = RUN
            # Returning switches to the parent (the actor's greenlet), which passes on to ``current``.

        lane = _Lane("scorer" if "scorer" in name else name, greenlet.greenlet(body, parent=main))
        self.lanes.append(lane)
        return _SimThread(self, lane)

    def condition(self) -> SimCondition:
        return SimCondition(self)

    def sleep(self, seconds: float) -> None:
        lane = self.current
        lane.state, lane.deadline = WAIT, self.clock.now + seconds
        self._block(lane, "sleep")

    def unit(self, lane: str, what: str) -> None:
        self.units += 1
        if what.endswith("forward"):
            self.forwards += 1
        self.trace.append((self.units, round(self.clock.now, 6), lane, what))
        if self.on_unit is not None:
            self.on_unit()
        if self.units == self.interrupt_at:
            self.interrupt_at = None
            raise KeyboardInterrupt(f"injected at unit {self.units} ({lane}: {what})")
        me = self.current
        nxt = self._next(me, what)
        if nxt is not me:
            self._switch(me, nxt)

    def note(self, text: str) -> None:
        """Add ``text`` to the last unit of the trace (what a forward computed)."""
        if self.trace:
            u, t, lane, what = self.trace[-1]
            self.trace[-1] = (u, t, lane, f"{what} {text}")

    def event(self, latency: float) -> SimEvent:
        """A completion event recorded now, complete after ``latency`` virtual seconds."""
        return SimEvent(self.clock, self.clock.now + latency)

    # -- the baton --------------------------------------------------------------------------------------

    def _wake_due(self) -> None:
        now = self.clock.now
        for lane in self.lanes:
            if lane.state == WAIT and lane.deadline is not None and lane.deadline <= now:
                self._wake(lane)

    def _wake(self, lane: _Lane) -> None:
        if lane.cond is not None:
            lane.cond.waiters.remove(lane)
        lane.state, lane.deadline, lane.cond = RUN, None, None

    def _next(self, me: _Lane, what: str) -> _Lane:
        """The lane to run next (``me`` may be waiting); jumps the clock when every lane waits."""
        self._wake_due()
        runnable = [ln for ln in self.lanes if ln.state == RUN]
        if not runnable:
            timed = [ln for ln in self.lanes if ln.state == WAIT and ln.deadline is not None]
            if not timed:
                me.state = RUN  # raise in the lane that found it
                for ln in self.lanes:
                    if ln is not me and ln.cond is not None:
                        ln.cond.waiters.remove(ln)
                raise SimDeadlock(f"every lane waits with no deadline ({what} in {me.name})")
            first = min(timed, key=lambda ln: ln.deadline)
            self.clock.now = max(self.clock.now, first.deadline)
            self._wake(first)
            runnable = [first]
        return self.policy.pick(runnable, me)

    def _block(self, me: _Lane, what: str) -> None:
        nxt = self._next(me, what)
        if nxt is not me:
            self._switch(me, nxt)

    def _switch(self, me: _Lane, nxt: _Lane) -> None:
        self.current = nxt
        nxt.glet.switch()
        # Back here when a lane handed over to ``me``, or when a lane ended (its greenlet returns to the
        # actor's): then pass on to the lane it chose.
        while self.current is not me:
            self.current.glet.switch()
