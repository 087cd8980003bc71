"""Tiny random-init decoders of every family the engine accepts, and HF's own forward as the oracle.

Each family is built from its config (no hub): hidden 32-64, 2 layers, vocab 128, GQA where the family has
it, ``initializer_range=0.1`` so attention is far from uniform (a wrong mask or position shows up in the
logits). Token ids 0-3 are special (pad 0, bos 1, eos 3); prompts use ids from 4 up.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import transformers
from packaging.version import Version
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

VOCAB = 128
PAD = 0
BOS = 1
EOS = 3
INIT = 0.1
SLIDING_WINDOW = 5  # shorter than most prompt + response lengths, so the window matters


@dataclass(frozen=True)
class Family:
    """One decoder family: its config class and the tiny config's arguments.

    ``features`` names what the family adds to a plain causal decoder (the tests use them to decide which
    "this feature matters" check applies): ``window``, ``softcap``, ``final_softcap``, ``logit_scale``,
    ``partial_rotary``, ``moe``, ``multipliers``. ``routed_since``: the transformers release that moved the
    family's attention onto ``AttentionInterface`` (``None``: every supported release routes it); on an older
    release the engine refuses the family when it is built.
    """

    name: str
    config: str  # transformers config class name
    kwargs: dict = field(default_factory=dict)
    features: frozenset[str] = frozenset()
    routed_since: str | None = None

    @property
    def routed(self) -> bool:
        """Whether the installed transformers dispatches this family's attention through the interface."""
        return self.routed_since is None or Version(transformers.__version__) >= Version(self.routed_since)

    def make_config(self, **overrides) -> transformers.PretrainedConfig:
        args = dict(
            vocab_size=VOCAB,
            num_hidden_layers=2,
            initializer_range=INIT,
            pad_token_id=PAD,
            bos_token_id=BOS,
            eos_token_id=EOS,
            tie_word_embeddings=False,
            max_position_embeddings=256,
        )
        args.update(self.kwargs)
        args.update(overrides)
        return getattr(transformers, self.config)(**args)


_GQA = dict(hidden_size=48, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in [
        Family("llama", "LlamaConfig", dict(_GQA)),
        Family("qwen2", "Qwen2Config", dict(_GQA)),
        Family("qwen3", "Qwen3Config", dict(_GQA, head_dim=16)),
        Family("mistral", "MistralConfig", dict(_GQA, sliding_window=None)),
        Family(
            "mistral_window",
            "MistralConfig",
            dict(_GQA, sliding_window=SLIDING_WINDOW),
            frozenset({"window"}),
        ),
        Family("gemma", "GemmaConfig", dict(_GQA, head_dim=16, tie_word_embeddings=True)),
        Family(
            "gemma2",
            "Gemma2Config",
            dict(
                _GQA,
                head_dim=16,
                query_pre_attn_scalar=16,
                sliding_window=SLIDING_WINDOW,
                layer_types=["sliding_attention", "full_attention"],
                attn_logit_softcapping=2.0,
                final_logit_softcapping=3.0,
                tie_word_embeddings=True,
            ),
            frozenset({"window", "softcap", "final_softcap"}),
        ),
        Family(
            "gemma3",
            "Gemma3TextConfig",
            dict(
                _GQA,
                head_dim=16,
                query_pre_attn_scalar=16,
                sliding_window=SLIDING_WINDOW,
                layer_types=["sliding_attention", "full_attention"],
                final_logit_softcapping=3.0,
                tie_word_embeddings=True,
            ),
            frozenset({"window", "final_softcap"}),
        ),
        Family("phi3", "Phi3Config", dict(_GQA, sliding_window=None)),
        Family("olmo2", "Olmo2Config", dict(_GQA)),
        Family(
            "gpt_neox",
            "GPTNeoXConfig",
            dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, rotary_pct=0.25),
            frozenset({"partial_rotary"}),
        ),
        Family(
            "gpt2",
            "GPT2Config",
            dict(n_embd=48, n_head=4, n_layer=2, n_positions=256, n_inner=96, tie_word_embeddings=True),
        ),
        Family(
            "granite",
            "GraniteConfig",
            dict(
                _GQA,
                logits_scaling=8.0,
                attention_multiplier=0.5,
                embedding_multiplier=4.0,
                residual_multiplier=0.5,
            ),
            frozenset({"multipliers", "logit_scale"}),
        ),
        Family("cohere", "CohereConfig", dict(_GQA, logit_scale=0.25), frozenset({"logit_scale"})),
        Family(
            "stablelm",
            "StableLmConfig",
            dict(_GQA, hidden_size=64, intermediate_size=128, partial_rotary_factor=0.25),
            frozenset({"partial_rotary"}),
        ),
        # Older families HF has moved onto AttentionInterface: the engine accepts them, so they are checked.
        # GPT-J and CodeGen moved in transformers 5.24 (5.17, the H200's, still has their own attention).
        Family(
            "gptj",
            "GPTJConfig",
            dict(n_embd=48, n_head=4, n_positions=256, rotary_dim=4),
            frozenset({"partial_rotary"}),
            routed_since="5.24",
        ),
        Family(
            "codegen",
            "CodeGenConfig",
            dict(n_embd=48, n_head=4, n_positions=256, rotary_dim=4),
            frozenset({"partial_rotary"}),
            routed_since="5.24",
        ),
        # Falcon moved in 5.25: Falcon-7B's layout (one K/V head, attention and MLP in parallel) and
        # Falcon-40B's (grouped K/V heads, the queries of a group beside their key and value). Its ALiBi
        # variant is refused (test_model_families.py, REFUSED).
        Family("falcon", "FalconConfig", dict(hidden_size=48, num_attention_heads=4), routed_since="5.25"),
        Family(
            "falcon_new",
            "FalconConfig",
            dict(hidden_size=48, num_attention_heads=4, num_kv_heads=2, new_decoder_architecture=True),
            routed_since="5.25",
        ),
        Family(
            "opt",
            "OPTConfig",
            dict(hidden_size=48, num_attention_heads=4, ffn_dim=96, word_embed_proj_dim=48),
        ),
        Family(
            "phi",
            "PhiConfig",
            dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96),
        ),
        Family(
            "gpt_bigcode", "GPTBigCodeConfig", dict(n_embd=48, n_head=4, n_positions=256, multi_query=True)
        ),
        Family(
            "qwen2_moe",
            "Qwen2MoeConfig",
            dict(
                _GQA,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=32,
            ),
            frozenset({"moe"}),
        ),
        Family(
            "mixtral",
            "MixtralConfig",
            dict(_GQA, num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
            frozenset({"moe"}),
        ),
    ]
}

