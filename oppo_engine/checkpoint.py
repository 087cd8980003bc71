"""An engine's prompts in flight and queued across a checkpoint: ``RolloutEngine.state_dict()`` and
``load_state_dict()`` (their docstrings say what a user can count on; this module says how).

A state holds token ids, log-probs, policy versions, seeds and counters -- never KV, which is prefilled again
after loading. Each carried sequence is saved with ``sched.state.save_sequence``; the settings it depends on
travel beside it, so that an engine that cannot continue it requeues it from its prompt instead
(``sched.state.why_not_carried``).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from oppo_engine.sched.overcommit import drop_kv
from oppo_engine.sched.state import load_sequence, restart_from_prompt, save_sequence, why_not_carried

if TYPE_CHECKING:
    from oppo_engine.engine import RolloutEngine

# 2: sequences carry their sample index (groups); 3: the settings they depend on ("settings"). 2 still loads.
STATE_VERSION = 3
READABLE_STATE_VERSIONS = (2, 3)


def rank_of(engine: RolloutEngine) -> tuple[int, int]:
    """(rank, world size) of ``engine``'s process group; (0, 1) without one."""
    return (0, 1) if engine._group is None else (engine._group.rank, engine._group.world_size)


def save_state(engine: RolloutEngine) -> dict:
    """``engine``'s state (``RolloutEngine.state_dict``); ``ValueError`` while agent episodes are in flight
    (``refuse_agents``)."""
    delta, counters = engine._delta_control, engine._counters
    state = {
        "version": STATE_VERSION,
        "policy_version": engine._policy_version,
        "prompts": engine._prompts.state_dict(),
        "step_index": counters.step_index,
        "finished_lengths": (counters.finished_tokens, counters.finished_seqs),
        "carried": [save_sequence(s) for s in engine._buffer.carried],
        "delta": None if delta is None else delta.state_dict(),
        "trainer_reward": engine._trainer_reward,
        "rank": list(rank_of(engine)),  # whose prompts these are: (rank, world size) of the saving engine
        # What the carried sequences depend on: another engine continues them only if it matches.
        "settings": {
            "mode": engine.config.mode,
            "overcommit": engine.config.overcommit,
            "n": engine.sampling.n,
            "max_model_len": engine.max_model_len,
            "eos_token_ids": list(engine.eos_token_ids),
        },
        "env": engine._prompts.env is not None,  # the queued prompts without their own run in env=
    }
    refuse_agents(engine, state)
    return state


def refuse_agents(engine: RolloutEngine, state: dict) -> None:
    """``ValueError`` if ``state`` would drop agent episodes: sequences not yet finished whose environment
    factory says they cannot be made afresh (``rewindable = False``: a served episode's, whose agent has had,
    or waits for, an answer), or agents of ``add_agents`` queued or running on the engine's server. Their
    agents cannot be saved, and a restarted agent episode fails: a checkpoint that kept them would lose them
    silently."""
    factories = [e["factory"] for e in _episodes(state)] + list(state["prompts"]["pending_envs"])
    episodes = sum(f is not None and getattr(f, "rewindable", True) is False for f in factories)
    server = engine._server
    agents = server.agents_in_flight() if server is not None else 0
    if episodes or agents:
        raise ValueError(
            f"state_dict(): agent episodes are in flight ({episodes} with a sequence in the engine, "
            f"{agents} agents of add_agents queued or running): an agent cannot be saved, nor restarted "
            "from a checkpoint (it has had its answers), so state_dict() refuses rather than drop them; call "
            "it once they have come back from step() (finished, or failed after serve()'s handle.close())"
        )


def _episodes(state: dict) -> list[dict]:
    """The saved episodes of sequences still under way: a finished one is saved whole (its tokens and
    reward, ``save_sequence``), so its agent needs nothing more and loses nothing."""
    saved = [*state["carried"], *state["prompts"]["requeued"]]
    return [d["episode"] for d in saved if d.get("episode") is not None and not d.get("finished")]


def check_state(engine: RolloutEngine, state: dict) -> None:
    """``ValueError`` unless ``engine`` can load ``state``: a readable version, saved by this rank, the same
    ``n``, every prompt valid here. Reads only."""
    if state.get("version") not in READABLE_STATE_VERSIONS:
        raise ValueError(
            f"state: version {state.get('version')!r}, this engine reads {READABLE_STATE_VERSIONS}"
        )
    saved_rank = state.get("rank")  # absent from states saved before it was recorded: not checked
    if saved_rank is not None and tuple(saved_rank) != rank_of(engine):
        (r, w), (mine, size) = saved_rank, rank_of(engine)
        raise ValueError(
            f"state: saved by rank {r} of {w}, this engine is rank {mine} of {size}; each rank loads the "
            "state its own rank saved (another's would run that rank's prompts twice and lose its own)"
        )
    saved = [*state["carried"], *state["prompts"]["requeued"]]
    pending = [params for _, params in state["prompts"]["pending"] if params is not None]
    other = {d["sampling"]["n"] for d in saved} | {p["n"] for p in pending}
    other -= {engine.sampling.n}
    if other:
        raise ValueError(
            f"state: its prompts are sampled n={sorted(other)} times, this engine's n={engine.sampling.n}: "
            "groups cannot change size across a checkpoint"
        )
    needs_env = state.get("env") or any(
        d.get("episode") is not None and d["episode"]["factory"] is None for d in saved
    )
    if needs_env and engine._prompts.env is None:
        raise ValueError(
            "state: its prompts run in the saving engine's environment (env=), and this engine has none: "
            "build it with env=factory"
        )
    for d in saved:
        engine._prompts.validate(f"state: the prompt of sequence {d['seq_id']}", d["prompt_ids"])
    for i, (ids, _) in enumerate(state["prompts"]["pending"]):
        engine._prompts.validate(f"state: queued prompt {i}", ids)


def load_state(engine: RolloutEngine, state: dict) -> int:
    """Load ``state`` into ``engine`` (``RolloutEngine.load_state_dict``); returns how many carried
    sequences start over from their prompts. Checks everything before it changes anything."""
    check_state(engine, state)
    carried = state["carried"]
    reason = why_not_carried(
        state.get("settings"), overcommit=engine._delta_control is not None,
        max_model_len=engine.max_model_len, eos_token_ids=engine.eos_token_ids,
    )  # fmt: skip
    restarted = [] if reason is None else [restart_from_prompt(d) for d in carried]
    if restarted:
        warnings.warn(
            f"load_state_dict: {len(restarted)} carried-over sequences start over from their prompts "
            f"(tokens dropped): {reason}",
            stacklevel=3,
        )
    for seq in engine._buffer.carried:  # what this engine held goes, its environment calls too
        engine._loop.envs.cancel(seq)
        for name in engine._caches:
            drop_kv(seq, name, engine._caches, engine._host)
    engine._loop.scorer_lane.abort()
    engine._policy_version = state["policy_version"]
    engine._prompts.load_state_dict(state["prompts"])
    # Older than anything queued: first in line (whole groups, in their order).
    env = engine._prompts.env
    engine._prompts.requeued.extendleft(reversed([load_sequence(d, env) for d in restarted]))
    counters = engine._counters
    counters.step_index = state["step_index"]
    counters.finished_tokens, counters.finished_seqs = state["finished_lengths"]
    engine._buffer.carried = [] if restarted else [load_sequence(d, env) for d in carried]
    if engine._delta_control is not None and state["delta"] is not None:
        engine._delta_control.load_state_dict(state["delta"])
    engine._trainer_reward = state["trainer_reward"]
    return len(restarted)
