"""bench/bench_update.py: each arm runs the configuration it names, whichever arm ran before it."""

import itertools
from types import SimpleNamespace

from bench import bench_update
from oppo_engine.ppo import PPOConfig


def test_each_arm_configures_the_trainer_as_named_whatever_ran_before():
    trainer = SimpleNamespace(config=PPOConfig())
    expected = {
        "padded": (False, None, "auto"),
        "grouped": (True, None, "auto"),
        "packed": (False, 528, "dense"),
        "packed-batched": (False, 528, "batched"),
    }
    assert expected.keys() == bench_update.ARMS.keys()
    for before, arm in itertools.product(bench_update.ARMS, repeat=2):
        bench_update._configure(trainer, before, 528)
        bench_update._configure(trainer, arm, 528)
        config = trainer.config
        got = (config.group_by_length, config.max_tokens_per_microbatch, config.pack_attention)
        assert got == expected[arm], (before, arm)


def test_one_packed_arm_per_budget_and_the_others_once():
    assert bench_update.expand_arms(["padded", "packed"], None) == [
        ("padded", "padded", None),
        ("packed", "packed", None),
    ]
    assert bench_update.expand_arms(["packed", "grouped", "packed-batched"], [528, 2048]) == [
        ("packed@528", "packed", 528),
        ("packed@2048", "packed", 2048),
        ("grouped", "grouped", None),
        ("packed-batched@528", "packed-batched", 528),
        ("packed-batched@2048", "packed-batched", 2048),
    ]


def test_the_multiply_add_model_counts_padded_rows_and_dense_pack_masks():
    """Two rows of 3 and 1 tokens: padded, 2 x 3 positions and 2 x 3 x 3 attended pairs; one pack of 4
    tokens, 4 positions and a dense 4 x 4 mask, or (batched) 4 positions and two buckets (1 is under half
    of 3) of 3 x 3 and 1 x 1 pairs; each 6 grad forwards' worth (actor and critic, 3x) plus the agreement
    forward."""
    import pytest
    import torch

    batch = SimpleNamespace(attention_mask=torch.tensor([[1, 1, 1], [1, 0, 0]]))
    gemm, pair = 3_538_944, 2 * 576
    got = bench_update.layer_macs(batch, [4])
    assert got["padded"]["gmac"] * 1e9 == pytest.approx(7 * (6 * gemm + 18 * pair), rel=1e-12)
    assert got["packed@4"]["gmac"] * 1e9 == pytest.approx(7 * (4 * gemm + 16 * pair), rel=1e-12)
    assert got["packed-batched@4"]["gmac"] * 1e9 == pytest.approx(7 * (4 * gemm + 10 * pair), rel=1e-12)
    assert {got[arm]["forwards"] for arm in ("padded", "packed@4", "packed-batched@4")} == {1}
