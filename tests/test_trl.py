"""TRL's GRPOTrainer on the engine: the real trainer trains on the engine's groups, TRL's own recomputed
log-probs equal the engine's behaviour log-probs, and configurations the engine cannot serve are refused.

``make test`` installs the ``trl`` extra, so these run in CI; a dev venv without trl skips them."""

import copy
import dataclasses
import importlib.util
import os

import pytest
import torch

if importlib.util.find_spec("trl") is None:
    pytest.skip("trl is not installed: pip install -e '.[trl]' (make test does)", allow_module_level=True)

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in trl 1.16

from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, Qwen2Config  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from oppo_engine import EngineConfig, RolloutEngine  # noqa: E402
from oppo_engine.integrations.trl import (  # noqa: E402
    REWARD_FIELD,
    _group_heads,
    _tokenize,
    check_trl_version,
    engine_reward,
    engine_rollout_func,
    sampling_params_for,
)
from oppo_engine.ppo.task import train_tokenizer  # noqa: E402

WORDS = "the a cat dog bird sat ran on under mat log tree red blue big small thank you please and is".split()
PROMPTS = ["the cat sat on", "a big dog ran under", "thank you", "the red bird is on the blue log"]
NUM_GENERATIONS = 4


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer([" ".join(WORDS)])


def _config(tokenizer, **overrides) -> Qwen2Config:
    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    shape.update(overrides)
    return Qwen2Config(
        vocab_size=32,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **shape,
    )


def _models(tokenizer):
    torch.manual_seed(0)
    actor = AutoModelForCausalLM.from_config(_config(tokenizer), dtype=torch.float32)
    reward = AutoModelForSequenceClassification.from_config(
        _config(tokenizer, num_hidden_layers=1, num_labels=1), dtype=torch.float32
    ).eval()
    return actor, reward


def _args(tmp_path, **overrides) -> GRPOConfig:
    # num_iterations=2 with one accumulation step: TRL recomputes the old log-probs with its own forward
    # (they are the ratio's denominator for the second iteration); 4 optimizer steps = 2 generations.
    cfg = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        num_generations=NUM_GENERATIONS,
        num_iterations=2,
        max_completion_length=12,
        max_steps=4,
        learning_rate=1e-2,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        logging_steps=1,
        seed=0,
        bf16=False,  # TRL's default autocasts the fp32 models to bf16
    )
    cfg.update(overrides)
    return GRPOConfig(**cfg)


def _engine(actor, reward, tokenizer, args, mode="sequential") -> RolloutEngine:
    return RolloutEngine(
        actor=actor,
        reward=reward,
        config=EngineConfig(batch_size=4, mode=mode, max_model_len=64, page_size=8),
        sampling=sampling_params_for(args, seed=7),
        eos_token_id=tokenizer.eos_token_id,
    )


def _trainer(model, tokenizer, args, rollout_func, reward=engine_reward, cls=GRPOTrainer, prompts=PROMPTS):
    """A GRPO trainer on ``model`` whose completions come from ``rollout_func``."""
    return cls(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
        rollout_func=rollout_func,
    )


class RecordingGRPOTrainer(GRPOTrainer):
    """The real GRPOTrainer; keeps each generation batch exactly as TRL built it for its loss."""

    def _generate_and_score_completions(self, inputs):
        batch = super()._generate_and_score_completions(inputs)
        self.generation_batches.append(batch)
        return batch


def _run(tokenizer, tmp_path, mode, bf16=False):
    actor, reward = _models(tokenizer)
    if bf16:
        actor.to(torch.bfloat16)
    initial_actor = copy.deepcopy(actor)
    args = _args(tmp_path, bf16=bf16)
    engine = _engine(actor, reward, tokenizer, args, mode)
    rollout_func = engine_rollout_func(engine, args)
    returned, scored, metrics = [], [], []

    def recording_rollout_func(prompts, trainer):
        returned.append(rollout_func(prompts, trainer))
        metrics.append(rollout_func.step_metrics)
        return returned[-1]

    def recording_reward(prompts, completions, **kwargs):
        scored.append(kwargs["completion_ids"])
        return engine_reward(prompts, completions, **kwargs)

    trainer = _trainer(actor, tokenizer, args, recording_rollout_func, recording_reward, RecordingGRPOTrainer)
    trainer.generation_batches = []
    trainer.train()
    return dict(
        engine=engine, rollout_func=rollout_func, trainer=trainer, returned=returned, scored=scored,
        metrics=metrics, actor=actor, initial_actor=initial_actor, reward=reward, args=args,
    )  # fmt: skip


