"""The environment of a multi-turn episode, as the engine sees it: tokens in, tokens out.

An environment never sees text unless it decodes it itself (``ToolEnv`` does), and nothing already in a
sequence is re-encoded: what ``step`` returns is appended after the turn as it was sampled.
"""

from __future__ import annotations

import numbers
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@dataclass(slots=True)
class Observation:
    """What an environment answers to a turn.

    ``tokens`` are appended to the sequence and never sampled (``Rollout.action_mask`` 0; a done
    observation's too; they may be empty). ``done`` ends the episode (``finish_reason="env_done"``).
    ``reward``, given with ``done``, is the episode's reward (``Rollout.reward``); ``None`` leaves the
    reward to the engine's reward model or function, which reads the whole transcript. ``finish_reason`` is
    the rollout's when ``done`` (an agent's episode ends with ``"agent_done"``). ``next_turn_tokens``
    (``None``: unchanged) bounds the next turn's sampled tokens, as ``SamplingParams.max_turn_tokens`` does
    (an agent's ``max_tokens`` of its next request).
    """

    tokens: list[int] = field(default_factory=list)
    done: bool = False
    reward: float | None = None
    finish_reason: str = "env_done"
    next_turn_tokens: int | None = None


@runtime_checkable
class Env(Protocol):
    """One episode's environment. The engine calls ``factory()`` once per sequence (every sample of a group
    gets its own instance), then ``reset(prompt_ids)`` once, then ``step(turn_ids)`` after every turn with
    that turn's sampled tokens (a turn-stop token included). Both run on a worker thread, off the actor
    lane; ``step`` may be a coroutine function (``async def``), which runs on the engine's event loop. An
    exception from either (or a call past ``EngineConfig.env_timeout_s``) ends that sequence alone with
    ``finish_reason="error"`` in ``StepResult.failed``.

    Optional members (``serve.AgentEnv`` has them all): ``step_logprobs = True`` makes the engine call
    ``step(turn_ids, logprobs)`` with the turn's behaviour log-probs; ``end(turn_ids, logprobs, reason)`` is
    called (on the actor thread: it must not block) when the episode ends without the environment's word --
    ``reason`` is the finish reason (``"eos"``, ``"length"``, ...) and the turn the one cut by it -- or with
    ``reason=None`` and no turn when the sequence is abandoned (restarted, failed, quarantined, closed).
    ``decoded(response_ids, logprobs, turn_start)``, if present, is called on the actor thread after every
    forward while the sequence decodes, with the turn so far at ``response_ids[turn_start:]`` (read-only; it
    must not block): a served episode streams its turn with it; an exception from it ends the sequence at
    that forward, as one from ``step`` does; it is never called in a quarantine probe (a run of the step that
    is always rolled back). Such an environment may have ``rewound(num_response)``, called on the actor
    thread (it must not block) for every listening sequence of a rolled-back attempt, with the
    ``num_response`` tokens left (cut back or not): between two calls of ``decoded`` the response only grows
    otherwise; one that raises restarts its sequence from its prompt with a fresh environment (a
    ``RuntimeWarning`` names it). ``rewindable = False`` says the
    environment cannot be made afresh (its answers reach someone outside the engine, as an agent's do): a
    probe never calls it (no ``step``, no ``end``, no answer taken): its sequence stops there in the probe
    (``serve.AgentEnv``)."""

    def reset(self, prompt_ids: list[int]) -> None: ...

    def step(self, turn_ids: list[int]) -> Observation | Awaitable[Observation]: ...


def env_name(env: object) -> str:
    """How messages name an environment: its class."""
    return type(env).__qualname__


def check_observation(obs: object, env: object) -> Observation:
    """``obs`` with its tokens as a list of ints; ``TypeError`` naming ``env`` unless it is an
    ``Observation`` whose tokens are a list (or tuple) of integer token ids, ``done`` a bool and ``reward``
    a real number or None. Ids outside the vocabulary are the caller's to judge (they end the sequence)."""
    name = env_name(env)
    if not isinstance(obs, Observation):
        raise TypeError(f"environment {name}: step() returned {type(obs).__name__}, not an Observation")
    tokens = obs.tokens
    if not isinstance(tokens, list | tuple):
        raise TypeError(
            f"environment {name}: Observation.tokens must be a list of token ids, got {type(tokens).__name__}"
        )
    bad = next((t for t in tokens if isinstance(t, bool) or not isinstance(t, numbers.Integral)), None)
    if bad is not None:
        raise TypeError(
            f"environment {name}: Observation.tokens must be a list of token ids, but holds {bad!r} "
            f"({type(bad).__name__})"
        )
    if not isinstance(obs.done, bool):
        raise TypeError(f"environment {name}: Observation.done must be a bool, got {obs.done!r}")
    reward = obs.reward
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, numbers.Real)):
        raise TypeError(f"environment {name}: Observation.reward must be a number or None, got {reward!r}")
    limit = obs.next_turn_tokens
    if limit is not None and (
        isinstance(limit, bool) or not isinstance(limit, numbers.Integral) or limit < 1
    ):
        raise TypeError(
            f"environment {name}: Observation.next_turn_tokens must be an int >= 1 or None, got {limit!r}"
        )
    return Observation(
        [int(t) for t in tokens],
        obs.done,
        None if reward is None else float(reward),
        str(obs.finish_reason),
        None if limit is None else int(limit),
    )