# The families the installed transformers lets the engine run (the exactness matrix).
ROUTED = [n for n, f in FAMILIES.items() if f.routed]

# transformers has no sequence-classification class for these: their engines get a Llama reward model.
NO_REWARD_CLASS = frozenset({"granite", "cohere", "codegen"})
# HF scores the last non-pad token; with pad id == EOS a response ending in EOS is scored at the token before.
PAD_IS_EOS = frozenset({"gpt2"})


def reward_family(name: str) -> str:
    """The family of the reward model paired with family ``name``'s actor."""
    return "llama" if name in NO_REWARD_CLASS else name


def build_actor(
    name: str, *, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides
) -> torch.nn.Module:
    """The family's tiny causal LM, eval mode, eager attention (the reference every feature supports)."""
    torch.manual_seed(seed)
    cfg = FAMILIES[name].make_config(**overrides)
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="eager").eval()


def build_reward(
    name: str, *, dtype: torch.dtype = torch.float32, seed: int = 1, **overrides
) -> torch.nn.Module:
    """The family's tiny one-label reward model (pad id = EOS for the families in ``PAD_IS_EOS``)."""
    torch.manual_seed(seed)
    if name in PAD_IS_EOS:
        overrides.setdefault("pad_token_id", EOS)
    cfg = FAMILIES[name].make_config(num_labels=1, **overrides)
    return AutoModelForSequenceClassification.from_config(
        cfg, dtype=dtype, attn_implementation="eager"
    ).eval()


def prompts(lengths: Sequence[int], *, seed: int = 0) -> list[list[int]]:
    """Random prompts of the given lengths over the non-special ids."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in lengths]


# -- HF's own forward: the oracle ---------------------------------------------------------------------


@torch.inference_mode()
def hf_logits(model: torch.nn.Module, ids: Sequence[int]) -> torch.Tensor:
    """HF's logits ``[len(ids), V]`` float32 for one unpadded sequence (its own head and post-processing)."""
    x = torch.tensor([list(ids)], device=model.device)
    return model(input_ids=x, use_cache=False).logits[0].float()


@torch.inference_mode()
def hf_score(model: torch.nn.Module, ids: Sequence[int]) -> float:
    """HF's one-label score of one sequence (its own choice of the pooled token, pad == EOS included)."""
    x = torch.tensor([list(ids)], device=model.device)
    return float(model(input_ids=x, use_cache=False).logits[0, 0])


def hf_behaviour_logprobs(
    model: torch.nn.Module, prompt: Sequence[int], response: Sequence[int], temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logprobs [R], logits [R, V])`` of ``response`` given ``prompt`` under HF's forward.

    Greedy (``temperature == 0``) uses the unscaled logits; otherwise ``logits / temperature``.
    """
    logits = hf_logits(model, list(prompt) + list(response))[len(prompt) - 1 : -1]
    scaled = logits if temperature == 0 else logits / temperature
    token = torch.tensor(list(response), device=logits.device)
    return torch.log_softmax(scaled, -1).gather(1, token[:, None])[:, 0], logits


def without(model: torch.nn.Module, edit: Callable[[torch.nn.Module], None]) -> torch.nn.Module:
    """A deep copy of ``model`` with ``edit`` applied to it (feature-ablation checks)."""
    clone = copy.deepcopy(model)
    edit(clone)
    return clone


def drop_window(model: torch.nn.Module) -> None:
    """Widen every sliding window past any sequence here (config and the per-module copies HF keeps)."""
    wide = 1 << 20
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and getattr(cfg, "sliding_window", None) is not None:
            cfg.sliding_window = wide
        if getattr(m, "sliding_window", None) is not None:
            m.sliding_window = wide


def drop_softcaps(model: torch.nn.Module, *, final: bool = True) -> None:
    """Remove attention-logit softcapping, and final-logit softcapping unless ``final=False``."""
    if final:
        model.config.final_logit_softcapping = None
    model.config.attn_logit_softcapping = None
    for m in model.modules():
        if hasattr(m, "attn_logit_softcapping"):
            m.attn_logit_softcapping = None
