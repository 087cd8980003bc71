"""The reference PPO trainer on the engine: exactness across modes, alignment with the engine's streamed
numbers, off-policy handling, rising reward on the embedded task, bad input, and the demo end to end."""

import json
import math
import statistics

import pytest
import torch

from oppo_engine import EngineConfig
from oppo_engine.ppo import PPOConfig, PPOTrainer, engine_config_for
from oppo_engine.ppo.batch import canonical_order, collate
from oppo_engine.ppo.core import token_logprobs, token_values
from oppo_engine.ppo.demo import _prompts
from oppo_engine.ppo.models import load_models
from oppo_engine.ppo.task import build_task


@pytest.fixture(scope="session")
def task_dir(tmp_path_factory):
    """The embedded task, built once (with the demo's defaults, so the demo test finds it cached)."""
    return build_task(tmp_path_factory.mktemp("demo_task"), log=lambda _: None)


def _trainer(task_dir, mode="sequential", seed=0, **cfg_kwargs):
    torch.manual_seed(seed)
    m = load_models(task_dir / "actor", task_dir / "reward")
    cfg = PPOConfig(
        **{
            "batch_size": 8,
            "minibatch_size": 4,
            "lr": 2e-4,
            "critic_lr": 2e-4,
            "max_new_tokens": 32,
            **cfg_kwargs,
        }
    )
    return PPOTrainer(
        m.actor,
        m.critic,
        m.reference,
        m.reward,
        m.tokenizer,
        _prompts(m.tokenizer),
        cfg,
        engine_config_for(cfg, mode=mode, max_model_len=128),
    )


def _numbers(stats):
    return [(s.reward, s.kl, s.policy_loss, s.value_loss) for s in stats]


def test_intra_ppo_steps_equal_sequential(task_dir):
    runs = {}
    for mode in ("sequential", "intra"):
        trainer = _trainer(task_dir, mode)
        runs[mode] = _numbers(trainer.train(3))
        trainer.close()
    seq, intra = torch.tensor(runs["sequential"]), torch.tensor(runs["intra"])
    # Scores and values are streamed in chunks in intra mode: equal up to float rounding, not bit for bit.
    torch.testing.assert_close(intra, seq, rtol=1e-3, atol=1e-4)
    assert len({round(r, 6) for r, *_ in runs["sequential"]}) > 1  # the policy did move between steps


def test_release_memory_around_the_update_changes_nothing(task_dir):
    results = []
    for release in (False, True):
        trainer = _trainer(task_dir, release_memory=release)
        results.append(_numbers(trainer.train(2)))
        assert trainer.engine.policy_version == 2
        trainer.close()
    assert results[0] == results[1]


