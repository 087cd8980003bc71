"""Engine and sampling configuration (public API: see DESIGN.md)."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields

import torch

from oppo_engine.control import ChunkControl, DeltaControl

MODES = ("sequential", "intra", "inter", "oppo")
RETAINED_KV_POLICIES = ("recompute", "reuse")
# The knobs only some modes read: a knob set (to other than its default) for a mode that ignores it is an
# error, not a silent no-op.
_KNOB_MODES = {
    "chunk_size": ("intra", "oppo"),  # streamed scoring
    "chunk": ("intra", "oppo"),  # the online chunk-size search
    "overcommit": ("inter", "oppo"),  # the overcommit buffer
    "delta": ("inter", "oppo"),  # the online overcommit control
    "max_deferrals": ("inter", "oppo"),
    "retained_kv": ("inter", "oppo"),  # deferred sequences across a policy update
    "max_policy_lag": ("inter", "oppo"),  # the staleness bound of carried sequences
}


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass(slots=True)
class SamplingParams:
    """How a prompt's response is sampled.

    ``temperature=0`` is greedy. ``top_k=0`` and ``top_p=1.0`` disable truncation. ``seed=None`` derives
    the sequence's RNG seed from the engine's default seed and the prompt's index, so results do not depend
    on batch composition; an explicit seed is used as given. ``ignore_eos=True`` generates exactly
    ``max_new_tokens`` tokens (benchmarks): it ignores EOS only, never ``stop_token_ids``.
    ``stop_token_ids`` end a response too, as EOS does (vLLM's ``stop_token_ids``); EOS and stop tokens are
    kept in ``response_ids`` and ``logprobs``, because RL trains on them.

    ``n`` samples each prompt ``n`` times (a group: GRPO, RLOO, PPO with n > 1). Sample 0 uses the prompt's
    seed (so ``n=1`` changes nothing) and sample ``j`` a seed derived from it and ``j``; the prompt is
    prefilled once per model and its pages shared. All prompts of one engine use the same ``n``.

    Multi-turn episodes (a sequence with an environment: ``RolloutEngine(env=...)`` or
    ``add_prompts(envs=...)``; docs/multi-turn.md): a turn ends on one of ``turn_stop_token_ids`` (kept in
    the turn) or after ``max_turn_tokens`` sampled tokens (``None``: no limit); the environment's
    observation is then appended and the next turn sampled. ``max_turns`` (``None``: no limit) ends the
    episode when that many turns have ended (``finish_reason="max_turns"``, the last turn not sent to the
    environment); ``max_new_tokens`` counts the sampled tokens of every turn, never observation tokens.
    ``max_observation_tokens`` (``None``: no limit) keeps the first that many tokens of each observation and
    counts the cut in ``Rollout.truncated_observations``. Without an environment these must stay unset.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 512
    ignore_eos: bool = False
    seed: int | None = None
    n: int = 1
    stop_token_ids: tuple[int, ...] = ()
    turn_stop_token_ids: tuple[int, ...] = ()
    max_turn_tokens: int | None = None
    max_turns: int | None = None
    max_observation_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("stop_token_ids", "turn_stop_token_ids"):
            stop = getattr(self, name)
            if isinstance(stop, int | str) or not all(_is_token_id(t) for t in stop):
                raise ValueError(f"SamplingParams.{name} must be a sequence of token ids >= 0, got {stop!r}")
            setattr(self, name, tuple(int(t) for t in stop))
        for name in ("max_turn_tokens", "max_turns", "max_observation_tokens"):
            value = getattr(self, name)
            if value is not None and not (_is_token_id(value) and value >= 1):
                raise ValueError(f"SamplingParams.{name} must be an int >= 1 or None, got {value!r}")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"SamplingParams.n must be an int >= 1, got {self.n!r}")
        if not self.temperature >= 0.0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass(slots=True)
