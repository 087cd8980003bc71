"""The PPO trainer on N data-parallel ranks (gloo, spawned processes): K PPO steps on 2 ranks with an FSDP2
actor and critic give the per-step losses, gradient norms and final weights of 1 rank over the same global
batch; the prompt stream is dealt rank-major with world-invariant seeds; bad set-ups are refused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from oppo_engine.ppo import ranks as distributed
from oppo_engine.sched.prompts import derive_seed
from tests.distributed import run_ranks
from tests.engine_models import EOS, VOCAB, make_actor, make_reward, random_prompts

STEPS = 3
BATCH, MINIBATCH = 4, 2  # per rank; the one-rank run has world_size times both


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t1"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=f"t{EOS}",
        pad_token="t0",
    )


def _models():
    actor = make_actor(0).train()
    reference = make_actor(0).requires_grad_(False)
    reward = make_reward(1).requires_grad_(False)
    critic = make_reward(2).train()
    return actor, critic, reference, reward


def _trainer(
    world_size: int, group, models, mode: str = "sequential", lr: float = 1e-3, pack_attention: str = "auto"
):
    """``mode`` is the engine's; ``mode+N``: packed updates, packs of at most ``N`` tokens."""
    from oppo_engine.ppo import PPOConfig, PPOTrainer, engine_config_for

    mode, _, packed = mode.partition("+")
    cfg = PPOConfig(
        max_tokens_per_microbatch=int(packed) if packed else None,
        pack_attention=pack_attention,
        batch_size=BATCH * world_size if group is None else BATCH,
        minibatch_size=MINIBATCH * world_size if group is None else MINIBATCH,
        epochs=2,
        lr=lr,
        critic_lr=1e-3,
        max_new_tokens=8,
        seed=5,
    )
    engine_cfg = engine_config_for(cfg, mode=mode, max_model_len=64)
    return PPOTrainer(*models, _tokenizer(), random_prompts(13, seed=3), cfg, engine_cfg, process_group=group)


def _full_weights(model) -> dict[str, list]:
    """Every parameter in full (collective for a sharded model), as nested lists: a tensor's storage would
    not outlive the rank that sends it."""
    return {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().tolist()
        for name, p in model.named_parameters()
    }


def _record(stats) -> list[list[float]]:
    fields = ("reward", "kl", "policy_loss", "value_loss", "clipfrac", "approx_kl", "grad_norm")
    fields += ("stale_tokens",)
    gap = [[s.agreement[c].tokens for c in ("fresh", "carried_current", "stale")] for s in stats]
    return [[float(getattr(s, f)) for f in fields] + g for s, g in zip(stats, gap, strict=True)]


def _ppo_rank(rank: int, world_size: int, modes: tuple[str, ...]):
    """Each mode's PPO run on this rank, on fresh models sharded over the world."""
    import torch.distributed as dist

    group = dist.group.WORLD
    with pytest.raises(ValueError, match="FSDP2-sharded"):  # data parallelism without FSDP is refused
        _trainer(world_size, group, _models())
    out = {}
    for mode in modes:
        models = _models()
        distributed.shard_model(models[0])  # over the world
        distributed.shard_model(models[1])
        with pytest.raises(ValueError, match="ranks differ in config"):  # raised on every rank, no hang
            _trainer(world_size, group, models, mode, lr=1e-3 * (1 + rank))
        # In oppo mode the exchanges run on a group of their own over the same ranks, as GPU ranks do
        # (FSDP on NCCL, the trainer and engines on gloo).
        exchanges = group if mode == "sequential" else dist.new_group(backend="gloo")
        trainer = _trainer(world_size, exchanges, models, mode)
        stats = trainer.train(STEPS)
        local = [sorted((r.prompt_ids, r.response_ids) for r in s.rollout.rollouts) for s in stats]
        out[mode] = _record(stats), local, _full_weights(trainer.actor), _full_weights(trainer.critic)
        trainer.close()
    return out


LEAK = "max_tokens_per_microbatch: the actor's attention crosses the boundary (rank 1's dense probe)"