def test_engine_streamed_numbers_align_with_the_trainers_forward(task_dir):
    """The behaviour log-probs, reference log-probs and critic values the engine streams sit in the columns
    where the trainer's own forwards put them: the PPO ratio starts at 1."""
    trainer = _trainer(task_dir, "intra")
    batch = collate(canonical_order(trainer.engine.step().rollouts), trainer.tokenizer.pad_token_id, "cpu")
    with torch.no_grad():
        ours = token_logprobs(trainer.actor, batch.input_ids, batch.attention_mask, 1.0)
        ref = token_logprobs(trainer.reference, batch.input_ids, batch.attention_mask, 1.0)
        values = token_values(trainer.critic, batch.input_ids, batch.attention_mask)
    m = batch.mask > 0
    assert m.sum() > 8 * 2
    torch.testing.assert_close(ours[m], batch.logprobs[m], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ref[m], batch.ref_logprobs[m], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(values[m], batch.values[m], rtol=1e-4, atol=1e-4)
    trainer.close()


@pytest.mark.parametrize("off_policy", ["recompute", "truncated_is"])
def test_stale_tokens_old_logprobs(task_dir, off_policy):
    """Tokens sampled before the last policy update: recomputed with the current actor by default, kept as
    sampled under truncated importance weights; tokens of the current policy are always kept."""
    trainer = _trainer(task_dir, off_policy=off_policy)
    batch = collate(canonical_order(trainer.engine.step().rollouts), trainer.tokenizer.pad_token_id, "cpu")
    with torch.no_grad():
        for p in trainer.actor.parameters():
            p.add_(0.05 * torch.randn_like(p))
    trainer.engine.update_policy()
    batch.versions[: len(batch) // 2] = trainer.engine.policy_version  # the first half: current policy
    old = trainer.old_logprobs(batch)
    with torch.no_grad():
        current = token_logprobs(trainer.actor, batch.input_ids, batch.attention_mask, 1.0)
    m = batch.mask > 0
    fresh, stale = m.clone(), m.clone()
    fresh[len(batch) // 2 :] = False
    stale[: len(batch) // 2] = False
    assert torch.equal(old[fresh], batch.logprobs[fresh])
    assert (current[stale] - batch.logprobs[stale]).abs().max() > 1e-2  # the perturbation shows
    if off_policy == "recompute":
        torch.testing.assert_close(old[stale], current[stale])
    else:
        assert torch.equal(old[stale], batch.logprobs[stale])
    trainer.close()


def test_reward_rises_on_the_embedded_task(task_dir):
    """20 steps of B=16 from the warmed-up actor: the mean reward of the last 4 steps beats the first 4 by
    at least 0.5 (the reward model separates polite from other answers by about 3). Measured over
    ``PPOConfig.seed`` 0-4: a rise of 1.03-1.79 after 20 steps. After 12 it was 0.05-1.06, and which side of
    0.5 the default seed fell on changed with the machine (the trajectory follows every rounding)."""
    trainer = _trainer(task_dir, batch_size=16, minibatch_size=8, max_new_tokens=48)
    rewards = [s.reward for s in trainer.train(20)]
    trainer.close()
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert last > first + 0.5, rewards


def test_bad_input_is_refused_before_any_work(task_dir):
    m = load_models(task_dir / "actor", task_dir / "reward")
    prompts = _prompts(m.tokenizer)
    cfg = PPOConfig(batch_size=8, minibatch_size=4, max_new_tokens=16)
    before = [p.clone() for p in m.actor.parameters()]

    small = load_models(task_dir / "actor", task_dir / "reward")
    small.actor.resize_token_embeddings(len(m.tokenizer) - 4)
    with pytest.raises(ValueError, match="tokenizer has .* tokens but the actor's vocabulary"):
        PPOTrainer(small.actor, m.critic, m.reference, m.reward, m.tokenizer, prompts, cfg)

    two_labels = load_models(task_dir / "actor", task_dir / "reward").reward
    two_labels.config.num_labels = 2
    two_labels.score = torch.nn.Linear(two_labels.config.hidden_size, 2, bias=False)
    with pytest.raises(ValueError, match="reward must be a sequence-classification model with one label"):
        PPOTrainer(m.actor, m.critic, m.reference, two_labels, m.tokenizer, prompts, cfg)

    too_big = PPOConfig(batch_size=64, minibatch_size=8, max_new_tokens=16)
    # 48 pages of 16 tokens x (2 layers x K,V x 2 KV heads x 16 dims x 4 bytes): one sequence of 32 tokens
    # needs 8 pages in the four models together, a batch of 64 at least 64.
    cramped = EngineConfig(batch_size=64, max_model_len=32, kv_cache_bytes=48 * 16 * 2 * 2 * 2 * 16 * 4)
    with pytest.raises(ValueError, match="batch_size=64"):
        PPOTrainer(m.actor, m.critic, m.reference, m.reward, m.tokenizer, prompts, too_big, cramped)

    with pytest.raises(ValueError, match="engine_config.batch_size=16 differs"):
        PPOTrainer(
            m.actor, m.critic, m.reference, m.reward, m.tokenizer, prompts, cfg, EngineConfig(batch_size=16)
        )
    assert all(torch.equal(a, b) for a, b in zip(before, m.actor.parameters(), strict=True))


def test_demo_writes_table_plots_and_traces(task_dir, tmp_path, capsys):
    from oppo_engine.cli import main

    out = tmp_path / "out"
    rc = main(
        [
            "demo",
            "--task",
            "polite",
            "--steps",
            "2",
            "--modes",
            "sequential,intra,oppo",
            "--out",
            str(out),
            "--cache",
            str(task_dir),
            "--batch-size",
            "4",
            "--max-new-tokens",
            "24",
        ]
    )
    assert rc == 0
    table = (out / "table.txt").read_text()
    header = next(line for line in table.splitlines() if "|" in line)
    assert all(mode in header for mode in ("sequential", "intra", "oppo"))
    rows = ("time to reward", "s/step (PPO step)", "s/step (rollout)", "rollout share", "exposed scoring",
            "mean overcommit", "chunk size chosen", "stale tokens/step", "length bias",
            "speed-up vs sequential")  # fmt: skip
    for row in rows:
        assert row in table
    assert "building the demo task" not in capsys.readouterr().out  # the cache was used
    for png in ("reward.png", "control.png", "agreement.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    records = json.loads((out / "records.json").read_text())
    assert set(records) == {"sequential", "intra", "oppo"}
    for rec in records["oppo"]["records"]:  # every token class of the step's gap, by name
        assert set(rec["agreement"]) == {"fresh", "carried_current", "stale"}
        assert rec["agreement"]["fresh"]["mean_abs"] == rec["agreement_mean_abs"]
        assert rec["truncated_sampling"] is False
    keys = {"time_to_reward_s", "threshold", "s_per_step", "rollout_s_per_step", "final_reward", "records"}
    for mode, rec in records.items():
        assert set(rec) == keys
        assert len(rec["records"]) == 2
        assert rec["threshold"] == records["sequential"]["threshold"]  # one threshold for every mode
        assert rec["s_per_step"] == pytest.approx(sum(r["step_s"] for r in rec["records"]) / 2)
        trace = json.loads((out / f"trace_{mode}.json").read_text())
        assert {e["tid"] for e in trace["traceEvents"] if e.get("ph") == "X"}  # lanes with spans


def test_demo_runs_on_models_given_by_path(task_dir, tmp_path):
    """``--actor PATH --reward PATH``: any local causal LM with its tokenizer and one-label reward model."""
    from oppo_engine.cli import main

    out = tmp_path / "out"
    args = ["demo", "--task", "polite", "--steps", "1", "--modes", "sequential", "--out", str(out),
            "--batch-size", "2", "--max-new-tokens", "8", "--actor", str(task_dir / "actor"), "--reward",
            str(task_dir / "reward"), "--cache", str(tmp_path / "unused")]  # fmt: skip
    assert main(args) == 0
    assert "sequential" in (out / "table.txt").read_text()
    assert not (tmp_path / "unused").exists()


@pytest.mark.parametrize("off_policy", ["recompute", "truncated_is"])
def test_overcommit_feeds_the_trainer_stale_tokens_it_handles(task_dir, off_policy):
    """In oppo mode with Δ=4, carried sequences come back with tokens of an older policy; the trainer
    counts them and its update stays finite under either correction."""
    torch.manual_seed(0)
    m = load_models(task_dir / "actor", task_dir / "reward")
    cfg = PPOConfig(batch_size=8, minibatch_size=4, lr=2e-4, critic_lr=2e-4, max_new_tokens=32,
                    off_policy=off_policy)  # fmt: skip
    trainer = PPOTrainer(m.actor, m.critic, m.reference, m.reward, m.tokenizer, _prompts(m.tokenizer), cfg,
                         engine_config_for(cfg, mode="oppo", overcommit=4, max_model_len=128))  # fmt: skip
    stats = trainer.train(4)
    trainer.close()
    assert sum(s.stale_tokens for s in stats) > 0
    for s in stats:
        versions = [v for r in s.rollout.rollouts for v in r.policy_versions]
        assert s.stale_tokens == sum(v < s.step - 1 for v in versions)
        assert all(torch.isfinite(torch.tensor([s.policy_loss, s.value_loss, s.kl])))


def test_the_trainer_logs_quarantined_rollouts_and_trains_without_them(task_dir, caplog):
    import logging
    import math

    trainer = _trainer(task_dir, "intra")
    scorer = trainer.engine._loop.scorer_lane.scheds["reward"].scorer
    prefill = scorer.prefill

    def failing_prefill(chunks):  # the reward model cannot read sequence 3, whatever it is batched with
        if any(c.seq_id == 3 for c in chunks):
            raise RuntimeError("reward model fell over on this sequence")
        return prefill(chunks)

    scorer.prefill = failing_prefill
    with caplog.at_level(logging.WARNING, logger="oppo_engine.ppo.trainer"):
        stats = trainer.step()
    assert len(stats.rollout.failed) == 1 and len(stats.rollout.rollouts) == 7
    assert "reward model fell over" in caplog.text and "left out" in caplog.text
    assert all(math.isfinite(v) for v in (stats.reward, stats.kl, stats.policy_loss, stats.value_loss))
    assert trainer.engine.policy_version == 1  # the update ran
    trainer.close()


def test_oppo_reward_curve_matches_sequential_on_the_same_seeds(task_dir):
    """Convergence parity (the paper's claim: the step-to-reward curves coincide). The same seeds, 8 PPO
    steps of B=8: the mean reward of the last K=4 steps of ``oppo`` (Δ=4, at most 2 deferrals) and of
    ``sequential`` differ by less than the margin.

    How the margin is chosen: three standard errors of the difference of two independent last-K means,
    ``3 · sd · sqrt(2 / (K · B))``, with ``sd`` the spread of sequential's per-rollout rewards in this very
    run (about 1.5 on this reward model: 3.2 between polite and other answers). The runs share seeds, so
    they are not independent and the bound is conservative; a systematic bias of the overcommitted batches
    (rewards of carried sequences mixed up, a length bias that moves the reward) beyond the sampling noise
    fails it. ``sequential``'s own last-K means over seeds 0-2 spread by about the same amount.
    """
    steps, k, b = 8, 4, 8
    curves, spread = {}, None
    for mode, extra in (("sequential", {}), ("oppo", {"overcommit": 4, "max_deferrals": 2})):
        torch.manual_seed(0)
        m = load_models(task_dir / "actor", task_dir / "reward")
        cfg = PPOConfig(batch_size=b, minibatch_size=4, lr=2e-4, critic_lr=2e-4, max_new_tokens=48)
        engine_cfg = engine_config_for(cfg, mode=mode, max_model_len=128, **extra)
        prompts = _prompts(m.tokenizer)
        trainer = PPOTrainer(m.actor, m.critic, m.reference, m.reward, m.tokenizer, prompts, cfg, engine_cfg)
        stats = trainer.train(steps)
        trainer.close()
        curves[mode] = [s.reward for s in stats]
        if mode == "sequential":
            spread = statistics.stdev(r.reward for s in stats for r in s.rollout.rollouts)
    margin = 3 * spread * math.sqrt(2 / (k * b))
    seq, oppo = statistics.fmean(curves["sequential"][-k:]), statistics.fmean(curves["oppo"][-k:])
    assert abs(oppo - seq) < margin, (curves, margin)