def _rows(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    return [row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)]


@pytest.mark.parametrize("mode", ["sequential", "intra"])
def test_grpo_trains_on_the_engines_groups_with_its_logprobs(tokenizer, tmp_path, mode):
    run = _run(tokenizer, tmp_path, mode)
    batches, returned = run["trainer"].generation_batches, run["returned"]
    assert len(batches) == len(returned) == 2  # two generations, four optimizer steps
    assert run["engine"].policy_version == 1  # update_policy() once, between the generations

    for batch, out, metrics in zip(batches, returned, run["metrics"], strict=True):
        # (a) TRL trains on the completions and prompts the engine returned.
        assert _rows(batch["completion_ids"], batch["completion_mask"]) == out["completion_ids"]
        assert _rows(batch["prompt_ids"], batch["prompt_mask"]) == out["prompt_ids"]
        # Each group: one prompt, its n samples in a row, as TRL's advantage (view(-1, n)) expects.
        for g in range(0, len(out["prompt_ids"]), NUM_GENERATIONS):
            assert all(p == out["prompt_ids"][g] for p in out["prompt_ids"][g : g + NUM_GENERATIONS])
        assert len({tuple(c) for c in out["completion_ids"]}) > 1  # sampled, not copies of one
        # (c) Each group's prompt was prefilled once per model: its prefix (all but the last token) was
        # shared with the other n - 1 samples, in the actor and in the reward model.
        heads = out["prompt_ids"][::NUM_GENERATIONS]
        assert len(metrics) == 2  # a generation batch of 2 groups, an engine step of B=4: one group each
        shared = {name: sum(m.shared_tokens[name] for m in metrics) for name in ("actor", "reward")}
        assert shared == dict.fromkeys(shared, (NUM_GENERATIONS - 1) * sum(len(p) - 1 for p in heads))
        # (b) The engine's behaviour log-probs equal TRL's own recomputed old log-probs (fp32, T=1, no
        # truncation), and reach TRL unchanged as its sampling log-probs.
        mask = batch["completion_mask"].bool()
        engine_logps = batch["sampling_per_token_logps"]
        assert engine_logps[mask].tolist() == [x for row in out["logprobs"] for x in row]
        torch.testing.assert_close(batch["old_per_token_logps"][mask], engine_logps[mask], atol=1e-4, rtol=0)

    # The reward functions saw the engine's completions and its streamed scores, which equal the reward
    # model's own forward over prompt + completion.
    assert run["scored"] == [out["completion_ids"] for out in returned]
    out = returned[0]
    for p, c, score in zip(out["prompt_ids"], out["completion_ids"], out[REWARD_FIELD], strict=True):
        with torch.no_grad():
            expected = run["reward"](torch.tensor([p + c])).logits[0, 0].item()
        assert score == pytest.approx(expected, abs=1e-4)

    # The first generation is the engine's own: a fresh engine with the same seed on the untrained actor
    # samples the same tokens for the same prompts.
    fresh = _engine(run["initial_actor"], run["reward"], tokenizer, run["args"], mode)
    heads = out["prompt_ids"][::NUM_GENERATIONS]
    fresh.add_prompts(heads)
    replay = []
    while len(replay) < len(out["completion_ids"]):
        replay.extend(fresh.step().rollouts)
    replay.sort(key=lambda r: (r.group_id, r.sample_index))
    assert [r.response_ids for r in replay] == out["completion_ids"]
    fresh.close()
    run["engine"].close()


def test_bf16_model_under_trls_bf16_autocast_matches_to_bf16_rounding(tokenizer, tmp_path):
    run = _run(tokenizer, tmp_path, "sequential", bf16=True)
    for batch in run["trainer"].generation_batches:
        mask = batch["completion_mask"].bool()
        old, engine_logps = batch["old_per_token_logps"][mask], batch["sampling_per_token_logps"][mask]
        torch.testing.assert_close(old, engine_logps, atol=1e-2, rtol=0)
    run["engine"].close()


