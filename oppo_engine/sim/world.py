"""The twin's world: lanes on virtual time, the devices they run work on, and how work shares a device.

Every lane (each rank's actor lane, its scorer lane) runs the engine's code unchanged on a greenlet of the
:class:`TwinExecutor`. A lane that starts a forward hands its :class:`~oppo_engine.sim.cost.Work` to a
device and waits; the clock jumps from event to event (a forward ends, a sleep ends, a round of the
scorer service starts), so lanes overlap in virtual time: each runs its own work, and the events of all of
them order what they see of each other.

The contention rule (lanes on one device, and the Python of one process)
-------------------------------------------------------------------------
A piece of work alone takes ``T = host + max(launch, sum over its kernel classes of max(f_k, m_k))``, with
``f_k`` its compute term and ``m_k`` its memory term (FLOPs over achieved FLOP/s, bytes over achieved
bandwidth), ``host`` the Python before its kernels and ``launch`` the Python and driver calls that launch
them while they run. Over ``T`` it demands ``a_f = threads * sum(f_k) / (cores * T)`` of the device's
arithmetic (``cores`` is 1 on a GPU), ``a_m = sum(m_k) / T`` of its memory bandwidth (on a CPU
``threads * sum(m_k) / (cores * T)``: a core's bandwidth is bound by its own misses, ``m_k`` was timed at
the bandwidth of ``threads`` cores, and the ``cores`` together draw that many times one's) and
``a_h = (host + launch) / T`` of its process's interpreter (Python holds the GIL; a process's lanes share
one). While a set of works runs at once, each resource is oversubscribed by ``S = max(1, sum of the
demands on it)``, and each work progresses at the rate of taking
``host * S_h + max(launch * S_h, sum over k of max(f_k * S_f, m_k * S_m))`` in all: the part of a work bound
by a resource stretches by that resource's oversubscription. The interpreter is worse than shared: two
interpreter-bound threads of one process take ``penalty`` times longer together than one after the other
(the GIL's hand-overs, measured by ``calibrate`` as ``HostCosts.interpreter_penalty``), so past a total
demand of one, ``S_h = demand * (1 + (penalty - 1) * min(1, demand - 1))``. And a thread of a process
waits for the interpreter at every op beside another thread of it, at any demand: a thread whose op ends
takes the GIL back, and while another holds it, it waits; the holder's own ops are short, so it takes the
GIL back before the waiter wakes (two lanes of a small model slowed each other 1.3-3.7x at demands summing
to 0.7-1.3, where two processes of them did not slow each other). A work's time under the cores' and the
bandwidth's sharing is then multiplied by ``g = (1 + sqrt(1 + 4 * handover * a_h * others)) / 2``,
``others`` the other works' ``a_h`` in its process (:func:`~oppo_engine.sim.cost.handover_load`;
``handover``: ``HostCosts.interpreter_handover``, measured by ``calibrate``): the seconds of waiting per
second of Python are ``handover`` times the others' share of their own stretched time. Those waits include
the interpreter's serialisation past a demand of one, so a work takes the larger of that and its time
under ``S_h``, not both. A CPU's ``cores`` are the cores
two busy lanes were measured to get (``Profile.cores``: fewer than the machine's when other work runs), and
there a work's Python needs a core as much as its kernels do: ``a_f`` counts both, and its Python stretches
by the larger of the cores' and the interpreter's oversubscription. A CPU kernel stalled on memory still
holds its core, so there each kernel class takes ``max(f_k * S_f, m_k * max(S_m, S_f))``: a memory-bound
decode beside a prefill on one core is slowed by the core's sharing, not only by the bandwidth's.

A memory-bound decode (``a_m`` near 1, ``a_f`` small) beside a compute-bound prefill (``a_f`` near 1,
``a_m`` small) slows each only by the other's small demand on its own bottleneck; two decodes, or two
prefills, share one resource and take twice as long (on a GPU, or a CPU whose lanes get one core).
Rates are recomputed whenever a work starts or ends (processor sharing).

Lanes on different devices do not contend (the paper's 7+1 placement: actor ranks on seven GPUs, the
frozen scorers on the eighth). The shared scorer GPU is a :class:`ScorerService`: one queue for every rank;
when it is idle, it takes everything queued at that moment and runs one forward per model over all the
ranks' chunks together (as ``ScorerService`` does), each rank's lane waking when its model's forward ends.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from oppo_engine.sim.cost import Batch, Work, demands, handover_load, interpreter_load
from oppo_engine.sim.executor import RUN, WAIT, Policy, SimClock, SimDeadlock, SimExecutor

_EPS = 1e-12


class _First(Policy):
    """The running lane keeps going while it can; otherwise the first runnable (deterministic)."""

    def __init__(self) -> None:
        self.kind, self.rng = "first", random.Random(0)

    def pick(self, runnable, current):
        return current if current in runnable else runnable[0]


class _Item:
    __slots__ = ("lane", "work", "device", "group", "progress", "rate", "end", "a_f", "a_m", "a_h",
                 "alone", "busy", "solo")  # fmt: skip

    def __init__(self, lane, work: Work, device: str, group: str, cores: float, cpu: bool) -> None:
        self.lane, self.work, self.device, self.group = lane, work, device, group
        self.progress, self.rate, self.end = 0.0, 0.0, 0.0
        self.a_f, self.a_m, self.a_h = demands(work, cores, cpu)
        self.alone = work.device_s()
        self.solo = work.alone_s  # its duration when nothing oversubscribes a resource it uses
        self.busy = 0.0  # the device seconds per second of progress at the current rate


class Fabric:
    """The devices whose lanes share them by the contention rule (module docstring). ``cores``: device name
    to its compute capacity (1 for a GPU, the cores for a CPU); ``penalty``: the interpreter's; ``cpus``:
    the devices that are CPUs (their lanes' Python runs on their cores); ``handover``: the interpreter's
    hand-overs (``HostCosts.interpreter_handover``). ``busy_s`` accumulates, per device, the seconds its
    kernels kept it busy (capped at one per second)."""

    def __init__(
        self,
        cores: dict[str, float],
        penalty: float = 1.0,
        cpus: frozenset[str] = frozenset(),
        handover: float = 0.0,
    ) -> None:
        self.cores, self.penalty, self.cpus, self.handover = dict(cores), penalty, cpus, handover
        self.items: list[_Item] = []
        self.t = 0.0
        self.busy_s = dict.fromkeys(cores, 0.0)

    def submit(self, lane, work: Work, device: str, group: str, now: float) -> None:
        self._advance(now)
        self.items.append(_Item(lane, work, device, group, self.cores[device], device in self.cpus))
        self._reshape({device}, {group})

    def next_time(self) -> float | None:
        return min((it.end for it in self.items), default=None)

    def fire(self, now: float) -> list:
        self._advance(now)
        done = [it for it in self.items if it.progress >= 1.0 - 1e-9 or it.end <= now + _EPS]
        if not done:
            return []
        self.items = [it for it in self.items if it not in done]
        self._reshape({it.device for it in done}, {it.group for it in done})
        return [it.lane for it in done]

    def _advance(self, now: float) -> None:
        dt = now - self.t
        if dt > 0 and self.items:
            share = dict.fromkeys(self.cores, 0.0)
            for it in self.items:
                it.progress += dt * it.rate
                share[it.device] += it.busy
            for name, s in share.items():
                self.busy_s[name] += dt * min(1.0, s)
        self.t = max(self.t, now)

    def _reshape(self, devices: set, groups: set) -> None:
        """Recompute the rates of the works on ``devices`` or in ``groups`` (a work started or ended there);
        the others' demands are unchanged, and so are their rates."""
        s_f, s_m, s_h = {}, {}, {}
        for it in self.items:
            s_f[it.device] = s_f.get(it.device, 0.0) + it.a_f
            s_m[it.device] = s_m.get(it.device, 0.0) + it.a_m
            s_h[it.group] = s_h.get(it.group, 0.0) + it.a_h
        for it in self.items:
            if it.device not in devices and it.group not in groups:
                continue
            f, m, h = s_f[it.device], s_m[it.device], s_h[it.group]
            waits = handover_load(it.a_h, h - it.a_h, self.handover)  # 1 alone in its process
            if f <= 1.0 and m <= 1.0 and h <= 1.0:  # nothing it uses is oversubscribed: its time alone
                duration = it.solo * waits
            else:
                cores = max(1.0, f)
                python = cores if it.device in self.cpus else 1.0
                shared = it.work.duration(cores, max(1.0, m), 1.0, python)
                duration = it.work.duration(cores, max(1.0, m), interpreter_load(h, self.penalty), python)
                duration = max(duration, shared * waits)
            if duration <= 0:
                it.rate, it.end, it.progress, it.busy = 0.0, self.t, 1.0, 0.0
                continue
            it.rate = 1.0 / duration
            it.busy = it.alone / duration  # the device's share of the work's time, at this rate
            it.end = self.t + max(0.0, 1.0 - it.progress) * duration


class ScorerService:
    """The shared scorer GPU of a 7+1 placement (module docstring). ``price(role, batch)`` is the
    :class:`Work` of one forward of ``role`` over ``batch``; ``roles`` the order the service runs its
    models in."""

    def __init__(self, price: Callable[[str, Batch], Work], roles: tuple[str, ...]) -> None:
        self.price, self.roles = price, roles
        self.queue: list[tuple[object, str, Batch]] = []
        self.running: list[tuple[float, list]] = []  # (end, lanes), in end order
        self.start_at: float | None = None
        self.busy_s = 0.0
        self.rounds = 0

    def submit(self, lane, role: str, batch: Batch, now: float) -> None:
        self.queue.append((lane, role, batch))
        if not self.running and self.start_at is None:
            self.start_at = now  # after every lane due now has run: the round takes them all

    def next_time(self) -> float | None:
        if self.running:
            return self.running[0][0]
        return self.start_at

    def fire(self, now: float) -> list:
        woken = []
        while self.running and self.running[0][0] <= now + _EPS:
            woken.extend(self.running.pop(0)[1])
        if not self.running and self.queue:
            if self.start_at is None:
                # Queued during the last round: the next one starts now, once the lanes it woke have run.
                self.start_at = now
            elif self.start_at <= now + _EPS:
                self._start_round(now)
        return woken

    def _start_round(self, now: float) -> None:
        queued, self.queue, self.start_at = self.queue, [], None
        t = now
        for role in self.roles:
            mine = [(lane, b) for lane, r, b in queued if r == role]
            if not mine:
                continue
            merged = Batch(
                tuple(c for _, b in mine for c in b.chunks),
                sum(b.head_rows for _, b in mine),
                sum(b.sampled for _, b in mine),
            )
            work = self.price(role, merged)
            t += work.alone_s
            self.busy_s += work.device_s()
            self.running.append((t, [lane for lane, _ in mine]))
        self.rounds += 1


class TwinExecutor(SimExecutor):
    """A :class:`~oppo_engine.sim.executor.SimExecutor` whose lanes run work on devices: ``work`` blocks the
    calling lane until its work is done on the :class:`Fabric` (or the :class:`ScorerService`), and the
    clock jumps to the next event when no lane can run. ``unit_cost(what)`` is the host :class:`Work` of a
    unit boundary (a hand-off), charged to the lane that reaches it. Lanes inherit the device and process
    (``home``) of the lane that starts them."""

    def __init__(
        self,
        clock: SimClock,
        fabric: Fabric,
        service: ScorerService | None = None,
        unit_cost: Callable[[str], Work | None] | None = None,
    ) -> None:
        super().__init__(random.Random(0), clock, _First(), trace_len=1)
        self.fabric, self.service, self.unit_cost = fabric, service, unit_cost
        self.homes: dict[object, tuple[str, str]] = {}

    def set_home(self, device: str, group: str) -> None:
        """The device and process of the running lane (and of the lanes it starts)."""
        self.homes[self.current] = (device, group)

    def home(self) -> tuple[str, str]:
        return self.homes[self.current]

    def start(self, target, name):
        home = self.homes.get(self.current)
        thread = super().start(target, name)
        if home is not None:
            self.homes[thread.lane] = home
        return thread

    def unit(self, lane: str, what: str) -> None:
        self.units += 1
        if self.unit_cost is not None:
            work = self.unit_cost(what)
            if work is not None:
                self.work(work)

    def work(self, work: Work, device: str | None = None) -> None:
        """Run ``work`` on ``device`` (the lane's own by default) and return when it is done."""
        me = self.current
        home_device, group = self.homes[me]
        me.state, me.deadline, me.cond = WAIT, None, None
        self.fabric.submit(me, work, device or home_device, group, self.clock.now)
        self._block(me, "work")

    def serve(self, role: str, batch: Batch) -> None:
        """Queue ``batch`` for ``role`` on the scorer service and return when its forward is done."""
        me = self.current
        me.state, me.deadline, me.cond = WAIT, None, None
        self.service.submit(me, role, batch, self.clock.now)
        self._block(me, "serve")

    def _next(self, me, what):
        devices = [d for d in (self.fabric, self.service) if d is not None]
        while True:
            self._wake_due()
            runnable = [ln for ln in self.lanes if ln.state == RUN]
            if runnable:
                return self.policy.pick(runnable, me)
            times = [ln.deadline for ln in self.lanes if ln.state == WAIT and ln.deadline is not None]
            times += [t for d in devices if (t := d.next_time()) is not None]
            if not times:
                me.state = RUN
                for ln in self.lanes:
                    if ln is not me and ln.cond is not None:
                        ln.cond.waiters.remove(ln)
                raise SimDeadlock(f"every lane waits with no deadline ({what} in {me.name})")
            self.clock.now = max(self.clock.now, min(times))
            for d in devices:
                for lane in d.fire(self.clock.now):
                    lane.state, lane.deadline = RUN, None
