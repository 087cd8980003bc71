"""The plan's terms as the project's code has them: each rank's share of a minibatch padded to its own
longest row (``group_by_length`` and packed micro-batches cutting it), the engine's own KV-arena rule
(the twin's arena holds the engine's page count), rule rewards, groups, and ``max_model_len`` honoured."""

from __future__ import annotations

import random

import pytest

from oppo_engine import EngineConfig
from oppo_engine.sim import cost, plan
from oppo_engine.sim.cost import (
    PACK_BUCKET_RATIO,
    dense_pack_pairs,
    pack_attention_pairs,
    roofline,
    training_flops,
)
from oppo_engine.sim.devices import device
from oppo_engine.sim.planner import _setting
from oppo_engine.sim.shapes import model_shape
from oppo_engine.sim.twin import World, rank_slices

H200 = roofline(device("h200"))
SEVEN_B = model_shape("7b")


def test_rank_slices_cut_a_minibatch_as_the_trainer_does():
    # torch.tensor_split: the first len % ranks slices one longer, consecutive
    assert rank_slices(list(range(10)), 4) == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert rank_slices([5], 3) == [[5], [], []]


def test_each_rank_pads_its_own_share_and_the_minibatch_waits_for_the_slowest():
    # one long row on rank 0: only rank 0's share is padded to it
    shares = [[4000, 100, 100, 100], [100] * 4, [100] * 4, [100] * 4]
    got = H200.update([SEVEN_B], [shares], gpus=4, epochs=1)
    alone = H200.update([SEVEN_B], [[shares[0], [], [], []]], gpus=4, epochs=1)
    assert got == pytest.approx(alone)
    compute = training_flops(SEVEN_B, [4000] * 4, 3.0)
    assert compute == training_flops(SEVEN_B, shares[0], 3.0)  # 4 rows of the longest width
    # padding every rank to the global longest row costs the same time: the minibatch waits for the slowest
    # rank, whose share holds that row either way; what cuts it is sorting (group_by_length) or packing
    assert H200.update([SEVEN_B], [[[4000] * 4] * 4], gpus=4, epochs=1) == pytest.approx(got)
    # packed: the real tokens only
    packed = H200.update([SEVEN_B], [shares], gpus=4, epochs=1, packed=True)
    assert packed < got
    assert training_flops(SEVEN_B, shares[0], 3.0, packed=True) == pytest.approx(
        3 * (2 * SEVEN_B.params * 4300 + 4 * SEVEN_B.layers * SEVEN_B.q_width * (4000**2 + 3 * 100**2))
    )


def test_packed_attention_is_priced_as_the_trainers_batched_packs_compute_it():
    """The pairs the twin charges a packed share equal those of the trainer's own packs and buckets
    (``plan_sorted_packs``, ``bucket_lengths``): per bucket, its rows times its longest squared."""
    from oppo_engine.ppo.pack_attention import BUCKET_RATIO, bucket_lengths
    from oppo_engine.ppo.packing import plan_sorted_packs

    assert PACK_BUCKET_RATIO == BUCKET_RATIO
    rng = random.Random(0)
    for _ in range(300):
        budget = rng.choice([64, 100, 512, 2048])
        lengths = [rng.randint(1, budget) for _ in range(rng.randint(1, 24))]
        want = 0
        for pack in plan_sorted_packs(lengths, budget):
            rows = [lengths[i] for i in pack]
            want += sum(len(b) * rows[b[0]] ** 2 for b in bucket_lengths(rows))
        assert pack_attention_pairs(lengths, budget) == want, (lengths, budget)
    # by hand: packs of 100 tokens [60, 25] [20, 20, 9, 5]; buckets [60] [25] | [20, 20] [9, 5]
    assert pack_attention_pairs([5, 60, 20, 9, 25, 20], 100) == 60**2 + 25**2 + 2 * 20**2 + 2 * 9**2
    with pytest.raises(ValueError, match="exceeds max_tokens_per_microbatch=100"):
        pack_attention_pairs([101], 100)
    # each row pays at most 4x its own square, and the update charges these pairs for a budgeted pack
    shares = [[4000, 1900, 1000, 30, 30]]
    pairs = pack_attention_pairs(shares[0], 4096)
    assert sum(w * w for w in shares[0]) < pairs <= 4 * sum(w * w for w in shares[0])
    attention = 4 * SEVEN_B.layers * SEVEN_B.q_width
    assert training_flops(SEVEN_B, shares[0], 3.0, packed=True, budget=4096) - training_flops(
        SEVEN_B, shares[0], 3.0, packed=True
    ) == pytest.approx(3 * attention * (pairs - sum(w * w for w in shares[0])))
    assert H200.update([SEVEN_B], [shares], gpus=1, epochs=1, packed=True, budget=4096) > H200.update(
        [SEVEN_B], [shares], gpus=1, epochs=1, packed=True
    )


