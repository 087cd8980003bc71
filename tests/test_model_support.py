"""Models as a trainer holds them (train mode, gradient checkpointing, PEFT/LoRA), refused models, and a
reward model of another vocabulary: the engine runs them exactly or refuses them when it is built."""

from __future__ import annotations

import os
import socket

import pytest
import torch
from engine_models import EOS, VOCAB, actor_config, make_actor, make_reward, random_prompts
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from oppo_engine import EngineConfig, RolloutEngine, SamplingParams

ATOL = 1e-4


def make_engine(actor, reward, *, batch_size=4, sampling=None, **kw) -> RolloutEngine:
    return RolloutEngine(
        actor=actor,
        reward=reward,
        config=EngineConfig(batch_size=batch_size, max_model_len=64, page_size=8),
        sampling=sampling or SamplingParams(temperature=0.0, max_new_tokens=8),
        eos_token_id=EOS,
        **kw,
    )


def rollout(actor, reward, prompts, **kw) -> list:
    engine = make_engine(actor, reward, batch_size=len(prompts), **kw)
    engine.add_prompts(prompts)
    out = sorted(engine.step().rollouts, key=lambda r: prompts.index(r.prompt_ids))
    engine.close()
    return out


@torch.inference_mode()
def hf_logprobs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """log_softmax of the model's own forward at each response token (eval mode restored by the caller)."""
    ids = torch.tensor([prompt + response])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(response)[:, None])[:, 0]


# -- the default configuration --------------------------------------------------------------------------


def test_default_config_builds_an_engine_that_steps():
    engine = RolloutEngine(actor=make_actor(), reward=make_reward(), eos_token_id=EOS)
    assert engine.config.mode == "oppo"
    engine.add_prompts(random_prompts(2, seed=3))
    assert len(engine.step().rollouts) == 2
    assert engine.step().rollouts == []


@pytest.mark.parametrize(
    ("knob", "mode"),
    [
        (dict(chunk_size=8), "sequential"),
        (dict(chunk_size=8), "inter"),
        (dict(overcommit=4), "sequential"),
        (dict(overcommit=0), "intra"),
        (dict(retained_kv="reuse"), "sequential"),
        (dict(retained_kv="reuse"), "intra"),
    ],
)
def test_a_knob_the_mode_ignores_is_an_error(knob, mode):
    (name,) = knob
    with pytest.raises(ValueError, match=f"{name}.*ignored by mode='{mode}'"):
        EngineConfig(mode=mode, **knob)


@pytest.mark.parametrize("mode", ["sequential", "intra", "inter", "oppo"])
def test_defaults_never_raise(mode):
    EngineConfig(mode=mode, chunk_size="auto", overcommit="auto", retained_kv="recompute")


# -- models as a trainer holds them ----------------------------------------------------------------------


def test_model_in_train_mode_runs_with_eval_semantics_and_gets_its_modes_back():
    prompts = random_prompts(3, seed=4)
    want = rollout(make_actor(), make_reward(), prompts)
    # Dropout everywhere: in train mode any forward would be random (and the attention would get dropout).
    torch.manual_seed(0)
    actor = AutoModelForCausalLM.from_config(actor_config(attention_dropout=0.5), dtype=torch.float32)
    actor.load_state_dict(make_actor().state_dict())
    actor.train()
    actor.gradient_checkpointing_enable()
    reward = make_reward().train()
    reward.model.layers[0].training = False  # a mixed state is restored as it was, module by module
    before = {name: m.training for name, m in [*actor.named_modules(), *reward.named_modules()]}

    got = rollout(actor, reward, prompts)

    after = {name: m.training for name, m in [*actor.named_modules(), *reward.named_modules()]}
    assert after == before
    assert actor.config._attn_implementation == make_actor().config._attn_implementation
    for g, w in zip(got, want, strict=True):
        assert g.response_ids == w.response_ids
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=ATOL, rtol=0)
        assert g.reward == pytest.approx(w.reward, abs=ATOL)