def test_bad_configurations_are_refused_naming_the_option(tokenizer, tmp_path):
    actor, reward = _models(tokenizer)
    args = _args(tmp_path)
    for mode in ("inter", "oppo"):
        engine = _engine(actor, reward, tokenizer, args, mode)
        with pytest.raises(ValueError, match=f"mode='{mode}' does not fit"):
            engine_rollout_func(engine, args)
        engine.close()

    engine = _engine(actor, reward, tokenizer, args)
    for option, value in [
        ("repetition_penalty", 1.2),
        ("min_p", 0.1),
        ("generation_kwargs", {"num_beams": 2}),
        ("num_generations_eval", 2),
        ("max_completion_length", None),
        ("bf16", True),
    ]:
        with pytest.raises(ValueError, match=f"GRPOConfig.{option}="):
            engine_rollout_func(engine, _args(tmp_path, **{option: value}))
    for option, value in [("temperature", 0.7), ("top_k", 5), ("top_p", 0.9), ("max_completion_length", 8)]:
        with pytest.raises(ValueError, match=f"GRPOConfig.{option}={value!r} differs from the engine's"):
            engine_rollout_func(engine, _args(tmp_path, **{option: value}))
    with pytest.raises(ValueError, match="GRPOConfig.num_generations=2 differs"):
        engine_rollout_func(engine, _args(tmp_path, num_generations=2))

    # A trainer on another model than the engine's actor: refused at the first generation.
    other, _ = _models(tokenizer)
    trainer = _trainer(other, tokenizer, args, engine_rollout_func(engine, args))
    with pytest.raises(ValueError, match="the engine's actor is not the trainer's model"):
        trainer.train()
    engine.close()


def test_engine_reward_needs_the_engines_field():
    with pytest.raises(ValueError, match="engine_reward reads the 'engine_reward' field"):
        engine_reward(["p"], ["c"])
    assert engine_reward(["p"], ["c"], **{REWARD_FIELD: [0.5]}) == [0.5]


def test_unsupported_trl_versions_are_refused_naming_both():
    assert check_trl_version("1.16.3") == "1.16.3"
    for version in ("1.15.0", "1.17.0"):
        with pytest.raises(ImportError, match=rf"trl {version} is installed, .* supports trl.*1\.16"):
            check_trl_version(version)


@pytest.mark.parametrize("chat", [False, True], ids=["text", "chat"])
def test_prompts_are_tokenized_as_trl_does(tokenizer, tmp_path, chat):
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant{% endif %}"
    )
    prompts = [[{"role": "user", "content": p}] for p in PROMPTS] if chat else PROMPTS
    actor, reward = _models(tokenizer)
    args = _args(tmp_path)
    engine = _engine(actor, reward, tokenizer, args)
    trainer = _trainer(actor, tokenizer, args, engine_rollout_func(engine, args), prompts=prompts)
    expected, _, _ = trainer._tokenize_prompts(prompts)
    assert _tokenize(prompts, trainer) == [list(p) for p in expected]
    assert len({len(p) for p in expected}) > 1
    engine.close()


def test_prompts_must_come_in_runs_of_num_generations():
    assert _group_heads(["a", "a", "b", "b"], 2) == ["a", "b"]
    with pytest.raises(ValueError, match="prompt 1 differs from prompt 0"):
        _group_heads(["a", "b", "b", "b"], 2)
    with pytest.raises(ValueError, match="3 prompts, not a multiple of num_generations=2"):
        _group_heads(["a", "a", "b"], 2)


def test_the_engines_resolved_eos_set_is_compared_and_stop_tokens_are_refused(tokenizer, tmp_path):
    actor, reward = _models(tokenizer)
    args = _args(tmp_path)
    config = EngineConfig(batch_size=4, mode="sequential", max_model_len=64, page_size=8)
    # eos_token_id omitted: the engine resolves the actor's own EOS ids, which are the trainer's.
    sampling = sampling_params_for(args, seed=7)
    engine = RolloutEngine(actor=actor, reward=reward, config=config, sampling=sampling)
    assert engine.eos_token_ids == (tokenizer.eos_token_id,)
    func = engine_rollout_func(engine, args)
    func._bind(_trainer(actor, tokenizer, args, func))  # accepted: the EOS sets agree
    engine.close()
    stopping = dataclasses.replace(sampling, stop_token_ids=(5,))
    engine = RolloutEngine(actor=actor, reward=reward, config=config, sampling=stopping)
    with pytest.raises(ValueError, match=r"stop_token_ids=\(5,\): TRL treats a completion"):
        engine_rollout_func(engine, args)
    engine.close()