def test_with_checkpointing_packs_are_priced_as_the_dense_mask_the_trainer_falls_back_to():
    """With activation checkpointing on, "auto" packs each model for the dense mask (``plan_packs``,
    ``T x T`` a pack): the twin charges those pairs, not the batched buckets'."""
    from oppo_engine.ppo.packing import plan_packs

    rng = random.Random(1)
    for _ in range(300):
        budget = rng.choice([64, 100, 512, 2048])
        lengths = [rng.randint(1, budget) for _ in range(rng.randint(1, 24))]
        want = sum(sum(lengths[i] for i in pack) ** 2 for pack in plan_packs(lengths, budget))
        assert dense_pack_pairs(lengths, budget) == want, (lengths, budget)
    share = [1500, 1200, 900, 700, 600, 400, 300, 200, 150, 100, 60, 30]
    assert dense_pack_pairs(share, 2048) > pack_attention_pairs(share, 2048)
    attention = 4 * SEVEN_B.layers * SEVEN_B.q_width
    gap = dense_pack_pairs(share, 2048) - pack_attention_pairs(share, 2048)
    assert training_flops(SEVEN_B, share, 4.0, True, 2048, dense=True) - training_flops(
        SEVEN_B, share, 4.0, True, 2048
    ) == pytest.approx(4 * attention * gap)
    checkpointed = H200.update(
        [SEVEN_B], [[share]], gpus=1, epochs=1, packed=True, budget=2048, checkpointing=True
    )
    want = H200.update([SEVEN_B], [[share]], gpus=1, epochs=1, packed=True, budget=2048)
    assert checkpointed > want * 4 / 3  # the recomputed forward and the dense pairs


def test_the_twin_prices_its_packs_with_the_plans_budget(monkeypatch):
    """The world's update hands the plan's ``max_tokens_per_microbatch`` to the pricing of its packs."""
    seen = []

    def record(lengths, budget):
        seen.append(budget)
        return sum(w * w for w in lengths)

    monkeypatch.setattr(cost, "pack_attention_pairs", record)
    _world_update(max_tokens=4096)
    assert seen and set(seen) == {4096}


def _world_update(rows=None, **changes):
    setting, _ = _setting(
        "0.5b", "rule", None, None, device="h200", gpus=4, placement="colocated", batch_size=32,
        lengths=[3000] * 8 + [50] * 24, prompt_lengths=16, config=EngineConfig(), reward_curve=None, epochs=1,
        minibatch_size=2, weight_bytes=2, grad_bytes=2, optimizer_bytes=8, checkpointing=False, fsdp=True,
        seed=0, **changes,
    )  # fmt: skip
    world = World(setting, "sequential", steps=1)
    try:
        return world._update_s(rows or [16 + n for n in [3000] * 8 + [50] * 24], [])
    finally:
        world.close()


def test_the_update_prices_the_agreement_forward_over_every_row():
    """``PPOConfig.measure_agreement`` (on by default): one no-grad actor forward over every row before the
    first optimizer step, in sorted chunks of a minibatch's rows (packed: one group in the batch's order),
    each rank its slice: exactly what the update costs more than without it, in ``sequential`` too (no
    stale rows)."""
    rows = sorted(16 + n for n in [3000] * 8 + [50] * 24)
    actor = model_shape("0.5b")
    size = 2 * 4  # minibatch_size x ranks
    chunks = [rank_slices(rows[i : i + size], 4) for i in range(0, len(rows), size)]
    flops = sum(max(training_flops(actor, share, 1.0) for share in chunk) for chunk in chunks)
    extra = _world_update() - _world_update(measure_agreement=False)
    assert extra == pytest.approx(H200.source.training_s(flops))
    # packed: one group in the batch's order, each rank a consecutive slice (two long rows each here;
    # sorted, one rank would hold all eight)
    mixed = [3016, 66, 66, 66] * 8
    packed = _world_update(mixed, max_tokens=4096) - _world_update(
        mixed, max_tokens=4096, measure_agreement=False
    )
    flops = max(training_flops(actor, share, 1.0, True, 4096) for share in rank_slices(mixed, 4))
    assert packed == pytest.approx(H200.source.training_s(flops))
    p = plan("0.5b", reward="rule", device="h100", gpus=2, placement="colocated", batch_size=2, lengths=8,
             prompt_lengths=8, steps=1, modes=("sequential",))  # fmt: skip
    assert p.setting["measure_agreement"] is True


def test_group_by_length_and_packing_cut_the_update_of_a_long_tail():
    padded = _world_update()
    assert _world_update(group_by_length=True) < padded
    assert _world_update(max_tokens=4096) < padded


