"""Rollout replicas of sharded (FSDP2) and meta-device trainer models: an FSDP2 actor and critic on 2 gloo
ranks roll out exactly as the same weights unsharded, before and after optimizer steps, with the replica
equal to the gathered weights bit for bit; ``update_policy(weights=...)`` validates everything before it
copies anything; ``release_memory(weights=True)`` frees the replicas and ``resume()`` gathers them again.
"""

from __future__ import annotations

import copy
import functools
import math
import types
from collections import Counter

import pytest
import torch
from distributed import run_ranks
from engine_models import EOS, VOCAB, make_reward, random_prompts
from test_ppo_scorers import make_critic
from transformers import LlamaConfig, LlamaForCausalLM

from oppo_engine import EngineConfig, RolloutEngine, SamplingParams
from oppo_engine.model import replica as replica_module

WORLD = 2


def llama_config(**overrides) -> LlamaConfig:
    cfg = dict(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, eos_token_id=EOS,
        pad_token_id=0,
    )  # fmt: skip
    cfg.update(overrides)
    return LlamaConfig(**cfg)


def make_llama(seed: int = 0, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config(**overrides)).eval()


def make_engine(actor, reward, critic=None, *, mode="inter", **cfg) -> RolloutEngine:
    cfg.setdefault("max_model_len", 64)
    cfg.setdefault("page_size", 8)
    if mode in ("inter", "oppo"):
        cfg.setdefault("overcommit", 2)
    return RolloutEngine(
        actor=actor,
        reward=reward,
        critic=critic,
        config=EngineConfig(batch_size=2, mode=mode, **cfg),
        sampling=SamplingParams(temperature=1.0, max_new_tokens=12, seed=5),
        eos_token_id=EOS,
    )


def summary(result) -> list[tuple]:
    """What a rollout is, in picklable numbers."""
    return [
        (r.group_id, r.prompt_ids, r.response_ids, r.logprobs, r.reward, r.values, r.policy_versions,
         r.deferred_steps)
        for r in result.rollouts
    ]  # fmt: skip


def replica_params(engine: RolloutEngine, role: str = "actor") -> dict[str, torch.Tensor]:
    return engine._replicas.by_role[role].params


# -- 2 gloo ranks: FSDP2 actor and critic ------------------------------------------------------------------