def test_a_quarantined_group_makes_the_rollout_func_raise_naming_its_prompt(tokenizer, tmp_path):
    actor, _ = _models(tokenizer)
    args = _args(tmp_path)
    poison: list[list[int]] = []

    def reward(prompt_ids, response_ids):  # fails for one prompt, every time: the engine quarantines it
        if prompt_ids in poison:
            raise ValueError("unscorable")
        return float(len(response_ids))

    engine = _engine(actor, reward, tokenizer, args)
    rollout_func = engine_rollout_func(engine, args)
    trainer = _trainer(actor, tokenizer, args, rollout_func)
    poison.append(_tokenize([PROMPTS[1]], trainer)[0])
    batch = [p for p in PROMPTS[:2] for _ in range(NUM_GENERATIONS)]
    with pytest.raises(
        RuntimeError, match=r"quarantined the group of prompt .*reward: ValueError: unscorable"
    ):
        rollout_func(batch, trainer)
    engine.close()


class WordEnv:
    """A two-turn environment over the test vocabulary: it answers a turn with two fixed words."""

    def __init__(self, tokenizer) -> None:
        self.answer = tokenizer("thank you")["input_ids"]
        self.turns = 0

    def reset(self, prompt_ids):
        self.turns = 0

    def step(self, turn_ids):
        from oppo_engine import Observation

        self.turns += 1
        return Observation(list(self.answer), done=self.turns >= 2)


