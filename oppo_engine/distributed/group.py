"""Data-parallel engine groups: one ``RolloutEngine`` per rank, whose online controllers agree.

Under ``RolloutEngine(..., process_group=pg)`` each rank runs its own engine over its own prompts and
``batch_size`` counts that rank's rollouts. The constructor, ``step()`` and ``report_reward()`` are
collective: every rank calls them in the same order. What the ranks exchange, all of it through
``all_gather_object`` on ``pg`` (small Python objects; every exchange carries the name of the engine call,
so ranks that call different methods are caught instead of pairing unrelated messages):

- at construction, the settings the controllers and the batch cut read (:data:`AGREED_SETTINGS`) and where
  each rank's cache lives (ranks on one host share its memory: the default arena is divided among them);
- at the start of a streamed step, rank 0's chunk size ``C`` (its decision, taken by every rank);
- at the end of a step, what each rank measured (:class:`StepReport`): the controllers are fed the group's
  numbers -- the summed rewards and tokens, the slowest per-token step time, the field-wise largest
  switch-cost profile -- so ``delta_history`` and ``chunk_history`` are identical on every rank;
- in ``report_reward(x)``, every rank's ``x`` (the controller is fed their mean).

Faults. Every collective runs under the group's own timeout (``init_process_group(timeout=...)``; gloo's
default is 30 minutes). A rank whose call fails locally (an exception in its step, rolled back as without
a group) sends its peers a failure notice in place of its next exchange: they roll their call back too and
raise :class:`PeerCallFailed`, and the group stays usable (a retry on every rank is exact). A collective
that fails (a peer died, or did not arrive within the timeout) raises :class:`GroupFailed`, naming the
collective and the engine call; from then on the engine supports only ``state_dict()`` and ``close()``,
neither of which communicates, so no rank hangs on a dead peer.
"""

from __future__ import annotations

import functools
import math
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.distributed as dist

from oppo_engine.control import SwitchProfile
from oppo_engine.sched.online import StepReport

# Settings every rank must share (EngineConfig fields, and SamplingParams.n): the controllers and the batch
# cut read them, so ranks that differed would decide differently and their collectives would stop pairing.
AGREED_SETTINGS = (
    "mode",
    "batch_size",
    "n",
    "overcommit",
    "chunk_size",
    "delta",
    "chunk",
    "max_deferrals",
    "retained_kv",
)
_COLLECTIVE = "all_gather_object"


class GroupFailed(RuntimeError):
    """A collective of the engine's process group failed: a peer died, did not arrive within the group's
    timeout, or called another engine method. The engine then supports only ``state_dict()`` and
    ``close()``."""


class PeerCallFailed(RuntimeError):
    """Another rank's call failed locally (and rolled back); this rank rolled its call back too. The group
    is intact: retrying the call on every rank is exact."""


@dataclass(frozen=True, slots=True)
class _Failure:
    """A failure notice: the rank's call failed locally and was rolled back."""

    error: str


def engine_settings(config, sampling) -> dict[str, Any]:
    """The values of :data:`AGREED_SETTINGS` for an ``EngineConfig`` and the default ``SamplingParams``."""
    return {name: sampling.n if name == "n" else getattr(config, name) for name in AGREED_SETTINGS}


def settings_mismatch(settings: Sequence[dict[str, Any]]) -> str | None:
    """What differs between the ranks' settings (rank order), against rank 0's; ``None`` if nothing."""
    problems = []
    for name in AGREED_SETTINGS:
        base = settings[0][name]
        other = [f"{s[name]!r} on rank {r}" for r, s in enumerate(settings) if s[name] != base]
        if other:
            problems.append(f"{name} is {base!r} on rank 0 but {', '.join(other)}")
    return "; ".join(problems) or None


def slowest_profile(profiles: Sequence[SwitchProfile | None]) -> SwitchProfile | None:
    """The field-wise largest of the measured profiles (``None`` entries skipped; ``None`` if all are): the
    slowest lane costs, and the largest slowdown per chunk size any rank measured."""
    measured = [p for p in profiles if p is not None]
    if not measured:
        return None
    slowdown: dict[int, float] = {}
    for p in measured:
        for size, value in p.slowdown.items():
            slowdown[size] = max(slowdown.get(size, value), value)
    names = [f.name for f in fields(SwitchProfile) if f.name != "slowdown"]
    values = {n: [getattr(p, n) for p in measured if getattr(p, n) is not None] for n in names}
    return SwitchProfile(slowdown=slowdown, **{n: max(v) if v else None for n, v in values.items()})


