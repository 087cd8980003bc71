"""A sequence as plain Python data, for the engine's checkpoints (``state_dict``): tokens, log-probs, policy
versions, seed, deferral count and the results already read; never KV, which is prefilled again."""

from __future__ import annotations

from dataclasses import asdict

from oppo_engine.config import SamplingParams
from oppo_engine.sched.sequence import SeqStatus, Sequence


def save_sequence(seq: Sequence) -> dict:
    """``seq``'s state as lists, numbers and strings."""
    scored = seq.status is SeqStatus.SCORED
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
    }


def load_sequence(state: dict) -> Sequence:
    """A sequence from ``save_sequence``'s output, with no KV anywhere."""
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
    return seq


def restart_from_prompt(state: dict) -> dict:
    """``save_sequence`` output of the same sequence started over from its prompt: same prompt index,
    sample and seed, its tokens, log-probs, results and deferrals dropped."""
    return dict(
        state,
        response_ids=[],
        logprobs=[],
        policy_versions=[],
        deferred_steps=0,
        finished=False,
        results=None,
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