def test_grpo_trains_only_on_sampled_tokens_of_multi_turn_episodes(tokenizer, tmp_path):
    actor, reward = _models(tokenizer)
    args = _args(tmp_path, max_steps=2)
    sampling = dataclasses.replace(sampling_params_for(args, seed=7), max_turn_tokens=4)
    engine = RolloutEngine(
        actor=actor, reward=reward, env=lambda: WordEnv(tokenizer), sampling=sampling,
        config=EngineConfig(batch_size=4, mode="intra", max_model_len=64, page_size=8),
        eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    rollout_func = engine_rollout_func(engine, args)
    returned = []

    def recording_rollout_func(prompts, trainer):
        returned.append(rollout_func(prompts, trainer))
        return returned[-1]

    trainer = _trainer(actor, tokenizer, args, recording_rollout_func, cls=RecordingGRPOTrainer)
    trainer.generation_batches = []
    trainer.train()
    assert returned and trainer.generation_batches
    for batch, out in zip(trainer.generation_batches, returned, strict=True):
        assert any(0 in m for m in out["env_mask"])  # observations came back inside the completions
        assert _rows(batch["completion_ids"], batch["completion_mask"]) == out["completion_ids"]
        # TRL took env_mask as its tool mask: its loss mask is 0 exactly at the observation tokens.
        assert _rows(batch["tool_mask"], batch["completion_mask"]) == out["env_mask"]
        for ids, mask in zip(out["completion_ids"], out["env_mask"], strict=True):
            assert len(ids) == len(mask)
    with pytest.raises(ValueError, match="mask_truncated_completions=True with an engine environment"):
        engine_rollout_func(engine, _args(tmp_path, mask_truncated_completions=True))
    engine.close()


def test_grpo_trains_fp32_weights_rolled_out_from_a_bf16_replica(tokenizer, tmp_path):
    """rollout_dtype=bf16 on the trainer's fp32 model: TRL trains the fp32 weights, the engine samples from
    its bf16 copy, refreshed when TRL's global step advances (update_policy)."""
    actor, reward = _models(tokenizer)
    args = _args(tmp_path)
    engine = RolloutEngine(
        actor=actor, reward=reward, sampling=sampling_params_for(args, seed=7),
        config=EngineConfig(batch_size=4, mode="sequential", max_model_len=64, page_size=8,
                            rollout_dtype=torch.bfloat16),
        eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    initial = {n: p.detach().to(torch.bfloat16) for n, p in actor.named_parameters()}
    assert engine.actor is not actor and next(engine.actor.parameters()).dtype == torch.bfloat16
    _trainer(actor, tokenizer, args, engine_rollout_func(engine, args)).train()
    assert all(p.dtype == torch.float32 for p in actor.parameters())
    replica = dict(engine.actor.named_parameters())
    assert any(not torch.equal(replica[n], initial[n]) for n in initial)  # refreshed during training
    engine.update_policy()
    assert all(torch.equal(replica[n], p.detach().to(torch.bfloat16)) for n, p in actor.named_parameters())


@pytest.mark.real_model  # ~20 s of CPU (one GRPO step of a 135M model): pytest -m real_model
def test_grpo_fine_tunes_the_bundled_pretrained_model(smollm2, tmp_path):
    """The GGUF-born SmolLM2 is a plain model to HF's Trainer: one GRPO step through the engine moves its
    weights (a model loaded straight from the GGUF keeps a quantizer that Trainer refuses to fine-tune)."""
    model, tokenizer = copy.deepcopy(smollm2[0]).train(), smollm2[1]
    before = model.model.layers[0].self_attn.q_proj.weight.clone()
    args = _args(tmp_path, per_device_train_batch_size=4, num_iterations=1, max_completion_length=6,
                 max_steps=1, learning_rate=1e-4)  # fmt: skip
    engine = RolloutEngine(
        actor=model,
        reward=lambda prompt, response: float(len(response)),
        config=EngineConfig(batch_size=4, mode="sequential", max_model_len=128),
        sampling=sampling_params_for(args, seed=7),
        eos_token_id=tokenizer.eos_token_id,
    )
    trainer = _trainer(model, tokenizer, args, engine_rollout_func(engine, args), prompts=["What is 2 + 3?"])
    trainer.train()
    assert trainer.state.global_step == 1
    assert not torch.equal(before, model.model.layers[0].self_attn.q_proj.weight)


def test_agreement_is_logged_and_equals_ppo_agreement_over_the_same_tokens(tokenizer, tmp_path):
    """``AgreementGRPOTrainer`` logs ``agreement/*`` every step, equal to ``ppo.agreement.measure`` of an
    independent forward (a copy of the weights each loss saw) against the engine's log-probs."""
    from oppo_engine.integrations.trl import AgreementGRPOTrainer
    from oppo_engine.ppo import agreement

    calls = []

    class Recording(AgreementGRPOTrainer):
        def _compute_loss(self, model, inputs):
            weights = copy.deepcopy(model.state_dict())
            loss = super()._compute_loss(model, inputs)
            calls.append(
                (weights, {k: v for k, v in inputs.items() if torch.is_tensor(v)}, self.last_agreement)
            )
            return loss

    actor, reward = _models(tokenizer)
    args = _args(tmp_path)
    engine = _engine(actor, reward, tokenizer, args)
    trainer = _trainer(actor, tokenizer, args, engine_rollout_func(engine, args), cls=Recording)
    trainer.train()
    engine.close()
    logged = [e for e in trainer.state.log_history if "agreement/mean_abs" in e]
    assert len(calls) == len(logged) == args.max_steps  # one loss per optimizer step here
    # NOTE: a model built afresh from the config, not a deep copy of the actor: GRPOTrainer sets the actor's
    # forward to a closure over its own bound forward (trl's add_fused_lm_head), so a deep copy runs the
    # *actor's* final weights whatever is loaded into it (0.3 nats off here). The engine's rollout replica
    # drops such instance forwards (tests/test_replica.py).
    replica = AutoModelForCausalLM.from_config(actor.config).eval()
    for (weights, inputs, gap), entry in zip(calls, logged, strict=True):
        replica.load_state_dict(weights)
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        n = inputs["completion_ids"].shape[1]
        with torch.no_grad():
            logits = replica(input_ids=ids, attention_mask=attention).logits[:, -n - 1 : -1]
        trainer_logps = logits.float().log_softmax(-1).gather(-1, inputs["completion_ids"][..., None])[..., 0]
        mask = inputs["completion_mask"]
        expected = agreement.measure(
            trainer_logps, inputs["sampling_per_token_logps"], mask, torch.zeros_like(mask, dtype=torch.bool),
            torch.zeros(len(mask), dtype=torch.bool),
        )["fresh"]  # fmt: skip
        assert gap.tokens == expected.tokens == int(mask.sum()) > 0
        for name in ("mean_abs", "max_abs", "mean_k3", "seq_sum_std", "seq_sum_max_abs"):
            assert getattr(gap, name) == pytest.approx(getattr(expected, name), rel=1e-3, abs=1e-6), name
            assert entry[f"agreement/{name}"] == pytest.approx(getattr(gap, name), rel=1e-6, abs=1e-9), name
        assert entry["agreement/truncated_sampling"] == 0.0
    # The first loss of each generation runs on the weights that sampled: fp32, the gap is rounding.
    assert calls[0][2].max_abs < 1e-4