def memory_key(device: torch.device) -> tuple:
    """Where a cache on ``device`` takes its memory from: the host's RAM, or one GPU of the host."""
    host = socket.gethostname()
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return (host, "cuda", str(getattr(props, "uuid", device.index)))
    return (host, "host")


def join_group(process_group, config, sampling, device: torch.device) -> EngineGroup | None:
    """The engine's group over ``process_group`` (``None``: no group), after the one collective that checks
    the settings; ValueError on every rank if they differ."""
    if process_group is None:
        return None
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            "process_group must be a torch.distributed ProcessGroup or None, got "
            f"{type(process_group).__name__}"
        )
    _check_nccl_device(process_group, device)
    group = EngineGroup(process_group)
    group.check_settings(engine_settings(config, sampling), memory_key(device))
    return group


def _check_nccl_device(process_group, device: torch.device) -> None:
    """ValueError if ``process_group`` runs NCCL and this rank's current CUDA device is not the engine's:
    NCCL's object collectives (every exchange here) run on the current device, so ranks left on the
    default ``cuda:0`` would all exchange on one GPU (NCCL fails or hangs) instead of on their own."""
    try:
        backend = dist.get_backend(process_group)
    except (RuntimeError, ValueError):  # a group torch.distributed does not know: not an NCCL world's
        return
    if backend != "nccl" or device.type != "cuda" or device.index is None:
        return
    current = torch.cuda.current_device()
    if current != device.index:
        raise ValueError(
            f"process_group: an NCCL group exchanges on the current CUDA device (cuda:{current}), but this "
            f"engine's models are on {device}: call torch.cuda.set_device({device.index}) on this rank "
            "before building the engine, or pass a gloo group over the same ranks "
            '(dist.new_group(backend="gloo"), as docs/scale-out.md recommends)'
        )