class EngineConfig:
    """Engine configuration.

    ``batch_size`` (B) rollouts are returned per ``step()``. ``mode`` picks the pipeline: ``sequential``
    (generate all, then score all), ``intra`` (streamed scoring), ``inter`` (overcommit), ``oppo`` (both,
    the default). ``chunk_size`` (tokens per streamed chunk) and ``overcommit``
    (Δ) are ints or ``"auto"`` (online control). A knob set explicitly that the chosen mode ignores
    (``chunk_size`` outside ``intra``/``oppo``; ``overcommit`` and ``retained_kv`` outside
    ``inter``/``oppo``) raises ``ValueError``; defaults never do. ``chunk`` (``ChunkControl``) sets the
    online chunk-size search of ``chunk_size="auto"``; ``delta`` (``DeltaControl``) the online Δ of
    ``overcommit="auto"``; ``max_deferrals`` bounds how many steps a sequence may be deferred.
    ``max_policy_lag`` (default 2) bounds staleness: no returned token was sampled more than this many
    policy versions (``update_policy`` calls) before the step that returns it, when ``update_policy`` is
    called at most once between two steps; a carried sequence about to exceed it is due and taken by the
    next batch. ``None`` leaves only ``max_deferrals``. While it is
    set, a fixed ``overcommit`` (or ``delta.max``) above ``batch_size`` is refused: more sequences could
    fall due than one batch holds.
    ``kv_cache_bytes=None`` sizes the arena for B (+ Δ_max under overcommit: ``overcommit`` when fixed,
    ``delta.max`` under "auto", B/4 by default) sequences of ``max_model_len`` tokens in every model,
    capped to 40% of the free device memory on CUDA or 25% of the RAM on the CPU.
    ``max_model_len`` bounds prompt + response tokens; ``None`` (the default) resolves at build to the
    smallest of 4096 and every model's position limit, read back as ``RolloutEngine.max_model_len``.
    ``max_num_batched_tokens`` bounds the tokens of one forward (chunked prefill). ``attention_backend`` is
    ``"triton"`` or ``"flash_attn"`` (CUDA only). ``graph`` runs the actor's decode-only forwards through
    captured graphs (CUDA graphs per batch-size bucket on CUDA, ``torch.compile`` on the CPU): ``True``,
    ``False``, or ``"auto"`` (fixed per device type: on for CUDA, off for the CPU). ``packed_weights``
    multiplies by the actor's ``nn.Linear`` weights packed once into oneDNN's layout rather than repacked
    at every call (CPU, fp32 and bf16; one more copy of those weights, refreshed when they change:
    ``oppo_engine/model/packed.py``): ``True``, ``False``, or ``"auto"`` (on for the CPU).
    ``rollout_dtype`` is the dtype of the rollout replicas of a sharded (FSDP2) or meta-device
    actor/critic (``None``: the dtype their weights are stored in; bf16 replicas of fp32 trainer weights
    are common); an unsharded actor/critic stored in another dtype gets a replica in it too, refreshed by
    ``update_policy()``.
    ``env_workers`` is the number of worker threads that run environment calls off the actor lane
    (``None``: one per sequence in flight, B + Δ_max); an async ``step`` runs on one event loop instead.
    ``env_timeout_s`` (``None``: no limit) ends a sequence whose environment call runs longer with
    ``finish_reason="error"`` (``StepResult.failed``).
    ``share_prompt_prefix`` (default ``True``): prompts sampled once (``n == 1``) that begin with the same
    tokens -- a chat template's system turn, a few-shot example -- share them across prompts: among the
    prompts a step admits, the first ``shared_prefix_min_tokens`` or more identical leading tokens of a class
    of prompts are computed once per model (actor, reward, reference, critic) and their KV pages shared, as
    a group's samples share their prompt. Each prompt's rollout is the engine's without it, to rounding;
    under overcommit the step that returns a prompt may differ (a shared prefix moves the forward a
    sequence finishes in, and so which B finish first).
    ``shared_prefix_min_tokens`` (``None``: ``page_size``) is the shortest prefix worth sharing.
    """

    batch_size: int = 64
    mode: str = "oppo"
    chunk_size: int | str = "auto"
    overcommit: int | str = "auto"
    page_size: int = 16
    kv_cache_bytes: int | None = None
    max_model_len: int | None = None
    max_num_batched_tokens: int = 4096
    retained_kv: str = "recompute"
    attention_backend: str = "triton"
    chunk: ChunkControl = field(default_factory=ChunkControl)
    delta: DeltaControl = field(default_factory=DeltaControl)
    max_deferrals: int = 4
    max_policy_lag: int | None = 2
    graph: bool | str = "auto"
    packed_weights: bool | str = "auto"
    rollout_dtype: torch.dtype | None = None
    env_workers: int | None = None
    env_timeout_s: float | None = None
    share_prompt_prefix: bool = True
    shared_prefix_min_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"EngineConfig.batch_size must be >= 1, got {self.batch_size}")
        if self.mode not in MODES:
            raise ValueError(f"EngineConfig.mode must be one of {MODES}, got {self.mode!r}")
        for name in ("chunk_size", "overcommit"):
            value = getattr(self, name)
            minimum = 1 if name == "chunk_size" else 0
            if value != "auto" and not (isinstance(value, int) and value >= minimum):
                raise ValueError(f"EngineConfig.{name} must be 'auto' or an int >= {minimum}, got {value!r}")
        if self.page_size < 8 or self.page_size & (self.page_size - 1):
            raise ValueError(f"EngineConfig.page_size must be a power of two >= 8, got {self.page_size}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError(
                f"EngineConfig.kv_cache_bytes must be positive or None, got {self.kv_cache_bytes}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"EngineConfig.max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"EngineConfig.max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.retained_kv not in RETAINED_KV_POLICIES:
            raise ValueError(
                f"EngineConfig.retained_kv must be one of {RETAINED_KV_POLICIES}, got {self.retained_kv!r}"
            )
        if self.attention_backend not in ("triton", "flash_attn"):
            raise ValueError(
                "EngineConfig.attention_backend must be 'triton' or 'flash_attn', "
                f"got {self.attention_backend!r}"
            )
        if not isinstance(self.chunk, ChunkControl):
            raise ValueError(f"EngineConfig.chunk must be a ChunkControl, got {self.chunk!r}")
        if not isinstance(self.delta, DeltaControl):
            raise ValueError(f"EngineConfig.delta must be a DeltaControl, got {self.delta!r}")
        if self.max_deferrals < 1:
            raise ValueError(f"EngineConfig.max_deferrals must be >= 1, got {self.max_deferrals}")
        self._check_policy_lag()
        if self.rollout_dtype is not None and not (
            isinstance(self.rollout_dtype, torch.dtype) and self.rollout_dtype.is_floating_point
        ):
            raise ValueError(
                "EngineConfig.rollout_dtype must be a floating torch.dtype or None, got "
                f"{self.rollout_dtype!r}"
            )
        if self.env_workers is not None and not (_is_token_id(self.env_workers) and self.env_workers >= 1):
            raise ValueError(
                f"EngineConfig.env_workers must be an int >= 1 or None, got {self.env_workers!r}"
            )
        timeout = self.env_timeout_s
        if timeout is not None and not (isinstance(timeout, int | float) and timeout > 0):
            raise ValueError(f"EngineConfig.env_timeout_s must be a number > 0 or None, got {timeout!r}")
        if self.graph not in ("auto", True, False):
            raise ValueError(f"EngineConfig.graph must be 'auto', True or False, got {self.graph!r}")
        if self.packed_weights not in ("auto", True, False):
            raise ValueError(
                f"EngineConfig.packed_weights must be 'auto', True or False, got {self.packed_weights!r}"
            )
        if not isinstance(self.share_prompt_prefix, bool):
            raise ValueError(
                f"EngineConfig.share_prompt_prefix must be True or False, got {self.share_prompt_prefix!r}"
            )
        least = self.shared_prefix_min_tokens
        if least is not None and not (_is_token_id(least) and least >= 1):
            raise ValueError(
                f"EngineConfig.shared_prefix_min_tokens must be an int >= 1 or None, got {least!r}"
            )
        if least is not None and not self.share_prompt_prefix:
            raise ValueError(
                f"EngineConfig.shared_prefix_min_tokens={least!r} is ignored with share_prompt_prefix=False; "
                "leave it at None or turn sharing on"
            )
        if self.chunk != ChunkControl() and self.chunk_size != "auto":
            raise ValueError(
                f"EngineConfig.chunk is ignored with chunk_size={self.chunk_size!r}: the search runs only "
                "under chunk_size='auto'"
            )
        if self.delta != DeltaControl() and self.overcommit != "auto":
            raise ValueError(
                f"EngineConfig.delta is ignored with overcommit={self.overcommit!r}: the controller runs "
                "only under overcommit='auto'"
            )
        defaults = {f.name: f.default_factory() if f.default is MISSING else f.default for f in fields(self)}
        for name, modes in _KNOB_MODES.items():
            value = getattr(self, name)
            if value != defaults[name] and self.mode not in modes:
                raise ValueError(
                    f"EngineConfig.{name}={value!r} is ignored by mode={self.mode!r}: it applies only to "
                    f"mode in {modes}; leave it at its default ({defaults[name]!r}) or change the mode"
                )

    def _check_policy_lag(self) -> None:
        lag = self.max_policy_lag
        if lag is not None and not (_is_token_id(lag) and lag >= 1):
            raise ValueError(f"EngineConfig.max_policy_lag must be an int >= 1 or None, got {lag!r}")
        if lag is None or self.mode not in ("inter", "oppo"):
            return
        fixed = self.overcommit if isinstance(self.overcommit, int) else None
        bound = ("overcommit", fixed) if fixed is not None else ("delta.max", self.delta.max)
        if bound[1] is not None and bound[1] > self.batch_size:
            raise ValueError(
                f"EngineConfig.{bound[0]}={bound[1]} exceeds batch_size={self.batch_size} while "
                f"max_policy_lag={lag}: more carried sequences could fall due than one batch holds; lower "
                f"{bound[0]} to at most batch_size, or set max_policy_lag=None (staleness then bounded by "
                "max_deferrals only)"
            )