def _dense_verdict_rank(rank: int, world_size: int, modes: tuple[str, ...]) -> dict:
    """Rank 1's dense probe refuses the actor, rank 0's passes it (each after the probe's forwards, which
    are collective): under ``pack_attention="dense"`` the build, under ``"auto"`` the build and then the
    dense fallback once activation checkpointing is turned on, on every rank."""

    from oppo_engine.ppo import trainer as trainer_module

    real = trainer_module.check_packing

    def check_packing(model, role, probe, forward):
        real(model, role, probe, forward)
        if rank == 1 and role == "actor":
            raise ValueError(LEAK)

    trainer_module.check_packing = check_packing

    def later(trainer, models):
        refusals = dict(trainer._dense_refusal)
        models[0].gradient_checkpointing_enable()
        try:
            return ("built", refusals, ("modes", trainer._pack_attention_modes()))
        except ValueError as e:
            return ("built", refusals, ("refused", str(e)))

    return _build_each(world_size, modes, later)


def _build_each(world_size: int, modes: tuple[str, ...], record) -> dict:
    """Per ``pack_attention`` of ``modes``: a sharded packed trainer built on every rank, and
    ``record(trainer, models)`` of it (then closed), or ``("refused at build", message)``."""
    import torch.distributed as dist

    out = {}
    for pack_attention in modes:
        models = _models()
        distributed.shard_model(models[0])
        distributed.shard_model(models[1])
        try:
            trainer = _trainer(
                world_size, dist.group.WORLD, models, "sequential+20", pack_attention=pack_attention
            )
        except ValueError as e:
            out[pack_attention] = ("refused at build", str(e))
            continue
        out[pack_attention] = record(trainer, models)
        trainer.close()
    return out


@pytest.fixture(scope="module")
def dense_verdicts():
    return run_ranks(_dense_verdict_rank, 2, ("dense", "auto"), timeout_s=240, pg_timeout_s=45)


def test_a_dense_refusal_on_one_rank_refuses_on_every_rank_at_build(dense_verdicts):
    """``pack_attention="dense"``: one rank's dense probe refuses the actor; every rank raises the same
    ``ValueError`` naming it (a rank raising alone used to leave the others in the next probe's collective
    until the group's timeout)."""
    assert [r["dense"] for r in dense_verdicts] == [("refused at build", LEAK)] * 2


def test_a_dense_refusal_on_one_rank_is_every_ranks_fallback_refusal(dense_verdicts):
    """``pack_attention="auto"``: the actor is batched everywhere, and every rank records rank 1's dense
    refusal, so once activation checkpointing puts the actor on the dense mask, every rank refuses it (one
    rank refusing alone would leave the others in the update's next collective)."""
    outcomes = [r["auto"] for r in dense_verdicts]
    assert outcomes[0] == outcomes[1]
    built, refusals, (later, message) = outcomes[0]
    assert built == "built" and refusals == {"actor": LEAK}
    assert later == "refused" and "turned activation checkpointing on" in message and LEAK in message


BATCHED_LEAK = "pack_attention='batched' cannot run the actor: rank 1's batched probe"


def _batched_verdict_rank(rank: int, world_size: int, modes: tuple[str, ...]) -> dict:
    """Rank 1's batched probe refuses the actor, rank 0's passes it (each after the probe's forwards):
    under ``pack_attention="batched"`` the build fails on every rank with rank 1's reason; under ``"auto"``
    every rank runs the actor's packs dense."""

    from oppo_engine.ppo import trainer as trainer_module

    real = trainer_module.check_batched_packing

    def check_batched_packing(model, role, probe, forward, longest):
        real(model, role, probe, forward, longest)
        if rank == 1 and role == "actor":
            raise ValueError(BATCHED_LEAK)

    trainer_module.check_batched_packing = check_batched_packing

    def record(trainer, models):
        return ("built", dict(trainer._batched_refusal), trainer._pack_attention_modes())

    return _build_each(world_size, modes, record)


def test_a_batched_refusal_on_one_rank_is_every_ranks():
    """One rank's batched probe refuses the actor: under ``"batched"`` every rank raises that refusal at
    build, under ``"auto"`` every rank runs the actor's packs dense (the ranks used to raise "the ranks
    differ", a ValueError naming no feature, in both)."""
    outcomes = run_ranks(_batched_verdict_rank, 2, ("batched", "auto"), timeout_s=240, pg_timeout_s=45)
    assert [r["batched"] for r in outcomes] == [("refused at build", BATCHED_LEAK)] * 2
    assert outcomes[0]["auto"] == outcomes[1]["auto"]
    built, refusals, modes = outcomes[0]["auto"]
    assert built == "built" and refusals == {"actor": BATCHED_LEAK, "critic": ""}
    assert modes == {"actor": False, "critic": True}


