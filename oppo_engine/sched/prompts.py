"""Prompt intake: the queue of prompts not yet in flight, their validation, and each sequence's seed."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass

from oppo_engine.config import SamplingParams
from oppo_engine.sched.episode import Episode
from oppo_engine.sched.sequence import Sequence as Seq
from oppo_engine.sched.state import load_sequence, save_sequence

EnvFactory = Callable[[], object]
_TURN_KNOBS = ("turn_stop_token_ids", "max_turn_tokens", "max_turns", "max_observation_tokens")


def turn_knobs_set(params: SamplingParams) -> list[str]:
    """The multi-turn settings of ``params`` that are set (they need an environment)."""
    return [name for name in _TURN_KNOBS if getattr(params, name) not in ((), None)]


def derive_seed(base_seed: int, prompt_index: int) -> int:
    """A sequence's RNG seed from the engine seed and its prompt's index (splitmix64, 63 bits)."""
    z = (base_seed * 0x9E3779B97F4A7C15 + prompt_index + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF


# How long take() waits for the next announced prompt once it has some work (served first requests come in
# bursts: an agent's first request follows its episode's opening within milliseconds in-process).
ADMIT_GAP_S = 0.05
_WAKE_S = 0.5  # how often a take() with nothing to run looks again (a Ctrl-C gets through)

# Mixed into a prompt's seed for its samples 1..n-1, so that they do not replay the seeds of other prompts.
_SAMPLE_SALT = 0x5DEECE66D
# Mixed into the engine seed for a data-parallel rank's own base seed.
_RANK_SALT = 0x2545F4914F6CDD1D


def rank_seed(base_seed: int, rank: int) -> int:
    """A data-parallel rank's base seed: ranks that share the engine seed never draw the same noise."""
    return derive_seed(base_seed ^ _RANK_SALT, rank)


def sample_seed(prompt_seed: int, sample_index: int) -> int:
    """Sample ``sample_index``'s seed in a group: the prompt's own seed for sample 0, else derived from it."""
    if sample_index == 0:
        return prompt_seed
    return derive_seed(prompt_seed ^ _SAMPLE_SALT, sample_index)


@dataclass(frozen=True, slots=True)
class _Group:
    """A group of ``add_group``: one sequence per member, each its own prompt, sampling and environment."""

    prompts: list[list[int]]
    sampling: list[SamplingParams]
    envs: list[EnvFactory]


