"""TRL's ``GRPOTrainer`` as a client of the engine: a ``rollout_func`` over a ``RolloutEngine``.

    args = GRPOConfig(num_generations=8, max_completion_length=256, bf16=False, ...)
    engine = RolloutEngine(model, reward_model,
                           config=EngineConfig(batch_size=args.generation_batch_size, mode="intra"),
                           sampling=sampling_params_for(args), eos_token_id=tokenizer.eos_token_id)
    trainer = GRPOTrainer(model=model, args=args, processing_class=tokenizer, train_dataset=dataset,
                          reward_funcs=engine_reward, rollout_func=engine_rollout_func(engine, args))

The contract of ``rollout_func`` in trl 1.16 (read from ``GRPOTrainer._generate``): it is called once per
generation batch with the process's prompts -- text, or chat messages -- each repeated
``num_generations`` times in a row (the trainer's ``RepeatSampler``; the docstring's "no duplication" is
not what it does), and ``trainer``. It returns a dict of per-completion lists ``prompt_ids``,
``completion_ids`` (EOS included when the completion ended) and ``logprobs`` (the sampling
distribution's), one entry per prompt entry in that order; every other key is an extra field that TRL
hands to each reward function as a keyword argument (but ``env_mask``, which TRL takes as its tool mask;
``logprob_token_ids``, named in the docstring, is read nowhere in 1.16 and would reach the reward
functions too). Without vLLM the ``logprobs`` only feed TRL's optional off-policy sequence mask
(``off_policy_mask_threshold``): TRL recomputes the old and reference log-probs with its own forward.

Each run of copies becomes one group: the prompt is queued once and the engine samples its
``num_generations`` responses on shared prompt pages. An engine with an environment (``RolloutEngine(env=)``)
returns multi-turn episodes: each completion is the whole transcript after the prompt, and ``env_mask`` (the
rollouts' ``action_mask``: 1 sampled, 0 observation) is what TRL takes as its tool mask, so GRPO's loss
reads only the sampled tokens. Only the modes whose step returns the rollouts of
exactly the prompts queued (``sequential``, ``intra``) fit; the overcommitting ones carry sequences across
steps and are refused.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

import torch
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from oppo_engine.config import SamplingParams
from oppo_engine.engine import RolloutEngine
from oppo_engine.obs.metrics import StepMetrics
from oppo_engine.sched.results import Rollout

# NOTE: keep in step with the ``trl`` extra in pyproject.toml.
SUPPORTED_TRL = SpecifierSet(">=1.16,<1.17")
# The extra field that carries the engine's reward-model score to the reward functions.
REWARD_FIELD = "engine_reward"
# Modes whose step returns all rollouts of the prompts it takes, and only those.
FITTING_MODES = ("sequential", "intra")


def check_trl_version(installed: str | None = None) -> str:
    """The installed trl version (or ``installed``), if this adapter supports it; else ``ImportError``."""
    if installed is None:
        try:
            installed = importlib.metadata.version("trl")
        except importlib.metadata.PackageNotFoundError:
            raise ImportError(
                f"oppo_engine.integrations.trl needs trl{SUPPORTED_TRL}, which is not installed: "
                "pip install 'oppo_engine[trl]'"
            ) from None
    if Version(installed) not in SUPPORTED_TRL:
        raise ImportError(
            f"trl {installed} is installed, but oppo_engine.integrations.trl supports trl{SUPPORTED_TRL} "
            "(its rollout_func contract changes between releases): pip install 'oppo_engine[trl]'"
        )
    return installed


check_trl_version()

from transformers import ProcessorMixin  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl.data_utils import is_conversational  # noqa: E402

# TRL's sampling options the engine honours: GRPOConfig option -> SamplingParams field.
_HONOURED_OPTIONS = {
    "num_generations": "n",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "max_completion_length": "max_new_tokens",
}
# TRL options the engine does not implement: option -> predicate "the option is off".
_UNSUPPORTED_OPTIONS = {
    "use_vllm": lambda v: not v,
    "repetition_penalty": lambda v: v == 1.0,
    "min_p": lambda v: v is None or v == 0.0,
    "generation_kwargs": lambda v: not v,
}


def sampling_params_for(args: GRPOConfig, seed: int | None = None) -> SamplingParams:
    """The engine ``SamplingParams`` that sample as ``args`` asks: ``n=num_generations``, its temperature,
    top-k, top-p and ``max_new_tokens=max_completion_length``."""
    _check_unsupported(args)
    return SamplingParams(**_sampling_fields(args), seed=seed)


def _sampling_fields(args: GRPOConfig) -> dict[str, Any]:
    """SamplingParams field -> the value ``args`` gives it (TRL's ``top_k=None`` is the engine's 0: off)."""
    fields = {field: getattr(args, option) for option, field in _HONOURED_OPTIONS.items()}
    fields["top_k"] = fields["top_k"] or 0
    return fields


def _check_unsupported(args: GRPOConfig) -> None:
    for option, is_off in _UNSUPPORTED_OPTIONS.items():
        if not is_off(getattr(args, option)):
            raise ValueError(
                f"GRPOConfig.{option}={getattr(args, option)!r} is not supported by the engine's "
                "rollout_func: leave it at its default"
            )
    if args.max_completion_length is None:
        raise ValueError("GRPOConfig.max_completion_length=None is not supported: the engine needs a bound")
    if args.num_generations_eval not in (None, args.num_generations):
        raise ValueError(
            f"GRPOConfig.num_generations_eval={args.num_generations_eval} differs from num_generations="
            f"{args.num_generations}: the engine samples one group size (SamplingParams.n)"
        )


def _check_args(args: GRPOConfig, engine: RolloutEngine) -> None:
    """``args`` asks for nothing the engine lacks, and samples as the engine does."""
    _check_unsupported(args)
    dtype = next(engine.actor.parameters()).dtype
    for option, autocast_dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        # NOTE: accelerate wraps the model's forward in autocast, which the engine's paged KV cache (in
        # the model's own dtype) cannot take in another dtype.
        if getattr(args, option) and dtype != autocast_dtype:
            raise ValueError(
                f"GRPOConfig.{option}=True autocasts the forward of a model in {dtype}, which the engine's "
                f"KV cache (in the model's dtype) does not support: set {option}=False, or load the model "
                f"in {autocast_dtype}"
            )
    sampling = engine.sampling
    wanted = _sampling_fields(args)
    for option, field in _HONOURED_OPTIONS.items():
        if wanted[field] != getattr(sampling, field):
            raise ValueError(
                f"GRPOConfig.{option}={getattr(args, option)!r} differs from the engine's "
                f"SamplingParams.{field}={getattr(sampling, field)!r}: build the engine with "
                "sampling=sampling_params_for(args)"
            )
    if sampling.ignore_eos:
        raise ValueError("the engine's SamplingParams.ignore_eos=True: TRL's completions end at EOS")
    if engine.env is not None and args.mask_truncated_completions:
        raise ValueError(
            "GRPOConfig.mask_truncated_completions=True with an engine environment: an episode the "
            "environment ends (finish_reason 'env_done') ends without EOS, and TRL would mask it all out; "
            "leave it False"
        )
    if sampling.stop_token_ids:
        raise ValueError(
            f"the engine's SamplingParams.stop_token_ids={sampling.stop_token_ids}: TRL treats a completion "
            "that ends without EOS as truncated; leave stop_token_ids empty"
        )


class EngineRolloutFunc:
    """``GRPOTrainer``'s ``rollout_func`` over ``engine`` (see the module docstring for the contract).

    The engine must run the trainer's own model (checked at the first call) and serve only this function.
    Each call queues the prompts of one generation batch and steps the engine until every group is back;
    before it, ``engine.update_policy()`` runs once if ``trainer.state.global_step`` advanced since the
    last call. ``step_metrics`` holds the engine's metrics of the last call's steps.
    """

    def __init__(self, engine: RolloutEngine, args: GRPOConfig) -> None:
        if engine.config.mode not in FITTING_MODES:
            raise ValueError(
                f"EngineConfig.mode={engine.config.mode!r} does not fit TRL's rollout_func: TRL hands over a "
                "fixed prompt slice and needs exactly its completions back, but an overcommitting mode "
                "returns the first rollouts to finish and carries the rest to later steps; use mode in "
                f"{FITTING_MODES}"
            )
        _check_args(args, engine)
        self.engine = engine
        self.args = args
        self.step_metrics: list[StepMetrics] = []
        self._trainer: GRPOTrainer | None = None
        self._last_global_step: int | None = None

    def __call__(self, prompts: list, trainer: GRPOTrainer) -> dict[str, list]:
        """One generation batch: ``prompts`` (each repeated ``n`` times in a row) -> TRL's output dict."""
        if trainer is not self._trainer:
            self._bind(trainer)
        step = trainer.state.global_step
        if self._last_global_step is not None and step != self._last_global_step:
            self.engine.update_policy()
        self._last_global_step = step

        n = self.engine.sampling.n
        heads = _group_heads(prompts, n)
        prompt_ids = _tokenize(heads, trainer)
        self.engine.add_prompts(prompt_ids)
        rollouts = self._collect(len(heads) * n)
        groups = _in_prompt_order(rollouts, prompt_ids, n)
        out = {
            "prompt_ids": [r.prompt_ids for r in groups],
            "completion_ids": [r.response_ids for r in groups],
            "logprobs": [r.logprobs for r in groups],
            REWARD_FIELD: [r.reward for r in groups],
        }
        if self.engine.env is not None:  # TRL's tool mask: its loss reads only the sampled tokens
            out["env_mask"] = [r.action_mask for r in groups]
        return out

    def _bind(self, trainer: GRPOTrainer) -> None:
        """Check, once per trainer, what only the trainer can tell: its model, EOS ids and features."""
        if self._trainer is not None:
            raise ValueError("this rollout_func already serves another GRPOTrainer: build one per trainer")
        model = trainer.accelerator.unwrap_model(trainer.model)
        replica = self.engine._replicas.by_role.get("actor")  # rollout_dtype: a copy refreshed from the model
        if model is not (
            replica.source if replica is not None and replica.source is not None else self.engine.actor
        ):
            raise ValueError(
                "the engine's actor is not the trainer's model: build the RolloutEngine on the model "
                "passed to GRPOTrainer, so that the completions come from the policy being trained"
            )
        if trainer.accelerator.num_processes != 1:
            raise ValueError(
                f"{trainer.accelerator.num_processes} processes: the engine's rollout_func runs in one "
                "process"
            )
        if trainer.tools or trainer.environment_factories:
            raise ValueError("GRPOTrainer tools / environment_factory are not supported by the engine")
        if isinstance(trainer.processing_class, ProcessorMixin):
            raise ValueError("a multimodal processing_class is not supported: the engine generates text only")
        if set(trainer.eos_token_ids) != set(self.engine.eos_token_ids):
            raise ValueError(
                f"the trainer ends completions at EOS ids {sorted(trainer.eos_token_ids)}, the engine at "
                f"{sorted(self.engine.eos_token_ids)}: pass eos_token_id={trainer.eos_token_ids} to the "
                "engine"
            )
        _check_args(trainer.args, self.engine)
        self._trainer = trainer

    def _collect(self, expected: int) -> list[Rollout]:
        """Step the engine until ``expected`` rollouts are back (each step returns whole groups)."""
        self.step_metrics = []
        rollouts: list[Rollout] = []
        while len(rollouts) < expected:
            result = self.engine.step()
            if result.failed:
                # TRL's advantages need every group whole: a quarantined group cannot be left out.
                bad = result.failed[0]
                raise RuntimeError(
                    f"the engine quarantined the group of prompt {bad.prompt_ids!r} (its completion "
                    f"failed: {bad.error}); TRL needs every group of the batch, so the step cannot go on"
                )
            if not result.rollouts:
                raise RuntimeError(
                    f"the engine ran dry after {len(rollouts)} of {expected} rollouts: it must serve only "
                    "this rollout_func"
                )
            rollouts.extend(result.rollouts)
            self.step_metrics.append(result.metrics)
        return rollouts


