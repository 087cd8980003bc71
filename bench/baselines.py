"""The `hf` baseline: what a TRL-style PPO loop does without the engine.

Generate the whole batch with HF `generate` (left-padded, dynamic KV cache), then score all
sequences with one padded reward forward once the slowest response is done. Its timings are the
reference the engine's modes are measured against.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class HfRollouts:
    """Per-rollout responses and rewards of one baseline step, with its two stage times."""

    response_ids: list[list[int]]
    rewards: list[float]
    generation_s: float
    scoring_s: float


def _sync(device: torch.device) -> None:
    """Wait for queued kernels so host clocks measure the GPU work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _pad(
    seqs: list[list[int]], pad_token_id: int, left: bool, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [N, T], attention_mask [N, T]) padded on the left or the right to the longest sequence."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        cols = slice(width - len(s), width) if left else slice(0, len(s))
        ids[i, cols] = torch.tensor(s, dtype=torch.long)
        mask[i, cols] = 1
    return ids.to(device), mask.to(device)


@torch.inference_mode()
def hf_generate(
    actor: torch.nn.Module,
    prompts: list[list[int]],
    max_new_tokens_list: list[int],
    temperature: float,
    seed: int,
    pad_token_id: int,
) -> list[list[int]]:
    """Responses of `actor` to `prompts`, each exactly its own max_new_tokens long (EOS ignored)."""
    # Decoder-only generate appends after the last column, so prompts are padded on the left.
    ids, mask = _pad(prompts, pad_token_id, left=True, device=actor.device)
    sampling = (
        dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        if temperature > 0
        else dict(do_sample=False)
    )
    torch.manual_seed(seed)  # HF samples from the global generator
    out = actor.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=max(max_new_tokens_list),
        # NOTE: eos_token_id=None as a keyword (not inside a GenerationConfig, where HF refills it from
        # the model's defaults) turns off stopping: the engine's ignore_eos.
        eos_token_id=None,
        pad_token_id=pad_token_id,
        **sampling,
    )
    # Every row ran to the batch maximum; cut each to its own length so token counts match the engine.
    return [out[i, ids.shape[1] : ids.shape[1] + n].tolist() for i, n in enumerate(max_new_tokens_list)]


@torch.inference_mode()
def hf_score(reward: torch.nn.Module, sequences: list[list[int]], pad_token_id: int) -> list[float]:
    """One reward forward over the right-padded `sequences`; the score at each one's last real token.

    Reads the last position from the lengths rather than from pad ids (as HF's pooling does), since
    a sampled response may contain the pad id itself.
    """
    ids, mask = _pad(sequences, pad_token_id, left=False, device=reward.device)
    backbone = getattr(reward, reward.base_model_prefix)
    hidden = backbone(input_ids=ids, attention_mask=mask).last_hidden_state  # [N, T, hidden]
    last = mask.sum(dim=1) - 1
    scores = reward.score(hidden[torch.arange(len(sequences), device=ids.device), last])  # [N, 1]
    return scores[:, 0].float().tolist()


@torch.inference_mode()
def hf_ppo_scores(
    reference: torch.nn.Module,
    critic: torch.nn.Module,
    prompts: list[list[int]],
    responses: list[list[int]],
    temperature: float,
    pad_token_id: int,
) -> tuple[list[list[float]], list[list[float]]]:
    """TRL's reference log-probs and critic values of each response: one right-padded forward per model."""
    seqs = [p + r for p, r in zip(prompts, responses, strict=True)]
    ids, mask = _pad(seqs, pad_token_id, left=False, device=reference.device)
    logits = reference(input_ids=ids, attention_mask=mask).logits.float() / (temperature or 1.0)
    logprobs = logits.log_softmax(-1)
    backbone = getattr(critic, critic.base_model_prefix)
    values = critic.score(backbone(input_ids=ids, attention_mask=mask).last_hidden_state)[..., 0].float()
    ref, val = [], []
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        rows = torch.arange(len(p) - 1, len(p) + len(r) - 1, device=ids.device)
        ref.append(logprobs[i, rows, torch.tensor(r, device=ids.device)].tolist())
        val.append(values[i, rows].tolist())
    return ref, val


def hf_rollout_step(
    actor: torch.nn.Module,
    reward: torch.nn.Module,
    prompts: list[list[int]],
    max_new_tokens_list: list[int],
    temperature: float,
    seed: int,
    pad_token_id: int,
    reference: torch.nn.Module | None = None,
    critic: torch.nn.Module | None = None,
) -> HfRollouts:
    """Generate all, then score all (reward; reference log-probs and critic values when given): one
    baseline PPO rollout step with its stage times."""
    if len(prompts) != len(max_new_tokens_list) or not prompts:
        raise ValueError(
            f"need one max_new_tokens per prompt, got {len(prompts)} prompts "
            f"and {len(max_new_tokens_list)} lengths"
        )
    _sync(actor.device)
    t0 = time.perf_counter()
    responses = hf_generate(actor, prompts, max_new_tokens_list, temperature, seed, pad_token_id)
    _sync(actor.device)
    t1 = time.perf_counter()
    rewards = hf_score(reward, [p + r for p, r in zip(prompts, responses, strict=True)], pad_token_id)
    if reference is not None and critic is not None:
        hf_ppo_scores(reference, critic, prompts, responses, temperature, pad_token_id)
    _sync(reward.device)
    t2 = time.perf_counter()
    return HfRollouts(responses, rewards, t1 - t0, t2 - t1)