def test_the_twins_arena_holds_the_engines_page_count_and_preempts_where_the_engine_would():
    kw = dict(device="h200", gpus=8, placement="colocated", batch_size=256, prompt_lengths=512,
              lengths="lognormal:median=3000,sigma=0.8,cap=16384", config=EngineConfig(), reward_curve=None,
              epochs=1, minibatch_size=4, weight_bytes=2, grad_bytes=2, optimizer_bytes=8,
              checkpointing=False, fsdp=True, seed=0)  # fmt: skip
    setting, memory = _setting("7b", "rule", None, "7b", **kw)
    capacity = device("h200").memory
    free = capacity - memory.per_gpu["weights"]
    page_bytes = memory.per_gpu["kv"] // memory.arena_pages
    assert memory.arena_pages == int(free * 0.4) // page_bytes  # cache/plan.py: 40% of the free memory
    assert memory.preempts and memory.arena_pages < memory.pages_wanted
    world = World(setting, "sequential", steps=1)
    try:
        assert world.target_pages == memory.arena_pages == setting.arena_pages
    finally:
        world.close()


def test_a_rule_reward_prices_no_model_and_groups_multiply_the_rollouts():
    p = plan("0.5b", reward="rule", device="h100", gpus=2, placement="colocated", batch_size=2, group_size=4,
             lengths="uniform:low=8,high=32", prompt_lengths=8, steps=2, modes=("sequential",))  # fmt: skip
    assert set(p.setting["models"]) == {"actor"}
    assert p.setting["reward"] == "rule" and p.setting["group_size"] == 4
    with_model = plan("0.5b", device="h100", gpus=2, placement="colocated", batch_size=2, group_size=4,
                      lengths="uniform:low=8,high=32", prompt_lengths=8, steps=2,
                      modes=("sequential",))  # fmt: skip
    shape = model_shape("0.5b", head="score")
    assert with_model.memory_per_gpu["weights"] - p.memory_per_gpu["weights"] == shape.weight_bytes
    setting, _ = _setting(
        "0.5b", "rule", None, None, device="h100", gpus=2, placement="colocated", batch_size=2,
        lengths="uniform:low=8,high=32", prompt_lengths=8, config=EngineConfig(), reward_curve=None,
        epochs=1, minibatch_size=2, weight_bytes=2, grad_bytes=2, optimizer_bytes=8, checkpointing=False,
        fsdp=True, seed=0, group_size=4,
    )  # fmt: skip
    world = World(setting, "sequential", steps=2)
    try:
        record = world.run(1)[0]
        assert len(record.rows) == 2 * 4  # prompts x samples
    finally:
        world.close()


def test_max_model_len_is_honoured_and_a_cap_beyond_it_is_refused():
    with pytest.raises(
        ValueError, match="max_model_len=1024 is below the prompt cap 512 plus the response cap 1000"
    ):
        plan("0.5b", device="h100", gpus=2, batch_size=2, lengths="fixed:value=1000", prompt_lengths=512,
             steps=1, config=EngineConfig(max_model_len=1024), modes=("sequential",))  # fmt: skip
    p = plan("0.5b", device="h100", gpus=2, batch_size=2, lengths=64, prompt_lengths=16, steps=1,
             config=EngineConfig(max_model_len=2048), modes=("sequential",))  # fmt: skip
    assert p.setting["max_model_len"] == 2048


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_a_bad_group_size_is_refused(bad):
    with pytest.raises(ValueError, match="group_size must be an int >= 1"):
        plan(
            "0.5b", device="h100", gpus=2, batch_size=2, lengths=8, prompt_lengths=8, steps=1, group_size=bad
        )


def test_a_profile_too_small_to_price_a_shape_is_refused_naming_it():
    from oppo_engine.sim.cost import HostCosts
    from oppo_engine.sim.profile import Profile, ThreadCosts

    gemm = {kn: [(1, 2e9), (16, 2e10), (256, 5e10)] for kn in (16384, 1048576)}
    costs = ThreadCosts(gemm, 1e10, 1e-4, 2e-5, 1e-10, 1e-11, 1e-9, 1e-9, 0.05)
    profile = Profile("cpu:test", "cpu", {1: costs}, HostCosts(2e-5, 3e-6, 5e-6), 5e9, cores=2)
    with pytest.raises(ValueError, match=r"timed projections of K x N up to 1,048,576 .* the actor model"):
        plan("7b", reward="rule", device=profile, gpus=1, placement="cpu", batch_size=2, lengths=8,
             prompt_lengths=8, steps=1)  # fmt: skip


def test_with_nothing_to_stream_intra_is_sequential_and_oppo_is_inter():
    kw = dict(reward="rule", device="h100", gpus=2, placement="colocated", batch_size=2, group_size=2,
              lengths="uniform:low=8,high=40", prompt_lengths=8, steps=3, sweep=(16,))  # fmt: skip
    p = plan("0.5b", modes=("intra", "oppo"), **kw)
    full = plan("0.5b", modes=("sequential", "inter"), **kw)
    assert p.modes["intra"].s_per_step == full.modes["sequential"].s_per_step
    assert p.modes["oppo"].s_per_step == full.modes["inter"].s_per_step
    assert p.modes["oppo"].chunk_chosen == "off"