class PromptQueue:
    """Prompts waiting for a step, in order: sequences a failed step gave back first, then the queued
    prompts, then a lazy source. Every prompt is checked against ``max_model_len`` and the vocabulary
    before it is queued; a sequence's seed derives from ``sampling.seed`` and its prompt's index (and
    ``rank``, a data-parallel rank's index, unless ``None``) unless its own ``SamplingParams`` give one, so
    rollouts do not depend on batch composition.

    A prompt becomes ``sampling.n`` sequences (a group), taken together: ``take`` hands out whole groups.
    ``env`` is the engine's environment factory (``None``: none); a prompt queued with its own factory
    runs in that one. Each sequence of a group gets its own ``Episode`` (its own environment instance).

    ``add_group`` queues sequences that form one group without being samples of one prompt (``n`` agents on
    one task, each with its own first request): they share a group id (one prompt index), are taken, cut,
    carried and failed together, and share no KV.

    ``add`` and ``add_group`` are safe from any thread (``RolloutEngine.add_prompts`` is): they append under a
    lock, which ``take`` and ``state_dict`` hold while they read the queue.

    ``expect(k)`` announces prompts on their way (a served episode opened, its first request not in yet):
    ``take`` waits for them -- until one comes when the step would hold nothing at all, then for as long as
    they keep coming within ``ADMIT_GAP_S`` of each other, up to the places it fills (DESIGN.md: first
    requests are admitted up to B + Δ).
    """

    def __init__(
        self,
        sampling: SamplingParams,
        *,
        max_model_len: int,
        vocab_size: int,
        rank: int | None = None,
        env: EnvFactory | None = None,
    ) -> None:
        if env is not None and not callable(env):
            raise TypeError(f"env must be an environment factory (a class or a function), got {env!r}")
        self.sampling = sampling
        self.rank = rank
        self.env = env
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.requeued: deque[Seq] = deque()  # new sequences of a failed step, rolled back, taken first
        self._pending: deque[tuple[list[int], SamplingParams | None, EnvFactory | None]] = deque()
        self._source: Iterator[Sequence[int]] | None = None
        self._next_prompt_index = 0
        self._next_seq_id = 0
        self._lock = threading.Condition()  # add(), expect() from any thread; the rest from the engine's
        self._expected = 0  # prompts announced by expect(), not yet added
        # Called with a prompt's group size before add() queues it (ValueError refuses it): the serving
        # endpoint's one-group-size-at-a-time rule (serve/server.py).
        self.size_check: Callable[[int], None] | None = None
        # Whether the step has work that needs no prompt (a served endpoint's evaluation requests): then
        # take() does not wait for announced prompts when it has nothing else. ``wake()`` when it turns true.
        self.side_work: Callable[[], bool] | None = None
        # Groups that failed before they had a sequence (a served episode whose agent raised before its first
        # request): [(prompts, errors)], returned by the next step in StepResult.failed (take_failed).
        self._failed: list[tuple[list[list[int]], list[str]]] = []
        self.check_sampling(sampling, "sampling")

    def check_sampling(self, params: SamplingParams, where: str, env: EnvFactory | None = None) -> None:
        """ValueError if ``params`` names a stop or turn-stop token outside the vocabulary (it could never be
        sampled), or sets a multi-turn setting for a prompt with no environment (``env``, else the
        engine's)."""
        for name in ("stop_token_ids", "turn_stop_token_ids"):
            bad = next((t for t in getattr(params, name) if t >= self.vocab_size), None)
            if bad is not None:
                raise ValueError(f"{where}.{name} holds {bad}, outside the vocabulary [0, {self.vocab_size})")
        knobs = turn_knobs_set(params)
        if knobs and env is None and self.env is None:
            raise ValueError(
                f"{where}.{knobs[0]}={getattr(params, knobs[0])!r} needs an environment: multi-turn "
                "settings apply to episodes only; pass RolloutEngine(env=factory), or "
                "add_prompts(..., envs=[...]) for these prompts"
            )

    def validate(self, where: str, ids: Sequence[int]) -> list[int]:
        """``ids`` as a list of ints, or ValueError naming ``where`` and the limit it breaks."""
        ids = [int(t) for t in ids]
        if not ids:
            raise ValueError(f"{where} is empty: a prompt needs at least one token")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"{where} has {len(ids)} tokens; max_model_len={self.max_model_len} leaves room for prompts "
                f"of at most {self.max_model_len - 1} tokens"
            )
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"{where} holds token id {bad}, outside the vocabulary [0, {self.vocab_size})")
        return ids

    def add(
        self,
        prompts: Iterable[Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams] | None,
        envs: Sequence[EnvFactory | None] | None = None,
    ) -> None:
        """Queue ``prompts``; all are validated before any is queued, so a bad call queues nothing.
        ``sampling`` is one ``SamplingParams`` for all of them, or one per prompt; ``envs`` one environment
        factory per prompt (``None`` entries: the engine's)."""
        prompts = list(prompts)
        envs = self._check_envs(envs, len(prompts))
        if isinstance(sampling, SamplingParams):
            sampling = [sampling] * len(prompts)
        if sampling is not None:
            if not isinstance(sampling, Iterable):
                raise TypeError(
                    f"sampling must be a SamplingParams or a list of them, got {type(sampling).__name__}"
                )
            sampling = list(sampling)
            # NOTE: the type before the length: a str is iterable, and no list of SamplingParams.
            if not all(isinstance(s, SamplingParams) for s in sampling):
                raise TypeError("sampling must be a SamplingParams or a list of them")
            if len(sampling) != len(prompts):
                raise ValueError(f"sampling has {len(sampling)} entries for {len(prompts)} prompts")
            for i, s in enumerate(sampling):
                self.check_sampling(s, f"sampling[{i}]", envs[i])
            other = next((i for i, s in enumerate(sampling) if s.n != self.sampling.n), None)
            if other is not None:
                raise ValueError(
                    f"sampling[{other}].n={sampling[other].n}, but this engine samples every prompt "
                    f"n={self.sampling.n} times: all prompts of one engine use the same n"
                )
        checked = [self.validate(f"prompt_token_ids[{i}]", p) for i, p in enumerate(prompts)]
        if checked and self.size_check is not None:
            self.size_check(self.sampling.n)
        per_prompt = sampling if sampling is not None else [None] * len(checked)
        with self._lock:
            self._pending.extend(zip(checked, per_prompt, envs, strict=True))
            self._lock.notify_all()

    def add_group(
        self, prompts: Sequence[Sequence[int]], sampling: Sequence[SamplingParams], envs: Sequence[EnvFactory]
    ) -> None:
        """Queue ``prompts`` as one group (see the class), each sampled once with its ``sampling`` (its seed
        given) in its environment; validated as ``add`` validates."""
        if self.sampling.n != 1:
            raise ValueError(f"add_group: this engine samples every prompt n={self.sampling.n} times")
        if not (len(prompts) == len(sampling) == len(envs)) or not prompts:
            raise ValueError("add_group: one SamplingParams and one environment per prompt, at least one")
        for i, s in enumerate(sampling):
            self.check_sampling(s, f"sampling[{i}]", envs[i])
            if s.n != 1 or s.seed is None:
                raise ValueError(f"add_group: sampling[{i}] must sample once (n=1) with its seed given")
        checked = [self.validate(f"prompt_token_ids[{i}]", p) for i, p in enumerate(prompts)]
        with self._lock:
            self._pending.append(_Group(checked, list(sampling), list(envs)))
            self._lock.notify_all()

    @property
    def busy(self) -> bool:
        """Prompts are queued, given back, announced or drawn from a source, or failed groups wait."""
        return bool(
            self._pending or self.requeued or self._expected or self._source is not None or self._failed
        )

    def add_failed(self, prompts: list[list[int]], errors: list[str]) -> None:
        """A group that failed before it had a sequence (from any thread): one member per prompt (``[]``: it
        never had one), each with its error; the next step returns it in ``StepResult.failed``."""
        with self._lock:
            self._failed.append(([list(p) for p in prompts], list(errors)))
            self._lock.notify_all()

    def take_failed(self) -> list[tuple[int, list[list[int]], list[str]]]:
        """The groups of ``add_failed`` since the last call, each with a group id of its own (a prompt index:
        never another group's)."""
        with self._lock:
            failed, self._failed = self._failed, []
        out = []
        for prompts, errors in failed:
            out.append((self._next_prompt_index, prompts, errors))
            self._next_prompt_index += 1
        return out

    def expect(self, k: int) -> None:
        """``k`` more prompts are on their way (negative: fewer; from any thread); see the class."""
        with self._lock:
            self._expected = max(0, self._expected + k)
            self._lock.notify_all()

    def wake(self) -> None:
        """Side work came (from any thread): a ``take`` waiting for announced prompts looks again."""
        with self._lock:
            self._lock.notify_all()

    def give_back(self, seqs: list[Seq]) -> None:
        """New sequences of a step rolled back, first in line again (in whole groups, in their order)."""
        self.requeued.extendleft(reversed(seqs))

    def _await_expected(self, n: int, holding: int) -> None:
        with self._lock:
            while self._expected > 0 and len(self._pending) < n:
                before = len(self._pending)
                if before + len(self.requeued) + holding == 0:
                    if self._failed or (self.side_work is not None and self.side_work()):
                        return  # the step has work of its own meanwhile: it joins that step, or the next
                    self._lock.wait(_WAKE_S)  # nothing to run: wait for the first (or for none expected)
                elif not self._lock.wait_for(lambda before=before: len(self._pending) > before, ADMIT_GAP_S):
                    return  # none came within the gap: run what there is

    @staticmethod
    def _check_envs(envs, count: int) -> list[EnvFactory | None]:
        if envs is None:
            return [None] * count
        if isinstance(envs, str) or not isinstance(envs, Iterable):
            raise TypeError(f"envs must be a list of environment factories (one per prompt), got {envs!r}")
        envs = list(envs)
        if len(envs) != count:
            raise ValueError(f"envs has {len(envs)} entries for {count} prompts: one factory per prompt")
        bad = next((i for i, e in enumerate(envs) if e is not None and not callable(e)), None)
        if bad is not None:
            raise TypeError(
                f"envs[{bad}] is {envs[bad]!r}, not an environment factory (a class or a function returning "
                "an Env)"
            )
        return envs

    def set_source(self, source: Iterable[Sequence[int]]) -> None:
        """Pull prompts lazily from ``source`` once the queued ones run out."""
        self._source = iter(source)

    def take(self, n: int, holding: int = 0, wait: bool = True) -> list[Seq]:
        """Up to ``n`` sequences in whole groups (``n`` is rounded up to a multiple of the group size), fewer
        once every supply is exhausted. A bad prompt from the source raises; the good ones taken before it
        stay first in line. ``holding``: sequences the step holds already (prompts ``expect``-ed are waited
        for as the class says, unless ``wait=False``: the step loop's admission in the middle of a step)."""
        if self._expected and wait:
            self._await_expected(n, holding)
        seqs: list[Seq] = []
        while len(seqs) < n:
            if self.requeued:
                group = self.requeued[0].group_n
                seqs.extend(self.requeued.popleft() for _ in range(group))  # given back in whole groups
                continue
            env = None
            with self._lock:
                queued = self._pending.popleft() if self._pending else None
            if isinstance(queued, _Group):
                seqs.extend(self._new_members(queued))
                continue
            if queued is not None:
                ids, params, env = queued
            elif self._source is not None:
                try:
                    raw = next(self._source)
                except StopIteration:
                    self._source = None
                    break
                except BaseException:  # the source's own failure: what was taken stays first in line
                    self.requeued.extendleft(reversed(seqs))
                    raise
                try:
                    ids, params = self.validate("a prompt from the prompt source", raw), None
                except ValueError:
                    self.requeued.extendleft(reversed(seqs))
                    raise
            else:
                break
            seqs.extend(self._new_group(ids, params, env))
        return seqs

    def _new_group(self, ids: list[int], params: SamplingParams | None, env: EnvFactory | None) -> list[Seq]:
        index = self._next_prompt_index
        self._next_prompt_index += 1
        if params is not None and params.seed is not None:
            seed = params.seed
        else:
            base = self.sampling.seed or 0
            if self.rank is not None:  # (seed, rank, local index): group_id stays the local index
                base = rank_seed(base, self.rank)
            seed = derive_seed(base, index)
        params = params or self.sampling
        factory = env if env is not None else self.env
        group = []
        for j in range(params.n):
            seq = Seq(self._next_seq_id, index, ids, params, sample_seed(seed, j), sample_index=j)
            if factory is not None:
                seq.episode = Episode(factory, engine_factory=env is None)
            group.append(seq)
            self._next_seq_id += 1
        return group

    def _new_members(self, group: _Group) -> list[Seq]:
        index = self._next_prompt_index
        self._next_prompt_index += 1
        members = []
        for j, (ids, params, env) in enumerate(zip(group.prompts, group.sampling, group.envs, strict=True)):
            seq = Seq(self._next_seq_id, index, ids, params, params.seed, sample_index=j)
            seq.group_size = len(group.prompts)
            seq.episode = Episode(env)
            members.append(seq)
            self._next_seq_id += 1
        return members

    def state_dict(self) -> dict:
        """Queued prompts, given-back sequences and the counters (a prompt source is not saved). A group of
        ``add_group`` is saved as its members' prompts plus its span of them (``pending_groups``: ``[start,
        size]``), so it loads as one group again; the groups of ``add_failed`` not yet reported are saved
        (``failed``) and reported by the loading engine's next step."""
        with self._lock:
            pending, groups = [], []
            for entry in self._pending:
                if isinstance(entry, _Group):
                    groups.append([len(pending), len(entry.prompts)])
                    pending += zip(entry.prompts, entry.sampling, entry.envs, strict=True)
                else:
                    pending.append(entry)
            failed = [[[list(p) for p in prompts], list(errors)] for prompts, errors in self._failed]
        return {
            "next_prompt_index": self._next_prompt_index,
            "next_seq_id": self._next_seq_id,
            "requeued": [save_sequence(s) for s in self.requeued],
            "pending": [(list(ids), None if p is None else asdict(p)) for ids, p, _ in pending],
            # A prompt's own environment factory, saved as the object (pickled with the state); None: the
            # engine's env=, which the loading engine gives.
            "pending_envs": [env for _, _, env in pending],
            "pending_groups": groups,
            "failed": failed,
        }

    def load_state_dict(self, state: dict) -> None:
        """Replace the queue with ``state``'s."""
        self._next_prompt_index = state["next_prompt_index"]
        self._next_seq_id = state["next_seq_id"]
        self.requeued = deque(load_sequence(d, self.env) for d in state["requeued"])
        envs = state.get("pending_envs") or [None] * len(state["pending"])
        entries = [
            (list(ids), None if p is None else SamplingParams(**p), env)
            for (ids, p), env in zip(state["pending"], envs, strict=True)
        ]
        pending: deque = deque()
        spans = dict(state.get("pending_groups", []))  # start -> size (absent from older states: no groups)
        i = 0
        while i < len(entries):
            size = spans.get(i)
            if size is None:
                pending.append(entries[i])
                i += 1
                continue
            members = entries[i : i + size]
            pending.append(_Group([m[0] for m in members], [m[1] for m in members], [m[2] for m in members]))
            i += size
        with self._lock:
            self._pending = pending
            self._failed = [(prompts, errors) for prompts, errors in state.get("failed", [])]