def engine_rollout_func(engine: RolloutEngine, args: GRPOConfig) -> EngineRolloutFunc:
    """A ``rollout_func`` for ``GRPOTrainer(args=args, ...)`` whose completions come from ``engine``.

    Raises ``ValueError`` now, naming the option, if the engine's mode does not fit (only ``sequential``
    and ``intra`` do) or ``args`` asks for sampling the engine does not do (``use_vllm``,
    ``repetition_penalty``, ``min_p``, ``generation_kwargs``, ``max_completion_length=None``, a different
    ``num_generations_eval``) or differs from the engine's ``SamplingParams`` in ``num_generations`` (n),
    ``temperature``, ``top_k``, ``top_p`` or ``max_completion_length`` (max_new_tokens).
    """
    return EngineRolloutFunc(engine, args)


def engine_reward(prompts: list, completions: list, **kwargs: Any) -> list[float]:
    """TRL reward function: each completion's reward-model score, streamed by the engine while it decoded
    (the ``engine_reward`` field of ``engine_rollout_func``'s output)."""
    scores = kwargs.get(REWARD_FIELD)
    if scores is None:
        raise ValueError(
            f"engine_reward reads the {REWARD_FIELD!r} field, which only engine_rollout_func returns: pass "
            "rollout_func=engine_rollout_func(engine, args) to GRPOTrainer"
        )
    return [float(s) for s in scores]