class EngineGroup:
    """One engine's view of its data-parallel process group: the exchanges of the collective calls, and
    whether the group has failed (see the module docstring)."""

    def __init__(self, process_group: dist.ProcessGroup) -> None:
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        # Ranks (this one included) whose caches take memory from where this rank's does.
        self.ranks_sharing_memory = 1
        self.failure: str | None = None  # why the group failed; None while it works
        self._call: str | None = None  # the collective engine call in progress
        # "open": the peers do not know how the call ends; "settled": they do (an exchange told them of a
        # failure); "agreed": the group committed the call, so a later local failure diverges the ranks.
        self._state = "agreed"

    # ------------------------------------------------------------------ calls

    def check(self) -> None:
        """GroupFailed if an earlier collective failed: then only ``state_dict()`` and ``close()`` work."""
        if self.failure is not None:
            raise GroupFailed(
                f"RolloutEngine: the process group failed earlier ({self.failure}); only state_dict() and "
                "close() work now: restart the job from every rank's state_dict()"
            )

    def begin(self, call: str) -> None:
        """Start the collective engine call ``call`` (its name goes with each of its exchanges)."""
        self._call, self._state = call, "open"

    def failed(self, exc: BaseException) -> None:
        """The call in progress raised ``exc`` on this rank: tell the peers, unless they know already (they
        then roll back and raise :class:`PeerCallFailed`). After the group agreed on the call, the ranks'
        states have diverged: the group fails."""
        if self.failure is not None or self._state == "settled":
            return
        if self._state == "agreed":
            self.failure = f"{self._call} failed on rank {self.rank} after the group agreed on it: {exc!r}"
            return
        try:
            self._exchange(_Failure(f"{type(exc).__name__}: {exc}"))
        except BaseException:  # noqa: BLE001 - the peers' news or a failed notice; the caller raises exc
            pass
        self._state = "settled"

    # ------------------------------------------------------------------ exchanges

    def check_settings(self, settings: dict[str, Any], memory: tuple) -> None:
        """The constructor's collective: ValueError on every rank naming each setting that differs (and on
        which ranks); counts the ranks sharing this rank's memory."""
        self.begin("RolloutEngine()")
        gathered = self._exchange((settings, memory))
        self._state = "agreed"
        mismatch = settings_mismatch([s for s, _ in gathered])
        if mismatch is not None:
            raise ValueError(
                f"process_group: the ranks' engine settings differ: {mismatch}. Every rank must build its "
                f"engine with the same {', '.join(AGREED_SETTINGS)} (batch_size counts each rank's rollouts)"
            )
        self.ranks_sharing_memory = sum(1 for _, m in gathered if m == memory)

    def agree_chunk_size(self, chunk_size):
        """Rank 0's chunk size (or "off") for this step: it decides, every rank takes it (a broadcast, sent
        as an all-gather of every rank's proposal so that it carries the call's name like every exchange)."""
        return self._exchange(chunk_size)[0]

    def end_step(self, report: StepReport) -> StepReport:
        """The group's :class:`StepReport` from every rank's (the last exchange of ``step()``)."""
        reports = self._exchange(report)
        tokens = sum(r.tokens for r in reports)
        slowest = max((r.wall_s / r.tokens for r in reports if r.tokens), default=0.0)
        group = StepReport(
            tokens=tokens,
            wall_s=slowest * tokens,
            reward_sum=math.fsum(r.reward_sum for r in reports),
            rewards=sum(r.rewards for r in reports),
            profile=slowest_profile([r.profile for r in reports]),
        )
        self._state = "agreed"
        return group

    def mean_reward(self, reward: float) -> float:
        """The collective of ``report_reward()``: the mean of every rank's ``reward``; ValueError on every
        rank naming the ranks whose value is not a finite number."""
        self.begin("report_reward()")
        # Only a plain number travels: anything else goes as its description (a CUDA tensor pickled to the
        # peers would be unpickled onto the sender's GPU there), and every rank refuses it below.
        values = self._exchange(reward if _is_finite(reward) else f"{type(reward).__name__} {reward!r}"[:200])
        bad = [f"{v} on rank {r}" for r, v in enumerate(values) if not _is_finite(v)]
        if bad:
            raise ValueError(
                f"report_reward: reward must be a finite number on every rank, got {', '.join(bad)}"
            )
        self._state = "agreed"
        return math.fsum(float(v) for v in values) / len(values)

    def _exchange(self, payload: Any) -> list[Any]:
        """Every rank's ``payload``, in rank order; raises if the collective fails, if a rank called another
        method, or if a peer sent a failure notice."""
        self.check()
        call = self._call
        gathered: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(gathered, (call, payload), group=self.process_group)
        except BaseException as exc:
            self._state = "settled"
            self.failure = f"{_COLLECTIVE} in {call} failed on rank {self.rank}: {type(exc).__name__}: {exc}"
            if not isinstance(exc, Exception):
                raise
            raise GroupFailed(
                f"{call}: {_COLLECTIVE} on the process group failed on rank {self.rank} (a peer "
                f"died or did not reach it within the group's timeout): {exc}. Only state_dict() and close() "
                "work now: restart the job from every rank's state_dict()"
            ) from exc
        calls = [c for c, _ in gathered]
        if any(c != call for c in calls):
            self._state = "settled"
            self.failure = "the ranks called different engine methods: " + ", ".join(
                f"rank {r} {c}" for r, c in enumerate(calls)
            )
            raise GroupFailed(
                f"{call}: {self.failure} (every rank must call the collective methods in the "
                "same order). Only state_dict() and close() work now"
            )
        payloads = [p for _, p in gathered]
        notices = [f"rank {r}: {p.error}" for r, p in enumerate(payloads) if isinstance(p, _Failure)]
        if notices and not isinstance(payload, _Failure):
            self._state = "settled"
            raise PeerCallFailed(
                f"{call}: {'; '.join(notices)}. Rolled back here (rank {self.rank}) too, as on "
                f"every rank; the group is intact: retry {call} on every rank"
            )
        return payloads


def collective(call: str) -> Callable:
    """Decorate a ``RolloutEngine`` method that is collective under a process group: a failure on this rank
    is sent to the peers (see :meth:`EngineGroup.failed`). Without a group the method runs as it is."""

    def decorate(method: Callable) -> Callable:
        @functools.wraps(method)
        def run(engine, *args, **kwargs):
            group: EngineGroup | None = engine._group
            if group is None:
                return method(engine, *args, **kwargs)
            group.begin(call)
            try:
                result = method(engine, *args, **kwargs)
            except BaseException as exc:
                group.failed(exc)
                raise
            group._state = "agreed"
            return result

        return run

    return decorate


def _is_finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
