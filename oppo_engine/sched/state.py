"""A sequence as plain Python data, for the engine's checkpoints (``state_dict``): tokens, log-probs, policy
versions, seed, deferral count and the results already read; never KV, which is prefilled again.

An environment's state cannot be saved: an unfinished episode whose environment has been sent a turn is
saved started over from its prompt (its environment is made afresh after loading); a finished one keeps
its turns and observations. A prompt's own environment factory is saved as the object; the engine's
``env=`` as ``None`` (the loading engine's is used)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict

from oppo_engine.config import SamplingParams
from oppo_engine.sched.episode import Episode
from oppo_engine.sched.sequence import SeqStatus, Sequence


def save_sequence(seq: Sequence) -> dict:
    """``seq``'s state as lists, numbers and strings (and a prompt's own environment factory)."""
    scored = seq.status is SeqStatus.SCORED
    episode = seq.episode
    finished = seq.status in (SeqStatus.FINISHED, SeqStatus.SCORED)
    if episode is not None and not finished and (episode.stepped or seq.status is SeqStatus.ENV):
        return restart_from_prompt(save_sequence(_unstarted(seq)))
    return {
        "seq_id": seq.seq_id,
        "prompt_index": seq.prompt_index,
        "sample_index": seq.sample_index,
        "prompt_ids": list(seq.prompt_ids),
        "sampling": asdict(seq.sampling),
        "seed": seq.seed,
        "response_ids": list(seq.response_ids),
        "logprobs": list(seq.logprobs),
        "policy_versions": list(seq.policy_versions),
        "deferred_steps": seq.deferred_steps,
        "finished": seq.status in (SeqStatus.FINISHED, SeqStatus.SCORED),
        "finish_reason": seq.finish_reason,
        # Results are kept only once every scorer has read them; a partly scored sequence starts over.
        "results": {"reward": seq.reward, "ref_logprobs": seq.ref_logprobs, "values": seq.values}
        if scored
        else None,
        "episode": None if episode is None else _save_episode(episode),
        "group_size": seq.group_size,
    }


def _unstarted(seq: Sequence) -> Sequence:
    """A copy of ``seq``'s prompt, seed and counters, with a fresh episode of the same factory."""
    copy = Sequence(
        seq.seq_id, seq.prompt_index, seq.prompt_ids, seq.sampling, seq.seed,
        deferred_steps=seq.deferred_steps, sample_index=seq.sample_index, group_size=seq.group_size,
    )  # fmt: skip
    copy.episode = Episode(seq.episode.factory, engine_factory=seq.episode.engine_factory)
    return copy


def _save_episode(episode: Episode) -> dict:
    return {
        "factory": None if episode.engine_factory else episode.factory,
        "turn_start": episode.turn_start,
        "turns": [list(t) for t in episode.turns],
        "observations": [list(o) for o in episode.observations],
        "truncated": episode.truncated,
        "reward": episode.reward,
    }


def _load_episode(state: dict, engine_env: Callable[[], object] | None) -> Episode:
    factory = state["factory"]
    if factory is None and engine_env is None:
        raise ValueError(
            "state: a sequence ran in the saving engine's env=, and this engine has none: build it with "
            "env=factory"
        )
    episode = Episode(factory or engine_env, engine_factory=factory is None)
    episode.turn_start = state["turn_start"]
    episode.turns = [tuple(t) for t in state["turns"]]
    for start, end in state["observations"]:
        episode.observed(start, end)
    episode.turn_start = state["turn_start"]
    episode.truncated = state["truncated"]
    episode.reward = state["reward"]
    return episode


def load_sequence(state: dict, engine_env: Callable[[], object] | None = None) -> Sequence:
    """A sequence from ``save_sequence``'s output, with no KV anywhere; ``engine_env`` is the loading
    engine's environment factory (for a sequence saved in the saving engine's)."""
    seq = Sequence(
        state["seq_id"],
        state["prompt_index"],
        list(state["prompt_ids"]),
        SamplingParams(**state["sampling"]),
        state["seed"],
        response_ids=list(state["response_ids"]),
        logprobs=list(state["logprobs"]),
        policy_versions=list(state["policy_versions"]),
        deferred_steps=state["deferred_steps"],
        sample_index=state["sample_index"],
        group_size=state.get("group_size", 0),
    )
    # Everything generated before counts as computed once: prefilling it again is a recompute.
    seq.computed_high = seq.num_tokens - 1 if seq.response_ids else 0
    if state["results"] is not None:
        seq.status = SeqStatus.SCORED
        seq.reward = state["results"]["reward"]
        seq.ref_logprobs = state["results"]["ref_logprobs"]
        seq.values = state["results"]["values"]
    elif state["finished"]:
        seq.status = SeqStatus.FINISHED
    if seq.status is not SeqStatus.WAITING:
        seq.finish_reason = state.get("finish_reason")
    if state.get("episode") is not None:
        seq.episode = _load_episode(state["episode"], engine_env)
    return seq


def restart_from_prompt(state: dict) -> dict:
    """``save_sequence`` output of the same sequence started over from its prompt: same prompt index,
    sample and seed, its tokens, log-probs, results and deferrals dropped."""
    episode = state.get("episode")
    if episode is not None:
        episode = dict(episode, turn_start=0, turns=[], observations=[], truncated=0, reward=None)
    return dict(
        state,
        response_ids=[],
        logprobs=[],
        policy_versions=[],
        deferred_steps=0,
        finished=False,
        results=None,
        episode=episode,
    )


def why_not_carried(
    settings: dict | None, *, overcommit: bool, max_model_len: int, eos_token_ids: tuple[int, ...]
) -> str | None:
    """Why an engine cannot continue a checkpoint's carried sequences as they are (None if it can).

    They continue only in an engine with overcommit (``inter``/``oppo``: the others carry nothing across
    steps), whose ``max_model_len`` is at least the saved one (a sequence may already be longer) and whose
    EOS ids are the saved ones (a response may already have passed one). ``settings`` is None for states
    saved before they were recorded (version 2): only the first rule can be checked.
    """
    if not overcommit:
        return "this engine's mode carries no sequence across steps"
    if settings is None:
        return None
    if settings["max_model_len"] > max_model_len:
        saved = settings["max_model_len"]
        return f"they were generated under max_model_len={saved}, this engine's is {max_model_len}"
    if sorted(settings["eos_token_ids"]) != sorted(eos_token_ids):
        saved = sorted(settings["eos_token_ids"])
        return f"they were generated with EOS ids {saved}, this engine's are {sorted(eos_token_ids)}"
    return None