CRASH = "the probe's forward crashed on rank 1"


def _probe_crash_rank(rank: int, world_size: int, which: str) -> tuple:
    """Rank 1's dense (or batched) probe raises an error that is not a refusal, after the probe's forwards:
    what each rank raises, and how long its build took."""
    import time

    import torch.distributed as dist

    from oppo_engine.ppo import trainer as trainer_module

    name = "check_packing" if which == "dense" else "check_batched_packing"
    real = getattr(trainer_module, name)

    def probe(model, role, *args):
        real(model, role, *args)
        if rank == 1 and role == "actor":
            raise RuntimeError(CRASH)

    setattr(trainer_module, name, probe)
    models = _models()
    distributed.shard_model(models[0])
    distributed.shard_model(models[1])
    t0 = time.monotonic()
    try:
        trainer = _trainer(world_size, dist.group.WORLD, models, "sequential+20", pack_attention=which)
    except RuntimeError as e:
        return type(e).__name__, str(e), time.monotonic() - t0
    trainer.close()
    return "built", "", time.monotonic() - t0


@pytest.mark.parametrize("which", ["dense", "batched"])
def test_a_probe_crash_on_one_rank_raises_on_every_rank_without_waiting(which: str):
    """A probe's error that is not a refusal (here a RuntimeError on rank 1, after the probe's collective
    forwards) reaches every rank through the probes' agreement: rank 1 raises its own error, rank 0 an
    error naming rank 1's, both long before the group's 45 s timeout. Before, rank 0 was left in the
    agreement's all-gather: here it got gloo's "Connection closed by peer" once rank 1's process ended, and
    where that rank lives on (a script that catches the error) it waits out the timeout."""
    outcomes = run_ranks(_probe_crash_rank, 2, which, timeout_s=240, pg_timeout_s=45)
    (kind0, message0, seconds0), (kind1, message1, seconds1) = outcomes
    assert (kind1, message1) == ("RuntimeError", CRASH)
    assert kind0 == "RuntimeError" and "rank 1 of the group failed" in message0 and CRASH in message0
    assert max(seconds0, seconds1) < 30, (seconds0, seconds1)


def test_a_probe_failure_is_shared_unless_the_group_is_broken():
    """A probe's own error goes through the agreement; a collective's failure is raised at once (the group
    is broken, and the agreement's all-gather would only wait on it); without a group the error is raised
    as itself."""
    import torch.distributed as dist

    from oppo_engine.ppo import ranks

    assert ranks.shared_failure(RuntimeError("out of memory"))
    assert not ranks.shared_failure(dist.DistBackendError("peer gone"))
    crash = RuntimeError(CRASH)
    with pytest.raises(RuntimeError) as raised:
        ranks.refusals_on_any_rank({"actor": ""}, None, crash)
    assert raised.value is crash
    assert ranks.refusals_on_any_rank({"actor": "no", "critic": ""}, None) == {"actor": "no", "critic": ""}


@pytest.fixture(scope="module")
def two_ranks():
    """One 2-rank job for every test here (spawning ranks costs more than their PPO steps)."""
    return run_ranks(_ppo_rank, 2, ("sequential", "oppo", "sequential+20"), timeout_s=400, pg_timeout_s=120)


def _one_rank(mode: str):
    models = _models()
    trainer = _trainer(2, None, models, mode)
    stats = trainer.train(STEPS)
    batches = [sorted((r.prompt_ids, r.response_ids) for r in s.rollout.rollouts) for s in stats]
    out = _record(stats), batches, _full_weights(trainer.actor), _full_weights(trainer.critic)
    trainer.close()
    return out


def test_prompt_stream_is_dealt_rank_major_with_world_invariant_seeds():
    prompts = [[i + 4] for i in range(7)]
    block = 3
    ranks = [distributed.rank_prompts(prompts, rank=r, world_size=2, block=block) for r in range(2)]
    one = distributed.rank_prompts(prompts, rank=0, world_size=1, block=2 * block)
    for _ in range(5):  # each step: rank 0's block, then rank 1's, is the one-rank step's block
        dealt = [next(it) for it in ranks for _ in range(block)]
        assert dealt == [next(one) for _ in range(2 * block)]
    # One rank: the global index is the engine's own prompt index, so its derived seeds are unchanged.
    alone = distributed.rank_prompts(prompts, rank=0, world_size=1, block=4)
    assert [next(alone)[0] for _ in range(9)] == list(range(9))
    assert distributed.prompt_seed(5, 11) == derive_seed(5, 11)