def _group_heads(prompts: list, n: int) -> list:
    """The first prompt of each run of ``n`` copies; ``ValueError`` unless ``prompts`` is such runs."""
    if len(prompts) % n:
        raise ValueError(f"rollout_func got {len(prompts)} prompts, not a multiple of num_generations={n}")
    heads = prompts[::n]
    for i, prompt in enumerate(prompts):
        if prompt != heads[i // n]:
            raise ValueError(
                f"rollout_func expects each prompt repeated num_generations={n} times in a row (TRL's "
                f"RepeatSampler), but prompt {i} differs from prompt {i - i % n}"
            )
    return heads


def _tokenize(prompts: list, trainer: GRPOTrainer) -> list[list[int]]:
    """Token ids of ``prompts`` as ``GRPOTrainer`` makes them: the chat template with a generation prompt
    (and ``chat_template_kwargs``) for messages, the plain tokenizer for text."""
    tokenizer = trainer.processing_class
    if is_conversational({"prompt": prompts[0]}):
        ids = tokenizer.apply_chat_template(
            conversation=prompts,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            **trainer.chat_template_kwargs,
        )["input_ids"]
    else:
        ids = tokenizer(text=prompts)["input_ids"]
    return [list(p) for p in ids]


def _in_prompt_order(rollouts: list[Rollout], prompt_ids: list[list[int]], n: int) -> list[Rollout]:
    """``rollouts`` sorted by (group, sample): TRL's order. ``RuntimeError`` unless they are exactly the
    ``n`` samples of each prompt in ``prompt_ids`` (the first queued group has the smallest group id)."""
    ordered = sorted(rollouts, key=lambda r: (r.group_id, r.sample_index))
    first = ordered[0].group_id
    expected = [(first + i // n, i % n) for i in range(len(prompt_ids) * n)]
    got = [(r.group_id, r.sample_index) for r in ordered]
    if got != expected or any(r.prompt_ids != prompt_ids[r.group_id - first] for r in ordered):
        raise RuntimeError(
            "the engine returned rollouts of prompts this rollout_func did not queue: it must serve only "
            "this rollout_func"
        )
    return ordered


class AgreementGRPOTrainer(GRPOTrainer):
    """TRL's ``GRPOTrainer`` that also logs the rollout-trainer agreement (``oppo_engine.ppo.agreement``).

    In every ``_compute_loss`` it takes the log-probs TRL's own training forward computed for the loss
    (``_get_per_token_logps_and_entropies``, no extra forward) and the behaviour log-probs the engine
    returned (TRL's ``sampling_per_token_logps``), and logs ``agreement.measure`` of the gap ``delta = log
    pi_trainer - log pi_behaviour`` over the completion's sampled tokens (``completion_mask``, times the
    ``env_mask`` of multi-turn episodes) as ``agreement/<field>`` in TRL's metrics, with
    ``agreement/truncated_sampling`` (1 under top-k/top-p: the behaviour log-probs are of a truncated
    law, TRL's are not). TRL never carries a sequence over a step (the adapter refuses ``inter``/``oppo``),
    so every token is of the ``fresh`` class. ``last_agreement`` holds the last ``Agreement`` measured.

    The gap is the trainer/rollout one while the weights are those that sampled: TRL's default
    (``num_iterations=1`` and ``steps_per_generation <= gradient_accumulation_steps``). Later iterations
    over a generation batch measure the policy's own movement as well. TRL averages each metric over the
    calls of a logging interval (``agreement/max_abs`` is then the mean of the per-call maxima).
    """

    def _compute_loss(self, model, inputs):
        self._trainer_logps: torch.Tensor | None = None
        self._capture_logps = True
        try:
            loss = super()._compute_loss(model, inputs)
        finally:
            self._capture_logps = False
        behaviour = inputs.get("sampling_per_token_logps")
        if self._trainer_logps is not None and behaviour is not None:
            self._log_agreement(self._trainer_logps, behaviour, inputs)
        return loss

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        if getattr(self, "_capture_logps", False) and self._trainer_logps is None:
            self._trainer_logps = out[0].detach()  # the first call of _compute_loss: the loss's forward
        return out

    def _log_agreement(self, trainer_logps: torch.Tensor, behaviour: torch.Tensor, inputs: dict) -> None:
        from oppo_engine.ppo import agreement

        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        none = torch.zeros_like(mask, dtype=torch.bool)
        carried = torch.zeros(len(mask), dtype=torch.bool, device=mask.device)
        gap = agreement.measure(trainer_logps, behaviour.to(trainer_logps), mask, none, carried)["fresh"]
        self.last_agreement = gap
        metrics = self._metrics["train" if self.model.training else "eval"]
        for name in gap.__slots__:
            metrics[f"agreement/{name}"].append(float(getattr(gap, name)))
        truncated = self.args.top_k not in (None, 0) or self.args.top_p not in (None, 1.0)
        metrics["agreement/truncated_sampling"].append(float(truncated))