def _shard(model: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    return fully_shard(model)


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The FSDP2 model's full weights (one all-gather per parameter)."""
    return {n: p.detach().full_tensor() for n, p in model.named_parameters()}


def _train(rank: int, actor, critic, opt) -> None:
    """One optimizer step of both FSDP2 models on this rank's own data (FSDP reduces the gradients)."""
    ids = torch.tensor([random_prompts(1, seed=100 + rank, min_len=8, max_len=8)[0]])
    loss = actor(input_ids=ids).logits.float().logsumexp(-1).mean() + critic(input_ids=ids).logits.mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


def _equal_to(engine, role: str, full: dict[str, torch.Tensor], dtype=None) -> list[str]:
    """Names of the replica's parameters that differ from ``full`` (cast to ``dtype``) in any bit."""
    got = replica_params(engine, role)
    assert set(got) == set(full)
    return [n for n, t in full.items() if not torch.equal(got[n], t if dtype is None else t.to(dtype))]


def _fsdp_scenario(rank: int, world_size: int) -> dict:
    out: dict = {"direct_gathers": Counter()}
    direct = replica_module._gather_into

    def counted(dst, src):  # which parameters went straight into the replica, which through full_tensor()
        done = direct(dst, src)
        out["direct_gathers"][done] += 1
        return done

    replica_module._gather_into = counted
    actor, critic, reward = make_llama(), make_critic(), make_reward()
    plain_actor, plain_critic = copy.deepcopy(actor), copy.deepcopy(critic)
    _shard(actor)
    _shard(critic)
    sharded = make_engine(actor, reward, critic)
    plain = make_engine(plain_actor, reward, plain_critic)
    out["local_numel"] = sum(p.to_local().numel() for p in actor.parameters())
    out["full_numel"] = sum(p.numel() for p in plain_actor.parameters())
    out["at_build"] = _equal_to(sharded, "actor", _full(actor)) + _equal_to(sharded, "critic", _full(critic))
    prompts = random_prompts(6, seed=10 + rank)
    for engine in (sharded, plain):
        engine.add_prompts(prompts)
    out["step1"] = [summary(sharded.step()), summary(plain.step())]
    opt = torch.optim.Adam([*actor.parameters(), *critic.parameters()], lr=1e-2)
    ids_before = [id(p) for p in replica_params(sharded).values()]

    _train(rank, actor, critic, opt)
    full_actor, full_critic = _full(actor), _full(critic)
    plain_actor.load_state_dict(full_actor)  # in place: the plain engine shares these tensors
    plain_critic.load_state_dict(full_critic)
    out["stale_before_update"] = bool(_equal_to(sharded, "actor", full_actor))
    sharded.update_policy()
    plain.update_policy()
    out["after_update"] = _equal_to(sharded, "actor", full_actor) + _equal_to(sharded, "critic", full_critic)
    out["same_parameter_objects"] = ids_before == [id(p) for p in replica_params(sharded).values()]
    state = sharded.state_dict()
    out["carried"] = len(state["carried"])
    fresh = make_engine(copy.deepcopy(plain_actor), reward, copy.deepcopy(plain_critic))
    fresh.load_state_dict(state)
    out["step2"] = [summary(sharded.step()), summary(plain.step()), summary(fresh.step())]

    # Sleep with the replicas freed, train, wake: the gather happens at resume().
    sharded.release_memory(weights=True)
    plain.release_memory()
    out["freed"] = all(p.untyped_storage().nbytes() == 0 for p in replica_params(sharded).values())
    try:
        sharded.step()
        out["step_while_released"] = None
    except RuntimeError as e:
        out["step_while_released"] = str(e)
    _train(rank, actor, critic, opt)
    full_actor, full_critic = _full(actor), _full(critic)
    plain_actor.load_state_dict(full_actor)
    plain_critic.load_state_dict(full_critic)
    sharded.update_policy()
    plain.update_policy()
    sharded.resume()
    plain.resume()
    out["after_resume"] = _equal_to(sharded, "actor", full_actor) + _equal_to(sharded, "critic", full_critic)
    out["same_parameter_objects_after_resume"] = ids_before == [
        id(p) for p in replica_params(sharded).values()
    ]
    out["step3"] = [summary(sharded.step()), summary(plain.step())]
    out["step3_released_bytes"] = sum(p.untyped_storage().nbytes() for p in replica_params(sharded).values())

    # bf16 replicas of the fp32 trainer weights.
    half = make_engine(actor, reward, critic, rollout_dtype=torch.bfloat16)
    out["bf16_dtype"] = str(next(iter(replica_params(half).values())).dtype)
    out["bf16_exact"] = _equal_to(half, "actor", full_actor, torch.bfloat16)
    want = make_engine(_bf16_copy(plain_actor), reward, _bf16_copy(plain_critic))
    for engine in (half, want):
        engine.add_prompts(prompts)
    out["bf16_step"] = [summary(half.step()), summary(want.step())]
    out["oppo"] = _oppo_steps(rank, actor, critic, opt, plain_actor, plain_critic, reward, prompts)
    out["peft"] = _peft_refusal()
    out["failed_sync"] = _failed_sync(sharded, actor, critic, opt, rank)
    out["mixed"] = _mixed_validation(rank, actor, reward)
    return out


def _mixed_validation(rank: int, actor, reward) -> dict:
    """An FSDP2 actor (gathered) beside a meta-device critic (fed): rank 0's critic weights lack a
    parameter, rank 1's are complete. Both calls must fail before the actor's gather (rank 1 must not
    enter it alone), change nothing, and a good call after them must sync on both ranks."""
    critic = make_critic()
    with torch.device("meta"):
        meta_critic = type(critic)(critic.config)
    engine = make_engine(actor, reward, meta_critic)
    good = dict(critic.named_parameters())
    bad = {n: t for n, t in good.items() if n != "score.weight"} if rank == 0 else good
    out = {}
    try:
        engine.update_policy(critic_weights=bad)
        out["raised"] = None
    except ValueError as e:
        out["raised"] = str(e)
    out["version_kept"] = engine.policy_version == 0
    out["critic_ready"] = engine._replicas.by_role["critic"].ready
    engine.update_policy(critic_weights=good)
    out["version_after_retry"] = engine.policy_version
    out["actor_after_retry"] = _equal_to(engine, "actor", _full(actor))
    out["critic_after_retry"] = [
        n for n, p in good.items() if not torch.equal(replica_params(engine, "critic")[n], p)
    ]
    return out


def _oppo_steps(rank, actor, critic, opt, plain_actor, plain_critic, reward, prompts) -> list:
    """Streamed scoring and overcommit (``oppo``) across an optimizer step: the replicas' rollouts, then
    the unsharded models'."""
    engines = [make_engine(m, reward, c, mode="oppo", chunk_size=3) for m, c in
               ((actor, critic), (plain_actor, plain_critic))]  # fmt: skip
    for engine in engines:
        engine.add_prompts(prompts)
    steps = [[summary(e.step()) for e in engines]]
    _train(rank, actor, critic, opt)
    full_actor, full_critic = _full(actor), _full(critic)
    plain_actor.load_state_dict(full_actor)
    plain_critic.load_state_dict(full_critic)
    for engine in engines:
        engine.update_policy()
    steps.append([summary(e.step()) for e in engines])
    return steps


def _failed_sync(engine, actor, critic, opt, rank: int) -> dict:
    """A gather that fails half-way (on every rank alike): no version bump, and no step on the half-synced
    replica until a sync succeeds."""
    out = {}
    _train(rank, actor, critic, opt)
    direct, calls = replica_module._gather_into, [0]

    def failing(dst, src):
        calls[0] += 1
        if calls[0] == 5:
            raise RuntimeError("peer gone")
        return direct(dst, src)

    replica_module._gather_into = failing
    version = engine.policy_version
    try:
        engine.update_policy()
    except RuntimeError as e:
        out["raised"] = str(e)
    finally:
        replica_module._gather_into = direct
    out["version_kept"] = engine.policy_version == version
    try:
        engine.step()
    except RuntimeError as e:
        out["step"] = str(e)
    engine.update_policy()
    out["after_retry"] = _equal_to(engine, "actor", _full(actor))
    return out


def _bf16_copy(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` in bf16 as HF loads it (``dtype=`` at build: the rotary frequencies stay float32, which a
    ``.to(bfloat16)`` of the fp32 model would round)."""
    copy_ = type(model)._from_config(model.config, dtype=torch.bfloat16)
    copy_.load_state_dict(model.state_dict())
    return copy_.eval()


def _peft_refusal() -> str | None:
    """The message refusing a PEFT-wrapped FSDP2 actor (None without peft)."""
    try:
        import peft
    except ImportError:
        return None
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    lora = peft.get_peft_model(make_llama(), config)
    _shard(lora.base_model.model)
    try:
        make_engine(lora, make_reward())
    except ValueError as e:
        return str(e)
    return "accepted"


@pytest.fixture(scope="module")
def fsdp_run() -> list[dict]:
    return run_ranks(_fsdp_scenario, WORLD, timeout_s=400, pg_timeout_s=120)


def assert_same(got: list[tuple], want: list[tuple]) -> None:
    assert [r[:3] for r in got] == [r[:3] for r in want]  # prompts, order and tokens exactly
    for g, w in zip(got, want, strict=True):
        assert g[6:] == w[6:]  # policy versions, deferrals
        torch.testing.assert_close(torch.tensor(g[3]), torch.tensor(w[3]), atol=1e-6, rtol=0)
        assert g[4] == pytest.approx(w[4], abs=1e-6)
        torch.testing.assert_close(torch.tensor(g[5]), torch.tensor(w[5]), atol=1e-6, rtol=0)


def test_fsdp2_models_are_really_sharded_across_the_ranks(fsdp_run):
    for out in fsdp_run:
        assert out["local_numel"] < 0.75 * out["full_numel"]


def test_fsdp2_replica_is_filled_at_construction_bit_for_bit(fsdp_run):
    for out in fsdp_run:
        assert out["at_build"] == []
        # Both gathers ran: straight into the replica (even Shard(0)) and DTensor's (the critic's 1-row head).
        assert out["direct_gathers"][True] > 0 and out["direct_gathers"][False] > 0


def test_fsdp2_rollouts_equal_the_same_weights_unsharded_before_an_optimizer_step(fsdp_run):
    for out in fsdp_run:
        got, want = out["step1"]
        assert len(got) == 2
        assert_same(got, want)


def test_update_policy_gathers_the_trained_weights_bit_for_bit_into_the_same_parameters(fsdp_run):
    for out in fsdp_run:
        assert out["stale_before_update"]  # the step really changed the weights
        assert out["after_update"] == []
        assert out["same_parameter_objects"]


def test_fsdp2_rollouts_equal_unsharded_after_an_optimizer_step_and_retained_ones_continue_as_fresh(fsdp_run):
    for out in fsdp_run:
        assert out["carried"] > 0
        got, plain, fresh = out["step2"]
        assert any(r[7] > 0 for r in got)  # a carried sequence is in the batch
        assert_same(got, plain)
        assert_same(got, fresh)


def test_fsdp2_rollouts_equal_unsharded_in_oppo_mode_across_an_update(fsdp_run):
    for out in fsdp_run:
        for got, want in out["oppo"]:
            assert len(got) == 2
            assert_same(got, want)


def test_release_memory_weights_frees_the_replicas_and_resume_gathers_them_again(fsdp_run):
    for out in fsdp_run:
        assert out["freed"]
        assert "resume() first" in out["step_while_released"]
        assert out["after_resume"] == []
        assert out["same_parameter_objects_after_resume"]
        assert out["step3_released_bytes"] > 0
        got, want = out["step3"]
        assert_same(got, want)


def test_bf16_replicas_of_fp32_weights_equal_a_bf16_copy_of_the_model(fsdp_run):
    for out in fsdp_run:
        assert out["bf16_dtype"] == "torch.bfloat16"
        assert out["bf16_exact"] == []
        got, want = out["bf16_step"]
        assert_same(got, want)


def test_a_sync_failing_half_way_bumps_no_version_and_blocks_steps_until_a_sync_succeeds(fsdp_run):
    for out in fsdp_run:
        failed = out["failed_sync"]
        assert failed["raised"] == "peer gone" and failed["version_kept"]
        assert "not synced" in failed["step"]
        assert failed["after_retry"] == []


def test_weights_failing_validation_on_one_rank_fail_every_rank_before_the_gather(fsdp_run):
    zero, one = (out["mixed"] for out in fsdp_run)
    assert "lack parameter 'score.weight'" in zero["raised"]
    assert "weights given on rank 0 failed validation" in one["raised"]
    for out in (zero, one):
        assert out["version_kept"] and not out["critic_ready"]
        assert out["version_after_retry"] == 1
        assert out["actor_after_retry"] == [] and out["critic_after_retry"] == []


def test_peft_wrapped_fsdp2_actor_is_refused_naming_peft(fsdp_run):
    if fsdp_run[0]["peft"] is None:
        pytest.skip("peft is not installed")
    for out in fsdp_run:
        assert "PEFT" in out["peft"]


# -- one process: meta-device models fed by update_policy(weights=...) ----------------------------------


@pytest.fixture
def meta_pair():
    """(a Llama on the meta device, the same class with real weights)."""
    with torch.device("meta"):
        meta = LlamaForCausalLM(llama_config())
    return meta, make_llama(seed=7)


def test_meta_actor_fed_by_weights_rolls_out_as_the_same_weights_shared(meta_pair):
    meta, real = meta_pair
    reward = make_reward()
    fed = make_engine(meta, reward, mode="sequential")
    with pytest.raises(RuntimeError, match=r"update_policy\(weights=\.\.\.\)"):
        fed.step()
    fed.update_policy(weights=((n, p.detach().clone()) for n, p in real.named_parameters()))  # an iterator
    assert fed.policy_version == 1
    shared = make_engine(real, reward, mode="sequential")
    prompts = random_prompts(4, seed=3)
    for engine in (fed, shared):
        engine.add_prompts(prompts)
    got, want = summary(fed.step()), summary(shared.step())
    assert [r[2] for r in got] == [r[2] for r in want]
    assert [r[3] for r in got] == [r[3] for r in want]


def test_meta_critic_fed_by_critic_weights_gives_the_shared_critics_values(meta_pair):
    meta, real = meta_pair
    critic = make_critic()
    with torch.device("meta"):
        meta_critic = type(critic)(critic.config)
    reward = make_reward()
    fed = make_engine(meta, reward, meta_critic, mode="sequential")
    actor_weights = dict(real.named_parameters())
    with pytest.raises(ValueError, match=r"critic was given on the meta device.*critic_weights=\.\.\."):
        fed.update_policy(weights=actor_weights)
    assert fed.policy_version == 0
    fed.update_policy(weights=actor_weights, critic_weights=dict(critic.named_parameters()))
    shared = make_engine(real, reward, critic, mode="sequential")
    prompts = random_prompts(4, seed=4)
    for engine in (fed, shared):
        engine.add_prompts(prompts)
    got, want = summary(fed.step()), summary(shared.step())
    assert [r[2] for r in got] == [r[2] for r in want]
    assert [r[5] for r in got] == [r[5] for r in want]  # the critic's values


def test_weights_are_cast_to_the_rollout_dtype(meta_pair):
    meta, real = meta_pair
    engine = make_engine(meta, make_reward(), mode="sequential", rollout_dtype=torch.bfloat16)
    weights = dict(real.named_parameters())
    engine.update_policy(weights=weights)
    got = replica_params(engine)
    assert all(torch.equal(got[n], p.detach().to(torch.bfloat16)) for n, p in weights.items())


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda w: w.pop("model.norm.weight"), "lack parameter 'model.norm.weight'"),
        (lambda w: w.update({"model.extra": torch.zeros(1)}), r"weights\['model.extra'\]: no such parameter"),
        (
            lambda w: w.update({"lm_head.weight": torch.zeros(3, 48)}),
            r"'lm_head.weight'\] has shape \(3, 48\)",
        ),
        (lambda w: w.update({"model.norm.weight": torch.empty(48, device="meta")}), "on the meta device"),
        (
            lambda w: w["model.norm.weight"].__setitem__(7, math.nan),
            r"'model.norm.weight'\] holds non-finite",
        ),
    ],
    ids=["missing", "unknown", "shape", "meta", "nan"],
)
def test_bad_weights_raise_naming_the_parameter_and_change_nothing(meta_pair, corrupt, message):
    meta, real = meta_pair
    engine = make_engine(meta, make_reward(), mode="sequential")
    engine.update_policy(weights=dict(real.named_parameters()))
    before = {n: t.clone() for n, t in replica_params(engine).items()}
    weights = {n: torch.randn_like(p) for n, p in real.named_parameters()}
    corrupt(weights)
    with pytest.raises(ValueError, match=message):
        engine.update_policy(weights=weights)
    assert engine.policy_version == 1
    assert all(torch.equal(before[n], t) for n, t in replica_params(engine).items())
    engine.step()  # still ready: the failed call left the replica as it was


def test_an_iterable_with_a_parameter_twice_raises_before_copying_anything(meta_pair):
    meta, real = meta_pair
    engine = make_engine(meta, make_reward(), mode="sequential")
    engine.update_policy(weights=dict(real.named_parameters()))
    before = {n: t.clone() for n, t in replica_params(engine).items()}
    items = [(n, torch.randn_like(p)) for n, p in real.named_parameters()]
    with pytest.raises(ValueError, match="'model.norm.weight'.* given twice"):
        engine.update_policy(weights=iter([*items, ("model.norm.weight", items[-2][1])]))
    assert engine.policy_version == 1
    assert all(torch.equal(before[n], t) for n, t in replica_params(engine).items())


def test_tied_weights_are_given_once_under_the_replicas_name():
    with torch.device("meta"):
        meta = LlamaForCausalLM(llama_config(tie_word_embeddings=True))
    real = make_llama(seed=2, tie_word_embeddings=True)
    engine = make_engine(meta, make_reward(), mode="sequential")
    weights = dict(real.named_parameters(remove_duplicate=False))
    with pytest.raises(ValueError, match="'lm_head.weight'.* is tied to 'model.embed_tokens.weight'"):
        engine.update_policy(weights=weights)
    weights.pop("lm_head.weight")
    engine.update_policy(weights=weights)
    model = engine._replicas.by_role["actor"].model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, real.lm_head.weight)


def test_weights_for_a_shared_model_and_plain_update_for_a_fed_one_raise(meta_pair):
    meta, real = meta_pair
    shared = make_engine(real, make_reward(), mode="sequential")
    with pytest.raises(ValueError, match="weights= was given, but the engine has no replica of its actor"):
        shared.update_policy(weights=dict(real.named_parameters()))
    with pytest.raises(ValueError, match="critic_weights= was given"):
        shared.update_policy(critic_weights={})
    assert shared.policy_version == 0
    fed = make_engine(meta, make_reward(), mode="sequential")
    with pytest.raises(ValueError, match=r"meta device.*update_policy\(weights=\.\.\.\)"):
        fed.update_policy()
    assert fed.policy_version == 0


def test_released_fed_replica_needs_new_weights_before_the_next_step(meta_pair):
    meta, real = meta_pair
    engine = make_engine(meta, make_reward(), mode="sequential")
    weights = dict(real.named_parameters())
    engine.update_policy(weights=weights)
    engine.add_prompts(random_prompts(4, seed=1))
    engine.step()
    engine.release_memory(weights=True)
    assert all(p.untyped_storage().nbytes() == 0 for p in replica_params(engine).values())
    engine.resume()
    with pytest.raises(RuntimeError, match=r"update_policy\(weights=\.\.\.\)"):
        engine.step()
    engine.update_policy(weights=weights)
    assert len(engine.step().rollouts) == 2
    assert all(torch.equal(replica_params(engine)[n], p) for n, p in weights.items())


def _assert_the_plan_counts_the_replica(make, monkeypatch, bytes_per_element: int) -> None:
    """The replica of ``make()``'s engine holds ``bytes_per_element`` per parameter, and the host's KV
    budget (its default share) gives one page fewer when it is the replica plus one page fewer than the
    plan wants: the plan takes the replica's bytes off the share."""
    engine = make()
    replica = engine._replicas.by_role["actor"]
    assert replica.nbytes == sum(p.numel() * bytes_per_element for p in replica.params.values())
    pages, page_bytes = engine.cache_stats().total_pages, engine._page_bytes
    memory = 4 * (replica.nbytes + (pages - 1) * page_bytes)  # a quarter is the default share
    monkeypatch.setattr("oppo_engine.cache.plan.os.sysconf", {"SC_PAGE_SIZE": 1, "SC_PHYS_PAGES": memory}.get)
    assert make().cache_stats().total_pages == pages - 1


def test_memory_plan_counts_the_replica_bytes(meta_pair, monkeypatch):
    meta, _ = meta_pair
    _assert_the_plan_counts_the_replica(
        lambda: make_engine(meta, make_reward(), mode="sequential"), monkeypatch, 4
    )


def test_memory_plan_counts_the_bf16_copy_of_an_unsharded_model(monkeypatch):
    actor = make_llama()
    engine = make_engine(actor, make_reward(), mode="sequential", rollout_dtype=torch.bfloat16)
    assert sum(p.numel() for p in replica_params(engine).values()) == sum(
        p.numel() for p in actor.parameters()
    )
    _assert_the_plan_counts_the_replica(
        lambda: make_engine(actor, make_reward(), mode="sequential", rollout_dtype=torch.bfloat16),
        monkeypatch,
        2,
    )


def test_rollout_dtype_must_be_a_floating_dtype_and_equal_to_the_models_shares_it():
    with pytest.raises(ValueError, match="rollout_dtype must be a floating torch.dtype"):
        EngineConfig(rollout_dtype=torch.int8)
    actor = make_llama()
    engine = make_engine(actor, make_reward(), mode="sequential", rollout_dtype=torch.float32)
    assert engine.actor is actor and engine._replicas.by_role == {}  # zero-copy, as without rollout_dtype


# -- unsharded fp32 models rolled out from a bf16 replica (rollout_dtype) --------------------------------


def _seeded(prompts: list[list[int]], seed: int) -> list[SamplingParams]:
    """Per-prompt sampling with explicit seeds: the same noise whichever engine, and whenever, runs them."""
    return [SamplingParams(temperature=1.0, max_new_tokens=12, seed=seed + i) for i in range(len(prompts))]


def _drained(engine: RolloutEngine) -> list[tuple]:
    """Every rollout of the engine's queued prompts: (prompt, response, log-probs, values), prompt order."""
    out = []
    while rollouts := engine.step().rollouts:
        out.extend((r.prompt_ids, r.response_ids, r.logprobs, r.values) for r in rollouts)
    return sorted(out, key=lambda r: (r[0], r[1]))


def _assert_all_pages_free(engine: RolloutEngine) -> None:
    stats = engine.cache_stats()
    assert stats.free_pages == stats.total_pages and not any(stats.pages_per_model.values()), stats


def _cast_equal(engine: RolloutEngine, role: str, model: torch.nn.Module) -> bool:
    theirs = dict(model.named_parameters())
    return all(torch.equal(p, theirs[n].to(p.dtype)) for n, p in replica_params(engine, role).items())


@pytest.mark.parametrize("mode", ["sequential", "intra", "inter", "oppo"])
def test_a_bf16_replica_of_unsharded_fp32_models_rolls_out_as_a_bf16_copy_of_them(mode):
    actor, critic, reward = make_llama(), make_critic(), make_reward()
    prompts = random_prompts(7, seed=7)  # more prompts than B (2): carried and deferred ones under oppo
    chunk = {"chunk_size": 3} if mode in ("intra", "oppo") else {}
    half = make_engine(actor, reward, critic, mode=mode, rollout_dtype=torch.bfloat16, **chunk)
    want = make_engine(_bf16_copy(actor), reward, _bf16_copy(critic), mode=mode, **chunk)
    assert half.actor is not actor and all(p.dtype == torch.bfloat16 for p in half.actor.parameters())
    assert all(p.dtype == torch.float32 for p in [*actor.parameters(), *critic.parameters()])  # untouched
    assert _cast_equal(half, "actor", actor) and _cast_equal(half, "critic", critic)
    rotary = half.actor.model.rotary_emb.inv_freq  # float32, as HF builds a model loaded in bf16
    assert rotary.dtype == torch.float32 and torch.equal(rotary, actor.model.rotary_emb.inv_freq)
    for engine in (half, want):
        engine.add_prompts(prompts, sampling=_seeded(prompts, 40))
    got = _drained(half)
    assert len(got) == len(prompts) and got == _drained(want)
    _assert_all_pages_free(half)


def _wrap_forward_like_trl(model: torch.nn.Module) -> None:
    """Set ``model.forward`` on the instance to a closure over the model's own bound forward, as TRL's
    ``GRPOTrainer`` does (``trl.trainer.utils.add_fused_lm_head``): a deep copy of the model keeps the
    closure, so its forward runs the source's weights."""
    original = model.forward

    @functools.wraps(type(model).forward)
    def forward(self, *args, **kwargs):
        return original(*args, **kwargs)

    model.forward = types.MethodType(forward, model)


@pytest.mark.parametrize("wrap", ["closure", "trl"])
def test_a_replica_of_a_model_whose_forward_a_trainer_wrapped_rolls_out_its_own_weights(wrap):
    """A model a trainer already patched (a second engine on a model TRL trains, a second training phase):
    its bf16 replica rolls out as a bf16 copy of the weights, never through the fp32 source's forward."""
    actor, reward = make_llama(), make_reward()
    if wrap == "trl":
        utils = pytest.importorskip("trl.trainer.utils")
        utils.add_fused_lm_head(actor)
    else:
        _wrap_forward_like_trl(actor)
    assert "forward" in vars(actor)
    prompts = random_prompts(4, seed=11)
    half = make_engine(actor, reward, mode="sequential", rollout_dtype=torch.bfloat16)
    want = make_engine(_bf16_copy(actor), reward, mode="sequential")
    ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        assert torch.equal(half.actor(input_ids=ids).logits, want.actor(input_ids=ids).logits)
    for engine in (half, want):
        engine.add_prompts(prompts, sampling=_seeded(prompts, 70))
    got = _drained(half)
    assert len(got) == len(prompts) and got == _drained(want)
    _assert_all_pages_free(half)


def test_update_policy_casts_the_trained_weights_into_the_unsharded_replica():
    actor, critic, reward = make_llama(), make_critic(), make_reward()
    prompts = random_prompts(4, seed=8)
    engine = make_engine(actor, reward, critic, mode="oppo", rollout_dtype=torch.bfloat16)
    engine.add_prompts(prompts, sampling=_seeded(prompts, 60))
    before = _drained(engine)
    ids_before = [id(p) for p in replica_params(engine).values()]
    opt = torch.optim.SGD([*actor.parameters(), *critic.parameters()], lr=0.5)
    _train(0, actor, critic, opt)
    assert not _cast_equal(engine, "actor", actor)  # a snapshot: nothing moves before update_policy
    engine.update_policy()
    assert _cast_equal(engine, "actor", actor) and _cast_equal(engine, "critic", critic)
    assert [id(p) for p in replica_params(engine).values()] == ids_before  # copied in place
    want = make_engine(_bf16_copy(actor), reward, _bf16_copy(critic), mode="oppo")
    for e in (engine, want):
        e.add_prompts(prompts, sampling=_seeded(prompts, 60))
    after = _drained(engine)
    assert after == _drained(want)
    assert [r[2] for r in after] != [r[2] for r in before]  # the new weights really roll out
    _assert_all_pages_free(engine)


def test_release_memory_frees_the_unsharded_replica_and_resume_casts_it_again():
    actor = make_llama()
    engine = make_engine(actor, make_reward(), mode="sequential", rollout_dtype=torch.bfloat16)
    with torch.no_grad():
        actor.model.norm.weight.mul_(2.0)  # trained while released: resume() reads the current weights
    engine.release_memory(weights=True)
    assert all(p.untyped_storage().nbytes() == 0 for p in replica_params(engine).values())
    engine.resume()
    assert _cast_equal(engine, "actor", actor)
    engine.add_prompts(random_prompts(2, seed=9))
    assert len(engine.step().rollouts) == 2


def test_weights_for_an_unsharded_replica_are_refused():
    actor = make_llama()
    engine = make_engine(actor, make_reward(), mode="sequential", rollout_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"refreshed from it: update_policy\(\) \(no weights\)"):
        engine.update_policy(weights=dict(actor.named_parameters()))
    assert engine.policy_version == 0


@pytest.mark.parametrize("bad", [math.nan, -math.inf, 3.4e38], ids=["nan", "inf", "finite-fp32-inf-bf16"])
def test_update_policy_refuses_a_non_finite_weight_cast_into_the_unsharded_replica(bad):
    actor = make_llama()
    engine = make_engine(actor, make_reward(), mode="sequential", rollout_dtype=torch.bfloat16)
    good = actor.model.norm.weight[7].item()
    with torch.no_grad():
        actor.model.norm.weight[7] = bad  # 3.4e38 is finite in float32, beyond bfloat16's range
    with pytest.raises(ValueError, match=r"actor: parameter 'model.norm.weight' holds non-finite"):
        engine.update_policy()
    assert engine.policy_version == 0 and not engine._replicas.by_role["actor"].ready
    engine.add_prompts(random_prompts(2, seed=9))
    with pytest.raises(RuntimeError, match="not synced"):
        engine.step()
    with torch.no_grad():
        actor.model.norm.weight[7] = good
    engine.update_policy()
    assert engine.policy_version == 1 and _cast_equal(engine, "actor", actor)
    assert len(engine.step().rollouts) == 2
    engine.release_memory(weights=True)  # resume() casts again, and checks the same way
    with torch.no_grad():
        actor.model.norm.weight[7] = bad
    with pytest.raises(ValueError, match=r"actor: parameter 'model.norm.weight' holds non-finite"):
        engine.resume()
    with torch.no_grad():
        actor.model.norm.weight[7] = good
    engine.resume()
    assert _cast_equal(engine, "actor", actor)
    engine.add_prompts(random_prompts(2, seed=10))
    assert len(engine.step().rollouts) == 2
    _assert_all_pages_free(engine)


def test_a_peft_actor_gets_a_bf16_replica_with_its_adapters():
    peft = pytest.importorskip("peft")
    base = make_llama()
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    actor = peft.get_peft_model(copy.deepcopy(base), config)
    engine = make_engine(actor, make_reward(), mode="sequential", rollout_dtype=torch.bfloat16)
    assert _cast_equal(engine, "actor", actor)
    assert any("lora_A" in n for n in replica_params(engine))
    half = copy.deepcopy(actor)  # the same adapters, every parameter rounded to bf16, buffers as they are
    for p in half.parameters():
        p.data = p.data.to(torch.bfloat16)
    want = make_engine(half, make_reward(), mode="sequential")
    prompts = random_prompts(3, seed=10)
    for e in (engine, want):
        e.add_prompts(prompts, sampling=_seeded(prompts, 70))
    got = _drained(engine)
    assert len(got) == 3 and got == _drained(want)
