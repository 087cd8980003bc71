"""The step loop's side of multi-turn episodes: each sequence's environment, driven through the worker pool.

When a sequence's turn ends the actor scheduler parks it and the loop hands the turn here (``turn_ended``);
the call runs on the pool while the actor decodes the others; between forwards the loop takes what
finished (``collect``): an observation is appended to the sequence (never sampled: log-prob 0.0, policy
version -1) and the sequence resumes, or its episode ends; a failure ends it in ``StepResult.failed``.
Calls outlive a step: an episode waiting on a slow call is carried to the next step with it in flight.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from oppo_engine.env.pool import EnvCall, EnvPool
from oppo_engine.env.protocol import check_observation, env_name
from oppo_engine.sched.sequence import SeqStatus, Sequence

RESUME = "resume"  # the observation is appended and the next turn follows


@dataclass(slots=True)
class Answer:
    """What an environment call brought a sequence: ``outcome`` is ``RESUME``, a finish reason
    (``"env_done"``, ``"max_model_len"``), or ``None`` with ``error`` set (the sequence fails)."""

    seq: Sequence
    outcome: str | None
    error: str | None = None


class EnvDriver:
    """Drives the environments of every sequence in flight; only the actor thread calls it.

    ``vocab_size`` and ``max_model_len`` bound observations: an id outside the vocabulary, or an
    observation that would pass ``max_model_len``, ends the sequence with ``"max_model_len"`` and nothing
    appended. ``calls`` counts the ``step`` calls answered, ``latencies`` their seconds (from a worker
    taking the call to its answer), both since the last ``take_counts``.
    """

    def __init__(self, pool: EnvPool, *, vocab_size: int, max_model_len: int) -> None:
        self.pool = pool
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self._calls: dict[EnvCall, Sequence] = {}  # in flight, across steps
        self._ready: list[EnvCall] = []  # finished, for sequences outside the run that collected them
        # Sequences whose environment follows its turn token by token (``decoded``: a streamed agent's).
        self.listening: dict[int, Sequence] = {}
        # A quarantine probe runs (``StepLoop.run(commit=False)``): always rolled back, so no environment is
        # told of its tokens (``decoded``), and one that cannot be rewound is never called (``untouchable``).
        self.probing = False
        self.calls = 0
        self.latencies: list[float] = []

    def take_counts(self) -> tuple[int, list[float]]:
        """The ``step`` calls answered and their latencies since the last call."""
        counts = (self.calls, self.latencies)
        self.calls, self.latencies = 0, []
        return counts

    def begin(self, seq: Sequence) -> str | None:
        """Make the environment of ``seq`` if it has none yet (``factory()`` here, ``reset(prompt_ids)`` on a
        worker); returns the error message if the factory raised."""
        episode = seq.episode
        if episode is None or episode.started or seq.status is not SeqStatus.WAITING:
            return None
        try:
            env = episode.factory()
        except Exception as e:
            factory = getattr(episode.factory, "__qualname__", type(episode.factory).__qualname__)
            return f"environment factory {factory}: {type(e).__name__}: {e}"
        episode.env = env
        if hasattr(env, "decoded"):
            self.listening[seq.seq_id] = seq
            episode.listening = True
        prompt = list(seq.prompt_ids)
        episode.call = self._submit(seq, lambda: _reset(env, prompt), "reset")
        return None

    def untouchable(self, seq: Sequence) -> bool:
        """A probe runs and ``seq``'s environment cannot be rewound (``rewindable = False``: an agent's, whose
        answers reach someone outside the engine): the probe never calls it (no turn, no end, no answer
        taken), so ``seq`` stops there; the probe's rollback finds its environment as the step found it."""
        episode = seq.episode
        return self.probing and episode is not None and not getattr(episode.env, "rewindable", True)

    def decoded(self, live: set[int]) -> list[tuple[Sequence, str]]:
        """After a forward: every listening environment whose sequence is decoding in this run (``live``: seq
        ids, as ``collect``'s; a group left out of the run stays as it was) hears of its turn so far
        (``env.decoded(response_ids, logprobs, turn_start)``; the lists are read-only to it). Never in a
        probe (``probing``): what a probe decodes is always rolled back, and a turn streamed from it could
        reach a client. Returns the sequences whose ``decoded`` raised, with the error: they fail now,
        mid-turn (an agent whose client went away), as a failed ``step`` fails them."""
        if self.probing:
            return []
        failed = []
        for seq in self.listening.values():
            if seq.status is SeqStatus.RUNNING and seq.seq_id in live:
                episode = seq.episode
                try:
                    episode.env.decoded(seq.response_ids, seq.logprobs, episode.turn_start)
                except Exception as e:
                    episode.error = f"environment {env_name(episode.env)}: decoded(): {type(e).__name__}: {e}"
                    failed.append((seq, episode.error))
        return failed

    def rewound(self, seq: Sequence) -> bool:
        """A rolled-back step cut ``seq``'s response back (``Sequence.restore``): a listening environment with
        ``rewound(num_response)`` hears how many response tokens are left, before the retry decodes the rest
        again (so ``decoded`` need not compare the whole turn after every forward to notice a rollback). Every
        listening sequence of an aborted attempt hears it, cut or not. False if it raised: no state of that
        environment can be trusted, and the caller restarts the sequence from its prompt with a fresh one
        (the rollback of the other sequences goes on); a ``RuntimeWarning`` names the environment and the
        error. A sequence the aborted attempt ended (``ended`` stopped its environment listening) and the
        rollback brought back listens again: its retry decodes that turn again."""
        episode = seq.episode
        if seq.seq_id not in self.listening:
            # Listening when the step began (the snapshot's flag, restored), stopped by the aborted attempt.
            if episode is None or not episode.listening or episode.env is None:
                return True
            self.listening[seq.seq_id] = seq
        rewound = getattr(episode.env, "rewound", None)
        if rewound is None:
            return True
        try:
            rewound(len(seq.response_ids))
        except Exception as e:
            warnings.warn(
                f"environment {env_name(episode.env)}: rewound(): {type(e).__name__}: {e}: its sequence "
                "restarts from its prompt with a fresh environment",
                RuntimeWarning,
                stacklevel=2,
            )
            return False
        return True

    def turn_ended(self, seq: Sequence) -> None:
        """``seq``'s turn ended (it is parked): send the turn to its environment, once ``reset`` returned."""
        episode = seq.episode
        start, end = episode.turns[-1]
        turn = seq.response_ids[start:end]
        if episode.ready:
            self._send(seq, turn)
        else:
            episode.pending_turn = turn

    def collect(self, live: set[int]) -> list[Answer]:
        """The answers for sequences of ``live`` (seq ids) finished or expired since the last call; those of
        other sequences are kept for a later run. ``TypeError`` naming the environment if an observation is
        not a list of token ids (the caller's step then fails, as for any bad input)."""
        # NOTE: what finished moves into _ready before anything else, and leaves it only once answered, so
        # an interrupt (Ctrl-C) anywhere in here loses no call; a call seen twice is skipped the second time.
        self.pool.drain_into(self._ready)
        self._ready.extend(self.pool.expire())
        answers: list[Answer] = []
        i = 0
        while i < len(self._ready):
            call = self._ready[i]
            seq = self._calls.get(call)
            if seq is not None and (seq.seq_id not in live or self.untouchable(seq)):
                i += 1  # kept for a later run that holds its sequence (a probe takes no agent's answer)
                continue
            if seq is not None:
                answer = self._answer(seq, call)
                del self._calls[call]
                if answer is not None:
                    answers.append(answer)
            del self._ready[i]
        return answers

    def waiting(self) -> bool:
        """Calls are queued or running."""
        return bool(self._calls)

    def wait(self, timeout: float) -> None:
        """Wait until a call finishes, or ``timeout`` seconds (capped at the next call's expiry)."""
        deadline = self.pool.next_deadline()
        if deadline is not None:
            timeout = max(0.0, min(timeout, deadline - self.pool.clock()))
        self.pool.wait(timeout)

    def cancel(self, seq: Sequence) -> None:
        """Abandon ``seq``'s call in flight, if any (its sequence restarts, fails or leaves); an environment
        with ``end`` is told (``reason=None``)."""
        episode = seq.episode
        if episode is None:
            return
        self.listening.pop(seq.seq_id, None)
        episode.listening = False
        for call in [c for c, s in self._calls.items() if s is seq]:
            del self._calls[call]
            self.pool.abandon(call)
        self._ready = [c for c in self._ready if c in self._calls]
        episode.call = None
        end = getattr(episode.env, "end", None)
        if end is not None:
            end([], [], None)

    def ended(self, seq: Sequence) -> None:
        """``seq``'s episode ended without its environment's word (EOS, a length limit, ``max_turns``): an
        environment with ``end`` is told, with the turn that was cut (an agent gets it as its answer, so this
        counts as a call: a rollback across it restarts the episode)."""
        if self.untouchable(seq):
            return  # a probe ends it: the rollback puts it back as the step found it
        episode = seq.episode
        self.listening.pop(seq.seq_id, None)
        if episode is not None:
            episode.listening = False
        end = getattr(episode.env, "end", None) if episode is not None else None
        if end is None or episode.done_by_env:
            return
        episode.steps += 1
        start = (
            episode.turns[-1][0]
            if episode.turns and episode.turns[-1][1] == len(seq.response_ids)
            else (episode.turn_start)
        )
        end(seq.response_ids[start:], seq.logprobs[start:], seq.finish_reason)

    def hold(self, seq: Sequence) -> bool:
        """``seq``'s episode ended without its environment's word (as for ``ended``). An environment with
        ``after_end(reason)`` (an agent's, which may still give the reward) is told (``ended``) and then asked
        for its last word: a call whose done observation (its reward, ``None``: the scorers') ends ``seq``,
        which waits for it, parked. False if there is none to ask: ``seq`` ends now."""
        episode = seq.episode
        if self.untouchable(seq):
            return False
        after_end = getattr(episode.env, "after_end", None) if episode is not None else None
        if after_end is None or episode.done_by_env or not episode.ready or episode.call is not None:
            return False
        reason = seq.finish_reason
        self.ended(seq)
        episode.steps += 1
        episode.call = self._submit(seq, lambda: after_end(reason), "step")
        return True

    def close(self) -> None:
        """Cancel every call pending and let the workers go."""
        self._calls.clear()
        self._ready = []
        self.pool.close()

    # -- internals -------------------------------------------------------------------------------------

    def _submit(self, seq: Sequence, fn: Callable[[], object], kind: str) -> EnvCall:
        call = self.pool.submit(seq.seq_id, fn, kind)
        self._calls[call] = seq
        return call

    def _send(self, seq: Sequence, turn: list[int]) -> None:
        episode = seq.episode
        episode.steps += 1
        env = episode.env
        if getattr(env, "step_logprobs", False):
            start, end = episode.turns[-1]
            logprobs = seq.logprobs[start:end]
            episode.call = self._submit(seq, lambda: env.step(list(turn), logprobs), "step")
        else:
            episode.call = self._submit(seq, lambda: env.step(list(turn)), "step")

    def _answer(self, seq: Sequence, call: EnvCall) -> Answer | None:
        episode = seq.episode
        episode.call = None
        if call.kind == "reset":
            if seq.status in (SeqStatus.FINISHED, SeqStatus.SCORED):
                return None  # its episode ended before it needed the environment
            if call.error is not None:
                return self._failed(seq, call)
            episode.ready = True
            if episode.pending_turn is not None:
                turn, episode.pending_turn = episode.pending_turn, None
                self._send(seq, turn)
            return None
        episode.answers += 1
        self.calls += 1
        self.latencies.append(call.latency_s)
        if call.error is not None:
            return self._failed(seq, call)
        obs = check_observation(call.result, episode.env)
        return Answer(seq, self._observe(seq, obs))

    def _failed(self, seq: Sequence, call: EnvCall) -> Answer:
        error = call.error
        episode = seq.episode
        message = f"environment {env_name(episode.env)}: {call.kind}(): {type(error).__name__}: {error}"
        episode.error = message
        return Answer(seq, None, message)

    def _observe(self, seq: Sequence, obs) -> str:
        """Append ``obs`` to ``seq``; the outcome (``RESUME`` or a finish reason)."""
        episode = seq.episode
        tokens = obs.tokens
        cap = seq.sampling.max_observation_tokens
        if cap is not None and len(tokens) > cap:
            tokens = tokens[:cap]
            episode.truncated += 1
        # NOTE: nothing is cut silently: an observation that does not fit, or holds an id the actor cannot
        # read, ends the sequence before any of it is appended.
        if any(not 0 <= t < self.vocab_size for t in tokens):
            return "max_model_len"
        if seq.num_tokens + len(tokens) > self.max_model_len:
            return "max_model_len"
        start = len(seq.response_ids)
        seq.response_ids.extend(tokens)
        seq.logprobs.extend([0.0] * len(tokens))
        seq.policy_versions.extend([-1] * len(tokens))
        episode.observed(start, len(seq.response_ids))
        if obs.next_turn_tokens is not None:
            episode.turn_tokens = obs.next_turn_tokens
        if obs.done:
            episode.reward, episode.done_by_env = obs.reward, True
            return obs.finish_reason
        if seq.num_tokens >= self.max_model_len:
            return "max_model_len"  # no room left for a sampled token
        return RESUME


def _reset(env, prompt_ids: list[int]):
    """``env.reset(prompt_ids)``, awaited if it is a coroutine; the result is the environment."""
    result = env.reset(prompt_ids)
    if inspect.isawaitable(result):

        async def then():
            await result
            return env

        return then()
    return env