@pytest.mark.parametrize("update", ["sequential", "sequential+20"])
def test_ppo_on_two_ranks_equals_one_rank_over_the_global_batch(two_ranks, update):
    """Padded updates, or packed ones on the 2 ranks (packs of at most 20 tokens: one or two per rank's
    share of a minibatch, so the ranks run unequal counts and pad them with weight-0 fillers), against the
    padded update of one rank."""
    one_stats, one_batches, one_actor, one_critic = _one_rank("sequential")
    rank0, rank1 = (r[update] for r in two_ranks)
    (stats0, local0, actor0, critic0), (stats1, local1, actor1, critic1) = rank0, rank1
    # Each rank rolled out its own half of every global batch; together, the one-rank batch.
    for step in range(STEPS):
        assert len(local0[step]) == len(local1[step]) == BATCH
        assert sorted(local0[step] + local1[step]) == one_batches[step]
        assert not set(map(str, local0[step])) & set(map(str, local1[step]))
    # Every rank reports the global numbers: the one rank's, to 1e-4.
    torch.testing.assert_close(torch.tensor(stats0), torch.tensor(stats1), rtol=0, atol=1e-6)
    torch.testing.assert_close(torch.tensor(stats0), torch.tensor(one_stats), rtol=1e-4, atol=1e-4)
    for got, want in ((actor0, one_actor), (actor1, one_actor), (critic0, one_critic), (critic1, one_critic)):
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(
                torch.tensor(got[name]), torch.tensor(want[name]), rtol=1e-4, atol=1e-4, msg=name
            )
    # The run is not vacuous: the policy moved, and the losses are not zero.
    initial = _full_weights(make_actor(0))
    moved = max(float((torch.tensor(one_actor[n]) - torch.tensor(initial[n])).abs().max()) for n in initial)
    assert moved > 1e-3
    assert all(abs(s[2]) > 0 and s[6] > 0 for s in one_stats)


def test_ppo_on_two_ranks_runs_under_overcommit_with_stale_tokens(two_ranks):
    """In ``oppo`` mode each rank returns its first B finished and carries the rest, so old log-probs of
    stale tokens are recomputed by sharded forwards split over the ranks: every rank runs as many (no
    hang), and both report the same global numbers."""
    (stats0, *_), (stats1, *_) = (r["oppo"] for r in two_ranks)
    torch.testing.assert_close(torch.tensor(stats0), torch.tensor(stats1), rtol=0, atol=1e-6)
    assert sum(s[7] for s in stats0) > 0  # the recompute ran


def test_demo_on_two_ranks_trains_and_only_rank_0_prints_and_writes(tmp_path):
    """``oppo-engine demo --nproc 2`` launches ``torchrun ... demo --fsdp``: both ranks train (gloo, FSDP2),
    one table is printed and one set of files written."""
    for name, model in (("actor", make_actor(0)), ("reward", make_reward(1))):
        model.save_pretrained(tmp_path / name)
        _tokenizer().save_pretrained(tmp_path / name)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "oppo_engine.cli", "demo", "--task", "polite", "--nproc", "2", "--steps",
           "2", "--modes", "sequential,oppo", "--batch-size", "2", "--max-new-tokens", "8", "--device", "cpu",
           "--actor", str(tmp_path / "actor"), "--reward", str(tmp_path / "reward"),
           "--out", str(out)]  # fmt: skip
    pipe = subprocess.PIPE
    proc = subprocess.Popen(cmd, stdout=pipe, stderr=pipe, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=300)
    finally:  # nothing may outlive the test: the launcher and its ranks share one session
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, stderr[-4000:]
    assert stdout.count("time to reward: threshold") == 1  # the table, from rank 0 alone
    assert "in all on 2 ranks" in stdout
    records = json.loads((out / "records.json").read_text())
    assert [len(records[m]["records"]) for m in ("sequential", "oppo")] == [2, 2]
    files = ["table.txt", "records.json", "reward.png", "control.png", "agreement.png"]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        files + ["trace_sequential.json", "trace_oppo.json"]
    )