def test_lora_wrapped_actor_equals_its_own_forward():
    peft = pytest.importorskip("peft")
    torch.manual_seed(5)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    actor = peft.get_peft_model(make_actor(), config)
    prompts = random_prompts(3, seed=5)
    base = rollout(make_actor(), make_reward(), prompts)
    got = rollout(actor, make_reward(), prompts)
    actor.eval()
    for r in got:
        torch.testing.assert_close(
            torch.tensor(r.logprobs), hf_logprobs(actor, r.prompt_ids, r.response_ids), atol=ATOL, rtol=0
        )
    # The adapters are really in the forward: the un-adapted actor's numbers differ.
    assert any(g.logprobs != pytest.approx(b.logprobs, abs=1e-3) for g, b in zip(got, base, strict=True))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fsdp2_reward_and_fsdp1_actor_are_refused_at_construction():
    # The actor and critic get rollout replicas (tests/test_replica.py); the frozen scorers do not.
    dist = pytest.importorskip("torch.distributed")
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        reward = make_reward()
        fsdp.fully_shard(reward)
        with pytest.raises(ValueError, match="reward: sharded weights .FSDP2. are supported for the actor"):
            make_engine(make_actor(), reward)
        # FSDP1 flattens the parameters: the engine cannot gather them, the trainer sends full weights.
        actor = fsdp.FullyShardedDataParallel(make_actor(), device_id=torch.device("cpu"))
        with pytest.raises(ValueError, match=r"actor: sharded weights .FSDP1.*update_policy\(weights="):
            make_engine(actor, make_reward())
    finally:
        dist.destroy_process_group()


def test_zero3_partitioned_parameters_are_refused_pointing_at_update_policy_weights():
    actor = make_actor()
    for i, p in enumerate(actor.parameters()):
        p.ds_id = i  # what DeepSpeed ZeRO-3 marks its partitioned parameters with
    with pytest.raises(ValueError, match=r"actor: sharded weights .*update_policy\(weights=\.\.\.\)"):
        make_engine(actor, make_reward())


# -- models the engine cannot run exactly ----------------------------------------------------------------


def _tiny(config_cls, **kw):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config_cls(**kw)).eval()


def test_state_space_model_is_refused_naming_why():
    from transformers import MambaConfig

    actor = _tiny(MambaConfig, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=4)
    with pytest.raises(ValueError, match="no attention heads"):
        make_engine(actor, lambda p, r: 0.0)


def test_attention_sinks_are_refused_at_construction():
    from transformers import GptOssConfig

    actor = _tiny(
        GptOssConfig, vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=2, num_experts_per_tok=1,
        sliding_window=8,
    )  # fmt: skip
    with pytest.raises(ValueError, match="attention sinks"):
        make_engine(actor, lambda p, r: 0.0)


def test_dynamic_rope_beyond_the_original_length_is_refused_naming_rope():
    actor = _tiny(
        type(actor_config()), **{**actor_config().to_dict(), "max_position_embeddings": 32},
        rope_scaling={"rope_type": "dynamic", "factor": 2.0},
    )  # fmt: skip
    with pytest.raises(ValueError, match="rope_type='dynamic'.*max_model_len=64"):
        make_engine(actor, lambda p, r: 0.0)


# -- a reward model of another vocabulary ----------------------------------------------------------------


def _word_tokenizer(words: list[str]):
    """A word-level fast tokenizer over ``words`` (trained nowhere, built locally: no hub)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<pad>", "<unk>", "<bos>", "<eos>", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<bos>", eos_token="<eos>"
    )


def test_reward_with_another_vocabulary_is_refused_without_tokenizers():
    reward = AutoModelForSequenceClassification.from_config(
        actor_config(vocab_size=VOCAB + 7, num_labels=1, num_hidden_layers=1)
    ).eval()
    with pytest.raises(ValueError, match="reward: its vocabulary has 135 tokens, the actor's 128"):
        make_engine(make_actor(), reward)
    # tokenizer= alone means one tokenizer for both models: the vocabularies must then agree.
    with pytest.raises(ValueError, match="reward: its vocabulary has 135 tokens"):
        make_engine(make_actor(), reward, tokenizer=_word_tokenizer(["a"]))
    with pytest.raises(ValueError, match="reward_tokenizer needs tokenizer="):
        make_engine(make_actor(), reward, reward_tokenizer=_word_tokenizer(["a"]))


def test_reward_with_another_vocabulary_scores_the_retokenized_text():
    words = [f"w{i}" for i in range(VOCAB - 4)]
    actor_tok = _word_tokenizer(words)
    reward_tok = _word_tokenizer(list(reversed(words)) + ["extra"])  # other ids, other size
    torch.manual_seed(6)
    reward = AutoModelForSequenceClassification.from_config(
        actor_config(vocab_size=len(reward_tok), num_labels=1, num_hidden_layers=1, pad_token_id=0)
    ).eval()
    prompts = random_prompts(3, seed=6)
    got = rollout(make_actor(), reward, prompts, tokenizer=actor_tok, reward_tokenizer=reward_tok)
    for r in got:
        text = actor_tok.decode(r.prompt_ids + r.response_ids, skip_special_tokens=True)
        ids = reward_tok(text, return_tensors="pt")["input_ids"]
        assert ids[0].tolist() != r.prompt_ids + r.response_ids  # really another tokenization
        with torch.inference_mode():
            assert r.reward == pytest.approx(reward(input_ids=ids).logits[0, 0].item(), abs=ATOL)
